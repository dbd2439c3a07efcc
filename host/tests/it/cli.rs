//! The `piper` binary as a user runs it.

use std::path::PathBuf;

use common::piper;

use crate::common;

fn home(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("piper-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// `F0 F1 …` steps of a device's compute stream in plan JSON.
fn steps(plan: &serde_json::Value, device: usize) -> String {
    let mut out: Vec<String> = Vec::new();
    let streams = plan["devices"][device]["streams"].as_array().unwrap();
    let compute = streams.iter().find(|s| s["stream"] == "compute").unwrap();
    for op in compute["ops"].as_array().unwrap() {
        let o = op["op"].as_str().unwrap();
        if !["F", "B", "BI", "BW"].contains(&o) {
            continue;
        }
        let s = format!("{o}{}", op["tags"]["MB"]);
        if out.last() != Some(&s) {
            out.push(s);
        }
    }
    out.join(" ")
}

#[test]
fn plan_json_with_bundled_1f1b_has_textbook_orders_and_the_cache_is_reused() {
    let h = home("plan");
    let args = [
        "-v",
        "plan",
        "--model",
        "tiny",
        "--devices",
        "4",
        "--strategy",
        "1f1b:microbatches=8",
        "--json",
    ];
    let (ok, out, err) = piper(&h, &args);
    assert!(ok, "{err}");
    assert!(
        err.contains("compiled in") && err.contains("(cache miss)"),
        "{err}"
    );
    let plan: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        steps(&plan, 0),
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    );
    assert_eq!(
        steps(&plan, 3),
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    );
    // The second run skips compilation.
    let (ok, out2, err) = piper(&h, &args);
    assert!(ok, "{err}");
    assert!(
        err.contains("loaded from the compile cache") && !err.contains("cache miss"),
        "{err}"
    );
    assert_eq!(out, out2, "same DAG, same plan (and hash)");
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn dp_then_1f1b_from_a_run_config_and_a_table_by_default() {
    let h = home("cfg");
    std::fs::create_dir_all(&h).unwrap();
    let cfg = h.join("run.toml");
    std::fs::write(
        &cfg,
        "model = \"tiny\"\ndevices = 8\n[[strategy]]\nname = \"dp\"\noptions = { degree = 2 }\n[[strategy]]\nname = \"1f1b\"\noptions = { microbatches = 8 }\n",
    )
    .unwrap();
    let (ok, out, err) = piper(&h, &["plan", "--config", cfg.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("device 7: peak"), "{out}");
    assert!(out.contains("dp      | all-reduce"), "{out}");
    assert!(
        out.contains("dp@0.1.0 (degree=2)") && out.contains("1f1b@0.1.0 (microbatches=8)"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn bad_input_gets_a_clear_error_not_a_panic() {
    let h = home("bad");
    // Every input: refused, with the expected message, and no panic.
    let check = |args: &[&str], expect: &str| {
        let (ok, _, err) = piper(&h, args);
        assert!(!ok, "{args:?} should fail");
        assert!(
            err.contains(expect),
            "{args:?}: `{err}` should contain `{expect}`"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        err
    };
    check(
        &["plan", "--strategy", "1f1b:microbatches=eight"],
        "option `microbatches` expects an int, got `eight`",
    );
    check(
        &["plan", "--strategy", "nope"],
        "no bundled strategy of that name",
    );
    check(&["plan", "--model", "huge"], "unknown model `huge`");
    // A file that is not WebAssembly: one line naming it and its digest.
    let junk = h.join("junk.wasm");
    std::fs::create_dir_all(&h).unwrap();
    std::fs::write(&junk, "not wasm at all").unwrap();
    let (ok, _, err) = piper(&h, &["plan", "--strategy", junk.to_str().unwrap()]);
    assert!(!ok);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("junk.wasm` (sha256 ")
            && err.contains("not a WebAssembly component (bad magic number"),
        "{err}"
    );
    // Numbers at their extremes, from the command line and from TOML.
    check(
        &[
            "plan",
            "--devices",
            "4",
            "--strategy",
            "1f1b:microbatches=4000000000",
        ],
        "over the host budget `sandbox.max_nodes`",
    );
    let cfg = h.join("huge.toml");
    std::fs::write(
        &cfg,
        "[model]\nname = \"big\"\nlayers = 4\nd_model = 4194304\nheads = 1\nseq_len = 4194304\nvocab = 4194304\nbatch_size = 4194304\n",
    )
    .unwrap();
    check(
        &["plan", "--config", cfg.to_str().unwrap()],
        "the model is too large to describe",
    );
    // A count is bounded before anything is sized from it: one line.
    let cfg = h.join("layers.toml");
    std::fs::write(
        &cfg,
        "[model]\nname = \"deep\"\nlayers = 4000000000\nd_model = 64\nheads = 4\nseq_len = 64\nvocab = 256\nbatch_size = 8\n",
    )
    .unwrap();
    let err = check(
        &["plan", "--config", cfg.to_str().unwrap()],
        "layers must be at most 16384, got 4000000000",
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let cfg = h.join("sandbox.toml");
    std::fs::write(&cfg, "[sandbox]\nmemory_mib = 18446744073709551615\n").unwrap();
    check(
        &["plan", "--config", cfg.to_str().unwrap()],
        "sandbox.memory_mib = 18446744073709551615: must be between",
    );
    let _ = std::fs::remove_dir_all(&h);
}

/// A first run's typos: each refused in milliseconds, before any work, with
/// one message that names the flag and the value, an OS error printed once,
/// and no clap "unexpected argument" for a negative number.
#[test]
fn a_first_runs_rough_edges_read_cleanly() {
    let h = home("rough");
    std::fs::create_dir_all(&h).unwrap();
    let check = |args: &[&str], expect: &str| {
        let start = std::time::Instant::now();
        let (ok, out, err) = piper(&h, args);
        assert!(!ok, "{args:?} should fail: {out}");
        assert!(
            err.contains(expect),
            "{args:?}: `{err}` should contain `{expect}`"
        );
        for bad in ["panicked", "unexpected argument", "backtrace"] {
            assert!(!err.contains(bad), "{args:?}: {err}");
        }
        assert!(err.matches("(os error").count() <= 1, "{args:?}: {err}");
        // No segment of the error chain printed twice in a row.
        let segs: Vec<&str> = err.trim().split(": ").collect();
        assert!(
            segs.windows(2).all(|w| w[0] != w[1]),
            "{args:?}: repeated: {err}"
        );
        assert!(!out.contains("peak"), "{args:?}: nothing ran: {out}");
        // Refused before building, loading or training anything.
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "{args:?} took {:?}",
            start.elapsed()
        );
        err
    };
    check(
        &["train", "--lr", "-1"],
        "--lr must be a positive number, got -1",
    );
    check(
        &["train", "--lr", "NaN"],
        "--lr must be a positive number, got NaN",
    );
    check(
        &["train", "--lr", "0"],
        "--lr must be a positive number, got 0",
    );
    check(
        &["train", "--clip", "-0.5"],
        "--clip must be 0 (off) or a positive number, got -0.5",
    );
    check(
        &["train", "--steps", "0"],
        "invalid value '0' for '--steps <STEPS>': 0 is not in 1..",
    );
    check(
        &["train", "--steps", "-3"],
        "invalid value '-3' for '--steps <STEPS>': -3 is not in 1..",
    );
    check(
        &["plan", "--devices", "-2"],
        "invalid value '-2' for '--devices <DEVICES>': -2 is not in 1..",
    );
    check(
        &["train", "--comm-timeout", "-5"],
        "--comm-timeout must be more than 0",
    );
    check(
        &["train", "--precision", "fp8"],
        "unknown precision `fp8`: choose one of fp32, bf16",
    );
    check(
        &["plan", "--global-batch", "8", "--simulate"],
        "--global-batch, --budget and --search-space shape a --search",
    );
    let missing = h.join("no-such-corpus.txt");
    let err = check(
        &["train", "--data", missing.to_str().unwrap()],
        &format!("cannot read training data {}: ", missing.display()),
    );
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    let err = check(
        &["plan", "--model", h.join("nope.toml").to_str().unwrap()],
        "cannot read model file",
    );
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    check(
        &["train", "--resume", h.join("no-ck").to_str().unwrap()],
        "no such checkpoint directory",
    );
    // Outputs that could not be written are refused before the run, not after.
    let nowhere = h.join("no-such-dir").join("trace.json");
    check(&["train", "--trace", nowhere.to_str().unwrap()], "--trace");
    let nowhere = h.join("no-such-dir").join("run.html");
    check(
        &["train", "--report", nowhere.to_str().unwrap()],
        "--report",
    );
    // `--simulate`'s cluster is read before training, not after.
    let bad = h.join("cluster.toml");
    std::fs::write(&bad, "name = \"x\"\npeak_flops = -1\n").unwrap();
    check(
        &[
            "train",
            "--report",
            h.join("run.html").to_str().unwrap(),
            "--simulate",
            "--cluster",
            bad.to_str().unwrap(),
        ],
        "cluster file",
    );
    check(
        &["train", "--threads", "0"],
        "invalid value '0' for '--threads <THREADS>'",
    );
    // A model whose plan needs hundreds of GiB per device: refused at once
    // against what this machine has, naming both and the flag.
    let huge = h.join("huge.toml");
    std::fs::write(
        &huge,
        "name = \"huge\"\nlayers = 48\nd_model = 16384\nheads = 128\nseq_len = 1024\nvocab = 256\nbatch_size = 8\nlayers_per_region = 1\n",
    )
    .unwrap();
    let start = std::time::Instant::now();
    let err = check(
        &["train", "--model", huge.to_str().unwrap(), "--devices", "1"],
        "device 0 needs ",
    );
    assert!(
        start.elapsed() < std::time::Duration::from_secs(20),
        "refused after {:?}",
        start.elapsed()
    );
    assert!(
        err.contains(" at its predicted peak, but this machine has ")
            && err.contains(" available")
            && err.contains("--device-memory SIZE sets the cap"),
        "{err}"
    );
    std::fs::write(h.join("a-file"), "x").unwrap();
    check(
        &[
            "train",
            "--checkpoint",
            h.join("a-file").join("ck").to_str().unwrap(),
        ],
        "creating checkpoint directory",
    );
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn plugin_info_and_list() {
    let h = home("info");
    let (ok, out, err) = piper(&h, &["plugin", "info", "1f1b"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("1f1b 0.1.0")
            && out.contains("piper:strategy@0.4.0")
            && out.contains("sha256:"),
        "{out}"
    );
    assert!(
        out.contains("microbatches") && out.contains("stages"),
        "{out}"
    );
    // The sandbox limits and host budget in force: defaults, or a config's.
    assert!(
        out.contains("max_host_work        2000000000")
            && out.contains("max_host_bytes       1610612736")
            && out.contains("max_nodes            4000000"),
        "{out}"
    );
    let cfg = h.join("limits.toml");
    std::fs::write(&cfg, "[sandbox]\nmax_nodes = 12345\n").unwrap();
    let (ok, out, err) = piper(
        &h,
        &["plugin", "info", "1f1b", "--config", cfg.to_str().unwrap()],
    );
    assert!(
        ok && out.contains("max_nodes            12345"),
        "{out}{err}"
    );
    let (ok, out, err) = piper(&h, &["plugin", "list"]);
    assert!(ok, "{err}");
    for name in [
        "dp",
        "zero",
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "zb-h1",
        "zbv",
        "interleaved-zb",
        "dualpipev",
        "dualpipe",
    ] {
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().next() == Some(name)),
            "{name} missing: {out}"
        );
    }
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn the_default_train_run_completes_and_the_loss_falls() {
    let h = home("train");
    let metrics = std::env::temp_dir().join(format!("piper-metrics-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&metrics);
    let (ok, out, err) = piper(&h, &["train", "--metrics", metrics.to_str().unwrap()]);
    assert!(ok, "{err}");
    // "done: 150 steps, loss 5.5105 → 1.6430, 6138 tokens/s"
    let line = out
        .lines()
        .find(|l| l.starts_with("done:"))
        .unwrap_or_else(|| panic!("{out}"));
    let nums: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse().ok())
        .collect();
    let (first, last) = (nums[1], nums[2]);
    assert!(last < first - 2.0, "loss {first} → {last}");
    assert!(out.contains("device 3: peak"), "{out}");
    let lines = std::fs::read_to_string(&metrics).unwrap();
    assert_eq!(lines.lines().count(), 150);
    let last_json: serde_json::Value = serde_json::from_str(lines.lines().last().unwrap()).unwrap();
    assert_eq!(last_json["step"], 150);
    assert_eq!(last_json["peak_bytes"].as_array().unwrap().len(), 4);
    let (ok, _, err) = piper(&h, &["train", "--steps", "1", "--device-memory", "2MiB"]);
    assert!(!ok && err.contains("out of memory"), "{err}");
    let _ = std::fs::remove_file(&metrics);
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn checkpoint_resume_trace_and_step1_dump_from_the_cli() {
    let h = home("ckpt");
    std::fs::create_dir_all(&h).unwrap();
    let p = |n: &str| h.join(n).to_str().unwrap().to_string();
    let common = [
        "train",
        "--devices",
        "2",
        "--strategy",
        "1f1b:microbatches=2",
    ];
    let args = |extra: &[String]| -> Vec<String> {
        common
            .iter()
            .map(|s| s.to_string())
            .chain(extra.iter().cloned())
            .collect()
    };
    let run = |a: Vec<String>| {
        let refs: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        let (ok, out, err) = piper(&h, &refs);
        assert!(ok, "{err}");
        out
    };
    run(args(&[
        "--steps".into(),
        "6".into(),
        "--metrics".into(),
        p("full.jsonl"),
    ]));
    run(args(&[
        "--steps".into(),
        "3".into(),
        "--checkpoint".into(),
        p("ck"),
        "--dump-step1".into(),
        p("step1.safetensors"),
        "--trace".into(),
        p("trace.json"),
    ]));
    run(args(&[
        "--steps".into(),
        "6".into(),
        "--resume".into(),
        p("ck"),
        "--metrics".into(),
        p("resumed.jsonl"),
    ]));
    let losses = |f: &str| -> Vec<String> {
        std::fs::read_to_string(h.join(f))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|v| format!("{}:{}", v["step"], v["loss"]))
            .collect()
    };
    assert_eq!(losses("resumed.jsonl"), losses("full.jsonl")[3..].to_vec());
    // In bf16 the checkpoint keeps the fp32 master weights: a run stopped at
    // step `at` and resumed takes the uninterrupted run's steps, with
    // pipelines, tensor parallelism (each rank's slices) and ZeRO.
    let resumes_exactly = |name: &str, layout: &[&str], at: &str, total: &str| {
        let go = |extra: &[&str]| {
            let a = layout
                .iter()
                .chain(&["--precision", "bf16", "--steps"])
                .chain(extra);
            run(a.map(|s| s.to_string()).collect())
        };
        let (full, ck, resumed) = (
            p(&format!("{name}-full.jsonl")),
            p(&format!("{name}-ck")),
            p(&format!("{name}-resumed.jsonl")),
        );
        go(&[total, "--metrics", &full]);
        go(&[at, "--checkpoint", &ck]);
        go(&[total, "--resume", &ck, "--metrics", &resumed]);
        let full = losses(&format!("{name}-full.jsonl"));
        let skip: usize = at.parse().unwrap();
        assert_eq!(
            losses(&format!("{name}-resumed.jsonl")),
            full[skip..].to_vec(),
            "{name}"
        );
        full
    };
    let full = resumes_exactly("bf16", &common, "3", "6");
    assert_ne!(full, losses("full.jsonl"), "bf16 is not fp32");
    resumes_exactly(
        "tp",
        &["train", "--devices", "2", "--strategy", "tp:tp=2"],
        "2",
        "4",
    );
    // ZeRO shards the master weights with the moments: each device's
    // shard leaves in the checkpoint and comes back (ZeRO-1 and, over
    // tensor-parallel slices, ZeRO-3).
    resumes_exactly(
        "zero1",
        &["train", "--devices", "2", "--strategy", "zero:stage=1"],
        "2",
        "4",
    );
    resumes_exactly(
        "zero3-tp",
        &[
            "train",
            "--devices",
            "4",
            "--strategy",
            "tp:tp=2",
            "--strategy",
            "zero:stage=3",
        ],
        "2",
        "4",
    );
    // Resuming at or past `--steps` says so instead of a summary of nothing.
    let out = run(args(&[
        "--steps".into(),
        "3".into(),
        "--resume".into(),
        p("ck"),
    ]));
    assert!(
        out.contains("nothing ran: the checkpoint is at step 3 and --steps 3 is the total"),
        "{out}"
    );
    assert!(!out.contains("measured") && !out.contains("done:"), "{out}");
    // The trace opens as Chrome-trace JSON with complete events per stream.
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(h.join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(events
        .iter()
        .any(|e| e["ph"] == "X" && e["name"].as_str().unwrap().starts_with("F[")));
    assert!(events
        .iter()
        .any(|e| e["ph"] == "M" && e["args"]["name"] == "pp"));
    // The dump holds GPT-2-named weights and gradients, the batch and the loss.
    let bytes = std::fs::read(h.join("step1.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("param.h.0.attn.c_attn.weight").unwrap();
    assert_eq!(w.shape(), &[64, 192]);
    assert_eq!(st.tensor("grad.wte.weight").unwrap().shape(), &[256, 64]);
    assert_eq!(st.tensor("inputs").unwrap().shape(), &[32, 64]);
    let loss = f32::from_le_bytes(st.tensor("loss").unwrap().data().try_into().unwrap());
    assert!((loss - (256f32).ln()).abs() < 0.1, "initial loss {loss}");
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn every_example_config_trains() {
    let h = home("examples");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().and_then(|x| x.to_str()) != Some("toml") {
            continue;
        }
        let cfg = path.to_str().unwrap();
        let (ok, out, err) = piper(&h, &["train", "--config", cfg, "--steps", "2"]);
        assert!(ok && out.contains("done: 2 steps"), "{cfg}: {out}{err}");
        n += 1;
    }
    assert!(n >= 3, "examples found: {n}");
    let _ = std::fs::remove_dir_all(&h);
}

/// The MoE example model trains under a pipeline, and the run says how
/// many expert assignments capacity dropped, in the summary and per step.
#[test]
fn a_moe_model_trains_and_reports_dropped_assignments() {
    let h = home("moe");
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/models/tiny-moe.toml");
    let metrics = h.join("m.jsonl");
    std::fs::create_dir_all(&h).unwrap();
    let (ok, out, err) = piper(
        &h,
        &[
            "train",
            "--model",
            model.to_str().unwrap(),
            "--devices",
            "2",
            "--strategy",
            "1f1b",
            "--steps",
            "3",
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    );
    assert!(ok, "{out}{err}");
    // 3 steps × 16 sequences × 64 tokens × top-2 over 4 layers.
    let routed = 3 * 16 * 64 * 2 * 4;
    let line = out
        .lines()
        .find(|l| l.contains("token-expert assignments dropped"))
        .unwrap_or_else(|| panic!("no expert line: {out}"));
    assert!(
        line.contains(&format!("of {routed} ")) && line.contains("capacity factor 1.25"),
        "{line}"
    );
    let text = std::fs::read_to_string(&metrics).unwrap();
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    let dropped: u64 = rows
        .iter()
        .map(|r| r["moe_dropped"].as_u64().unwrap())
        .sum();
    assert!(rows.iter().all(|r| r["moe_routed"] == routed / 3));
    assert!(
        line.starts_with(&format!("  experts: {dropped} of")),
        "{line} vs {dropped}"
    );
    // A capacity factor that is not a number in range is refused with the field named.
    let bad = h.join("bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&model)
            .unwrap()
            .replace("capacity_factor = 1.25", "capacity_factor = -1.0"),
    )
    .unwrap();
    let (ok, out, err) = piper(
        &h,
        &["plan", "--model", bad.to_str().unwrap(), "--devices", "2"],
    );
    assert!(!ok && err.contains("capacity_factor"), "{out}{err}");
    let _ = std::fs::remove_dir_all(&h);
}

/// `piper backend check` runs every check the GPU machine runs — here on
/// the CPU backend against itself on another thread count, where every
/// kernel gives the same bits — and writes its report.
#[test]
fn backend_check_holds_the_cpu_to_itself_and_writes_its_report() {
    let h = home("backend-check");
    let out = h.join("out");
    let out_s = out.to_str().unwrap();
    let (ok, stdout, err) = piper(
        &h,
        &[
            "backend",
            "check",
            "--backend",
            "cpu",
            "--steps",
            "2",
            "--out",
            out_s,
        ],
    );
    assert!(ok, "{stdout}\n{err}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("check.json")).unwrap()).unwrap();
    assert_eq!(report["failed"], serde_json::json!([]));
    let kernels = report["kernels"].as_array().unwrap();
    assert!(kernels.len() >= 30, "{} kernels", kernels.len());
    assert!(kernels.iter().all(|k| k["error"] == 0.0), "{kernels:?}");
    let strategies = report["strategies"].as_array().unwrap();
    let names: Vec<&str> = strategies
        .iter()
        .map(|s| s["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "1f1b",
            "zero3+1f1b",
            "dualpipev",
            "tp=2",
            "tp=2+sp",
            "ep on 4"
        ]
    );
    assert!(
        stdout.contains("tiny, 2 steps on one cpu device"),
        "{stdout}"
    );
    assert_eq!(report["one_device"]["bitwise_repeat"], true);
    assert!(kernels.iter().any(|k| k["shape"] == "gpt2-small"));
    // bf16: the storage checks among the kernels; tiny in bf16 against the
    // CPU's (itself: the same bits) and ZeRO-3 × 1F1B with bf16 reductions
    // against one device.
    assert!(
        kernels.iter().any(|k| k["kernel"] == "bf16 rounding bits"),
        "{kernels:?}"
    );
    assert_eq!(report["bf16"]["worst"], 0.0, "{}", report["bf16"]);
    let z = &report["bf16"]["zero3_1f1b_reduce_bf16"];
    assert!(z["worst"].as_f64().unwrap() <= 1e-3, "{z}");
    assert!(
        stdout.contains("tiny in bf16, 2 steps on one cpu device"),
        "{stdout}"
    );
}

/// A stage that fails is recorded and the next one runs: on this machine
/// (no GPU, or a build without CUDA) every CUDA stage errs, each named in
/// `check.json`, which is there after every stage.
#[test]
fn backend_check_records_a_failing_stage_and_runs_the_next() {
    let h = home("backend-check-stages");
    let out = h.join("out");
    let (ok, stdout, err) = piper(
        &h,
        &[
            "backend",
            "check",
            "--backend",
            "cuda",
            "--steps",
            "1",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(!ok, "{stdout}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("check.json")).unwrap()).unwrap();
    for stage in ["kernels", "one_device", "strategies", "bf16"] {
        assert!(
            report["errors"][stage]
                .as_str()
                .is_some_and(|e| e.contains("cuda")),
            "{stage}: {report}"
        );
        assert!(
            stdout.contains(&format!("stage {stage}: ERROR")),
            "{stdout}"
        );
    }
    assert!(
        err.contains(
            "4 check(s) failed: stage kernels, stage one_device, stage strategies, stage bf16"
        ),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// `piper backend info` runs a kernel and a matrix product against known
/// results (here on the CPU backend); on CUDA without a GPU or a CUDA
/// build it says what is missing in one line.
#[test]
fn backend_info_checks_known_results_and_names_what_is_missing() {
    let h = home("backend-info");
    let (ok, out, err) = piper(&h, &["backend", "info", "--backend", "cpu"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("matrix product [2x3]·[3x2] + bias: [4.5, 1.0, 10.5, 4.0] ok"),
        "{out}"
    );
    assert!(out.contains("residual kernel x + x: [2.0, 4.0, 6.0, 8.0, 10.0, 12.0] ok"));
    let (ok, _, err) = piper(&h, &["backend", "info", "--backend", "cuda"]);
    assert!(!ok);
    assert!(
        err.contains("built without CUDA") || err.contains("no CUDA driver"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn schedules_resume_mid_warmup_and_mid_decay_exactly() {
    let h = home("sched");
    std::fs::create_dir_all(&h).unwrap();
    let p = |n: &str| h.join(n).to_str().unwrap().to_string();
    let run = |extra: &[&str]| {
        let mut a = vec![
            "train",
            "--devices",
            "2",
            "--strategy",
            "dp",
            "--lr",
            "2e-3",
            "--warmup",
            "4",
            "--schedule",
            "cosine",
            "--min-lr",
            "2e-4",
        ];
        a.extend_from_slice(extra);
        piper(&h, &a)
    };
    let lines = |f: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(h.join(f))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let full = p("full.jsonl");
    let (ok, _, err) = run(&["--steps", "12", "--metrics", &full]);
    assert!(ok, "{err}");
    let full = lines("full.jsonl");
    // The lr of each step is the formula's: warmup 2e-3·s/4, then cosine
    // from 2e-3 (after step 4) to 2e-4 at step 12.
    for v in &full {
        let s = v["step"].as_f64().unwrap();
        let want = if s <= 4.0 {
            2e-3 * s / 4.0
        } else {
            2e-4 + (2e-3 - 2e-4) * 0.5 * (1.0 + (std::f64::consts::PI * (s - 4.0) / 8.0).cos())
        };
        let got = v["lr"].as_f64().unwrap();
        assert!((got - want).abs() < 1e-9, "step {s}: lr {got}, want {want}");
    }
    // Stopped mid-warmup (step 2) and mid-decay (step 7), then resumed:
    // the same losses and rates as the uninterrupted run, bit for bit.
    for at in ["2", "7"] {
        let ck = p(&format!("ck{at}"));
        let (ok, _, err) = run(&["--steps", at, "--schedule-steps", "12", "--checkpoint", &ck]);
        assert!(ok, "{err}");
        let resumed = p(&format!("resumed{at}.jsonl"));
        let (ok, _, err) = run(&["--steps", "12", "--resume", &ck, "--metrics", &resumed]);
        assert!(ok, "{err}");
        let key = |v: &serde_json::Value| format!("{}:{}:{}", v["step"], v["loss"], v["lr"]);
        let n: usize = at.parse().unwrap();
        assert_eq!(
            lines(&format!("resumed{at}.jsonl"))
                .iter()
                .map(key)
                .collect::<Vec<_>>(),
            full[n..].iter().map(key).collect::<Vec<_>>()
        );
    }
    // Resuming under another schedule is refused, naming what differs.
    let ck = p("ck7");
    let (ok, _, err) = piper(
        &h,
        &[
            "train",
            "--devices",
            "2",
            "--strategy",
            "dp",
            "--lr",
            "2e-3",
            "--warmup",
            "2",
            "--schedule",
            "cosine",
            "--min-lr",
            "2e-4",
            "--steps",
            "12",
            "--resume",
            &ck,
        ],
    );
    assert!(!ok, "resumed under another warmup");
    assert!(err.contains("--warmup 2 (the checkpoint's 4)"), "{err}");
    let (ok, _, err) = run(&["--steps", "20", "--resume", &ck]);
    assert!(!ok, "resumed under a longer cosine");
    assert!(err.contains("give --schedule-steps 12"), "{err}");
    // Hostile schedule numbers stop before any work.
    for (bad, want) in [
        (
            vec!["--warmup", "13"],
            "--warmup 13 is longer than the schedule (12 steps)",
        ),
        (vec!["--min-lr", "1"], "above the peak learning rate"),
        (
            vec!["--decay-steps", "13"],
            "--decay-steps 13 must be between 1 and the 12 steps after warmup",
        ),
        (
            vec!["--weight-decay", "-1"],
            "weight decay must be 0 or a positive number",
        ),
    ] {
        let mut a = vec!["train", "--schedule", "wsd", "--steps", "12"];
        a.extend(bad.iter().copied());
        let (ok, _, err) = piper(&h, &a);
        assert!(!ok && err.contains(want), "{bad:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&h);
}

/// Periodic checkpoints survive a crash: a ZeRO-3 run under a warmup +
/// cosine schedule saving every 2 steps is killed (SIGKILL) while its
/// step-4 checkpoint is being written; the resume takes the step-2 one
/// (`latest`), and continues with the uninterrupted run's losses and
/// rates bit for bit. Damaged checkpoints are refused naming the file; a
/// NaN weight stops the run at the first step, with no checkpoint of it.
#[test]
fn a_run_killed_mid_checkpoint_resumes_from_the_previous_one() {
    use piper::runtime::checkpoint::{Checkpoint, PAUSE_ENV};
    let h = home("killed");
    std::fs::create_dir_all(&h).unwrap();
    let p = |n: &str| h.join(n).to_str().unwrap().to_string();
    // Trained on a token file `piper data tokenize` wrote.
    for (name, seed) in [("text", 1u64), ("other", 2)] {
        std::fs::write(h.join(format!("{name}.txt")), sentences(seed, 4000)).unwrap();
        let (ok, out, err) = piper(
            &h,
            &[
                "data",
                "tokenize",
                &p(&format!("{name}.txt")),
                "--out",
                &p(&format!("{name}.bin")),
            ],
        );
        assert!(
            ok && out.contains("uint16 tokens (byte tokenizer"),
            "{out}{err}"
        );
    }
    let tokens = p("text.bin");
    let common: Vec<String> = [
        "train",
        "--data",
        &tokens,
        "--devices",
        "2",
        "--strategy",
        "zero:stage=3",
        "--warmup",
        "2",
        "--schedule",
        "cosine",
        "--steps",
        "6",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let with = |extra: &[&str]| -> Vec<String> {
        let mut a = common.clone();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |a: Vec<String>| {
        let refs: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        piper(&h, &refs)
    };
    let lines = |f: &str| -> Vec<String> {
        std::fs::read_to_string(h.join(f))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|v| format!("{}:{}:{}", v["step"], v["loss"], v["lr"]))
            .collect()
    };
    let (ok, _, err) = run(with(&["--metrics", &p("full.jsonl")]));
    assert!(ok, "{err}");

    let ck = h.join("ck");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_piper"))
        .args(with(&["--checkpoint", &p("ck"), "--checkpoint-every", "2"]))
        .env("PIPER_HOME", &h)
        .env(PAUSE_ENV, "400")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the step-4 checkpoint's first temporary file is on disk
    // (`.step-00000004.PID.N.partial/.model.safetensors.PID.N.tmp`).
    let names = |dir: &std::path::Path| -> Vec<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let named = |p: &std::path::Path, start: &str, end: &str| {
        let n = p.file_name().unwrap().to_string_lossy().into_owned();
        n.starts_with(start) && n.ends_with(end)
    };
    let writing = || {
        names(&ck)
            .iter()
            .filter(|d| named(d, ".step-00000004.", ".partial"))
            .any(|d| {
                names(d)
                    .iter()
                    .any(|f| named(f, ".model.safetensors.", ".tmp"))
            })
    };
    let t = std::time::Instant::now();
    while !writing() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(120),
            "no step-4 checkpoint write began"
        );
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap().trim(),
        "step-00000002"
    );
    assert!(!ck.join("step-00000004").exists());

    let (ok, _, err) = run(with(&[
        "--resume",
        &p("ck"),
        "--checkpoint",
        &p("ck"),
        "--checkpoint-every",
        "2",
        "--metrics",
        &p("resumed.jsonl"),
    ]));
    assert!(ok, "{err}");
    assert!(
        err.contains("step-00000002 (the latest) at step 2"),
        "{err}"
    );
    assert_eq!(lines("resumed.jsonl"), lines("full.jsonl")[2..].to_vec());
    // The killed write's leftovers are gone; steps 4 and 6 are whole.
    assert!(!names(&ck).iter().any(|d| named(d, ".step-", ".partial")));
    assert!(ck.join("step-00000004/state.json").exists());
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap().trim(),
        "step-00000006"
    );

    // A truncated model file is refused, naming it; so are flipped bytes
    // inside a tensor (sizes intact).
    let model = ck.join("step-00000006").join("model.safetensors");
    let good = std::fs::read(&model).unwrap();
    let resume6 = |extra: &[&str]| {
        let mut a = with(&["--resume", &p("ck")]);
        a.iter_mut().for_each(|s| {
            if s == "6" {
                *s = "8".into();
            }
        });
        a.extend(extra.iter().map(|s| s.to_string()));
        run(a)
    };
    std::fs::write(&model, &good[..good.len() - 1000]).unwrap();
    let (ok, _, err) = resume6(&[]);
    assert!(
        !ok && err.contains(&model.display().to_string()) && err.contains("damaged"),
        "{err}"
    );
    let mut flipped = good.clone();
    let at = flipped.len() - 4000;
    flipped[at..at + 10].iter_mut().for_each(|b| *b ^= 0x5a);
    std::fs::write(&model, &flipped).unwrap();
    let (ok, _, err) = resume6(&[]);
    assert!(
        !ok && err.contains("model.safetensors") && err.contains("sha256"),
        "{err}"
    );
    std::fs::write(&model, &good).unwrap();

    // Other data than the checkpoint's is refused, naming both.
    let mut other = with(&["--resume", &p("ck")]);
    other[2] = p("other.bin");
    let (ok, _, err) = run(other);
    assert!(
        !ok && err.contains("the checkpoint was trained on") && err.contains("other.bin"),
        "{err}"
    );

    // A NaN in a weight (the checkpoint's digests made to match it): the
    // run stops at the first step it trains, naming step and tensor, and
    // writes no checkpoint of that state.
    let dir = ck.join("step-00000006");
    let mut bad = Checkpoint::load(&dir).unwrap();
    bad.params.get_mut("h.0.attn.c_proj.weight").unwrap()[7] = f32::NAN;
    bad.save(&dir).unwrap();
    let (ok, _, err) = resume6(&[
        "--schedule-steps",
        "6",
        "--checkpoint",
        &p("ck2"),
        "--checkpoint-every",
        "1",
    ]);
    assert!(!ok, "trained on a NaN weight");
    assert!(
        err.contains("step 7: the loss is NaN")
            && err.contains("parameter `h.0.attn.c_proj.weight` on device"),
        "{err}"
    );
    assert!(
        !h.join("ck2").join("latest").exists(),
        "a checkpoint of the NaN state was written"
    );
    let _ = std::fs::remove_dir_all(&h);
}

/// `words` words of a small generated grammar, different per seed.
fn sentences(seed: u64, words: usize) -> String {
    const W: [&str; 12] = [
        "the", "cat", "sees", "a", "dog", "near", "the", "hill", "and", "river", "runs", ".",
    ];
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..words)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            W[(state % W.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn a_2gib_token_file_trains_in_the_memory_of_a_small_one() {
    let h = home("bigtokens");
    std::fs::create_dir_all(&h).unwrap();
    let p = |n: &str| h.join(n).to_str().unwrap().to_string();
    std::fs::write(h.join("text.txt"), sentences(3, 20_000)).unwrap();
    let (ok, _, err) = piper(
        &h,
        &["data", "tokenize", &p("text.txt"), "--out", &p("small.bin")],
    );
    assert!(ok, "{err}");
    // The same tokens, then zeros (a sparse file) up to 2^30 uint16 tokens:
    // a 2 GiB file whose header counts them all.
    let small = std::fs::read(h.join("small.bin")).unwrap();
    let count: u32 = 1 << 30;
    let mut head = small.clone();
    head[8..12].copy_from_slice(&count.to_le_bytes());
    std::fs::write(h.join("big.bin"), &head).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(h.join("big.bin"))
        .unwrap();
    f.set_len(1024 + 2 * count as u64).unwrap();
    drop(f);
    let peak = |data: &str| {
        let (ok, out, err) = piper(&h, &["train", "--steps", "12", "--data", &p(data)]);
        assert!(ok, "{err}");
        let line = out
            .lines()
            .find_map(|l| l.split("peak resident memory ").nth(1))
            .unwrap_or_else(|| panic!("no resident-memory line: {out}"));
        let (v, unit) = line.split_once(' ').unwrap();
        let mib = v.parse::<f64>().unwrap()
            * match unit {
                "KiB" => 1.0 / 1024.0,
                "MiB" => 1.0,
                "GiB" => 1024.0,
                other => panic!("unit {other}"),
            };
        let losses = out
            .lines()
            .find(|l| l.starts_with("done:"))
            .unwrap()
            .to_string();
        (mib, losses.split(", ").nth(1).unwrap().to_string(), err)
    };
    let (small_mib, small_loss, _) = peak("small.bin");
    let (big_mib, big_loss, err) = peak("big.bin");
    assert!(
        err.contains("1073741824 uint16 tokens, llm.c header"),
        "{err}"
    );
    // The first 12 batches lie in the tokens both files share.
    assert_eq!(big_loss, small_loss);
    assert!(
        big_mib < 200.0 && big_mib < small_mib + 16.0,
        "a 2 GiB token file trained at {big_mib:.1} MiB resident (the small one at {small_mib:.1} MiB)"
    );
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn evaluation_reports_held_out_loss_the_same_under_every_strategy() {
    let h = home("eval");
    std::fs::create_dir_all(&h).unwrap();
    let p = |n: &str| h.join(n).to_str().unwrap().to_string();
    std::fs::write(h.join("val.txt"), sentences(9, 3000)).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let metrics = p(&format!("{name}.jsonl"));
        let mut args = vec!["train", "--steps", "7", "--metrics", &metrics];
        args.extend(extra);
        let (ok, out, err) = piper(&h, &args);
        assert!(ok, "{name}: {err}");
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let evals: Vec<(u64, f64)> = (lines.iter())
            .filter_map(|v| Some((v["step"].as_u64()?, v["eval_loss"].as_f64()?)))
            .collect();
        let losses: Vec<f64> = lines.iter().map(|v| v["loss"].as_f64().unwrap()).collect();
        (evals, losses, out, err)
    };
    let eval = ["--eval-every", "3", "--eval-batches", "2"];
    let (pp, _, out, err) = run("pp", &eval);
    // Every 3 steps and at the last; printed beside the training loss.
    assert_eq!(pp.iter().map(|e| e.0).collect::<Vec<_>>(), [3, 6, 7]);
    assert!(err.contains("step 6: eval loss"), "{err}");
    assert!(
        err.contains("(held out)") && out.contains("eval loss"),
        "{err}{out}"
    );
    assert!(pp[2].1 < pp[0].1, "the held-out loss falls: {pp:?}");
    let zero3 = [&eval[..], &["--devices", "2", "--strategy", "zero:stage=3"]].concat();
    let (z3, ..) = run("zero3", &zero3);
    for ((s, a), (_, b)) in pp.iter().zip(&z3) {
        assert!((a - b).abs() / a < 1e-5, "step {s}: 1f1b {a}, ZeRO-3 {b}");
    }
    // Other evaluation data: training sees all of its data, as without
    // evaluation, and the optimizer is untouched.
    let (_, plain, ..) = run("plain", &[]);
    let val = p("val.txt");
    let (own, with_eval, ..) = run("own", &[&eval[..], &["--eval-data", &val]].concat());
    assert_eq!(with_eval, plain);
    assert_eq!(own.len(), 3);
    assert!(own.iter().zip(&pp).all(|(a, b)| a.1 != b.1));
    let (ok, _, err) = piper(&h, &["train", "--eval-batches", "2"]);
    assert!(!ok && err.contains("--eval-every"), "{err}");
    let _ = std::fs::remove_dir_all(&h);
}

/// `piper plugin verify`: every bundled strategy keeps the math on `tiny`
/// (dense and dropless MoE; a model a plugin cannot plan is skipped), a plan
/// that trains differently fails naming the worst tensor, and a plugin that
/// splits one microbatch alone (which would train some rows twice and others
/// never) is refused by the host, so it planned nothing and fails too.
#[test]
fn plugin_verify_passes_the_bundled_strategies_and_fails_a_plan_that_changes_the_math() {
    let h = home("verify");
    std::fs::create_dir_all(&h).unwrap();
    let bundled = [
        "dp",
        "zero:stage=3",
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "zb-h1",
        "zbv",
        "interleaved-zb",
        "dualpipe",
        "dualpipev",
        "tp",
        "ep",
    ];
    // Two at a time: this machine has two cores.
    for pair in bundled.chunks(2) {
        let runs: Vec<_> = pair
            .iter()
            .map(|p| {
                let h = h.clone();
                let p = p.to_string();
                std::thread::spawn(move || (p.clone(), piper(&h, &["plugin", "verify", &p])))
            })
            .collect();
        for r in runs {
            let (p, (ok, out, err)) = r.join().unwrap();
            assert!(ok, "{p}: {out}{err}");
            assert!(out.contains("\nPASS: `"), "{p}: {out}");
            // At least one model trained under it, every trained one within 1e-5.
            assert!(out.contains("  ok\n"), "{p}: {out}");
            assert!(!out.contains("DIFFERS"), "{p}: {out}");
        }
    }
    // With capacity-limited experts, microbatches route other tokens past
    // capacity than the whole batch does: the router's gradient differs.
    let moe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/models/tiny-moe.toml"
    );
    let (ok, out, err) = piper(
        &h,
        &[
            "plugin",
            "verify",
            "1f1b:microbatches=4",
            "--model",
            moe,
            "--json",
        ],
    );
    assert!(!ok, "{out}");
    assert!(err.contains("does not train like one device"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["passed"], false);
    let m = &v["models"][0];
    assert!(m["grad_diff"].as_f64().unwrap() > 1e-3, "{m}");
    let worst = m["grad_tensor"].as_str().unwrap();
    assert!(worst.contains("mlp"), "{m}");
    assert!(
        v["verdict"].as_str().unwrap().contains(&format!(
            "tiny-moe trains differently than on one device: step-1 gradient of `{worst}` differs by"
        )),
        "{v}"
    );
    // A microbatch split on its own: refused at plan time on every model.
    let hostile = format!(
        "{}/piper_testing_hostile.wasm:mode=part-split",
        env!("PIPER_PLUGINS_WASM_DIR")
    );
    let (ok, out, _) = piper(&h, &["plugin", "verify", &hostile, "--devices", "1"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("FAIL: `hostile@0.1.0`")
            && out.contains("it planned none of the models")
            && out.contains("a split takes the whole model: the filter matches"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&h);
}

/// `piper plan --search` on this machine's virtual devices: every candidate
/// ends one way or another (the counts add up), the best is written as a run
/// config that `plan --config` reproduces (same hash) and `train --config`
/// runs, a candidate called out of memory under a cap is refused by the
/// runtime under that cap, and a cap nothing fits says so with the figures.
#[test]
fn plan_search_finds_writes_and_reproduces_the_best_and_names_what_does_not_fit() {
    let h = home("search");
    std::fs::create_dir_all(&h).unwrap();
    let p = |n: &str| h.join(n).to_str().unwrap().to_string();
    let search = |extra: &[&str]| {
        let mut a = vec![
            "plan",
            "--search",
            "--devices",
            "4",
            "--cluster",
            "cpu-local",
        ];
        a.extend_from_slice(extra);
        piper(&h, &a)
    };
    let (ok, out, err) = search(&["--out", &p("best.toml"), "--report", &p("search.html")]);
    assert!(ok, "{out}{err}");
    // "N candidates in S s (R/s): a cut …, b failed, c over …, d duplicate …, e simulated, f not tried"
    let line = out.lines().find(|l| l.contains(" candidates in ")).unwrap();
    let nums: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit() && c != '.')
        .filter_map(|w| w.parse::<u64>().ok())
        .collect();
    let (total, parts) = (nums[0], &nums[nums.len() - 6..]);
    assert_eq!(parts.iter().sum::<u64>(), total, "{line}");
    assert!(total > 50, "{line}");
    assert!(
        out.contains("#1 ") && out.contains(" beat #2 ") && out.contains("× faster: "),
        "{out}"
    );
    let hash = out
        .lines()
        .find_map(|l| l.split("(plan ").nth(1))
        .map(|s| s[..16].to_string())
        .unwrap_or_else(|| panic!("{out}"));
    let (ok, plan, err) = piper(&h, &["plan", "--config", &p("best.toml"), "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&plan).unwrap();
    assert_eq!(v["hash"], hash.as_str());
    let (ok, out2, err) = piper(&h, &["train", "--config", &p("best.toml"), "--steps", "2"]);
    assert!(ok && out2.contains("done: 2 steps"), "{out2}{err}");
    // A bf16 search writes its policy, and the config plans it again.
    let (ok, out, err) = piper(
        &h,
        &[
            "plan",
            "--search",
            "--devices",
            "2",
            "--cluster",
            "cpu-local",
            "--precision",
            "bf16",
            "--out",
            &p("bf16.toml"),
        ],
    );
    assert!(ok, "{out}{err}");
    let text = std::fs::read_to_string(p("bf16.toml")).unwrap();
    assert!(
        text.contains("[precision]") && text.contains("params = \"bf16\""),
        "{text}"
    );
    let hash = out.lines().find_map(|l| l.split("(plan ").nth(1)).unwrap();
    let (ok, plan, err) = piper(&h, &["plan", "--config", &p("bf16.toml")]);
    assert!(
        ok && plan.starts_with(&format!("plan {}", &hash[..16])),
        "{plan}{err}"
    );
    assert!(plan
        .lines()
        .next()
        .unwrap()
        .ends_with("precision bf16 (fp32 reduce, fp32 master)"));
    let html = std::fs::read_to_string(p("search.html")).unwrap();
    assert!(
        html.contains("#1 ") && html.contains("#2 "),
        "the report stacks the top candidates"
    );
    // A MoE model on the memory-efficient attention: cp and ep compose in
    // the space, and every candidate it offers plans (the plugins' known
    // refusals, such as tp × ep's sequences per microbatch, are left out).
    let moe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/models/tiny-moe-cp.toml"
    );
    let (ok, json, err) = piper(
        &h,
        &[
            "plan",
            "--search",
            "--devices",
            "8",
            "--model",
            moe,
            "--json",
        ],
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let all = v["candidates"].as_array().unwrap();
    let failed: Vec<String> = (all.iter())
        .filter(|c| c["outcome"] == "failed")
        .map(|c| format!("{}: {}", c["candidate"], c["reason"]))
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(
        all.iter().any(|c| {
            let name = c["candidate"].as_str().unwrap_or_default();
            name.contains("cp:cp=") && name.contains("+ep") && c["outcome"] == "simulated"
        }),
        "no cp × ep candidate simulated"
    );

    // Under a cap: what the search calls out of memory, the runtime refuses.
    let (ok, json, err) = search(&["--device-memory", "6MiB", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let over: Vec<String> = (v["candidates"].as_array().unwrap().iter())
        .filter(|c| c["outcome"] == "over-cap" || c["outcome"] == "cut-by-estimate")
        .map(|c| c["candidate"].as_str().unwrap().to_string())
        .collect();
    assert!(!over.is_empty(), "{}", v["summary"]);
    for c in over.iter().step_by(over.len().div_ceil(3)) {
        let mut a = vec![
            "train",
            "--devices",
            "4",
            "--device-memory",
            "6MiB",
            "--steps",
            "1",
        ];
        for s in c.split('+') {
            a.extend(["--strategy", s]);
        }
        let (ok, _, err) = piper(&h, &a);
        assert!(!ok && err.contains("out of memory"), "{c}: {err}");
    }

    // Nothing fits: the smallest peak, the cap and the closest knob.
    let (ok, _, err) = search(&["--device-memory", "64KiB"]);
    assert!(!ok);
    assert!(
        err.contains("nothing fits tiny on cpu-local")
            && err.contains("against the cap 64.00 KiB")
            && err.contains("more devices"),
        "{err}"
    );

    // A plugin of one's own in the space: a component file with its values.
    let space = h.join("space.toml");
    std::fs::write(
        &space,
        format!(
            "bundled = false\n[[plugin]]\nname = \"{}/piper_plugin_zb_h1.wasm\"\nrole = \"pipeline\"\n[plugin.options]\nmicrobatches = [4, 8]\n",
            env!("PIPER_PLUGINS_WASM_DIR")
        ),
    )
    .unwrap();
    let (ok, out, err) = search(&["--search-space", space.to_str().unwrap()]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("2 candidates in "), "{out}");
    assert!(
        out.contains("  1  piper_plugin_zb_h1.wasm:microbatches="),
        "{out}"
    );
    std::fs::write(
        &space,
        "[[plugin]]\nname = \"x\"\nrole = \"pipeline\"\n[plugin.options]\nmicrobatches = []\n",
    )
    .unwrap();
    let (ok, _, err) = search(&["--search-space", space.to_str().unwrap()]);
    assert!(
        !ok && err.contains("option `microbatches` = []: an empty list"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&h);
}

/// Every `piper …` command the README and the docs show (in code blocks,
/// and in inline code that names a command) parses with this CLI: a
/// renamed flag or subcommand fails here, naming the file and line.
/// Placeholders (`DIR`, `N`, `<…>`, `…`) are left out, and prose may name a
/// command without its required arguments (`piper plugin new`).
#[test]
fn every_piper_command_in_the_docs_parses() {
    let files = doc_files();
    let (mut checked, mut failed) = (0, Vec::new());
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (line, cmd, inline) in doc_commands(&text) {
            let Some(args) = shell_words(&cmd) else {
                continue;
            };
            let at = args.iter().position(|a| a == "piper").unwrap();
            let args = &args[at..];
            let placeholder = |a: &String| {
                a.contains('…')
                    || a.contains("...")
                    || a.contains('<')
                    || a.contains('[')
                    || a.contains('|')
                    || (a.len() > 1 && a.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
            };
            if args.iter().any(placeholder) {
                continue;
            }
            checked += 1;
            if let Err(e) = piper::cli::parses(args) {
                let fragment = e.contains("required arguments were not provided")
                    || e.contains("a value is required");
                if inline && fragment {
                    continue;
                }
                let first = e.lines().next().unwrap_or("").to_string();
                failed.push(format!(
                    "{}:{line}: `{}`: {first}",
                    f.display(),
                    args.join(" ")
                ));
            }
        }
    }
    assert!(checked > 40, "only {checked} commands found");
    assert!(
        failed.is_empty(),
        "{} of {checked} commands do not parse:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// The README and every Markdown page of the book (`docs/`, its
/// subdirectories too).
fn doc_files() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// The CLI reference page is the CLI's own: `docs/reference/cli.md` is
/// what `piper::cli::reference` generates from clap's model of the CLI, so
/// a flag added, renamed or re-documented without the page fails here.
/// `PIPER_WRITE_DOCS=1` rewrites the page instead.
#[test]
fn the_cli_reference_is_the_clis_own() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/reference/cli.md");
    let want = piper::cli::reference();
    if std::env::var_os("PIPER_WRITE_DOCS").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        have == want,
        "{} is not the CLI's reference: regenerate it with PIPER_WRITE_DOCS=1 cargo test -p piper --test it cli::the_cli_reference",
        path.display()
    );
    // Every command is in it, with its flags.
    for want in [
        "## `piper train`",
        "`--strategy <NAME[:k=v,...]>`",
        "## `piper plugin verify`",
    ] {
        assert!(have.contains(want), "{want} missing");
    }
}

/// Every relative link in the README and the book leads somewhere: the
/// file or directory exists, and an anchor names a heading of the page it
/// points into (GitHub's and mdBook's ids: lower case, spaces to `-`,
/// punctuation dropped).
#[test]
fn every_internal_link_in_the_docs_resolves() {
    let slug = |h: &str| -> String {
        h.trim()
            .to_lowercase()
            .chars()
            .filter_map(|c| match c {
                ' ' => Some('-'),
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                _ => None,
            })
            .collect()
    };
    let anchors = |text: &str| -> Vec<String> {
        let mut in_code = false;
        let mut out = Vec::new();
        for l in text.lines() {
            if l.trim_start().starts_with("```") {
                in_code = !in_code;
            } else if !in_code && l.starts_with('#') {
                out.push(slug(l.trim_start_matches('#')));
            }
        }
        out
    };
    let (mut checked, mut broken) = (0, Vec::new());
    for f in doc_files() {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut in_code = false;
        for (i, l) in text.lines().enumerate() {
            if l.trim_start().starts_with("```") {
                in_code = !in_code;
                continue;
            }
            if in_code {
                continue;
            }
            let mut rest = l;
            while let Some(at) = rest.find("](") {
                rest = &rest[at + 2..];
                let Some(end) = rest.find(')') else { break };
                let target = &rest[..end];
                rest = &rest[end..];
                if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                    continue;
                }
                checked += 1;
                let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
                let dest = if file.is_empty() {
                    f.clone()
                } else {
                    f.parent().unwrap().join(file)
                };
                let at = format!("{}:{}: ({target})", f.display(), i + 1);
                if !dest.exists() {
                    broken.push(format!("{at}: no such file"));
                } else if !anchor.is_empty() {
                    let page = std::fs::read_to_string(&dest).unwrap_or_default();
                    if !anchors(&page).iter().any(|a| a == anchor) {
                        broken.push(format!("{at}: no heading with that id"));
                    }
                }
            }
        }
    }
    assert!(checked > 30, "only {checked} links found");
    assert!(
        broken.is_empty(),
        "{} broken links:\n{}",
        broken.len(),
        broken.join("\n")
    );
}

/// The configuration reference (`docs/reference/config.md`) is what Piper
/// reads: its run config, model and cluster blocks parse with Piper's own
/// readers (each rejects a key it does not know), and its `[sandbox]` and
/// cluster blocks name every key those readers have.
#[test]
fn the_configuration_reference_is_what_piper_reads() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(root.join("docs/reference/config.md")).unwrap();
    let block = |heading: &str| -> String {
        let at = page
            .find(&format!("## {heading}\n"))
            .unwrap_or_else(|| panic!("no {heading}"));
        let start = page[at..].find("```toml\n").unwrap() + at + 8;
        let end = page[start..].find("```").unwrap() + start;
        page[start..end].to_string()
    };
    let keys = |v: &toml::Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_table().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    let dir = std::env::temp_dir().join(format!("piper-config-ref-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The run config, read as `--config` reads it.
    let run = block("Run config");
    let path = dir.join("run.toml");
    std::fs::write(&path, &run).unwrap();
    let config = piper::session::RunConfig::resolve(&piper::session::Overrides {
        config: Some(path.clone()),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("the run config block: {e:#}"));
    assert_eq!(config.devices, Some(8));
    assert_eq!(config.strategies.len(), 2);
    assert_eq!(
        config.sandbox,
        piper::plugin::SandboxLimits::default(),
        "[sandbox] shows the defaults"
    );
    let sandbox: toml::Value = toml::from_str::<toml::Value>(&run).unwrap()["sandbox"].clone();
    let all = toml::Value::try_from(piper::plugin::SandboxLimits::default()).unwrap();
    assert_eq!(keys(&sandbox), keys(&all), "[sandbox] keys");
    // The model file.
    let model = piper::model::ModelConfig::from_toml_str(&block("Model file"), "config.md")
        .unwrap_or_else(|e| panic!("the model block: {e}"));
    assert!(model.moe.is_some() && model.qk_norm);
    // The cluster file, every key of the preset's (and `compute_slots`,
    // `eager`, which the GPU preset leaves out).
    let cluster = block("Cluster file");
    let path = dir.join("cluster.toml");
    std::fs::write(&path, &cluster).unwrap();
    piper::sim::Cluster::from_file(&path).unwrap_or_else(|e| panic!("the cluster block: {e}"));
    let mut all = toml::Value::try_from(piper::sim::Cluster::h100_8x()).unwrap();
    all.as_table_mut()
        .unwrap()
        .insert("compute_slots".into(), toml::Value::Float(2.0));
    all.as_table_mut()
        .unwrap()
        .insert("eager".into(), toml::Value::Boolean(false));
    assert_eq!(
        keys(&toml::from_str(&cluster).unwrap()),
        keys(&all),
        "cluster keys"
    );
    // A device class: a `[device]` table, every key of a bundled class's.
    let device = block("Device class");
    let table: toml::Value = toml::from_str(&device).unwrap();
    let class: piper::sim::device::DeviceClass = table.clone().try_into().unwrap();
    class.validate().unwrap();
    let bundled = piper::sim::device::DeviceClass::bundled("h100-sxm").unwrap();
    assert_eq!(keys(&table), keys(&toml::Value::try_from(bundled).unwrap()));
    let inline = format!("{cluster}\n[device]\n{device}")
        .replace("device = \"h100-sxm\"", "")
        .replace("[attention]", "[device.attention]");
    std::fs::write(&path, inline).unwrap();
    let read = piper::sim::Cluster::from_file(&path).unwrap();
    assert_eq!(read.device, Some(class));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The plan file's reference (`docs/reference/plan-json.md`) names every
/// key `piper plan --json` writes, and nothing it does not: plans of a
/// pipeline, ZeRO-3, tensor (+ sequence) parallelism, experts, context
/// parallelism and bf16 together write every key once.
#[test]
fn the_plan_file_reference_names_every_key_a_plan_writes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let page = std::fs::read_to_string(root.join("docs/reference/plan-json.md")).unwrap();
    // The first column of the table under `## {heading}`.
    let documented = |heading: &str| -> std::collections::BTreeSet<String> {
        let at = page.find(&format!("## {heading}\n")).unwrap();
        let mut keys = std::collections::BTreeSet::new();
        for l in page[at..]
            .lines()
            .skip(1)
            .skip_while(|l| !l.starts_with('|'))
        {
            if !l.starts_with('|') {
                break;
            }
            let cell = l.split('|').nth(1).unwrap();
            keys.extend(cell.split('`').skip(1).step_by(2).map(String::from));
        }
        keys.remove("key");
        keys
    };
    let h = std::env::temp_dir().join(format!("piper-plan-ref-{}", std::process::id()));
    let mut seen = [(); 3].map(|_| std::collections::BTreeSet::new());
    let models = root.join("examples/models");
    let moe = models.join("tiny-moe.toml");
    let cp = models.join("tiny-cp.toml");
    let runs: [&[&str]; 6] = [
        &[
            "--model",
            "tiny",
            "--devices",
            "2",
            "--strategy",
            "1f1b:microbatches=2",
        ],
        &[
            "--model",
            "tiny",
            "--devices",
            "4",
            "--strategy",
            "zero:stage=3,dp=2",
            "--strategy",
            "1f1b:microbatches=2",
        ],
        &[
            "--model",
            "tiny",
            "--devices",
            "2",
            "--strategy",
            "tp:tp=2,sequence-parallel=true",
            "--precision",
            "bf16",
        ],
        &[
            "--model",
            moe.to_str().unwrap(),
            "--devices",
            "2",
            "--strategy",
            "ep",
        ],
        &[
            "--model",
            cp.to_str().unwrap(),
            "--devices",
            "2",
            "--strategy",
            "cp:cp=2",
        ],
        &[
            "--model",
            "tiny",
            "--devices",
            "2",
            "--strategy",
            "zbv:microbatches=2",
            "--strategy",
            "recompute",
        ],
    ];
    for args in runs {
        let mut all = vec!["plan"];
        all.extend_from_slice(args);
        all.push("--json");
        let (ok, out, err) = piper(&h, &all);
        assert!(ok, "{all:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        seen[0].extend(v.as_object().unwrap().keys().cloned());
        for d in v["devices"].as_array().unwrap() {
            seen[1].extend(d.as_object().unwrap().keys().cloned());
            for s in d["streams"].as_array().unwrap() {
                for op in s["ops"].as_array().unwrap() {
                    seen[2].extend(op.as_object().unwrap().keys().cloned());
                }
            }
        }
    }
    // A mixed layout's relayout (`layouts.rs`): regions on one device
    // feeding regions replicated over two.
    let mixed = crate::fuzz::Program {
        model: crate::fuzz::Model::Gpt2,
        devices: 2,
        calls: (0..4)
            .map(|r| crate::fuzz::Call::Replicate {
                f: crate::fuzz::F::pp(r),
                devices: if r == 0 || r == 3 {
                    vec![0]
                } else {
                    vec![0, 1]
                },
                zero: 0,
            })
            .collect(),
    };
    let mut dag =
        piper::dag::TrainingDag::build(&mixed.model.config(), piper::dag::Cluster::new(2)).unwrap();
    mixed.apply(&mut dag).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&piper::compile::compile(&dag).unwrap().to_json()).unwrap();
    for d in v["devices"].as_array().unwrap() {
        for s in d["streams"].as_array().unwrap() {
            for op in s["ops"].as_array().unwrap() {
                seen[2].extend(op.as_object().unwrap().keys().cloned());
            }
        }
    }
    for (heading, seen) in ["The plan", "A device", "An op"].iter().zip(&seen) {
        assert_eq!(
            &documented(heading),
            seen,
            "{heading}: documented keys vs the keys plans write"
        );
    }
    let _ = std::fs::remove_dir_all(&h);
}

/// `(line, command, inline)` of each `piper` command: the lines of shell
/// code blocks (continuations joined, comments dropped) that run `piper`
/// (not `cargo` or one of `scripts/`, which take `-p piper`), and inline
/// code spans that start with `piper ` and a subcommand.
fn doc_commands(text: &str) -> Vec<(usize, String, bool)> {
    let mut out = Vec::new();
    let (mut in_code, mut shell, mut pending): (bool, bool, Option<(usize, String)>) =
        (false, false, None);
    for (i, l) in text.lines().enumerate() {
        let t = l.trim_start();
        if t.starts_with("```") {
            in_code = !in_code;
            let lang = t.trim_start_matches('`');
            shell = in_code && matches!(lang, "" | "sh" | "bash" | "shell" | "console");
            continue;
        }
        if in_code {
            if !shell {
                continue;
            }
            let body = match t.find(" #") {
                Some(k) if !t[..k].contains('"') && !t[..k].contains('\'') => &t[..k],
                _ => t,
            };
            let (line, mut cmd) = pending.take().unwrap_or((i + 1, String::new()));
            cmd.push_str(body.trim_end_matches('\\'));
            cmd.push(' ');
            if body.trim_end().ends_with('\\') {
                pending = Some((line, cmd));
            } else if cmd.split_whitespace().any(|w| w == "piper")
                && !cmd.contains("cargo ")
                && !cmd.contains("scripts/")
            {
                out.push((line, cmd, false));
            }
            continue;
        }
        for (k, span) in l.split('`').enumerate() {
            if k % 2 == 1 && span.starts_with("piper ") && span.split_whitespace().count() > 2 {
                out.push((i + 1, span.to_string(), true));
            }
        }
    }
    out
}

/// A shell line's words (single and double quotes; no expansions): `None`
/// for a line with pipes, redirections or variables.
fn shell_words(line: &str) -> Option<Vec<String>> {
    if line.contains('$') || line.contains('>') || line.contains("&&") || line.contains(';') {
        return None;
    }
    let (mut words, mut cur, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    for ch in line.chars() {
        match (quote, ch) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(ch);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if any || !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            (None, c) => cur.push(c),
        }
    }
    if any || !cur.is_empty() {
        words.push(cur);
    }
    (quote.is_none() && words.iter().any(|w| w == "piper")).then_some(words)
}

/// A pipeline message between two devices of this process hands the tensor
/// over; `PIPER_HOST_MESSAGES=1` sends it through the host, packed in its
/// dtype, instead. Both train the same bits (bf16 messages included) and
/// count the same bytes sent.
#[test]
fn messages_handed_over_or_through_the_host_train_the_same_bits() {
    let run = |through_host: bool| {
        let h = home(&format!("messages-{through_host}"));
        let metrics = h.join("m.jsonl");
        std::fs::create_dir_all(&h).unwrap();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_piper"));
        cmd.args(["train", "--precision", "bf16", "--devices", "4"])
            .args(["--strategy", "1f1b:microbatches=4", "--steps", "3"])
            .args(["--metrics", metrics.to_str().unwrap()])
            .env("PIPER_HOME", &h);
        if through_host {
            cmd.env("PIPER_HOST_MESSAGES", "1");
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let field = |l: &str, k: &str| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v[k].to_string()
        };
        let lines = std::fs::read_to_string(&metrics).unwrap();
        let got: Vec<(String, String)> = lines
            .lines()
            .map(|l| (field(l, "loss"), field(l, "comm_bytes")))
            .collect();
        let _ = std::fs::remove_dir_all(&h);
        got
    };
    let (handed, host) = (run(false), run(true));
    assert_eq!(handed.len(), 3);
    for ((loss_a, bytes_a), (loss_b, bytes_b)) in handed.iter().zip(&host) {
        assert_eq!(loss_a, loss_b, "the losses, bit for bit");
        // The host's bf16 messages carry a 4-byte head each (so the two
        // runs took different paths).
        let parse = |s: &str| -> Vec<f64> { serde_json::from_str(s).unwrap() };
        for (a, b) in parse(bytes_a).into_iter().zip(parse(bytes_b)) {
            assert!(
                a > 0.0 && a < b && b - a < 1e-3 * b,
                "sent {a} handed, {b} through the host"
            );
        }
    }
}
