//! AdamW (decoupled weight decay), as GPT-2 training uses it.

/// Hyper-parameters of the optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

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
    let bc1 = 1.0 - h.beta1.powi(step as i32);
    let bc2 = 1.0 - h.beta2.powi(step as i32);
    let wd = if decay { h.weight_decay } else { 0.0 };
    for i in 0..param.len() {
        let g = grad[i] * grad_scale;
        m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g;
        v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
        let mhat = m[i] / bc1;
        let vhat = v[i] / bc2;
        param[i] -= h.lr * (mhat / (vhat.sqrt() + h.eps) + wd * param[i]);
    }
}
