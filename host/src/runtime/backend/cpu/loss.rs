//! Softmax cross-entropy over the vocabulary, fused with its backward. Rows
//! in parallel; the loss summed afterwards in row order.

use super::par;

/// Softmax of each row of `logits[N,V]` into `probs`; returns Σ −log p(target).
pub fn crossentropy_forward(
    probs: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
) -> f64 {
    let _k = super::profile::span("crossentropy_forward");
    par::rows_mut_work(&mut probs[..n * v], v, 2 * v, |i0, block| {
        for (k, p) in block.chunks_exact_mut(v).enumerate() {
            let l = &logits[(i0 + k) * v..][..v];
            let maxv = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for j in 0..v {
                p[j] = (l[j] - maxv).exp();
                sum += p[j];
            }
            let inv = 1.0 / sum;
            for x in p.iter_mut() {
                *x *= inv;
            }
        }
    });
    let mut total = 0.0f64;
    for i in 0..n {
        // Clamped away from 0, but a NaN stays NaN (`f32::max` would hide it).
        let pt = probs[i * v + targets[i] as usize];
        total -= (if pt.is_nan() { pt } else { pt.max(1e-30) } as f64).ln();
    }
    total
}

/// `dlogits = (probs − onehot(target)) · scale` (scale = 1 / tokens in the global batch).
pub fn crossentropy_backward(
    dlogits: &mut [f32],
    probs: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
    scale: f32,
) {
    let _k = super::profile::span("crossentropy_backward");
    par::rows_mut(&mut dlogits[..n * v], v, |i0, block| {
        for (k, d) in block.chunks_exact_mut(v).enumerate() {
            let i = i0 + k;
            let p = &probs[i * v..][..v];
            for j in 0..v {
                d[j] = p[j] * scale;
            }
            d[targets[i] as usize] -= scale;
        }
    });
}
