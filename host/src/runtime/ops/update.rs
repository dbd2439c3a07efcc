//! The optimizer `update`: clip by the global norm (or the local one when
//! the plan has no norm all-reduce), AdamW on whole tensors, and the
//! sharded step of every ZeRO bucket the update covers.

use super::owned;
use super::StepCtx;
use crate::compile::plan::Op;
use crate::runtime::backend::{Backend, BackendError, ParamId, ParamMap};
use crate::runtime::device::Device;
use crate::runtime::error::RuntimeError;

pub(super) fn update<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
) -> Result<(), RuntimeError> {
    let fail = |e| dev.backend_error(op, e);
    if !dev.has_norm_op {
        let local = local_sq(dev).map_err(fail)?;
        set_clip(dev, local.sqrt(), ctx.opts.clip);
    }
    let (scale, norm) = {
        let s = dev.state.lock().unwrap();
        (s.clip_scale, s.grad_norm)
    };
    let ids = owned(dev, &op.segments);
    if ctx.opts.capture_grads {
        // ZeRO buckets capture their reduced shards (`zero::update`).
        let sharded: std::collections::HashSet<ParamId> = dev
            .states
            .buckets()
            .iter()
            .flat_map(|b| b.names.iter().map(|(n, _)| *n))
            .collect();
        let grads = dev.states.grads();
        let mut cap = dev.states.captured();
        for id in ids.iter().filter(|id| !sharded.contains(id)) {
            if let Some(g) = grads.get(*id) {
                cap.insert(*id, dev.b.duplicate(g).map_err(fail)?);
            }
        }
    }
    if !norm.is_finite() {
        // A NaN or infinite gradient: no update, so the parameters stay
        // those the step ran on (the trainer stops the run and names where
        // the first non-finite value is); the gradients are kept for that.
        return Ok(());
    }
    let mut params = dev.states.params_mut();
    let mut master = dev.states.master();
    let mut grads = dev.states.grads();
    let mut mom = dev.states.moments();
    let (m, v) = &mut *mom;
    // Unsharded parameters: whole tensors (their fp32 master weights, then
    // the bf16 copy the kernels read, when there are some).
    for id in &ids {
        let (Some(p), Some(g), Some(mm), Some(vv)) = (
            params.get_mut(*id),
            grads.get_mut(*id),
            m.get_mut(*id),
            v.get_mut(*id),
        ) else {
            continue;
        };
        let len = B::len(p);
        let decay = dev.decay.contains(*id);
        match master.get_mut(*id) {
            Some(w) => {
                dev.b
                    .adamw(w, g, mm, vv, 0..len, &ctx.adamw, ctx.step, scale, decay);
                dev.b.copy(p, 0, w, 0..len);
            }
            None => dev
                .b
                .adamw(p, g, mm, vv, 0..len, &ctx.adamw, ctx.step, scale, decay),
        }
        dev.b.fill_zero(g);
    }
    drop(master);
    // ZeRO buckets: this device's shard only.
    super::zero::update(dev, op, ctx, &mut params, &mut grads, scale).map_err(fail)
}

/// Σ g² over the gradients this device counts: unsharded ones on DP replica
/// 0, and its own shard of every ZeRO bucket.
pub(super) fn local_sq<B: Backend>(dev: &Device<B>) -> Result<f64, BackendError> {
    let grads: std::sync::MutexGuard<'_, ParamMap<B::Tensor>> = dev.states.grads();
    super::zero::norm_sq(dev, &grads)
}

pub(super) fn set_clip<B: Backend>(dev: &Device<B>, norm: f64, clip: f32) {
    let mut s = dev.state.lock().unwrap();
    s.grad_norm = norm;
    s.clip_scale = if clip > 0.0 && norm > clip as f64 {
        (clip as f64 / (norm + 1e-6)) as f32
    } else {
        1.0
    };
}
