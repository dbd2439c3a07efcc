//! One plan device: its model states (parameters, gradients, AdamW
//! moments, ZeRO buckets) for the segments its plan runs, as storage of its
//! backend indexed by parameter id; its buffers, streams and per-step
//! state; set up from the plan, restored from checkpoints.

use super::backend::{init, Backend, BackendError, ParamId, ParamMap};
use super::buffers::Buffers;
use super::error::{label, RuntimeError};
use super::step::TraceEvent;
use super::zero::{self, Bucket};
use super::TrainOptions;
use crate::compile::human_bytes;
use crate::compile::plan::{Act, Collective, DevicePlan, Spread};
use crate::model::params::{tp_ranges, ParamTable, TpSplit};
use crate::model::{ModelConfig, Segment};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Condvar, Mutex, RwLock};

pub(super) use crate::runtime::model::moe::ExpertGroup;

/// What one step leaves on a device.
pub(super) struct StepState<B: Backend> {
    /// Each forward's loss terms, in the order the forwards ran; read when
    /// the step ends.
    pub(super) losses: Vec<Vec<B::Scalar>>,
    /// MoE expert assignments routed and dropped by this device's forwards.
    pub(super) moe_routed: u64,
    pub(super) moe_dropped: u64,
    pub(super) grad_norm: f64,
    pub(super) clip_scale: f32,
}

impl<B: Backend> Default for StepState<B> {
    fn default() -> Self {
        StepState {
            losses: Vec::new(),
            moe_routed: 0,
            moe_dropped: 0,
            grad_norm: 0.0,
            clip_scale: 1.0,
        }
    }
}

/// AdamW's first and second moments of a device's whole tensors.
pub(super) type Moments<B> = (
    ParamMap<<B as Backend>::Tensor>,
    ParamMap<<B as Backend>::Tensor>,
);

/// A device's share of a step's figures.
pub(crate) struct DeviceStats {
    pub(crate) loss: f64,
    pub(crate) grad_norm: f64,
    pub(crate) moe_routed: u64,
    pub(crate) moe_dropped: u64,
}

/// One plan device: its model states and buffers.
pub(crate) struct Device<B: Backend> {
    pub(super) id: u32,
    /// The backend its storage and kernels are on.
    pub(super) b: B,
    pub(super) table: Arc<ParamTable>,
    pub(super) params: RwLock<ParamMap<B::Tensor>>,
    pub(super) grads: Mutex<ParamMap<B::Tensor>>,
    pub(super) moments: Mutex<Moments<B>>,
    /// ZeRO buckets (sharded states).
    pub(super) buckets: Mutex<Vec<Bucket<B>>>,
    /// Of those, segments spread over a group (`shard`, `shard-tensor`).
    pub(super) spreads: Spreads,
    /// The parameters each held segment owns here (sorted): the tied `wte`
    /// belongs to the embedding when both ends are here; of spread
    /// experts, only this device's.
    pub(super) owned: BTreeMap<u32, Vec<ParamId>>,
    /// Tensor-parallel slices: this device's part of each full tensor.
    pub(super) tp_pieces: ParamMap<TpPiece>,
    /// Segments of which this device holds a parameter copy whose summed
    /// gradient another copy counts in the norm (DualPipe's second copy).
    pub(super) other_copy: BTreeSet<u32>,
    /// Does it run the embedding (which owns the tied `wte`)?
    pub(super) has_embedding: bool,
    pub(super) bufs: Mutex<Buffers<B>>,
    pub(super) state: Mutex<StepState<B>>,
    /// Gradients this device counts in the global norm.
    pub(super) norm_ids: Vec<ParamId>,
    /// Parameters that get weight decay (matrices and embeddings).
    pub(super) decay: ParamMap<()>,
    pub(super) has_norm_op: bool,
    pub(super) state_bytes: u64,
    pub(super) cap: Option<u64>,
    /// One backend stream per plan stream.
    pub(super) streams: Vec<B::Stream>,
    /// Ops done per stream this step (cross-stream waits read it).
    pub(super) progress: Mutex<Vec<usize>>,
    /// The ops another stream waits for, by (stream, op index), and the
    /// event recorded after each this step.
    pub(super) waited: std::collections::HashSet<(usize, usize)>,
    /// The same of the forward-only plan, set at its first step.
    pub(super) eval_waited: std::sync::OnceLock<std::collections::HashSet<(usize, usize)>>,
    pub(super) marks: Mutex<HashMap<(usize, usize), B::Event>>,
    pub(super) cv: Condvar,
    pub(super) captured: Mutex<ParamMap<B::Tensor>>,
    /// ZeRO-2/3: the last step's reduced gradient shard per bucket index.
    pub(super) captured_shards: Mutex<HashMap<usize, B::Tensor>>,
    pub(super) events: Mutex<Vec<TraceEvent>>,
}

/// Expert segments whose experts `shard` spread, with this device's place
/// in each one's group.
pub(super) type ExpertGroups = BTreeMap<u32, ExpertGroup>;

/// Segments `shard-tensor` split, with (group size, this device's rank).
pub(super) type TensorGroups = BTreeMap<u32, (usize, usize)>;

/// Expert segments on a tensor-parallel mesh: each rank of a
/// tensor-parallel group runs the `rank`-th of `tp` shares of its replica's
/// sequences, the group gathering outputs and summing replicated gradients.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct SequenceSplit {
    pub(super) tp: usize,
    pub(super) rank: usize,
    /// The tensor-parallel group, in rank order.
    pub(super) members: Arc<[u32]>,
}

impl SequenceSplit {
    /// This rank's rows of `n` rows (whole sequences, as `n` divides).
    pub(super) fn share(&self, n: usize) -> std::ops::Range<usize> {
        let per = n / self.tp.max(1);
        self.rank * per..(self.rank + 1) * per
    }
}

/// How a segment's parameters are spread over this device's groups.
#[derive(Default)]
pub(super) struct Spreads {
    pub(super) experts: ExpertGroups,
    pub(super) tensor: TensorGroups,
    pub(super) sequences: BTreeMap<u32, SequenceSplit>,
    /// Segments of `tensor` under sequence parallelism (`sequence-parallel`).
    pub(super) sequence_parallel: BTreeSet<u32>,
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

/// A parameter as this device holds it: id, full shape, and for a
/// tensor-parallel split its part of the full tensor.
pub(super) struct ParamHere {
    pub(super) id: ParamId,
    pub(super) piece: Option<TpPiece>,
}

/// A segment's parameters on this device: of experts spread by `shard`,
/// only this device's; of a segment split by `shard-tensor`, this device's
/// slices.
pub(super) fn params_here(
    cfg: &ModelConfig,
    table: &ParamTable,
    seg: &Segment,
    spreads: &Spreads,
) -> Vec<ParamHere> {
    let mut all = table.segment(cfg, seg);
    if let (Some(g), Some(moe)) = (spreads.experts.get(&seg.index), &cfg.moe) {
        let local = g.local(moe.experts as usize);
        all.retain(|id| {
            table
                .expert_of(*id)
                .is_none_or(|e| local.contains(&(e as usize)))
        });
    }
    let tp = spreads.tensor.get(&seg.index).copied();
    all.into_iter()
        .map(|id| {
            let entry = table.entry(id);
            let split = tp.map(|_| entry.tp_split()).unwrap_or(TpSplit::Replicated);
            let piece = match (tp, split) {
                (Some((t, r)), split) if split != TpSplit::Replicated => {
                    let (ranges, _) = tp_ranges(&entry.shape, split, t, r);
                    Some(TpPiece {
                        total: entry.numel(),
                        ranges,
                    })
                }
                _ => None,
            };
            ParamHere { id, piece }
        })
        .collect()
}

/// The parameters segment `s` owns on a device holding `held`: the tied
/// `wte` belongs to the embedding when both ends are here; of spread
/// experts, only this device's.
pub(super) fn owned_ids(
    cfg: &ModelConfig,
    table: &ParamTable,
    segments: &[Segment],
    held: &BTreeSet<u32>,
    spreads: &Spreads,
    s: u32,
) -> Vec<ParamId> {
    let seg = &segments[s as usize];
    let emb_here = held.iter().any(|h| segments[*h as usize].has_embedding());
    params_here(cfg, table, seg, spreads)
        .into_iter()
        .map(|p| p.id)
        .filter(|id| !(*id == table.wte && !seg.has_embedding() && emb_here))
        .collect()
}

/// The segments a device's plan runs: each one's DP replica, and how
/// spread ops split them.
struct Held {
    segments: BTreeSet<u32>,
    replica: HashMap<u32, u32>,
    spreads: Spreads,
}

fn held_and_spreads(plan: &DevicePlan) -> Result<Held, RuntimeError> {
    let mut held: BTreeSet<u32> = BTreeSet::new();
    let mut replica: HashMap<u32, u32> = HashMap::new();
    let mut spreads = Spreads::default();
    let ops = plan.streams.iter().flat_map(|s| s.ops.iter());
    for op in ops.filter(|o| o.kind().is_compute()) {
        for s in op.segments.iter() {
            held.insert(*s);
            replica.insert(*s, op.replica);
            // A spread op exchanges with its group inside the op.
            let (Some(kind), Some(g)) = (op.spread, op.group()) else {
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
            let tp = op.tp.max(1) as usize;
            if kind == Spread::Experts && !size.is_multiple_of(tp) {
                return Err(RuntimeError::Plan(format!(
                    "device {}: {}: its group {g:?} is not made of tensor-parallel groups of {tp}",
                    plan.device,
                    label(op)
                )));
            }
            let clash = match kind {
                Spread::Experts if tp > 1 => {
                    let group = ExpertGroup { size, rank };
                    let at = rank / tp * tp;
                    let split = SequenceSplit {
                        tp,
                        rank: rank % tp,
                        members: g.get(at..at + tp).unwrap_or_default().into(),
                    };
                    spreads
                        .experts
                        .insert(*s, group)
                        .is_some_and(|o| o != group)
                        || spreads
                            .sequences
                            .insert(*s, split.clone())
                            .is_some_and(|o| o != split)
                }
                Spread::Experts => {
                    let group = ExpertGroup { size, rank };
                    spreads
                        .experts
                        .insert(*s, group)
                        .is_some_and(|o| o != group)
                }
                Spread::Tensor => {
                    let sp_differs = match spreads.tensor.contains_key(s) {
                        true => spreads.sequence_parallel.contains(s) != op.sp,
                        false => false,
                    };
                    if op.sp {
                        spreads.sequence_parallel.insert(*s);
                    }
                    sp_differs
                        || spreads
                            .tensor
                            .insert(*s, (size, rank))
                            .is_some_and(|o| o != (size, rank))
                }
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
    Ok(Held {
        segments: held,
        replica,
        spreads,
    })
}

/// A device's parameters at step 0 and what it knows of them.
struct Initial<T> {
    params: ParamMap<T>,
    /// The parameters whose gradients this device counts in the norm.
    norm_ids: Vec<ParamId>,
    /// The parameters AdamW decays.
    decay: ParamMap<()>,
    /// Of tensor-parallel slices, this device's part of the full tensor.
    tp_pieces: ParamMap<TpPiece>,
}

/// The initial values of the `held` segments' parameters as this device
/// holds them (its slices and experts), seeded by name as on every backend.
fn initial_params<B: Backend>(
    cfg: &ModelConfig,
    table: &ParamTable,
    segments: &[Segment],
    (held, replica, spreads): (&BTreeSet<u32>, &HashMap<u32, u32>, &Spreads),
    seed: u64,
    b: &B,
) -> Result<Initial<B::Tensor>, BackendError> {
    let has_embedding = held.iter().any(|s| segments[*s as usize].has_embedding());
    let mut params: ParamMap<B::Tensor> = ParamMap::new();
    let mut norm_ids = Vec::new();
    let mut decay = ParamMap::new();
    let mut tp_pieces = ParamMap::new();
    for &s in held {
        let spread = spreads.experts.contains_key(&s);
        let tp_rank = spreads.tensor.get(&s).map(|(_, r)| *r);
        for p in params_here(cfg, table, &segments[s as usize], spreads) {
            let id = p.id;
            if table.entry(id).decays() {
                decay.insert(id, ());
            }
            if !params.contains(id) {
                let full = init::param_values(table, id, cfg.layers, seed);
                let mine = match &p.piece {
                    Some(pc) => pc.take(&full),
                    None => full,
                };
                params.insert(id, b.upload(mine)?);
            }
            // Replicated tensors count in the norm on their first
            // replica (of a tensor-parallel mesh, rank 0 of the first
            // replica's group); spread experts and tensor-parallel
            // slices on every device holding them (of the first replica).
            // (Of a sequence split, rank 0 of the first replica's group
            // too, for what every rank holds whole.)
            let seq_rank = spreads.sequences.get(&s).map_or(0, |q| q.rank);
            let first_replica =
                replica.get(&s) == Some(&0) && (seq_rank == 0 || table.expert_of(id).is_some());
            let first = match tp_rank {
                Some(r) => first_replica && (r == 0 || p.piece.is_some()),
                None => first_replica || (spread && table.expert_of(id).is_some()),
            };
            if let Some(pc) = p.piece {
                tp_pieces.insert(id, pc);
            }
            let counts = first && (id != table.wte || has_embedding);
            if counts && !norm_ids.contains(&id) {
                norm_ids.push(id);
            }
        }
    }
    Ok(Initial {
        params,
        norm_ids,
        decay,
        tp_pieces,
    })
}

impl<B: Backend> Device<B> {
    pub(crate) fn new(
        cfg: &ModelConfig,
        table: Arc<ParamTable>,
        segments: &[Segment],
        plan: &DevicePlan,
        opts: &TrainOptions,
        b: B,
    ) -> Result<Self, RuntimeError> {
        let setup = |e: BackendError| RuntimeError::Backend {
            device: plan.device,
            op: "setup".into(),
            backend: b.name(),
            cause: e.to_string(),
        };
        let ops = || plan.streams.iter().flat_map(|s| s.ops.iter());
        let Held {
            segments: held,
            replica,
            spreads,
        } = held_and_spreads(plan)?;
        let has_embedding = held.iter().any(|s| segments[*s as usize].has_embedding());
        let Initial {
            mut params,
            mut norm_ids,
            decay,
            tp_pieces,
        } = initial_params(
            cfg,
            &table,
            segments,
            (&held, &replica, &spreads),
            opts.seed,
            &b,
        )
        .map_err(setup)?;
        let owned: BTreeMap<u32, Vec<ParamId>> = held
            .iter()
            .map(|&s| {
                let mut ids = owned_ids(cfg, &table, segments, &held, &spreads, s);
                ids.sort();
                (s, ids)
            })
            .collect();
        // Parameter copies (DualPipe): the first device of each copy group
        // counts the reduced gradient in the norm, the others do not.
        let mut other_copy = BTreeSet::new();
        for op in ops() {
            let Act::Collective {
                what: Collective::CopyGrad,
                group,
            } = &op.act
            else {
                continue;
            };
            if group.first() != Some(&plan.device) {
                other_copy.extend(op.segments.iter().copied());
                for s in op.segments.iter() {
                    for id in owned.get(s).into_iter().flatten() {
                        norm_ids.retain(|x| x != id);
                    }
                }
            }
        }
        let zeros = |p: &ParamMap<B::Tensor>| -> Result<ParamMap<B::Tensor>, RuntimeError> {
            p.iter()
                .map(|(id, t)| Ok((id, b.zeros(B::len(t)).map_err(setup)?)))
                .collect()
        };
        let mut grads = zeros(&params)?;
        let (mut m, mut v) = (zeros(&params)?, zeros(&params)?);
        let buckets = zero::layout(
            &table,
            &b,
            plan,
            &owned,
            &spreads,
            zero::States {
                params: &mut params,
                grads: &mut grads,
                m: &mut m,
                v: &mut v,
                norm_ids: &mut norm_ids,
            },
        )
        .map_err(setup)?;
        let bytes = |t: &ParamMap<B::Tensor>| t.iter().map(|(_, x)| B::bytes(x)).sum::<u64>();
        let state_bytes =
            bytes(&params) + bytes(&grads) + bytes(&m) + bytes(&v) + zero::shard_bytes(&buckets);
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
        let has_norm_op = ops().any(|o| {
            matches!(
                o.act,
                Act::Collective {
                    what: Collective::GradNorm,
                    ..
                }
            )
        });
        let streams = plan
            .streams
            .iter()
            .map(|_| b.stream())
            .collect::<Result<Vec<_>, _>>()
            .map_err(setup)?;
        Ok(Device {
            id: plan.device,
            table,
            grads: Mutex::new(grads),
            moments: Mutex::new((m, v)),
            params: RwLock::new(params),
            buckets: Mutex::new(buckets),
            spreads,
            owned,
            tp_pieces,
            other_copy,
            has_embedding,
            bufs: Mutex::new(Buffers::default()),
            state: Mutex::new(StepState::default()),
            norm_ids,
            decay,
            has_norm_op,
            state_bytes,
            cap: opts.device_memory,
            streams,
            progress: Mutex::new(vec![0; plan.streams.len()]),
            waited: super::step::waited_ops(plan),
            eval_waited: Default::default(),
            marks: Mutex::new(HashMap::new()),
            cv: Condvar::new(),
            captured: Mutex::new(ParamMap::new()),
            captured_shards: Mutex::new(HashMap::new()),
            events: Mutex::new(Vec::new()),
            b,
        })
    }

    /// The step's figures; reads the loss terms (the step's one read of
    /// them) and leaves none behind.
    pub(crate) fn stats(&self) -> Result<DeviceStats, RuntimeError> {
        let mut s = self.state.lock().unwrap();
        let mut loss = 0.0f64;
        for terms in std::mem::take(&mut s.losses) {
            if terms.is_empty() {
                continue;
            }
            let mut l = 0.0f64;
            for t in terms {
                l += self
                    .b
                    .read_scalar(t)
                    .map_err(|e| self.read_error("the loss", e))?;
            }
            loss += l;
        }
        Ok(DeviceStats {
            loss,
            grad_norm: s.grad_norm,
            moe_routed: s.moe_routed,
            moe_dropped: s.moe_dropped,
        })
    }

    /// A failed read of the device's state, naming what was read.
    pub(super) fn read_error(&self, what: &str, e: BackendError) -> RuntimeError {
        RuntimeError::Backend {
            device: self.id,
            op: format!("reading {what}"),
            backend: self.b.name(),
            cause: e.to_string(),
        }
    }
    pub(crate) fn peak_bytes(&self) -> u64 {
        self.state_bytes + self.bufs.lock().unwrap().peak
    }
    pub(crate) fn state_bytes(&self) -> u64 {
        self.state_bytes
    }

    /// Host copies of the whole tensors of one kind of state (parameters,
    /// captured gradients, moments): tensor-parallel slices leave as
    /// [`Device::tp_shards`].
    fn whole(&self, t: &ParamMap<B::Tensor>) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        let mut out = ParamMap::new();
        for (id, v) in t.iter().filter(|(id, _)| !self.tp_pieces.contains(*id)) {
            let host = self
                .b
                .download(v)
                .map_err(|e| self.read_error(self.table.name(id), e))?;
            out.insert(id, host);
        }
        Ok(out)
    }
    pub(crate) fn params(&self) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        self.whole(&self.params.read().unwrap())
    }
    pub(crate) fn captured(&self) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        self.whole(&self.captured.lock().unwrap())
    }
    pub(crate) fn first_moments(&self) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        self.whole(&self.moments.lock().unwrap().0)
    }
    pub(crate) fn second_moments(&self) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        self.whole(&self.moments.lock().unwrap().1)
    }

    /// This device's tensor-parallel slices of one kind of state, as pieces
    /// of the full tensors (put back together with ZeRO's shards).
    pub(crate) fn tp_shards(
        &self,
        part: zero::ShardPart,
    ) -> Result<Vec<zero::Shard>, RuntimeError> {
        if self.tp_pieces.is_empty() {
            return Ok(Vec::new());
        }
        let (params, captured, moments);
        let t: &ParamMap<B::Tensor> = match part {
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
        for (id, piece) in self.tp_pieces.iter() {
            let Some(values) = t.get(id) else { continue };
            let values = self
                .b
                .download(values)
                .map_err(|e| self.read_error(self.table.name(id), e))?;
            let mut at = 0;
            for r in &piece.ranges {
                out.push(zero::Shard {
                    names: vec![(id, piece.total)],
                    total: piece.total,
                    range: r.clone(),
                    values: values[at..at + r.len()].to_vec(),
                });
                at += r.len();
            }
        }
        Ok(out)
    }
    /// The first tensor of this device holding a NaN or infinite value:
    /// of its parameters (whole, ZeRO-3 shard, tensor-parallel slice), or
    /// with `grads` of its gradients (whole, ZeRO-2/3 reduced shard).
    pub(crate) fn non_finite(&self, grads: bool) -> Result<Option<String>, RuntimeError> {
        let in_whole = |t: &ParamMap<Vec<f32>>| {
            t.iter()
                .find(|(_, v)| v.iter().any(|x| !x.is_finite()))
                .map(|(id, _)| self.table.name(id).to_string())
        };
        let in_shards = |shards: &[zero::Shard]| {
            shards.iter().find_map(|s| {
                let i = s.values.iter().position(|x| !x.is_finite())?;
                let flat = s.range.start + i;
                let mut at = 0;
                s.names.iter().find_map(|(id, len)| {
                    let hit = (at..at + len).contains(&flat);
                    at += len;
                    hit.then(|| self.table.name(*id).to_string())
                })
            })
        };
        if !grads {
            let params = self.params()?;
            let mut shards = self.shards(zero::ShardPart::Param)?;
            shards.extend(self.tp_shards(zero::ShardPart::Param)?);
            return Ok(in_whole(&params)
                .or_else(|| in_shards(&shards))
                .map(|n| format!("parameter `{n}`")));
        }
        let grads = self.whole(&self.grads.lock().unwrap())?;
        let buckets = self.buckets.lock().unwrap();
        let mut shards = Vec::new();
        for b in buckets.iter().filter(|b| b.zero >= 2) {
            let values = self
                .b
                .download(&b.grad)
                .map_err(|e| self.read_error("a ZeRO gradient shard", e))?;
            shards.push(zero::Shard {
                names: b.names.clone(),
                total: b.total,
                range: b.shard.clone(),
                values,
            });
        }
        Ok(in_whole(&grads)
            .or_else(|| in_shards(&shards))
            .map(|n| format!("the gradient of `{n}`")))
    }
    pub(crate) fn events(&self) -> Vec<TraceEvent> {
        self.events.lock().unwrap().clone()
    }

    /// Take the tensors of this device's parameters from full host tensors
    /// (a checkpoint's, by id): whole tensors, and this device's slice of
    /// each ZeRO bucket (parameters for ZeRO-3, AdamW moments for every
    /// stage).
    pub(crate) fn restore(&self, ck: &zero::HostStates) -> Result<(), RuntimeError> {
        self.restore_shards(ck)?;
        let mut params = self.params.write().unwrap();
        let mut mom = self.moments.lock().unwrap();
        let wrong = |id: ParamId, got: usize| {
            RuntimeError::Plan(format!(
                "device {}: the checkpoint's {} has {got} values, which does not fit this device's tensor",
                self.id,
                self.table.name(id)
            ))
        };
        // A tensor-parallel slice takes its part of the full tensor; sizes
        // are checked, never assumed.
        let take = |id: ParamId, dst: &mut B::Tensor, full: &Vec<f32>| {
            let mine = match self.tp_pieces.get(id) {
                Some(piece) if full.len() == piece.total => piece.take(full),
                Some(_) => return Err(wrong(id, full.len())),
                None => full.clone(),
            };
            if mine.len() != B::len(dst) {
                return Err(wrong(id, full.len()));
            }
            self.b.write(dst, 0, &mine);
            Ok(())
        };
        for (id, p) in params.iter_mut() {
            if let Some(x) = ck.params.get(id) {
                take(id, p, x)?;
            }
            // Sharded parameters keep their moments in their bucket.
            if let (Some(x), Some(mm)) = (ck.m.get(id), mom.0.get_mut(id)) {
                take(id, mm, x)?;
            }
            if let (Some(x), Some(vv)) = (ck.v.get(id), mom.1.get_mut(id)) {
                take(id, vv, x)?;
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
        *self.state.lock().unwrap() = StepState::default();
        self.marks.lock().unwrap().clear();
        let mut p = self.progress.lock().unwrap();
        p.iter_mut().for_each(|x| *x = 0);
    }
}
