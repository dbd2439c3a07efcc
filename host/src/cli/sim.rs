//! `piper plan --simulate`: time the compiled plan on a described cluster,
//! print the figures, and write the trace, the SVG timeline or the HTML report.

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
    /// file (default: `h100-8x`, or `h100-cluster` with enough nodes).
    #[arg(long, requires = "simulate")]
    pub cluster: Option<String>,
    /// Write the simulated timeline as Chrome-trace JSON (Perfetto).
    #[arg(long, requires = "simulate")]
    pub trace: Option<PathBuf>,
    /// Write the simulated timeline as SVG.
    #[arg(long, requires = "simulate")]
    pub svg: Option<PathBuf>,
    /// Write a self-contained HTML report: timeline, memory over time, summary.
    #[arg(long, requires = "simulate")]
    pub report: Option<PathBuf>,
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

/// Simulate, print, and write what was asked for. `title` names the run.
pub fn run(plan: &Plan, args: &SimArgs, title: &str) -> Result<sim::Simulation> {
    let cluster = cluster_for(args.cluster.as_deref(), plan.devices.len() as u32)?;
    let t = std::time::Instant::now();
    let s = sim::simulate(plan, &cluster).context("simulating the plan")?;
    let took = t.elapsed();
    println!(
        "simulated on {} ({} × {} devices, {:.0} TFLOP/s peak, {:.0} GB): step {}, bubble {:.1}% ({} ops in {:.0} ms)",
        cluster.name,
        cluster.nodes,
        cluster.devices_per_node,
        cluster.peak_flops / 1e12,
        cluster.memory_bytes / 1e9,
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
                }],
            ),
        )?;
    }
    Ok(s)
}
