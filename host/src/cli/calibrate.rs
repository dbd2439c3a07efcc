//! `piper calibrate`: measure the CPU runtime on this machine and write the
//! `cpu-local` cluster the simulator then predicts it with.
//!
//! Two real training runs with tracing on: `dp` over the devices (forward,
//! fused backward, gradient all-reduces, optimizer steps) and `zb-h1` over
//! as many pipeline stages (microbatched forwards, split backwards, sends).
//! Every op's trimmed mean time over the steps after the first is fitted by
//! [`crate::sim::calibrate`]; the fitted cluster is checked against the two
//! runs' own step times and written as TOML.

use super::RunArgs;
use crate::compile::compile;
use crate::runtime::{Corpus, TrainOptions, Trainer};
use crate::sim::calibrate::Samples;
use crate::sim::{self, measured, report, Cluster};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

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
}

/// One calibration run: the plan, its measured steps after the first, and
/// their median step time.
struct Run {
    name: String,
    threads: usize,
    plan: crate::compile::plan::Plan,
    steps: Vec<sim::Simulation>,
    median: f64,
}

fn measure(a: &CalibrateArgs, strategy: String) -> Result<Run> {
    let args = RunArgs {
        model: a.model.clone(),
        devices: Some(a.devices),
        strategies: vec![strategy.clone()],
        ..RunArgs::default()
    };
    let p = super::prepare(&args)?;
    let cfg = p.config.model_config()?;
    let plan = compile(&p.dag).context("compiling the plan")?;
    let corpus = Corpus::builtin();
    corpus.check(cfg.vocab, cfg.seq_len as usize)?;
    let opts = TrainOptions {
        trace: true,
        threads: a.threads.map(|t| t as usize),
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
    let trace = trainer.trace_json();
    let threads = trainer.threads();
    let steps = (2..=a.steps)
        .map(|step| Ok(measured::from_trace(&plan, &trace, Some(step))?.sim))
        .collect::<Result<Vec<_>>>()?;
    let mut times: Vec<f64> = steps.iter().map(|s| s.step_time).collect();
    times.sort_by(f64::total_cmp);
    Ok(Run {
        name: strategy,
        threads,
        plan,
        steps,
        median: times[times.len() / 2],
    })
}

/// Total memory of this machine, when the OS says.
fn machine_memory() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

pub fn calibrate(a: CalibrateArgs) -> Result<()> {
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| crate::home::piper_home().join("cpu-local.toml"));
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let d = a.devices;
    eprintln!(
        "calibrating the CPU runtime: {} steps each of dp and zb-h1 on {d} devices",
        a.steps
    );
    let runs = [
        measure(&a, format!("dp:degree={d}"))?,
        measure(&a, format!("zb-h1:microbatches={}", 2 * d))?,
    ];
    if let Some(r) = runs.iter().find(|r| r.median.is_nan() || r.median <= 0.0) {
        bail!("calibration run `{}` measured no time", r.name);
    }
    let mut samples = Samples::default();
    for r in &runs {
        samples.add(&r.plan, &r.steps)?;
    }
    let mut base = Cluster::cpu_local_default();
    if let Some(m) = machine_memory() {
        base.memory_bytes = m;
    }
    // The devices share this machine's cores: as many compute at full
    // speed at once as the cores give each its kernel threads.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let slots = (cores as f64 / runs[0].threads.max(1) as f64).max(1.0);
    base.compute_slots = Some(slots);
    if f64::from(d) > slots {
        eprintln!(
            "note: {d} devices × {} kernel thread(s) share {cores} core(s) while measuring: the fitted rates are of shared cores and the simulator will share them again (calibrate with --devices {} or fewer)",
            runs[0].threads,
            slots.floor()
        );
    }
    let (cluster, fits) = samples.fit(&base)?;
    cluster.validate()?;
    for f in &fits {
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
        cluster.peak_flops / 1e9,
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
    for r in &runs {
        let s = sim::simulate(&r.plan, &cluster)?;
        println!(
            "  {:<24} measured {} (median), simulated {} ({:+.1}%)",
            r.name,
            report::human_time(r.median),
            report::human_time(s.step_time),
            100.0 * (s.step_time / r.median - 1.0)
        );
    }
    let model = runs[0].plan.model.clone();
    let body = toml::to_string(&cluster).context("writing the cluster as TOML")?;
    let text = format!(
        "# This machine's CPU runtime, measured by `piper calibrate` \
         (model `{model}`, {d} devices at once × {} kernel thread(s), {} steps of dp and zb-h1).\n\
         # Read by `--cluster cpu-local` when it is $PIPER_HOME/cpu-local.toml.\n{body}",
        runs[0].threads, a.steps
    );
    std::fs::write(&out, text).with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}
