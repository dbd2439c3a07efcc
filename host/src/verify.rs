//! Beside the flow, after the runtime: does a plan keep the math? A plan
//! trains a few steps beside the same model on one device, and its losses,
//! every step-1 gradient and each device's measured peak are held to one
//! device's and to the plan's own figures. What `piper plugin verify`
//! reports for a user's strategy, and what the strategy fuzzer in the tests
//! holds every plan that compiles to.

use crate::compile::{compile, CompileError, Plan};
use crate::dag::{Cluster, DagError, Filter, TrainingDag};
use crate::model::{ModelConfig, ModelError};
use crate::runtime::{Corpus, DataError, NamedTensors, RuntimeError, TrainOptions, Trainer};
use std::time::Duration;

/// The largest loss and gradient difference a plan may show against one
/// device: relative for losses, relative to the tensor's largest entry for
/// gradients (sums in another grouping move f32 entries by ~1e-6 of the
/// largest; a lost microbatch or a wrong shard by 1e-2 or more).
pub const TOLERANCE: f64 = 1e-5;

/// How far above the plan's predicted peak a device's measured peak may go
/// (allocator rounding, a norm's statistics the plan does not itemise).
pub const PEAK_SLACK: f64 = 0.05;

/// Why a plan could not be verified (not a verdict: the plan was not run).
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Dag(#[from] DagError),
    #[error(transparent)]
    Compile(Box<CompileError>),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("step {step}: {source}")]
    Run {
        step: u32,
        #[source]
        source: Box<RuntimeError>,
    },
}

impl From<CompileError> for VerifyError {
    fn from(e: CompileError) -> Self {
        VerifyError::Compile(Box::new(e))
    }
}

/// A model trained on one device: what every plan of it is held to.
pub struct Baseline {
    pub model: ModelConfig,
    pub steps: u32,
    pub losses: Vec<f64>,
    pub grads: NamedTensors,
}

/// What training a plan beside its baseline showed.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Verdict {
    /// Predicted and measured peak bytes per device (the measured: the
    /// highest over the steps).
    pub planned: Vec<u64>,
    pub measured: Vec<u64>,
    /// Largest relative loss difference and its step (1-based).
    pub loss_diff: f64,
    pub loss_step: u32,
    /// Largest step-1 gradient difference, relative to the tensor's
    /// largest entry, and the tensor.
    pub grad_diff: f64,
    pub grad_tensor: String,
    /// Parameters the plan gave no gradient (or one of another size).
    pub missing: Vec<String>,
}

impl Verdict {
    /// The devices whose measured peak passed the plan's by more than
    /// [`PEAK_SLACK`]: (device, measured, planned).
    pub fn over_plan(&self) -> Vec<(usize, u64, u64)> {
        self.measured
            .iter()
            .zip(&self.planned)
            .enumerate()
            .filter(|(_, (m, p))| **m as f64 > **p as f64 * (1.0 + PEAK_SLACK))
            .map(|(d, (m, p))| (d, *m, *p))
            .collect()
    }

    /// Losses and gradients as one device's, every gradient there, and
    /// every device within its planned peak.
    pub fn passed(&self) -> bool {
        self.missing.is_empty()
            && self.loss_diff <= TOLERANCE
            && self.grad_diff <= TOLERANCE
            && self.over_plan().is_empty()
    }

    /// What failed, the worst first, as a predicate of the model ("tiny
    /// trains differently …"); `None` when it passed.
    pub fn failure(&self) -> Option<String> {
        if !self.missing.is_empty() {
            return Some(format!("gets no gradient for {}", self.missing.join(", ")));
        }
        if self.loss_diff > TOLERANCE || self.grad_diff > TOLERANCE {
            return Some(format!(
                "trains differently than on one device: step-1 gradient of `{}` differs by {:.1e} of its largest entry, losses by {:.1e} (step {}); tolerance {TOLERANCE:.0e}",
                self.grad_tensor, self.grad_diff, self.loss_diff, self.loss_step
            ));
        }
        self.over_plan().first().map(|(d, m, p)| {
            format!(
                "peaks at {m} bytes on device {d}, {:.1}% above the {p} its plan predicts",
                (*m as f64 / *p as f64 - 1.0) * 100.0
            )
        })
    }
}

/// Train `cfg` for `steps` steps under `plan`: the losses, the step-1
/// gradients and each device's highest measured peak.
fn train(
    cfg: &ModelConfig,
    plan: Plan,
    steps: u32,
    timeout: Option<Duration>,
) -> Result<(Vec<f64>, NamedTensors, Vec<u64>), VerifyError> {
    let opts = TrainOptions {
        capture_grads: true,
        comm_timeout: timeout,
        ..TrainOptions::default()
    };
    let run = |step: u32| {
        move |source: RuntimeError| VerifyError::Run {
            step,
            source: Box::new(source),
        }
    };
    let mut t = Trainer::new(cfg, plan, opts).map_err(run(0))?;
    let corpus = Corpus::builtin();
    let (mut losses, mut grads, mut peaks) = (Vec::new(), NamedTensors::new(), Vec::new());
    for s in 1..=steps {
        let batch = corpus.batch(s, cfg.batch_size as usize, cfg.seq_len as usize, cfg.vocab)?;
        let st = t.step(&batch).map_err(run(s))?;
        losses.push(st.loss);
        peaks.resize(st.peak_bytes.len(), 0);
        for (p, m) in peaks.iter_mut().zip(&st.peak_bytes) {
            *p = (*p).max(*m);
        }
        if s == 1 {
            grads = t.last_grads().map_err(run(s))?;
        }
    }
    Ok((losses, grads, peaks))
}

impl Baseline {
    /// `cfg` trained `steps` steps on one device.
    pub fn of(cfg: &ModelConfig, steps: u32) -> Result<Self, VerifyError> {
        let mut one = TrainingDag::build(cfg, Cluster::new(1))?;
        one.place(&Filter::all(), &[0], "pp")?;
        let (losses, grads, _) = train(cfg, compile(&one)?, steps, None)?;
        Ok(Baseline {
            model: cfg.clone(),
            steps,
            losses,
            grads,
        })
    }

    /// Train `plan` (of this baseline's model) beside it. `timeout` bounds
    /// every wait for a peer (`None`: derived from the plan, as a run's).
    pub fn check(&self, plan: Plan, timeout: Option<Duration>) -> Result<Verdict, VerifyError> {
        let planned = plan.devices.iter().map(|d| d.peak_bytes).collect();
        let (losses, grads, measured) = train(&self.model, plan, self.steps, timeout)?;
        let mut v = Verdict {
            planned,
            measured,
            ..Verdict::default()
        };
        for (s, (a, b)) in losses.iter().zip(&self.losses).enumerate() {
            let d = ((a - b) / b).abs();
            let d = if d.is_nan() { f64::INFINITY } else { d };
            if d > v.loss_diff || v.loss_step == 0 {
                v.loss_diff = d;
                v.loss_step = s as u32 + 1;
            }
        }
        for (name, want) in &self.grads {
            let Some(got) = grads.get(name).filter(|g| g.len() == want.len()) else {
                v.missing.push(name.clone());
                continue;
            };
            let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-12);
            let worst = got
                .iter()
                .zip(want)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            let d = if worst.is_nan() {
                f64::INFINITY
            } else {
                (worst / scale) as f64
            };
            if d > v.grad_diff || v.grad_tensor.is_empty() {
                v.grad_diff = d;
                v.grad_tensor = name.clone();
            }
        }
        Ok(v)
    }
}
