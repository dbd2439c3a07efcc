//! Compute ops through the CPU backend: a segment's forward (`F`), its
//! backward (`B`, or split into `BI` for the input gradient and `BW` for the
//! weight gradients), with ZeRO-3's gathered parameters when the plan
//! gathers them.

use super::missing;
use crate::compile::plan::{Op, OpKind, TensorKind};
use crate::model::Segment;
use crate::runtime::backend::cpu::gpt::{
    segment_backward_input_in, segment_backward_weight, segment_forward_in, Dims, Peers,
    SegmentCache, SegmentStash, Tensors,
};
use crate::runtime::buffers::{vec_of, Buf};
use crate::runtime::comm::in_op_key;
use crate::runtime::device::params_here;
use crate::runtime::device::Device;
use crate::runtime::error::label;
use crate::runtime::error::RuntimeError;
use crate::runtime::step::StepCtx;
use std::sync::Arc;

/// Run `f` with the parameters the op computes with: ZeRO-3's gathered
/// buffer when the plan gathers them, otherwise the device's own.
pub(super) fn with_params<R>(
    dev: &Device,
    op: &Op,
    f: impl FnOnce(&Tensors) -> Result<R, RuntimeError>,
) -> Result<R, RuntimeError> {
    let gathered = dev.take(op, TensorKind::Param)?;
    if let Some(Buf::Params(t)) = gathered.as_deref() {
        return f(t);
    }
    let own = dev.params.read().unwrap();
    f(&own)
}

/// Run `f` with the peers of a spread `op` (expert parallelism: its group's
/// all-to-all; tensor parallelism: its group's sum, both through the step's
/// `Comm`), or `None` when it runs alone.
fn with_peers<R>(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    f: impl FnOnce(Option<Peers<'_, '_>>) -> Result<R, String>,
) -> Result<R, RuntimeError> {
    let seg = op.segments[0];
    let fail = |cause: String| RuntimeError::Exchange {
        device: dev.id,
        op: label(op),
        cause,
    };
    let members = op.group.as_deref().unwrap_or(&[]);
    let key = |phase: u32| {
        in_op_key(op.node, phase).ok_or_else(|| {
            format!(
                "node {} or exchange {phase} past what in-op keys hold (nodes < 2^20, 1024 exchanges an op)",
                op.node
            )
        })
    };
    if let Some(group) = dev.spreads.experts.get(&seg).copied() {
        let mut exchange = |phase: u32, chunks: Vec<Vec<f32>>| {
            let what = [
                "dispatch",
                "combine",
                "gradient dispatch",
                "gradient combine",
            ][phase as usize % 4];
            ctx.comm
                .all_to_all(what, key(phase)?, members, dev.id, chunks)
                .map_err(|e| e.to_string())
        };
        let peers = Peers::Experts {
            group,
            exchange: &mut exchange,
        };
        return f(Some(peers)).map_err(fail);
    }
    if dev.spreads.tensor.contains_key(&seg) {
        let mut phase = 0u32;
        let mut reduce = |part: Vec<f32>| {
            let k = key(phase)?;
            phase += 1;
            ctx.comm
                .all_reduce("tensor-parallel all-reduce", k, members, dev.id, part)
                .map(Arc::unwrap_or_clone)
                .map_err(|e| e.to_string())
        };
        let peers = Peers::Tensor {
            reduce: &mut reduce,
        };
        return f(Some(peers)).map_err(fail);
    }
    f(None).map_err(fail)
}

pub(super) fn forward(dev: &Device, op: &Op, ctx: &StepCtx) -> Result<(), RuntimeError> {
    let seg = &ctx.segments[op.segments[0] as usize];
    let div = op.batch_div as usize;
    let b = ctx.batch.b / div;
    let dp = div / op.microbatches.max(1) as usize;
    let piece = op.microbatch as usize * dp + op.replica as usize;
    let (tokens, targets) = ctx.batch.rows(piece * b, b);
    let input = vec_of(dev.take(op, TensorKind::Activation)?);
    // A tensor-parallel member holds 1/tp of the heads and MLP units; the
    // cache keeps the shapes for backward.
    let dims = Dims {
        tp: dev
            .spreads
            .tensor
            .get(&op.segments[0])
            .map_or(1, |(t, _)| *t),
        ..Dims::new(ctx.cfg, b)
    };
    let (out, cache, loss) = with_params(dev, op, |params| {
        with_peers(dev, op, ctx, |peers| {
            segment_forward_in(
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
    let reports = dev
        .spreads
        .tensor
        .get(&op.segments[0])
        .is_none_or(|(_, r)| *r == 0);
    if reports {
        let mut s = dev.state.lock().unwrap();
        if let Some(l) = loss {
            s.loss += l;
        }
        s.moe_routed += routed;
        s.moe_dropped += dropped;
    }
    if let Some(out) = out {
        dev.put(op, TensorKind::Activation, Buf::Vec(Arc::new(out)))?;
    }
    dev.put(op, TensorKind::Saved, Buf::Saved(cache))
}

/// `B` (input and weight gradients) or `BI` (input gradient; hands the
/// weight pass its stash).
pub(super) fn backward_input(dev: &Device, op: &Op, ctx: &StepCtx) -> Result<(), RuntimeError> {
    let seg = &ctx.segments[op.segments[0] as usize];
    // Parameters first: the gathered buffer is an input like the others.
    let gathered = dev.take(op, TensorKind::Param)?;
    let saved = dev
        .take(op, TensorKind::Saved)?
        .ok_or_else(|| missing(dev, op, "the forward's saved tensors"))?;
    let Buf::Saved(cache) = &*saved else {
        unreachable!()
    };
    let dout = vec_of(dev.take(op, TensorKind::ActGrad)?);
    let run = |params: &Tensors| {
        with_peers(dev, op, ctx, |peers| {
            segment_backward_input_in(params, cache, dout, ctx.loss_scale, peers)
        })
    };
    let (dinp, mut stash) = match gathered.as_deref() {
        Some(Buf::Params(t)) => run(t)?,
        _ => run(&dev.params.read().unwrap())?,
    };
    if op.op == OpKind::B {
        weight_grads(dev, op, ctx, seg, cache, &stash)?;
    } else {
        // BI is the saved tensors' last reader: hand what BW needs on in
        // the stash, free the rest now.
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
    Ok(())
}

/// `BW`: the weight gradients from `BI`'s stash.
pub(super) fn backward_weight(dev: &Device, op: &Op, ctx: &StepCtx) -> Result<(), RuntimeError> {
    let seg = &ctx.segments[op.segments[0] as usize];
    // A gathered parameter buffer, if the plan feeds one, is consumed.
    drop(dev.take(op, TensorKind::Param)?);
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
    weight_grads(dev, op, ctx, seg, cache, stash)
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
        let mut t: Tensors = params_here(ctx.cfg, seg, &dev.spreads)
            .into_iter()
            .map(|p| (p.name, vec![0.0; p.shape.iter().product()]))
            .collect();
        segment_backward_weight(&mut t, cache, stash);
        dev.put(op, TensorKind::MicroGrad, Buf::Params(t))
    } else {
        segment_backward_weight(&mut dev.grads.lock().unwrap(), cache, stash);
        Ok(())
    }
}
