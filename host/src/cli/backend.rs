//! `piper backend info`: what a backend runs on, and a kernel and a matrix
//! product against known results. `piper backend check`: a backend held to the CPU backend on this
//! machine — every kernel on the same inputs (at small shapes and at
//! gpt2-small's widths), `tiny` trained on one device against the CPU's
//! losses and again against its own bits, multi-device strategies on the backend against
//! its own one-device losses, and (with `--bench`) `gpt2-small`'s speed.
//! Runs in stages (kernels, one device, strategies, bench): a stage that
//! errs or panics is recorded under `errors` and the next one runs;
//! `check.json` in `--out` is written again after every stage. Fails when
//! any check or stage does.
//! `scripts/gpu-check.sh` runs it on a GPU machine; on the CPU backend it
//! checks the CPU against itself on another thread count.

use super::verify::tiny_moe;
use crate::compile::{compile, human_bytes};
use crate::dag::{Cluster, TrainingDag};
use crate::model::ModelConfig;
use crate::plugin::{PluginHost, SandboxLimits};
use crate::runtime::backend::check::{self, KernelCheck};
use crate::runtime::backend::{self, Backend, BackendError, BackendKind, Placement, WithBackend};
use crate::runtime::{Corpus, TrainOptions, Trainer};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args)]
pub struct CheckArgs {
    /// The backend to check against the CPU's: `cuda`, or `cpu` (the CPU
    /// against itself on another thread count).
    #[arg(long, default_value = "cuda", value_parser = ["cpu", "cuda"])]
    backend: String,
    /// GPUs of this machine for the multi-device checks.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    gpus: u32,
    /// Steps of each training check.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
    steps: u32,
    /// Also measure `gpt2-small` (batch 8 × 1024) on one device and under
    /// 1F1B on 4 devices: tokens/s, MFU and peak memory.
    #[arg(long)]
    bench: bool,
    /// Peak dense fp32 FLOP/s of one device for the MFU (default: an H200's
    /// 67 TFLOP/s on `cuda`, none on `cpu`).
    #[arg(long)]
    peak_flops: Option<f64>,
    /// Where `check.json` goes.
    #[arg(long, default_value = ".")]
    out: PathBuf,
}

#[derive(Args)]
pub struct InfoArgs {
    /// The backend to describe: `cuda` or `cpu`.
    #[arg(long, default_value = "cuda", value_parser = ["cpu", "cuda"])]
    backend: String,
}

/// `piper backend info`: what the backend runs on, then a kernel and a
/// cuBLAS (or gemm) product on one device against results known exactly.
pub fn info(a: InfoArgs) -> Result<()> {
    let kind = BackendKind::parse(&a.backend, 1).map_err(anyhow::Error::msg)?;
    match kind {
        BackendKind::Cpu => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            println!("cpu: {cores} cores");
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda { .. } => {
            for (k, v) in backend::cuda::setup::info().map_err(anyhow::Error::msg)? {
                println!("{k}: {v}");
            }
        }
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda { .. } => bail!(
            "this piper was built without CUDA: build it with `cargo build --release -p piper --features cuda`"
        ),
    }
    let place = Placement {
        devices: &[0],
        peaks: &[0],
        threads: 1,
    };
    let lines = backend::with_backend(kind, &place, Smoke)
        .map_err(|e| anyhow::anyhow!("{} backend: {e}", kind.name()))?
        .map_err(|e| anyhow::anyhow!("{} backend, device 0: {e}", kind.name()))?;
    for l in &lines {
        println!("{l}");
    }
    Ok(())
}

/// A kernel (the residual sum) and a matrix product with a bias, on small
/// integers whose results fp32 holds exactly.
struct Smoke;

impl WithBackend for Smoke {
    type Output = Result<Vec<String>, BackendError>;
    fn run<B: Backend>(
        self,
        make: &(dyn Fn(usize) -> Result<B, BackendError> + Sync),
    ) -> Self::Output {
        let b = make(0)?;
        let s = b.stream()?;
        let x = b.upload(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?; // [2, 3]
        let w = b.upload(vec![1.0, 0.0, 1.0, 0.0, 1.0, 0.0])?; // [2, 3]: out, in
        let bias = b.upload(vec![0.5, -1.0])?;
        let (mut prod, mut sum) = (b.zeros(4)?, b.zeros(6)?);
        b.enter(&s, None, || {
            b.matmul_forward(&mut prod, &x, &w, Some(&bias), 2, 3, 2);
            b.residual_forward(&mut sum, &x, &x);
        });
        b.check()?;
        let want_prod = [4.5, 1.0, 10.5, 4.0];
        let want_sum = [2.0, 4.0, 6.0, 8.0, 10.0, 12.0];
        let mut lines = Vec::new();
        for (what, got, want) in [
            (
                "matrix product [2x3]·[3x2] + bias",
                b.download(&prod)?,
                &want_prod[..],
            ),
            ("residual kernel x + x", b.download(&sum)?, &want_sum[..]),
        ] {
            if got != want {
                return Err(BackendError::Device(format!(
                    "{what}: got {got:?}, want {want:?}"
                )));
            }
            lines.push(format!("{what}: {got:?} ok"));
        }
        Ok(lines)
    }
}

/// Loss tolerances: a backend against the CPU's arithmetic (other sum
/// orders, other `exp`), and strategies against one device on one backend.
const TRAIN_VS_CPU: f64 = 1e-4;
const STRATEGY_VS_ONE: f64 = 1e-5;
/// bf16 runs against the CPU's bf16 run: each store rounds fp32 results
/// that agree up to the order of their sums, and a value near a rounding
/// boundary may go either way, one bf16 step; over 10 steps the CPU's bf16
/// strategies stay within 1e-3 of one device, and a backend within 1e-2.
const BF16_VS_CPU: f64 = 1e-2;
const BF16_STRATEGY_VS_ONE: f64 = 1e-3;

/// A strategy as bundled plugins with options.
type Strategy = &'static [(&'static str, &'static [(&'static str, &'static str)])];

/// The multi-device checks: name, model, devices, strategy.
fn strategy_checks() -> Vec<(&'static str, ModelConfig, u32, Strategy)> {
    vec![
        (
            "1f1b",
            ModelConfig::tiny(),
            4,
            &[("1f1b", &[("microbatches", "8")])],
        ),
        (
            "zero3+1f1b",
            ModelConfig::tiny(),
            4,
            &[
                ("zero", &[("stage", "3"), ("dp", "2")]),
                ("1f1b", &[("microbatches", "4")]),
            ],
        ),
        (
            "dualpipev",
            ModelConfig::tiny(),
            4,
            &[("dualpipev", &[("microbatches", "8")])],
        ),
        ("tp=2", ModelConfig::tiny(), 2, &[("tp", &[("tp", "2")])]),
        (
            "tp=2+sp",
            ModelConfig::tiny(),
            2,
            &[("tp", &[("tp", "2"), ("sequence-parallel", "true")])],
        ),
        ("ep on 4", tiny_moe(), 4, &[("ep", &[("ep", "4")])]),
    ]
}

/// What a training check measured.
struct Run {
    losses: Vec<f64>,
    /// Measured peak bytes per device, over the run.
    peaks: Vec<u64>,
    /// Seconds of each step.
    secs: Vec<f64>,
    /// The plan's predicted peak per device.
    planned: Vec<u64>,
}

/// The plan of `cfg` on `devices` devices under the bundled `strategy`.
fn plan_of(
    host: &PluginHost,
    cfg: &ModelConfig,
    devices: u32,
    strategy: Strategy,
) -> Result<crate::compile::plan::Plan> {
    let mut dag = TrainingDag::build(cfg, Cluster::new(devices))?;
    for (name, opts) in strategy {
        let o: Vec<(String, String)> = (opts.iter())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        host.apply(&host.load(name)?, &mut dag, &o)?;
    }
    Ok(compile(&dag)?)
}

/// Train `steps` steps of `cfg` under `strategy` on `devices` devices of
/// `kind`.
fn train(
    host: &PluginHost,
    cfg: &ModelConfig,
    devices: u32,
    strategy: Strategy,
    kind: BackendKind,
    steps: u32,
) -> Result<Run> {
    let plan = plan_of(host, cfg, devices, strategy)?;
    let planned: Vec<u64> = plan.devices.iter().map(|d| d.peak_bytes).collect();
    let opts = TrainOptions {
        backend: kind,
        ..TrainOptions::default()
    };
    let mut t = Trainer::new(cfg, plan, opts)?;
    let corpus = Corpus::builtin();
    let (mut losses, mut peaks, mut secs) = (Vec::new(), vec![0u64; devices as usize], Vec::new());
    for s in 1..=steps {
        let batch = corpus.batch(s, cfg.batch_size as usize, cfg.seq_len as usize, cfg.vocab)?;
        let st = t.step(&batch).with_context(|| format!("step {s}"))?;
        losses.push(st.loss);
        for (p, x) in peaks.iter_mut().zip(&st.peak_bytes) {
            *p = (*p).max(*x);
        }
        secs.push(st.elapsed.as_secs_f64());
    }
    Ok(Run {
        losses,
        peaks,
        secs,
        planned,
    })
}

/// The largest relative difference of two loss curves.
fn worst(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) / y).abs())
        .fold(0.0, f64::max)
}

/// The kernel checks, on the backend `kind` names against the CPU.
struct Kernels {
    reference: backend::cpu::Cpu,
}

impl WithBackend for Kernels {
    type Output = Result<Vec<KernelCheck>, BackendError>;
    fn run<B: Backend>(
        self,
        make: &(dyn Fn(usize) -> Result<B, BackendError> + Sync),
    ) -> Self::Output {
        check::kernels(&self.reference, &make(0)?)
    }
}

/// One stage's figures for `check.json`, and the checks in it that failed.
type Stage = (serde_json::Value, Vec<String>);

/// The report as it grows: written again after every stage, so a stage
/// that kills the process (a GPU fault) leaves the ones before it on disk.
struct Report {
    map: serde_json::Map<String, serde_json::Value>,
    failed: Vec<String>,
    errors: serde_json::Map<String, serde_json::Value>,
    path: PathBuf,
}

impl Report {
    /// Run `stage`: its figures go under `name`; an error or a panic is
    /// recorded under `errors` and the next stage runs all the same.
    fn stage(&mut self, name: &str, stage: impl FnOnce() -> Result<Stage>) -> Result<()> {
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(stage));
        let error = match outcome {
            Ok(Ok((value, failed))) => {
                self.map.insert(name.into(), value);
                self.failed.extend(failed);
                None
            }
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(panic) => Some(format!(
                "panicked: {}",
                (panic.downcast_ref::<String>().map(String::as_str))
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)")
            )),
        };
        if let Some(e) = error {
            println!("stage {name}: ERROR {e}");
            self.failed.push(format!("stage {name}"));
            self.errors.insert(name.into(), json!(e));
        }
        println!("stage {name}: {:.1} s", t.elapsed().as_secs_f64());
        self.write()
    }

    fn write(&self) -> Result<()> {
        let mut out = self.map.clone();
        out.insert("errors".into(), json!(self.errors));
        out.insert("failed".into(), json!(self.failed));
        std::fs::write(&self.path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

pub fn check(a: CheckArgs) -> Result<()> {
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let kind = BackendKind::parse(&a.backend, a.gpus).map_err(anyhow::Error::msg)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The CPU against itself: one thread against every core.
    let (reference, other_threads) = match kind {
        BackendKind::Cpu => (1, cores.max(2)),
        _ => (cores, 1),
    };
    let mut report = Report {
        map: serde_json::Map::new(),
        failed: Vec::new(),
        errors: serde_json::Map::new(),
        path: a.out.join("check.json"),
    };
    let host = PluginHost::new(SandboxLimits::default(), None)?;
    report.stage("kernels", || kernels(kind, reference, other_threads))?;
    report.stage("one_device", || one_device(&host, kind, a.steps))?;
    report.stage("strategies", || strategies(&host, kind, a.steps))?;
    report.stage("bf16", || bf16(&host, kind, a.steps))?;
    if a.bench {
        let peak = a.peak_flops.or(match kind {
            BackendKind::Cuda { .. } => Some(67e12),
            BackendKind::Cpu => None,
        });
        report.stage("bench", || bench(&host, kind, peak))?;
    }
    println!("report: {}", report.path.display());
    if !report.failed.is_empty() {
        let first = (report.errors.values().next())
            .and_then(|e| e.as_str())
            .map_or(String::new(), |e| format!("; the first stage error: {e}"));
        bail!(
            "{} check(s) failed: {}{first}",
            report.failed.len(),
            report.failed.join(", ")
        );
    }
    Ok(())
}

/// Every kernel of `kind` against the CPU's on the same inputs.
fn kernels(kind: BackendKind, reference: usize, other_threads: usize) -> Result<Stage> {
    let t = Instant::now();
    let place = Placement {
        devices: &[0],
        peaks: &[0],
        threads: other_threads,
    };
    let kernels = backend::with_backend(
        kind,
        &place,
        Kernels {
            reference: backend::cpu::Cpu::new(0, reference)?,
        },
    )
    .map_err(|e| anyhow::anyhow!("{} backend: {e}", kind.name()))?
    .map_err(|e| anyhow::anyhow!("checking the kernels: {e}"))?;
    let mut failed = Vec::new();
    for k in &kernels {
        let verdict = if k.passed() { "ok" } else { "FAILED" };
        println!(
            "kernel {:<28} {:<10} error {:.2e} (tolerance {:.0e}) {verdict}",
            k.kernel, k.shape, k.error, k.tolerance
        );
        if !k.passed() {
            failed.push(format!("kernel {} ({})", k.kernel, k.shape));
        }
    }
    println!(
        "{} kernels checked in {:.1} s",
        kernels.len(),
        t.elapsed().as_secs_f64()
    );
    Ok((serde_json::to_value(&kernels)?, failed))
}

/// One step of every strategy check: a single device under `1f1b`.
const ONE: Strategy = &[("1f1b", &[("stages", "1"), ("microbatches", "1")])];

/// `tiny` on one device of `kind` against the CPU's losses.
fn one_device(host: &PluginHost, kind: BackendKind, steps: u32) -> Result<Stage> {
    let tiny = ModelConfig::tiny();
    let cpu = train(host, &tiny, 1, ONE, BackendKind::Cpu, steps)?.losses;
    let Run {
        losses: mine,
        peaks,
        planned,
        ..
    } = train(host, &tiny, 1, ONE, kind, steps)?;
    let w = worst(&mine, &cpu);
    let ok = w <= TRAIN_VS_CPU;
    println!(
        "tiny, {steps} steps on one {} device: losses {:.4} -> {:.4}, worst relative difference to the CPU's {w:.2e} (tolerance {TRAIN_VS_CPU:.0e}) {}; peak {} measured, {} planned",
        kind.name(),
        mine[0],
        mine[mine.len() - 1],
        if ok { "ok" } else { "FAILED" },
        human_bytes(peaks[0]),
        human_bytes(planned[0])
    );
    let mut failed = Vec::new();
    if !ok {
        failed.push("tiny on one device".into());
    }
    // The same run again gives the same bits (no atomics in a sum, no
    // nondeterministic library path).
    let again = train(host, &tiny, 1, ONE, kind, steps)?.losses;
    let bitwise = again
        .iter()
        .map(|l| l.to_bits())
        .eq(mine.iter().map(|l| l.to_bits()));
    println!(
        "tiny again on one {} device: {}",
        kind.name(),
        if bitwise {
            "the same bits ok"
        } else {
            "other bits FAILED"
        }
    );
    if !bitwise {
        failed.push("tiny repeated bit for bit".into());
    }
    Ok((
        json!({"losses": mine, "cpu_losses": cpu, "worst": w, "tolerance": TRAIN_VS_CPU, "repeat_losses": again, "bitwise_repeat": bitwise, "peak_bytes": peaks[0], "planned_bytes": planned[0]}),
        failed,
    ))
}

/// Each multi-device strategy on `kind` against its one-device losses.
fn strategies(host: &PluginHost, kind: BackendKind, steps: u32) -> Result<Stage> {
    let mut failed = Vec::new();
    let mut out = Vec::new();
    for (name, cfg, devices, strategy) in strategy_checks() {
        let base = train(host, &cfg, 1, ONE, kind, steps)?.losses;
        let Run {
            losses,
            peaks,
            planned,
            ..
        } = train(host, &cfg, devices, strategy, kind, steps)
            .with_context(|| format!("{name} on {devices} devices"))?;
        let w = worst(&losses, &base);
        let ok = w <= STRATEGY_VS_ONE;
        println!(
            "{name} on {devices} {} devices ({}): worst relative difference to one device {w:.2e} (tolerance {STRATEGY_VS_ONE:.0e}) {}",
            kind.name(),
            cfg.name,
            if ok { "ok" } else { "FAILED" }
        );
        if !ok {
            failed.push(format!("{name} on {devices} devices"));
        }
        out.push(json!({"strategy": name, "model": cfg.name, "devices": devices, "worst": w, "tolerance": STRATEGY_VS_ONE, "losses": losses, "one_device": base, "peak_bytes": peaks, "planned_bytes": planned}));
    }
    Ok((json!(out), failed))
}

/// bf16 mixed precision on `kind`: `tiny` on one device against the CPU's
/// bf16 losses, and ZeRO-3 × 1F1B with bf16 gradient reductions against
/// its own one-device bf16-reduce run.
fn bf16(host: &PluginHost, kind: BackendKind, steps: u32) -> Result<Stage> {
    use crate::model::{Dtype, Precision};
    let tiny = ModelConfig {
        precision: Precision::BF16,
        ..ModelConfig::tiny()
    };
    let cpu = train(host, &tiny, 1, ONE, BackendKind::Cpu, steps)?.losses;
    let mine = train(host, &tiny, 1, ONE, kind, steps)?;
    let w = worst(&mine.losses, &cpu);
    let ok = w <= BF16_VS_CPU;
    println!(
        "tiny in bf16, {steps} steps on one {} device: losses {:.4} -> {:.4}, worst relative difference to the CPU's bf16 {w:.2e} (tolerance {BF16_VS_CPU:.0e}) {}; peak {} measured, {} planned",
        kind.name(),
        mine.losses[0],
        mine.losses[mine.losses.len() - 1],
        if ok { "ok" } else { "FAILED" },
        human_bytes(mine.peaks[0]),
        human_bytes(mine.planned[0])
    );
    let mut failed = Vec::new();
    if !ok {
        failed.push("tiny in bf16 on one device".into());
    }
    let wire = ModelConfig {
        precision: Precision {
            reduce: Dtype::Bf16,
            ..Precision::BF16
        },
        ..ModelConfig::tiny()
    };
    let zero3: Strategy = &[
        ("zero", &[("stage", "3"), ("dp", "2")]),
        ("1f1b", &[("microbatches", "4")]),
    ];
    let base = train(host, &wire, 1, ONE, kind, steps)?.losses;
    let run = train(host, &wire, 4, zero3, kind, steps)
        .context("zero3+1f1b in bf16 with bf16 reductions on 4 devices")?;
    let ws = worst(&run.losses, &base);
    let ok = ws <= BF16_STRATEGY_VS_ONE;
    println!(
        "zero3+1f1b in bf16 (bf16 reductions) on 4 {} devices: worst relative difference to one device {ws:.2e} (tolerance {BF16_STRATEGY_VS_ONE:.0e}) {}",
        kind.name(),
        if ok { "ok" } else { "FAILED" }
    );
    if !ok {
        failed.push("zero3+1f1b in bf16 on 4 devices".into());
    }
    Ok((
        json!({"losses": mine.losses, "cpu_losses": cpu, "worst": w, "tolerance": BF16_VS_CPU, "peak_bytes": mine.peaks[0], "planned_bytes": mine.planned[0],
               "zero3_1f1b_reduce_bf16": {"losses": run.losses, "one_device": base, "worst": ws, "tolerance": BF16_STRATEGY_VS_ONE}}),
        failed,
    ))
}

/// The step-1 loss on the CPU: the same initial weights (the same seed)
/// on the same first batch, forward only. What the GPU's step 1 is held to.
fn cpu_first_loss(host: &PluginHost, cfg: &ModelConfig) -> Result<f64> {
    let mut t = Trainer::new(cfg, plan_of(host, cfg, 1, ONE)?, TrainOptions::default())?;
    let batch =
        Corpus::builtin().batch(1, cfg.batch_size as usize, cfg.seq_len as usize, cfg.vocab)?;
    Ok(t.eval(&batch)?)
}

/// The GPUs' pool high-water marks (`reset`: start a new one), `None` on
/// the CPU (its memory account is the runtime's own, `peak_bytes`).
fn pool_high_water(kind: BackendKind, reset: bool) -> Result<Option<Vec<u64>>> {
    match kind {
        BackendKind::Cpu => Ok(None),
        #[cfg(feature = "cuda")]
        BackendKind::Cuda { gpus } => backend::cuda::setup::pool_high_water(gpus, reset)
            .map(Some)
            .map_err(anyhow::Error::msg),
        #[cfg(not(feature = "cuda"))]
        BackendKind::Cuda { .. } => {
            let _ = reset;
            bail!("this piper was built without CUDA")
        }
    }
}

/// Relative tolerance of gpt2-small's step-1 loss against the CPU's (fp32
/// sums in another order over 8 × 1024 tokens).
const FIRST_LOSS_VS_CPU: f64 = 1e-4;

/// `gpt2-small` at batch 8 × 1024: tokens/s (median of the steps after the
/// first two), MFU against `peak` FLOP/s of each physical device (virtual
/// devices on one GPU share its peak), measured peak memory; on one device,
/// and under 1F1B on 4 virtual devices. Each run's step-1 loss is checked
/// against the CPU's ([`cpu_first_loss`]); `ln V` is printed beside it (a
/// fresh GPT-2 starts above it: gpt2-small 11.02 against 10.82 on the CPU).
fn bench(host: &PluginHost, kind: BackendKind, peak: Option<f64>) -> Result<Stage> {
    let mut cfg = ModelConfig::preset("gpt2-small")?;
    cfg.batch_size = 8;
    cfg.seq_len = 1024;
    let flops: f64 = cfg
        .segments()
        .iter()
        .map(|s| s.cost.fwd_flops + s.cost.bwd_flops)
        .sum();
    let tokens = (cfg.batch_size * cfg.seq_len) as f64;
    let expected = cpu_first_loss(host, &cfg).context("gpt2-small's step-1 loss on the CPU")?;
    let ln_v = f64::from(cfg.vocab).ln();
    let mut out = Vec::new();
    let mut failed = Vec::new();
    let bf16_cfg = ModelConfig {
        precision: crate::model::Precision::BF16,
        ..cfg.clone()
    };
    let bf16_expected =
        cpu_first_loss(host, &bf16_cfg).context("gpt2-small's bf16 step-1 loss on the CPU")?;
    let runs: [(&str, u32, Strategy, bool); 3] = [
        (
            "one device",
            1,
            &[("1f1b", &[("stages", "1"), ("microbatches", "1")])],
            false,
        ),
        (
            "1f1b on 4 devices",
            4,
            &[("1f1b", &[("microbatches", "8")])],
            false,
        ),
        (
            "one device in bf16",
            1,
            &[("1f1b", &[("stages", "1"), ("microbatches", "1")])],
            true,
        ),
    ];
    for (name, devices, strategy, bf16) in runs {
        let (cfg, expected, precision) = match bf16 {
            true => (&bf16_cfg, bf16_expected, "bf16"),
            false => (&cfg, expected, "fp32"),
        };
        // bf16 products run on the tensor cores: MFU against their peak
        // (the H100's and H200's dense bf16, 989 TFLOP/s).
        let peak = match (bf16, kind) {
            (true, BackendKind::Cuda { .. }) => Some(989e12),
            _ => peak,
        };
        pool_high_water(kind, true)?;
        let Run {
            losses,
            peaks,
            mut secs,
            planned,
        } = train(host, cfg, devices, strategy, kind, 6)?;
        let pool = pool_high_water(kind, false)?;
        let first = losses.first().copied().unwrap_or(f64::NAN);
        let off = (first - expected).abs() / expected;
        let first_ok = off <= FIRST_LOSS_VS_CPU;
        println!(
            "gpt2-small {name}: step-1 loss {first:.5}, the CPU's {expected:.5} (relative difference {off:.1e}, tolerance {FIRST_LOSS_VS_CPU:.0e}; ln V {ln_v:.3}) {}",
            if first_ok { "ok" } else { "FAILED" }
        );
        if !first_ok {
            failed.push(format!("gpt2-small {name}: step-1 loss"));
        }
        let mut timed = secs.split_off(2);
        timed.sort_by(|a, b| a.total_cmp(b));
        let step = timed[timed.len() / 2];
        let tps = tokens / step;
        // Virtual devices share the physical GPUs: the peak is theirs.
        let physical = match kind {
            BackendKind::Cuda { gpus } => gpus.min(devices).max(1),
            BackendKind::Cpu => 1,
        };
        let mfu = peak.map(|p| flops / step / (p * f64::from(physical)));
        println!(
            "gpt2-small 8x1024 {precision}, {name} ({}): {tps:.0} tokens/s, step {:.1} ms{}, peak {}",
            kind.name(),
            step * 1e3,
            mfu.map_or(String::new(), |m| format!(", MFU {:.1}%", 100.0 * m)),
            peaks
                .iter()
                .map(|p| human_bytes(*p))
                .collect::<Vec<_>>()
                .join(" / ")
        );
        if let Some(pool) = &pool {
            println!(
                "gpt2-small {name}: the GPU pool's high-water mark {} (every plan device on it), the plan's peaks {} together",
                pool.iter().map(|p| human_bytes(*p)).collect::<Vec<_>>().join(" / "),
                human_bytes(planned.iter().sum())
            );
        }
        out.push(json!({"run": name, "devices": devices, "precision": precision, "tokens_per_s": tps, "step_ms": step * 1e3, "mfu": mfu, "peak_bytes": peaks, "planned_bytes": planned, "first_loss": first, "cpu_first_loss": expected, "pool_high_water_bytes": pool}));
    }
    Ok((json!(out), failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU's forward-only step-1 loss is the loss a training run's
    /// first step reports, and a fresh GPT-2 starts above `ln V` (so `ln V`
    /// itself is no test of a run).
    #[test]
    fn the_cpu_first_loss_is_the_first_steps_loss() {
        let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
        let cfg = ModelConfig {
            layers: 1,
            seq_len: 64,
            batch_size: 2,
            ..ModelConfig::gpt2_small()
        };
        let first = train(&host, &cfg, 1, ONE, BackendKind::Cpu, 1)
            .unwrap()
            .losses[0];
        let eval = cpu_first_loss(&host, &cfg).unwrap();
        assert!(
            ((first - eval) / eval).abs() < 1e-6,
            "step 1 {first}, forward only {eval}"
        );
        assert!(first > f64::from(cfg.vocab).ln() * 1.01, "{first}");
    }
}
