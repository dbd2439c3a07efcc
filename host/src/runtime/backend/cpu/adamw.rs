//! AdamW (decoupled weight decay), as GPT-2 training uses it; elementwise,
//! in parallel chunks on the device's threads.

use super::par;
use crate::runtime::backend::AdamW;

/// A chunk of the step: its offset, parameters, first and second moments.
type Block<'a> = (usize, &'a mut [f32], &'a mut [f32], &'a mut [f32]);

/// One step at time `step` (1-based) on `param` with gradient `grad · grad_scale`
/// (the clipping factor); `decay` selects weight decay for this tensor.
#[allow(clippy::too_many_arguments)]
pub fn adamw_update(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    h: &AdamW,
    step: u32,
    grad_scale: f32,
    decay: bool,
) {
    let _k = super::profile::span("adamw_update");
    let bc1 = 1.0 - h.beta1.powi(step as i32);
    let bc2 = 1.0 - h.beta2.powi(step as i32);
    let wd = if decay { h.weight_decay } else { 0.0 };
    let n = param.len();
    assert!(grad.len() >= n && m.len() >= n && v.len() >= n);
    let chunk = (n.div_ceil(4 * par::threads())).max(16 * 1024);
    let mut blocks: Vec<Block> = param
        .chunks_mut(chunk)
        .zip(m[..n].chunks_mut(chunk))
        .zip(v[..n].chunks_mut(chunk))
        .enumerate()
        .map(|(k, ((p, m), v))| (k * chunk, p, m, v))
        .collect();
    par::each_mut(&mut blocks, |_, (o, param, m, v)| {
        let grad = &grad[*o..];
        for i in 0..param.len() {
            let g = grad[i] * grad_scale;
            m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g;
            v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
            let mhat = m[i] / bc1;
            let vhat = v[i] / bc2;
            param[i] -= h.lr * (mhat / (vhat.sqrt() + h.eps) + wd * param[i]);
        }
    });
}
