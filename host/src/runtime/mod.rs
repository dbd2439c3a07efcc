//! Runtime: executes per-device plans with real numerics. Strategy-agnostic:
//! it reads a [`Plan`] (from `compile/`) and the model config, nothing else.
//! After `compile/` in the flow.
//!
//! Per training step, every (device, stream) of the plan is a thread that runs
//! its ops in plan order, waiting on the plan's cross-stream events; devices
//! talk through a [`comm::Comm`] (in process: [`comm::LocalComm`]). Each device owns its
//! parameters, gradients and AdamW moments (for the segments it runs) and its
//! transient buffers, which are reference-counted by the plan's readers and
//! freed at their last use. Every byte is accounted against the device's
//! memory cap; the measured peak is reported beside the plan's prediction.
//!
//! Numerics: the loss is the mean over every token of the global batch; each
//! op scales its gradient by `1 / (B·T)` of the global batch, so microbatch
//! accumulation and data-parallel sums give the full-batch gradient whatever
//! the strategy. Gradient clipping uses the global norm (the plan's
//! `grad-norm` all-reduce; each parameter counted once: by DP replica 0, and
//! the tied `wte` by the embedding's device).

//!
//! Rooms: `device` (states, setup, restore), `buffers` (transient buffers,
//! one accounting path), `zero` (bucket layout, shards, sharded step,
//! gathers), `ops/` (one file per op family, dispatched on the plan's
//! enums), `step` (threads, aborts, bounded waits), `comm/` (the [`Comm`]
//! trait and its implementations), `backend/` (the [`backend::Backend`]
//! trait, the model composed over it, and its implementations). Every room
//! is generic over the backend; [`backend::with_backend`] is the one place
//! that picks it, and parameters are named by [`backend::ParamId`] (names
//! only at the checkpoint and dump edge).

pub mod backend;
mod buffers;
pub mod checkpoint;
pub mod comm;
pub mod data;
mod device;
mod error;
mod files;
#[cfg(feature = "fingerprint")]
mod fingerprint;
pub mod hf;
pub mod model;
mod ops;
pub mod schedule;
mod spread;
mod states;
mod step;
mod sync;
mod trace;
pub mod train_loop;
#[cfg(feature = "mpi")]
mod wire;
mod zero;

pub use backend::{AdamW, BackendKind};
pub use checkpoint::NamedTensors;
pub use comm::Comm;
pub use data::{Batch, Corpus, DataError, DataPosition, Tokenizer};
pub use error::RuntimeError;
pub use schedule::{Decay, Schedule};
pub use train_loop::{train_loop, LoopConfig, LoopError, Observer, Summary};

use crate::compile::plan::DevicePlan;
use crate::compile::Plan;
use crate::model::params::ParamTable;
use crate::model::{ModelConfig, Segment};
use backend::{Backend, BackendError, ParamMap, WithBackend};
use device::{Device, DeviceStats};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zero::{HostStates, ShardPart};

/// How to train.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub seed: u64,
    /// AdamW's hyper-parameters; `adamw.lr` is the rate of every step
    /// unless a schedule is given.
    pub adamw: AdamW,
    /// The learning rate per step (`None`: `adamw.lr` throughout).
    pub schedule: Option<Schedule>,
    /// Clip the global gradient norm to this (0: no clipping).
    pub clip: f32,
    /// Memory cap per device, bytes (`None`: no cap).
    pub device_memory: Option<u64>,
    /// Longest wait for a peer before a communication error; `None`:
    /// derived from the plan ([`derived_comm_timeout`]).
    pub comm_timeout: Option<Duration>,
    /// Keep each step's gradients (before clipping) for [`Trainer::last_grads`].
    pub capture_grads: bool,
    /// Record what every stream did, for [`Trainer::trace_json`].
    pub trace: bool,
    /// Kernel threads per device (`None`: [`default_threads`]). Results are
    /// the same bits for every count.
    pub threads: Option<usize>,
    /// The backend the devices compute on.
    pub backend: BackendKind,
    /// Fault injection for the runtime's own tests: panic on `device` when
    /// an op whose label starts with the text is about to run.
    #[cfg(test)]
    pub(crate) inject_panic: Option<(u32, String)>,
}

/// Kernel threads per device when none are asked for: this machine's cores
/// shared among the devices of this process and the processes of this job
/// on this machine (Open MPI's and MPICH's local rank count), at least 1.
pub fn default_threads(devices_here: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / (devices_here.max(1) * local_ranks())).max(1)
}

/// The ranks of this job on this machine (Open MPI's or MPICH's count; 1
/// outside MPI): they share its cores and memory.
fn local_ranks() -> usize {
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
        .unwrap_or(1)
        .max(1)
}

/// The most kernel threads a device may be given.
pub const MAX_THREADS: usize = 1024;

/// The slowest rate any device is assumed to compute at when the plan's
/// waits are bounded (well below one CPU core).
const SLOWEST_FLOPS: f64 = 0.2e9;
/// No wait is bounded below this.
const TIMEOUT_FLOOR: Duration = Duration::from_secs(10);

/// How long a device may wait for a peer in `plan`: every op of the busiest
/// device at [`SLOWEST_FLOPS`] (a wait can never be longer than the whole
/// step of the device it waits for), doubled, and at least 10 s.
pub fn derived_comm_timeout(plan: &Plan) -> Duration {
    let busiest = plan
        .devices
        .iter()
        .map(|d| {
            d.streams
                .iter()
                .flat_map(|s| s.ops.iter())
                .map(|o| o.flops + o.bytes as f64)
                .sum::<f64>()
        })
        .fold(0.0f64, f64::max);
    let secs = 2.0 * busiest / SLOWEST_FLOPS;
    TIMEOUT_FLOOR.max(Duration::from_secs_f64(secs.min(24.0 * 3600.0)))
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            seed: 1337,
            adamw: AdamW::default(),
            schedule: None,
            clip: 1.0,
            device_memory: None,
            comm_timeout: None,
            capture_grads: false,
            trace: false,
            threads: None,
            backend: BackendKind::default(),
            #[cfg(test)]
            inject_panic: None,
        }
    }
}

/// What one step did.
#[derive(Clone, Debug)]
pub struct StepStats {
    pub step: u32,
    pub loss: f64,
    pub grad_norm: f64,
    /// The learning rate this step's update ran at.
    pub lr: f32,
    pub elapsed: Duration,
    /// Measured peak bytes per device (model states + transient buffers).
    pub peak_bytes: Vec<u64>,
    /// Model states per device (parameters, gradients, optimizer moments,
    /// sharded or not) as the runtime allocated them.
    pub state_bytes: Vec<u64>,
    /// Bytes each device sent to other devices this step (messages and its
    /// part of every collective, as the transport moved them).
    pub comm_bytes: Vec<u64>,
    /// MoE: expert assignments (token × top-k choice) routed this step,
    /// and how many of them capacity dropped (zero for dense models).
    pub moe_routed: u64,
    pub moe_dropped: u64,
}

/// One device's share of a kind of state, on the host: whole tensors and
/// ZeRO shards.
type Part = (ParamMap<Vec<f32>>, Vec<zero::Shard>);

/// Full tensors from per-device parts in device order: each whole tensor
/// from the first device holding it, then ZeRO shards put back together.
fn merge(parts: Vec<Part>) -> ParamMap<Vec<f32>> {
    let mut out = ParamMap::new();
    let mut shards = Vec::new();
    for (whole, s) in parts {
        for (k, v) in whole {
            if !out.contains(k) {
                out.insert(k, v);
            }
        }
        shards.extend(s);
    }
    zero::assemble(shards, &mut out);
    out
}

/// What a step's ops read besides their device (and the step's devices).
struct StepInputs<'a> {
    cfg: &'a ModelConfig,
    segments: Vec<Segment>,
    batch: &'a Batch,
    loss_scale: f32,
    step: u32,
    adamw: AdamW,
    opts: &'a TrainOptions,
    comm: &'a dyn Comm,
    epoch: Instant,
    eval: bool,
}

/// This process's devices, on whichever backend: what the trainer asks of
/// them.
trait Devices: Send + Sync {
    /// Run every stream of every device (`plans[i]` is device `i`'s).
    fn run_step(&self, plans: &[&DevicePlan], inputs: StepInputs<'_>) -> Result<(), RuntimeError>;
    /// Each device's figures of the step just run: (stats, peak, states).
    fn stats(&self) -> Result<Vec<(DeviceStats, u64, u64)>, RuntimeError>;
    /// What each device holds of one kind of state, in device order.
    fn parts(&self, part: ShardPart) -> Result<Vec<Part>, RuntimeError>;
    fn restore(&self, ck: &HostStates) -> Result<(), RuntimeError>;
    /// The first device (in order) holding a NaN or infinite parameter,
    /// else gradient, and which tensor it is.
    fn non_finite(&self) -> Result<Option<(usize, String)>, RuntimeError>;
    fn events(&self) -> Vec<Vec<trace::TraceEvent>>;
}

impl<B: Backend> Devices for Vec<Device<B>> {
    fn run_step(&self, plans: &[&DevicePlan], i: StepInputs<'_>) -> Result<(), RuntimeError> {
        let ctx = ops::StepCtx {
            cfg: i.cfg,
            segments: i.segments,
            batch: i.batch,
            loss_scale: i.loss_scale,
            step: i.step,
            adamw: i.adamw,
            opts: i.opts,
            comm: i.comm,
            devices: self,
            epoch: i.epoch,
            eval: i.eval,
            failures: std::sync::Mutex::new(Vec::new()),
            handed: Default::default(),
        };
        step::run_step(self, plans, &ctx)
    }
    fn stats(&self) -> Result<Vec<(DeviceStats, u64, u64)>, RuntimeError> {
        self.iter()
            .map(|d| Ok((d.stats()?, d.peak_bytes(), d.state_bytes())))
            .collect()
    }
    fn parts(&self, part: ShardPart) -> Result<Vec<Part>, RuntimeError> {
        self.iter()
            .map(|d| {
                let whole = match part {
                    ShardPart::Param => d.params()?,
                    ShardPart::Grad => d.captured()?,
                    ShardPart::M => d.first_moments()?,
                    ShardPart::V => d.second_moments()?,
                };
                let mut shards = d.shards(part)?;
                shards.extend(d.tp_shards(part)?);
                Ok((whole, shards))
            })
            .collect()
    }
    fn restore(&self, ck: &HostStates) -> Result<(), RuntimeError> {
        self.iter().try_for_each(|d| d.restore(ck))
    }
    fn non_finite(&self) -> Result<Option<(usize, String)>, RuntimeError> {
        for grads in [false, true] {
            for (i, d) in self.iter().enumerate() {
                if let Some(what) = d.non_finite(grads)? {
                    return Ok(Some((i, what)));
                }
            }
        }
        Ok(None)
    }
    fn events(&self) -> Vec<Vec<trace::TraceEvent>> {
        self.iter().map(|d| d.events()).collect()
    }
}

/// Sets up this process's devices on the backend [`backend::with_backend`] picks.
struct Setup<'a> {
    cfg: &'a ModelConfig,
    table: &'a Arc<ParamTable>,
    plan: &'a Plan,
    opts: &'a TrainOptions,
    local: &'a [usize],
}

impl WithBackend for Setup<'_> {
    type Output = Result<Box<dyn Devices>, RuntimeError>;
    fn run<B: Backend>(
        self,
        make: &(dyn Fn(usize) -> Result<B, BackendError> + Sync),
    ) -> Self::Output {
        let segments = self.cfg.segments();
        let devices = self
            .local
            .iter()
            .enumerate()
            .map(|(at, &i)| {
                let dp = &self.plan.devices[i];
                let b = make(at).map_err(|e| RuntimeError::Backend {
                    device: dp.device,
                    op: "setup".into(),
                    backend: "the device's",
                    cause: e.to_string(),
                })?;
                Device::new(self.cfg, self.table.clone(), &segments, dp, self.opts, b)
            })
            .collect::<Result<Vec<Device<B>>, RuntimeError>>()?;
        Ok(Box::new(devices))
    }
}

/// The rows of a global batch of `b` rows that the devices `devices` (indices
/// in `plan.devices`) train on: a data-parallel replica's own part.
pub fn rows_read(plan: &Plan, devices: &[usize], b: usize) -> Vec<bool> {
    let mut read = vec![false; b];
    let forwards = (devices.iter())
        .filter_map(|&i| plan.devices.get(i))
        .flat_map(|d| &d.streams)
        .flat_map(|s| &s.ops);
    for op in
        forwards.filter(|op| op.kind() == crate::compile::plan::OpKind::F && op.phase.is_none())
    {
        let rows = ops::compute::rows_of(op, b);
        read[rows.start.min(b)..rows.end.min(b)].fill(true);
    }
    read
}

/// Trains a model by running a compiled plan.
pub struct Trainer {
    cfg: ModelConfig,
    plan: Plan,
    opts: TrainOptions,
    /// The model's parameters by id.
    table: Arc<ParamTable>,
    /// The devices this process runs (all of them, or a rank's block).
    devices: Box<dyn Devices>,
    /// Their indices in `plan.devices`.
    local: Vec<usize>,
    #[cfg(feature = "mpi")]
    fabric: Option<std::sync::Arc<comm::mpi::MpiFabric>>,
    step: u32,
    epoch: Instant,
    /// The forward-only plan evaluation runs, derived at the first
    /// [`Trainer::eval`].
    eval_plan: Option<Plan>,
    /// Evaluation batches run so far (their exchanges' keys under MPI).
    evals: u32,
}

/// Exchanges of evaluation batches are keyed from here up, training steps
/// below (`--steps` is at most `i32::MAX`).
pub const EVAL_KEYS: u32 = 1 << 31;

impl Trainer {
    /// Set up every device of the plan: parameters (initialised from `seed`),
    /// gradients and optimizer state for the segments it runs.
    pub fn new(cfg: &ModelConfig, plan: Plan, opts: TrainOptions) -> Result<Self, RuntimeError> {
        let all: Vec<usize> = (0..plan.devices.len()).collect();
        Self::with_devices(cfg, plan, opts, all)
    }

    /// One rank of an MPI job: set up the rank's block of the plan's
    /// devices; traffic to the others goes through `fabric`.
    #[cfg(feature = "mpi")]
    pub fn on_ranks(
        cfg: &ModelConfig,
        plan: Plan,
        opts: TrainOptions,
        fabric: std::sync::Arc<comm::mpi::MpiFabric>,
    ) -> Result<Self, RuntimeError> {
        let local: Vec<usize> = plan
            .devices
            .iter()
            .enumerate()
            .filter(|(_, d)| fabric.ranks.is_local(d.device))
            .map(|(i, _)| i)
            .collect();
        let mut t = Self::with_devices(cfg, plan, opts, local)?;
        t.fabric = Some(fabric);
        Ok(t)
    }

    fn with_devices(
        cfg: &ModelConfig,
        plan: Plan,
        mut opts: TrainOptions,
        local: Vec<usize>,
    ) -> Result<Self, RuntimeError> {
        let threads = opts.threads.unwrap_or_else(|| default_threads(local.len()));
        if !(1..=MAX_THREADS).contains(&threads) {
            return Err(RuntimeError::Threads(format!(
                "{threads} per device: give between 1 and {MAX_THREADS}"
            )));
        }
        opts.threads = Some(threads);
        if plan.precision != cfg.precision {
            return Err(RuntimeError::Plan(format!(
                "it counts bytes in precision {} but the run is set to {}",
                plan.precision, cfg.precision
            )));
        }
        crate::compile::check_deadlock(&plan.devices)
            .map_err(|e| RuntimeError::Plan(e.to_string()))?;
        let table = Arc::new(ParamTable::new(cfg));
        let local_devices: Vec<u32> = local.iter().map(|&i| plan.devices[i].device).collect();
        let peaks: Vec<u64> = local.iter().map(|&i| plan.devices[i].peak_bytes).collect();
        let place = backend::Placement {
            devices: &local_devices,
            peaks: &peaks,
            threads,
        };
        let kind = opts.backend;
        let on_backend =
            |e: BackendError| RuntimeError::Setup(format!("{} backend: {e}", kind.name()));
        match opts.device_memory {
            None => {
                opts.device_memory =
                    backend::default_cap(kind, &place, local_ranks()).map_err(on_backend)?;
            }
            // A cap given: a plan predicted past it is refused before it
            // allocates (the steps' own accounting still holds it to the cap).
            Some(cap) => {
                let over = (local_devices.iter().zip(&peaks)).find(|(_, p)| **p > cap);
                if let Some((&device, &peak)) = over {
                    return Err(RuntimeError::PlanOverCap {
                        device,
                        peak: crate::compile::human_bytes(peak),
                        cap: crate::compile::human_bytes(cap),
                    });
                }
            }
        }
        let setup = Setup {
            cfg,
            table: &table,
            plan: &plan,
            opts: &opts,
            local: &local,
        };
        let devices = backend::with_backend(kind, &place, setup).map_err(on_backend)??;
        Ok(Trainer {
            cfg: cfg.clone(),
            plan,
            opts,
            table,
            devices,
            local,
            #[cfg(feature = "mpi")]
            fabric: None,
            step: 0,
            epoch: Instant::now(),
            eval_plan: None,
            evals: 0,
        })
    }

    #[cfg(feature = "mpi")]
    fn fabric(&self) -> Option<&std::sync::Arc<comm::mpi::MpiFabric>> {
        self.fabric.as_ref()
    }
    #[cfg(not(feature = "mpi"))]
    fn fabric(&self) -> Option<&()> {
        None
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// The options the trainer runs with.
    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }
    /// Kernel threads each of this process's devices runs on.
    pub fn threads(&self) -> usize {
        self.opts.threads.unwrap_or(1)
    }
    pub fn step_count(&self) -> u32 {
        self.step
    }

    /// The rows of the global batch this process's devices read: all of
    /// them in one process, a rank's data-parallel part under MPI.
    pub fn rows_read(&self) -> Vec<bool> {
        rows_read(&self.plan, &self.local, self.cfg.batch_size as usize)
    }

    /// The learning rate step `step` (1-based) updates at.
    pub fn lr(&self, step: u32) -> f32 {
        self.schedule().lr(step)
    }

    /// Run one step on `batch` (the global batch).
    pub fn step(&mut self, batch: &Batch) -> Result<StepStats, RuntimeError> {
        let t = Instant::now();
        self.step += 1;
        let scale = 1.0 / (batch.b * batch.t) as f32;
        let timeout = self
            .opts
            .comm_timeout
            .unwrap_or_else(|| derived_comm_timeout(&self.plan));
        let comm: Box<dyn Comm> = match self.fabric() {
            #[cfg(feature = "mpi")]
            Some(f) => Box::new(f.step(self.step)),
            _ => Box::new(comm::LocalComm::new(timeout)),
        };
        let lr = self.lr(self.step);
        let inputs = StepInputs {
            cfg: &self.cfg,
            segments: self.cfg.segments(),
            batch,
            loss_scale: scale,
            step: self.step,
            adamw: AdamW {
                lr,
                ..self.opts.adamw
            },
            opts: &self.opts,
            comm: comm.as_ref(),
            epoch: self.epoch,
            eval: false,
        };
        let plans: Vec<&DevicePlan> = self.local.iter().map(|&i| &self.plan.devices[i]).collect();
        let ran = self.devices.run_step(&plans, inputs);
        let sent = comm.sent_bytes();
        drop(comm);
        ran?;
        // Per plan device (zeros for another rank's, filled in by the
        // reduction), then summed in device order: the same additions
        // whichever process ran which device.
        let n = self.plan.devices.len();
        let (mut losses, mut grad_norm) = (vec![0.0f64; n], 0.0f64);
        let (mut peak_bytes, mut state_bytes) = (vec![0u64; n], vec![0u64; n]);
        let (mut routed, mut dropped) = (vec![0u64; n], vec![0u64; n]);
        let mut comm_bytes = vec![0u64; n];
        for (&d, &b) in &sent {
            if let Some(c) = comm_bytes.get_mut(d as usize) {
                *c = b;
            }
        }
        for ((s, peak, states), &i) in self.devices.stats()?.into_iter().zip(&self.local) {
            losses[i] = s.loss;
            // A NaN wins (`f64::max` would drop it).
            if s.grad_norm.is_nan() || s.grad_norm > grad_norm {
                grad_norm = s.grad_norm;
            }
            (routed[i], dropped[i]) = (s.moe_routed, s.moe_dropped);
            peak_bytes[i] = peak;
            state_bytes[i] = states;
        }
        #[cfg(feature = "mpi")]
        if let Some(f) = self.fabric() {
            f.finish(self.step);
            grad_norm = f.reduce_stats(
                &mut losses,
                grad_norm,
                [
                    &mut peak_bytes,
                    &mut state_bytes,
                    &mut routed,
                    &mut dropped,
                    &mut comm_bytes,
                ],
            );
        }
        let loss: f64 = losses.iter().fold(0.0, |a, x| a + x);
        if !loss.is_finite() || !grad_norm.is_finite() {
            return Err(self.non_finite(&losses, loss, grad_norm)?);
        }
        let stats = StepStats {
            step: self.step,
            loss: loss * scale as f64,
            grad_norm,
            lr,
            elapsed: t.elapsed(),
            peak_bytes,
            state_bytes,
            comm_bytes,
            moe_routed: routed.iter().sum(),
            moe_dropped: dropped.iter().sum(),
        };
        #[cfg(feature = "fingerprint")]
        fingerprint::record(self, batch, &stats);
        Ok(stats)
    }

    /// The loss of the current parameters on `batch` (a global batch, as
    /// for [`Trainer::step`]), by the forward-only plan of the training
    /// plan on the same devices: no gradient, optimizer state or step count
    /// changes. Collective in an MPI job (every rank evaluates the same
    /// batches in the same order).
    pub fn eval(&mut self, batch: &Batch) -> Result<f64, RuntimeError> {
        if self.eval_plan.is_none() {
            let plan = crate::compile::forward_only(&self.plan).map_err(|e| {
                RuntimeError::Plan(format!("the evaluation plan of {}: {e}", self.plan.hash))
            })?;
            self.eval_plan = Some(plan);
        }
        #[cfg(feature = "mpi")]
        let key = EVAL_KEYS | (self.evals % EVAL_KEYS);
        self.evals = self.evals.wrapping_add(1);
        let scale = 1.0 / (batch.b * batch.t) as f32;
        let timeout = self
            .opts
            .comm_timeout
            .unwrap_or_else(|| derived_comm_timeout(&self.plan));
        let comm: Box<dyn Comm> = match self.fabric() {
            #[cfg(feature = "mpi")]
            Some(f) => Box::new(f.step(key)),
            _ => Box::new(comm::LocalComm::new(timeout)),
        };
        let opts = TrainOptions {
            trace: false,
            capture_grads: false,
            ..self.opts.clone()
        };
        let inputs = StepInputs {
            cfg: &self.cfg,
            segments: self.cfg.segments(),
            batch,
            loss_scale: scale,
            step: self.step,
            adamw: self.opts.adamw,
            opts: &opts,
            comm: comm.as_ref(),
            epoch: self.epoch,
            eval: true,
        };
        let plan = self.eval_plan.as_ref().expect("derived above");
        let plans: Vec<&DevicePlan> = self.local.iter().map(|&i| &plan.devices[i]).collect();
        let ran = self.devices.run_step(&plans, inputs);
        drop(comm);
        ran?;
        let n = self.plan.devices.len();
        let mut losses = vec![0.0f64; n];
        for ((s, _, _), &i) in self.devices.stats()?.into_iter().zip(&self.local) {
            losses[i] = s.loss;
        }
        #[cfg(feature = "mpi")]
        if let Some(f) = self.fabric() {
            f.finish(key);
            let mut none: [Vec<u64>; 5] = std::array::from_fn(|_| vec![0u64; n]);
            let [a, b, c, d, e] = &mut none;
            f.reduce_stats(&mut losses, 0.0, [a, b, c, d, e]);
        }
        let loss = losses.iter().fold(0.0, |a, x| a + x);
        if !loss.is_finite() {
            return Err(RuntimeError::NonFinite {
                step: self.step,
                what: "evaluation loss",
                value: loss,
                at: match losses.iter().position(|l| !l.is_finite()) {
                    Some(i) => format!("the loss of device {}", self.plan.devices[i].device),
                    None => "on another rank's devices".into(),
                },
            });
        }
        Ok(loss * scale as f64)
    }

    /// The error of a step whose loss or gradient norm is not finite,
    /// naming where the first non-finite value is on this process's
    /// devices: a parameter or gradient, else the device whose loss is.
    fn non_finite(
        &self,
        losses: &[f64],
        loss: f64,
        grad_norm: f64,
    ) -> Result<RuntimeError, RuntimeError> {
        let (what, value) = match loss.is_finite() {
            false => ("loss", loss),
            true => ("gradient norm", grad_norm),
        };
        let device = |i: usize| self.plan.devices[i].device;
        let at = match self.devices.non_finite()? {
            Some((at, tensor)) => format!("{tensor} on device {}", device(self.local[at])),
            None => match losses.iter().position(|l| !l.is_finite()) {
                Some(i) => format!(
                    "the loss of device {} (every parameter and gradient is finite)",
                    device(i)
                ),
                None => "on another rank's devices".to_string(),
            },
        };
        Ok(RuntimeError::NonFinite {
            step: self.step,
            what,
            value,
            at,
        })
    }

    /// Host tensors by id as the edge names them.
    fn named(&self, t: ParamMap<Vec<f32>>) -> NamedTensors {
        t.into_iter()
            .map(|(id, v)| (self.table.name(id).to_string(), v))
            .collect()
    }

    /// Named host tensors by id (names the model does not have are not
    /// its: they are left out).
    fn by_id(&self, t: &NamedTensors) -> ParamMap<Vec<f32>> {
        t.iter()
            .filter_map(|(n, v)| Some((self.table.by_name(n)?, v.clone())))
            .collect()
    }

    /// Every parameter of the model, taken from the first device holding it
    /// (ZeRO-3 shards are put back together from their group). Of this
    /// process's devices: on one rank of an MPI job use [`Trainer::gather_params`].
    pub fn params(&self) -> Result<NamedTensors, RuntimeError> {
        Ok(self.named(merge(self.devices.parts(ShardPart::Param)?)))
    }

    /// The last step's full gradients (before clipping), when
    /// `capture_grads` is on; each taken from the first device holding it,
    /// ZeRO-2/3 gradients put back together from their reduced shards.
    pub fn last_grads(&self) -> Result<NamedTensors, RuntimeError> {
        Ok(self.named(merge(self.devices.parts(ShardPart::Grad)?)))
    }

    /// Everything needed to resume: parameters, AdamW moments, step.
    pub fn checkpoint(&self) -> Result<checkpoint::Checkpoint, RuntimeError> {
        let m = self.named(merge(self.devices.parts(ShardPart::M)?));
        let v = self.named(merge(self.devices.parts(ShardPart::V)?));
        Ok(self.checkpoint_of(self.params()?, m, v))
    }

    fn checkpoint_of(
        &self,
        params: NamedTensors,
        m: NamedTensors,
        v: NamedTensors,
    ) -> checkpoint::Checkpoint {
        checkpoint::Checkpoint {
            state: checkpoint::TrainState {
                step: self.step,
                seed: self.opts.seed,
                model: self.cfg.clone(),
                schedule: Some(self.schedule()),
                data: None,
            },
            params,
            m,
            v,
        }
    }

    /// What every process's devices hold of one kind of state, on the
    /// first rank (`None` on the others); this process's alone when it is
    /// the whole job. Every rank of a job calls it at the same point.
    fn gather_parts(&self, part: ShardPart) -> Result<Option<Vec<Part>>, RuntimeError> {
        let mine = self.devices.parts(part)?;
        #[cfg(feature = "mpi")]
        if let Some(f) = self.fabric() {
            let Some(all) = f.gather_to_root(&wire::encode(&mine)) else {
                return Ok(None);
            };
            let mut parts = Vec::new();
            for (rank, bytes) in all.iter().enumerate() {
                parts.extend(wire::decode(bytes, self.table.len()).map_err(|e| {
                    RuntimeError::Plan(format!("rank {rank} sent unreadable states: {e}"))
                })?);
            }
            return Ok(Some(parts));
        }
        Ok(Some(mine))
    }

    /// [`Trainer::params`] over every rank of the job: `Some` on the first
    /// rank, `None` on the others. Collective.
    pub fn gather_params(&self) -> Result<Option<NamedTensors>, RuntimeError> {
        Ok(self
            .gather_parts(ShardPart::Param)?
            .map(|p| self.named(merge(p))))
    }

    /// [`Trainer::last_grads`] over every rank of the job. Collective.
    pub fn gather_grads(&self) -> Result<Option<NamedTensors>, RuntimeError> {
        Ok(self
            .gather_parts(ShardPart::Grad)?
            .map(|p| self.named(merge(p))))
    }

    /// [`Trainer::checkpoint`] over every rank of the job: written once, by
    /// the first rank, whatever the number of ranks. Collective.
    pub fn gather_checkpoint(&self) -> Result<Option<checkpoint::Checkpoint>, RuntimeError> {
        let params = self.gather_params()?;
        let m = self.gather_parts(ShardPart::M)?;
        let v = self.gather_parts(ShardPart::V)?;
        Ok(match (params, m, v) {
            (Some(p), Some(m), Some(v)) => {
                Some(self.checkpoint_of(p, self.named(merge(m)), self.named(merge(v))))
            }
            _ => None,
        })
    }

    /// The schedule the run follows (a constant one when none was given).
    fn schedule(&self) -> Schedule {
        self.opts
            .schedule
            .unwrap_or_else(|| Schedule::constant(self.opts.adamw.lr))
    }

    /// Start from these weights instead of the seed's (`--init-from`: a
    /// Hugging Face directory), with fresh optimizer moments at step 0.
    pub fn init_from(&mut self, params: &NamedTensors) -> Result<(), RuntimeError> {
        let zeros: NamedTensors = params
            .iter()
            .map(|(k, v)| (k.clone(), vec![0.0; v.len()]))
            .collect();
        let states = HostStates {
            params: self.by_id(params),
            m: self.by_id(&zeros),
            v: self.by_id(&zeros),
        };
        self.devices.restore(&states)?;
        self.step = 0;
        Ok(())
    }

    /// Continue from a checkpoint (any strategy: every device takes the
    /// tensors of the segments it runs).
    /// A checkpoint holds fp32 weights and moments whatever the precision
    /// it was trained in, so a run may resume it in another policy.
    pub fn restore(&mut self, ck: &checkpoint::Checkpoint) -> Result<(), RuntimeError> {
        let same_model = crate::model::ModelConfig {
            precision: self.cfg.precision,
            ..ck.state.model.clone()
        } == self.cfg;
        if !same_model {
            return Err(RuntimeError::Plan(format!(
                "the checkpoint is of model `{}` ({} layers, d_model {}), this run trains `{}` ({} layers, d_model {})",
                ck.state.model.name, ck.state.model.layers, ck.state.model.d_model, self.cfg.name, self.cfg.layers, self.cfg.d_model
            )));
        }
        let states = HostStates {
            params: self.by_id(&ck.params),
            m: self.by_id(&ck.m),
            v: self.by_id(&ck.v),
        };
        if let Some(saved) = &ck.state.schedule {
            self.schedule().continues(saved).map_err(|e| {
                RuntimeError::Plan(format!(
                    "the checkpoint at step {} was trained on another learning-rate schedule; resume with its settings: {e}",
                    ck.state.step
                ))
            })?;
        }
        self.devices.restore(&states)?;
        self.step = ck.state.step;
        Ok(())
    }

    /// [`Trainer::trace_json`] over every rank of the job, one file's
    /// worth on the first rank (`None` on the others). Collective.
    pub fn gather_trace(&self) -> Result<Option<serde_json::Value>, RuntimeError> {
        let mine = self.trace_json();
        #[cfg(feature = "mpi")]
        if let Some(f) = self.fabric() {
            let Some(all) = f.gather_to_root(mine.to_string().as_bytes()) else {
                return Ok(None);
            };
            let mut events = Vec::new();
            for (rank, bytes) in all.iter().enumerate() {
                let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
                    RuntimeError::Plan(format!("rank {rank} sent an unreadable trace: {e}"))
                })?;
                if let Some(e) = v["traceEvents"].as_array() {
                    events.extend(e.iter().cloned());
                }
            }
            return Ok(Some(
                serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" }),
            ));
        }
        Ok(Some(mine))
    }

    /// Chrome-trace JSON (Perfetto) of what each of this process's devices'
    /// streams did (a process per device, named with its rank in an MPI job).
    pub fn trace_json(&self) -> serde_json::Value {
        #[cfg(feature = "mpi")]
        let rank = self.fabric().map(|f| f.ranks.rank);
        #[cfg(not(feature = "mpi"))]
        let rank: Option<u32> = None;
        // The clock the times are on: one per process.
        let clock = rank.map_or(0, |r| r);
        let mut events = Vec::new();
        for (&i, device_events) in self.local.iter().zip(self.devices.events()) {
            let dp = &self.plan.devices[i];
            let name = match rank {
                Some(r) => format!("device {} (rank {r})", dp.device),
                None => format!("device {}", dp.device),
            };
            events.push(serde_json::json!({"name": "process_name", "ph": "M", "pid": dp.device, "args": {"name": name}}));
            for (si, s) in dp.streams.iter().enumerate() {
                events.push(serde_json::json!({"name": "thread_name", "ph": "M", "pid": dp.device, "tid": si, "args": {"name": s.stream}}));
            }
            for e in device_events {
                events.push(serde_json::json!({
                    "name": e.name, "cat": e.cat, "ph": "X", "pid": dp.device, "tid": e.stream,
                    "ts": e.start_us, "dur": e.dur_us, "args": {"step": e.step, "op": e.op, "clock": clock},
                }));
            }
        }
        serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
    }
}
