//! Strategies in Python, JavaScript and C beside Rust: the examples under
//! `examples/plugins/` build with `piper plugin build` and give the same plan
//! as the bundled Rust `1f1b`; errors and endless loops in a guest reach the
//! user with the plugin's name; `piper plugin new` skeletons build and plan
//! from a folder outside the repository; `piper plugin check` reports what the
//! host sees; a missing toolchain is named with its install command.
//!
//! The guest toolchains come from `scripts/test.sh` (componentize-py in a venv
//! under `target/`, componentize-js under `examples/plugins/js`) and, for C,
//! from the system (clang with wasi-libc). A language whose toolchain is
//! missing is reported as not run (`scripts/test.sh` lists it; under CI, a
//! failure).

use piper::compile::compile;
use piper::dag::{Cluster, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::author::{self, AuthorError, Lang};
use piper::plugin::{Plugin, PluginHost, SandboxLimits};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// Scratch space kept between runs (compile cache, build outputs).
fn scratch() -> PathBuf {
    let d = repo().join("target/guest-tests");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A fresh folder outside the repository.
fn outside(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("piper-lang-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The plugin host of the tests that load plugins in this process. Its
/// compile cache is the one `piper` keeps under the tests' `PIPER_HOME`
/// (`piper()`), so a guest compiled here is not compiled again there.
fn host() -> &'static PluginHost {
    static HOST: OnceLock<PluginHost> = OnceLock::new();
    HOST.get_or_init(|| {
        let cache = scratch().join("home/compiled");
        PluginHost::new(SandboxLimits::default(), Some(cache)).unwrap()
    })
}

/// Whether `lang`'s toolchain is here; when it is not, reported as not run.
fn available(lang: Lang, what: &str) -> bool {
    let ok = match lang {
        Lang::Rust => true,
        Lang::Python => runs("componentize-py"),
        Lang::Js => {
            runs("node")
                && js_modules()
                    .join("@bytecodealliance/componentize-js")
                    .is_dir()
        }
        Lang::C => (14..=22)
            .map(|v| format!("clang-{v}"))
            .chain(["clang".to_string()])
            .any(|c| runs(&c)),
    };
    if !ok {
        piper::test_support::not_run(
            &format!("languages ({})", lang.title()),
            &format!(
                "{what}: its toolchain is missing (scripts/test.sh installs Python's and JavaScript's; C needs clang and wasi-libc)"
            ),
        );
    }
    ok
}

fn runs(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// componentize-js, installed by `npm ci` in `examples/plugins/js`.
fn js_modules() -> PathBuf {
    repo().join("examples/plugins/js/node_modules")
}

/// Copy a folder's files (not its `build/` or `node_modules/`) to `to`; a
/// JavaScript folder gets a link to the repository's componentize-js.
fn copy_plugin(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
    if to.join("app.js").exists() && !to.join("node_modules").exists() {
        std::os::unix::fs::symlink(js_modules(), to.join("node_modules")).unwrap();
    }
}

/// Build the plugin in `dir` (once per process per folder) and load it.
fn built(dir: &Path) -> Plugin {
    static BUILT: std::sync::Mutex<Vec<(PathBuf, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let done = BUILT
        .lock()
        .unwrap()
        .iter()
        .find(|(d, _)| d == dir)
        .map(|(_, w)| w.clone());
    let wasm = match done {
        Some(w) => w,
        None => {
            let b = author::build(dir, None)
                .unwrap_or_else(|e| panic!("building {}: {e}", dir.display()));
            BUILT
                .lock()
                .unwrap()
                .push((dir.to_path_buf(), b.component.clone()));
            b.component
        }
    };
    host().load_file(&wasm).unwrap()
}

/// An example under `examples/plugins/`, built in a copy so concurrent
/// test binaries never share a build folder.
fn example(lang: &str) -> Plugin {
    static COPIES: OnceLock<PathBuf> = OnceLock::new();
    let root = COPIES.get_or_init(|| outside("examples"));
    let dir = root.join(lang);
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    {
        let _g = LOCK.lock().unwrap();
        if !dir.exists() {
            copy_plugin(&repo().join("examples/plugins").join(lang), &dir);
        }
    }
    built(&dir)
}

/// One of the failing-on-purpose plugins under `tests/guest-plugins/`.
fn misbehaving(lang: &str) -> Plugin {
    static COPIES: OnceLock<PathBuf> = OnceLock::new();
    let root = COPIES.get_or_init(|| outside("errors"));
    let dir = root.join(format!("{lang}-errors"));
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    {
        let _g = LOCK.lock().unwrap();
        if !dir.exists() {
            copy_plugin(
                &repo()
                    .join("tests/guest-plugins")
                    .join(format!("{lang}-errors")),
                &dir,
            );
        }
    }
    built(&dir)
}

fn model(layers: u32) -> ModelConfig {
    ModelConfig {
        layers,
        ..ModelConfig::tiny()
    }
}

/// Plan hash after applying `before` (bundled) then `plugin` with `options`.
fn plan_hash(
    plugin: &Plugin,
    layers: u32,
    devices: u32,
    before: Option<(&str, &[(&str, &str)])>,
    options: &[(&str, &str)],
) -> String {
    let owned = |kv: &[(&str, &str)]| -> Vec<(String, String)> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let mut dag = TrainingDag::build(&model(layers), Cluster::new(devices)).unwrap();
    if let Some((name, opts)) = before {
        let p = host().load(name).unwrap();
        host().apply(&p, &mut dag, &owned(opts)).unwrap();
    }
    host()
        .apply(plugin, &mut dag, &owned(options))
        .unwrap_or_else(|e| panic!("{e}"));
    compile(&dag).unwrap().hash
}

#[test]
fn the_python_js_and_c_examples_plan_exactly_like_the_rust_1f1b() {
    let rust = host().load("1f1b").unwrap();
    type Case<'a> = (
        u32,
        u32,
        Option<(&'a str, &'a [(&'a str, &'a str)])>,
        &'a [(&'a str, &'a str)],
    );
    let cases: &[Case] = &[
        (8, 4, None, &[]),
        (8, 4, None, &[("microbatches", "8")]),
        (8, 2, None, &[("microbatches", "2"), ("stream", "p2p")]),
        (8, 3, None, &[("stages", "3"), ("microbatches", "4")]),
        (
            8,
            4,
            Some(("dp", &[("degree", "2")])),
            &[("microbatches", "4")],
        ),
        (
            16,
            8,
            Some(("zero", &[("stage", "1"), ("dp", "2")])),
            &[("microbatches", "4")],
        ),
        (16, 8, None, &[("stages", "8"), ("microbatches", "16")]),
        // Each SDK's `recompute` (0.2.0) through the example's option.
        (8, 4, None, &[("microbatches", "4"), ("recompute", "full")]),
    ];
    let mut compared = 0;
    for (lang, dir, name) in [
        (Lang::Python, "python", "1f1b-py"),
        (Lang::Js, "js", "1f1b-js"),
        (Lang::C, "c", "1f1b-c"),
    ] {
        if !available(lang, "the same-plan test") {
            continue;
        }
        let plugin = example(dir);
        assert_eq!(plugin.info.name, name);
        for (layers, devices, before, opts) in cases {
            let want = plan_hash(&rust, *layers, *devices, *before, opts);
            let got = plan_hash(&plugin, *layers, *devices, *before, opts);
            assert_eq!(
                got, want,
                "{} 1F1B differs from Rust's: {layers} layers, {devices} devices, before {before:?}, options {opts:?}",
                lang.title()
            );
            compared += 1;
        }
        // The Python and JS SDKs' pipelines cut at `boundaries` as Rust's
        // does (the C example lays out its stages itself, evenly).
        if lang == Lang::C {
            continue;
        }
        let cut: &[Case] = &[
            (
                8,
                4,
                None,
                &[("microbatches", "8"), ("boundaries", "0/3/5/7")],
            ),
            (
                8,
                4,
                Some(("dp", &[("degree", "2")])),
                &[("boundaries", "[0, 5]")],
            ),
        ];
        for (layers, devices, before, opts) in cut {
            let want = plan_hash(&rust, *layers, *devices, *before, opts);
            assert_ne!(want, plan_hash(&rust, *layers, *devices, *before, &[]));
            let got = plan_hash(&plugin, *layers, *devices, *before, opts);
            assert_eq!(got, want, "{} 1F1B with {opts:?}", lang.title());
            compared += 1;
        }
        let mut dag = TrainingDag::build(&model(8), Cluster::new(4)).unwrap();
        let e = host()
            .apply(
                &plugin,
                &mut dag,
                &[("boundaries".into(), "0/4/4/7".into())],
            )
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("boundaries must increase") && e.contains("4 follows 4"),
            "{}: {e}",
            lang.title()
        );
    }
    eprintln!("compared {compared} plans");
}

/// `piper plugin verify` on the Python 1F1B example: it keeps the math.
#[test]
fn the_python_1f1b_example_passes_plugin_verify() {
    if !available(Lang::Python, "the verify test") {
        return;
    }
    let plugin = example("python");
    let out = ok(piper().args(["plugin", "verify", &plugin.origin]));
    assert!(
        out.contains("PASS: `1f1b-py@") && out.contains("tiny-moe-dropless on 4 devices:"),
        "{out}"
    );
}

/// `piper plan --search` with the Python 1F1B in the space beside a
/// bundled schedule: the search applies it at each of its option values
/// and names it, at the value that wins, as the best.
#[test]
fn plan_search_finds_a_python_plugin_at_its_winning_option_value() {
    if !available(Lang::Python, "the search test") {
        return;
    }
    let plugin = example("python");
    let dir = outside("search");
    let space = dir.join("space.toml");
    std::fs::write(
        &space,
        format!(
            "bundled = false\n\
             [[plugin]]\nname = \"{}\"\nrole = \"pipeline\"\n[plugin.options]\nmicrobatches = [2, 16]\n\
             [[plugin]]\nname = \"gpipe\"\nrole = \"pipeline\"\n[plugin.options]\nmicrobatches = [4]\n",
            plugin.origin
        ),
    )
    .unwrap();
    let out = ok(piper().args([
        "plan",
        "--search",
        "--model",
        "gpt2-small",
        "--global-batch",
        "64",
        "--devices",
        "4",
        "--cluster",
        "h100-8x",
        "--search-space",
        space.to_str().unwrap(),
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let top: Vec<&str> = (v["top"].as_array().unwrap().iter())
        .map(|c| c.as_str().unwrap())
        .collect();
    let file = Path::new(&plugin.origin)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(
        top,
        [
            format!("{file}:microbatches=16"),
            "gpipe:microbatches=4".to_string(),
            format!("{file}:microbatches=2"),
        ],
        "{}",
        v["summary"]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Apply `plugin` with `mode=...` to a 2-device tiny DAG: it must fail, leave
/// the DAG as it was, and say every one of `wants` (and none of `not`).
fn fails_with(plugin: &Plugin, mode: &str, wants: &[&str], not: &[&str]) {
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(2)).unwrap();
    let before = dag.clone();
    let e = host()
        .apply(plugin, &mut dag, &[("mode".into(), mode.into())])
        .unwrap_err()
        .to_string();
    for w in wants {
        assert!(e.contains(w), "mode {mode}: missing {w:?} in: {e}");
    }
    for n in not {
        assert!(!e.contains(n), "mode {mode}: {n:?} is noise in: {e}");
    }
    assert!(
        dag.same_state(&before),
        "the DAG changed under a failed apply"
    );
}

#[test]
fn an_exception_in_a_python_strategy_reaches_the_user_with_its_traceback() {
    if !available(Lang::Python, "the exception test") {
        return;
    }
    let p = misbehaving("python");
    let sdk_frames = ["piper_strategy.py"];
    fails_with(
        &p,
        "raise",
        &[
            "plugin `errors-py@0.1.0`",
            "returned an error: ValueError: stage 3 has no devices",
            "File \"app.py\", line 9, in check_stage",
        ],
        &sdk_frames,
    );
    // A directive the host refuses: the host's message, the line that called it.
    fails_with(
        &p,
        "directive",
        &[
            "DagError: directive `place({}, devices [99]",
            "device 99 does not exist",
            "File \"app.py\", line 26, in apply",
        ],
        &sdk_frames,
    );
}

#[test]
fn an_exception_in_a_js_strategy_reaches_the_user_with_its_stack() {
    if !available(Lang::Js, "the exception test") {
        return;
    }
    let p = misbehaving("js");
    let sdk_frames = ["piper_strategy.js", "initializer.js"];
    fails_with(
        &p,
        "raise",
        &[
            "plugin `errors-js@0.1.0`",
            "returned an error: RangeError: stage 3 has no devices",
            "checkStage@app.js:7:",
        ],
        &sdk_frames,
    );
    fails_with(
        &p,
        "directive",
        &[
            "DagError: directive `place({}, devices [99]",
            "apply@app.js:20:",
        ],
        &sdk_frames,
    );
}

#[test]
fn a_c_strategy_fails_with_its_own_message_or_the_hosts() {
    if !available(Lang::C, "the failure test") {
        return;
    }
    let p = misbehaving("c");
    fails_with(
        &p,
        "raise",
        &[
            "plugin `errors-c@0.1.0`",
            "returned an error: stage 3 has no devices",
        ],
        &[],
    );
    fails_with(
        &p,
        "directive",
        &[
            "a directive failed",
            "device 99 does not exist, the cluster has 2",
        ],
        &[],
    );
}

/// An endless loop in an interpreted guest ends within the default deadline
/// (fuel runs out first: about 4 s on this 2-core machine) with a message.
#[test]
fn an_endless_loop_in_python_or_js_is_stopped_within_the_default_deadline() {
    let deadline = SandboxLimits::default().deadline_ms;
    for (lang, dir, name) in [
        (Lang::Python, "python", "errors-py"),
        (Lang::Js, "js", "errors-js"),
    ] {
        if !available(lang, "the endless-loop test") {
            continue;
        }
        let p = misbehaving(dir);
        let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(2)).unwrap();
        let t = Instant::now();
        let e = host()
            .apply(&p, &mut dag, &[("mode".into(), "loop".into())])
            .unwrap_err()
            .to_string();
        let took = t.elapsed();
        assert!(e.contains(&format!("plugin `{name}@0.1.0`")), "{e}");
        assert!(
            e.contains("ran out of fuel") || e.contains("exceeded its wall-clock deadline"),
            "{e}"
        );
        assert!(
            took.as_millis() < u128::from(deadline) + 10_000,
            "{} loop ran {took:?}, the deadline is {deadline} ms",
            lang.title()
        );
    }
}

fn piper() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_piper"));
    c.env("PIPER_HOME", scratch().join("home"));
    c
}

fn ok(c: &mut Command) -> String {
    let o = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{c:?} failed:\n{text}");
    text
}

#[test]
fn plugin_new_writes_a_skeleton_that_builds_and_plans_in_every_language_outside_the_repo() {
    let parent = outside("new");
    for (lang, flag) in [
        (Lang::Rust, "rust"),
        (Lang::Python, "python"),
        (Lang::Js, "js"),
        (Lang::C, "c"),
    ] {
        if !available(lang, "the skeleton test") {
            continue;
        }
        let name = format!("my-{flag}");
        let made = ok(piper()
            .args(["plugin", "new", &name, "--lang", flag, "--dir"])
            .arg(&parent));
        let dir = parent.join(&name);
        // The next steps that work here: the build, after `npm install`
        // for JavaScript (its toolchain is a package of the folder).
        assert!(
            made.contains(&format!("  piper plugin build {}", dir.display())),
            "{made}"
        );
        assert_eq!(
            made.contains(&format!("(cd {} && npm install)", dir.display())),
            lang == Lang::Js,
            "{made}"
        );
        assert!(dir.join("README.md").is_file());
        let readme = std::fs::read_to_string(dir.join("README.md")).unwrap();
        assert!(readme.contains("piper plugin build"), "{readme}");
        let wit = if lang == Lang::Rust {
            "piper-sdk/wit/strategy.wit"
        } else {
            "wit/strategy.wit"
        };
        assert_eq!(
            std::fs::read_to_string(dir.join(wit)).unwrap(),
            std::fs::read_to_string(repo().join("wit/strategy.wit")).unwrap(),
            "the skeleton's WIT is this host's"
        );
        if lang == Lang::Js {
            // What the skeleton's README says to run first.
            ok(Command::new("npm")
                .args([
                    "install",
                    "--prefer-offline",
                    "--no-audit",
                    "--no-fund",
                    "--silent",
                ])
                .current_dir(&dir));
        }
        let mut build = piper();
        build.args(["plugin", "build"]).arg(&dir);
        if lang == Lang::Rust {
            // Its own workspace, built in the bundled plugins' target folder,
            // where its dependencies (wit-bindgen and its macros) already are.
            build.env("CARGO_TARGET_DIR", repo().join("target/plugins"));
        }
        let out = ok(&mut build);
        let wasm = dir.join("build").join(format!("{name}.wasm"));
        assert!(out.contains(&wasm.display().to_string()), "{out}");
        // Out of the box it plans on any device count (data parallelism).
        let plan = ok(piper()
            .args(["plan", "--model", "tiny", "--devices", "2", "--strategy"])
            .arg(&wasm));
        assert!(plan.contains(&format!("{name}@0.1.0")), "{plan}");
        if lang == Lang::Rust {
            // A syntax error: the compiler's own diagnostic and the command
            // that reproduces it, not cargo's JSON messages.
            let lib = dir.join("src/lib.rs");
            let text = std::fs::read_to_string(&lib).unwrap();
            std::fs::write(&lib, format!("{text}\nfn broken( {{\n")).unwrap();
            let o = build.output().unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success());
            assert!(
                err.contains("unclosed delimiter") && err.contains("src/lib.rs"),
                "{err}"
            );
            assert!(!err.contains("\"reason\""), "{err}");
            assert!(
                err.contains("cargo build --release --target wasm32-wasip2 --manifest-path"),
                "{err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&parent);
}

#[test]
fn plugin_new_refuses_a_bad_name_and_an_existing_folder() {
    let parent = outside("refuse");
    let e = author::new_plugin("My_Plugin", Lang::Python, &parent)
        .unwrap_err()
        .to_string();
    assert!(e.contains("lowercase letters, digits and '-'"), "{e}");
    author::new_plugin("twice", Lang::C, &parent).unwrap();
    let e = author::new_plugin("twice", Lang::C, &parent)
        .unwrap_err()
        .to_string();
    assert!(e.contains("already exists"), "{e}");
    let _ = std::fs::remove_dir_all(&parent);
}

#[test]
fn a_missing_toolchain_is_named_with_its_install_command() {
    let parent = outside("missing");
    let no_tools = |c: &mut Command| {
        c.env("PATH", parent.join("empty"))
            .env_remove("CARGO")
            .env_remove("RUSTC");
    };
    for (lang, flag, want) in [
        (
            Lang::Python,
            "python",
            "pip install componentize-py==0.25.1",
        ),
        (Lang::Js, "js", "apt-get install nodejs npm"),
        (
            Lang::C,
            "c",
            "apt-get install clang-19 lld-19 libclang-rt-19-dev-wasm32 wasi-libc",
        ),
        (Lang::Rust, "rust", "https://sh.rustup.rs"),
    ] {
        let dir = author::new_plugin(&format!("t-{flag}"), lang, &parent).unwrap();
        let mut c = piper();
        c.args(["plugin", "build"]).arg(&dir);
        no_tools(&mut c);
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success());
        assert!(err.contains(want), "{}: {err}", lang.title());
        assert!(err.contains("was not found; install it with"), "{err}");
    }
    // Node present, componentize-js not installed in the folder.
    if runs("node") {
        let dir = parent.join("t-js");
        let e = author::build(&dir, None).unwrap_err();
        assert!(matches!(e, AuthorError::MissingTool { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("npm install --save-dev @bytecodealliance/componentize-js@0.23.0 @bytecodealliance/preview2-shim@0.25.0"),
            "{e}"
        );
    }
    // No plugin at all.
    let empty = parent.join("nothing");
    std::fs::create_dir_all(&empty).unwrap();
    let e = author::build(&empty, None).unwrap_err().to_string();
    assert!(e.contains("cannot tell the language"), "{e}");
    let _ = std::fs::remove_dir_all(&parent);
}

#[test]
fn plugin_check_reports_the_wit_imports_exports_and_info_without_applying() {
    if !available(Lang::C, "the check test") {
        return;
    }
    let p = example("c");
    let wasm = Path::new(&p.origin);
    let out = ok(piper().args(["plugin", "check"]).arg(wasm));
    for want in [
        "wit:     piper:strategy@0.4.0 (this host accepts piper:strategy@0.1.x, 0.2.x, 0.3.x or 0.4.x)",
        "piper:strategy/dag@0.4.0",
        "exports: info, apply",
        "1f1b-c 0.1.0",
        "microbatches",
        "accepted: yes",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&ok(piper().args(["plugin", "check", "--json"]).arg(wasm))).unwrap();
    assert_eq!(json["accepted"], true);
    assert_eq!(json["info"]["name"], "1f1b-c");
    // A component built against another WIT version: refused, both versions named.
    let other =
        PathBuf::from(env!("PIPER_PLUGINS_WASM_DIR")).join("piper_testing_wrong_version.wasm");
    let o = piper()
        .args(["plugin", "check"])
        .arg(&other)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(!o.status.success());
    assert!(text.contains("accepted: no"), "{text}");
    assert!(
        text.contains("this host accepts piper:strategy@0.1.x, 0.2.x, 0.3.x or 0.4.x"),
        "{text}"
    );
}
