//! `cargo bench -p piper --bench calibrate [-- --record DIR]`: the
//! simulator against this machine, live. `piper calibrate` measures the
//! CPU runtime (keeping its traces), then real runs of `1f1b` and `dp` on 2
//! devices are set beside the calibrated prediction, and `piper plan
//! --search` on 4 devices beside real runs of its top 5. Prints each ratio.
//!
//! What it measured is written to DIR (default `target/calibration`) in the
//! layout `host/tests/it/calibrate.rs` reads from `host/tests/data/calibration`
//! (`scripts/record-calibration.sh` records there): the tests check the
//! simulator against that kept record, never against this machine's clock.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `piper ARGS` with `home` as PIPER_HOME; its standard output.
fn piper(home: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_piper"))
        .args(args)
        .env("PIPER_HOME", home)
        .output()
        .expect("running piper");
    assert!(
        out.status.success(),
        "piper {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The median step of a `tiny` run's `--metrics` file, the first left out.
fn median_step(metrics: &Path) -> f64 {
    let mut steps: Vec<f64> = std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (32 * 64) as f64 / v["tokens_per_s"].as_f64().unwrap()
        })
        .collect();
    steps.sort_by(f64::total_cmp);
    steps[steps.len() / 2]
}

/// `246.867 ms`, `1.200 s`, `95.0 µs` in seconds.
fn seconds(text: &str) -> f64 {
    let (num, unit) = text.trim().split_once(' ').unwrap();
    let v: f64 = num.parse().unwrap();
    v * match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "µs" => 1e-6,
        u => panic!("unit {u}"),
    }
}

/// `piper train --model tiny` with `strategies` (a search label's parts)
/// on `devices`, writing its metrics to `metrics`: its median step.
fn train(home: &Path, devices: u32, strategies: &[&str], steps: u32, metrics: &Path) -> f64 {
    let (devices, steps) = (devices.to_string(), steps.to_string());
    let mut args = vec!["train", "--model", "tiny", "--devices", &devices];
    args.extend(["--steps", &steps, "--metrics", metrics.to_str().unwrap()]);
    for s in strategies {
        args.extend(["--strategy", s]);
    }
    piper(home, &args);
    median_step(metrics)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = match args.iter().position(|a| a == "--record") {
        Some(i) => PathBuf::from(&args[i + 1]),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/calibration"),
    };
    std::fs::create_dir_all(&dir).unwrap();
    let home = std::env::temp_dir().join(format!("piper-bench-calibrate-{}", std::process::id()));
    let cluster = home.join("cpu.toml");
    // 1. Calibration, its runs kept.
    let out = piper(
        &home,
        &[
            "calibrate",
            "--save-traces",
            dir.to_str().unwrap(),
            "--out",
            cluster.to_str().unwrap(),
        ],
    );
    print!("{out}");
    // 2. 1f1b and dp on 2 devices: measured median beside the prediction.
    for (strategy, file) in [
        ("1f1b:microbatches=4", "1f1b.metrics.jsonl"),
        ("dp:degree=2", "dp.metrics.jsonl"),
    ] {
        let measured = train(&home, 2, &[strategy], 25, &dir.join(file));
        let plan = piper(
            &home,
            &[
                "plan",
                "--model",
                "tiny",
                "--devices",
                "2",
                "--strategy",
                strategy,
                "--simulate",
                "--cluster",
                cluster.to_str().unwrap(),
            ],
        );
        let line = plan
            .lines()
            .find(|l| l.starts_with("simulated on "))
            .unwrap();
        let simulated = seconds(
            line.split("step ")
                .nth(1)
                .unwrap()
                .split(',')
                .next()
                .unwrap(),
        );
        println!(
            "{strategy:<22} measured median {:>7.1} ms, simulated {:>7.1} ms: ratio {:.3}",
            measured * 1e3,
            simulated * 1e3,
            simulated / measured
        );
    }
    // 3. The search's top 5 on 4 devices, each trained in turn over three
    //    rounds (a neighbour's load slows a round, not a candidate), its
    //    fastest round kept.
    let json = piper(
        &home,
        &[
            "plan",
            "--search",
            "--devices",
            "4",
            "--cluster",
            cluster.to_str().unwrap(),
            "--top",
            "5",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let top: Vec<String> = (v["top"].as_array().unwrap().iter())
        .map(|c| c.as_str().unwrap().to_string())
        .collect();
    let metrics = home.join("m.jsonl");
    let mut best = vec![f64::INFINITY; top.len()];
    for _ in 0..3 {
        for (i, c) in top.iter().enumerate() {
            let parts: Vec<&str> = c.split('+').collect();
            best[i] = best[i].min(train(&home, 4, &parts, 5, &metrics));
        }
    }
    let mut table = String::new();
    for (c, t) in top.iter().zip(&best) {
        println!("  {c:<48} {:>7.1} ms", t * 1e3);
        table.push_str(&format!("{c}\t{t:.6}\n"));
    }
    std::fs::write(dir.join("search.tsv"), table).unwrap();
    let fastest = best.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "searched best {} at {:.1} ms, the fastest of the top {} at {:.1} ms: ratio {:.3}",
        top[0],
        best[0] * 1e3,
        top.len(),
        fastest * 1e3,
        best[0] / fastest
    );
    println!("record written to {}", dir.display());
    let _ = std::fs::remove_dir_all(&home);
}
