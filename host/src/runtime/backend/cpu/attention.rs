//! Causal multi-head self-attention from a packed `qkv[B,T,3C]`: per head,
//! `att = softmax(q·kᵀ/√hs)` masked to `t2 ≤ t`, `out = att·v`. The softmax
//! probabilities are cached for backward. No weights: the whole backward is a
//! backward-for-input. Per (sequence, head) the products are GEMMs on strided
//! views of `qkv` (the masked upper triangle is computed and zeroed: for the
//! sizes here GEMM beats a triangular loop). The (sequence, head) pairs run
//! in parallel on the device's threads, each into its own buffers; results
//! are then added into the packed outputs in the one-thread order.

use super::matmul::matmul_strided;
use super::par;

/// Forward. `att[B,NH,T,T]` receives the probabilities (zero above the diagonal).
pub fn attention_forward(
    out: &mut [f32],
    att: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let _k = super::profile::span("attention_forward");
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    // One item per (sequence, head): its probabilities and its output.
    let mut items: Vec<(&mut [f32], Vec<f32>)> = att[..b * nh * t * t]
        .chunks_mut(t * t)
        .map(|a| (a, vec![0.0f32; t * hs]))
        .collect();
    par::each_mut(&mut items, |k, (a, tmp)| {
        let (bi, h) = (k / nh, k % nh);
        let qo = bi * t * c3 + h * hs;
        // pre = q·kᵀ
        matmul_strided(
            t,
            t,
            hs,
            a,
            false,
            &qkv[qo..],
            (c3, 1),
            &qkv[qo + c..],
            (1, c3),
        );
        for ti in 0..t {
            let row = &mut a[ti * t..(ti + 1) * t];
            let mut maxv = f32::NEG_INFINITY;
            for v in row.iter_mut().take(ti + 1) {
                *v *= scale;
                maxv = maxv.max(*v);
            }
            let mut sum = 0.0f32;
            for v in row.iter_mut().take(ti + 1) {
                *v = (*v - maxv).exp();
                sum += *v;
            }
            let inv = 1.0 / sum;
            for v in row.iter_mut().take(ti + 1) {
                *v *= inv;
            }
            for v in row.iter_mut().skip(ti + 1) {
                *v = 0.0;
            }
        }
        // out = att·v
        matmul_strided(t, hs, t, tmp, false, a, (t, 1), &qkv[qo + 2 * c..], (c3, 1));
    });
    for (k, (_, tmp)) in items.iter().enumerate() {
        let (bi, h) = (k / nh, k % nh);
        for ti in 0..t {
            out[(bi * t + ti) * c + h * hs..][..hs].copy_from_slice(&tmp[ti * hs..(ti + 1) * hs]);
        }
    }
}

/// Backward: `dqkv += ∂out/∂qkv · dout`.
pub fn attention_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    att: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
) {
    let _k = super::profile::span("attention_backward");
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    // One item per (sequence, head): its dv, dq and dk.
    let mut items: Vec<[Vec<f32>; 3]> = (0..b * nh)
        .map(|_| {
            [
                vec![0.0f32; t * hs],
                vec![0.0f32; t * hs],
                vec![0.0f32; t * hs],
            ]
        })
        .collect();
    par::each_mut(&mut items, |k, [dv, dq, dk]| {
        let (bi, h) = (k / nh, k % nh);
        let mut datt = vec![0.0f32; t * t];
        let qo = bi * t * c3 + h * hs;
        let dof = bi * t * c + h * hs;
        let a = &att[(bi * nh + h) * t * t..][..t * t];
        // datt = dout·vᵀ ; dv = attᵀ·dout
        matmul_strided(
            t,
            t,
            hs,
            &mut datt,
            false,
            &dout[dof..],
            (c, 1),
            &qkv[qo + 2 * c..],
            (1, c3),
        );
        matmul_strided(t, hs, t, dv, false, a, (1, t), &dout[dof..], (c, 1));
        // softmax backward (scaled): dpre = att ⊙ (datt − Σ att·datt) / √hs
        for ti in 0..t {
            let (ar, dr) = (&a[ti * t..(ti + 1) * t], &mut datt[ti * t..(ti + 1) * t]);
            let dot: f32 = (0..=ti).map(|t2| ar[t2] * dr[t2]).sum();
            for t2 in 0..t {
                dr[t2] = if t2 <= ti {
                    ar[t2] * (dr[t2] - dot) * scale
                } else {
                    0.0
                };
            }
        }
        // dq = dpre·k ; dk = dpreᵀ·q
        matmul_strided(t, hs, t, dq, false, &datt, (t, 1), &qkv[qo + c..], (c3, 1));
        matmul_strided(t, hs, t, dk, false, &datt, (1, t), &qkv[qo..], (c3, 1));
    });
    let add = |dqkv: &mut [f32], off: usize, tmp: &[f32]| {
        for ti in 0..t {
            let d = &mut dqkv[off + ti * c3..][..hs];
            for (x, y) in d.iter_mut().zip(&tmp[ti * hs..(ti + 1) * hs]) {
                *x += y;
            }
        }
    };
    for (k, [dv, dq, dk]) in items.iter().enumerate() {
        let (bi, h) = (k / nh, k % nh);
        let qo = bi * t * c3 + h * hs;
        add(dqkv, qo + 2 * c, dv);
        add(dqkv, qo, dq);
        add(dqkv, qo + c, dk);
    }
}
