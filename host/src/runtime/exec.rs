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
    #[error("device {device}: {op}: {source}")]
    Comm {
        device: u32,
        op: String,
        #[source]
        source: CommError,
    },
    #[error("device {device}: {op}: input {input} is missing (the plan does not produce it on this device)")]
    MissingInput {
        device: u32,
        op: String,
        input: String,
    },
    #[error("{0}")]
    Unsupported(String),
}

enum Buf {
    Vec(Arc<Vec<f32>>),
    Saved(SegmentCache),
    Stash(SegmentStash),
}

impl Buf {
    fn bytes(&self) -> u64 {
        match self {
            Buf::Vec(v) => v.len() as u64 * 4,
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
    events: Mutex<Vec<TraceEvent>>,
}

fn label(op: &Op) -> String {
    format!("{}#{}", op.label(), op.node)
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
        for op in ops() {
            if matches!(
                op.op,
                OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll
            ) {
                return Err(RuntimeError::Unsupported(format!(
                    "device {}: {}: ZeRO sharding (reduce-scatter / all-gather) and all-to-all are not yet supported by the CPU runtime",
                    plan.device,
                    label(op)
                )));
            }
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
        let zeros = |p: &Tensors| -> Tensors {
            p.iter()
                .map(|(k, v)| (k.clone(), vec![0.0; v.len()]))
                .collect()
        };
        let elems: u64 = params.values().map(|v| v.len() as u64).sum();
        let state_bytes = elems * 4 * 4; // params, grads, two moments
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
            grads: Mutex::new(zeros(&params)),
            moments: Mutex::new((zeros(&params), zeros(&params))),
            params: RwLock::new(params),
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
    /// Take the tensors of this device's parameters from a checkpoint.
    pub(crate) fn restore(&self, ck: &super::checkpoint::Checkpoint) {
        let mut params = self.params.write().unwrap();
        let mut mom = self.moments.lock().unwrap();
        for (name, p) in params.iter_mut() {
            if let Some(x) = ck.params.get(name) {
                p.copy_from_slice(x);
            }
            if let Some(x) = ck.m.get(name) {
                mom.0
                    .get_mut(name)
                    .expect("moments mirror params")
                    .copy_from_slice(x);
            }
            if let Some(x) = ck.v.get(name) {
                mom.1
                    .get_mut(name)
                    .expect("moments mirror params")
                    .copy_from_slice(x);
            }
        }
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

    /// Store an op's output if anyone on this device reads it.
    fn put(&self, op: &Op, kind: TensorKind, buf: Buf) -> Result<(), RuntimeError> {
        let mut b = self.bufs.lock().unwrap();
        let Some(&readers) = b.readers.get(&(op.node, kind)) else {
            return Ok(());
        };
        let bytes = buf.bytes();
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
        b.map.insert((op.node, kind), (Arc::new(buf), readers));
        Ok(())
    }

    /// Read an input of `op`; freed after its last reader.
    fn take(&self, op: &Op, kind: TensorKind) -> Result<Option<Arc<Buf>>, RuntimeError> {
        let Some(input) = op.inputs.iter().find(|i| i.tensor == kind) else {
            return Ok(None);
        };
        let mut b = self.bufs.lock().unwrap();
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
        Ok(Some(buf))
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
    pub epoch: std::time::Instant,
}

/// Run every stream of every device; the first real error wins.
pub(crate) fn run_step(devices: &[Device], plan: &Plan, ctx: &StepCtx) -> Result<(), RuntimeError> {
    for (d, dp) in devices.iter().zip(&plan.devices) {
        d.reset(dp);
    }
    let results: Vec<Result<(), RuntimeError>> = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .zip(&plan.devices)
            .flat_map(|(dev, dp)| (0..dp.streams.len()).map(move |si| (dev, dp, si)))
            .map(|(dev, dp, si)| s.spawn(move || run_stream(dev, dp, si, ctx)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("stream threads do not panic"))
            .collect()
    });
    let mut first = None;
    for r in results {
        if let Err(e) = r {
            let aborted = matches!(
                e,
                RuntimeError::Comm {
                    source: CommError::Aborted,
                    ..
                }
            );
            if first.is_none()
                || (!aborted
                    && matches!(
                        first,
                        Some(RuntimeError::Comm {
                            source: CommError::Aborted,
                            ..
                        })
                    ))
            {
                first = Some(e);
            }
        }
    }
    first.map_or(Ok(()), Err)
}

fn run_stream(dev: &Device, dp: &DevicePlan, si: usize, ctx: &StepCtx) -> Result<(), RuntimeError> {
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
                        source: CommError::Aborted,
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

fn exec_op(dev: &Device, op: &Op, ctx: &StepCtx) -> Result<(), RuntimeError> {
    let comm_err = |source| RuntimeError::Comm {
        device: dev.id,
        op: label(op),
        source,
    };
    match op.op {
        OpKind::F => {
            let seg = &ctx.segments[op.segments[0] as usize];
            let div = op.batch_div as usize;
            let b = ctx.batch.b / div;
            let dp = div / op.microbatches.max(1) as usize;
            let piece = op.microbatch as usize * dp + op.replica as usize;
            let (tokens, targets) = ctx.batch.rows(piece * b, b);
            let input = vec_of(dev.take(op, TensorKind::Activation)?);
            let (out, cache, loss) = {
                let params = dev.params.read().unwrap();
                segment_forward(
                    seg,
                    &params,
                    seg.has_embedding().then_some(tokens),
                    input,
                    seg.has_head().then_some(targets),
                    Dims::new(ctx.cfg, b),
                )
            };
            if let Some(l) = loss {
                dev.state.lock().unwrap().loss += l;
            }
            if let Some(out) = out {
                dev.put(op, TensorKind::Activation, Buf::Vec(Arc::new(out)))?;
            }
            dev.put(op, TensorKind::Saved, Buf::Saved(cache))?;
        }
        OpKind::B | OpKind::BI => {
            let saved =
                dev.take(op, TensorKind::Saved)?
                    .ok_or_else(|| RuntimeError::MissingInput {
                        device: dev.id,
                        op: label(op),
                        input: "the forward's saved tensors".into(),
                    })?;
            let Buf::Saved(cache) = &*saved else {
                unreachable!()
            };
            let dout = vec_of(dev.take(op, TensorKind::ActGrad)?);
            let (dinp, stash) = {
                let params = dev.params.read().unwrap();
                segment_backward_input(&params, cache, dout, ctx.loss_scale)
            };
            if op.op == OpKind::B {
                segment_backward_weight(&mut dev.grads.lock().unwrap(), cache, &stash);
            } else {
                dev.put(op, TensorKind::Stash, Buf::Stash(stash))?;
            }
            if let Some(d) = dinp {
                dev.put(op, TensorKind::ActGrad, Buf::Vec(Arc::new(d)))?;
            }
        }
        OpKind::BW => {
            let saved = dev.take(op, TensorKind::Saved)?;
            let stash = dev.take(op, TensorKind::Stash)?;
            let (Some(saved), Some(stash)) = (saved, stash) else {
                return Err(RuntimeError::MissingInput {
                    device: dev.id,
                    op: label(op),
                    input: "saved tensors and BI's stash".into(),
                });
            };
            let (Buf::Saved(cache), Buf::Stash(stash)) = (&*saved, &*stash) else {
                unreachable!()
            };
            segment_backward_weight(&mut dev.grads.lock().unwrap(), cache, stash);
        }
        OpKind::Send => {
            let kind = op.tensor.unwrap_or(TensorKind::Activation);
            let buf = dev
                .take(op, kind)?
                .ok_or_else(|| RuntimeError::MissingInput {
                    device: dev.id,
                    op: label(op),
                    input: format!("{kind:?} to send"),
                })?;
            let Buf::Vec(v) = &*buf else {
                unreachable!("only tensors cross devices")
            };
            ctx.comm.send(
                op.pair.unwrap_or(op.node),
                dev.id,
                op.peer.unwrap_or(dev.id),
                v.clone(),
            );
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
            dev.put(op, kind, Buf::Vec(v))?;
        }
        OpKind::AllReduce => {
            let group: Vec<u32> = op
                .group
                .as_deref()
                .map(|g| g.to_vec())
                .unwrap_or_else(|| vec![dev.id]);
            match op.purpose.as_deref() {
                Some("grad-norm") => {
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
                Some("grad-sync") | Some("tied-grad") => {
                    let names: Vec<String> = if op.purpose.as_deref() == Some("tied-grad") {
                        vec!["wte".into()]
                    } else {
                        let mut n: Vec<String> = op
                            .segments
                            .iter()
                            .flat_map(|s| {
                                segment_params(ctx.cfg, &ctx.segments[*s as usize])
                                    .into_iter()
                                    .map(|(n, _)| n)
                            })
                            .collect();
                        n.sort();
                        n.dedup();
                        n
                    };
                    let mut grads = dev.grads.lock().unwrap();
                    let mut flat = Vec::new();
                    for n in &names {
                        flat.extend_from_slice(&grads[n]);
                    }
                    drop(grads);
                    let sum = ctx
                        .comm
                        .all_reduce("gradient all-reduce", op.node, &group, dev.id, flat)
                        .map_err(comm_err)?;
                    grads = dev.grads.lock().unwrap();
                    let mut at = 0;
                    for n in &names {
                        let g = grads.get_mut(n).expect("named above");
                        let len = g.len();
                        g.copy_from_slice(&sum[at..at + len]);
                        at += len;
                    }
                }
                other => {
                    return Err(RuntimeError::Unsupported(format!(
                    "device {}: {}: all-reduce for {other:?} is not supported by the CPU runtime",
                    dev.id,
                    label(op)
                )))
                }
            }
        }
        OpKind::Update => {
            if !dev.has_norm_op {
                let local = local_sq(dev);
                set_clip(dev, local.sqrt(), ctx.opts.clip);
            }
            let scale = dev.state.lock().unwrap().clip_scale;
            if ctx.opts.capture_grads {
                let grads = dev.grads.lock().unwrap();
                let mut cap = dev.captured.lock().unwrap();
                for s in op.segments.iter() {
                    for (n, _) in segment_params(ctx.cfg, &ctx.segments[*s as usize]) {
                        if let Some(g) = grads.get(&n) {
                            cap.insert(n, g.clone());
                        }
                    }
                }
            }
            let mut names: Vec<String> = op
                .segments
                .iter()
                .flat_map(|s| {
                    segment_params(ctx.cfg, &ctx.segments[*s as usize])
                        .into_iter()
                        .map(|(n, _)| n)
                })
                .collect();
            names.sort();
            names.dedup();
            let mut params = dev.params.write().unwrap();
            let mut grads = dev.grads.lock().unwrap();
            let mut mom = dev.moments.lock().unwrap();
            let (m, v) = &mut *mom;
            for n in &names {
                let (Some(p), Some(g)) = (params.get_mut(n), grads.get_mut(n)) else {
                    continue;
                };
                let decay = dev.decay.contains(n);
                adamw_update(
                    p,
                    g,
                    m.get_mut(n).unwrap(),
                    v.get_mut(n).unwrap(),
                    &ctx.opts.adamw,
                    ctx.step,
                    scale,
                    decay,
                );
                g.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll => {
            return Err(RuntimeError::Unsupported(format!(
                "device {}: {} is not yet supported by the CPU runtime",
                dev.id,
                label(op)
            )))
        }
    }
    Ok(())
}

/// Σ g² over the gradients this device counts.
fn local_sq(dev: &Device) -> f64 {
    let grads = dev.grads.lock().unwrap();
    dev.norm_names
        .iter()
        .filter_map(|n| grads.get(n))
        .flat_map(|g| g.iter())
        .map(|x| (*x as f64) * (*x as f64))
        .sum()
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
