//! The training loop over a [`Trainer`], as torchtitan's `Trainer.train()`:
//! steps on the data's batches, evaluation on held-out data, periodic
//! checkpoints, per-step metrics as JSON lines, the step-1 dump, and the stop
//! at the first non-finite loss or gradient. What a caller shows (a progress
//! bar, lines above it) comes through an [`Observer`]; what the run did comes
//! back as a [`Summary`]. The CLI builds its [`LoopConfig`] from flags.

use super::checkpoint::{self, gpt2_entries, write_safetensors, CheckpointError};
use super::{Batch, Corpus, DataError, NamedTensors, RuntimeError, StepStats, Trainer};
use crate::model::ModelConfig;
use safetensors::tensor::Dtype;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What the loop does besides stepping.
#[derive(Clone, Debug, Default)]
pub struct LoopConfig {
    /// The step to reach (a resumed trainer continues from its own).
    pub steps: u32,
    /// Evaluate every this many steps and at the last (with held-out data).
    pub eval_every: Option<u32>,
    /// Batches per evaluation.
    pub eval_batches: u32,
    /// Checkpoints under this directory: every `checkpoint_every` steps and
    /// at the last, the newest `keep` kept (0: all).
    pub checkpoint: Option<PathBuf>,
    pub checkpoint_every: Option<u32>,
    pub keep: u32,
    /// Per-step metrics, appended as JSON lines.
    pub metrics: Option<PathBuf>,
    /// The step-1 dump (initial weights, gradients, batch and loss).
    pub dump_step1: Option<PathBuf>,
    /// This process writes metrics, checkpoints and dumps and reports
    /// (the first rank of an MPI job; every rank steps).
    pub leader: bool,
}

/// What a caller sees while the loop runs. Every method has a default that
/// shows nothing.
pub trait Observer {
    /// A step finished at `tokens_per_s`.
    fn step(&mut self, _stats: &StepStats, _tokens_per_s: f64) {}
    /// A line worth showing while the run goes on (an evaluation, a
    /// checkpoint, the step-1 dump).
    fn say(&mut self, _line: String) {}
    /// The run stops at a non-finite loss or gradient.
    fn stopped(&mut self) {}
}

/// No observer: the loop runs silently.
impl Observer for () {}

/// What the loop did.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Steps run by this call (0 when the trainer was already at `steps`).
    pub ran: u32,
    pub first_loss: Option<f64>,
    pub last_loss: f64,
    /// Over the steps this call ran.
    pub tokens_per_s: f64,
    /// The last evaluation: (step, loss).
    pub last_eval: Option<(u32, f64)>,
    /// Measured peak bytes per device over the run.
    pub peak_bytes: Vec<u64>,
    /// Bytes each device sent in the last step.
    pub sent_bytes: Vec<u64>,
    /// MoE: expert assignments routed and dropped over the run.
    pub moe_routed: u64,
    pub moe_dropped: u64,
    /// The checkpoint written at the last step, as a line to show.
    pub last_checkpoint: Option<String>,
}

/// Why the loop stopped early; each names its step.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    /// A non-finite loss or gradient: the error names its step and where.
    #[error(transparent)]
    NonFinite(Box<RuntimeError>),
    #[error("step {step}")]
    Step {
        step: u32,
        #[source]
        source: Box<RuntimeError>,
    },
    #[error("step {step}: evaluation batch {batch}")]
    Eval {
        step: u32,
        batch: u32,
        #[source]
        source: Box<RuntimeError>,
    },
    #[error("reading {what}")]
    Data {
        what: String,
        #[source]
        source: DataError,
    },
    #[error("step {step}")]
    Checkpoint {
        step: u32,
        #[source]
        source: CheckpointError,
    },
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl LoopError {
    fn of_step(step: u32, e: RuntimeError) -> Self {
        match e {
            e @ RuntimeError::NonFinite { .. } => LoopError::NonFinite(Box::new(e)),
            source => LoopError::Step {
                step,
                source: Box::new(source),
            },
        }
    }
}

/// Run `trainer` from its next step to `config.steps` on `data` (and
/// `held`, to evaluate), reporting to `obs`.
pub fn train_loop(
    trainer: &mut Trainer,
    cfg: &ModelConfig,
    data: &Corpus,
    held: Option<&Corpus>,
    config: &LoopConfig,
    obs: &mut dyn Observer,
) -> Result<Summary, LoopError> {
    let first_step = trainer.step_count() + 1;
    let devices = trainer.plan().devices.len();
    let mut sum = Summary {
        peak_bytes: vec![0; devices],
        sent_bytes: vec![0; devices],
        ..Summary::default()
    };
    if first_step > config.steps {
        return Ok(sum);
    }
    let mut metrics = match config.metrics.as_ref().filter(|_| config.leader) {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| LoopError::Io {
                    what: "opening metrics file",
                    path: path.clone(),
                    source,
                })?,
        ),
        None => None,
    };
    // Collective in an MPI job: every rank takes part, the first gets them.
    let initial = match &config.dump_step1 {
        Some(_) => trainer
            .gather_params()
            .map_err(|e| LoopError::of_step(1, e))?,
        None => None,
    };
    let (b, t) = (cfg.batch_size as usize, cfg.seq_len as usize);
    let tokens_per_step = (b * t) as f64;
    // Each process reads its own devices' rows (the step-1 dump reads all).
    let read = match config.dump_step1 {
        Some(_) => vec![true; b],
        None => trainer.rows_read(),
    };
    let start = Instant::now();
    for step in first_step..=config.steps {
        let batch = data
            .batch_rows(step, b, t, cfg.vocab, &read)
            .map_err(|source| LoopError::Data {
                what: format!("step {step}'s batch"),
                source,
            })?;
        let s = trainer.step(&batch).map_err(|e| {
            let e = LoopError::of_step(step, e);
            if matches!(e, LoopError::NonFinite(_)) {
                obs.stopped();
            }
            e
        })?;
        if let (Some(path), 1) = (&config.dump_step1, step) {
            // Every rank gathers; the first (holding `initial`) writes.
            let grads = trainer
                .gather_grads()
                .map_err(|e| LoopError::of_step(step, e))?;
            if let (Some(init), Some(grads)) = (&initial, grads) {
                dump_step1(path, cfg, init, &batch, s.loss, &grads)
                    .map_err(|source| LoopError::Checkpoint { step, source })?;
                obs.say(format!("step-1 dump: {}", path.display()));
            }
        }
        let tps = tokens_per_step / s.elapsed.as_secs_f64();
        sum.first_loss.get_or_insert(s.loss);
        sum.last_loss = s.loss;
        sum.sent_bytes.clone_from(&s.comm_bytes);
        for (p, m) in sum.peak_bytes.iter_mut().zip(&s.peak_bytes) {
            *p = (*p).max(*m);
        }
        sum.moe_routed += s.moe_routed;
        sum.moe_dropped += s.moe_dropped;
        sum.ran += 1;
        obs.step(&s, tps);
        let eval_loss = match (held, config.eval_every) {
            (Some(h), Some(n)) if step % n == 0 || step == config.steps => {
                let l = evaluate(trainer, cfg, h, config.eval_batches, step, &read, obs)?;
                if config.leader {
                    obs.say(format!(
                        "step {step}: eval loss {l:.4} (train loss {:.4})",
                        s.loss
                    ));
                }
                sum.last_eval = Some((step, l));
                Some(l)
            }
            _ => None,
        };
        if let (Some(f), Some(path)) = (metrics.as_mut(), &config.metrics) {
            write_metrics(f, cfg, &s, tps, eval_loss).map_err(|source| LoopError::Io {
                what: "writing metrics to",
                path: path.clone(),
                source,
            })?;
        }
        if let Some(root) = &config.checkpoint {
            let every = config.checkpoint_every.is_some_and(|n| step % n == 0);
            if every || step == config.steps {
                if let Some(line) = save(trainer, data, root, config.keep, step, (b, t))? {
                    match step == config.steps {
                        true => sum.last_checkpoint = Some(line),
                        false => obs.say(line),
                    }
                }
            }
        }
    }
    sum.tokens_per_s = tokens_per_step * f64::from(sum.ran) / start.elapsed().as_secs_f64();
    Ok(sum)
}

/// The mean loss of `batches` held-out batches.
fn evaluate(
    trainer: &mut Trainer,
    cfg: &ModelConfig,
    held: &Corpus,
    batches: u32,
    step: u32,
    read: &[bool],
    obs: &mut dyn Observer,
) -> Result<f64, LoopError> {
    let (b, t) = (cfg.batch_size as usize, cfg.seq_len as usize);
    let mut sum = 0.0;
    for k in 1..=batches {
        let batch = held
            .batch_rows(k, b, t, cfg.vocab, read)
            .map_err(|source| LoopError::Data {
                what: format!("evaluation batch {k}"),
                source,
            })?;
        sum += trainer.eval(&batch).map_err(|e| match e {
            e @ RuntimeError::NonFinite { .. } => {
                obs.stopped();
                LoopError::NonFinite(Box::new(e))
            }
            source => LoopError::Eval {
                step,
                batch: k,
                source: Box::new(source),
            },
        })?;
    }
    Ok(sum / f64::from(batches.max(1)))
}

/// One step's metrics line.
fn write_metrics(
    f: &mut std::fs::File,
    cfg: &ModelConfig,
    s: &StepStats,
    tps: f64,
    eval_loss: Option<f64>,
) -> std::io::Result<()> {
    let mut line = serde_json::json!({
        "step": s.step,
        "loss": s.loss,
        "lr": s.lr,
        "grad_norm": s.grad_norm,
        "tokens_per_s": tps,
        "peak_bytes": s.peak_bytes,
        "comm_bytes": s.comm_bytes,
    });
    if let Some(l) = eval_loss {
        line["eval_loss"] = l.into();
    }
    if cfg.moe.is_some() {
        line["moe_routed"] = s.moe_routed.into();
        line["moe_dropped"] = s.moe_dropped.into();
    }
    writeln!(f, "{line}")
}

/// A checkpoint of `step` under `root` (collective in an MPI job: every
/// rank gathers, the first writes and gets the line to show).
fn save(
    trainer: &Trainer,
    data: &Corpus,
    root: &Path,
    keep: u32,
    step: u32,
    (b, t): (usize, usize),
) -> Result<Option<String>, LoopError> {
    let Some(mut ck) = trainer
        .gather_checkpoint()
        .map_err(|e| LoopError::of_step(step, e))?
    else {
        return Ok(None);
    };
    ck.state.data = Some(data.position(step, b, t));
    let saved = checkpoint::save_step(root, &ck, keep)
        .map_err(|source| LoopError::Checkpoint { step, source })?;
    let removed = match saved.removed.len() {
        0 => String::new(),
        n => format!(", {n} older removed (--keep)"),
    };
    Ok(Some(format!(
        "checkpoint: {} (step {step}{removed})",
        saved.dir.display()
    )))
}

/// The step-1 dump: `param.<gpt2 name>` (initial weights), `grad.<gpt2 name>`,
/// `inputs` and `targets` (I32 `[B, T]`) and `loss` (F32 `[1]`).
pub fn dump_step1(
    path: &Path,
    cfg: &ModelConfig,
    init: &NamedTensors,
    batch: &Batch,
    loss: f64,
    grads: &NamedTensors,
) -> Result<(), CheckpointError> {
    let mut entries = gpt2_entries(cfg, init, "param.");
    entries.extend(gpt2_entries(cfg, grads, "grad."));
    let ints = |v: &[u32]| {
        v.iter()
            .flat_map(|x| (*x as i32).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    entries.push((
        "inputs".into(),
        vec![batch.b, batch.t],
        ints(&batch.tokens),
        Dtype::I32,
    ));
    entries.push((
        "targets".into(),
        vec![batch.b, batch.t],
        ints(&batch.targets),
        Dtype::I32,
    ));
    entries.push((
        "loss".into(),
        vec![1],
        (loss as f32).to_le_bytes().to_vec(),
        Dtype::F32,
    ));
    write_safetensors(path, entries, None).map(|_| ())
}
