//! `piper calibrate`: measure the CPU runtime on this machine and write the
//! `cpu-local` cluster the simulator then predicts it with; with `--backend
//! cuda`, this machine's GPUs, fitted to a GPU cluster's device class.
//!
//! Two real training runs with tracing on: `dp` over the devices (forward,
//! fused backward, gradient all-reduces, optimizer steps) and `zb-h1` over
//! as many pipeline stages (microbatched forwards, split backwards, sends).
//! Every op's trimmed mean time over the steps after the first is fitted by
//! [`crate::sim::calibrate`]; the fitted cluster is checked against the two
//! runs' own step times and written as TOML.
//!
//! `--save-traces DIR` keeps what was measured (both traces, the machine's
//! cores, threads and memory); `--from-traces DIR` fits from such a record
//! without running anything, so a calibration can be fitted again on any
//! machine, and the tests check the simulator against a recorded run
//! (`host/tests/data/calibration/`) instead of timing this one.

use super::RunArgs;
use crate::compile::plan::Plan;
use crate::model::ModelConfig;
use crate::runtime::{Corpus, TrainOptions, Trainer};
use crate::sim::calibrate::Samples;
use crate::sim::{self, measured, report, Cluster};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct CalibrateArgs {
    /// The model to measure: a preset (`tiny`, `gpt2-small`) or a model TOML
    /// (default: the default run's). Op rates depend on the sizes: calibrate
    /// with the model you will simulate.
    #[arg(long)]
    model: Option<String>,
    /// Virtual devices running at once (the calibrated times hold for this
    /// many devices sharing this machine's cores).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..=64))]
    devices: u32,
    /// Kernel threads per device (default as `piper train`'s; calibrate
    /// with the count you will train with).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Measured steps per run (the first is left out as warm-up).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(3..=10_000))]
    steps: u32,
    /// Where to write the cluster (default: `$PIPER_HOME/cpu-local.toml`,
    /// which `--cluster cpu-local` reads).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Also keep what was measured (each run's trace and the machine's
    /// figures) in this directory, for `--from-traces`.
    #[arg(long, value_name = "DIR", conflicts_with = "from_traces")]
    save_traces: Option<PathBuf>,
    /// Fit from runs kept by `--save-traces DIR` instead of measuring this
    /// machine: the same cluster, as often as asked, on any machine.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "devices", "threads", "steps", "backend", "gpus", "cluster"])]
    from_traces: Option<PathBuf>,
    /// Measure on `cuda` (this machine's GPUs) instead of the CPU: the
    /// ops are fitted on their shapes to `--cluster`'s device class, and the
    /// cluster written is that one with its pass efficiencies and overheads
    /// measured (default out: `$PIPER_HOME/gpu-local.toml`).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    backend: String,
    /// GPUs the devices are dealt to, with `--backend cuda`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    gpus: u32,
    /// With `--backend cuda`: the cluster (a preset or a TOML file with a
    /// device class) whose efficiencies to fit (default `h100-8x`).
    #[arg(long)]
    cluster: Option<String>,
}

/// One calibration run: the plan, its measured steps after the first, and
/// their median step time.
struct Run {
    name: String,
    plan: crate::compile::plan::Plan,
    steps: Vec<sim::Simulation>,
    median: f64,
}

/// What a calibration measured, as `--save-traces` keeps it and
/// `--from-traces` reads it back: the machine and model it ran, and each
/// run's trace (plan ops only, without the kernels nested in them).
#[derive(Serialize, Deserialize)]
struct Record {
    /// The model measured (preset or model TOML), as `--model` gave it.
    model: Option<String>,
    devices: u32,
    /// Kernel threads per device while measuring.
    threads: usize,
    /// The machine's cores while measuring.
    cores: usize,
    steps: u32,
    /// The machine's memory, when the OS said.
    memory_bytes: Option<f64>,
    /// `cuda` when a GPU was measured (absent: the CPU), and the cluster
    /// its ops are fitted to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    backend: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cluster: Option<String>,
}

/// The two runs calibration measures on `d` devices.
fn strategies(d: u32) -> [String; 2] {
    [
        format!("dp:degree={d}"),
        format!("zb-h1:microbatches={}", 2 * d),
    ]
}

/// File names of a record's parts in its directory.
const RECORD: &str = "calibration.toml";
fn trace_file(strategy: &str) -> String {
    let name = strategy.split(':').next().unwrap_or(strategy);
    format!("{name}.trace.json")
}

/// The plan a calibration run of `strategy` trains.
fn plan_of(model: Option<&str>, devices: u32, strategy: &str) -> Result<(Plan, ModelConfig)> {
    let args = RunArgs {
        model: model.map(str::to_string),
        devices: Some(devices),
        strategies: vec![strategy.to_string()],
        ..RunArgs::default()
    };
    let p = super::prepare(&args)?;
    let cfg = p.config.model_config()?;
    let plan = p.compile()?;
    Ok((plan, cfg))
}

/// Read `trace` onto `plan`: every step after the first (warm-up) as a
/// timeline, and their median time.
fn run_of(name: &str, plan: Plan, trace: &serde_json::Value, steps: u32) -> Result<Run> {
    let steps = (2..=steps)
        .map(|step| {
            measured::from_trace(&plan, trace, Some(step))
                .map(|m| m.sim)
                .with_context(|| format!("reading step {step} of the `{name}` trace"))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut times: Vec<f64> = steps.iter().map(|s| s.step_time).collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    if median.is_nan() || median <= 0.0 {
        bail!("calibration run `{name}` measured no time");
    }
    Ok(Run {
        name: name.to_string(),
        plan,
        steps,
        median,
    })
}

/// Train `strategy` with tracing on: its run and its trace (plan ops only),
/// and the kernel threads per device it used.
fn measure(a: &CalibrateArgs, strategy: &str) -> Result<(Run, serde_json::Value, usize)> {
    let (plan, cfg) = plan_of(a.model.as_deref(), a.devices, strategy)?;
    let corpus = Corpus::builtin();
    corpus.check(cfg.vocab, cfg.seq_len as usize)?;
    let backend =
        crate::runtime::BackendKind::parse(&a.backend, a.gpus).map_err(anyhow::Error::msg)?;
    let opts = TrainOptions {
        trace: true,
        threads: a.threads.map(|t| t as usize),
        backend,
        ..TrainOptions::default()
    };
    let mut trainer = Trainer::new(&cfg, plan.clone(), opts)?;
    for step in 1..=a.steps {
        let batch = corpus.batch(
            step,
            cfg.batch_size as usize,
            cfg.seq_len as usize,
            cfg.vocab,
        )?;
        trainer
            .step(&batch)
            .with_context(|| format!("calibration run `{strategy}`, step {step}"))?;
    }
    let mut trace = trainer.trace_json();
    if let Some(events) = trace["traceEvents"].as_array_mut() {
        events.retain(|e| e["cat"] != "kernel");
    }
    let threads = trainer.threads();
    Ok((run_of(strategy, plan, &trace, a.steps)?, trace, threads))
}

/// Total memory of this machine, when the OS says.
fn machine_memory() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

/// Measure both runs on this machine; with `--save-traces`, keep what was
/// measured there.
fn measure_both(a: &CalibrateArgs) -> Result<(Record, Vec<Run>)> {
    let d = a.devices;
    eprintln!(
        "calibrating the {} runtime: {} steps each of dp and zb-h1 on {d} devices",
        a.backend, a.steps
    );
    let mut runs = Vec::new();
    let mut threads = 1;
    let mut traces = Vec::new();
    for s in strategies(d) {
        let (run, trace, t) = measure(a, &s)?;
        threads = t;
        traces.push((trace_file(&s), trace));
        runs.push(run);
    }
    let record = Record {
        model: a.model.clone(),
        devices: d,
        threads,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        steps: a.steps,
        memory_bytes: machine_memory(),
        backend: (a.backend == "cuda").then(|| a.backend.clone()),
        cluster: (a.backend == "cuda").then(|| a.cluster.clone().unwrap_or("h100-8x".into())),
    };
    if let Some(dir) = &a.save_traces {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
        };
        for (name, trace) in &traces {
            write(name, serde_json::to_string(trace)?)?;
        }
        write(RECORD, toml::to_string(&record)?)?;
        println!("kept the measured runs in {}", dir.display());
    }
    Ok((record, runs))
}

/// Read a kept calibration (`--save-traces DIR`) back: its record and both
/// runs, read onto the plans this build compiles for them.
fn read_back(dir: &Path) -> Result<(Record, Vec<Run>)> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    };
    let record: Record = toml::from_str(&read(RECORD)?)
        .with_context(|| format!("reading {}", dir.join(RECORD).display()))?;
    let within = |v: u64, lo: u64, hi: u64, what: &str| {
        if (lo..=hi).contains(&v) {
            Ok(())
        } else {
            Err(anyhow::anyhow!(
                "{}: {what} = {v} is out of range ({lo} to {hi})",
                dir.join(RECORD).display()
            ))
        }
    };
    within(record.devices.into(), 2, 64, "devices")?;
    within(record.steps.into(), 3, 10_000, "steps")?;
    within(record.threads as u64, 1, 1 << 16, "threads")?;
    within(record.cores as u64, 1, 1 << 16, "cores")?;
    let mut runs = Vec::new();
    for s in strategies(record.devices) {
        let name = trace_file(&s);
        let trace: serde_json::Value = serde_json::from_str(&read(&name)?)
            .with_context(|| format!("reading {}", dir.join(&name).display()))?;
        let (plan, _) = plan_of(record.model.as_deref(), record.devices, &s)
            .with_context(|| format!("the plan of `{s}` for {}", dir.join(RECORD).display()))?;
        let run = run_of(&s, plan, &trace, record.steps).with_context(|| {
            format!(
                "{} does not fit the plan this build compiles for `{s}` (a plan changed since it was recorded: record it again)",
                dir.join(&name).display()
            )
        })?;
        runs.push(run);
    }
    Ok((record, runs))
}

pub fn calibrate(a: CalibrateArgs) -> Result<()> {
    if a.backend == "cpu" && a.cluster.is_some() {
        bail!("--cluster names the GPU cluster to fit: it goes with --backend cuda");
    }
    if a.backend == "cuda" {
        // Before measuring: the cluster the GPU is fitted to.
        gpu_base(a.cluster.as_deref().unwrap_or("h100-8x"), a.devices)?;
    }
    let (record, runs) = match &a.from_traces {
        Some(dir) => read_back(dir)?,
        None => measure_both(&a)?,
    };
    let gpu = record.backend.as_deref() == Some("cuda");
    let out = a.out.clone().unwrap_or_else(|| {
        crate::home::piper_home().join(if gpu {
            "gpu-local.toml"
        } else {
            "cpu-local.toml"
        })
    });
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let d = record.devices;
    if gpu {
        let spec = record.cluster.as_deref().unwrap_or("h100-8x");
        let base = gpu_base(spec, d)?;
        let mut samples = Samples::default();
        for r in &runs {
            samples.add_on(&r.plan, &r.steps, Some(&base))?;
        }
        let (cluster, fits) = samples.fit(&base)?;
        cluster.validate()?;
        let header = format!(
            "# GPUs measured by `piper calibrate --backend cuda` (model `{}`, {d} devices, {} steps of dp and zb-h1), fitted to `{spec}`'s device class.\n",
            runs[0].plan.model, record.steps
        );
        return report_and_write(&cluster, &fits, &runs, &out, header);
    }
    let mut samples = Samples::default();
    for r in &runs {
        samples.add(&r.plan, &r.steps)?;
    }
    let mut base = Cluster::cpu_local_default();
    if let Some(m) = record.memory_bytes.filter(|m| m.is_finite() && *m > 0.0) {
        base.memory_bytes = m;
    }
    // The devices share the machine's cores: as many compute at full
    // speed at once as the cores give each its kernel threads.
    let (cores, threads) = (record.cores.max(1), record.threads.max(1));
    let slots = (cores as f64 / threads as f64).max(1.0);
    base.compute_slots = Some(slots);
    if f64::from(d) > slots {
        eprintln!(
            "note: {d} devices × {} kernel thread(s) share {cores} core(s) while measuring: the fitted rates are of shared cores and the simulator will share them again (calibrate with --devices {} or fewer)",
            threads,
            slots.floor()
        );
    }
    let (cluster, fits) = samples.fit(&base)?;
    cluster.validate()?;
    let model = runs[0].plan.model.clone();
    let header = format!(
        "# A CPU runtime measured by `piper calibrate` \
         (model `{model}`, {d} devices at once × {} kernel thread(s), {} steps of dp and zb-h1).\n\
         # Read by `--cluster cpu-local` when it is $PIPER_HOME/cpu-local.toml.\n",
        threads, record.steps
    );
    report_and_write(&cluster, &fits, &runs, &out, header)
}

/// The cluster a GPU calibration fits: `spec` on `devices`, which must name
/// a device class.
fn gpu_base(spec: &str, devices: u32) -> Result<Cluster> {
    let base = Cluster::resolve(spec, devices)?;
    if base.device.is_none() {
        bail!("cluster `{spec}` has no device class: a GPU is fitted on its ops' shapes (a cluster file names one: device = \"h100-sxm\")");
    }
    Ok(base)
}

/// Print how the fit explains each kind and the runs' steps, and write the
/// cluster to `out` under `header`.
fn report_and_write(
    cluster: &Cluster,
    fits: &[sim::calibrate::Fit],
    runs: &[Run],
    out: &Path,
    header: String,
) -> Result<()> {
    for f in fits {
        println!(
            "  {:<6} {:>4} ops: total {:+.1}%, worst op {:.0}%",
            f.kind,
            f.samples,
            100.0 * f.total_error,
            100.0 * f.worst_error
        );
    }
    println!(
        "  F {:.2} GFLOP/s + {} per op, B {:.2} GFLOP/s + {}, BI {:.2}, BW {:.2} GFLOP/s; AdamW {:.2} GB/s; transfers {} + bytes at {:.2} GB/s",
        cluster.peak_flops * cluster.efficiency.f / 1e9,
        report::human_time(cluster.op_overhead_s.f),
        cluster.peak_flops * cluster.efficiency.b / 1e9,
        report::human_time(cluster.op_overhead_s.b),
        cluster.peak_flops * cluster.efficiency.bi / 1e9,
        cluster.peak_flops * cluster.efficiency.bw / 1e9,
        cluster.memory_bytes_per_s / 1e9,
        report::human_time(cluster.intra_latency_s),
        cluster.intra_bytes_per_s / 1e9
    );
    // The fitted cluster on the runs it came from: whole steps, not ops.
    for r in runs {
        let s = sim::simulate(&r.plan, cluster)?;
        println!(
            "  {:<24} measured {} (median), simulated {} ({:+.1}%)",
            r.name,
            report::human_time(r.median),
            report::human_time(s.step_time),
            100.0 * (s.step_time / r.median - 1.0)
        );
    }
    let body = toml::to_string(cluster).context("writing the cluster as TOML")?;
    let text = format!("{header}{body}");
    std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}
