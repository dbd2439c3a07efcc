//! `cargo bench -p piper --features mpi --bench mpi`: the same plans in one
//! process and on 2 MPI ranks (one device per rank, loopback), side by side
//! in one run: `tiny` and a mid-size model (6 layers, d_model 384, batch
//! 8×256), each under `dp`, `zero:stage=3` and `1f1b` over 2 devices. For
//! each: the median step time (from the metrics, first step left out), the
//! time a device spends in communication ops per step (sends, receives and
//! collectives, waiting included; from the trace, mean over devices), and
//! the bytes device 0 sent in a step (`comm_bytes`) beside the plan's
//! prediction (the summary's `planned`).
//!
//! `PIPER_AGAINST=/path/to/an/older/piper` (built with `--features mpi`)
//! runs that binary's 2-rank job too, in 3 pairs alternating which goes
//! first, and prints the median ratio of communication time per step (this
//! one's / the older's) — how the collectives compare with an earlier
//! transport; this machine's speed drifts, a ratio taken pair by pair less. Both
//! binaries should come from the same profile (`cargo bench --profile dev`
//! builds this one as `target/debug/piper`).

use std::path::Path;
use std::process::Command;

const STEPS: u32 = 6;
/// Pairs of 2-rank runs against `PIPER_AGAINST`.
const PAIRS: usize = 3;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run piper");
    assert!(
        out.status.success(),
        "{cmd:?}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
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

/// Bytes device 0 sent in step 2, when the binary records them.
fn sent_bytes(metrics: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(metrics).ok()?;
    let line = text.lines().nth(1)?;
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    v["comm_bytes"][0].as_u64()
}

/// The summary's prediction for device 0: `sent X in the last step, Y planned`.
fn planned_bytes(stdout: &str) -> Option<String> {
    let line = stdout.lines().find(|l| l.contains("device 0: peak"))?;
    let at = line.find("in the last step, ")? + "in the last step, ".len();
    Some(line[at..].trim_end_matches(" planned").to_string())
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
}

/// A 2-rank job of `bin`; its stdout.
fn two_ranks(bin: &str, dir: &Path, args: &[String], metrics: &Path, trace: &Path) -> String {
    let mut mpirun = Command::new("mpirun");
    if is_root() {
        mpirun.arg("--allow-run-as-root");
    }
    mpirun
        .args(["--oversubscribe", "-n", "2", "-x"])
        .arg(format!("PIPER_HOME={}", dir.display()))
        .arg(bin)
        .args(args)
        .args(["--metrics", metrics.to_str().unwrap()])
        .args(["--trace", trace.to_str().unwrap()]);
    run(&mut mpirun)
}

fn main() {
    let bin = env!("CARGO_BIN_EXE_piper");
    let against = std::env::var("PIPER_AGAINST").ok();
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
        "{:<6} {:<20} {:>11} {:>11} {:>6} {:>11} {:>11} {:>22}",
        "model",
        "strategy",
        "1 process",
        "2 ranks",
        "ratio",
        "comm 1 proc",
        "comm 2 ranks",
        "sent/step (planned)"
    );
    let mut versus = Vec::new();
    for (model, tokens) in [("tiny", tiny_tokens), ("mid", mid_tokens)] {
        for strategy in ["dp", "zero:stage=3", "1f1b:microbatches=4"] {
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
            let ours = || two_ranks(bin, &dir, &args, &f("two.jsonl"), &f("two.trace"));
            let stdout = match &against {
                // Pairs, alternating which binary goes first; the median of
                // each pair's ratio.
                Some(old) => {
                    let theirs = || two_ranks(old, &dir, &args, &f("old.jsonl"), &f("old.trace"));
                    let (mut out, mut ratios, mut ms) = (String::new(), Vec::new(), Vec::new());
                    for pair in 0..PAIRS {
                        if pair % 2 == 0 {
                            out = ours();
                            theirs();
                        } else {
                            theirs();
                            out = ours();
                        }
                        let (a, b) = (comm_ms(&f("old.trace")), comm_ms(&f("two.trace")));
                        ratios.push(b / a);
                        ms.push((a, b));
                    }
                    versus.push((tag.clone(), ms, median(ratios)));
                    out
                }
                None => ours(),
            };
            let (one, two) = (
                step_ms(&f("one.jsonl"), tokens),
                step_ms(&f("two.jsonl"), tokens),
            );
            let sent = sent_bytes(&f("two.jsonl")).map_or("-".into(), mib);
            let planned = planned_bytes(&stdout).unwrap_or_else(|| "-".into());
            println!(
                "{model:<6} {strategy:<20} {one:>8.1} ms {two:>8.1} ms {:>5.2}× {:>8.1} ms {:>8.1} ms {:>22}",
                two / one,
                comm_ms(&f("one.trace")),
                comm_ms(&f("two.trace")),
                format!("{sent} ({planned})"),
            );
        }
    }
    if let Some(old) = &against {
        println!(
            "\ncommunication per step on 2 ranks, {old} -> this binary, {PAIRS} alternating pairs:"
        );
        for (tag, ms, ratio) in &versus {
            let pairs: Vec<String> = ms
                .iter()
                .map(|(a, b)| format!("{a:.1} -> {b:.1}"))
                .collect();
            println!(
                "  {tag:<12} median ratio {ratio:.2}×  (ms: {})",
                pairs.join(", ")
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
