//! `piper plugin verify PLUGIN[:options]`: the other half of trusting a
//! stranger's strategy — does it keep the math? The plugin plans each model
//! (`tiny` and `tiny` with a dropless mixture of experts, or the `--model`s
//! given) on each of the `--devices` counts; each plan is compiled (so
//! checked for deadlocks, with its predicted peaks) and trained for `--steps`
//! steps beside the same model on one device (`crate::verify`): the largest
//! loss and step-1 gradient differences are held to 1e-5 and each device's
//! measured peak to its plan's. A model the plugin refuses to plan (expert
//! parallelism on a dense model), or plans only with another strategy after
//! it (tensor parallelism on a MoE model, whose experts need `ep`), is
//! reported and skipped; a plan that does not compile, a missing gradient, a
//! difference past the tolerance or a peak past the plan fails the verdict,
//! naming the worst tensor.

use super::{RegistryArgs, RunArgs, RunConfig};
use crate::compile::{compile, human_bytes};
use crate::dag::{Cluster, TrainingDag};
use crate::model::{ModelConfig, MoeConfig};
use crate::session::Strategies;
use crate::verify::{Baseline, Verdict, TOLERANCE};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;

#[derive(Args)]
pub struct VerifyArgs {
    /// The strategy with its options: a bundled name, a `.wasm` path or an
    /// `oci://` reference (`1f1b:microbatches=8`).
    #[arg(value_name = "PLUGIN[:k=v,...]")]
    plugin: String,
    /// Train these models (a preset or a model TOML; repeat the flag for
    /// several) instead of `tiny` and `tiny` with a dropless MoE.
    #[arg(long)]
    model: Vec<String>,
    /// Device counts the plugin plans for, each checked (`2,4,8`).
    #[arg(long, value_delimiter = ',', default_value = "4", value_parser = clap::value_parser!(u32).range(1..=64))]
    devices: Vec<u32>,
    /// Steps trained under each plan.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    steps: u32,
    /// Run config whose `[sandbox]` table sets the limits.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    registry: RegistryArgs,
}

/// `tiny` with 4 experts of which each token uses 2, dropless, so every
/// plan routes every token the same way.
pub fn tiny_moe() -> ModelConfig {
    let mut cfg = ModelConfig::tiny();
    cfg.name = "tiny-moe-dropless".into();
    let mut moe = MoeConfig::new(4, 2);
    moe.hidden = Some(128);
    cfg.moe = Some(moe);
    cfg
}

/// What verifying one model on one device count found.
#[derive(Serialize)]
struct ModelReport {
    model: String,
    devices: u32,
    /// The plugin's own refusal of this model (then nothing else is set).
    #[serde(skip_serializing_if = "Option::is_none")]
    not_planned: Option<String>,
    /// The plan's compile error (deadlock, inconsistent placement).
    #[serde(skip_serializing_if = "Option::is_none")]
    compile_error: Option<String>,
    /// Training beside one device.
    #[serde(flatten)]
    verdict: Verdict,
}

impl ModelReport {
    fn new(model: &str, devices: u32) -> Self {
        ModelReport {
            model: model.into(),
            devices,
            not_planned: None,
            compile_error: None,
            verdict: Verdict::default(),
        }
    }
    fn trained(&self) -> bool {
        self.not_planned.is_none() && self.compile_error.is_none()
    }
    fn passed(&self) -> bool {
        self.trained() && self.verdict.passed()
    }
    /// The larger of the loss and gradient differences.
    fn worst(&self) -> f64 {
        self.verdict.grad_diff.max(self.verdict.loss_diff)
    }
}

/// Verify the loaded strategies on one model.
fn verify_model(
    strategies: &Strategies,
    cfg: &ModelConfig,
    devices: u32,
    steps: u32,
) -> Result<ModelReport> {
    let mut report = ModelReport::new(&cfg.name, devices);
    let mut dag = TrainingDag::build(cfg, Cluster::new(devices))?;
    if let Err(e) = strategies.apply(&mut dag) {
        report.not_planned = Some(format!("{e:#}"));
        return Ok(report);
    }
    let plan = match compile(&dag) {
        Ok(plan) => plan,
        // A plan that needs another strategy to finish it (tp on a MoE
        // model: `ep` spreads its experts) is not this plugin's alone.
        Err(e @ crate::compile::CompileError::ExpertsNotSpread { .. }) => {
            report.not_planned = Some(format!("it needs another strategy after it: {e}"));
            return Ok(report);
        }
        Err(e) => {
            report.compile_error = Some(e.to_string());
            return Ok(report);
        }
    };
    let base = Baseline::of(cfg, steps).context("training on one device")?;
    report.verdict = base
        .check(plan, None)
        .context("training under the plugin's plan")?;
    Ok(report)
}

pub fn verify(a: VerifyArgs) -> Result<()> {
    let args = RunArgs {
        config: a.config.clone(),
        model: None,
        devices: a.devices.first().copied(),
        strategies: vec![a.plugin.clone()],
        registry: a.registry.clone(),
        lock: None,
        precision: None,
    };
    let config = RunConfig::resolve(&args.overrides())?;
    let strategies = Strategies::load(&config, &args.sources())?;
    let (plugin, options) = &strategies.plugins[0];
    let models = match &a.model[..] {
        [] => vec![ModelConfig::tiny(), tiny_moe()],
        names => names
            .iter()
            .map(|m| ModelConfig::from_name_or_file(m))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let mut reports = Vec::new();
    for cfg in &models {
        for &devices in &a.devices {
            reports.push(verify_model(&strategies, cfg, devices, a.steps)?);
        }
    }
    let trained: Vec<&ModelReport> = reports.iter().filter(|r| r.trained()).collect();
    let worst = trained
        .iter()
        .max_by(|x, y| x.worst().total_cmp(&y.worst()));
    let passed = !trained.is_empty()
        && reports
            .iter()
            .all(|r| r.passed() || r.not_planned.is_some());
    let opts = options
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let who = match opts.is_empty() {
        true => plugin.ident(),
        false => format!("{} with {opts}", plugin.ident()),
    };
    // `tiny and tiny-moe`, `2 and 4`: each name once, in order.
    let listed = |items: Vec<String>| {
        let mut seen: Vec<String> = Vec::new();
        for i in items {
            if !seen.contains(&i) {
                seen.push(i);
            }
        }
        seen.join(" and ")
    };
    let verdict = match (passed, worst) {
        (true, Some(w)) => format!(
            "PASS: {who} trains {} on {} devices as one device does (largest difference {:.1e}, tolerance {TOLERANCE:.0e})",
            listed(trained.iter().map(|r| r.model.clone()).collect()),
            listed(trained.iter().map(|r| r.devices.to_string()).collect()),
            w.worst(),
        ),
        _ => format!("FAIL: {who}: {}", failure(&reports)),
    };
    if a.json {
        let v = serde_json::json!({
            "plugin": plugin.ident(),
            "options": opts,
            "devices": a.devices,
            "steps": a.steps,
            "tolerance": TOLERANCE,
            "models": reports,
            "passed": passed,
            "verdict": verdict,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "verifying {who} on {} devices, {} steps, against one device (tolerance {TOLERANCE:.0e}):",
            listed(a.devices.iter().map(|d| d.to_string()).collect()),
            a.steps
        );
        for r in &reports {
            println!("  {}", line(r));
        }
        println!("{verdict}");
    }
    if !passed {
        bail!("{who} does not train like one device (the verdict above)");
    }
    Ok(())
}

/// One model's line of the report.
fn line(r: &ModelReport) -> String {
    let at = format!("{} on {} devices", r.model, r.devices);
    if let Some(e) = &r.not_planned {
        return format!("{at}: not planned by the plugin (skipped): {e}");
    }
    if let Some(e) = &r.compile_error {
        return format!("{at}: the plan does not compile: {e}");
    }
    let v = &r.verdict;
    let peaks = v
        .measured
        .iter()
        .zip(&v.planned)
        .map(|(m, p)| format!("{} of {}", human_bytes(*m), human_bytes(*p)))
        .collect::<Vec<_>>()
        .join(", ");
    let mut s = format!(
        "{at}: deadlock-free plan, peaks (measured of planned) {peaks}; losses within {:.1e} (step {}), step-1 gradients within {:.1e} (worst {})",
        v.loss_diff, v.loss_step, v.grad_diff, v.grad_tensor
    );
    if !v.missing.is_empty() {
        s.push_str(&format!("; no gradient for {}", v.missing.join(", ")));
    }
    for (d, m, p) in v.over_plan() {
        s.push_str(&format!(
            "; device {d} peaked at {}, above its planned {}",
            human_bytes(m),
            human_bytes(p)
        ));
    }
    s.push_str(if r.passed() { "  ok" } else { "  DIFFERS" });
    s
}

/// Why the verdict failed, the worst first.
fn failure(reports: &[ModelReport]) -> String {
    if let Some(r) = reports.iter().find(|r| r.compile_error.is_some()) {
        return format!(
            "its plan of {} does not compile: {}",
            r.model,
            r.compile_error.as_deref().unwrap_or_default()
        );
    }
    let differs = reports
        .iter()
        .filter(|r| r.trained() && !r.passed())
        .max_by(|x, y| x.worst().total_cmp(&y.worst()));
    if let Some(why) = differs.and_then(|r| Some(format!("{} {}", r.model, r.verdict.failure()?))) {
        return why;
    }
    let why = reports
        .iter()
        .filter_map(|r| {
            r.not_planned
                .as_deref()
                .map(|e| format!("{}: {e}", r.model))
        })
        .collect::<Vec<_>>()
        .join("; ");
    format!("it planned none of the models ({why})")
}
