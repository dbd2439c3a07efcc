//! Gradient collectives: the global gradient norm (an all-reduce of Σ g²),
//! and the reductions of data parallelism (`grad-sync`), of the tied
//! embedding across stages (`tied-grad`) and of parameter copies
//! (`copy-grad`): whole gradients all-reduced, or with ZeRO reduce-scattered
//! (ZeRO-1 the accumulated gradients, ZeRO-2/3 each microbatch's), each
//! device getting its shard.

use super::update::{local_sq, set_clip};
use super::StepCtx;
use super::{comm_error, missing, owned};
use crate::compile::plan::{Collective, Op, TensorKind};
use crate::model::Dtype;
use crate::runtime::backend::{Backend, ParamId, ParamMap};
use crate::runtime::buffers::{Buf, Reserved};
use crate::runtime::comm::packed;
use crate::runtime::device::Device;
use crate::runtime::error::RuntimeError;

pub(super) fn grad_norm<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    group: &[u32],
) -> Result<(), RuntimeError> {
    let local = local_sq(dev).map_err(|e| dev.backend_error(op, e))?;
    let total = ctx
        .comm
        .all_reduce(
            "grad-norm all-reduce",
            op.node,
            group,
            dev.id,
            vec![local as f32],
        )
        .map_err(|e| comm_error(dev, op, e))?;
    set_clip(dev, (total[0] as f64).sqrt(), ctx.opts.clip);
    Ok(())
}

/// The gradients a reduction moves, laid out one after the other: the
/// device's own, or (ZeRO-2/3) the sum of each microbatch's, whose buffers
/// the backwards hand over (a tied all-reduce's result replaces the local
/// pieces). `staging` accounts the collective's buffers for the total
/// length before any of them is made: the bytes count from the moment they
/// exist, as the plan counts them from when the device reaches the op.
fn contribution<'d, B: Backend>(
    dev: &'d Device<B>,
    op: &Op,
    ids: &[ParamId],
    per_microbatch: bool,
    staging: impl FnOnce(usize) -> Result<Reserved<'d, B>, RuntimeError>,
) -> Result<(B::Tensor, Reserved<'d, B>), RuntimeError> {
    let fail = |e| dev.backend_error(op, e);
    let concat = |pieces: &[&B::Tensor], total: usize| -> Result<B::Tensor, RuntimeError> {
        let mut flat = dev.b.zeros_as(total, dev.grad).map_err(fail)?;
        let mut at = 0;
        for t in pieces {
            dev.b.copy(&mut flat, at, t, 0..B::len(t));
            at += B::len(t);
        }
        Ok(flat)
    };
    if !per_microbatch {
        let grads = dev.states.grads();
        let pieces = ids
            .iter()
            .map(|&id| {
                grads
                    .get(id)
                    .ok_or_else(|| missing(dev, op, &format!("gradient {}", dev.table.name(id))))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let total = pieces.iter().map(|t| B::len(t)).sum();
        let held = staging(total)?;
        return Ok((concat(&pieces, total)?, held));
    }
    let bufs = dev.bufs.take_all(op, TensorKind::MicroGrad)?;
    // Each parameter's pieces: the tied all-reduce's result where there is
    // one, else every microbatch's.
    let pieces = ids
        .iter()
        .map(|&id| {
            let reduced = bufs
                .iter()
                .any(|b| matches!(&**b, Buf::Tied(t) if t.contains(id)));
            let of_id: Vec<&B::Tensor> = (bufs.iter())
                .filter_map(|b| match &**b {
                    Buf::Tied(t) => t.get(id),
                    Buf::Params(t) if !reduced => t.get(id),
                    _ => None,
                })
                .collect();
            if of_id.is_empty() {
                let name = dev.table.name(id);
                return Err(missing(
                    dev,
                    op,
                    &format!("this microbatch's gradient of {name}"),
                ));
            }
            Ok(of_id)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let total = pieces.iter().map(|p| B::len(p[0])).sum();
    let held = staging(total)?;
    let mut sums: Vec<B::Tensor> = Vec::with_capacity(ids.len());
    for of_id in &pieces {
        let mut acc = dev.b.duplicate(of_id[0]).map_err(fail)?;
        for g in &of_id[1..] {
            dev.b.add(&mut acc, g);
        }
        sums.push(acc);
    }
    Ok((concat(&sums.iter().collect::<Vec<_>>(), total)?, held))
}

pub(super) fn reduce_grads<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    group: &[u32],
    what: Collective,
) -> Result<(), RuntimeError> {
    let fail = |e| dev.backend_error(op, e);
    let tied = what == Collective::TiedGrad;
    let mut ids = if tied {
        vec![dev.table.wte]
    } else {
        owned(dev, &op.segments)
    };
    if matches!(what, Collective::GradSync { .. })
        && op
            .segments
            .iter()
            .any(|s| dev.spreads.experts.contains_key(s))
    {
        // Experts spread by `shard` live on one device each: not replicated,
        // not reduced (their router and layernorm are).
        ids.retain(|id| dev.table.expert_of(*id).is_none());
    }
    let per_microbatch = op.inputs.iter().any(|i| i.tensor == TensorKind::MicroGrad);
    let scatter = what == Collective::GradSync { scatter: true };
    // ZeRO: this device gets its shard of the reduced gradients (of each
    // microbatch's, ZeRO-2/3; of the accumulated ones, ZeRO-1).
    let lens = match scatter {
        true => super::zero::member_lens(dev, op, group)?,
        false => Vec::new(),
    };
    let own =
        (group.iter().position(|d| *d == dev.id)).map_or(0, |p| lens.get(p).copied().unwrap_or(0));
    // Staging: this device's contribution and the reduced result (its
    // shard, for a reduce-scatter).
    let (contrib, _staging) = contribution(dev, op, &ids, per_microbatch, |total| {
        let result = if scatter { own } else { total };
        let bytes = (total as u64 + result as u64) * dev.grad.bytes();
        dev.bufs.reserve(op, bytes)
    })?;
    let flat = dev.b.download_owned(contrib).map_err(fail)?;
    let what = op.kind().as_str();
    if scatter {
        let key = reduction_key(dev, op, 0)?;
        let shard =
            packed::reduce_scatter(ctx.comm, (what, key), group, dev.id, flat, &lens, dev.grad)
                .map_err(|e| comm_error(dev, op, e))?;
        return match per_microbatch {
            true => super::zero::accumulate_shard(dev, op, &shard),
            false => super::zero::write_grad_shard(dev, op, &shard),
        };
    }
    let keys = (reduction_key(dev, op, 0)?, reduction_key(dev, op, 1)?);
    let sum = packed::all_reduce(ctx.comm, what, keys, group, dev.id, flat, dev.grad)
        .map_err(|e| comm_error(dev, op, e))?;
    if per_microbatch && tied {
        // Hand the microbatch's reduced `wte` gradient to the gradient
        // reduce-scatter of its bucket.
        let mut t: ParamMap<B::Tensor> = ParamMap::new();
        t.insert(dev.table.wte, dev.b.upload_as(sum, dev.grad).map_err(fail)?);
        dev.bufs.put(op, TensorKind::MicroGrad, Buf::Tied(t))?;
    } else {
        let mut grads = dev.states.grads();
        let mut at = 0;
        for id in &ids {
            let g = grads.get_mut(*id).expect("read above");
            let len = B::len(g);
            dev.b.write(g, 0, &sum[at..at + len]);
            at += len;
        }
    }
    Ok(())
}

/// The key of a gradient reduction's exchange `phase`: the plan node's own
/// in fp32 (one collective), in-op keys in bf16 (two exchanges: see
/// `comm::packed`).
fn reduction_key<B: Backend>(dev: &Device<B>, op: &Op, phase: u32) -> Result<u32, RuntimeError> {
    match dev.grad {
        Dtype::F32 => Ok(op.node),
        _ => super::compute::in_op(op, phase).map_err(|e| dev.backend_error(op, e)),
    }
}
