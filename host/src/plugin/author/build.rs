//! `piper plugin build [DIR]`: build the plugin in DIR for its language
//! (detected from its files) into `DIR/build/NAME.wasm`.
//!
//! - Rust (`Cargo.toml`): `cargo build --release --target wasm32-wasip2`.
//! - Python (`app.py`): `componentize-py` with the `piper_strategy` module.
//! - JavaScript (`app.js`): `@bytecodealliance/componentize-js` through its
//!   JS API (a small Node script; the package comes from `npm install` in DIR).
//! - C (`*.c`): the bindings from wit-bindgen's C generator and the component
//!   encoding with the WASI reactor adapter run inside this binary, so a C
//!   author needs only clang and wasi-libc.
//!
//! A missing toolchain is named with the exact command that installs it.

use super::{embedded, io, write, AuthorError, Lang};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What a build produced.
#[derive(Debug, Clone)]
pub struct Built {
    pub lang: Lang,
    pub component: PathBuf,
}

/// Which language the plugin in `dir` is written in.
pub fn detect(dir: &Path) -> Result<Lang, AuthorError> {
    if dir.join("Cargo.toml").is_file() {
        return Ok(Lang::Rust);
    }
    if dir.join("app.py").is_file() {
        return Ok(Lang::Python);
    }
    if dir.join("app.js").is_file() {
        return Ok(Lang::Js);
    }
    if !c_sources(dir)?.is_empty() {
        return Ok(Lang::C);
    }
    Err(AuthorError::UnknownLang { dir: dir.into() })
}

/// Build the plugin in `dir`; the component goes to `out` (default
/// `DIR/build/NAME.wasm`).
pub fn build(dir: &Path, out: Option<&Path>) -> Result<Built, AuthorError> {
    if !dir.is_dir() {
        return Err(AuthorError::Invalid(format!(
            "{} is not a folder (give the plugin's folder; `piper plugin new` makes one)",
            dir.display()
        )));
    }
    let dir = dir.canonicalize().map_err(io("cannot resolve", dir))?;
    let lang = detect(&dir)?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "plugin".into());
    let work = dir.join("build");
    std::fs::create_dir_all(&work).map_err(io("cannot create", &work))?;
    let component = match out {
        Some(p) => p.to_path_buf(),
        None => work.join(format!("{name}.wasm")),
    };
    let wit = wit_dir(&dir, &work)?;
    match lang {
        Lang::Rust => rust(&dir, &component)?,
        Lang::Python => python(&dir, &work, &wit, &component)?,
        Lang::Js => js(&dir, &work, &wit, &component)?,
        Lang::C => c(&dir, &work, &wit, &component)?,
    }
    Ok(Built { lang, component })
}

/// The WIT to build against: the folder's own `wit/` (what `piper plugin
/// new` wrote), else the one this host speaks.
fn wit_dir(dir: &Path, work: &Path) -> Result<PathBuf, AuthorError> {
    let own = dir.join("wit");
    if own.join("strategy.wit").is_file() {
        return Ok(own);
    }
    let w = work.join("wit");
    write(&w.join("strategy.wit"), embedded::WIT.as_bytes())?;
    Ok(w)
}

fn c_sources(dir: &Path) -> Result<Vec<PathBuf>, AuthorError> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io("cannot read", dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "c") && p.is_file())
        .collect();
    v.sort();
    Ok(v)
}

/// Whether `program --version` runs.
fn runs(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// What to run, in order, before `piper plugin build DIR` works for a new
/// `lang` plugin in `dir` on this machine, and that command last: the
/// toolchain's install line when it is missing, `npm install` in a
/// JavaScript folder that has no componentize-js yet.
pub fn next_steps(lang: Lang, dir: &Path) -> Vec<String> {
    let mut steps = Vec::new();
    match lang {
        Lang::Rust => {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            if !runs(&cargo) {
                steps.push("curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh".into());
            }
            if !runs(&cargo) || !rust_target_installed() {
                steps.push("rustup target add wasm32-wasip2".into());
            }
        }
        Lang::Python => {
            if !runs("componentize-py") {
                steps.push(format!(
                    "pip install componentize-py=={}",
                    embedded::COMPONENTIZE_PY
                ));
            }
        }
        Lang::Js => {
            if !runs("node") {
                steps.push(
                    "apt-get install nodejs npm   (or https://nodejs.org, version 20 or newer)"
                        .into(),
                );
            }
            if !dir
                .join("node_modules/@bytecodealliance/componentize-js")
                .is_dir()
            {
                steps.push(format!("(cd {} && npm install)", dir.display()));
            }
        }
        Lang::C => {
            if find_clang().is_none() {
                steps.push(C_INSTALL.into());
            }
        }
    }
    steps.push(format!("piper plugin build {}", dir.display()));
    steps
}

/// A command as a user would type it.
fn shown(cmd: &Command) -> String {
    format!(
        "{} {}",
        cmd.get_program().to_string_lossy(),
        cmd.get_args()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// Run a command; a failure carries its output (the last 8 KiB).
fn run(cmd: &mut Command) -> Result<std::process::Output, AuthorError> {
    let shown = shown(cmd);
    run_as(cmd, shown, true)
}

/// [`run`], naming the command `shown` in a failure, with the tool's
/// standard output in it or not (cargo's is its JSON messages: its rendered
/// diagnostics are on standard error).
fn run_as(
    cmd: &mut Command,
    shown: String,
    with_stdout: bool,
) -> Result<std::process::Output, AuthorError> {
    let out = cmd.output().map_err(|e| AuthorError::Failed {
        cmd: shown.clone(),
        status: "could not start".into(),
        output: e.to_string(),
    })?;
    if !out.status.success() {
        let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
        if with_stdout {
            text.push_str(&String::from_utf8_lossy(&out.stdout));
        }
        if text.len() > 8192 {
            let mut cut = text.len() - 8192;
            while !text.is_char_boundary(cut) {
                cut += 1;
            }
            text = format!("...{}", &text[cut..]);
        }
        return Err(AuthorError::Failed {
            cmd: shown,
            status: out.status.to_string(),
            output: text.trim_end().to_string(),
        });
    }
    Ok(out)
}

fn rust(dir: &Path, component: &Path) -> Result<(), AuthorError> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    if !runs(&cargo) {
        return Err(AuthorError::MissingTool {
            lang: "Rust",
            tool: "cargo".into(),
            install: "curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh".into(),
        });
    }
    if !rust_target_installed() {
        return Err(AuthorError::MissingTool {
            lang: "Rust",
            tool: "the wasm32-wasip2 target".into(),
            install: "rustup target add wasm32-wasip2".into(),
        });
    }
    // Built with cargo's JSON messages (to find the artifact), quiet (no
    // progress lines); a failure shows the compiler's rendered diagnostics
    // and the plain command.
    let mut plain = Command::new(&cargo);
    plain
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(dir.join("Cargo.toml"));
    let reproduce = shown(&plain);
    let out = run_as(
        Command::new(&cargo)
            .current_dir(dir)
            .args(["build", "--quiet", "--release", "--target", "wasm32-wasip2"])
            .args([
                "--message-format",
                "json-render-diagnostics",
                "--manifest-path",
            ])
            .arg(dir.join("Cargo.toml")),
        reproduce,
        false,
    )?;
    // The cdylib of the package in `dir`, from cargo's artifact messages.
    let manifest = dir.join("Cargo.toml");
    let mut wasm = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact"
            || v["manifest_path"].as_str().map(Path::new) != Some(manifest.as_path())
        {
            continue;
        }
        if let Some(files) = v["filenames"].as_array() {
            wasm = files
                .iter()
                .filter_map(|f| f.as_str())
                .find(|f| f.ends_with(".wasm"))
                .map(PathBuf::from)
                .or(wasm);
        }
    }
    let wasm = wasm.ok_or_else(|| {
        AuthorError::Invalid(format!(
            "cargo built no .wasm for {}: its [lib] needs crate-type = [\"cdylib\"]",
            manifest.display()
        ))
    })?;
    if let Some(parent) = component.parent() {
        std::fs::create_dir_all(parent).map_err(io("cannot create", parent))?;
    }
    std::fs::copy(&wasm, component).map_err(io("cannot copy the component to", component))?;
    Ok(())
}

/// Whether the toolchain cargo uses has the wasm32-wasip2 standard library.
fn rust_target_installed() -> bool {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .is_some_and(|root| root.join("lib/rustlib/wasm32-wasip2/lib").is_dir())
}

fn python(dir: &Path, work: &Path, wit: &Path, component: &Path) -> Result<(), AuthorError> {
    if !runs("componentize-py") {
        return Err(AuthorError::MissingTool {
            lang: "Python",
            tool: "componentize-py".into(),
            install: format!("pip install componentize-py=={}", embedded::COMPONENTIZE_PY),
        });
    }
    let sdk = work.join("sdk");
    write(
        &sdk.join("piper_strategy.py"),
        embedded::PYTHON_SDK.as_bytes(),
    )?;
    run(Command::new("componentize-py")
        .current_dir(dir)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .arg("--wit-path")
        .arg(wit)
        .args(["--world", "strategy", "componentize", "--python-path"])
        .arg(dir)
        .arg("--python-path")
        .arg(&sdk)
        .arg("app")
        .arg("-o")
        .arg(component))?;
    Ok(())
}

/// The Node script that calls componentize-js's API.
const COMPONENTIZE_MJS: &str = r#"import { componentize } from '@bytecodealliance/componentize-js';
import { writeFile } from 'node:fs/promises';
const [source, wit, out] = process.argv.slice(2);
const { component } = await componentize({
  sourcePath: source,
  witPath: wit,
  worldName: 'strategy',
  // The host grants no network and a stopped clock: leave those out.
  disableFeatures: ['http', 'fetch-event', 'clocks', 'random'],
});
await writeFile(out, component);
"#;

fn js(dir: &Path, work: &Path, wit: &Path, component: &Path) -> Result<(), AuthorError> {
    if !runs("node") {
        return Err(AuthorError::MissingTool {
            lang: "JavaScript",
            tool: "node".into(),
            install: "apt-get install nodejs npm   (or https://nodejs.org, version 20 or newer)"
                .into(),
        });
    }
    // Node resolves the packages from the script's folder upwards.
    let install = || {
        AuthorError::MissingTool {
        lang: "JavaScript",
        tool: "@bytecodealliance/componentize-js".into(),
        install: format!(
            "cd {} && npm install --save-dev @bytecodealliance/componentize-js@{} @bytecodealliance/preview2-shim@{}",
            dir.display(),
            embedded::COMPONENTIZE_JS,
            embedded::PREVIEW2_SHIM
        ),
    }
    };
    for package in ["componentize-js", "preview2-shim"] {
        let found = dir.ancestors().any(|a| {
            a.join("node_modules/@bytecodealliance")
                .join(package)
                .join("package.json")
                .is_file()
        });
        if !found {
            return Err(install());
        }
    }
    // The author's modules and the SDK side by side, so `./piper_strategy.js` resolves.
    let src = work.join("src");
    if src.exists() {
        std::fs::remove_dir_all(&src).map_err(io("cannot clean", &src))?;
    }
    for entry in std::fs::read_dir(dir).map_err(io("cannot read", dir))? {
        let p = entry.map_err(io("cannot read", dir))?.path();
        if p.is_file() && p.extension().is_some_and(|e| e == "js" || e == "mjs") {
            let to = src.join(p.file_name().unwrap_or_default());
            let text = std::fs::read(&p).map_err(io("cannot read", &p))?;
            write(&to, &text)?;
        }
    }
    write(&src.join("piper_strategy.js"), embedded::JS_SDK.as_bytes())?;
    let script = work.join("componentize.mjs");
    write(&script, COMPONENTIZE_MJS.as_bytes())?;
    if let Some(parent) = component.parent() {
        std::fs::create_dir_all(parent).map_err(io("cannot create", parent))?;
    }
    match run(Command::new("node")
        .current_dir(dir)
        .arg(&script)
        .arg(src.join("app.js"))
        .arg(wit)
        .arg(component))
    {
        Err(AuthorError::Failed { output, .. })
            if output.contains("ERR_MODULE_NOT_FOUND")
                && output.contains("Cannot find package '@bytecodealliance/") =>
        {
            Err(install())
        }
        r => r.map(|_| ()),
    }
}

/// Compilers tried in order (`$CC` first when it names a clang).
fn find_clang() -> Option<String> {
    let mut candidates: Vec<String> = std::env::var("CC")
        .ok()
        .filter(|c| c.contains("clang"))
        .into_iter()
        .collect();
    candidates.push("clang".into());
    candidates.extend((14..=22).rev().map(|v| format!("clang-{v}")));
    candidates.into_iter().find(|c| runs(c))
}

const C_INSTALL: &str = "apt-get install clang-19 lld-19 libclang-rt-19-dev-wasm32 wasi-libc";

fn c(dir: &Path, work: &Path, wit: &Path, component: &Path) -> Result<(), AuthorError> {
    let clang = find_clang().ok_or_else(|| AuthorError::MissingTool {
        lang: "C",
        tool: "clang".into(),
        install: C_INSTALL.into(),
    })?;
    // 1. Bindings: wit-bindgen's C generator.
    let gen = work.join("gen");
    let mut resolve = wit_parser::Resolve::default();
    let (pkg, _) = resolve
        .push_dir(wit)
        .map_err(|e| AuthorError::Encode(format!("{e:#}")))?;
    let world = resolve
        .select_world(&[pkg], Some("strategy"))
        .map_err(|e| AuthorError::Encode(format!("{e:#}")))?;
    let opts = wit_bindgen_c::Opts {
        autodrop_borrows: wit_bindgen_c::Enabled::Yes,
        ..Default::default()
    };
    let mut files = wit_bindgen_core::Files::default();
    opts.build()
        .generate(&mut resolve, world, &mut files)
        .map_err(|e| AuthorError::Encode(format!("{e:#}")))?;
    let mut objects = Vec::new();
    for (name, bytes) in files.iter() {
        let p = gen.join(name);
        write(&p, bytes)?;
        if name.ends_with(".c") || name.ends_with(".o") {
            objects.push(p);
        }
    }
    write(&gen.join("piper_strategy.h"), embedded::C_SDK_H.as_bytes())?;
    write(&gen.join("piper_strategy.c"), embedded::C_SDK_C.as_bytes())?;
    objects.push(gen.join("piper_strategy.c"));
    // 2. A core module: a WASI preview-1 reactor.
    let core = work.join("core.wasm");
    let compiled = run(Command::new(&clang)
        .current_dir(dir)
        .args([
            "--target=wasm32-wasi",
            "-mexec-model=reactor",
            "-O2",
            "-Wall",
        ])
        .arg("-I")
        .arg(&gen)
        .arg("-I")
        .arg(dir)
        .args(c_sources(dir)?)
        .args(&objects)
        .arg("-o")
        .arg(&core));
    if let Err(AuthorError::Failed { output, .. }) = &compiled {
        let missing_libc = [
            "stdlib.h' file not found",
            "stdbool.h' file not found",
            "crt1-reactor.o",
            "unable to find library -lc",
        ]
        .iter()
        .any(|m| output.contains(m));
        let missing_rt = output.contains("libclang_rt.builtins-wasm32.a");
        let missing_ld = output.contains("wasm-ld") && output.contains("No such file");
        if missing_libc || missing_rt || missing_ld {
            return Err(AuthorError::MissingTool {
                lang: "C",
                tool: format!(
                    "{} for {clang}",
                    if missing_libc {
                        "wasi-libc"
                    } else if missing_rt {
                        "the wasm32 compiler runtime"
                    } else {
                        "wasm-ld (lld)"
                    }
                ),
                install: C_INSTALL.into(),
            });
        }
    }
    compiled?;
    // 3. The component: the core module plus the WASI reactor adapter.
    let bytes = std::fs::read(&core).map_err(io("cannot read", &core))?;
    let encoded = wit_component::ComponentEncoder::default()
        .module(&bytes)
        .and_then(|e| {
            e.adapter(
                "wasi_snapshot_preview1",
                wasi_preview1_component_adapter_provider::WASI_SNAPSHOT_PREVIEW1_REACTOR_ADAPTER,
            )
        })
        .and_then(|e| e.validate(true).encode())
        .map_err(|e| AuthorError::Encode(format!("{e:#}")))?;
    write(component, &encoded)
}
