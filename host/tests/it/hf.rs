//! Hugging Face interop, against transformers itself: a Piper checkpoint of
//! `llama-tiny` (Qwen3-style) and of `tiny` (GPT-2) opens with
//! `AutoModelForCausalLM.from_pretrained` and gives Piper's loss on the same
//! batch; a randomly initialised transformers model saved by
//! `save_pretrained` (in shards, with its index) trains under `piper train
//! --init-from` with transformers' step-1 loss; checkpoints of context-
//! parallel runs (every sequence split over 2 devices) give their loss too.
//!
//! Runs where Python with torch and transformers is found
//! (`PIPER_HF_PYTHON`, else `target/hf-venv/bin/python` as
//! `scripts/hf-python.sh` installs it); reported as not run otherwise
//! (`scripts/test.sh` lists it; CI fails).

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock};

/// A fresh directory for one test.
fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("piper-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// transformers' side: one `interop.py serve` for every test here, so torch
/// and transformers are imported once.
struct Interop {
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Its standard error (transformers' warnings, a crash).
    log: PathBuf,
}

/// The shared `interop.py serve`, started on first use; `None` (reported as
/// not run) where no Python imports torch and transformers.
fn python() -> Option<&'static Mutex<Interop>> {
    static SERVER: OnceLock<Option<Mutex<Interop>>> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let py = std::env::var_os("PIPER_HF_PYTHON")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/hf-venv/bin/python")
                });
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf/interop.py");
            let log = std::env::temp_dir().join(format!("piper-interop-{}.log", std::process::id()));
            let started = Command::new(&py)
                .arg(script)
                .arg("serve")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn();
            let server = started.ok().map(|mut child| Interop {
                stdin: child.stdin.take().unwrap(),
                stdout: BufReader::new(child.stdout.take().unwrap()),
                log,
            });
            // The first answer says whether both import.
            let server = server.and_then(|mut s| {
                let answer = s.ask(&["ping"]).ok()?;
                answer.get("torch").is_some().then_some(s)
            });
            if server.is_none() {
                piper::test_support::not_run(
                    "hf",
                    &format!(
                        "{} cannot import torch and transformers (scripts/hf-python.sh installs them into target/hf-venv)",
                        py.display()
                    ),
                );
            }
            server.map(Mutex::new)
        })
        .as_ref()
}

impl Interop {
    /// One command of `interop.py`, its JSON answer (or the line it gave).
    fn ask(&mut self, args: &[&str]) -> Result<serde_json::Value, String> {
        let line = serde_json::to_string(args).unwrap();
        writeln!(self.stdin, "{line}").map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        let mut answer = String::new();
        self.stdout
            .read_line(&mut answer)
            .map_err(|e| e.to_string())?;
        serde_json::from_str(&answer).map_err(|e| {
            format!(
                "answered {answer:?} ({e}); its stderr: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )
        })
    }
}

/// Run one interop command; its JSON answer.
fn hf(py: &Mutex<Interop>, args: &[&str]) -> serde_json::Value {
    let answer = py.lock().unwrap_or_else(|e| e.into_inner()).ask(args);
    match answer {
        Ok(v) if v.get("error").is_none() => v,
        Ok(v) => panic!("interop.py {args:?}: {}", v["error"].as_str().unwrap_or("")),
        Err(e) => panic!("interop.py {args:?}: {e}"),
    }
}

/// `piper train` with these arguments, which must succeed.
fn train(home: &Path, args: &[&str]) {
    let (ok, out, err) = common::piper(home, &[&["train"], args].concat());
    assert!(ok, "piper train {args:?}:\n{out}\n{err}");
}

/// The step-1 loss and the batch of a `--dump-step1` file.
fn dump(path: &Path) -> (f64, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let l = st.tensor("loss").unwrap();
    let loss = f32::from_le_bytes(l.data()[..4].try_into().unwrap()) as f64;
    (loss, st.tensor("inputs").unwrap().data().to_vec())
}

fn close(what: &str, piper: f64, hf: f64) {
    let rel = (piper - hf).abs() / hf.abs();
    assert!(
        rel < 1e-5,
        "{what}: Piper {piper}, transformers {hf} (relative {rel:.1e})"
    );
}

#[test]
fn checkpoints_open_in_transformers_and_transformers_models_train_in_piper() {
    let Some(py) = python() else { return };
    for (model, class) in [
        ("llama-tiny", "Qwen3ForCausalLM"),
        ("tiny", "GPT2LMHeadModel"),
    ] {
        let dir = scratch(&format!("hf-{model}"));
        let home = dir.join("home");
        let p = |s: &str| dir.join(s).display().to_string();
        // Piper -> transformers: a checkpoint after 3 steps, and Piper's loss
        // of it on the first batch (a step from it with the dump).
        train(
            &home,
            &["--model", model, "--steps", "3", "--checkpoint", &p("ck")],
        );
        let ck = p("ck/step-00000003");
        train(
            &home,
            &[
                "--model",
                model,
                "--init-from",
                &ck,
                "--steps",
                "1",
                "--dump-step1",
                &p("d1"),
            ],
        );
        let (piper_loss, batch) = dump(&dir.join("d1"));
        let got = hf(py, &["loss", &ck, &p("d1")]);
        assert_eq!(got["class"], class, "{model}");
        close(
            &format!("{model} checkpoint"),
            piper_loss,
            got["loss"].as_f64().unwrap(),
        );
        // transformers -> Piper: a fresh model of the same config, saved in
        // shards; Piper's step-1 loss from it on the same batch.
        hf(py, &["save", &ck, &p("hf")]);
        assert!(dir.join("hf/model.safetensors.index.json").is_file());
        train(
            &home,
            &[
                "--model",
                model,
                "--init-from",
                &p("hf"),
                "--steps",
                "1",
                "--dump-step1",
                &p("d2"),
            ],
        );
        let (piper_loss, batch2) = dump(&dir.join("d2"));
        assert_eq!(batch, batch2, "{model}: the same first batch");
        let got = hf(py, &["loss", &p("hf"), &p("d2")]);
        close(
            &format!("{model} from transformers"),
            piper_loss,
            got["loss"].as_f64().unwrap(),
        );
        // The other family's model is refused, naming a tensor.
        let (ok, _, err) = common::piper(
            &home,
            &[
                "train",
                "--model",
                if model == "tiny" {
                    "llama-tiny"
                } else {
                    "tiny"
                },
                "--init-from",
                &p("hf"),
                "--steps",
                "1",
            ],
        );
        assert!(!ok && err.contains("--init-from"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// bf16 both ways: a bf16 run's checkpoint names `bfloat16` in its
/// config.json, so transformers loads it in bf16 and computes Piper's bf16
/// loss (1e-3 relative: the two round at different points; 1e-5 to 7e-5 measured); bf16 weights
/// saved by transformers start a bf16 run unchanged (every parameter the
/// step-1 dump holds is a bf16 value) at transformers' bf16 loss; and
/// PyTorch's bf16 autocast (`benches/reference/torch_gpt.py`) on the same
/// GPT-2 weights and batch agrees on the step-1 loss within 1e-2.
#[test]
fn bf16_checkpoints_open_in_transformers_in_bf16_and_bf16_weights_train_in_bf16() {
    let Some(py) = python() else { return };
    for model in ["llama-tiny", "tiny"] {
        let dir = scratch(&format!("hf-bf16-{model}"));
        let home = dir.join("home");
        let p = |s: &str| dir.join(s).display().to_string();
        let bf16 = ["--model", model, "--precision", "bf16"];
        train(
            &home,
            &[&bf16[..], &["--steps", "3", "--checkpoint", &p("ck")]].concat(),
        );
        let ck = p("ck/step-00000003");
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("ck/step-00000003/config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(config["dtype"], "bfloat16", "{model}");
        assert_eq!(config["torch_dtype"], "bfloat16", "{model}");
        let near = |what: &str, piper: f64, got: &serde_json::Value| {
            assert_eq!(got["dtype"], "torch.bfloat16", "{what}");
            let hf = got["loss"].as_f64().unwrap();
            let rel = (piper - hf).abs() / hf;
            eprintln!("{what}: Piper {piper}, transformers {hf} (relative {rel:.1e})");
            assert!(
                rel < 1e-2,
                "{what}: Piper {piper}, transformers {hf} (relative {rel:.1e})"
            );
        };
        let step1 = |from: &str, out: &str| {
            train(
                &home,
                &[
                    &bf16[..],
                    &["--init-from", from, "--steps", "1", "--dump-step1", &p(out)],
                ]
                .concat(),
            );
            dump(&dir.join(out)).0
        };
        let loss = step1(&ck, "d1");
        near(
            &format!("{model} checkpoint"),
            loss,
            &hf(py, &["loss", &ck, &p("d1"), "auto"]),
        );
        if model == "tiny" {
            // PyTorch's own mixed precision (fp32 weights, bf16 autocast) on
            // the same weights and batch: the reference bench's model.
            let got = hf(py, &["autocast", &p("d1"), "4"]);
            let torch = got["loss"].as_f64().unwrap();
            let rel = (loss - torch).abs() / torch;
            eprintln!(
                "tiny vs PyTorch bf16 autocast: Piper {loss}, PyTorch {torch} (relative {rel:.1e})"
            );
            assert!(rel < 1e-2, "Piper {loss}, PyTorch bf16 autocast {torch}");
            assert!(
                loss < 0.9 * 256f64.ln(),
                "a trained model's loss, not a uniform guess: {loss}"
            );
        }
        hf(py, &["save", &ck, &p("hf"), "bfloat16"]);
        let loss = step1(&p("hf"), "d2");
        near(
            &format!("{model} from transformers"),
            loss,
            &hf(py, &["loss", &p("hf"), &p("d2"), "auto"]),
        );
        let bytes = std::fs::read(dir.join("d2")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut params = 0;
        for (name, t) in st.tensors() {
            if !name.starts_with("param.") {
                continue;
            }
            params += 1;
            let off = t
                .data()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .find(|bits| bits & 0xffff != 0);
            assert_eq!(
                off, None,
                "{model}: {name} holds a value that is not a bf16"
            );
        }
        assert!(params > 0, "{model}: the dump holds the parameters");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Context parallelism against transformers: a GPT-2 (`tiny-cp`) and a
/// Qwen3-style Llama, each trained 3 steps with every sequence split over
/// 2 devices (`cp:cp=2`, keys and values round a ring), checkpoint into
/// models transformers opens and scores at the loss Piper's cp run computes
/// on the next batch (1e-5). (transformers' own models start a cp run as
/// they start any: `--init-from` reads weights before the plan.)
#[test]
fn context_parallel_runs_give_transformers_losses() {
    let Some(py) = python() else { return };
    let dir = scratch("hf-cp");
    let home = dir.join("home");
    let p = |s: &str| dir.join(s).display().to_string();
    let llama = piper::model::ModelConfig {
        name: "llama-tiny-cp".into(),
        attention: piper::model::Attention::Flash,
        ..piper::model::ModelConfig::llama_tiny()
    };
    std::fs::write(dir.join("llama.toml"), toml::to_string(&llama).unwrap()).unwrap();
    let gpt = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-cp.toml");
    for (model, class) in [
        (gpt.display().to_string(), "GPT2LMHeadModel"),
        (p("llama.toml"), "Qwen3ForCausalLM"),
    ] {
        let cp = ["--model", &model, "--devices", "2", "--strategy", "cp:cp=2"];
        let ck = p("ck/step-00000003");
        let _ = std::fs::remove_dir_all(dir.join("ck"));
        train(
            &home,
            &[&cp[..], &["--steps", "3", "--checkpoint", &p("ck")]].concat(),
        );
        train(
            &home,
            &[
                &cp[..],
                &["--init-from", &ck, "--steps", "1", "--dump-step1", &p("d1")],
            ]
            .concat(),
        );
        let (piper_loss, _) = dump(&dir.join("d1"));
        let got = hf(py, &["loss", &ck, &p("d1")]);
        assert_eq!(got["class"], class, "{model}");
        close(
            &format!("{model} under cp 2"),
            piper_loss,
            got["loss"].as_f64().unwrap(),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
