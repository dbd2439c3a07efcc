//! `piper plugin verify PLUGIN[:options]`: the other half of trusting a
//! stranger's strategy — does it keep the math? The plugin plans `tiny` (and
//! `tiny` with a dropless mixture of experts) on `--devices` devices; each
//! plan is compiled (so checked for deadlocks, with its predicted peaks) and
//! trained for `--steps` steps beside the same model on one device, and the
//! largest loss and step-1 gradient differences are held to 1e-5. A model the
//! plugin refuses to plan (expert parallelism on a dense model), or plans
//! only with another strategy after it (tensor parallelism on a MoE model,
//! whose experts need `ep`), is reported and skipped; a plan that does not compile, a missing gradient or a
//! difference past the tolerance fails the verdict, naming the worst tensor.

use super::{RegistryArgs, RunArgs, RunConfig};
use crate::compile::{compile, human_bytes};
use crate::dag::{Cluster, Filter, TrainingDag};
use crate::model::{ModelConfig, MoeConfig};
use crate::runtime::{Corpus, NamedTensors, TrainOptions, Trainer};
use crate::session::Strategies;
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
    /// Train this model only (a preset or a model TOML) instead of `tiny`
    /// and `tiny` with a dropless MoE.
    #[arg(long)]
    model: Option<String>,
    /// Devices the plugin plans for.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    devices: u32,
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

/// The largest loss and gradient difference a plan may show against one
/// device: relative for losses, relative to the tensor's largest entry for
/// gradients (sums in another grouping move f32 entries by ~1e-6 of the
/// largest; a lost microbatch or a wrong shard by 1e-2 or more).
pub const TOLERANCE: f64 = 1e-5;

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

/// What verifying one model found.
#[derive(Serialize)]
struct ModelReport {
    model: String,
    /// The plugin's own refusal of this model (then nothing else is set).
    #[serde(skip_serializing_if = "Option::is_none")]
    not_planned: Option<String>,
    /// The plan's compile error (deadlock, inconsistent placement).
    #[serde(skip_serializing_if = "Option::is_none")]
    compile_error: Option<String>,
    /// Predicted peak bytes per device.
    peaks: Vec<u64>,
    /// Largest relative loss difference and its step.
    loss_diff: f64,
    loss_step: u32,
    /// Largest step-1 gradient difference (relative to the tensor's
    /// largest entry) and the tensor.
    grad_diff: f64,
    grad_tensor: String,
    /// Parameters the plan gave no gradient.
    missing: Vec<String>,
}

impl ModelReport {
    fn new(model: &str) -> Self {
        ModelReport {
            model: model.into(),
            not_planned: None,
            compile_error: None,
            peaks: Vec::new(),
            loss_diff: 0.0,
            loss_step: 0,
            grad_diff: 0.0,
            grad_tensor: String::new(),
            missing: Vec::new(),
        }
    }
    fn trained(&self) -> bool {
        self.not_planned.is_none() && self.compile_error.is_none()
    }
    fn passed(&self) -> bool {
        self.trained()
            && self.missing.is_empty()
            && self.loss_diff <= TOLERANCE
            && self.grad_diff <= TOLERANCE
    }
}

/// Losses of `steps` steps and the step-1 gradients of `cfg` under `dag`'s plan.
fn train(cfg: &ModelConfig, dag: &TrainingDag, steps: u32) -> Result<(Vec<f64>, NamedTensors)> {
    let plan = compile(dag)?;
    let opts = TrainOptions {
        capture_grads: true,
        ..TrainOptions::default()
    };
    let mut t = Trainer::new(cfg, plan, opts)?;
    let corpus = Corpus::builtin();
    let mut losses = Vec::new();
    let mut grads = NamedTensors::new();
    for s in 1..=steps {
        let batch = corpus.batch(s, cfg.batch_size as usize, cfg.seq_len as usize, cfg.vocab)?;
        losses.push(t.step(&batch).with_context(|| format!("step {s}"))?.loss);
        if s == 1 {
            grads = t.last_grads()?;
        }
    }
    Ok((losses, grads))
}

/// Verify the loaded strategies on one model.
fn verify_model(
    strategies: &Strategies,
    cfg: &ModelConfig,
    devices: u32,
    steps: u32,
) -> Result<ModelReport> {
    let mut report = ModelReport::new(&cfg.name);
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
    report.peaks = plan.devices.iter().map(|d| d.peak_bytes).collect();
    let (losses, grads) = train(cfg, &dag, steps).context("training under the plugin's plan")?;
    let mut one = TrainingDag::build(cfg, Cluster::new(1))?;
    one.place(&Filter::all(), &[0], "pp")?;
    let (base_losses, base_grads) = train(cfg, &one, steps).context("training on one device")?;
    for (s, (a, b)) in losses.iter().zip(&base_losses).enumerate() {
        let d = ((a - b) / b).abs();
        let d = if d.is_nan() { f64::INFINITY } else { d };
        if d > report.loss_diff || report.loss_step == 0 {
            report.loss_diff = d;
            report.loss_step = s as u32 + 1;
        }
    }
    for (name, want) in &base_grads {
        let Some(got) = grads.get(name) else {
            report.missing.push(name.clone());
            continue;
        };
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
        let worst = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        let d = if got.len() != want.len() || worst.is_nan() {
            f64::INFINITY
        } else {
            (worst / scale) as f64
        };
        if d > report.grad_diff || report.grad_tensor.is_empty() {
            report.grad_diff = d;
            report.grad_tensor = name.clone();
        }
    }
    Ok(report)
}

pub fn verify(a: VerifyArgs) -> Result<()> {
    let args = RunArgs {
        config: a.config.clone(),
        model: None,
        devices: Some(a.devices),
        strategies: vec![a.plugin.clone()],
        registry: a.registry.clone(),
        lock: None,
        precision: None,
    };
    let config = RunConfig::resolve(&args.overrides())?;
    let strategies = Strategies::load(&config, &args.sources())?;
    let (plugin, options) = &strategies.plugins[0];
    let models = match &a.model {
        Some(m) => vec![ModelConfig::from_name_or_file(m)?],
        None => vec![ModelConfig::tiny(), tiny_moe()],
    };
    let mut reports = Vec::new();
    for cfg in &models {
        reports.push(verify_model(&strategies, cfg, a.devices, a.steps)?);
    }
    let trained: Vec<&ModelReport> = reports.iter().filter(|r| r.trained()).collect();
    let worst = trained.iter().max_by(|x, y| {
        x.grad_diff
            .max(x.loss_diff)
            .total_cmp(&y.grad_diff.max(y.loss_diff))
    });
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
    let verdict = match (passed, worst) {
        (true, Some(w)) => format!(
            "PASS: {who} trains {} on {} devices as one device does (largest difference {:.1e}, tolerance {TOLERANCE:.0e})",
            trained.iter().map(|r| r.model.as_str()).collect::<Vec<_>>().join(" and "),
            a.devices,
            w.grad_diff.max(w.loss_diff),
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
            a.devices, a.steps
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
    if let Some(e) = &r.not_planned {
        return format!("{}: not planned by the plugin (skipped): {e}", r.model);
    }
    if let Some(e) = &r.compile_error {
        return format!("{}: the plan does not compile: {e}", r.model);
    }
    let peaks = r
        .peaks
        .iter()
        .map(|p| human_bytes(*p))
        .collect::<Vec<_>>()
        .join(", ");
    let mut s = format!(
        "{}: deadlock-free plan, predicted peaks {peaks}; losses within {:.1e} (step {}), step-1 gradients within {:.1e} (worst {})",
        r.model, r.loss_diff, r.loss_step, r.grad_diff, r.grad_tensor
    );
    if !r.missing.is_empty() {
        s.push_str(&format!("; no gradient for {}", r.missing.join(", ")));
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
    if let Some(r) = reports.iter().find(|r| !r.missing.is_empty()) {
        return format!(
            "its plan of {} gives no gradient for {}",
            r.model,
            r.missing.join(", ")
        );
    }
    let differs = reports
        .iter()
        .filter(|r| r.trained() && !r.passed())
        .max_by(|x, y| {
            x.grad_diff
                .max(x.loss_diff)
                .total_cmp(&y.grad_diff.max(y.loss_diff))
        });
    if let Some(r) = differs {
        return format!(
            "{} trains differently than on one device: step-1 gradient of `{}` differs by {:.1e} of its largest entry, losses by {:.1e} (step {}); tolerance {TOLERANCE:.0e}",
            r.model, r.grad_tensor, r.grad_diff, r.loss_diff, r.loss_step
        );
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
