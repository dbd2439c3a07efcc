//! Compute ops: a segment's forward (`F`; `R` when `recompute` runs it again
//! before the backward), its backward (`B`, or split into `BI` for the input
//! gradient and `BW` for the weight gradients), with ZeRO-3's gathered
//! parameters when the plan gathers them.

use super::missing;
use super::StepCtx;
use crate::compile::plan::{Op, OpKind, TensorKind};
use crate::dag::Pass;
use crate::model::{Dtype, Segment};
use crate::runtime::backend::{Backend, BackendError, ParamMap, SeqRows};
use crate::runtime::buffers::Buf;
use crate::runtime::comm::{in_op_key, packed};
use crate::runtime::device::{params_here, Device, SequenceSplit};
use crate::runtime::error::RuntimeError;
use crate::runtime::model::{Coll, Dims, Model, Peers, SegmentCache, SegmentStash};
use std::sync::Arc;

/// Run `f` with the parameters the op computes with: ZeRO-3's gathered
/// buffer when the plan gathers them, otherwise the device's own.
pub(super) fn with_params<B: Backend, R>(
    dev: &Device<B>,
    op: &Op,
    f: impl FnOnce(&ParamMap<B::Tensor>) -> Result<R, RuntimeError>,
) -> Result<R, RuntimeError> {
    let gathered = dev.bufs.take(op, TensorKind::Param)?;
    if let Some(Buf::Params(t)) = gathered.as_deref() {
        return f(t);
    }
    let own = dev.states.params();
    f(&own)
}

/// Run `f` with the peers of a spread `op` (expert parallelism: its group's
/// all-to-all; tensor parallelism: its group's sum, both through the step's
/// `Comm`, on host copies), or `None` when it runs alone.
pub(super) fn with_peers<B: Backend, R>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    f: impl FnOnce(Option<Peers<'_, '_, B>>) -> Result<R, BackendError>,
) -> Result<R, RuntimeError> {
    let seg = op.segments[0];
    let fail = |e: BackendError| dev.backend_error(op, e);
    let members = op.group().map_or(&[][..], |g| &g[..]);
    let key = |phase: u32| in_op(op, phase);
    let b = &dev.b;
    let mut context_sum = context_sum(dev, op, ctx);
    let mut context_sum = context_sum
        .as_mut()
        .map(|c| c as &mut crate::runtime::model::ContextSum<'_>);
    if let Some(group) = dev.spreads.experts.get(&seg).copied() {
        let mut exchange = |phase: u32, chunks: Vec<B::Tensor>| {
            let what = [
                "dispatch",
                "combine",
                "gradient dispatch",
                "gradient combine",
            ][phase as usize % 4];
            let host = chunks
                .into_iter()
                .map(|c| b.download_owned(c))
                .collect::<Result<Vec<_>, _>>()?;
            let got = packed::all_to_all(
                ctx.comm,
                (what, key(phase)?),
                members,
                dev.id,
                host,
                dev.act,
            )
            .map_err(|e| BackendError::Exchange(e.to_string()))?;
            got.into_iter().map(|c| b.upload_as(c, dev.act)).collect()
        };
        let peers = Peers::Experts {
            group,
            exchange: &mut exchange,
            context: context_sum.take(),
        };
        return f(Some(peers)).map_err(fail);
    }
    let tensor = dev.spreads.tensor.get(&seg).copied();
    let context = op.context_group().filter(|_| op.cp > 1);
    if tensor.is_some() || context.is_some() {
        let rank = tensor.map_or(0, |(_, r)| r);
        // Context parallelism's shape: the replica's rows and the whole
        // sequence (each member holds its chunks of each).
        let (rows, seq) = (rows_of(op, ctx.batch.b).len(), ctx.cfg.seq_len as usize);
        let mut phase = 0u32;
        // The ring's sends not yet matched by a receive: (key, dtype).
        let mut ring: std::collections::VecDeque<(u32, Dtype)> = Default::default();
        // Sequence parallelism's overlapped exchanges: the key of the rows
        // posted last, and of the parts being sent (with this member's own).
        let mut posted: Option<(u32, Dtype)> = None;
        let mut parts: Option<(u32, Dtype, Option<Vec<f32>>)> = None;
        let mut reduce = |how: Coll, part: B::Tensor| {
            let exchange =
                |e: crate::runtime::comm::CommError| BackendError::Exchange(e.to_string());
            if let Coll::Post | Coll::Take(_) | Coll::Part(_) | Coll::Parts = how {
                let member = |m: usize| {
                    members.get(m).copied().ok_or_else(|| {
                        BackendError::Exchange(format!(
                            "member {m} of a tensor-parallel group of {}",
                            members.len()
                        ))
                    })
                };
                if members.get(rank) != Some(&dev.id) {
                    return Err(BackendError::Exchange(format!(
                        "device {} is not member {rank} of its tensor-parallel group {members:?}",
                        dev.id
                    )));
                }
                let comm = ctx.comm;
                match how {
                    Coll::Post => {
                        let dtype = B::dtype(&part);
                        phase += 1;
                        let k = key(phase - 1)?;
                        posted = Some((k, dtype));
                        let mine = b.download_owned(part)?;
                        // In ring order (the next member first), as the
                        // members take them (the previous one's first):
                        // on a shared link the rows arrive one after the
                        // other, each while the one before is multiplied.
                        for s in 1..members.len() {
                            let to = member((rank + s) % members.len())?;
                            packed::send(comm, k, (dev.id, to), mine.clone(), dtype)
                                .map_err(exchange)?;
                        }
                        return Ok(Default::default());
                    }
                    Coll::Take(m) => {
                        let (k, dtype) = posted.ok_or_else(|| {
                            BackendError::Exchange("rows taken before they were posted".into())
                        })?;
                        let what = "sequence-parallel rows";
                        let got = packed::recv(comm, k, (member(m)?, dev.id), what, dtype)
                            .map_err(exchange)?;
                        return b.upload_as(got, dtype);
                    }
                    Coll::Part(m) => {
                        let to = member(m)?;
                        let (k, dtype, own) = match &mut parts {
                            Some(p) => p,
                            None => {
                                phase += 1;
                                parts.insert((key(phase - 1)?, B::dtype(&part), None))
                            }
                        };
                        let mine = b.download_owned(part)?;
                        match to == dev.id {
                            true => *own = Some(mine),
                            false => packed::send(comm, *k, (dev.id, to), mine, *dtype)
                                .map_err(exchange)?,
                        }
                        return Ok(Default::default());
                    }
                    _ => {
                        let what = "sequence-parallel reduce-scatter";
                        let (k, dtype, own) = parts.take().ok_or_else(|| {
                            BackendError::Exchange("a sum of parts none was sent of".into())
                        })?;
                        let mut own = Some(own.ok_or_else(|| {
                            BackendError::Exchange("a sum of parts without this member's".into())
                        })?);
                        let mut got: Vec<(u32, Vec<f32>)> = Vec::with_capacity(members.len());
                        for from in members.iter().copied() {
                            let v = match own.take_if(|_| from == dev.id) {
                                Some(v) => v,
                                None => packed::recv(comm, k, (from, dev.id), what, dtype)
                                    .map_err(exchange)?,
                            };
                            got.push((from, v));
                        }
                        got.sort_by_key(|(d, _)| *d);
                        let sum = crate::runtime::comm::sum_in_device_order(
                            what,
                            k,
                            members,
                            got.iter().map(|(d, v)| (*d, &v[..])),
                        )
                        .map_err(exchange)?;
                        return b.upload_as(sum, dtype);
                    }
                }
            }
            if let Coll::ContextSend | Coll::ContextRecv = how {
                let cm = context.ok_or_else(|| {
                    BackendError::Exchange("context-parallel attention without its group".into())
                })?;
                let me = cm.iter().position(|d| *d == dev.id).ok_or_else(|| {
                    BackendError::Exchange(format!(
                        "device {} is not in its context-parallel group {cm:?}",
                        dev.id
                    ))
                })?;
                let (next, prev) = (cm[(me + 1) % cm.len()], cm[(me + cm.len() - 1) % cm.len()]);
                if how == Coll::ContextSend {
                    let dtype = B::dtype(&part);
                    phase += 1;
                    let k = key(phase - 1)?;
                    ring.push_back((k, dtype));
                    let mine = b.download_owned(part)?;
                    packed::send(ctx.comm, k, (dev.id, next), mine, dtype).map_err(exchange)?;
                    return Ok(Default::default());
                }
                let (k, dtype) = ring.pop_front().ok_or_else(|| {
                    BackendError::Exchange("a context-parallel ring receive before its send".into())
                })?;
                let what = "context-parallel ring block";
                let got =
                    packed::recv(ctx.comm, k, (prev, dev.id), what, dtype).map_err(exchange)?;
                return b.upload_as(got, dtype);
            }
            let context_coll = matches!(how, Coll::ContextGather | Coll::ContextScatter);
            if members.len() < 2 && !context_coll {
                // A context-parallel group alone: its tensor-parallel
                // collectives have one member.
                return Ok(part);
            }
            // On the wire and held in the member's tensor's dtype (summed
            // in fp32).
            let dtype = B::dtype(&part);
            let mine = b.download_owned(part)?;
            let mut next_key = || {
                phase += 1;
                key(phase - 1)
            };
            let comm = ctx.comm;
            let n = members.len();
            let out = match how {
                Coll::ContextSend
                | Coll::ContextRecv
                | Coll::Post
                | Coll::Take(_)
                | Coll::Part(_)
                | Coll::Parts => {
                    return Err(BackendError::Exchange("a ring step out of place".into()))
                }
                Coll::ContextGather | Coll::ContextScatter => {
                    let cm = context.ok_or_else(|| {
                        BackendError::Exchange(
                            "context-parallel attention without its group".into(),
                        )
                    })?;
                    let cp = cm.len();
                    let key = (
                        match how {
                            Coll::ContextGather => "context-parallel all-gather",
                            _ => "context-parallel reduce-scatter",
                        },
                        next_key()?,
                    );
                    let layout = ContextLayout { cp, rows, seq };
                    match how {
                        Coll::ContextGather => {
                            let lens = vec![mine.len(); cp];
                            let all = packed::all_gather(comm, key, cm, dev.id, mine, &lens, dtype)
                                .map_err(exchange)?;
                            layout.whole(&all)?
                        }
                        _ => {
                            let by_member = layout.by_member(&mine)?;
                            let lens = vec![mine.len() / cp; cp];
                            packed::reduce_scatter(comm, key, cm, dev.id, by_member, &lens, dtype)
                                .map_err(exchange)?
                        }
                    }
                }
                Coll::Shard => mine[rows_of_member(mine.len(), n, rank)?].to_vec(),
                Coll::Sum => {
                    let what = "tensor-parallel all-reduce";
                    // bf16 sums take two exchanges (see `comm::packed`).
                    let keys = match dtype {
                        Dtype::F32 => (next_key()?, 0),
                        _ => (next_key()?, next_key()?),
                    };
                    packed::all_reduce(comm, what, keys, members, dev.id, mine, dtype)
                        .map_err(exchange)?
                }
                Coll::Gather => {
                    let what = "sequence-parallel all-gather";
                    let lens = vec![mine.len(); n];
                    packed::all_gather(
                        comm,
                        (what, next_key()?),
                        members,
                        dev.id,
                        mine,
                        &lens,
                        dtype,
                    )
                    .map_err(exchange)?
                }
            };
            b.upload_as(out, dtype)
        };
        let peers = Peers::Tensor {
            reduce: &mut reduce,
            context: context_sum.take(),
        };
        return f(Some(peers)).map_err(fail);
    }
    f(None).map_err(fail)
}

/// A context-parallel op's sum over its group of host values (fp32, in
/// member order; see [`crate::runtime::model::ContextSum`]), or `None`
/// when the op holds whole sequences.
pub(super) fn context_sum<'a, B: Backend>(
    dev: &'a Device<B>,
    op: &'a Op,
    ctx: &'a StepCtx<B>,
) -> Option<impl FnMut(Vec<f32>) -> Result<Vec<f32>, BackendError> + 'a> {
    let group = op.context_group().filter(|_| op.cp > 1)?;
    let mut phase = CONTEXT_SUM;
    Some(move |mine: Vec<f32>| {
        let key = in_op(op, phase)?;
        phase += 1;
        let what = "context-parallel sequence statistics";
        packed::all_reduce(ctx.comm, what, (key, 0), group, dev.id, mine, Dtype::F32)
            .map_err(|e| BackendError::Exchange(e.to_string()))
    })
}

/// Member `rank`'s contiguous `1/size` of `len` values (sequence
/// parallelism's rows: the plan checked that the tokens divide).
fn rows_of_member(
    len: usize,
    size: usize,
    rank: usize,
) -> Result<std::ops::Range<usize>, BackendError> {
    if size == 0 || !len.is_multiple_of(size) {
        return Err(BackendError::Exchange(format!(
            "{len} values do not split over a sequence-parallel group of {size}"
        )));
    }
    let per = len / size;
    Ok(rank * per..(rank + 1) * per)
}

/// The rows of a global batch of `b` a forward op trains on: piece
/// `microbatch × DP degree + replica` of `batch_div` (a context-parallel
/// group of replicas shares one piece: `batch_div` counts its members).
pub(in crate::runtime) fn rows_of(op: &Op, b: usize) -> std::ops::Range<usize> {
    let cp = op.cp.max(1) as usize;
    let div = (op.batch_div as usize / cp).max(1);
    let rows = b / div;
    let dp = div / op.microbatches.max(1) as usize;
    let piece = op.microbatch as usize * dp + op.replica as usize / cp;
    piece * rows..(piece + 1) * rows
}

/// Context parallelism's layout of a tensor over its group: `cp` members
/// each holding `[rows, t, w]`, their chunks of `rows` sequences of `seq`
/// positions ([`SeqRows::balanced`]).
struct ContextLayout {
    cp: usize,
    rows: usize,
    seq: usize,
}

impl ContextLayout {
    /// Row width of a whole-sequence tensor (`[rows, seq, w]`, or the
    /// members' rows one after the other) of `len` values, checked.
    fn width(&self, len: usize) -> Result<usize, BackendError> {
        let cells = self.rows * self.seq;
        if cells == 0 || !len.is_multiple_of(cells) || !self.seq.is_multiple_of(2 * self.cp) {
            return Err(BackendError::Exchange(format!(
                "{len} values are not {} sequences of {} positions split over a context-parallel group of {}",
                self.rows, self.seq, self.cp
            )));
        }
        Ok(len / cells)
    }

    /// Every member's rows (`all`, the members' tensors one after the
    /// other) placed at their positions: `[rows, seq, w]`.
    fn whole(&self, all: &[f32]) -> Result<Vec<f32>, BackendError> {
        let w = self.width(all.len())?;
        let t = self.seq / self.cp;
        let mut out = vec![0.0; all.len()];
        for m in 0..self.cp {
            let held = SeqRows::balanced(self.seq, self.cp, m);
            let part = &all[m * self.rows * t * w..][..self.rows * t * w];
            for s in 0..self.rows {
                for r in 0..t {
                    let to = (s * self.seq + held.position(r)) * w;
                    out[to..to + w].copy_from_slice(&part[(s * t + r) * w..][..w]);
                }
            }
        }
        Ok(out)
    }

    /// A whole-sequence tensor `[rows, seq, w]` as the members' rows, one
    /// member after the other (what a reduce-scatter hands out).
    fn by_member(&self, whole: &[f32]) -> Result<Vec<f32>, BackendError> {
        let w = self.width(whole.len())?;
        let t = self.seq / self.cp;
        let mut out = Vec::with_capacity(whole.len());
        for m in 0..self.cp {
            let held = SeqRows::balanced(self.seq, self.cp, m);
            for s in 0..self.rows {
                for r in 0..t {
                    let from = (s * self.seq + held.position(r)) * w;
                    out.extend_from_slice(&whole[from..from + w]);
                }
            }
        }
        Ok(out)
    }
}

/// The tokens (or targets) a context-parallel member holds of `rows`
/// whole sequences of `seq`: its chunks of each ([`Dims::held_rows`]).
fn held_of(all: &[u32], dims: &Dims) -> Vec<u32> {
    dims.held_rows()
        .into_iter()
        .map(|r| all[r as usize])
        .collect()
}

/// `F`, or its recompute `R`: the same kernels on the same inputs (so the
/// same bits), whose saved tensors the backward reads. `R` reports no loss
/// or routing counts (its `F` did) and its output has no reader.
pub(super) fn forward<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
) -> Result<(), RuntimeError> {
    let seg = &ctx.segments[op.segments[0] as usize];
    let split = dev.spreads.sequences.get(&op.segments[0]);
    let mut rows = rows_of(op, ctx.batch.b);
    if let Some(q) = split {
        check_split(dev, op, q, rows.len())?;
        let mine = q.share(rows.len());
        rows = rows.start + mine.start..rows.start + mine.end;
    }
    let b = rows.len();
    let (tokens, targets) = ctx.batch.rows(rows.start, b).ok_or_else(|| {
        missing(
            dev,
            op,
            &format!("batch rows {rows:?} (not read by this process)"),
        )
    })?;
    let cp = op.cp.max(1) as usize;
    let mut input = dev.tensor_of(op, dev.bufs.take(op, TensorKind::Activation)?)?;
    if let Some(q) = split {
        input = input.map(|x| share_of(dev, op, q, x)).transpose()?;
    }
    // A tensor-parallel member holds 1/tp of the heads and MLP units; the
    // cache keeps the shapes for backward.
    let (tp, tp_rank) = dev
        .spreads
        .tensor
        .get(&op.segments[0])
        .map_or((1, 0), |(t, r)| (*t, *r));
    let dims = Dims {
        tp,
        tp_rank,
        sp: dev.spreads.sequence_parallel.contains(&op.segments[0]),
        ..Dims::new(ctx.cfg, b)
    }
    .with_context(cp, op.replica as usize % cp, op.cp_ring);
    let held;
    let (tokens, targets) = match dims.context() {
        true => {
            held = (held_of(tokens, &dims), held_of(targets, &dims));
            (&held.0[..], &held.1[..])
        }
        false => (tokens, targets),
    };
    let model = Model::new(&dev.b, &dev.table).with_act(dev.act);
    let (out, cache, loss) = with_params(dev, op, |params| {
        with_peers(dev, op, ctx, |peers| {
            model.forward(
                seg,
                params,
                seg.has_embedding().then_some(tokens),
                input,
                seg.has_head().then_some(targets),
                dims,
                peers,
            )
        })
    })?;
    let (routed, dropped) = cache.moe_counts();
    // A tensor-parallel group computes one loss: its first member reports it.
    let reports = op.kind() == OpKind::F
        && dev
            .spreads
            .tensor
            .get(&op.segments[0])
            .is_none_or(|(_, r)| *r == 0);
    if reports {
        let mut s = dev.state.lock().unwrap();
        s.losses.push(loss);
        s.moe_routed += routed;
        s.moe_dropped += dropped;
    }
    if let Some(mut out) = out {
        if let Some(q) = split {
            out = gather_shares(dev, op, ctx, q, out, GATHER)?;
        }
        dev.bufs.put(op, TensorKind::Activation, Buf::Tensor(out))?;
    }
    // A forward with a selective recompute hands it only what it keeps.
    if dev.bufs.reads(op, TensorKind::Kept) {
        return dev.bufs.put(op, TensorKind::Kept, Buf::Saved(cache.thin()));
    }
    dev.bufs.put(op, TensorKind::Saved, Buf::Saved(cache))
}

/// `R`: a full recompute runs the forward again ([`forward`]); a selective
/// one rebuilds the saved tensors from what its forward kept.
pub(super) fn recompute<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
) -> Result<(), RuntimeError> {
    if !op.inputs.iter().any(|i| i.tensor == TensorKind::Kept) {
        return forward(dev, op, ctx);
    }
    let what = "what the forward kept for its recompute";
    let kept = dev
        .bufs
        .take(op, TensorKind::Kept)?
        .ok_or_else(|| missing(dev, op, what))?;
    let cache = owned_cache(dev, op, kept, what)?;
    let model = Model::new(&dev.b, &dev.table).with_act(dev.act);
    let full = with_params(dev, op, |params| {
        with_peers(dev, op, ctx, |peers| model.rebuild(params, cache, peers))
    })?;
    dev.bufs.put(op, TensorKind::Saved, Buf::Saved(full))
}

/// A taken forward cache (`what`, for the error), owned: moved out when
/// this was its last holder, a device copy otherwise.
fn owned_cache<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    buf: Arc<Buf<B>>,
    what: &str,
) -> Result<SegmentCache<B>, RuntimeError> {
    match Arc::try_unwrap(buf) {
        Ok(Buf::Saved(c)) => Ok(c),
        Ok(_) => Err(missing(dev, op, what)),
        Err(shared) => match &*shared {
            Buf::Saved(c) => c.duplicate(&dev.b).map_err(|e| dev.backend_error(op, e)),
            _ => Err(missing(dev, op, what)),
        },
    }
}

/// `B` (input and weight gradients) or `BI` (input gradient; hands the
/// weight pass its stash).
pub(super) fn backward_input<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    pass: Pass,
    ctx: &StepCtx<B>,
) -> Result<(), RuntimeError> {
    let seg = &ctx.segments[op.segments[0] as usize];
    // Parameters first: the gathered buffer is an input like the others.
    let gathered = dev.bufs.take(op, TensorKind::Param)?;
    let saved = dev
        .bufs
        .take(op, TensorKind::Saved)?
        .ok_or_else(|| missing(dev, op, "the forward's saved tensors"))?;
    let Buf::Saved(cache) = &*saved else {
        return Err(missing(dev, op, "the forward's saved tensors"));
    };
    let mut dout = dev.tensor_of(op, dev.bufs.take(op, TensorKind::ActGrad)?)?;
    let split = dev.spreads.sequences.get(&op.segments[0]);
    if let Some(q) = split {
        dout = dout.map(|d| share_of(dev, op, q, d)).transpose()?;
    }
    let model = Model::new(&dev.b, &dev.table).with_act(dev.act);
    let run = |params: &ParamMap<B::Tensor>| {
        with_peers(dev, op, ctx, |peers| {
            model.backward_input(params, cache, dout, ctx.loss_scale, peers)
        })
    };
    let (dinp, mut stash) = match gathered.as_deref() {
        Some(Buf::Params(t)) => run(t)?,
        _ => run(&dev.states.params())?,
    };
    if pass == Pass::B {
        weight_grads(dev, op, ctx, seg, cache, &stash)?;
    } else {
        // BI is the saved tensors' last reader: hand what BW needs on in
        // the stash, free the rest now.
        let cache = owned_cache(dev, op, saved, "the forward's saved tensors")?;
        stash.keep_for_weights(cache);
        dev.bufs.put(op, TensorKind::Stash, Buf::Stash(stash))?;
    }
    if let Some(mut d) = dinp {
        if let Some(q) = split {
            d = gather_shares(dev, op, ctx, q, d, GATHER)?;
        }
        dev.bufs.put(op, TensorKind::ActGrad, Buf::Tensor(d))?;
    }
    Ok(())
}

/// In-op exchanges of a sequence split (after the experts' four).
const GATHER: u32 = 8;
/// A context-parallel group's sums of sequence statistics, counting up
/// (one per expert layer of the op).
const CONTEXT_SUM: u32 = 16;
/// Its gradient sum (two keys: a bf16 sum is two exchanges).
const GRAD_SUM: (u32, u32) = (9, 10);
/// Sequence parallelism's sum of the norms' gradients: the last in-op keys,
/// past the group's exchanges inside the segment (which count from 0).
const SP_GRAD_SUM: (u32, u32) = (1023, 1022);

/// A sequence split needs whole sequences on every rank.
fn check_split<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    q: &SequenceSplit,
    rows: usize,
) -> Result<(), RuntimeError> {
    if rows.is_multiple_of(q.tp) && rows > 0 {
        return Ok(());
    }
    Err(dev.backend_error(
        op,
        BackendError::Device(format!(
            "its {rows} sequences do not split over its tensor-parallel group {:?}",
            q.members
        )),
    ))
}

/// This rank's share of a tensor of whole sequences (`x` holds every
/// sequence of the replica's microbatch, one after the other).
fn share_of<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    q: &SequenceSplit,
    x: B::Tensor,
) -> Result<B::Tensor, RuntimeError> {
    let fail = |e| dev.backend_error(op, e);
    let dtype = B::dtype(&x);
    let all = dev.b.download_owned(x).map_err(fail)?;
    let mine = q.share(all.len());
    dev.b.upload_as(all[mine].to_vec(), dtype).map_err(fail)
}

/// Every rank's share, in rank order: the whole tensor again.
fn gather_shares<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    q: &SequenceSplit,
    x: B::Tensor,
    phase: u32,
) -> Result<B::Tensor, RuntimeError> {
    let fail = |e| dev.backend_error(op, e);
    let key = in_op(op, phase).map_err(fail)?;
    let dtype = B::dtype(&x);
    let mine = dev.b.download_owned(x).map_err(fail)?;
    let all = ctx
        .comm
        .all_gather("sequence-split all-gather", key, &q.members, dev.id, mine)
        .map_err(|e| fail(BackendError::Exchange(e.to_string())))?;
    dev.b
        .upload_as(Arc::unwrap_or_clone(all), dtype)
        .map_err(fail)
}

pub(super) fn in_op(op: &Op, phase: u32) -> Result<u32, BackendError> {
    in_op_key(op.node, phase).ok_or_else(|| {
        BackendError::Exchange(format!(
            "node {} or exchange {phase} past what in-op keys hold (nodes < 2^20, 1024 exchanges an op)",
            op.node
        ))
    })
}

/// `BW`: the weight gradients from `BI`'s stash.
pub(super) fn backward_weight<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
) -> Result<(), RuntimeError> {
    let seg = &ctx.segments[op.segments[0] as usize];
    // A gathered parameter buffer, if the plan feeds one, is consumed.
    drop(dev.bufs.take(op, TensorKind::Param)?);
    let stash = dev
        .bufs
        .take(op, TensorKind::Stash)?
        .ok_or_else(|| missing(dev, op, "BI's stash"))?;
    let Buf::Stash(stash) = &*stash else {
        return Err(missing(dev, op, "BI's stash"));
    };
    let cache = stash
        .kept
        .as_ref()
        .ok_or_else(|| missing(dev, op, "the forward tensors in BI's stash"))?;
    weight_grads(dev, op, ctx, seg, cache, stash)
}

/// Accumulate a backward's weight gradients: into the device's gradient
/// buffers, or (ZeRO-2/3) into a per-microbatch buffer its reduce-scatter reads.
fn weight_grads<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    seg: &Segment,
    cache: &SegmentCache<B>,
    stash: &SegmentStash<B>,
) -> Result<(), RuntimeError> {
    let model = Model::new(&dev.b, &dev.table).with_act(dev.act);
    let fail = |e| dev.backend_error(op, e);
    let split = dev.spreads.sequences.get(&seg.index);
    let sp = dev.spreads.sequence_parallel.contains(&seg.index);
    if op.zero < 2 && split.is_none() && !sp {
        return model
            .backward_weight(&mut dev.states.grads(), cache, stash)
            .map_err(fail);
    }
    // This microbatch's gradients on their own: ZeRO-2/3 reduce-scatters
    // them, a sequence split sums them over its group first.
    let mut t: ParamMap<B::Tensor> = ParamMap::new();
    for p in params_here(ctx.cfg, &dev.table, seg, &dev.spreads) {
        let len = local_len(dev, &p);
        t.insert(p.id, dev.b.zeros_as(len, dev.grad).map_err(fail)?);
    }
    model.backward_weight(&mut t, cache, stash).map_err(fail)?;
    keep_expert_grads(dev, seg, &mut t);
    if let Some(q) = split {
        t = sum_over_group(dev, op, ctx, &q.members, GRAD_SUM, &t)?;
    }
    if sp {
        // Each member's norms saw its rows only: their gradients are
        // summed over the group (the rest is its own slice, or whole).
        let norms: Vec<_> = (t.ids())
            .filter(|id| dev.table.entry(*id).role.is_block_norm())
            .collect();
        let mut mine = ParamMap::new();
        for id in norms {
            if let Some(g) = t.remove(id) {
                mine.insert(id, g);
            }
        }
        let members = op.group().map_or(&[][..], |g| &g[..]);
        for (id, g) in sum_over_group(dev, op, ctx, members, SP_GRAD_SUM, &mine)? {
            t.insert(id, g);
        }
    }
    if op.zero >= 2 {
        return dev.bufs.put(op, TensorKind::MicroGrad, Buf::Params(t));
    }
    let mut grads = dev.states.grads();
    for (id, g) in t.iter() {
        if let Some(mine) = grads.get_mut(id) {
            dev.b.add(mine, g);
        }
    }
    Ok(())
}

/// A sequence split's gradients of what every rank holds whole (router,
/// layernorm; the experts' stay where they live, each on one device of the
/// mesh), summed over the tensor-parallel group, as the data-parallel sync
/// then sums them over the replicas: one all-reduce of them all.
fn sum_over_group<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    members: &[u32],
    phases: (u32, u32),
    t: &ParamMap<B::Tensor>,
) -> Result<ParamMap<B::Tensor>, RuntimeError> {
    let fail = |e| dev.backend_error(op, e);
    let mut flat = Vec::new();
    let mut lens = Vec::new();
    for (id, g) in t.iter() {
        let v = dev.b.download(g).map_err(fail)?;
        lens.push((id, v.len()));
        flat.extend(v);
    }
    // In the gradients' dtype, as the data-parallel reduction after it.
    let keys = (
        in_op(op, phases.0).map_err(fail)?,
        in_op(op, phases.1).map_err(fail)?,
    );
    let what = "tensor-parallel gradient sum";
    let sum = packed::all_reduce(ctx.comm, what, keys, members, dev.id, flat, dev.grad)
        .map_err(|e| fail(BackendError::Exchange(e.to_string())))?;
    let mut at = 0;
    let mut summed: ParamMap<B::Tensor> = ParamMap::new();
    for (id, n) in lens {
        let part = sum.get(at..at + n).ok_or_else(|| {
            fail(BackendError::Exchange(format!(
                "the gradient sum over {:?} came back with {} values, not {}",
                members,
                sum.len(),
                at + n
            )))
        })?;
        let g = dev.b.upload_as(part.to_vec(), dev.grad).map_err(fail)?;
        summed.insert(id, g);
        at += n;
    }
    Ok(summed)
}

/// Experts spread by `shard` live on this device alone: under ZeRO-2/3
/// their gradients are not reduced but accumulate here, as without ZeRO;
/// they leave the microbatch's buffer for the reduce-scatter.
pub(super) fn keep_expert_grads<B: Backend>(
    dev: &Device<B>,
    seg: &Segment,
    t: &mut ParamMap<B::Tensor>,
) {
    if !dev.spreads.experts.contains_key(&seg.index) {
        return;
    }
    let experts: Vec<_> = (t.iter())
        .map(|(id, _)| id)
        .filter(|id| dev.table.expert_of(*id).is_some())
        .collect();
    let mut grads = dev.states.grads();
    for id in experts {
        if let (Some(g), Some(mine)) = (t.remove(id), grads.get_mut(id)) {
            dev.b.add(mine, &g);
        }
    }
}

/// Elements of a parameter as this device holds it (its tensor-parallel
/// slice, or whole).
fn local_len<B: Backend>(dev: &Device<B>, p: &crate::runtime::device::ParamHere) -> usize {
    match &p.piece {
        Some(pc) => pc.ranges.iter().map(|r| r.len()).sum(),
        None => dev.table.entry(p.id).numel(),
    }
}
