//! Real `mpirun` jobs of the `piper` binary (feature `mpi`; Open MPI on
//! loopback): the same losses as one process, agreement before the first
//! step, and a killed rank ending the job.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn home(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("piper-mpi-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn mpirun(ranks: u32) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-n", &ranks.to_string()]);
    // CI runs as root; Open MPI refuses that without the flag.
    if is_root() {
        c.arg("--allow-run-as-root");
    }
    c
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("run the command");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// (loss, grad norm) per step of a metrics file; the evaluation loss
/// stands in for the norm on a line with one, so it is compared too.
fn losses(path: &Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .flat_map(|v| {
            let mut out = vec![(
                v["loss"].as_f64().unwrap(),
                v["grad_norm"].as_f64().unwrap(),
            )];
            out.extend(v["eval_loss"].as_f64().map(|e| (e, e)));
            out
        })
        .collect()
}

/// Train `args` for 10 steps in one process and on `ranks` MPI ranks; the
/// losses and norms agree bit for bit (both transports add every element's
/// contributions in device order).
fn same_as_one_process(tag: &str, ranks: u32, args: &[&str]) {
    same_runs(tag, ranks, args, &[]);
}

/// [`same_as_one_process`], with flags only the one-process run gets.
fn same_runs(tag: &str, ranks: u32, args: &[&str], one_only: &[&str]) {
    let h = home(tag);
    let bin = env!("CARGO_BIN_EXE_piper");
    let common: Vec<&str> = ["train", "--steps", "10"]
        .iter()
        .chain(args)
        .copied()
        .collect();
    let one = h.join("one.jsonl");
    run(Command::new(bin)
        .args(&common)
        .args(one_only)
        .args(["--metrics", one.to_str().unwrap()])
        .env("PIPER_HOME", &h));
    let many = h.join("many.jsonl");
    let out = run(mpirun(ranks)
        .args(["-x", &format!("PIPER_HOME={}", h.display())])
        .arg(bin)
        .args(&common)
        .args(["--metrics", many.to_str().unwrap()]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // One job, one summary: rank 0 prints it.
    assert_eq!(stdout.matches("done: 10 steps").count(), 1, "{stdout}");
    let (a, b) = (losses(&one), losses(&many));
    let lines = |p: &Path| std::fs::read_to_string(p).unwrap().lines().count();
    assert_eq!(lines(&one), 10, "{tag}");
    assert_eq!(
        lines(&many),
        10,
        "{tag}: one metrics line per step, from rank 0 only"
    );
    assert_eq!(a.len(), b.len(), "{tag}: the same evaluations");
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            x.0.to_bits() == y.0.to_bits() && x.1.to_bits() == y.1.to_bits(),
            "{tag}, step {}: one process {x:?}, {ranks} ranks {y:?}",
            step + 1
        );
    }
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn dp_on_2_and_4_ranks() {
    // Under mpirun, `--devices` defaults to the world size.
    same_runs("dp", 2, &["--strategy", "dp"], &["--devices", "2"]);
    // Each rank reads its own replica's rows of a memory-mapped token file.
    let h = home("dp4-tokens");
    let text = h.join("text.txt");
    std::fs::write(&text, "a token file read by four ranks. ".repeat(2000)).unwrap();
    let tokens = h.join("tokens.bin");
    run(Command::new(env!("CARGO_BIN_EXE_piper"))
        .args(["data", "tokenize", text.to_str().unwrap(), "--out"])
        .arg(&tokens)
        .env("PIPER_HOME", &h));
    same_as_one_process(
        "dp4",
        4,
        &[
            "--devices",
            "4",
            "--strategy",
            "dp",
            "--data",
            tokens.to_str().unwrap(),
        ],
    );
}

/// The same run on 2 and on 4 ranks.
fn on_2_and_4_ranks(tag: &str, args: &[&str]) {
    for ranks in [2, 4] {
        same_as_one_process(&format!("{tag}-{ranks}"), ranks, args);
    }
}

#[test]
fn one_f_one_b_on_2_and_4_ranks() {
    on_2_and_4_ranks(
        "1f1b",
        &["--devices", "4", "--strategy", "1f1b:microbatches=4"],
    );
}

/// ZeRO-3 over 2 replicas of a 2-stage 1F1B pipeline on 4 devices.
const ZERO3_1F1B: [&str; 6] = [
    "--devices",
    "4",
    "--strategy",
    "zero:stage=3,dp=2",
    "--strategy",
    "1f1b:microbatches=2",
];

#[test]
fn zero3_inside_1f1b_on_2_and_4_ranks() {
    on_2_and_4_ranks("zero3", &ZERO3_1F1B);
    // Evaluation's forward-only plan over the ranks, between steps.
    let eval = [
        &ZERO3_1F1B[..],
        &["--eval-every", "4", "--eval-batches", "2"],
    ]
    .concat();
    same_as_one_process("zero3-eval", 2, &eval);
}

/// Megatron's 3D layout, dp 2 × tp 2 × pp 2 on 8 devices: the
/// tensor-parallel sums, the pipeline's transfers and ZeRO's reductions
/// over each rank's replicas cross the ranks and give one process's bits.
#[test]
fn a_3d_mesh_on_2_and_4_ranks() {
    on_2_and_4_ranks(
        "3d",
        &[
            "--devices",
            "8",
            "--strategy",
            "zero:stage=1,dp=2",
            "--strategy",
            "tp:tp=2",
            "--strategy",
            "1f1b:microbatches=4",
        ],
    );
}

/// bf16 across ranks: pipeline messages, tensor-parallel sums and ZeRO-3's
/// gathers go out two values to a word, fp32 gradients beside them (and,
/// with `reduce = "bf16"`, ZeRO-3's gradient reduce-scatters in bf16 too),
/// and the run is one process's bits.
#[test]
fn bf16_on_2_ranks_is_one_process() {
    same_as_one_process(
        "bf16-3d",
        2,
        &[
            "--precision",
            "bf16",
            "--devices",
            "8",
            "--strategy",
            "zero:stage=1,dp=2",
            "--strategy",
            "tp:tp=2,sequence-parallel=true",
            "--strategy",
            "1f1b:microbatches=4",
        ],
    );
    same_as_one_process(
        "bf16-zero3",
        2,
        &[&["--precision", "bf16"][..], &ZERO3_1F1B].concat(),
    );
    let config = home("bf16-reduce-config").join("run.toml");
    std::fs::write(
        &config,
        "[precision]\nparams = \"bf16\"\nreduce = \"bf16\"\n",
    )
    .unwrap();
    same_as_one_process(
        "bf16-reduce-zero3",
        2,
        &[&["--config", config.to_str().unwrap()][..], &ZERO3_1F1B].concat(),
    );
}

/// Context parallelism across ranks: each attention's ring (cp 2 × dp 2 on
/// 4 devices) and all-gathers and reduce-scatters (tp 2 × cp 2) span both
/// ranks, and so do a MoE model's expert exchanges under cp × dp × ep: one
/// process's bits.
#[test]
fn context_parallel_on_2_ranks_is_one_process() {
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/models/tiny-cp.toml"
    );
    same_as_one_process(
        "cp2-dp2",
        2,
        &[
            "--model",
            model,
            "--devices",
            "4",
            "--strategy",
            "cp:cp=2",
            "--strategy",
            "dp",
        ],
    );
    same_as_one_process(
        "tp2-cp2",
        2,
        &[
            "--model",
            model,
            "--devices",
            "4",
            "--strategy",
            "tp:tp=2",
            "--strategy",
            "cp:cp=2",
        ],
    );
    // Experts spread over dp × cp: the all-to-alls and the sums of the
    // sequences' balance statistics cross the ranks.
    let moe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/models/tiny-moe-cp.toml"
    );
    same_as_one_process(
        "cp2-dp2-ep",
        2,
        &[
            "--model",
            moe,
            "--devices",
            "4",
            "--strategy",
            "cp:cp=2",
            "--strategy",
            "dp",
            "--strategy",
            "ep",
        ],
    );
}

#[test]
fn dualpipev_on_2_and_4_ranks() {
    // DualPipeV needs microbatches ≥ 2 × devices.
    on_2_and_4_ranks(
        "dualpipev",
        &["--devices", "4", "--strategy", "dualpipev:microbatches=8"],
    );
}

/// Expert and tensor parallelism across ranks: the all-to-all of each MoE
/// layer and the tensor-parallel sums (and sequence parallelism's gathers
/// and reduce-scatters) go through MPI (2 ranks, 2 devices; 4
/// devices as EP 2 × 1F1B on 2 ranks: each EP group spans both ranks; dp ×
/// tp × ep on 4) and train as in one process.
#[test]
fn spread_segments_exchange_through_mpi() {
    same_as_one_process("tp2", 2, &["--devices", "2", "--strategy", "tp"]);
    // Sequence parallelism: the all-gathers and reduce-scatters too.
    same_as_one_process(
        "tp2-sp",
        2,
        &["--devices", "2", "--strategy", "tp:sequence-parallel=true"],
    );
    let model = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/models/tiny-moe.toml"
    );
    same_as_one_process(
        "ep2",
        2,
        &["--model", model, "--devices", "2", "--strategy", "ep"],
    );
    same_as_one_process(
        "ep-1f1b",
        2,
        &[
            "--model",
            model,
            "--devices",
            "4",
            "--strategy",
            "ep:ep=2",
            "--strategy",
            "1f1b:microbatches=4",
        ],
    );
    // The exchange inside the expert op (`stream=compute`), and DualPipeV's
    // phase-by-phase overlap of split expert passes, pairs spanning ranks.
    same_as_one_process(
        "ep-in-op",
        2,
        &[
            "--model",
            model,
            "--devices",
            "2",
            "--strategy",
            "ep:stream=compute",
        ],
    );
    same_as_one_process(
        "dp-ep-dualpipev",
        2,
        &[
            "--model",
            model,
            "--devices",
            "4",
            "--strategy",
            "dp:degree=2",
            "--strategy",
            "ep",
            "--strategy",
            "dualpipev:microbatches=4",
        ],
    );
    // Tensor × expert parallelism: the sequence split's all-gathers and
    // gradient sums and the exchange over the dp × tp mesh span the ranks.
    same_as_one_process(
        "dp-tp-ep",
        2,
        &[
            "--model",
            model,
            "--devices",
            "4",
            "--strategy",
            "dp:degree=2",
            "--strategy",
            "tp:tp=2",
            "--strategy",
            "ep",
        ],
    );
}

/// `piper comm check`: every collective over groups of 1 to 5 devices
/// with uneven sizes, in one process and dealt over 2, 3 and 4 ranks
/// (groups inside one rank and spanning several): each result equals the
/// reference bit for bit and each device sent what the direct algorithm
/// states ((N−1)/N of the buffer for a reduce-scatter or an all-gather).
#[test]
fn every_collective_matches_the_reference_and_its_bytes_on_1_to_4_ranks() {
    let bin = env!("CARGO_BIN_EXE_piper");
    let args = ["comm", "check", "--devices", "5"];
    let out = run(Command::new(bin).args(args));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("20 collective runs on 5 devices in this process: every result equals the reference bit for bit"),
        "{stdout}"
    );
    for ranks in [2, 3, 4] {
        let out = run(mpirun(ranks).arg(bin).args(args));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("on 5 devices on {ranks} MPI ranks: every result equals the reference bit for bit, every device sent what the algorithm states")),
            "{ranks} ranks:\n{stdout}"
        );
        // Rank 0 reports every rank's cases, the 5-member ones included.
        for r in 0..ranks {
            assert!(
                stdout.contains(&format!("rank {r}: reduce-scatter   5 members")),
                "{ranks} ranks, rank {r}:\n{stdout}"
            );
        }
    }
}

/// ZeRO-1 and ZeRO-2 (a gradient reduce-scatter per microbatch, then the
/// parameters' all-gather) inside 1F1B across ranks.
#[test]
fn zero_1_and_2_inside_1f1b_on_2_ranks() {
    for stage in ["1", "2"] {
        same_as_one_process(
            &format!("zero{stage}"),
            2,
            &[
                "--devices",
                "4",
                "--strategy",
                &format!("zero:stage={stage},dp=2"),
                "--strategy",
                "1f1b:microbatches=2",
            ],
        );
    }
}

#[test]
fn devices_split_unevenly_across_ranks() {
    // 3 pipeline stages on 2 ranks: rank 0 runs devices 0 and 1, rank 1 device 2.
    same_as_one_process(
        "uneven",
        2,
        &["--devices", "3", "--strategy", "1f1b:microbatches=4"],
    );
}

/// Checkpoint on 4 ranks, resume on 2: the losses of an uninterrupted
/// one-process run, bit for bit; the checkpoint, the step-1 dump and the
/// trace are written once, by rank 0, and hold every device's part.
#[test]
fn checkpoint_on_4_ranks_resume_on_2_equals_an_uninterrupted_run() {
    let h = home("ckpt");
    let bin = env!("CARGO_BIN_EXE_piper");
    let p = |n: &str| h.join(n).to_str().unwrap().to_string();
    let plan = ZERO3_1F1B;
    let env = format!("PIPER_HOME={}", h.display());
    run(Command::new(bin)
        .args(["train", "--steps", "6"])
        .args(plan)
        .args(["--metrics", &p("full.jsonl"), "--dump-step1", &p("one.st")])
        .env("PIPER_HOME", &h));
    run(mpirun(4)
        .args(["-x", &env, bin, "train", "--steps", "3"])
        .args(plan)
        .args([
            "--checkpoint",
            &p("ck"),
            "--checkpoint-every",
            "2",
            "--dump-step1",
            &p("four.st"),
            "--trace",
            &p("trace.json"),
            "--report",
            &p("run.html"),
        ]));
    run(mpirun(2)
        .args(["-x", &env, bin, "train", "--steps", "6"])
        .args(plan)
        .args(["--resume", &p("ck"), "--metrics", &p("resumed.jsonl")]));
    // Every rank took part in each save (step 2, and the last, 3); the
    // resume took `latest`.
    let ck = h.join("ck");
    assert!(ck.join("step-00000002/state.json").exists());
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap().trim(),
        "step-00000003"
    );
    let full = losses(&h.join("full.jsonl"));
    let resumed = losses(&h.join("resumed.jsonl"));
    assert_eq!(resumed, full[3..].to_vec(), "bit for bit");
    // The step-1 dump of 4 ranks is the one-process dump, byte for byte.
    assert_eq!(
        std::fs::read(h.join("four.st")).unwrap(),
        std::fs::read(h.join("one.st")).unwrap()
    );
    // One trace with every device, each named with its rank.
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(h.join("trace.json")).unwrap()).unwrap();
    let names: Vec<String> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        [
            "device 0 (rank 0)",
            "device 1 (rank 1)",
            "device 2 (rank 2)",
            "device 3 (rank 3)"
        ]
    );
    // The run report reads that trace back onto the plan: a lane per device.
    let html = std::fs::read_to_string(h.join("run.html")).unwrap();
    assert!(html.contains("measured on this machine"));
    assert_eq!(html.matches("class=\"lane\"").count(), 4);
    let _ = std::fs::remove_dir_all(&h);
}

#[test]
fn ranks_with_different_plans_stop_before_the_first_step_naming_both_hashes() {
    let h = home("mismatch");
    let bin = env!("CARGO_BIN_EXE_piper");
    let plan_hash = |mb: &str| {
        let out = run(Command::new(bin)
            .args(["plan", "--devices", "2", "--json", "--strategy"])
            .arg(format!("1f1b:microbatches={mb}"))
            .env("PIPER_HOME", &h));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["hash"].as_str().unwrap().to_string()
    };
    let (h4, h2) = (plan_hash("4"), plan_hash("2"));
    assert_ne!(h4, h2);
    // MPMD: rank 0 and rank 1 get different strategy options.
    let mut cmd = mpirun(1);
    let env = format!("PIPER_HOME={}", h.display());
    cmd.args(["-x", &env, bin, "train", "--devices", "2", "--steps", "3"])
        .args([
            "--strategy",
            "1f1b:microbatches=4",
            ":",
            "-n",
            "1",
            "-x",
            &env,
            bin,
        ])
        .args(["train", "--devices", "2", "--steps", "3"])
        .args(["--strategy", "1f1b:microbatches=2"]);
    let start = Instant::now();
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "rank 1 compiled plan {h2} but rank 0 compiled plan {h4}"
        )),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("done:"));
    assert!(start.elapsed() < Duration::from_secs(60));
    let _ = std::fs::remove_dir_all(&h);
}

/// A rank whose run fails (here: its memory cap is too small for its
/// devices' states) prints the error with its rank and ends the job on
/// every rank; nobody waits for it.
#[test]
fn a_rank_that_fails_ends_the_job_with_its_error_and_rank() {
    let h = home("fail");
    let bin = env!("CARGO_BIN_EXE_piper");
    let env = format!("PIPER_HOME={}", h.display());
    let common = [
        "train",
        "--devices",
        "2",
        "--strategy",
        "1f1b:microbatches=4",
    ];
    let start = Instant::now();
    let out = mpirun(1)
        .args(["-x", &env, bin])
        .args(common)
        .args([":", "-n", "1", "-x", &env, bin])
        .args(common)
        .args(["--device-memory", "64KiB"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("error: rank 1: device 1: setup: out of memory"),
        "{err}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("done:"));
    let _ = std::fs::remove_dir_all(&h);
}

/// The pid of the process of `rank` among mpirun's children.
fn rank_pid(mpirun: u32, rank: u32) -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Field 4 (after the parenthesised name) is the parent pid.
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|s| s.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if ppid != Some(mpirun) {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let want = format!("OMPI_COMM_WORLD_RANK={rank}");
        if env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()) {
            return Some(pid);
        }
    }
    None
}

#[test]
fn a_rank_killed_mid_run_ends_the_job_on_every_rank_naming_it() {
    let h = home("kill");
    let bin = env!("CARGO_BIN_EXE_piper");
    let mut child = mpirun(2)
        .args(["-x", &format!("PIPER_HOME={}", h.display())])
        .arg(bin)
        .args([
            "train",
            "--devices",
            "2",
            "--strategy",
            "1f1b:microbatches=4",
        ])
        .args(["--steps", "100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until rank 1 runs, let it train a moment, then kill it.
    let deadline = Instant::now() + Duration::from_secs(60);
    let pid = loop {
        if let Some(p) = rank_pid(child.id(), 1) {
            break p;
        }
        assert!(Instant::now() < deadline, "rank 1 never started");
        std::thread::sleep(Duration::from_millis(200));
    };
    let rank0 = rank_pid(child.id(), 0).expect("rank 0 runs");
    std::thread::sleep(Duration::from_secs(3));
    let killed = Instant::now();
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    // The job ends on every rank within 30 s.
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if killed.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("the job still ran 30 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!status.success(), "{text}");
    assert!(
        text.contains("rank 1") && text.to_lowercase().contains("signal 9"),
        "the message names the killed rank: {text}"
    );
    // Rank 0 does not outlive the job (give the kernel a moment to reap it).
    let gone = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{rank0}/exe")).exists() && Instant::now() < gone {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !Path::new(&format!("/proc/{rank0}/exe")).exists(),
        "rank 0 still runs"
    );
    let _ = std::fs::remove_dir_all(&h);
}
