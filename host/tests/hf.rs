//! Hugging Face interop, against transformers itself: a Piper checkpoint of
//! `llama-tiny` (Qwen3-style) and of `tiny` (GPT-2) opens with
//! `AutoModelForCausalLM.from_pretrained` and gives Piper's loss on the same
//! batch; a randomly initialised transformers model saved by
//! `save_pretrained` (in shards, with its index) trains under `piper train
//! --init-from` with transformers' step-1 loss.
//!
//! Runs where Python with torch and transformers is found
//! (`PIPER_HF_PYTHON`, else `target/hf-venv/bin/python` as
//! `scripts/hf-python.sh` installs it); reported NOT RUN otherwise, unless
//! `PIPER_REQUIRE_HF=1` (CI) makes that a failure.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh directory for one test.
fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("piper-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn python() -> Option<PathBuf> {
    let py = std::env::var_os("PIPER_HF_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/hf-venv/bin/python")
        });
    let ok = Command::new(&py)
        .args(["-c", "import torch, transformers"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    let required = std::env::var("PIPER_REQUIRE_HF").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "PIPER_REQUIRE_HF=1 but {} cannot import torch and transformers (scripts/hf-python.sh installs them)",
        py.display()
    );
    println!("NOT RUN: no Python with torch and transformers (scripts/hf-python.sh installs them into target/hf-venv)");
    None
}

/// Run the interop script; its JSON answer.
fn hf(py: &Path, args: &[&str]) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf/interop.py");
    let out = Command::new(py).arg(script).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "interop.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim().lines().last().unwrap_or(""))
        .unwrap_or_else(|e| panic!("interop.py {args:?} printed {text}: {e}"))
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
        let got = hf(&py, &["loss", &ck, &p("d1")]);
        assert_eq!(got["class"], class, "{model}");
        close(
            &format!("{model} checkpoint"),
            piper_loss,
            got["loss"].as_f64().unwrap(),
        );
        // transformers -> Piper: a fresh model of the same config, saved in
        // shards; Piper's step-1 loss from it on the same batch.
        hf(&py, &["save", &ck, &p("hf")]);
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
        let got = hf(&py, &["loss", &p("hf"), &p("d2")]);
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
