//! `piper train`: the model, strategies and cluster of a run config (or flags),
//! compiled and executed on the runtime's devices (virtual CPU devices, or
//! plan devices on GPUs with `--backend cuda`), with a progress bar, a
//! summary, and per-step metrics as JSON lines.

use super::RunArgs;
use crate::compile::human_bytes;
use crate::model::ModelConfig;
use crate::runtime::checkpoint::{self, Checkpoint};
use crate::runtime::data::file::Width;
use crate::runtime::train_loop::{train_loop, LoopConfig, Observer};
use crate::runtime::{AdamW, Corpus, Decay, Schedule, StepStats, Tokenizer, TrainOptions, Trainer};
use crate::session::parse_size;
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct TrainArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Optimizer steps (with `--resume`: the total to reach).
    #[arg(long, default_value_t = 150, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=i32::MAX as i64))]
    steps: u32,
    /// Peak learning rate (AdamW), more than 0.
    #[arg(long, default_value_t = 3e-3, allow_negative_numbers = true)]
    lr: f32,
    /// Linear warmup over the first STEPS steps (step s at lr · s / STEPS).
    #[arg(long, value_name = "STEPS", default_value_t = 0)]
    warmup: u32,
    /// After warmup: `constant`, `cosine` (down to `--min-lr` at the last
    /// step) or `wsd` (warmup-stable-decay: flat, then linear to
    /// `--min-lr` over the last `--decay-steps`).
    #[arg(long, default_value = "constant", value_parser = ["constant", "cosine", "wsd"])]
    schedule: String,
    /// Where `cosine` and `wsd` end (default: a tenth of `--lr`).
    #[arg(long, allow_negative_numbers = true)]
    min_lr: Option<f32>,
    /// With `--schedule wsd`: the steps of the final decay (default: a
    /// fifth of the steps after warmup).
    #[arg(long, value_name = "STEPS")]
    decay_steps: Option<u32>,
    /// The step the schedule ends at (default: `--steps`), as nanoGPT's
    /// `lr_decay_iters` and Megatron's `--lr-decay-iters`: a run stopped
    /// early with `--steps` keeps the schedule of the whole run.
    #[arg(long, value_name = "STEPS", value_parser = clap::value_parser!(u32).range(1..))]
    schedule_steps: Option<u32>,
    /// AdamW's decoupled weight decay (default: the run config's
    /// `[optimizer] weight_decay`, else 0.1).
    #[arg(long, allow_negative_numbers = true)]
    weight_decay: Option<f32>,
    /// Seed of the initial weights.
    #[arg(long, default_value_t = 1337, allow_negative_numbers = true)]
    seed: u64,
    /// Clip the global gradient norm to this (0: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    clip: f32,
    /// What to train on: UTF-8 text (tokenized by `--tokenizer`), or a
    /// token file ending in `.bin` (nanoGPT's raw uint16, or llm.c's with
    /// its header; memory-mapped, so any size); default: the built-in corpus.
    #[arg(long)]
    data: Option<PathBuf>,
    /// The tokens of a `.bin` file without a header: `uint16` (nanoGPT's
    /// `prepare.py`, the default) or `uint32`.
    #[arg(long, value_name = "TYPE", value_parser = ["uint16", "uint32"])]
    token_type: Option<String>,
    /// `byte` (vocabulary 256), `gpt2` (GPT-2 BPE, vocabulary 50257, e.g. with `--model gpt2-small`), or a Hugging Face `tokenizer.json` (the file, or a model directory holding it: Llama 3's, Qwen3's).
    #[arg(long, default_value = "byte")]
    tokenizer: String,
    /// Evaluate every N steps (and at the last): the mean loss of
    /// `--eval-batches` batches of held-out data, by a forward-only plan
    /// of the same strategies on the same devices; the optimizer is not
    /// touched. Without `--eval-data`, the last tenth of the data is held
    /// out (and not trained on).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    eval_every: Option<u32>,
    /// With `--eval-every`: batches per evaluation (the same ones each
    /// time, so evaluations compare).
    #[arg(long, value_name = "K", default_value_t = 10, requires = "eval_every", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    eval_batches: u32,
    /// With `--eval-every`: evaluate on this text or `.bin` token file
    /// instead of holding out the data's last tenth.
    #[arg(long, value_name = "FILE", requires = "eval_every")]
    eval_data: Option<PathBuf>,
    /// Memory cap per device: bytes, or with a unit (`512MiB`, `2GiB`).
    #[arg(long)]
    device_memory: Option<String>,
    /// Append one JSON object per step (step, loss, lr, grad norm, tokens/s, peak bytes per device).
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Save checkpoints under this directory, at the end and every
    /// `--checkpoint-every` steps: `DIR/step-NNNNNNNN/` (GPT-2 safetensors,
    /// AdamW state, `state.json` with each file's sha256), and `DIR/latest`
    /// naming the newest. Each is written whole or not at all.
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// With `--checkpoint`: also save every N steps.
    #[arg(long, value_name = "N", requires = "checkpoint", value_parser = clap::value_parser!(u32).range(1..))]
    checkpoint_every: Option<u32>,
    /// With `--checkpoint`: keep the newest K checkpoints, removing older
    /// ones after each save (default: keep every one).
    #[arg(long, value_name = "K", requires = "checkpoint", value_parser = clap::value_parser!(u32).range(1..))]
    keep: Option<u32>,
    /// Continue from a checkpoint: a `--checkpoint` directory (its newest
    /// complete checkpoint) or one `step-NNNNNNNN` directory in it; every
    /// file is checked against its sha256 first. `--steps` is then the
    /// total to reach.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Start from the weights of a Hugging Face directory (what
    /// transformers' `save_pretrained` writes: `model.safetensors` or
    /// sharded with its index; or a Piper checkpoint's step directory)
    /// instead of the seed's, with fresh optimizer state at step 0. Every
    /// tensor is checked by name and shape against `--model`.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// Write a Chrome-trace JSON of what each device's streams did (open in Perfetto).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Write a self-contained HTML report of a measured step (the median
    /// by time): the timeline per device and stream in the simulator's
    /// style, memory over time, the summary table.
    #[arg(long, value_name = "FILE.html")]
    report: Option<PathBuf>,
    /// With `--report`: the simulator's prediction of the same plan drawn
    /// beneath the measured step, on one time axis.
    #[arg(long, requires = "report")]
    simulate: bool,
    /// The cluster `--simulate` predicts on (default: `cpu-local`, this
    /// machine as `piper calibrate` measured it).
    #[arg(long, requires = "simulate")]
    cluster: Option<String>,
    /// Write one safetensors file with the initial weights, the first batch,
    /// the step-1 loss and every parameter gradient.
    #[arg(long)]
    dump_step1: Option<PathBuf>,
    /// Kernel threads per device (default: this machine's cores ÷ the
    /// devices of this process, ÷ the ranks on this machine under MPI; at
    /// least 1). Losses are the same bits for every count.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: Option<u32>,
    /// Longest wait for a peer device, seconds (default: derived from the
    /// plan's predicted step time, at least 10 s).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    comm_timeout: Option<f64>,
    /// What the plan devices compute on: `cpu` (virtual devices on this
    /// machine's cores) or `cuda` (GPUs; a piper built with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    backend: String,
    /// With `--backend cuda`: the GPUs of this machine to use; plan devices
    /// are dealt to them in contiguous blocks (several may share one GPU).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    gpus: u32,
}

/// Numbers and output paths checked before any work, so a typo costs
/// milliseconds and a finished run is never lost to an unwritable path.
fn check_args(a: &TrainArgs) -> Result<()> {
    if !(a.lr.is_finite() && a.lr > 0.0) {
        bail!("--lr must be a positive number, got {}", a.lr);
    }
    schedule_of(a)?;
    if !(a.clip.is_finite() && a.clip >= 0.0) {
        bail!(
            "--clip must be 0 (off) or a positive number, got {}",
            a.clip
        );
    }
    if let Some(dir) = a.resume.as_ref().filter(|d| !d.is_dir()) {
        bail!("--resume {}: no such checkpoint directory", dir.display());
    }
    if let Some(dir) = &a.checkpoint {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating checkpoint directory {}", dir.display()))?;
    }
    for (flag, path) in [
        ("--trace", &a.trace),
        ("--report", &a.report),
        ("--dump-step1", &a.dump_step1),
        ("--metrics", &a.metrics),
    ] {
        if let Some(parent) = path.as_ref().and_then(|p| p.parent()) {
            if !parent.as_os_str().is_empty() && !parent.is_dir() {
                bail!(
                    "{flag} {}: directory {} does not exist",
                    path.as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                    parent.display()
                );
            }
        }
    }
    Ok(())
}

/// The learning-rate schedule the flags ask for, checked.
fn schedule_of(a: &TrainArgs) -> Result<Schedule> {
    if a.schedule != "wsd" && a.decay_steps.is_some() {
        bail!(
            "--decay-steps is for --schedule wsd (this run's is {})",
            a.schedule
        );
    }
    if a.schedule == "constant" && a.min_lr.is_some() {
        bail!("--min-lr is for --schedule cosine or wsd (this run's is constant)");
    }
    let total = a.schedule_steps.unwrap_or(a.steps);
    let after = total.saturating_sub(a.warmup);
    let decay = match a.schedule.as_str() {
        "cosine" => Decay::Cosine,
        "wsd" => Decay::Wsd {
            decay_steps: a.decay_steps.unwrap_or((after / 5).max(1)),
        },
        _ => Decay::Constant,
    };
    let s = Schedule {
        peak: a.lr,
        min: match decay {
            Decay::Constant => a.lr,
            _ => a.min_lr.unwrap_or(a.lr / 10.0),
        },
        warmup: a.warmup,
        decay,
        total,
    };
    s.check().map_err(anyhow::Error::msg)?;
    Ok(s)
}

/// Where this process stands in a job: alone, or one rank of an MPI job.
struct Job {
    /// This process prints the progress bar, metrics and summary.
    leader: bool,
    #[cfg(feature = "mpi")]
    ranks: Option<super::job::Mpi>,
}

pub fn train(a: TrainArgs) -> Result<()> {
    check_args(&a)?;
    #[cfg(not(feature = "mpi"))]
    if let Some(n) = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok())
        .filter(|n| n.trim() != "1")
    {
        bail!("started as one of {n} MPI ranks, but this piper was built without MPI: build it with `cargo build --release -p piper --features mpi` (each rank would otherwise train the whole job alone)");
    }
    #[cfg(feature = "mpi")]
    if let Some(mpi) = super::job::Mpi::launched()? {
        let rank = mpi.rank();
        let job = Job {
            leader: rank == 0,
            ranks: Some(mpi),
        };
        // MPI_Abort on failure must come before the job (and MPI) is
        // finalised: finalising waits for the other ranks.
        let result = train_in(a, &job);
        return super::job::finish(rank, result);
    }
    train_in(
        a,
        &Job {
            leader: true,
            #[cfg(feature = "mpi")]
            ranks: None,
        },
    )
}

fn train_in(a: TrainArgs, job: &Job) -> Result<()> {
    #[cfg(feature = "mpi")]
    let default_devices = job.ranks.as_ref().map_or(4, |m| m.size());
    #[cfg(not(feature = "mpi"))]
    let default_devices = 4;
    let p = super::prepare_with(&a.run, default_devices)?;
    let cfg = p.config.model_config()?;
    let plan = p.compile()?;
    // `--simulate`'s cluster checked before any training: a finished run is
    // never lost to a cluster file that does not parse or is too small.
    let sim_cluster = match a.simulate {
        true => Some(super::sim::cluster_for(
            Some(a.cluster.as_deref().unwrap_or("cpu-local")),
            plan.devices.len() as u32,
        )?),
        false => None,
    };
    let (corpus, held) = data_of(&a, &cfg)?;
    let opts = options_of(&a, p.config.optimizer)?;
    // Read (and every file checked) before the devices start, so a damaged
    // checkpoint costs no setup.
    let init = match &a.init_from {
        Some(dir) => Some(
            crate::runtime::hf::load_weights(dir, &cfg)
                .with_context(|| format!("--init-from {}", dir.display()))?,
        ),
        None => None,
    };
    let resumed = match &a.resume {
        Some(path) => {
            let (dir, found) = checkpoint::resolve(path)?;
            let ck = Checkpoint::load(&dir)?;
            check_data(&dir, &ck, &corpus, &cfg)?;
            Some((dir, found, ck))
        }
        None => None,
    };
    let predicted: Vec<u64> = plan.devices.iter().map(|d| d.peak_bytes).collect();
    let predicted_sent = plan.predicted_sent_bytes();
    #[cfg(feature = "mpi")]
    let mut trainer = match &job.ranks {
        Some(mpi) => {
            let at = resumed.as_ref().map_or(0, |r| r.2.state.step).to_string();
            let eval = held.as_ref().map_or("none".into(), |h| h.fingerprint());
            mpi.agree(&[
                ("compiled plan", &plan.hash),
                ("has data", &corpus.fingerprint()),
                ("evaluates on", &eval),
                ("resumes at step", &at),
            ])?;
            let timeout = opts
                .comm_timeout
                .unwrap_or_else(|| crate::runtime::derived_comm_timeout(&plan));
            let fabric = mpi.fabric(plan.devices.len() as u32, timeout)?;
            Trainer::on_ranks(&cfg, plan, opts, fabric)?
        }
        None => Trainer::new(&cfg, plan, opts)?,
    };
    #[cfg(not(feature = "mpi"))]
    let mut trainer = Trainer::new(&cfg, plan, opts)?;
    if let (Some(params), Some(dir)) = (&init, &a.init_from) {
        trainer.init_from(params)?;
        if job.leader {
            eprintln!("initialised from {}", dir.display());
        }
    }
    if let Some((dir, found, ck)) = &resumed {
        trainer.restore(ck)?;
        if job.leader {
            eprintln!("{}", resumed_line(dir, *found, ck.state.step));
        }
    }
    let first_step = trainer.step_count() + 1;
    if first_step > a.steps {
        println!(
            "nothing ran: the checkpoint is at step {} and --steps {} is the total to reach",
            first_step - 1,
            a.steps
        );
        return Ok(());
    }
    if job.leader {
        print_header(
            &a,
            &cfg,
            &trainer,
            &p.applied,
            (&corpus, held.as_ref()),
            job,
        );
    }
    let bar = progress_bar(job.leader, first_step, a.steps);
    let config = LoopConfig {
        steps: a.steps,
        eval_every: a.eval_every,
        eval_batches: a.eval_batches,
        checkpoint: a.checkpoint.clone(),
        checkpoint_every: a.checkpoint_every,
        keep: a.keep.unwrap_or(0),
        metrics: a.metrics.clone(),
        dump_step1: a.dump_step1.clone(),
        leader: job.leader,
    };
    let sum = train_loop(
        &mut trainer,
        &cfg,
        &corpus,
        held.as_ref(),
        &config,
        &mut Bar(&bar),
    )?;
    bar.finish_and_clear();
    let trace = match a.trace.is_some() || a.report.is_some() {
        true => trainer.gather_trace()?,
        false => None,
    };
    if !job.leader {
        return Ok(());
    }
    print_summary(&a, &cfg, &sum);
    if let (Some(path), Some(trace)) = (&a.trace, &trace) {
        write_trace(path, trace)?;
    }
    if let (Some(path), Some(trace)) = (&a.report, &trace) {
        write_report(path, sim_cluster.as_ref(), trainer.plan(), trace, &cfg.name)?;
    }
    print_devices(&sum, &predicted, &predicted_sent);
    Ok(())
}

/// `resumed from DIR (how it was found) at step N`.
fn resumed_line(dir: &std::path::Path, found: checkpoint::Found, step: u32) -> String {
    let how = match found {
        checkpoint::Found::Directory => "",
        checkpoint::Found::Latest => " (the latest)",
        checkpoint::Found::Newest => " (no `latest` pointer: the newest complete one)",
    };
    format!("resumed from {}{how} at step {step}", dir.display())
}

/// What trains on what: the model, devices, plan, data, strategies and
/// evaluation.
fn print_header(
    a: &TrainArgs,
    cfg: &ModelConfig,
    trainer: &Trainer,
    applied: &[String],
    (corpus, held): (&Corpus, Option<&Corpus>),
    job: &Job,
) {
    let plan = trainer.plan();
    eprintln!(
        "training {} ({} parameters) on {} {}{}, plan {}, data: {}",
        cfg.name,
        cfg.param_count(),
        plan.devices.len(),
        match trainer.options().backend {
            crate::runtime::BackendKind::Cpu =>
                format!("CPU device(s) × {} thread(s)", trainer.threads()),
            crate::runtime::BackendKind::Cuda { gpus } => format!("device(s) on {gpus} GPU(s)"),
        },
        job_ranks(job),
        plan.hash,
        corpus.name
    );
    for line in applied {
        eprintln!("  strategy {line}");
    }
    if let (Some(h), Some(n)) = (held, a.eval_every) {
        eprintln!(
            "  evaluation every {n} steps: {} batches of {}",
            a.eval_batches, h.name
        );
    }
}

/// The leader's progress bar from `first_step` to `steps` (hidden on the
/// other ranks).
fn progress_bar(leader: bool, first_step: u32, steps: u32) -> ProgressBar {
    let bar = match leader {
        true => ProgressBar::new(u64::from(steps)),
        false => ProgressBar::hidden(),
    };
    bar.set_position(u64::from(first_step) - 1);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} step {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
        )
        .expect("valid template"),
    );
    bar
}

/// `--trace`: the run's trace, and where its compute went.
fn write_trace(path: &std::path::Path, trace: &serde_json::Value) -> Result<()> {
    std::fs::write(path, trace.to_string())
        .with_context(|| format!("writing trace {}", path.display()))?;
    println!("trace: {}", path.display());
    let (kernels, compute) = crate::sim::measured::kernel_totals(trace);
    if compute > 0.0 && !kernels.is_empty() {
        let top: Vec<String> = kernels
            .iter()
            .take(6)
            .map(|(k, t)| format!("{k} {:.0}%", 100.0 * t / compute))
            .collect();
        println!(
            "  where compute went (every device, steps after the first): {}",
            top.join(", ")
        );
    }
    Ok(())
}

/// The training data, checked against the model, and the held-out data
/// when the run evaluates (`--eval-data`, or a tenth of the training data).
fn data_of(a: &TrainArgs, cfg: &ModelConfig) -> Result<(Corpus, Option<Corpus>)> {
    let tokenizer = Tokenizer::parse(&a.tokenizer)?;
    let width = a.token_type.as_deref().map(Width::parse).transpose()?;
    let corpus = match &a.data {
        Some(path) => Corpus::open(path, tokenizer.clone(), width)?,
        None if width.is_some() => bail!("--token-type is for a `--data FILE.bin` token file"),
        None => Corpus::builtin_with(tokenizer.clone())?,
    };
    let (corpus, held) = match (a.eval_every, &a.eval_data) {
        (None, _) => (corpus, None),
        (Some(_), Some(path)) => (corpus, Some(Corpus::open(path, tokenizer, width)?)),
        (Some(_), None) => {
            let (train, held) = corpus.hold_out(0.1);
            (train, Some(held))
        }
    };
    corpus.check(cfg.vocab, cfg.seq_len as usize)?;
    if let Some(h) = &held {
        h.check(cfg.vocab, cfg.seq_len as usize)
            .context("the evaluation data")?;
    }
    Ok((corpus, held))
}

/// The runtime's options from the flags and the run config's optimizer.
fn options_of(
    a: &TrainArgs,
    mut optimizer: crate::session::OptimizerConfig,
) -> Result<TrainOptions> {
    if let Some(wd) = a.weight_decay {
        optimizer.weight_decay = wd;
    }
    optimizer.check()?;
    // Test builds' options have a fault-injection field more.
    #[allow(clippy::needless_update)]
    Ok(TrainOptions {
        seed: a.seed,
        adamw: AdamW {
            lr: a.lr,
            beta1: optimizer.beta1,
            beta2: optimizer.beta2,
            eps: optimizer.eps,
            weight_decay: optimizer.weight_decay,
        },
        schedule: Some(schedule_of(a)?),
        clip: a.clip,
        device_memory: a.device_memory.as_deref().map(parse_size).transpose()?,
        comm_timeout: match a.comm_timeout {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 && s <= 7.0 * 24.0 * 3600.0 => {
                Some(Duration::from_secs_f64(s))
            }
            Some(s) => {
                bail!("--comm-timeout must be more than 0 and at most 604800 seconds, got {s}")
            }
        },
        capture_grads: a.dump_step1.is_some(),
        trace: a.trace.is_some() || a.report.is_some(),
        threads: a.threads.map(|t| t as usize),
        backend: crate::runtime::BackendKind::parse(&a.backend, a.gpus)
            .map_err(anyhow::Error::msg)?,
        ..TrainOptions::default()
    })
}

/// The summary's first lines: losses, evaluation, experts, the last checkpoint.
fn print_summary(a: &TrainArgs, cfg: &ModelConfig, sum: &crate::runtime::Summary) {
    println!(
        "done: {} steps, loss {:.4} → {:.4}, {:.0} tokens/s",
        a.steps,
        sum.first_loss.unwrap_or(f64::NAN),
        sum.last_loss,
        sum.tokens_per_s
    );
    if let Some((step, l)) = sum.last_eval {
        println!("  eval loss {l:.4} at step {step}");
    }
    if let Some(moe) = &cfg.moe {
        let (dropped, routed) = (sum.moe_dropped, sum.moe_routed);
        println!(
            "  experts: {dropped} of {routed} token-expert assignments dropped ({:.2}%; capacity factor {})",
            100.0 * dropped as f64 / routed.max(1) as f64,
            moe.capacity_factor
                .map_or("none: dropless".to_string(), |c| c.to_string())
        );
    }
    if let Some(line) = &sum.last_checkpoint {
        println!("{line}");
    }
}

/// Each device's measured peak and last step's bytes beside the plan's.
fn print_devices(sum: &crate::runtime::Summary, predicted: &[u64], predicted_sent: &[u64]) {
    for (d, (m, p)) in sum.peak_bytes.iter().zip(predicted).enumerate() {
        let (s, ps) = (
            sum.sent_bytes.get(d).copied(),
            predicted_sent.get(d).copied(),
        );
        let sent = match (s, ps) {
            (Some(s), Some(ps)) if s > 0 || ps > 0 => format!(
                "; sent {} in the last step, {} planned",
                human_bytes(s),
                human_bytes(ps)
            ),
            _ => String::new(),
        };
        println!(
            "  device {d}: peak {} measured, {} planned{sent}",
            human_bytes(*m),
            human_bytes(*p)
        );
    }
    if let Some(rss) = peak_resident() {
        println!("  this process: peak resident memory {}", human_bytes(rss));
    }
}

/// The progress bar as the training loop's observer: lines above it also
/// when stderr is not a terminal (a run's log), where indicatif's `println`
/// prints nothing.
struct Bar<'a>(&'a ProgressBar);

impl Observer for Bar<'_> {
    fn step(&mut self, s: &StepStats, tokens_per_s: f64) {
        self.0
            .set_message(format!("loss {:.4} | {:.0} tok/s", s.loss, tokens_per_s));
        self.0.inc(1);
    }
    fn say(&mut self, line: String) {
        self.0.suspend(|| eprintln!("{line}"));
    }
    fn stopped(&mut self) {
        self.0.abandon();
    }
}

/// The process's peak resident set (Linux's `VmHWM`): weights, buffers,
/// the compiled plugins, and the pages of a token file it has read.
fn peak_resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    kib.trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?
        .checked_mul(1024)
}

/// A checkpoint that records its data resumes only on the same data,
/// where the next step's batch starts where it would have.
fn check_data(
    dir: &std::path::Path,
    ck: &Checkpoint,
    corpus: &Corpus,
    cfg: &ModelConfig,
) -> Result<()> {
    let Some(saved) = &ck.state.data else {
        return Ok(());
    };
    let here = corpus.position(ck.state.step, cfg.batch_size as usize, cfg.seq_len as usize);
    if saved.fingerprint != here.fingerprint || saved.tokens != here.tokens {
        bail!(
            "--resume {}: the checkpoint was trained on {} ({} tokens, fingerprint {}), this run's data is {} ({} tokens, fingerprint {}); give the same --data (and --tokenizer) to continue the run",
            dir.display(),
            saved.name,
            saved.tokens,
            saved.fingerprint,
            here.name,
            here.tokens,
            here.fingerprint
        );
    }
    if saved.next_token != here.next_token {
        bail!(
            "--resume {}: the checkpoint's next batch starts at token {} of the data, this run's would start at {}",
            dir.display(),
            saved.next_token,
            here.next_token
        );
    }
    Ok(())
}

/// `--report`: the median measured step, and with `--simulate` (its
/// cluster given) the predicted one beneath it.
fn write_report(
    path: &std::path::Path,
    cluster: Option<&crate::sim::Cluster>,
    plan: &crate::compile::plan::Plan,
    trace: &serde_json::Value,
    model: &str,
) -> Result<()> {
    use crate::sim::{self, measured, report};
    let m = measured::from_trace(plan, trace, None).context("reading the run's trace")?;
    let title = format!(
        "{model} on {} CPU device(s), plan {}",
        plan.devices.len(),
        plan.hash
    );
    let mut line = format!(
        "report: {} (measured step {}: {}",
        path.display(),
        m.step,
        report::human_time(m.sim.step_time)
    );
    let predicted = match cluster {
        Some(cluster) => {
            let s = sim::simulate(plan, cluster).context("simulating the plan")?;
            line.push_str(&format!(
                "; simulated on {}: {}, {:+.1}%",
                cluster.name,
                report::human_time(s.step_time),
                100.0 * (s.step_time / m.sim.step_time - 1.0)
            ));
            Some((cluster, s))
        }
        None => None,
    };
    let mut sections = vec![report::Section {
        title: format!("measured: {title}"),
        sim: &m.sim,
        capacity: None,
        source: format!(
            "measured on this machine: step {} (the median of {} steps by time)",
            m.step,
            m.step_times.len()
        ),
    }];
    if let Some((c, s)) = &predicted {
        sections.push(report::Section {
            title: format!("simulated: {title}"),
            sim: s,
            capacity: Some(c.memory_bytes),
            source: format!("predicted by the simulator on `{}`", c.name),
        });
    }
    std::fs::write(
        path,
        report::html(&format!("Piper run report — {title}"), &sections),
    )
    .with_context(|| format!("writing {}", path.display()))?;
    println!("{line})");
    Ok(())
}

/// ` on 2 MPI ranks` when this is a job of several processes.
fn job_ranks(job: &Job) -> String {
    #[cfg(feature = "mpi")]
    if let Some(m) = &job.ranks {
        return format!(" on {} MPI rank(s)", m.size());
    }
    let _ = job;
    String::new()
}
