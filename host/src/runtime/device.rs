//! One virtual device: its model states (parameters, gradients, AdamW
//! moments, ZeRO buckets) for the segments its plan runs, its buffers and
//! per-step state; set up from the plan, restored from checkpoints.

use super::backend::cpu::gpt::{decays, init_param, segment_params, Tensors};
use super::buffers::Buffers;
use super::error::{label, RuntimeError};
use super::step::TraceEvent;
use super::zero::{self, Bucket};
use super::TrainOptions;
use crate::compile::human_bytes;
use crate::compile::plan::{CommPurpose, DevicePlan, OpKind};
use crate::model::{ModelConfig, Segment};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Condvar, Mutex, RwLock};

/// What one step leaves on a device.
#[derive(Default)]
pub(super) struct StepState {
    pub(super) loss: f64,
    /// MoE expert assignments routed and dropped by this device's forwards.
    pub(super) moe_routed: u64,
    pub(super) moe_dropped: u64,
    pub(super) grad_norm: f64,
    pub(super) clip_scale: f32,
}

/// A device's share of a step's figures.
pub(crate) struct DeviceStats {
    pub(crate) loss: f64,
    pub(crate) grad_norm: f64,
    pub(crate) moe_routed: u64,
    pub(crate) moe_dropped: u64,
}

/// One virtual device: its model states and buffers.
pub(crate) struct Device {
    pub(super) id: u32,
    pub(super) params: RwLock<Tensors>,
    pub(super) grads: Mutex<Tensors>,
    pub(super) moments: Mutex<(Tensors, Tensors)>,
    /// ZeRO buckets (sharded states).
    pub(super) buckets: Mutex<Vec<Bucket>>,
    /// Segments this device runs.
    pub(super) held: BTreeSet<u32>,
    /// Does it run the embedding (which owns the tied `wte`)?
    pub(super) has_embedding: bool,
    pub(super) bufs: Mutex<Buffers>,
    pub(super) state: Mutex<StepState>,
    /// Gradients this device counts in the global norm.
    pub(super) norm_names: Vec<String>,
    /// Parameters that get weight decay (matrices and embeddings).
    pub(super) decay: BTreeSet<String>,
    pub(super) has_norm_op: bool,
    pub(super) state_bytes: u64,
    pub(super) cap: Option<u64>,
    /// Ops done per stream this step (cross-stream waits read it).
    pub(super) progress: Mutex<Vec<usize>>,
    pub(super) cv: Condvar,
    pub(super) captured: Mutex<Tensors>,
    /// ZeRO-2/3: the last step's reduced gradient shard per bucket index.
    pub(super) captured_shards: Mutex<HashMap<usize, Vec<f32>>>,
    pub(super) events: Mutex<Vec<TraceEvent>>,
    /// The threads its kernels run on (`TrainOptions::threads`).
    pub(super) pool: rayon::ThreadPool,
}

/// Names of the parameters a segment owns on a device holding `held`: the
/// tied `wte` belongs to the embedding when both ends are here.
pub(super) fn owned_names(
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
        for op in ops().filter(|o| o.purpose == Some(CommPurpose::CopyGrad)) {
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
        let buckets = zero::layout(
            cfg,
            segments,
            plan,
            &held,
            zero::States {
                params: &mut params,
                grads: &mut grads,
                m: &mut m,
                v: &mut v,
                norm_names: &mut norm_names,
            },
        );
        let elems = |t: &Tensors| t.values().map(|v| v.len() as u64).sum::<u64>();
        let state_bytes = 4
            * (elems(&params)
                + elems(&grads)
                + elems(&m)
                + elems(&v)
                + zero::shard_elems(&buckets));
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
        let has_norm_op = ops().any(|o| o.purpose == Some(CommPurpose::GradNorm));
        let threads = opts.threads.unwrap_or(1).max(1);
        let id = plan.device;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("piper-d{id}-k{i}"))
            .build()
            .map_err(|e| {
                RuntimeError::Threads(format!("device {id}: cannot start {threads}: {e}"))
            })?;
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
            pool,
        })
    }

    pub(crate) fn stats(&self) -> DeviceStats {
        let s = self.state.lock().unwrap();
        DeviceStats {
            loss: s.loss,
            grad_norm: s.grad_norm,
            moe_routed: s.moe_routed,
            moe_dropped: s.moe_dropped,
        }
    }
    pub(crate) fn peak_bytes(&self) -> u64 {
        self.state_bytes + self.bufs.lock().unwrap().peak
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
        self.restore_shards(ck)?;
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

    /// Before a step: no buffers, readers counted from the plan, progress 0.
    pub(super) fn reset(&self, plan: &DevicePlan) {
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
}
