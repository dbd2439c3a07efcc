//! Calibrated prediction against a recorded measurement: `piper calibrate
//! --from-traces` fits the cluster from runs measured once and kept in
//! `tests/data/calibration/` (by `scripts/record-calibration.sh`), and the
//! simulator on that cluster must predict the recorded `1f1b` and `dp` runs
//! on 2 CPU devices within 15%, and its search's best must be within 10% of
//! the fastest recorded of its top 5. Nothing here times this machine: the
//! live comparison is `cargo bench -p piper --bench calibrate`, which prints
//! the same ratios and writes such a record.

use std::path::{Path, PathBuf};

use crate::common;

/// The kept record.
fn record() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/calibration")
}

/// What to do when the record no longer fits this build.
const RERECORD: &str = "record it again with scripts/record-calibration.sh";

/// `piper ARGS`, which must succeed: its standard output.
fn piper(home: &Path, args: &[&str]) -> String {
    let (ok, out, err) = common::piper(home, args);
    assert!(ok, "piper {args:?}: {err}");
    out
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("piper-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
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

/// The median step time of a `tiny` run's `--metrics` file (tokens per
/// step ÷ tokens/s), the first step (warm-up) left out.
fn median_step(metrics: &Path) -> f64 {
    let text = std::fs::read_to_string(metrics)
        .unwrap_or_else(|e| panic!("{}: {e}: {RERECORD}", metrics.display()));
    let mut steps: Vec<f64> = text
        .lines()
        .skip(1)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (32 * 64) as f64 / v["tokens_per_s"].as_f64().unwrap()
        })
        .collect();
    assert!(steps.len() >= 3, "{}: too few steps", metrics.display());
    steps.sort_by(f64::total_cmp);
    steps[steps.len() / 2]
}

/// The cluster fitted from the kept record, written to `dir/cpu.toml`.
fn fitted(home: &Path, dir: &Path) -> PathBuf {
    let cluster = dir.join("cpu.toml");
    let out = piper(
        home,
        &[
            "calibrate",
            "--from-traces",
            record().to_str().unwrap(),
            "--out",
            cluster.to_str().unwrap(),
        ],
    );
    assert!(out.contains("wrote"), "{out}");
    cluster
}

/// The simulator's step time for `strategies` on `devices` devices of `cluster`.
fn simulated(home: &Path, cluster: &Path, devices: u32, strategies: &[&str]) -> f64 {
    let devices = devices.to_string();
    let mut args = vec!["plan", "--model", "tiny", "--devices", &devices];
    for s in strategies {
        args.extend(["--strategy", s]);
    }
    args.extend(["--simulate", "--cluster", cluster.to_str().unwrap()]);
    let out = piper(home, &args);
    let line = (out.lines())
        .find(|l| l.starts_with("simulated on "))
        .unwrap_or_else(|| panic!("no simulation line: {out}"));
    seconds(
        line.split("step ")
            .nth(1)
            .unwrap()
            .split(',')
            .next()
            .unwrap(),
    )
}

#[test]
fn a_kept_calibration_predicts_its_recorded_1f1b_and_dp_runs_within_15_percent() {
    let dir = scratch("calibrate");
    let home = dir.join("home");
    let cluster = fitted(&home, &dir);
    let text = std::fs::read_to_string(&cluster).unwrap();
    assert!(
        text.contains("[op_overhead_s]") && text.contains("peak_flops"),
        "{text}"
    );
    // Fitting is a function of the record: the same file every time.
    let again = dir.join("again");
    std::fs::create_dir_all(&again).unwrap();
    let text2 = std::fs::read_to_string(fitted(&home, &again)).unwrap();
    assert_eq!(text, text2, "two fits of one record differ");
    for (strategy, file) in [
        ("1f1b:microbatches=4", "1f1b.metrics.jsonl"),
        ("dp:degree=2", "dp.metrics.jsonl"),
    ] {
        let measured = median_step(&record().join(file));
        let predicted = simulated(&home, &cluster, 2, &[strategy]);
        let error = predicted / measured - 1.0;
        eprintln!(
            "{strategy}: recorded median {:.1} ms, simulated {:.1} ms ({:+.1}%)",
            measured * 1e3,
            predicted * 1e3,
            error * 100.0
        );
        assert!(
            error.abs() <= 0.15,
            "{strategy}: simulated {predicted:.4} s vs recorded median {measured:.4} s ({:+.1}%); if the runtime changed speed, {RERECORD}",
            error * 100.0
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_search_on_a_kept_calibration_picks_within_10_percent_of_the_fastest_recorded_of_its_top_5() {
    let dir = scratch("search-recorded");
    let home = dir.join("home");
    let cluster = fitted(&home, &dir);
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
    let top: Vec<&str> = (v["top"].as_array().unwrap().iter())
        .map(|c| c.as_str().unwrap())
        .collect();
    assert_eq!(top.len(), 5, "{}", v["summary"]);
    // Each candidate's median step, measured in turn over three rounds,
    // its fastest round kept (the bench's record).
    let table = std::fs::read_to_string(record().join("search.tsv")).unwrap();
    let recorded = |c: &str| -> f64 {
        let line = (table.lines())
            .find(|l| l.split('\t').next() == Some(c))
            .unwrap_or_else(|| panic!("the search's top 5 {top:?} name `{c}`, which the record does not hold: the search changed its candidates; {RERECORD}"));
        line.split('\t').nth(1).unwrap().parse().unwrap()
    };
    let times: Vec<f64> = top.iter().map(|c| recorded(c)).collect();
    let fastest = times.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(
        times[0] <= 1.10 * fastest,
        "the searched best {} was recorded at {:.1} ms, the fastest of its top 5 at {:.1} ms: {:?}",
        top[0],
        times[0] * 1e3,
        fastest * 1e3,
        top.iter().zip(&times).collect::<Vec<_>>()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_kept_record_that_no_longer_fits_its_plans_is_refused_naming_the_file() {
    let dir = scratch("calibrate-stale");
    let home = dir.join("home");
    let stale = dir.join("record");
    std::fs::create_dir_all(&stale).unwrap();
    for f in ["calibration.toml", "dp.trace.json", "zb-h1.trace.json"] {
        std::fs::copy(record().join(f), stale.join(f)).unwrap();
    }
    // Recorded on 2 devices, read as if on 4: the plans have other ops.
    let meta = std::fs::read_to_string(stale.join("calibration.toml")).unwrap();
    std::fs::write(
        stale.join("calibration.toml"),
        meta.replace("devices = 2", "devices = 4"),
    )
    .unwrap();
    let args = ["calibrate", "--from-traces", stale.to_str().unwrap()];
    let (ok, _, err) = common::piper(&home, &args);
    assert!(!ok);
    assert!(
        err.contains("dp.trace.json") && err.contains("record it again"),
        "{err}"
    );
    // A hostile count is refused before anything is sized.
    std::fs::write(
        stale.join("calibration.toml"),
        meta.replace("devices = 2", "devices = 4000000000"),
    )
    .unwrap();
    let (ok, _, err) = common::piper(&home, &args);
    assert!(!ok);
    assert!(
        err.contains("devices = 4000000000 is out of range"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GPU calibration is fitted to a cluster with a device class: one
/// without is refused before anything runs (and in a kept record), `--cluster`
/// without `--backend cuda` is refused, and a record marked as measured on
/// `cuda` is refitted on its ops' shapes to the H100 class (this machine's
/// CPU traces read as an H100's: every pass below the H100's full rate for
/// its shapes).
#[test]
fn a_gpu_calibration_fits_a_device_class_and_refuses_a_cluster_without_one() {
    let dir = scratch("calibrate-gpu");
    let home = dir.join("home");
    let (ok, _, err) = common::piper(&home, &["calibrate", "--cluster", "h100-8x"]);
    assert!(!ok && err.contains("goes with --backend cuda"), "{err}");
    let args = ["calibrate", "--backend", "cuda", "--cluster", "cpu-local"];
    let (ok, _, err) = common::piper(&home, &args);
    assert!(
        !ok && err.contains("`cpu-local` has no device class"),
        "{err}"
    );
    let kept = dir.join("record");
    std::fs::create_dir_all(&kept).unwrap();
    for f in ["calibration.toml", "dp.trace.json", "zb-h1.trace.json"] {
        std::fs::copy(record().join(f), kept.join(f)).unwrap();
    }
    let meta = std::fs::read_to_string(kept.join("calibration.toml")).unwrap();
    let out = dir.join("gpu.toml");
    let args = [
        "calibrate",
        "--from-traces",
        kept.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    std::fs::write(
        kept.join("calibration.toml"),
        format!("{meta}backend = \"cuda\"\ncluster = \"cpu-local\"\n"),
    )
    .unwrap();
    let (ok, _, err) = common::piper(&home, &args);
    assert!(!ok && err.contains("has no device class"), "{err}");
    std::fs::write(
        kept.join("calibration.toml"),
        format!("{meta}backend = \"cuda\"\ncluster = \"h100-8x\"\n"),
    )
    .unwrap();
    piper(&home, &args);
    let fitted = piper::sim::Cluster::from_file(&out).unwrap();
    assert_eq!(
        fitted.device.as_ref().map(|d| d.name.as_str()),
        Some("h100-sxm")
    );
    let e = &fitted.efficiency;
    assert!(
        [e.f, e.b, e.bi, e.bw].iter().all(|x| *x > 0.0 && *x < 1.0),
        "{e:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_training_report_draws_the_measured_step_beside_the_prediction() {
    let dir = scratch("calibrate-report");
    let home = dir.join("home");
    let cluster = fitted(&home, &dir);
    let report = dir.join("r.html");
    piper(
        &home,
        &[
            "train",
            "--model",
            "tiny",
            "--devices",
            "2",
            "--strategy",
            "1f1b:microbatches=4",
            "--steps",
            "3",
            "--report",
            report.to_str().unwrap(),
            "--simulate",
            "--cluster",
            cluster.to_str().unwrap(),
        ],
    );
    // One lane per device for the measured step and for the prediction.
    let html = std::fs::read_to_string(&report).unwrap();
    assert!(
        html.contains("measured on this machine") && html.contains("predicted by the simulator")
    );
    assert_eq!(html.matches("class=\"lane\"").count(), 4);
    let _ = std::fs::remove_dir_all(&dir);
}
