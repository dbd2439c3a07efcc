//! The optimizer `update`: clip by the global norm (or the local one when
//! the plan has no norm all-reduce), AdamW on whole tensors, and the
//! sharded step of every ZeRO bucket the update covers.

use super::owned;
use crate::compile::plan::Op;
use crate::runtime::backend::cpu::adamw::adamw_update;
use crate::runtime::device::Device;
use crate::runtime::error::RuntimeError;
use crate::runtime::step::StepCtx;
use crate::runtime::zero;

pub(super) fn update(dev: &Device, op: &Op, ctx: &StepCtx) -> Result<(), RuntimeError> {
    if !dev.has_norm_op {
        let local = local_sq(dev);
        set_clip(dev, local.sqrt(), ctx.opts.clip);
    }
    let scale = dev.state.lock().unwrap().clip_scale;
    let names = owned(dev, ctx, &op.segments);
    if ctx.opts.capture_grads {
        let grads = dev.grads.lock().unwrap();
        let mut cap = dev.captured.lock().unwrap();
        for n in &names {
            if let Some(g) = grads.get(n) {
                cap.insert(n.clone(), g.clone());
            }
        }
    }
    let mut params = dev.params.write().unwrap();
    let mut grads = dev.grads.lock().unwrap();
    let mut mom = dev.moments.lock().unwrap();
    let (m, v) = &mut *mom;
    // Unsharded parameters: whole tensors.
    for n in &names {
        let (Some(p), Some(g), Some(mm), Some(vv)) = (
            params.get_mut(n),
            grads.get_mut(n),
            m.get_mut(n),
            v.get_mut(n),
        ) else {
            continue;
        };
        adamw_update(
            p,
            g,
            mm,
            vv,
            &ctx.opts.adamw,
            ctx.step,
            scale,
            dev.decay.contains(n),
        );
        g.iter_mut().for_each(|x| *x = 0.0);
    }
    // ZeRO buckets: this device's shard only.
    zero::update(dev, op, ctx, &mut params, &mut grads, scale);
    Ok(())
}

/// Σ g² over the gradients this device counts: unsharded ones on DP replica
/// 0, and its own shard of every ZeRO bucket.
pub(super) fn local_sq(dev: &Device) -> f64 {
    let grads = dev.grads.lock().unwrap();
    let sq = |g: &[f32]| g.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>();
    let whole: f64 = dev
        .norm_names
        .iter()
        .filter_map(|n| grads.get(n))
        .map(|g| sq(g))
        .sum();
    zero::add_shard_sq(dev, &grads, whole)
}

pub(super) fn set_clip(dev: &Device, norm: f64, clip: f32) {
    let mut s = dev.state.lock().unwrap();
    s.grad_norm = norm;
    s.clip_scale = if clip > 0.0 && norm > clip as f64 {
        (clip as f64 / (norm + 1e-6)) as f32
    } else {
        1.0
    };
}
