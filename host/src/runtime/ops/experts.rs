//! Split expert passes (`shard` on a stream of its own): each phase of an
//! expert segment's forward and backward runs as its own op, and the
//! all-to-all between two phases as a comm op on the shard's stream, so the
//! exchange can overlap another microbatch's compute. The arithmetic is
//! `moe.rs`'s phase by phase, so a split pass computes what the whole one
//! does, bit for bit.

use super::compute::{context_sum, rows_of, with_params};
use super::StepCtx;
use super::{comm_error, missing};
use crate::compile::plan::{ExpertPhase, Op, OpKind, TensorKind};
use crate::dag::Pass;
use crate::model::Part;
use crate::runtime::backend::{Backend, BackendError, ParamMap};
use crate::runtime::buffers::{Buf, MoePart};
use crate::runtime::comm::packed;
use crate::runtime::device::{params_here, Device};
use crate::runtime::error::{label, RuntimeError};
use crate::runtime::model::moe::{ExpertGroup, MoeCache, MoeDims};
use crate::runtime::model::segment::{PartCache, PartStash};
use crate::runtime::model::{ContextSum, Dims, Model, SegmentCache, SegmentStash};
use std::sync::Arc;

/// The all-to-all between two phases: this device's chunk for each member
/// out, each member's chunk for this device in.
pub(super) fn all_to_all<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    group: &[u32],
) -> Result<(), RuntimeError> {
    let chunks = received(dev, op, "the rows to exchange")?;
    // Staging: what leaves and what arrives.
    let bytes: u64 = chunks.iter().map(|c| B::bytes(c)).sum();
    let _staging = dev.bufs.reserve(op, bytes.saturating_mul(2))?;
    let host = chunks
        .into_iter()
        .map(|c| dev.b.download_owned(c))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| dev.backend_error(op, e))?;
    // On the wire and held in the activation dtype.
    let got = packed::all_to_all(
        ctx.comm,
        ("expert all-to-all", op.node),
        group,
        dev.id,
        host,
        dev.act,
    )
    .map_err(|e| comm_error(dev, op, e))?;
    let got = got
        .into_iter()
        .map(|c| dev.b.upload_as(c, dev.act))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| dev.backend_error(op, e))?;
    dev.bufs
        .put(op, TensorKind::Routed, Buf::Moe(MoePart::Chunks(got)))
}

/// A plan that asks for what an expert phase cannot do.
fn plan_error<B: Backend>(dev: &Device<B>, op: &Op, m: &str) -> RuntimeError {
    RuntimeError::Plan(format!("device {}: {}: {m}", dev.id, label(op)))
}

/// Rows for (or from) each member, as a buffer.
fn chunks<B: Backend>(v: Vec<B::Tensor>) -> Buf<B> {
    Buf::Moe(MoePart::Chunks(v))
}

/// The rows the all-to-all before this phase delivered (moved out when
/// this is their last reader, copied otherwise).
fn received<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    what: &str,
) -> Result<Vec<B::Tensor>, RuntimeError> {
    let b = dev
        .bufs
        .take(op, TensorKind::Routed)?
        .ok_or_else(|| missing(dev, op, what))?;
    match Arc::try_unwrap(b) {
        Ok(Buf::Moe(MoePart::Chunks(c))) => Ok(c),
        Ok(_) => Err(plan_error(dev, op, "the exchanged rows are not rows")),
        Err(shared) => match &*shared {
            Buf::Moe(MoePart::Chunks(c)) => c
                .iter()
                .map(|t| dev.b.duplicate(t))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| dev.backend_error(op, e)),
            _ => Err(plan_error(dev, op, "the exchanged rows are not rows")),
        },
    }
}

/// One phase of a split expert pass.
pub(super) fn phase<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    pass: Pass,
    ctx: &StepCtx<B>,
) -> Result<(), RuntimeError> {
    let s = op.segments[0];
    let seg = &ctx.segments[s as usize];
    let plan_error = |m: &str| plan_error(dev, op, m);
    let (Some(&Part::Experts(l)), Some(moe)) = (seg.parts.first(), ctx.cfg.moe.as_ref()) else {
        return Err(plan_error("an expert phase on a segment without experts"));
    };
    let group = dev
        .spreads
        .experts
        .get(&s)
        .copied()
        .unwrap_or(ExpertGroup::ALONE);
    let b = rows_of(op, ctx.batch.b).len();
    let cp = op.cp.max(1) as usize;
    let dims = Dims::new(ctx.cfg, b).with_context(cp, op.replica as usize % cp, op.cp_ring);
    let d = MoeDims::new(moe, dims.n(), dims.t, dims.c).of_sequences(dims.seq);
    let model = Model::new(&dev.b, &dev.table).with_act(dev.act);
    let fail = |e: BackendError| dev.backend_error(op, e);
    let phase = op.phase.ok_or_else(|| plan_error("no phase"))?;
    match (pass, phase) {
        (Pass::F, ExpertPhase::Dispatch) => {
            let x = dev
                .tensor_of(op, dev.bufs.take(op, TensorKind::Activation)?)?
                .ok_or_else(|| missing(dev, op, "the input activation"))?;
            let mut sum = context_sum(dev, op, ctx);
            let sum = sum.as_mut().map(|c| c as &mut ContextSum<'_>);
            let (routed, out) = with_params(dev, op, |p| {
                model
                    .moe_dispatch(p, l, moe, x, d, group, sum)
                    .map_err(fail)
            })?;
            {
                let mut st = dev.state.lock().unwrap();
                st.moe_routed += routed.routing.choice.len() as u64;
                st.moe_dropped += routed.routing.dropped;
            }
            dev.bufs.put(op, TensorKind::Routed, chunks(out))?;
            dev.bufs.put(
                op,
                TensorKind::Saved,
                Buf::Moe(MoePart::Routed(Box::new(routed))),
            )
        }
        (Pass::F, ExpertPhase::Experts) => {
            let got = received(dev, op, "the exchanged rows")?;
            let (experts, back) = with_params(dev, op, |p| {
                model.moe_experts(p, l, d, group, &got).map_err(fail)
            })?;
            drop(got);
            dev.bufs.put(op, TensorKind::Routed, chunks(back))?;
            dev.bufs
                .put(op, TensorKind::Saved, Buf::Moe(MoePart::Experts(experts)))
        }
        (Pass::F, ExpertPhase::Combine) => {
            let got = received(dev, op, "the exchanged rows")?;
            let (mut routed, mut experts) = (None, None);
            for buf in dev.bufs.take_all(op, TensorKind::Saved)? {
                match Arc::try_unwrap(buf) {
                    Ok(Buf::Moe(MoePart::Routed(r))) => routed = Some(*r),
                    Ok(Buf::Moe(MoePart::Experts(e))) => experts = Some(e),
                    _ => {
                        return Err(plan_error(
                            "a combine reads the dispatch's and the experts' tensors, once",
                        ))
                    }
                }
            }
            let (Some(routed), Some(experts)) = (routed, experts) else {
                return Err(missing(dev, op, "the dispatch's and the experts' tensors"));
            };
            let (out, cache, aux) = model.moe_combine(routed, experts, got).map_err(fail)?;
            dev.state
                .lock()
                .unwrap()
                .losses
                .push(vec![dev.b.scalar(aux)]);
            dev.bufs.put(op, TensorKind::Activation, Buf::Tensor(out))?;
            let cache = SegmentCache {
                dims: Dims {
                    moe: Some(*moe),
                    ..dims
                },
                parts: vec![PartCache::Experts(Box::new(cache))],
            };
            dev.bufs.put(op, TensorKind::Saved, Buf::Saved(cache))
        }
        (Pass::B | Pass::BI, p) => {
            let saved = dev
                .bufs
                .take(op, TensorKind::Saved)?
                .ok_or_else(|| missing(dev, op, "the forward's saved tensors"))?;
            backward_phase(dev, op, ctx, p, saved)
        }
        _ => Err(plan_error("no such expert phase")),
    }
}

/// The expert half's cache inside a forward's saved tensors.
fn moe_cache<'a, B: Backend>(
    dev: &Device<B>,
    op: &Op,
    saved: &'a Buf<B>,
) -> Result<&'a MoeCache<B>, RuntimeError> {
    match saved {
        Buf::Saved(SegmentCache { parts, .. }) => match parts.first() {
            Some(PartCache::Experts(m)) => Ok(m),
            _ => Err(plan_error(
                dev,
                op,
                "the saved tensors are not an expert half's",
            )),
        },
        _ => Err(plan_error(
            dev,
            op,
            "the saved tensors are not a forward cache",
        )),
    }
}

/// One backward phase (`B` computes weight gradients on the way, `BI`
/// hands them to `BW`).
fn backward_phase<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    phase: ExpertPhase,
    saved: Arc<Buf<B>>,
) -> Result<(), RuntimeError> {
    let plan_error = |m: &str| plan_error(dev, op, m);
    let fail = |e: BackendError| dev.backend_error(op, e);
    let model = Model::new(&dev.b, &dev.table).with_act(dev.act);
    let fused = op.kind() == OpKind::B;
    let cache = moe_cache(dev, op, &saved)?;
    match phase {
        ExpertPhase::Combine => {
            let dout = dev
                .tensor_of(op, dev.bufs.take(op, TensorKind::ActGrad)?)?
                .ok_or_else(|| missing(dev, op, "the output gradient"))?;
            let (combined, out) = model.moe_back_combine(cache, dout).map_err(fail)?;
            dev.bufs.put(op, TensorKind::Routed, chunks(out))?;
            dev.bufs
                .put(op, TensorKind::Stash, Buf::Moe(MoePart::Combined(combined)))
        }
        ExpertPhase::Experts => {
            let got = received(dev, op, "the exchanged rows")?;
            let (grads, back) = with_params(dev, op, |p| {
                model.moe_back_experts(p, cache, &got).map_err(fail)
            })?;
            drop(got);
            dev.bufs.put(op, TensorKind::Routed, chunks(back))?;
            if fused {
                model
                    .moe_experts_weight(&mut dev.states.grads(), cache, &grads.dy, &grads.dfc)
                    .map_err(fail)
            } else {
                dev.bufs
                    .put(op, TensorKind::Stash, Buf::Moe(MoePart::Grads(grads)))
            }
        }
        ExpertPhase::Dispatch => {
            let got = received(dev, op, "the exchanged rows")?;
            let (mut combined, mut grads) = (None, None);
            for buf in dev.bufs.take_all(op, TensorKind::Stash)? {
                match Arc::try_unwrap(buf) {
                    Ok(Buf::Moe(MoePart::Combined(c))) => combined = Some(c),
                    Ok(Buf::Moe(MoePart::Grads(g))) => grads = Some(g),
                    _ => {
                        return Err(plan_error(
                            "a dispatch reads the combine's and the experts' gradients, once",
                        ))
                    }
                }
            }
            let combined = combined.ok_or_else(|| missing(dev, op, "the combine's gradients"))?;
            let (dx, mut stash) = with_params(dev, op, |p| {
                model
                    .moe_back_dispatch(p, cache, combined, &got, ctx.loss_scale)
                    .map_err(fail)
            })?;
            drop(got);
            if fused && op.zero >= 2 {
                // ZeRO-2/3: the replicated router and norm's gradients of
                // this microbatch go to its reduce-scatter (the experts'
                // accumulated in place in the experts phase).
                let seg = &ctx.segments[op.segments[0] as usize];
                let mut t: ParamMap<B::Tensor> = ParamMap::new();
                for p in params_here(ctx.cfg, &dev.table, seg, &dev.spreads) {
                    if dev.table.expert_of(p.id).is_none() {
                        let len = dev.table.entry(p.id).numel();
                        t.insert(p.id, dev.b.zeros_as(len, dev.grad).map_err(fail)?);
                    }
                }
                model
                    .moe_router_weight(&mut t, cache, &stash)
                    .map_err(fail)?;
                dev.bufs.put(op, TensorKind::MicroGrad, Buf::Params(t))?;
            } else if fused {
                model
                    .moe_router_weight(&mut dev.states.grads(), cache, &stash)
                    .map_err(fail)?;
            } else {
                let g = grads.ok_or_else(|| missing(dev, op, "the experts' gradients"))?;
                stash.dy = g.dy;
                stash.dfc = g.dfc;
                let mut st = SegmentStash {
                    parts: vec![PartStash::Experts(Box::new(stash))],
                    kept: None,
                };
                // The dispatch is the saved tensors' last reader: they move
                // into the stash unless another op still holds them.
                let kept = match Arc::try_unwrap(saved) {
                    Ok(Buf::Saved(c)) => c,
                    Ok(_) => return Err(plan_error("the saved tensors are not a forward cache")),
                    Err(shared) => match &*shared {
                        Buf::Saved(c) => c.duplicate(&dev.b).map_err(fail)?,
                        _ => return Err(plan_error("the saved tensors are not a forward cache")),
                    },
                };
                st.keep_for_weights(kept);
                dev.bufs.put(op, TensorKind::Stash, Buf::Stash(st))?;
            }
            dev.bufs.put(op, TensorKind::ActGrad, Buf::Tensor(dx))
        }
    }
}
