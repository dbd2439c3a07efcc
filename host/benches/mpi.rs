//! `cargo bench -p piper --features mpi --bench mpi`: the same plans in one
//! process and on 2 MPI ranks (one device per rank, loopback), side by side
//! in one run: `tiny` and a mid-size model (6 layers, d_model 384, batch
//! 8×256), each under `dp` over 2 devices and `1f1b` over 2 stages. For each:
//! the median step time (from the metrics, first step left out) and the time
//! a device spends in communication ops per step (sends, receives and
//! collectives, waiting included; from the trace, mean over devices).

use std::path::Path;
use std::process::Command;

const STEPS: u32 = 6;

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("run piper");
    assert!(
        out.status.success(),
        "{cmd:?}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median step time in ms, steps 2.. (tokens per step / tokens per second).
fn step_ms(metrics: &Path, tokens_per_step: f64) -> f64 {
    let v: Vec<f64> = std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .map(|v| tokens_per_step / v["tokens_per_s"].as_f64().unwrap() * 1e3)
        .collect();
    median(v)
}

/// Mean over devices of the time in comm ops per step (steps 2..), ms.
fn comm_ms(trace: &Path) -> f64 {
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trace).unwrap()).unwrap();
    let mut per_device: std::collections::BTreeMap<u64, f64> = Default::default();
    for e in t["traceEvents"].as_array().unwrap() {
        if e["ph"] == "X" && e["cat"] == "comm" && e["args"]["step"].as_u64() > Some(1) {
            *per_device.entry(e["pid"].as_u64().unwrap()).or_default() +=
                e["dur"].as_f64().unwrap() / 1e3;
        }
    }
    let n = per_device.len().max(1) as f64;
    per_device.values().sum::<f64>() / n / (STEPS - 1) as f64
}

fn main() {
    let bin = env!("CARGO_BIN_EXE_piper");
    let dir = std::env::temp_dir().join(format!("piper-bench-mpi-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mid = dir.join("mid.toml");
    std::fs::write(
        &mid,
        "[model]\nname = \"mid\"\nlayers = 6\nd_model = 384\nheads = 6\nseq_len = 256\nvocab = 256\nbatch_size = 8\n",
    )
    .unwrap();
    let tiny_tokens = 32.0 * 64.0;
    let mid_tokens = 8.0 * 256.0;
    println!(
        "{:<6} {:<22} {:>12} {:>12} {:>7} {:>12} {:>12}",
        "model", "strategy", "1 process", "2 ranks", "ratio", "comm 1 proc", "comm 2 ranks"
    );
    for (model, tokens) in [("tiny", tiny_tokens), ("mid", mid_tokens)] {
        for strategy in ["dp", "1f1b:microbatches=4"] {
            let mut args: Vec<String> = vec!["train".into(), "--devices".into(), "2".into()];
            if model == "tiny" {
                args.extend(["--model".into(), "tiny".into()]);
            } else {
                args.extend(["--config".into(), mid.display().to_string()]);
            }
            args.extend([
                "--strategy".into(),
                strategy.into(),
                "--steps".into(),
                STEPS.to_string(),
            ]);
            let tag = format!("{model}-{}", strategy.split(':').next().unwrap());
            let f = |n: &str| dir.join(format!("{tag}-{n}"));
            run(Command::new(bin)
                .args(&args)
                .args(["--metrics", f("one.jsonl").to_str().unwrap()])
                .args(["--trace", f("one.trace").to_str().unwrap()])
                .env("PIPER_HOME", &dir));
            let mut mpirun = Command::new("mpirun");
            if is_root() {
                mpirun.arg("--allow-run-as-root");
            }
            run(mpirun
                .args(["--oversubscribe", "-n", "2", "-x"])
                .arg(format!("PIPER_HOME={}", dir.display()))
                .arg(bin)
                .args(&args)
                .args(["--metrics", f("two.jsonl").to_str().unwrap()])
                .args(["--trace", f("two.trace").to_str().unwrap()]));
            let (one, two) = (
                step_ms(&f("one.jsonl"), tokens),
                step_ms(&f("two.jsonl"), tokens),
            );
            println!(
                "{model:<6} {strategy:<22} {one:>9.1} ms {two:>9.1} ms {:>6.2}× {:>9.1} ms {:>9.1} ms",
                two / one,
                comm_ms(&f("one.trace")),
                comm_ms(&f("two.trace")),
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
