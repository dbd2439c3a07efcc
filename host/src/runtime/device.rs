//! One plan device: its model states (parameters, gradients, AdamW
//! moments, ZeRO buckets) for the segments its plan runs, as storage of its
//! backend indexed by parameter id; its buffers, streams and per-step
//! state; set up from the plan, restored from checkpoints.

use super::backend::{init, Backend, BackendError, ParamId, ParamMap};
use super::buffers::{Buf, Buffers};
use super::error::{label, RuntimeError};
use super::states::States;
use super::sync::StreamSync;
use super::trace::{Trace, TraceEvent};
use super::zero::{self, tensor_shards, HostStates, Shard, ShardPart};
use super::TrainOptions;
use crate::compile::human_bytes;
use crate::compile::plan::{Act, Collective, DevicePlan, Op, Spread};
use crate::model::params::ParamTable;
use crate::model::{Dtype, ModelConfig, Segment};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use super::spread::ExpertGroup;
pub(super) use super::spread::{
    owned_ids, params_here, ParamHere, SequenceSplit, Spreads, TpPiece,
};

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
    /// Parameters, gradients, moments, ZeRO buckets, captured gradients.
    pub(super) states: States<B>,
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
    pub(super) bufs: Buffers<B>,
    pub(super) state: Mutex<StepState<B>>,
    /// Gradients this device counts in the global norm.
    pub(super) norm_ids: Vec<ParamId>,
    /// Parameters that get weight decay (matrices and embeddings).
    pub(super) decay: ParamMap<()>,
    pub(super) has_norm_op: bool,
    /// Its streams and how they wait for each other.
    pub(super) sync: StreamSync<B>,
    pub(super) trace: Trace,
    /// The dtype activations and parameters are stored in.
    pub(super) act: Dtype,
    /// The dtype gradients are accumulated, held and reduced in (the
    /// precision policy's `reduce`).
    pub(super) grad: Dtype,
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
        let zeros =
            |p: &ParamMap<B::Tensor>, dtype: Dtype| -> Result<ParamMap<B::Tensor>, RuntimeError> {
                p.iter()
                    .map(|(id, t)| Ok((id, b.zeros_as(B::len(t), dtype).map_err(setup)?)))
                    .collect()
            };
        let grad = cfg.precision.reduce;
        let mut grads = zeros(&params, grad)?;
        let (mut m, mut v) = (zeros(&params, Dtype::F32)?, zeros(&params, Dtype::F32)?);
        // bf16 parameters: the kernels read a bf16 copy, the optimizer steps
        // the fp32 values they were made from (ZeRO shards those with the
        // moments).
        let act = cfg.precision.params;
        let mut master = match act {
            Dtype::F32 => ParamMap::new(),
            _ => {
                let master = std::mem::take(&mut params);
                params = (master.iter())
                    .map(|(id, t)| Ok((id, b.cast(t, act).map_err(setup)?)))
                    .collect::<Result<_, RuntimeError>>()?;
                master
            }
        };
        let buckets = zero::layout(
            &table,
            &b,
            plan,
            &owned,
            &spreads,
            zero::States {
                params: &mut params,
                master: &mut master,
                grads: &mut grads,
                m: &mut m,
                v: &mut v,
                norm_ids: &mut norm_ids,
                act,
                grad,
            },
        )
        .map_err(setup)?;
        let bytes = |t: &ParamMap<B::Tensor>| t.iter().map(|(_, x)| B::bytes(x)).sum::<u64>();
        let state_bytes = bytes(&params)
            + bytes(&master)
            + bytes(&grads)
            + bytes(&m)
            + bytes(&v)
            + zero::shard_bytes(&buckets);
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
        let sync = StreamSync::new(&b, plan).map_err(setup)?;
        Ok(Device {
            id: plan.device,
            table,
            states: States::new((params, master), grads, (m, v), buckets),
            act,
            grad,
            spreads,
            owned,
            tp_pieces,
            other_copy,
            has_embedding,
            bufs: Buffers::new(plan.device, opts.device_memory, state_bytes),
            state: Mutex::new(StepState::default()),
            norm_ids,
            decay,
            has_norm_op,
            sync,
            trace: Trace::default(),
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
        self.bufs.states() + self.bufs.peak()
    }
    pub(crate) fn state_bytes(&self) -> u64 {
        self.bufs.states()
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
    /// The parameters' values: the fp32 master weights where the kernels
    /// read a bf16 copy (what checkpoints, dumps and exports keep). Those
    /// ZeRO shards come as [`Device::shards`].
    pub(crate) fn params(&self) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        match self.act {
            Dtype::F32 => self.whole(&self.states.params()),
            _ => self.whole(&self.states.master()),
        }
    }
    pub(crate) fn captured(&self) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        self.whole(&self.states.captured())
    }
    pub(crate) fn first_moments(&self) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        self.whole(&self.states.moments().0)
    }
    pub(crate) fn second_moments(&self) -> Result<ParamMap<Vec<f32>>, RuntimeError> {
        self.whole(&self.states.moments().1)
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
        let (params, master, captured, moments);
        let t: &ParamMap<B::Tensor> = match part {
            // The master weights where the kernels read a bf16 copy.
            zero::ShardPart::Param => {
                master = self.states.master();
                params = self.states.params();
                match self.act {
                    Dtype::F32 => &params,
                    _ => &master,
                }
            }
            zero::ShardPart::Grad => {
                captured = self.states.captured();
                &captured
            }
            zero::ShardPart::M | zero::ShardPart::V => {
                moments = self.states.moments();
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
        let grads = self.whole(&self.states.grads())?;
        let buckets = self.states.buckets();
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
        self.trace.events()
    }

    /// Take the tensors of this device's parameters from full host tensors
    /// (a checkpoint's, by id): whole tensors, and this device's slice of
    /// each ZeRO bucket (parameters for ZeRO-3, AdamW moments for every
    /// stage).
    pub(crate) fn restore(&self, ck: &zero::HostStates) -> Result<(), RuntimeError> {
        self.restore_shards(ck)?;
        let mut params = self.states.params_mut();
        let mut master = self.states.master();
        let mut mom = self.states.moments();
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
            match (ck.params.get(id), master.get_mut(id)) {
                (Some(x), Some(w)) => {
                    take(id, w, x)?;
                    self.b.copy(p, 0, w, 0..B::len(w));
                }
                (Some(x), None) => take(id, p, x)?,
                (None, _) => {}
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
        self.bufs.reset(plan);
        *self.state.lock().unwrap() = StepState::default();
        self.sync.reset();
    }
}

impl<B: Backend> Device<B> {
    /// The tensor of a taken buffer: moved out when this was its last
    /// holder, a device copy otherwise.
    pub(super) fn tensor_of(
        &self,
        op: &Op,
        buf: Option<Arc<Buf<B>>>,
    ) -> Result<Option<B::Tensor>, RuntimeError> {
        let Some(buf) = buf else { return Ok(None) };
        let t = match Arc::try_unwrap(buf) {
            Ok(Buf::Tensor(t)) => t,
            Ok(_) => return Err(self.not_a_tensor(op)),
            Err(shared) => match &*shared {
                Buf::Tensor(t) => self.b.duplicate(t).map_err(|e| self.backend_error(op, e))?,
                _ => return Err(self.not_a_tensor(op)),
            },
        };
        Ok(Some(t))
    }

    fn not_a_tensor(&self, op: &Op) -> RuntimeError {
        RuntimeError::Plan(format!(
            "device {}: {}: an input the plan says is a tensor is not one",
            self.id,
            label(op)
        ))
    }

    /// A backend failure inside `op`, with the device, the op and (for a
    /// missing parameter) its name.
    pub(super) fn backend_error(&self, op: &Op, e: BackendError) -> RuntimeError {
        match e {
            BackendError::Exchange(cause) => RuntimeError::Exchange {
                device: self.id,
                op: label(op),
                cause,
            },
            BackendError::MissingParam(id) => RuntimeError::MissingInput {
                device: self.id,
                op: label(op),
                input: format!("parameter {}", self.table.name(id)),
            },
            other => RuntimeError::Backend {
                device: self.id,
                op: label(op),
                backend: self.b.name(),
                cause: other.to_string(),
            },
        }
    }
}

impl<B: Backend> Device<B> {
    /// One part of this device's ZeRO bucket shards: parameters (ZeRO-3;
    /// the fp32 master shard of bf16 parameters, every stage), AdamW
    /// moments or the last step's reduced gradients (when captured).
    pub(crate) fn shards(&self, part: ShardPart) -> Result<Vec<Shard>, RuntimeError> {
        let buckets = self.states.buckets();
        let captured = self.states.captured_shards();
        let mut out = Vec::new();
        for (i, b) in buckets.iter().enumerate() {
            let t = match (part, &b.master) {
                (ShardPart::Param, Some(w)) => w,
                (ShardPart::Param, None) if b.zero >= 3 => &b.param,
                (ShardPart::M, _) => &b.m,
                (ShardPart::V, _) => &b.v,
                (ShardPart::Grad, _) => match captured.get(&i) {
                    Some(g) => g,
                    None => continue,
                },
                _ => continue,
            };
            let values = self
                .b
                .download(t)
                .map_err(|e| self.read_error("a ZeRO shard", e))?;
            out.extend(tensor_shards(b, &values, &self.tp_pieces));
        }
        Ok(out)
    }

    /// Take this device's slice of each bucket from a checkpoint's full
    /// tensors: AdamW moments for every stage, parameters for ZeRO-3 and
    /// master weights of bf16 parameters.
    pub(super) fn restore_shards(&self, ck: &HostStates) -> Result<(), RuntimeError> {
        let mut buckets = self.states.buckets();
        for b in buckets.iter_mut() {
            let flat = |t: &ParamMap<Vec<f32>>, what: &str| -> Result<Vec<f32>, RuntimeError> {
                let mut v = Vec::with_capacity(b.total);
                for (n, len) in &b.names {
                    // A tensor-parallel slice is cut from the full tensor.
                    let total = self.tp_pieces.get(*n).map_or(*len, |p| p.total);
                    let x = t.get(*n).filter(|x| x.len() == total).ok_or_else(|| {
                        RuntimeError::Plan(format!(
                            "the checkpoint has no {what} `{}` of {total} values for device {}",
                            self.table.name(*n),
                            self.id
                        ))
                    })?;
                    match self.tp_pieces.get(*n) {
                        Some(p) => v.extend(p.take(x)),
                        None => v.extend_from_slice(x),
                    }
                }
                Ok(v[b.shard.clone()].to_vec())
            };
            let (m, v) = (flat(&ck.m, "first moment")?, flat(&ck.v, "second moment")?);
            self.b.write(&mut b.m, 0, &m);
            self.b.write(&mut b.v, 0, &v);
            if b.zero >= 3 || b.master.is_some() {
                let p = flat(&ck.params, "parameter")?;
                if let Some(w) = b.master.as_mut() {
                    self.b.write(w, 0, &p);
                }
                if b.zero >= 3 {
                    self.b.write(&mut b.param, 0, &p);
                }
            }
        }
        Ok(())
    }
}
