//! One virtual device: its model states (parameters, gradients, AdamW
//! moments, ZeRO buckets) for the segments its plan runs, its buffers and
//! per-step state; set up from the plan, restored from checkpoints.

use super::backend::cpu::gpt::{decays, init_param, segment_params, Tensors};
use super::backend::cpu::moe::ExpertGroup;
use super::buffers::Buffers;
use super::error::{label, RuntimeError};
use super::step::TraceEvent;
use super::zero::{self, Bucket};
use super::TrainOptions;
use crate::compile::human_bytes;
use crate::compile::plan::{CommPurpose, DevicePlan, Spread};
use crate::model::params::{expert_of, tp_ranges, tp_split, TpSplit};
use crate::model::{ModelConfig, Segment};
use std::collections::{BTreeMap, BTreeSet, HashMap};
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
    /// Of those, segments spread over a group (`shard`, `shard-tensor`).
    pub(super) spreads: Spreads,
    /// Tensor-parallel slices: this device's part of each full tensor.
    pub(super) tp_pieces: BTreeMap<String, TpPiece>,
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

/// Expert segments whose experts `shard` spread, with this device's place
/// in each one's group.
pub(super) type ExpertGroups = BTreeMap<u32, ExpertGroup>;

/// Segments `shard-tensor` split, with (group size, this device's rank).
pub(super) type TensorGroups = BTreeMap<u32, (usize, usize)>;

/// How a segment's parameters are spread over this device's groups.
#[derive(Default)]
pub(super) struct Spreads {
    pub(super) experts: ExpertGroups,
    pub(super) tensor: TensorGroups,
}

/// This device's part of a tensor split by tensor parallelism: the ranges
/// of the full (row-major) tensor it holds, in order.
#[derive(Clone, Debug)]
pub(crate) struct TpPiece {
    pub(crate) total: usize,
    pub(crate) ranges: Vec<std::ops::Range<usize>>,
}

impl TpPiece {
    /// This device's values of the full tensor `full`.
    pub(crate) fn take(&self, full: &[f32]) -> Vec<f32> {
        self.ranges
            .iter()
            .flat_map(|r| full[r.clone()].iter().copied())
            .collect()
    }
}

/// A parameter as this device holds it: name, local shape, and for a
/// tensor-parallel split its part of the full tensor (of `full` shape).
pub(super) struct ParamHere {
    pub(super) name: String,
    pub(super) full: Vec<usize>,
    pub(super) shape: Vec<usize>,
    pub(super) piece: Option<TpPiece>,
}

/// A segment's parameters on this device: of experts spread by `shard`,
/// only this device's; of a segment split by `shard-tensor`, this device's
/// slices.
pub(super) fn params_here(cfg: &ModelConfig, seg: &Segment, spreads: &Spreads) -> Vec<ParamHere> {
    let mut all = segment_params(cfg, seg);
    if let (Some(g), Some(moe)) = (spreads.experts.get(&seg.index), &cfg.moe) {
        let local = g.local(moe.experts as usize);
        all.retain(|(n, _)| expert_of(n).is_none_or(|e| local.contains(&e)));
    }
    let tp = spreads.tensor.get(&seg.index).copied();
    all.into_iter()
        .map(|(name, full)| {
            let split = tp.map(|_| tp_split(&name)).unwrap_or(TpSplit::Replicated);
            match (tp, split) {
                (Some((t, r)), split) if split != TpSplit::Replicated => {
                    let (ranges, shape) = tp_ranges(&full, split, t, r);
                    let total = full.iter().product();
                    ParamHere {
                        name,
                        full,
                        shape,
                        piece: Some(TpPiece { total, ranges }),
                    }
                }
                _ => ParamHere {
                    name,
                    shape: full.clone(),
                    full,
                    piece: None,
                },
            }
        })
        .collect()
}

/// Names of the parameters a segment owns on a device holding `held`: the
/// tied `wte` belongs to the embedding when both ends are here; of spread
/// experts, only this device's.
pub(super) fn owned_names(
    cfg: &ModelConfig,
    segments: &[Segment],
    held: &BTreeSet<u32>,
    spreads: &Spreads,
    s: u32,
) -> Vec<String> {
    let seg = &segments[s as usize];
    let emb_here = held.iter().any(|h| segments[*h as usize].has_embedding());
    params_here(cfg, seg, spreads)
        .into_iter()
        .map(|p| p.name)
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
        let mut spreads = Spreads::default();
        for op in ops().filter(|o| o.op.is_compute()) {
            for s in op.segments.iter() {
                held.insert(*s);
                replica.insert(*s, op.replica);
                // A spread op exchanges with its group inside the op.
                let (Some(kind), Some(g)) = (op.spread, op.group.as_deref()) else {
                    continue;
                };
                let (size, rank) = (g.len(), g.iter().position(|d| *d == plan.device));
                let Some(rank) = rank else {
                    return Err(RuntimeError::Plan(format!(
                        "device {}: {}: its group {g:?} does not hold this device",
                        plan.device,
                        label(op)
                    )));
                };
                let clash = match kind {
                    Spread::Experts => {
                        let group = ExpertGroup { size, rank };
                        spreads
                            .experts
                            .insert(*s, group)
                            .is_some_and(|o| o != group)
                    }
                    Spread::Tensor => spreads
                        .tensor
                        .insert(*s, (size, rank))
                        .is_some_and(|o| o != (size, rank)),
                };
                if clash {
                    return Err(RuntimeError::Plan(format!(
                        "device {}: {}: segment {s}'s group differs between its ops",
                        plan.device,
                        label(op)
                    )));
                }
            }
        }
        let has_embedding = held.iter().any(|s| segments[*s as usize].has_embedding());
        let mut params = Tensors::new();
        let mut norm_names = Vec::new();
        let mut decay = BTreeSet::new();
        let mut tp_pieces = BTreeMap::new();
        for &s in &held {
            let spread = spreads.experts.contains_key(&s);
            let tp_rank = spreads.tensor.get(&s).map(|(_, r)| *r);
            for p in params_here(cfg, &segments[s as usize], &spreads) {
                let name = p.name;
                if decays(&p.full) {
                    decay.insert(name.clone());
                }
                if !params.contains_key(&name) {
                    let full = init_param(cfg, opts.seed, &name, &p.full);
                    let mine = match &p.piece {
                        Some(pc) => pc.take(&full),
                        None => full,
                    };
                    params.insert(name.clone(), mine);
                }
                // Replicated tensors count in the norm on their first
                // replica (tensor-parallel rank 0); spread experts and
                // tensor-parallel slices on every device holding them.
                let first = match tp_rank {
                    Some(r) => r == 0 || p.piece.is_some(),
                    None => replica.get(&s) == Some(&0) || (spread && expert_of(&name).is_some()),
                };
                if let Some(pc) = p.piece {
                    tp_pieces.insert(name.clone(), pc);
                }
                let counts = first && (name != "wte" || has_embedding);
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
                    for n in owned_names(cfg, segments, &held, &spreads, *s) {
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
            &spreads,
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
            spreads,
            tp_pieces,
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
    /// Whole tensors of one kind of state (parameters, captured gradients,
    /// moments): tensor-parallel slices leave as [`Device::tp_shards`].
    fn whole(&self, t: &Tensors) -> Tensors {
        t.iter()
            .filter(|(k, _)| !self.tp_pieces.contains_key(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
    pub(crate) fn params(&self) -> Tensors {
        self.whole(&self.params.read().unwrap())
    }
    pub(crate) fn captured(&self) -> Tensors {
        self.whole(&self.captured.lock().unwrap())
    }

    /// This device's tensor-parallel slices of one kind of state, as pieces
    /// of the full tensors (put back together with ZeRO's shards).
    pub(crate) fn tp_shards(&self, part: zero::ShardPart) -> Vec<zero::Shard> {
        if self.tp_pieces.is_empty() {
            return Vec::new();
        }
        let (params, captured, moments);
        let t: &Tensors = match part {
            zero::ShardPart::Param => {
                params = self.params.read().unwrap();
                &params
            }
            zero::ShardPart::Grad => {
                captured = self.captured.lock().unwrap();
                &captured
            }
            zero::ShardPart::M | zero::ShardPart::V => {
                moments = self.moments.lock().unwrap();
                if part == zero::ShardPart::M {
                    &moments.0
                } else {
                    &moments.1
                }
            }
        };
        let mut out = Vec::new();
        for (name, piece) in &self.tp_pieces {
            let Some(values) = t.get(name) else { continue };
            let mut at = 0;
            for r in &piece.ranges {
                out.push(zero::Shard {
                    names: vec![(name.clone(), piece.total)],
                    total: piece.total,
                    range: r.clone(),
                    values: values[at..at + r.len()].to_vec(),
                });
                at += r.len();
            }
        }
        out
    }
    pub(crate) fn events(&self) -> Vec<TraceEvent> {
        self.events.lock().unwrap().clone()
    }
    pub(crate) fn moments(&self) -> (Tensors, Tensors) {
        let m = self.moments.lock().unwrap();
        (self.whole(&m.0), self.whole(&m.1))
    }

    /// Take the tensors of this device's parameters from a checkpoint:
    /// whole tensors, and this device's slice of each ZeRO bucket
    /// (parameters for ZeRO-3, AdamW moments for every stage).
    pub(crate) fn restore(&self, ck: &super::checkpoint::Checkpoint) -> Result<(), RuntimeError> {
        self.restore_shards(ck)?;
        let mut params = self.params.write().unwrap();
        let mut mom = self.moments.lock().unwrap();
        // A tensor-parallel slice takes its part of the full tensor; sizes
        // are checked, never assumed.
        let take = |name: &str, dst: &mut Vec<f32>, full: &Vec<f32>| {
            let mine = match self.tp_pieces.get(name) {
                Some(piece) if full.len() == piece.total => piece.take(full),
                Some(_) => return Err(full.len()),
                None => full.clone(),
            };
            if mine.len() != dst.len() {
                return Err(full.len());
            }
            dst.copy_from_slice(&mine);
            Ok(())
        };
        let wrong = |name: &str, got: usize| {
            RuntimeError::Plan(format!(
                "device {}: the checkpoint's {name} has {got} values, which does not fit this device's tensor",
                self.id
            ))
        };
        for (name, p) in params.iter_mut() {
            if let Some(x) = ck.params.get(name) {
                take(name, p, x).map_err(|n| wrong(name, n))?;
            }
            // Sharded parameters keep their moments in their bucket.
            if let Some(x) = ck.m.get(name) {
                if let Some(mm) = mom.0.get_mut(name) {
                    take(name, mm, x).map_err(|n| wrong(name, n))?;
                }
            }
            if let Some(x) = ck.v.get(name) {
                if let Some(vv) = mom.1.get_mut(name) {
                    take(name, vv, x).map_err(|n| wrong(name, n))?;
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
