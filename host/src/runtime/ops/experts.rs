//! Split expert passes (`shard` on a stream of its own): each phase of an
//! expert segment's forward and backward runs as its own op, and the
//! all-to-all between two phases as a comm op on the shard's stream, so the
//! exchange can overlap another microbatch's compute. The arithmetic is
//! `moe.rs`'s phase by phase, so a split pass computes what the whole one
//! does, bit for bit.

use super::compute::with_params;
use super::{comm_error, missing};
use crate::compile::plan::{ExpertPhase, Op, OpKind, TensorKind};
use crate::model::Part;
use crate::runtime::backend::cpu::gpt::{Dims, PartCache, PartStash, SegmentCache, SegmentStash};
use crate::runtime::backend::cpu::moe::{
    moe_back_combine, moe_back_dispatch, moe_back_experts, moe_combine, moe_dispatch, moe_experts,
    moe_experts_weight, moe_router_weight, ExpertGroup, MoeCache, MoeDims,
};
use crate::runtime::buffers::{vec_of, Buf, MoePart};
use crate::runtime::device::Device;
use crate::runtime::error::{label, RuntimeError};
use crate::runtime::step::StepCtx;
use std::sync::Arc;

/// The all-to-all between two phases: this device's chunk for each member
/// out, each member's chunk for this device in.
pub(super) fn all_to_all(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    group: &[u32],
) -> Result<(), RuntimeError> {
    let input = dev
        .take(op, TensorKind::Routed)?
        .ok_or_else(|| missing(dev, op, "the rows to exchange"))?;
    let chunks: Vec<Vec<f32>> = match &*input {
        Buf::Moe(MoePart::Chunks(c)) => c.iter().map(|v| (**v).clone()).collect(),
        _ => return Err(missing(dev, op, "the rows to exchange")),
    };
    drop(input);
    // Staging: what leaves and what arrives.
    let bytes: u64 = chunks.iter().map(|c| c.len() as u64 * 4).sum();
    let _staging = dev.reserve(op, bytes.saturating_mul(2))?;
    let got = ctx
        .comm
        .all_to_all("expert all-to-all", op.node, group, dev.id, chunks)
        .map_err(|e| comm_error(dev, op, e))?;
    dev.put(op, TensorKind::Routed, Buf::Moe(MoePart::Chunks(got)))
}

/// A plan that asks for what an expert phase cannot do.
fn plan_error(dev: &Device, op: &Op, m: &str) -> RuntimeError {
    RuntimeError::Plan(format!("device {}: {}: {m}", dev.id, label(op)))
}

/// An exchange whose rows do not fit the routing.
fn exchange_error(dev: &Device, op: &Op, cause: String) -> RuntimeError {
    RuntimeError::Exchange {
        device: dev.id,
        op: label(op),
        cause,
    }
}

/// Rows for (or from) each member, as a buffer.
fn chunks(v: Vec<Vec<f32>>) -> Buf {
    Buf::Moe(MoePart::Chunks(v.into_iter().map(Arc::new).collect()))
}

/// The rows the all-to-all before this phase delivered.
fn received(dev: &Device, op: &Op) -> Result<Vec<Arc<Vec<f32>>>, RuntimeError> {
    let b = dev
        .take(op, TensorKind::Routed)?
        .ok_or_else(|| missing(dev, op, "the exchanged rows"))?;
    match &*b {
        Buf::Moe(MoePart::Chunks(c)) => Ok(c.clone()),
        _ => Err(plan_error(dev, op, "the exchanged rows are not rows")),
    }
}

/// One phase of a split expert pass.
pub(super) fn phase(dev: &Device, op: &Op, ctx: &StepCtx) -> Result<(), RuntimeError> {
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
    let b = ctx.batch.b / op.batch_div.max(1) as usize;
    let dims = Dims::new(ctx.cfg, b);
    let d = MoeDims::new(moe, dims.n(), dims.t, dims.c);
    let fail = |cause| exchange_error(dev, op, cause);
    let phase = op.phase.ok_or_else(|| plan_error("no phase"))?;
    match (op.op, phase) {
        (OpKind::F, ExpertPhase::Dispatch) => {
            let x = vec_of(dev.take(op, TensorKind::Activation)?)
                .ok_or_else(|| missing(dev, op, "the input activation"))?;
            let (routed, out) = with_params(dev, op, |p| Ok(moe_dispatch(p, l, moe, x, d, group)))?;
            {
                let mut st = dev.state.lock().unwrap();
                st.moe_routed += routed.routing.choice.len() as u64;
                st.moe_dropped += routed.routing.dropped;
            }
            dev.put(op, TensorKind::Routed, chunks(out))?;
            dev.put(
                op,
                TensorKind::Saved,
                Buf::Moe(MoePart::Routed(Box::new(routed))),
            )
        }
        (OpKind::F, ExpertPhase::Experts) => {
            let got = received(dev, op)?;
            let (experts, back) = with_params(dev, op, |p| {
                moe_experts::<String>(p, l, d, group, &got).map_err(fail)
            })?;
            drop(got);
            dev.put(op, TensorKind::Routed, chunks(back))?;
            dev.put(op, TensorKind::Saved, Buf::Moe(MoePart::Experts(experts)))
        }
        (OpKind::F, ExpertPhase::Combine) => {
            let got = received(dev, op)?;
            let (mut routed, mut experts) = (None, None);
            for buf in dev.take_all(op, TensorKind::Saved)? {
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
            let (out, cache, aux) = moe_combine::<String>(routed, experts, got).map_err(fail)?;
            dev.state.lock().unwrap().loss += aux;
            dev.put(op, TensorKind::Activation, Buf::Vec(Arc::new(out)))?;
            let cache = SegmentCache {
                dims: Dims {
                    moe: Some(*moe),
                    ..dims
                },
                parts: vec![PartCache::Experts(Box::new(cache))],
            };
            dev.put(op, TensorKind::Saved, Buf::Saved(cache))
        }
        (OpKind::B | OpKind::BI, p) => {
            let saved = dev
                .take(op, TensorKind::Saved)?
                .ok_or_else(|| missing(dev, op, "the forward's saved tensors"))?;
            let cache = match &*saved {
                Buf::Saved(SegmentCache { parts, .. }) => match parts.first() {
                    Some(PartCache::Experts(m)) => m,
                    _ => return Err(plan_error("the saved tensors are not an expert half's")),
                },
                _ => return Err(plan_error("the saved tensors are not a forward cache")),
            };
            backward_phase(dev, op, ctx, p, cache, &saved)
        }
        _ => Err(plan_error("no such expert phase")),
    }
}

/// One backward phase (`B` computes weight gradients on the way, `BI`
/// hands them to `BW`).
fn backward_phase(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    phase: ExpertPhase,
    cache: &MoeCache,
    saved: &Arc<Buf>,
) -> Result<(), RuntimeError> {
    let plan_error = |m: &str| plan_error(dev, op, m);
    let fail = |cause| exchange_error(dev, op, cause);
    let fused = op.op == OpKind::B;
    if fused && op.zero >= 2 {
        return Err(plan_error("ZeRO-2/3 on a split expert pass"));
    }
    match phase {
        ExpertPhase::Combine => {
            let dout = vec_of(dev.take(op, TensorKind::ActGrad)?)
                .ok_or_else(|| missing(dev, op, "the output gradient"))?;
            let (combined, out) = moe_back_combine(cache, dout);
            dev.put(op, TensorKind::Routed, chunks(out))?;
            dev.put(op, TensorKind::Stash, Buf::Moe(MoePart::Combined(combined)))
        }
        ExpertPhase::Experts => {
            let got = received(dev, op)?;
            let (grads, back) = with_params(dev, op, |p| {
                moe_back_experts::<String>(p, cache, &got).map_err(fail)
            })?;
            drop(got);
            dev.put(op, TensorKind::Routed, chunks(back))?;
            if fused {
                moe_experts_weight(&mut dev.grads.lock().unwrap(), cache, &grads.dy, &grads.dfc);
                Ok(())
            } else {
                dev.put(op, TensorKind::Stash, Buf::Moe(MoePart::Grads(grads)))
            }
        }
        ExpertPhase::Dispatch => {
            let got = received(dev, op)?;
            let (mut combined, mut grads) = (None, None);
            for buf in dev.take_all(op, TensorKind::Stash)? {
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
                moe_back_dispatch::<String>(p, cache, combined, &got, ctx.loss_scale).map_err(fail)
            })?;
            drop(got);
            if fused {
                moe_router_weight(&mut dev.grads.lock().unwrap(), cache, &stash);
            } else {
                let g = grads.ok_or_else(|| missing(dev, op, "the experts' gradients"))?;
                stash.dy = g.dy;
                stash.dfc = g.dfc;
                let mut st = SegmentStash {
                    parts: vec![PartStash::Experts(Box::new(stash))],
                    kept: None,
                };
                let Buf::Saved(c) = &**saved else {
                    unreachable!("checked by the caller")
                };
                st.keep_for_weights(c.clone());
                dev.put(op, TensorKind::Stash, Buf::Stash(st))?;
            }
            dev.put(op, TensorKind::ActGrad, Buf::Vec(Arc::new(dx)))
        }
    }
}
