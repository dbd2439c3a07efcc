//! Softmax cross-entropy over the vocabulary, fused with its backward.

/// Softmax of each row of `logits[N,V]` into `probs`; returns Σ −log p(target).
pub fn crossentropy_forward(
    probs: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
) -> f64 {
    let mut total = 0.0f64;
    for i in 0..n {
        let l = &logits[i * v..][..v];
        let p = &mut probs[i * v..][..v];
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
        total -= (p[targets[i] as usize].max(1e-30) as f64).ln();
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
    for i in 0..n {
        let p = &probs[i * v..][..v];
        let d = &mut dlogits[i * v..][..v];
        for j in 0..v {
            d[j] = p[j] * scale;
        }
        d[targets[i] as usize] -= scale;
    }
}
