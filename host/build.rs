//! Builds the bundled strategy plugins (and the test plugins) for
//! `wasm32-wasip2` with a nested cargo in its own target directory, and embeds
//! the bundled ones in the `piper` binary, so `piper` finds every bundled strategy
//! by name wherever it runs.
//!
//! Set `PIPER_PLUGINS_WASM_DIR` to a directory of prebuilt `*.wasm` files to
//! skip the nested build (packaging, offline builds).

use std::path::{Path, PathBuf};
use std::process::Command;

/// (bundled name, package, wasm file stem)
const BUNDLED: &[(&str, &str, &str)] = &[
    ("dp", "piper-plugin-dp", "piper_plugin_dp"),
    ("gpipe", "piper-plugin-gpipe", "piper_plugin_gpipe"),
    ("1f1b", "piper-plugin-1f1b", "piper_plugin_1f1b"),
    ("zero", "piper-plugin-zero", "piper_plugin_zero"),
    (
        "interleaved-1f1b",
        "piper-plugin-interleaved-1f1b",
        "piper_plugin_interleaved_1f1b",
    ),
    ("zb-h1", "piper-plugin-zb-h1", "piper_plugin_zb_h1"),
    (
        "dualpipev",
        "piper-plugin-dualpipev",
        "piper_plugin_dualpipev",
    ),
    ("dualpipe", "piper-plugin-dualpipe", "piper_plugin_dualpipe"),
];
/// Built for tests, not bundled.
const TESTING: &[&str] = &[
    "piper-testing-hostile",
    "piper-testing-wrong-version",
    "piper-testing-extra-import",
];

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().unwrap().to_path_buf();
    for dir in ["wit", "sdk", "plugins", "tests/plugins"] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    println!("cargo:rerun-if-env-changed=PIPER_PLUGINS_WASM_DIR");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());

    let wasm_dir = match std::env::var_os("PIPER_PLUGINS_WASM_DIR") {
        Some(d) => PathBuf::from(d),
        None => build_plugins(&root),
    };
    println!(
        "cargo:rustc-env=PIPER_PLUGINS_WASM_DIR={}",
        wasm_dir.display()
    );

    let mut src = String::from("/// Bundled strategies: (name, component bytes).\npub const BUNDLED: &[(&str, &[u8])] = &[\n");
    for (name, _, stem) in BUNDLED {
        let file = wasm_dir.join(format!("{stem}.wasm"));
        if !file.exists() {
            panic!(
                "bundled plugin `{name}` was not built: {} is missing",
                file.display()
            );
        }
        src.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            file.display().to_string()
        ));
    }
    src.push_str("];\n");
    std::fs::write(out.join("bundled.rs"), src).unwrap();
}

fn build_plugins(root: &Path) -> PathBuf {
    let target_dir = root.join("target").join("plugins");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--target-dir",
        ])
        .arg(&target_dir);
    for (_, pkg, _) in BUNDLED {
        cmd.args(["-p", pkg]);
    }
    for pkg in TESTING {
        cmd.args(["-p", pkg]);
    }
    // The outer build's settings are for the host, not for wasm guests.
    for var in [
        "CARGO_ENCODED_RUSTFLAGS",
        "RUSTFLAGS",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CLIPPY_ARGS",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_MAKEFLAGS",
        "MAKEFLAGS",
        "MFLAGS",
        "PROFILE",
        "OPT_LEVEL",
        "DEBUG",
        "TARGET",
        "HOST",
    ] {
        cmd.env_remove(var);
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("CARGO_CFG_")
            || k.starts_with("CARGO_FEATURE_")
            || k.starts_with("CARGO_PROFILE_")
        {
            cmd.env_remove(k);
        }
    }
    let output = cmd.output().expect("run cargo to build the plugins");
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let hint = if stderr.contains("wasm32-wasip2") && stderr.contains("target") {
            "\nhint: install the plugin target with `rustup target add wasm32-wasip2`"
        } else {
            ""
        };
        panic!("building the bundled strategy plugins failed:\n{stderr}{hint}");
    }
    target_dir.join("wasm32-wasip2").join("release")
}
