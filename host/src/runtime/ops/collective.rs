//! Gradient collectives: the global gradient norm (an all-reduce of Σ g²),
//! and the reductions of data parallelism (`grad-sync`), of the tied
//! embedding across stages (`tied-grad`) and of parameter copies
//! (`copy-grad`): whole gradients, or with ZeRO-2/3 each microbatch's
//! gradients, of which each device keeps its shard.

use super::update::{local_sq, set_clip};
use super::{comm_error, missing, owned};
use crate::compile::plan::{CommPurpose, Op, TensorKind};
use crate::model::params::expert_of;
use crate::runtime::backend::cpu::gpt::Tensors;
use crate::runtime::buffers::Buf;
use crate::runtime::device::Device;
use crate::runtime::error::RuntimeError;
use crate::runtime::step::StepCtx;
use crate::runtime::zero;

pub(super) fn grad_norm(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    group: &[u32],
) -> Result<(), RuntimeError> {
    let local = local_sq(dev);
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

pub(super) fn reduce_grads(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    group: &[u32],
    purpose: CommPurpose,
) -> Result<(), RuntimeError> {
    let tied = purpose == CommPurpose::TiedGrad;
    let mut names = if tied {
        vec!["wte".to_string()]
    } else {
        owned(dev, ctx, &op.segments)
    };
    if purpose == CommPurpose::GradSync
        && op
            .segments
            .iter()
            .any(|s| dev.spreads.experts.contains_key(s))
    {
        // Experts spread by `shard` live on one device each: not replicated,
        // not reduced (their router and layernorm are).
        names.retain(|n| expert_of(n).is_none());
    }
    // ZeRO-2/3 reduce every microbatch's gradients, which the backwards
    // hand over as buffers (freed after this op).
    let per_microbatch = op.inputs.iter().any(|i| i.tensor == TensorKind::MicroGrad);
    let mut flat = Vec::new();
    if per_microbatch {
        let bufs = dev.take_all(op, TensorKind::MicroGrad)?;
        for n in &names {
            // A tied all-reduce's result replaces the local pieces.
            let reduced = bufs
                .iter()
                .any(|b| matches!(&**b, Buf::Tied(t) if t.contains_key(n)));
            let mut acc: Option<Vec<f32>> = None;
            for b in &bufs {
                let t = match &**b {
                    Buf::Tied(t) => t,
                    Buf::Params(t) if !reduced => t,
                    _ => continue,
                };
                if let Some(g) = t.get(n) {
                    match acc.as_mut() {
                        None => acc = Some(g.clone()),
                        Some(a) => a.iter_mut().zip(g).for_each(|(x, y)| *x += y),
                    }
                }
            }
            flat.extend(
                acc.ok_or_else(|| missing(dev, op, &format!("this microbatch's gradient of {n}")))?,
            );
        }
    } else {
        let grads = dev.grads.lock().unwrap();
        for n in &names {
            flat.extend_from_slice(
                grads
                    .get(n)
                    .ok_or_else(|| missing(dev, op, &format!("gradient {n}")))?,
            );
        }
    }
    // Staging: this device's contribution and the reduced result.
    let _staging = dev.reserve(op, flat.len() as u64 * 8)?;
    let sum = ctx
        .comm
        .all_reduce(op.op.as_str(), op.node, group, dev.id, flat)
        .map_err(|e| comm_error(dev, op, e))?;
    if per_microbatch && tied {
        // Hand the microbatch's reduced `wte` gradient to the gradient
        // reduce-scatter of its bucket.
        let t: Tensors = [("wte".to_string(), sum.to_vec())].into_iter().collect();
        dev.put(op, TensorKind::MicroGrad, Buf::Tied(t))?;
    } else if per_microbatch {
        // Keep this device's shard of the reduced gradients.
        zero::accumulate_shard(dev, op, &sum)?;
    } else {
        let mut grads = dev.grads.lock().unwrap();
        let mut at = 0;
        for n in &names {
            let g = grads.get_mut(n).expect("read above");
            let len = g.len();
            g.copy_from_slice(&sum[at..at + len]);
            at += len;
        }
    }
    Ok(())
}
