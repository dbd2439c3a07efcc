//! `piper plan --simulate`: time the compiled plan on a described cluster,
//! print the figures, and write the trace, the SVG timeline or the HTML report.

use super::RunArgs;
use crate::compile::compile;
use crate::compile::plan::Plan;
use crate::sim::{self, report, Cluster};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Clone, Default)]
pub struct SimArgs {
    /// Time the plan on a cluster instead of only printing it.
    #[arg(long)]
    pub simulate: bool,
    /// `h100-8x`, `h100-cluster[:NODES]`, `h200-1`, `cpu-local` or a TOML
    /// file (default: `h100-8x`, or `h100-cluster` with enough nodes); with
    /// `--simulate` or `--search`.
    #[arg(long)]
    pub cluster: Option<String>,
    /// Write the simulated timeline as Chrome-trace JSON (Perfetto).
    #[arg(long, requires = "simulate")]
    pub trace: Option<PathBuf>,
    /// Write the simulated timeline as SVG.
    #[arg(long, requires = "simulate")]
    pub svg: Option<PathBuf>,
    /// Write a self-contained HTML report: timeline, memory over time,
    /// summary (with `--search`: the top candidates stacked).
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Compare candidates on one cluster: each a strategy list joined by `+`
    /// (`zero:stage=1+1f1b:microbatches=8`) or a run config file; repeat
    /// for each. `--model`/`--devices` apply to all. One row per candidate;
    /// `--report` stacks their timelines on one time axis.
    #[arg(long, requires = "simulate", value_name = "STRATEGIES|CONFIG", conflicts_with_all = ["trace", "svg"])]
    pub compare: Vec<String>,
    /// Memory each device may hold (`80GiB`; default: the cluster's): what
    /// `fits` judges with `--simulate` and `--compare`, and `--search` cuts by.
    #[arg(long, value_name = "SIZE")]
    pub device_memory: Option<String>,
}

impl SimArgs {
    /// The cluster to time on, with `--device-memory` as its memory.
    fn cluster(&self, devices: u32) -> Result<Cluster> {
        let mut c = cluster_for(self.cluster.as_deref(), devices)?;
        if let Some(s) = &self.device_memory {
            c.memory_bytes = crate::session::parse_size(s)? as f64;
        }
        Ok(c)
    }
}

/// The cluster a plan over `devices` is simulated on.
pub fn cluster_for(spec: Option<&str>, devices: u32) -> Result<Cluster> {
    let spec = spec.unwrap_or(if devices <= 8 {
        "h100-8x"
    } else {
        "h100-cluster"
    });
    let c = Cluster::resolve(spec, devices)?;
    if c.devices() < u64::from(devices) {
        bail!(
            "cluster `{}` has {} devices ({} nodes × {}), the plan needs {devices}",
            c.name,
            c.devices(),
            c.nodes,
            c.devices_per_node
        );
    }
    Ok(c)
}

/// `h100-8x (1 × 8 devices, 989 TFLOP/s peak, 80 GB)`.
fn describe(c: &Cluster) -> String {
    format!(
        "{} ({} × {} devices, {:.0} TFLOP/s peak, {:.0} GB)",
        c.name,
        c.nodes,
        c.devices_per_node,
        c.peak_flops / 1e12,
        c.memory_bytes / 1e9
    )
}

/// Simulate, print, and write what was asked for. `title` names the run.
pub fn run(plan: &Plan, args: &SimArgs, title: &str) -> Result<sim::Simulation> {
    let cluster = args.cluster(plan.devices.len() as u32)?;
    let t = std::time::Instant::now();
    let s = sim::simulate(plan, &cluster).context("simulating the plan")?;
    let took = t.elapsed();
    println!(
        "simulated on {}: step {}, bubble {:.1}% ({} ops in {:.0} ms)",
        describe(&cluster),
        report::human_time(s.step_time),
        s.bubble * 100.0,
        s.ops,
        took.as_secs_f64() * 1e3
    );
    println!(
        "  {:>6}  {:>12}  {:>20}  {:>28}  {:>10}  {:>4}",
        "device", "busy", "idle", "exposed comm", "peak mem", "fits"
    );
    let rows = report::summary_rows(&s, Some(cluster.memory_bytes));
    let shown = rows.len().min(32);
    for r in &rows[..shown] {
        println!(
            "  {:>6}  {:>12}  {:>20}  {:>28}  {:>10}  {:>4}",
            r[0], r[1], r[2], r[3], r[4], r[5]
        );
    }
    if rows.len() > shown {
        println!(
            "  … {} more devices (the report lists them all)",
            rows.len() - shown
        );
    }
    let write = |path: &PathBuf, text: String| {
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    };
    if let Some(p) = &args.trace {
        write(p, report::chrome_trace(&s))?;
    }
    if let Some(p) = &args.svg {
        write(p, report::timeline_svg(&s, title))?;
    }
    if let Some(p) = &args.report {
        write(
            p,
            report::html(
                &format!("Piper plan report — {title}"),
                &[report::Section {
                    title: format!("{title} on {}", cluster.name),
                    sim: &s,
                    capacity: Some(cluster.memory_bytes),
                    source: format!("simulated on {}", cluster.name),
                }],
            ),
        )?;
    }
    Ok(s)
}

/// The run one `--compare` candidate describes, on top of the command's flags.
fn candidate_args(base: &RunArgs, candidate: &str) -> Result<RunArgs> {
    let path = std::path::Path::new(candidate);
    if candidate.ends_with(".toml") || path.is_file() {
        if !path.is_file() {
            bail!("candidate `{candidate}`: no such run config file");
        }
        return Ok(RunArgs {
            config: Some(path.to_path_buf()),
            strategies: Vec::new(),
            lock: None,
            ..base.clone()
        });
    }
    let strategies: Vec<String> = candidate.split('+').map(|s| s.trim().to_string()).collect();
    if strategies.iter().any(|s| s.is_empty()) {
        bail!("candidate `{candidate}`: an empty strategy between `+` signs (write e.g. `dp:degree=2+1f1b`)");
    }
    Ok(RunArgs {
        strategies,
        ..base.clone()
    })
}

/// `piper plan --simulate --compare …`: every candidate compiled and
/// simulated on one cluster, one row each, and the stacked report.
pub fn compare(base: &RunArgs, args: &SimArgs) -> Result<()> {
    let mut plans = Vec::with_capacity(args.compare.len());
    for c in &args.compare {
        let a = candidate_args(base, c)?;
        let p = super::prepare(&a).with_context(|| format!("candidate `{c}`"))?;
        let plan = compile(&p.dag).with_context(|| format!("candidate `{c}`: compiling"))?;
        plans.push((c.clone(), plan));
    }
    let devices = plans
        .iter()
        .map(|(_, p)| p.devices.len() as u32)
        .max()
        .unwrap_or(1);
    let cluster = args.cluster(devices)?;
    let mut sims = Vec::with_capacity(plans.len());
    for (c, plan) in &plans {
        let s = sim::simulate(plan, &cluster).with_context(|| format!("candidate `{c}`"))?;
        sims.push(s);
    }
    let sections: Vec<report::Section> = plans
        .iter()
        .zip(&sims)
        .map(|((c, plan), s)| report::Section {
            title: format!("{c} ({} devices, {})", plan.devices.len(), plan.model),
            sim: s,
            capacity: Some(cluster.memory_bytes),
            source: format!("simulated on {}", cluster.name),
        })
        .collect();
    println!("compared on {}:", describe(&cluster));
    let rows: Vec<[String; 6]> = sections.iter().map(report::compare_row).collect();
    let width = rows
        .iter()
        .map(|r| r[0].chars().count())
        .max()
        .unwrap_or(9)
        .max(9);
    // Expert all-to-alls, on their stream or inside the compute ops: a
    // column of their own when a candidate has any.
    let a2a: Vec<Option<f64>> = plans
        .iter()
        .zip(&sims)
        .map(|((_, p), s)| sim::exposed_all_to_all(p, s))
        .collect();
    let a2a_col = |i: usize| match a2a.iter().any(Option::is_some) {
        true => format!("  {:>14}", a2a[i].map_or("-".into(), report::human_time)),
        false => String::new(),
    };
    let a2a_head = match a2a.iter().any(Option::is_some) {
        true => format!("  {:>14}", "of it all-to-all"),
        false => String::new(),
    };
    println!(
        "  {:<width$}  {:>12}  {:>7}  {:>14}{a2a_head}  {:>10}  {:>4}",
        "candidate", "step", "bubble", "exposed comm", "peak mem", "fits"
    );
    for (i, r) in rows.iter().enumerate() {
        println!(
            "  {:<width$}  {:>12}  {:>7}  {:>14}{}  {:>10}  {:>4}",
            r[0],
            r[1],
            r[2],
            r[3],
            a2a_col(i),
            r[4],
            r[5]
        );
    }
    println!("  (exposed comm and peak mem: the worst device)");
    if let Some(p) = &args.report {
        let html = report::html(
            &format!("Piper strategy comparison on {}", cluster.name),
            &sections,
        );
        std::fs::write(p, html).with_context(|| format!("writing {}", p.display()))?;
        println!("report: {}", p.display());
    }
    Ok(())
}
