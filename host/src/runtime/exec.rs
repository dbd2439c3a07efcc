//! Execution of one step: a thread per (device, stream), ops in plan order,
//! cross-stream waits, reference-counted buffers with memory accounting, and
//! the op implementations (compute through the CPU backend, communication
//! through [`Comm`]).

use super::backend::cpu::adamw::adamw_update;
use super::backend::cpu::gpt::{
    decays, init_param, segment_backward_input, segment_backward_weight, segment_forward,
    segment_params, Dims, SegmentCache, SegmentStash, Tensors,
};
use super::comm::{Comm, CommError};
use super::data::Batch;
use super::TrainOptions;
use crate::compile::{human_bytes, DevicePlan, Op, OpKind, Plan};
use crate::dag::TensorKind;
use crate::model::{ModelConfig, Segment};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

/// Why a step could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RuntimeError {
    #[error("the plan cannot run: {0}")]
    Plan(String),
    #[error("device {device}: {op}: out of memory: it needs {need} more with {live} in use, over its cap of {cap} (model states take {states})")]
    OutOfMemory {
        device: u32,
        op: String,
        need: String,
        live: String,
        cap: String,
        states: String,
    },
    /// The comm error is part of the message (not a `source`), so a
    /// `{:#}` chain prints it once.
    #[error("device {device}: {op}: {cause}")]
    Comm {
        device: u32,
        op: String,
        cause: CommError,
    },
    #[error("device {device}: {op}: input {input} is missing (the plan does not produce it on this device)")]
    MissingInput {
        device: u32,
        op: String,
        input: String,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("device {device}, stream `{stream}`: {op}: panicked: {message}")]
    Panic {
        device: u32,
        stream: String,
        op: String,
        message: String,
    },
}

enum Buf {
    Vec(Arc<Vec<f32>>),
    Saved(SegmentCache),
    Stash(SegmentStash),
    /// ZeRO-3: a segment's gathered parameters; ZeRO-2/3: one microbatch's
    /// weight gradients.
    Params(Tensors),
    /// ZeRO-2/3: one microbatch's tied `wte` gradient, already all-reduced
    /// across the embedding's and the head's stages; it replaces the local
    /// `wte` gradients of that microbatch.
    Tied(Tensors),
}

impl Buf {
    fn bytes(&self) -> u64 {
        match self {
            Buf::Vec(v) => v.len() as u64 * 4,
            Buf::Params(t) | Buf::Tied(t) => t.values().map(|v| v.len() as u64 * 4).sum(),
            Buf::Saved(c) => c.bytes(),
            Buf::Stash(s) => s.bytes(),
        }
    }
}

#[derive(Default)]
struct Buffers {
    map: HashMap<(u32, TensorKind), (Arc<Buf>, u32)>,
    readers: HashMap<(u32, TensorKind), u32>,
    live: u64,
    peak: u64,
}

#[derive(Default)]
struct StepState {
    loss: f64,
    grad_norm: f64,
    clip_scale: f32,
}

/// One op as it ran, for the trace.
#[derive(Clone, Debug)]
pub(crate) struct TraceEvent {
    pub name: String,
    pub cat: &'static str,
    pub stream: usize,
    pub start_us: f64,
    pub dur_us: f64,
    pub step: u32,
}

/// One virtual device: its model states and buffers.
pub(crate) struct Device {
    id: u32,
    params: RwLock<Tensors>,
    grads: Mutex<Tensors>,
    moments: Mutex<(Tensors, Tensors)>,
    /// ZeRO buckets (sharded states).
    buckets: Mutex<Vec<Bucket>>,
    /// Segments this device runs.
    held: BTreeSet<u32>,
    /// Does it run the embedding (which owns the tied `wte`)?
    has_embedding: bool,
    bufs: Mutex<Buffers>,
    state: Mutex<StepState>,
    /// Gradients this device counts in the global norm.
    norm_names: Vec<String>,
    /// Parameters that get weight decay (matrices and embeddings).
    decay: BTreeSet<String>,
    has_norm_op: bool,
    state_bytes: u64,
    cap: Option<u64>,
    progress: Mutex<Vec<usize>>,
    cv: Condvar,
    captured: Mutex<Tensors>,
    /// ZeRO-2/3: the last step's reduced gradient shard per bucket index.
    captured_shards: Mutex<HashMap<usize, Vec<f32>>>,
    events: Mutex<Vec<TraceEvent>>,
}

fn label(op: &Op) -> String {
    format!("{}#{}", op.label(), op.node)
}

/// A ZeRO gradient bucket on this device: its parameters laid out flat (names
/// sorted), of which this device owns the slice `shard`.
pub(crate) struct Bucket {
    segments: Vec<u32>,
    names: Vec<(String, usize)>,
    total: usize,
    shard: std::ops::Range<usize>,
    zero: u8,
    /// AdamW moments of the shard.
    m: Vec<f32>,
    v: Vec<f32>,
    /// ZeRO-2/3: the reduced gradient of the shard, accumulated over microbatches.
    grad: Vec<f32>,
    /// ZeRO-3: the parameter shard.
    param: Vec<f32>,
}

impl Bucket {
    /// `(name, offset in the flat layout)`.
    fn offsets(&self) -> impl Iterator<Item = (&str, usize, usize)> {
        let mut at = 0;
        self.names.iter().map(move |(n, len)| {
            let o = at;
            at += len;
            (n.as_str(), o, *len)
        })
    }
    /// Scatter `shard_data` (this device's slice) into a full-length padded vector.
    fn padded(&self, shard_data: &[f32]) -> Vec<f32> {
        let mut v = vec![0.0; self.total];
        v[self.shard.clone()].copy_from_slice(&shard_data[..self.shard.len()]);
        v
    }
}

/// Bytes reserved on a device until dropped.
pub(crate) struct Reserved<'a> {
    dev: &'a Device,
    bytes: u64,
}

impl Reserved<'_> {
    /// Keep the bytes reserved past this guard (a message in flight, which
    /// its receiver releases).
    fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.dev.release(self.bytes);
    }
}

/// What [`Device::shards`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShardPart {
    Param,
    M,
    V,
    Grad,
}

/// A device's slice of a ZeRO bucket's flat layout.
pub(crate) struct Shard {
    /// Tensor names and lengths in the flat layout.
    pub names: Vec<(String, usize)>,
    pub total: usize,
    /// This device's range of the layout.
    pub range: std::ops::Range<usize>,
    pub values: Vec<f32>,
}

/// Put full tensors back together from the shards of every device (the
/// first device holding a range wins; the union of a group's ranges is the
/// whole layout).
pub(crate) fn assemble(shards: impl IntoIterator<Item = Shard>, out: &mut Tensors) {
    let mut flat: HashMap<Vec<(String, usize)>, Vec<f32>> = HashMap::new();
    for s in shards {
        let full = flat.entry(s.names).or_insert_with(|| vec![0.0; s.total]);
        full[s.range.clone()].copy_from_slice(&s.values[..s.range.len()]);
    }
    for (names, full) in flat {
        let mut at = 0;
        for (n, len) in names {
            out.entry(n).or_insert_with(|| full[at..at + len].to_vec());
            at += len;
        }
    }
}

/// Names of the parameters a segment owns on a device holding `held`: the
/// tied `wte` belongs to the embedding when both ends are here.
fn owned_names(
    cfg: &ModelConfig,
    segments: &[Segment],
    held: &BTreeSet<u32>,
    s: u32,
) -> Vec<String> {
    let seg = &segments[s as usize];
    let emb_here = held.iter().any(|h| segments[*h as usize].has_embedding());
    segment_params(cfg, seg)
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| !(n == "wte" && !seg.has_embedding() && emb_here))
        .collect()
}

impl Device {
    pub(crate) fn new(
        cfg: &ModelConfig,
        segments: &[Segment],
        plan: &DevicePlan,
        opts: &TrainOptions,
    ) -> Result<Self, RuntimeError> {
        let ops = || plan.streams.iter().flat_map(|s| s.ops.iter());
        let mut held: BTreeSet<u32> = BTreeSet::new();
        let mut replica: HashMap<u32, u32> = HashMap::new();
        for op in ops().filter(|o| o.op.is_compute()) {
            for s in op.segments.iter() {
                held.insert(*s);
                replica.insert(*s, op.replica);
            }
        }
        if let Some(op) = ops().find(|o| o.op == OpKind::AllToAll) {
            return Err(RuntimeError::Unsupported(format!(
                "device {}: {}: all-to-all (expert parallelism) is not yet supported by the CPU runtime",
                plan.device,
                label(op)
            )));
        }
        let has_embedding = held.iter().any(|s| segments[*s as usize].has_embedding());
        let mut params = Tensors::new();
        let mut norm_names = Vec::new();
        let mut decay = BTreeSet::new();
        for &s in &held {
            for (name, shape) in segment_params(cfg, &segments[s as usize]) {
                if decays(&shape) {
                    decay.insert(name.clone());
                }
                if !params.contains_key(&name) {
                    params.insert(name.clone(), init_param(cfg, opts.seed, &name, &shape));
                }
                let counts = replica.get(&s) == Some(&0) && (name != "wte" || has_embedding);
                if counts && !norm_names.contains(&name) {
                    norm_names.push(name);
                }
            }
        }
        // Parameter copies (DualPipe): the first device of each copy group
        // counts the reduced gradient in the norm, the others do not.
        for op in ops().filter(|o| o.purpose.as_deref() == Some("copy-grad")) {
            let group = op.group.as_deref().unwrap_or(&[]);
            if group.first() != Some(&plan.device) {
                for s in op.segments.iter() {
                    for n in owned_names(cfg, segments, &held, *s) {
                        norm_names.retain(|x| *x != n);
                    }
                }
            }
        }
        let zeros = |p: &Tensors| -> Tensors {
            p.iter()
                .map(|(k, v)| (k.clone(), vec![0.0; v.len()]))
                .collect()
        };
        let mut grads = zeros(&params);
        let (mut m, mut v) = (zeros(&params), zeros(&params));
        // ZeRO buckets, from this device's gradient reductions.
        let mut buckets: Vec<Bucket> = Vec::new();
        for op in ops().filter(|o| o.purpose.as_deref() == Some("grad-sync") && o.zero >= 1) {
            let segs: Vec<u32> = op.segments.to_vec();
            if buckets.iter().any(|b| b.segments == segs) {
                continue;
            }
            let group = op.group.as_deref().unwrap_or(&[]);
            let n = group.len().max(1);
            let rank = group.iter().position(|d| *d == plan.device).unwrap_or(0);
            let mut names: Vec<String> = segs
                .iter()
                .flat_map(|s| owned_names(cfg, segments, &held, *s))
                .collect();
            names.sort();
            names.dedup();
            let names: Vec<(String, usize)> = names
                .into_iter()
                .map(|n| {
                    let l = params[&n].len();
                    (n, l)
                })
                .collect();
            let total: usize = names.iter().map(|(_, l)| l).sum();
            let per = total.div_ceil(n);
            let shard = (rank * per).min(total)..((rank + 1) * per).min(total);
            let mut b = Bucket {
                segments: segs,
                total,
                zero: op.zero,
                m: vec![0.0; shard.len()],
                v: vec![0.0; shard.len()],
                grad: if op.zero >= 2 {
                    vec![0.0; shard.len()]
                } else {
                    Vec::new()
                },
                param: Vec::new(),
                shard,
                names,
            };
            // Sharded states replace the full ones.
            for (name, _) in &b.names {
                m.remove(name);
                v.remove(name);
                norm_names.retain(|x| x != name);
                if b.zero >= 2 {
                    grads.remove(name);
                }
            }
            if b.zero >= 3 {
                let mut flat = Vec::with_capacity(b.total);
                for (name, _) in &b.names {
                    flat.extend_from_slice(&params.remove(name).expect("held"));
                }
                b.param = flat[b.shard.clone()].to_vec();
            }
            buckets.push(b);
        }
        let elems = |t: &Tensors| t.values().map(|v| v.len() as u64).sum::<u64>();
        let shard_elems: u64 = buckets
            .iter()
            .map(|b| (b.m.len() + b.v.len() + b.grad.len() + b.param.len()) as u64)
            .sum();
        let state_bytes =
            4 * (elems(&params) + elems(&grads) + elems(&m) + elems(&v) + shard_elems);
        if let Some(cap) = opts.device_memory {
            if state_bytes > cap {
                return Err(RuntimeError::OutOfMemory {
                    device: plan.device,
                    op: "setup".into(),
                    need: human_bytes(state_bytes),
                    live: human_bytes(0),
                    cap: human_bytes(cap),
                    states: human_bytes(state_bytes),
                });
            }
        }
        let has_norm_op = ops().any(|o| o.purpose.as_deref() == Some("grad-norm"));
        Ok(Device {
            id: plan.device,
            grads: Mutex::new(grads),
            moments: Mutex::new((m, v)),
            params: RwLock::new(params),
            buckets: Mutex::new(buckets),
            held,
            has_embedding,
            bufs: Mutex::new(Buffers::default()),
            state: Mutex::new(StepState::default()),
            norm_names,
            decay,
            has_norm_op,
            state_bytes,
            cap: opts.device_memory,
            progress: Mutex::new(vec![0; plan.streams.len()]),
            cv: Condvar::new(),
            captured: Mutex::new(Tensors::new()),
            captured_shards: Mutex::new(HashMap::new()),
            events: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn stats(&self) -> (f64, f64) {
        let s = self.state.lock().unwrap();
        (s.loss, s.grad_norm)
    }
    pub(crate) fn peak_bytes(&self) -> u64 {
        self.state_bytes + self.bufs.lock().unwrap().peak
    }
    /// One part of this device's ZeRO bucket shards: parameters (ZeRO-3),
    /// AdamW moments (ZeRO-1/2/3) or the last step's reduced gradients
    /// (ZeRO-2/3, when captured).
    pub(crate) fn shards(&self, part: ShardPart) -> Vec<Shard> {
        let buckets = self.buckets.lock().unwrap();
        let captured = self.captured_shards.lock().unwrap();
        buckets
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                let values = match part {
                    ShardPart::Param if b.zero >= 3 => b.param.clone(),
                    ShardPart::M => b.m.clone(),
                    ShardPart::V => b.v.clone(),
                    ShardPart::Grad => captured.get(&i)?.clone(),
                    _ => return None,
                };
                Some(Shard {
                    names: b.names.clone(),
                    total: b.total,
                    range: b.shard.clone(),
                    values,
                })
            })
            .collect()
    }
    pub(crate) fn state_bytes(&self) -> u64 {
        self.state_bytes
    }
    pub(crate) fn params(&self) -> Tensors {
        self.params.read().unwrap().clone()
    }
    pub(crate) fn captured(&self) -> Tensors {
        self.captured.lock().unwrap().clone()
    }
    pub(crate) fn events(&self) -> Vec<TraceEvent> {
        self.events.lock().unwrap().clone()
    }
    pub(crate) fn moments(&self) -> (Tensors, Tensors) {
        self.moments.lock().unwrap().clone()
    }
    /// Take the tensors of this device's parameters from a checkpoint:
    /// whole tensors, and this device's slice of each ZeRO bucket
    /// (parameters for ZeRO-3, AdamW moments for every stage).
    pub(crate) fn restore(&self, ck: &super::checkpoint::Checkpoint) -> Result<(), RuntimeError> {
        {
            let mut buckets = self.buckets.lock().unwrap();
            for b in buckets.iter_mut() {
                let flat = |t: &Tensors, what: &str| -> Result<Vec<f32>, RuntimeError> {
                    let mut v = Vec::with_capacity(b.total);
                    for (n, len) in &b.names {
                        let x = t.get(n).filter(|x| x.len() == *len).ok_or_else(|| {
                            RuntimeError::Plan(format!(
                                "the checkpoint has no {what} `{n}` of {len} values for device {}",
                                self.id
                            ))
                        })?;
                        v.extend_from_slice(x);
                    }
                    Ok(v[b.shard.clone()].to_vec())
                };
                b.m = flat(&ck.m, "first moment")?;
                b.v = flat(&ck.v, "second moment")?;
                if b.zero >= 3 {
                    b.param = flat(&ck.params, "parameter")?;
                }
            }
        }
        let mut params = self.params.write().unwrap();
        let mut mom = self.moments.lock().unwrap();
        for (name, p) in params.iter_mut() {
            if let Some(x) = ck.params.get(name) {
                p.copy_from_slice(x);
            }
            // Sharded parameters keep their moments in their bucket.
            if let Some(x) = ck.m.get(name) {
                if let Some(mm) = mom.0.get_mut(name) {
                    mm.copy_from_slice(x);
                }
            }
            if let Some(x) = ck.v.get(name) {
                if let Some(vv) = mom.1.get_mut(name) {
                    vv.copy_from_slice(x);
                }
            }
        }
        Ok(())
    }

    fn reset(&self, plan: &DevicePlan) {
        let mut b = self.bufs.lock().unwrap();
        b.map.clear();
        b.readers.clear();
        b.live = 0;
        b.peak = 0;
        for op in plan.streams.iter().flat_map(|s| s.ops.iter()) {
            for i in op.inputs.iter() {
                *b.readers.entry((i.node, i.tensor)).or_insert(0) += 1;
            }
        }
        *self.state.lock().unwrap() = StepState {
            clip_scale: 1.0,
            ..Default::default()
        };
        let mut p = self.progress.lock().unwrap();
        p.iter_mut().for_each(|x| *x = 0);
    }

    /// Account `bytes` of communication staging or an in-flight message
    /// against this device's cap before they are allocated; released when
    /// the guard drops (or by the receiver, for a message: [`Device::release`]).
    fn reserve(&self, op: &Op, bytes: u64) -> Result<Reserved<'_>, RuntimeError> {
        self.admit(&mut self.bufs.lock().unwrap(), op, bytes)?;
        Ok(Reserved { dev: self, bytes })
    }

    /// The one accounting path: add `bytes` to the live total, or refuse them
    /// over the cap with the device, op and sizes named.
    fn admit(&self, b: &mut Buffers, op: &Op, bytes: u64) -> Result<(), RuntimeError> {
        if let Some(cap) = self.cap {
            if self.state_bytes + b.live + bytes > cap {
                return Err(RuntimeError::OutOfMemory {
                    device: self.id,
                    op: label(op),
                    need: human_bytes(bytes),
                    live: human_bytes(b.live),
                    cap: human_bytes(cap),
                    states: human_bytes(self.state_bytes),
                });
            }
        }
        b.live += bytes;
        b.peak = b.peak.max(b.live);
        Ok(())
    }

    /// Give back bytes reserved for a message once its receiver holds it.
    fn release(&self, bytes: u64) {
        let mut b = self.bufs.lock().unwrap();
        b.live = b.live.saturating_sub(bytes);
    }

    /// Store an op's output if anyone on this device reads it.
    fn put(&self, op: &Op, kind: TensorKind, buf: Buf) -> Result<(), RuntimeError> {
        let mut b = self.bufs.lock().unwrap();
        let Some(&readers) = b.readers.get(&(op.node, kind)) else {
            return Ok(());
        };
        self.admit(&mut b, op, buf.bytes())?;
        b.map.insert((op.node, kind), (Arc::new(buf), readers));
        Ok(())
    }

    /// Read every input of `op` of one kind, in input order; each buffer is
    /// freed after its last reader.
    fn take_all(&self, op: &Op, kind: TensorKind) -> Result<Vec<Arc<Buf>>, RuntimeError> {
        let mut b = self.bufs.lock().unwrap();
        let mut out = Vec::new();
        for input in op.inputs.iter().filter(|i| i.tensor == kind) {
            let key = (input.node, kind);
            let Some(entry) = b.map.get_mut(&key) else {
                return Err(RuntimeError::MissingInput {
                    device: self.id,
                    op: label(op),
                    input: format!("{kind:?} of #{}", input.node),
                });
            };
            entry.1 -= 1;
            let buf = entry.0.clone();
            if entry.1 == 0 {
                let bytes = buf.bytes();
                b.map.remove(&key);
                b.live -= bytes;
            }
            out.push(buf);
        }
        Ok(out)
    }

    /// Read the (first) input of `op` of one kind, if it has one.
    fn take(&self, op: &Op, kind: TensorKind) -> Result<Option<Arc<Buf>>, RuntimeError> {
        Ok(self.take_all(op, kind)?.into_iter().next())
    }
}

/// Everything an op needs besides its device.
pub(crate) struct StepCtx<'a> {
    pub cfg: &'a ModelConfig,
    pub segments: Vec<Segment>,
    pub batch: &'a Batch,
    pub loss_scale: f32,
    pub step: u32,
    pub opts: &'a TrainOptions,
    pub comm: &'a Comm,
    /// Every device of this process (a receiver releases its sender's
    /// in-flight bytes).
    pub devices: &'a [Device],
    pub epoch: std::time::Instant,
    /// Failures in the order they happened: the first is the cause, later
    /// ones (aborted waits, locks a panic left poisoned) are consequences.
    pub failures: Mutex<Vec<RuntimeError>>,
}

/// Run every stream of every device; the first real error wins.
pub(crate) fn run_step(devices: &[Device], plan: &Plan, ctx: &StepCtx) -> Result<(), RuntimeError> {
    for (d, dp) in devices.iter().zip(&plan.devices) {
        d.reset(dp);
    }
    std::thread::scope(|s| {
        for (dev, dp) in devices.iter().zip(&plan.devices) {
            for si in 0..dp.streams.len() {
                s.spawn(move || {
                    // A panic in a kernel (or anywhere in the op) is caught
                    // here: the step aborts on every device and the error
                    // names where it happened.
                    let current = std::cell::Cell::new(None::<usize>);
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run_stream(dev, dp, si, ctx, &current)
                    }));
                    let err = match r {
                        Ok(Ok(())) => return,
                        Ok(Err(e)) => e,
                        Err(payload) => RuntimeError::Panic {
                            device: dev.id,
                            stream: dp.streams[si].stream.to_string(),
                            op: current
                                .get()
                                .map(|i| label(&dp.streams[si].ops[i]))
                                .unwrap_or_else(|| "waiting".into()),
                            message: panic_text(payload.as_ref()),
                        },
                    };
                    ctx.comm.abort();
                    dev.cv.notify_all();
                    ctx.failures
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(err);
                });
            }
        }
    });
    let failures = std::mem::take(&mut *ctx.failures.lock().unwrap_or_else(|p| p.into_inner()));
    let aborted = |e: &RuntimeError| {
        matches!(
            e,
            RuntimeError::Comm {
                cause: CommError::Aborted,
                ..
            }
        )
    };
    let first = failures
        .iter()
        .position(|e| !aborted(e))
        .or(if failures.is_empty() { None } else { Some(0) });
    match first {
        Some(i) => Err(failures.into_iter().nth(i).expect("index in range")),
        None => Ok(()),
    }
}

/// The message of a panic payload.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a non-text panic payload)".into())
}

fn run_stream(
    dev: &Device,
    dp: &DevicePlan,
    si: usize,
    ctx: &StepCtx,
    current: &std::cell::Cell<Option<usize>>,
) -> Result<(), RuntimeError> {
    let stream = &dp.streams[si];
    for (i, op) in stream.ops.iter().enumerate() {
        // Cross-stream events.
        for w in &op.waits {
            let ws = dp
                .streams
                .iter()
                .position(|s| *s.stream == *w.stream)
                .expect("waits name streams of the device");
            let mut p = dev.progress.lock().unwrap();
            while p[ws] <= w.op {
                if ctx.comm.aborted() {
                    return Err(RuntimeError::Comm {
                        device: dev.id,
                        op: label(op),
                        cause: CommError::Aborted,
                    });
                }
                p = dev
                    .cv
                    .wait_timeout(p, Duration::from_millis(100))
                    .unwrap()
                    .0;
            }
        }
        let t0 = ctx.epoch.elapsed();
        current.set(Some(i));
        if let Some((d, what)) = &ctx.opts.inject_panic {
            if *d == dev.id && op.label().starts_with(what.as_str()) {
                panic!("injected kernel panic (TrainOptions::inject_panic)");
            }
        }
        if let Err(e) = exec_op(dev, op, ctx) {
            ctx.comm.abort();
            // Wake this device's other streams so they notice.
            dev.cv.notify_all();
            return Err(e);
        }
        if ctx.opts.trace {
            let t1 = ctx.epoch.elapsed();
            dev.events.lock().unwrap().push(TraceEvent {
                name: op.label(),
                cat: if op.op.is_compute() || op.op == OpKind::Update {
                    "compute"
                } else {
                    "comm"
                },
                stream: si,
                start_us: t0.as_secs_f64() * 1e6,
                dur_us: (t1 - t0).as_secs_f64() * 1e6,
                step: ctx.step,
            });
        }
        let mut p = dev.progress.lock().unwrap();
        p[si] = i + 1;
        dev.cv.notify_all();
    }
    Ok(())
}

fn vec_of(buf: Option<Arc<Buf>>) -> Option<Vec<f32>> {
    buf.map(|b| match &*b {
        Buf::Vec(v) => (**v).clone(),
        _ => panic!("expected a tensor buffer"),
    })
}

fn missing(dev: &Device, op: &Op, what: &str) -> RuntimeError {
    RuntimeError::MissingInput {
        device: dev.id,
        op: label(op),
        input: what.into(),
    }
}

/// Accumulate a backward's weight gradients: into the device's gradient
/// buffers, or (ZeRO-2/3) into a per-microbatch buffer its reduce-scatter reads.
fn weight_grads(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    seg: &Segment,
    cache: &SegmentCache,
    stash: &SegmentStash,
) -> Result<(), RuntimeError> {
    if op.zero >= 2 {
        let mut t: Tensors = segment_params(ctx.cfg, seg)
            .into_iter()
            .map(|(n, shape)| (n, vec![0.0; shape.iter().product()]))
            .collect();
        segment_backward_weight(&mut t, cache, stash);
        dev.put(op, TensorKind::MicroGrad, Buf::Params(t))
    } else {
        segment_backward_weight(&mut dev.grads.lock().unwrap(), cache, stash);
        Ok(())
    }
}

/// Sorted, deduplicated names the given segments own on this device.
fn owned(dev: &Device, ctx: &StepCtx, segs: &[u32]) -> Vec<String> {
    let mut n: Vec<String> = segs
        .iter()
        .flat_map(|s| owned_names(ctx.cfg, &ctx.segments, &dev.held, *s))
        .collect();
    n.sort();
    n.dedup();
    n
}

fn exec_op(dev: &Device, op: &Op, ctx: &StepCtx) -> Result<(), RuntimeError> {
    let comm_err = |cause| RuntimeError::Comm {
        device: dev.id,
        op: label(op),
        cause,
    };
    let group: Vec<u32> = op
        .group
        .as_deref()
        .map(|g| g.to_vec())
        .unwrap_or_else(|| vec![dev.id]);
    match op.op {
        OpKind::F | OpKind::B | OpKind::BI | OpKind::BW => {
            let seg = &ctx.segments[op.segments[0] as usize];
            // ZeRO-3 computes with gathered parameters; otherwise the device's own.
            let gathered = dev.take(op, TensorKind::Param)?;
            let own = dev.params.read().unwrap();
            let params: &Tensors = match gathered.as_deref() {
                Some(Buf::Params(t)) => t,
                _ => &own,
            };
            match op.op {
                OpKind::F => {
                    let div = op.batch_div as usize;
                    let b = ctx.batch.b / div;
                    let dp = div / op.microbatches.max(1) as usize;
                    let piece = op.microbatch as usize * dp + op.replica as usize;
                    let (tokens, targets) = ctx.batch.rows(piece * b, b);
                    let input = vec_of(dev.take(op, TensorKind::Activation)?);
                    let (out, cache, loss) = segment_forward(
                        seg,
                        params,
                        seg.has_embedding().then_some(tokens),
                        input,
                        seg.has_head().then_some(targets),
                        Dims::new(ctx.cfg, b),
                    );
                    drop(own);
                    if let Some(l) = loss {
                        dev.state.lock().unwrap().loss += l;
                    }
                    if let Some(out) = out {
                        dev.put(op, TensorKind::Activation, Buf::Vec(Arc::new(out)))?;
                    }
                    dev.put(op, TensorKind::Saved, Buf::Saved(cache))?;
                }
                OpKind::B | OpKind::BI => {
                    let saved = dev
                        .take(op, TensorKind::Saved)?
                        .ok_or_else(|| missing(dev, op, "the forward's saved tensors"))?;
                    let Buf::Saved(cache) = &*saved else {
                        unreachable!()
                    };
                    let dout = vec_of(dev.take(op, TensorKind::ActGrad)?);
                    let (dinp, mut stash) =
                        segment_backward_input(params, cache, dout, ctx.loss_scale);
                    drop(own);
                    if op.op == OpKind::B {
                        weight_grads(dev, op, ctx, seg, cache, &stash)?;
                    } else {
                        // BI is the saved tensors' last reader: hand what BW
                        // needs on in the stash, free the rest now.
                        let cache = match Arc::try_unwrap(saved) {
                            Ok(Buf::Saved(c)) => c,
                            Ok(_) => unreachable!(),
                            Err(shared) => match &*shared {
                                Buf::Saved(c) => c.clone(),
                                _ => unreachable!(),
                            },
                        };
                        stash.keep_for_weights(cache);
                        dev.put(op, TensorKind::Stash, Buf::Stash(stash))?;
                    }
                    if let Some(d) = dinp {
                        dev.put(op, TensorKind::ActGrad, Buf::Vec(Arc::new(d)))?;
                    }
                }
                _ => {
                    drop(own);
                    let stash = dev
                        .take(op, TensorKind::Stash)?
                        .ok_or_else(|| missing(dev, op, "BI's stash"))?;
                    let Buf::Stash(stash) = &*stash else {
                        unreachable!()
                    };
                    let cache = stash
                        .kept
                        .as_ref()
                        .ok_or_else(|| missing(dev, op, "the forward tensors in BI's stash"))?;
                    weight_grads(dev, op, ctx, seg, cache, stash)?;
                }
            }
        }
        OpKind::Send => {
            let kind = op.tensor.unwrap_or(TensorKind::Activation);
            let buf = dev
                .take(op, kind)?
                .ok_or_else(|| missing(dev, op, &format!("{kind:?} to send")))?;
            let Buf::Vec(v) = &*buf else {
                unreachable!("only tensors cross devices")
            };
            // The message stays on this device's account until its receiver
            // holds it.
            dev.reserve(op, v.len() as u64 * 4)?.keep();
            ctx.comm
                .send(
                    op.pair.unwrap_or(op.node),
                    dev.id,
                    op.peer.unwrap_or(dev.id),
                    v.clone(),
                )
                .map_err(comm_err)?;
        }
        OpKind::Recv => {
            let kind = op.tensor.unwrap_or(TensorKind::Activation);
            let what = format!("{kind:?}");
            let v = ctx
                .comm
                .recv(
                    op.pair.unwrap_or(u32::MAX),
                    op.peer.unwrap_or(u32::MAX),
                    dev.id,
                    &what,
                )
                .map_err(comm_err)?;
            let bytes = v.len() as u64 * 4;
            dev.put(op, kind, Buf::Vec(v))?;
            if let Some(sender) = ctx.devices.iter().find(|d| Some(d.id) == op.peer) {
                sender.release(bytes);
            }
        }
        OpKind::AllReduce if op.purpose.as_deref() == Some("grad-norm") => {
            let local = local_sq(dev);
            let total = ctx
                .comm
                .all_reduce(
                    "grad-norm all-reduce",
                    op.node,
                    &group,
                    dev.id,
                    vec![local as f32],
                )
                .map_err(comm_err)?;
            set_clip(dev, (total[0] as f64).sqrt(), ctx.opts.clip);
        }
        OpKind::AllReduce | OpKind::ReduceScatter
            if matches!(
                op.purpose.as_deref(),
                Some("grad-sync") | Some("tied-grad") | Some("copy-grad")
            ) =>
        {
            let names = if op.purpose.as_deref() == Some("tied-grad") {
                vec!["wte".to_string()]
            } else {
                owned(dev, ctx, &op.segments)
            };
            // ZeRO-2/3 reduce every microbatch's gradients, which the
            // backwards hand over as buffers (freed after this op).
            let per_microbatch = op.inputs.iter().any(|i| i.tensor == TensorKind::MicroGrad);
            let tied = op.purpose.as_deref() == Some("tied-grad");
            let mut flat = Vec::new();
            if per_microbatch {
                let bufs = dev.take_all(op, TensorKind::MicroGrad)?;
                for n in &names {
                    // A tied all-reduce's result replaces the local pieces.
                    let reduced = bufs
                        .iter()
                        .any(|b| matches!(&**b, Buf::Tied(t) if t.contains_key(n)));
                    let mut acc: Option<Vec<f32>> = None;
                    for b in &bufs {
                        let t = match &**b {
                            Buf::Tied(t) => t,
                            Buf::Params(t) if !reduced => t,
                            _ => continue,
                        };
                        if let Some(g) = t.get(n) {
                            match acc.as_mut() {
                                None => acc = Some(g.clone()),
                                Some(a) => a.iter_mut().zip(g).for_each(|(x, y)| *x += y),
                            }
                        }
                    }
                    flat.extend(acc.ok_or_else(|| {
                        missing(dev, op, &format!("this microbatch's gradient of {n}"))
                    })?);
                }
            } else {
                let grads = dev.grads.lock().unwrap();
                for n in &names {
                    flat.extend_from_slice(
                        grads
                            .get(n)
                            .ok_or_else(|| missing(dev, op, &format!("gradient {n}")))?,
                    );
                }
            }
            // Staging: this device's contribution and the reduced result.
            let _staging = dev.reserve(op, flat.len() as u64 * 8)?;
            let sum = ctx
                .comm
                .all_reduce(op.op.as_str(), op.node, &group, dev.id, flat)
                .map_err(comm_err)?;
            if per_microbatch && tied {
                // Hand the microbatch's reduced `wte` gradient to the
                // gradient reduce-scatter of its bucket.
                let t: Tensors = [("wte".to_string(), sum.to_vec())].into_iter().collect();
                dev.put(op, TensorKind::MicroGrad, Buf::Tied(t))?;
            } else if per_microbatch {
                // Keep this device's shard of the reduced gradients.
                let mut buckets = dev.buckets.lock().unwrap();
                let b = buckets
                    .iter_mut()
                    .find(|b| *b.segments == *op.segments)
                    .ok_or_else(|| missing(dev, op, "its ZeRO bucket"))?;
                for (acc, x) in b.grad.iter_mut().zip(&sum[b.shard.clone()]) {
                    *acc += x;
                }
                drop(buckets);
            } else {
                let mut grads = dev.grads.lock().unwrap();
                let mut at = 0;
                for n in &names {
                    let g = grads.get_mut(n).expect("read above");
                    let len = g.len();
                    g.copy_from_slice(&sum[at..at + len]);
                    at += len;
                }
            }
        }
        OpKind::AllGather => {
            let params_padded = |b: &Bucket, params: &Tensors| -> Vec<f32> {
                if b.zero >= 3 {
                    return b.padded(&b.param);
                }
                let mut flat = Vec::with_capacity(b.total);
                for (n, _) in &b.names {
                    flat.extend_from_slice(&params[n]);
                }
                let mut v = vec![0.0; b.total];
                v[b.shard.clone()].copy_from_slice(&flat[b.shard.clone()]);
                v
            };
            match op.purpose.as_deref() {
                Some("param-refresh") => {
                    let padded = {
                        let buckets = dev.buckets.lock().unwrap();
                        let b = buckets
                            .iter()
                            .find(|b| *b.segments == *op.segments)
                            .ok_or_else(|| missing(dev, op, "its ZeRO bucket"))?;
                        params_padded(b, &dev.params.read().unwrap())
                    };
                    let _staging = dev.reserve(op, padded.len() as u64 * 8)?;
                    let full = ctx
                        .comm
                        .all_reduce("all-gather", op.node, &group, dev.id, padded)
                        .map_err(comm_err)?;
                    let buckets = dev.buckets.lock().unwrap();
                    let b = buckets
                        .iter()
                        .find(|b| *b.segments == *op.segments)
                        .expect("found above");
                    let mut params = dev.params.write().unwrap();
                    for (n, at, len) in b.offsets() {
                        params
                            .get_mut(n)
                            .expect("held")
                            .copy_from_slice(&full[at..at + len]);
                    }
                }
                Some("param-gather") => {
                    // The buckets that own any parameter the segment reads.
                    let seg = &ctx.segments[op.segments[0] as usize];
                    let need: Vec<String> = segment_params(ctx.cfg, seg)
                        .into_iter()
                        .map(|(n, _)| n)
                        .collect();
                    let buckets = dev.buckets.lock().unwrap();
                    let used: Vec<&Bucket> = buckets
                        .iter()
                        .filter(|b| b.names.iter().any(|(n, _)| need.contains(n)))
                        .collect();
                    let mut padded = Vec::new();
                    {
                        let params = dev.params.read().unwrap();
                        for b in &used {
                            padded.extend(params_padded(b, &params));
                        }
                    }
                    let staging = dev.reserve(op, padded.len() as u64 * 8)?;
                    let full = ctx
                        .comm
                        .all_reduce("all-gather", op.node, &group, dev.id, padded)
                        .map_err(comm_err)?;
                    drop(staging);
                    let mut out = Tensors::new();
                    let mut base = 0;
                    for b in &used {
                        for (n, at, len) in b.offsets() {
                            if need.iter().any(|x| x == n) {
                                out.insert(
                                    n.to_string(),
                                    full[base + at..base + at + len].to_vec(),
                                );
                            }
                        }
                        base += b.total;
                    }
                    drop(buckets);
                    let own = dev.params.read().unwrap();
                    for n in &need {
                        if !out.contains_key(n) {
                            if let Some(p) = own.get(n) {
                                out.insert(n.clone(), p.clone());
                            }
                        }
                    }
                    drop(own);
                    dev.put(op, TensorKind::Param, Buf::Params(out))?;
                }
                other => {
                    return Err(RuntimeError::Unsupported(format!(
                    "device {}: {}: all-gather for {other:?} is not supported by the CPU runtime",
                    dev.id,
                    label(op)
                )))
                }
            }
        }
        OpKind::AllReduce | OpKind::ReduceScatter => {
            return Err(RuntimeError::Unsupported(format!(
                "device {}: {}: {:?} is not supported by the CPU runtime",
                dev.id,
                label(op),
                op.purpose
            )))
        }
        OpKind::Update => {
            if !dev.has_norm_op {
                let local = local_sq(dev);
                set_clip(dev, local.sqrt(), ctx.opts.clip);
            }
            let scale = dev.state.lock().unwrap().clip_scale;
            let names = owned(dev, ctx, &op.segments);
            if ctx.opts.capture_grads {
                let grads = dev.grads.lock().unwrap();
                let mut cap = dev.captured.lock().unwrap();
                for n in &names {
                    if let Some(g) = grads.get(n) {
                        cap.insert(n.clone(), g.clone());
                    }
                }
            }
            let mut params = dev.params.write().unwrap();
            let mut grads = dev.grads.lock().unwrap();
            let mut mom = dev.moments.lock().unwrap();
            let (m, v) = &mut *mom;
            // Unsharded parameters: whole tensors.
            for n in &names {
                let (Some(p), Some(g), Some(mm), Some(vv)) = (
                    params.get_mut(n),
                    grads.get_mut(n),
                    m.get_mut(n),
                    v.get_mut(n),
                ) else {
                    continue;
                };
                adamw_update(
                    p,
                    g,
                    mm,
                    vv,
                    &ctx.opts.adamw,
                    ctx.step,
                    scale,
                    dev.decay.contains(n),
                );
                g.iter_mut().for_each(|x| *x = 0.0);
            }
            // ZeRO buckets: this device's shard only.
            let mut buckets = dev.buckets.lock().unwrap();
            if ctx.opts.capture_grads {
                let mut cap = dev.captured_shards.lock().unwrap();
                for (i, b) in buckets.iter().enumerate() {
                    if b.zero >= 2 && b.segments.iter().all(|s| op.segments.contains(s)) {
                        cap.insert(i, b.grad.clone());
                    }
                }
            }
            for b in buckets
                .iter_mut()
                .filter(|b| b.segments.iter().all(|s| op.segments.contains(s)))
            {
                let shard = b.shard.clone();
                let mut flat_p: Vec<f32> = if b.zero >= 3 {
                    std::mem::take(&mut b.param)
                } else {
                    b.names
                        .iter()
                        .flat_map(|(n, _)| params[n].iter().copied())
                        .collect::<Vec<f32>>()[shard.clone()]
                    .to_vec()
                };
                let flat_g: Vec<f32> = if b.zero >= 2 {
                    std::mem::take(&mut b.grad)
                } else {
                    b.names
                        .iter()
                        .flat_map(|(n, _)| grads[n].iter().copied())
                        .collect::<Vec<f32>>()[shard.clone()]
                    .to_vec()
                };
                // Per tensor piece inside the shard, for weight decay.
                let pieces: Vec<(String, usize, usize)> = b
                    .offsets()
                    .map(|(n, at, len)| (n.to_string(), at, len))
                    .collect();
                for (n, at, len) in pieces {
                    let lo = at.max(shard.start);
                    let hi = (at + len).min(shard.end);
                    if lo >= hi {
                        continue;
                    }
                    let r = lo - shard.start..hi - shard.start;
                    adamw_update(
                        &mut flat_p[r.clone()],
                        &flat_g[r.clone()],
                        &mut b.m[r.clone()],
                        &mut b.v[r.clone()],
                        &ctx.opts.adamw,
                        ctx.step,
                        scale,
                        dev.decay.contains(&n),
                    );
                }
                if b.zero >= 3 {
                    b.param = flat_p;
                } else {
                    // Write the updated shard back; the refresh all-gather fills the rest.
                    for (n, at, len) in b.offsets() {
                        let lo = at.max(shard.start);
                        let hi = (at + len).min(shard.end);
                        if lo < hi {
                            params.get_mut(n).expect("held")[lo - at..hi - at]
                                .copy_from_slice(&flat_p[lo - shard.start..hi - shard.start]);
                        }
                    }
                }
                if b.zero >= 2 {
                    b.grad = vec![0.0; shard.len()];
                } else {
                    for (n, _) in &b.names {
                        grads
                            .get_mut(n)
                            .expect("held")
                            .iter_mut()
                            .for_each(|x| *x = 0.0);
                    }
                }
            }
        }
        OpKind::AllToAll => {
            return Err(RuntimeError::Unsupported(format!(
                "device {}: {} is not yet supported by the CPU runtime",
                dev.id,
                label(op)
            )))
        }
    }
    Ok(())
}

/// Σ g² over the gradients this device counts: unsharded ones on DP replica
/// 0, and its own shard of every ZeRO bucket.
fn local_sq(dev: &Device) -> f64 {
    let grads = dev.grads.lock().unwrap();
    let sq = |g: &[f32]| g.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>();
    let mut total: f64 = dev
        .norm_names
        .iter()
        .filter_map(|n| grads.get(n))
        .map(|g| sq(g))
        .sum();
    for b in dev.buckets.lock().unwrap().iter() {
        let flat: Vec<f32> = if b.zero >= 2 {
            b.grad.clone()
        } else {
            let full: Vec<f32> = b
                .names
                .iter()
                .flat_map(|(n, _)| grads[n].iter().copied())
                .collect();
            full[b.shard.clone()].to_vec()
        };
        // Each tensor piece of the shard; the head's copy of the tied `wte`
        // is counted by the embedding's device only.
        for (n, at, len) in b.offsets() {
            if n == "wte" && !dev.has_embedding {
                continue;
            }
            let lo = at.max(b.shard.start);
            let hi = (at + len).min(b.shard.end);
            if lo < hi {
                total += sq(&flat[lo - b.shard.start..hi - b.shard.start]);
            }
        }
    }
    total
}

fn set_clip(dev: &Device, norm: f64, clip: f32) {
    let mut s = dev.state.lock().unwrap();
    s.grad_norm = norm;
    s.clip_scale = if clip > 0.0 && norm > clip as f64 {
        (clip as f64 / (norm + 1e-6)) as f32
    } else {
        1.0
    };
}
