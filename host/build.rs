//! Builds the bundled strategy plugins (and the test plugins) for
//! `wasm32-wasip2` with a nested cargo in its own target directory, and embeds
//! the bundled ones in the `piper` binary, so `piper` finds every bundled strategy
//! by name wherever it runs.
//!
//! A missing `wasm32-wasip2` target is installed with rustup (as
//! cargo-component does), with a cargo warning saying so; without rustup the
//! build stops with one message naming what is missing and the fix.
//!
//! Set `PIPER_PLUGINS_WASM_DIR` to a directory of prebuilt `*.wasm` files to
//! skip the nested build (packaging, offline builds).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The target strategy plugins build for.
const WASM_TARGET: &str = "wasm32-wasip2";

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
    ("zbv", "piper-plugin-zbv", "piper_plugin_zbv"),
    (
        "interleaved-zb",
        "piper-plugin-interleaved-zb",
        "piper_plugin_interleaved_zb",
    ),
    ("ep", "piper-plugin-ep", "piper_plugin_ep"),
    ("tp", "piper-plugin-tp", "piper_plugin_tp"),
    ("cp", "piper-plugin-cp", "piper_plugin_cp"),
    (
        "recompute",
        "piper-plugin-recompute",
        "piper_plugin_recompute",
    ),
];
/// Built for tests, not bundled.
const TESTING: &[&str] = &[
    "piper-testing-hostile",
    "piper-testing-wrong-version",
    "piper-testing-extra-import",
    "piper-testing-wit-0-1",
    "piper-testing-wit-0-2",
    "piper-testing-wit-0-3",
];

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            // One clean error line per message (cargo prints it as
            // `error: piper@…: …`), no panic, no backtrace.
            for line in message.lines() {
                println!("cargo::error={line}");
            }
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let manifest = PathBuf::from(env("CARGO_MANIFEST_DIR")?);
    let root = manifest
        .parent()
        .ok_or("the host crate has no parent directory")?
        .to_path_buf();
    for dir in ["wit", "sdk", "plugins", "tests/plugins"] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }
    println!("cargo:rerun-if-env-changed=PIPER_PLUGINS_WASM_DIR");
    let out = PathBuf::from(env("OUT_DIR")?);

    let wasm_dir = match std::env::var_os("PIPER_PLUGINS_WASM_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            ensure_wasm_target()?;
            build_plugins(&root)?
        }
    };
    println!(
        "cargo:rustc-env=PIPER_PLUGINS_WASM_DIR={}",
        wasm_dir.display()
    );

    let mut src = String::from("/// Bundled strategies: (name, component bytes).\npub const BUNDLED: &[(&str, &[u8])] = &[\n");
    for (name, _, stem) in BUNDLED {
        let file = wasm_dir.join(format!("{stem}.wasm"));
        if !file.exists() {
            return Err(format!(
                "bundled plugin `{name}` was not built: {} is missing",
                file.display()
            ));
        }
        src.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            file.display().to_string()
        ));
    }
    src.push_str("];\n");
    std::fs::write(out.join("bundled.rs"), src)
        .map_err(|e| format!("writing {}: {e}", out.join("bundled.rs").display()))
}

fn env(key: &str) -> Result<String, String> {
    std::env::var(key).map_err(|_| format!("cargo did not set {key} for the build script"))
}

/// The toolchain's sysroot, from the rustc cargo builds with.
fn sysroot() -> Result<PathBuf, String> {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let out = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .map_err(|e| format!("running `{rustc} --print sysroot`: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "`{rustc} --print sysroot` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(PathBuf::from(
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    ))
}

fn has_target(sysroot: &Path) -> bool {
    sysroot
        .join("lib/rustlib")
        .join(WASM_TARGET)
        .join("lib")
        .is_dir()
}

/// `rustup` on `PATH`, if any.
fn find_rustup() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("rustup"))
        .find(|p| p.is_file())
}

/// Make sure the toolchain can build for `wasm32-wasip2`: present, or
/// installed now with rustup, or one clear error.
fn ensure_wasm_target() -> Result<(), String> {
    let sysroot = sysroot()?;
    if has_target(&sysroot) {
        return Ok(());
    }
    let fix = format!(
        "the bundled strategy plugins build for the WebAssembly target `{WASM_TARGET}`, which the Rust toolchain at {} does not have",
        sysroot.display()
    );
    let Some(rustup) = find_rustup() else {
        return Err(format!(
            "{fix}, and rustup is not on PATH to add it: run `rustup target add {WASM_TARGET}` (or install the target's standard library for this toolchain), or set PIPER_PLUGINS_WASM_DIR to a directory of prebuilt plugins"
        ));
    };
    // Install into the toolchain cargo runs with: rustup keeps toolchains
    // in `…/toolchains/<name>`; elsewhere RUSTUP_TOOLCHAIN (inherited) decides.
    let toolchain = sysroot
        .parent()
        .filter(|p| p.file_name().is_some_and(|n| n == "toolchains"))
        .and(sysroot.file_name())
        .map(|n| n.to_string_lossy().into_owned());
    let mut cmd = Command::new(&rustup);
    cmd.args(["target", "add", WASM_TARGET]);
    if let Some(t) = &toolchain {
        cmd.args(["--toolchain", t]);
    }
    let out = cmd
        .output()
        .map_err(|e| format!("{fix}; running {} failed: {e}", rustup.display()))?;
    if !out.status.success() || !has_target(&sysroot) {
        return Err(format!(
            "{fix}; `rustup target add {WASM_TARGET}` did not install it:\n{}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // Past tense: cargo replays a build script's warnings on later builds.
    println!(
        "cargo::warning=the WebAssembly target `{WASM_TARGET}` the strategy plugins build for was missing; installed it (rustup target add {WASM_TARGET}{})",
        toolchain
            .as_deref()
            .map(|t| format!(" --toolchain {t}"))
            .unwrap_or_default()
    );
    Ok(())
}

fn build_plugins(root: &Path) -> Result<PathBuf, String> {
    let target_dir = root.join("target").join("plugins");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args([
            "build",
            "--release",
            "--target",
            WASM_TARGET,
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
    let output = cmd
        .output()
        .map_err(|e| format!("running cargo to build the plugins: {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        // The compiler's own errors, without cargo's progress lines.
        let errors: Vec<&str> = stderr
            .lines()
            .filter(|l| !l.trim_start().starts_with("Compiling "))
            .collect();
        return Err(format!(
            "building the bundled strategy plugins failed:\n{}",
            errors.join("\n")
        ));
    }
    Ok(target_dir.join(WASM_TARGET).join("release"))
}
