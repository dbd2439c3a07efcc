//! Causal multi-head self-attention from a packed `qkv[B,T,3C]`: per head,
//! `att = softmax(q·kᵀ/√hs)` masked to `t2 ≤ t`, `out = att·v`. The softmax
//! probabilities are cached for backward. No weights: the whole backward is a
//! backward-for-input. Per (sequence, head) the products are GEMMs on strided
//! views of `qkv`, blocked by the mask: query rows go in blocks of
//! [`BLOCK`], and each block's products stop at its last key, so the blocks
//! above the diagonal are never computed (at T = 256 that is 10 of 16
//! blocks' work, as a causal kernel does). The (sequence, head) pairs run in
//! parallel on the device's threads, each into its own buffers; results are
//! then added into the packed outputs in the one-thread order.

use super::elementwise::exp_small;
use super::matmul::matmul_strided;
use super::par;

/// Query rows per block of the causal products: large enough for GEMM to
/// run at speed, small enough to skip most of the masked triangle.
const BLOCK: usize = 64;

/// The row blocks of a `t`-long sequence: `(first row, end row)`.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(BLOCK)).map(move |i| (i * BLOCK, ((i + 1) * BLOCK).min(t)))
}

/// Grouped-query attention's input: `qkv[n, 3·nh·hd]` packed from
/// `q[n, nh·hd]` and `k`, `v[n, kvh·hd]`, each key/value head repeated for
/// the `nh / kvh` query heads it serves (query head `h` reads kv head
/// `h / (nh / kvh)`, Hugging Face's `repeat_kv`).
pub fn qkv_pack(
    qkv: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    nh: usize,
    kvh: usize,
    hd: usize,
) {
    let _k = super::profile::span("qkv_pack");
    let (qw, kvw, rep) = (nh * hd, kvh * hd, nh / kvh.max(1));
    par::rows_mut(&mut qkv[..n * 3 * qw], 3 * qw, |r0, block| {
        for (i, row) in block.chunks_exact_mut(3 * qw).enumerate() {
            let r = r0 + i;
            row[..qw].copy_from_slice(&q[r * qw..][..qw]);
            for h in 0..nh {
                let g = h / rep;
                row[qw + h * hd..][..hd].copy_from_slice(&k[r * kvw + g * hd..][..hd]);
                row[2 * qw + h * hd..][..hd].copy_from_slice(&v[r * kvw + g * hd..][..hd]);
            }
        }
    });
}

/// Backward of [`qkv_pack`]: `dq += dqkv`'s queries, and each kv head's
/// `dk`, `dv` += the sum of its query heads' parts, in head order.
pub fn qkv_unpack_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dqkv: &[f32],
    n: usize,
    nh: usize,
    kvh: usize,
    hd: usize,
) {
    let _k = super::profile::span("qkv_unpack_backward");
    let (qw, kvw, rep) = (nh * hd, kvh * hd, nh / kvh.max(1));
    par::rows_mut(&mut dq[..n * qw], qw, |r0, block| {
        for (i, row) in block.chunks_exact_mut(qw).enumerate() {
            let src = &dqkv[(r0 + i) * 3 * qw..][..qw];
            row.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        }
    });
    par::rows_mut2(
        &mut dk[..n * kvw],
        kvw,
        &mut dv[..n * kvw],
        kvw,
        2 * qw,
        |r0, dk, dv| {
            for (i, (krow, vrow)) in dk
                .chunks_exact_mut(kvw)
                .zip(dv.chunks_exact_mut(kvw))
                .enumerate()
            {
                let src = &dqkv[(r0 + i) * 3 * qw..][..3 * qw];
                for h in 0..nh {
                    let g = h / rep;
                    let (ks, vs) = (&src[qw + h * hd..][..hd], &src[2 * qw + h * hd..][..hd]);
                    krow[g * hd..][..hd]
                        .iter_mut()
                        .zip(ks)
                        .for_each(|(d, s)| *d += s);
                    vrow[g * hd..][..hd]
                        .iter_mut()
                        .zip(vs)
                        .for_each(|(d, s)| *d += s);
                }
            }
        },
    );
}

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
        for (r0, r1) in blocks(t) {
            // pre[r0..r1, ..r1] = q[r0..r1]·k[..r1]ᵀ
            matmul_strided(
                r1 - r0,
                r1,
                hs,
                (&mut a[r0 * t..], t),
                false,
                &qkv[qo + r0 * c3..],
                (c3, 1),
                &qkv[qo + c..],
                (1, c3),
            );
            for ti in r0..r1 {
                let row = &mut a[ti * t..(ti + 1) * t];
                let mut maxv = f32::NEG_INFINITY;
                for v in row.iter_mut().take(ti + 1) {
                    *v *= scale;
                    maxv = maxv.max(*v);
                }
                // e^(v − max) ≤ 1 without libm (its loop vectorizes); below
                // e^-80 a probability is 0 to f32 anyway.
                for v in row.iter_mut().take(ti + 1) {
                    *v = exp_small((*v - maxv).max(-80.0));
                }
                let sum: f32 = row[..=ti].iter().sum();
                let inv = 1.0 / sum;
                for v in row.iter_mut().take(ti + 1) {
                    *v *= inv;
                }
                for v in row.iter_mut().skip(ti + 1) {
                    *v = 0.0;
                }
            }
            // out[r0..r1] = att[r0..r1, ..r1]·v[..r1]
            matmul_strided(
                r1 - r0,
                hs,
                r1,
                (&mut tmp[r0 * hs..], hs),
                false,
                &a[r0 * t..],
                (t, 1),
                &qkv[qo + 2 * c..],
                (c3, 1),
            );
        }
    });
    for (k, (_, tmp)) in items.iter().enumerate() {
        let (bi, h) = (k / nh, k % nh);
        for ti in 0..t {
            out[(bi * t + ti) * c + h * hs..][..hs].copy_from_slice(&tmp[ti * hs..(ti + 1) * hs]);
        }
    }
}

/// Backward: `dqkv += ∂out/∂qkv · dout`.
#[allow(clippy::too_many_arguments)]
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
        for (r0, r1) in blocks(t) {
            // datt[r0..r1, ..r1] = dout[r0..r1]·v[..r1]ᵀ
            matmul_strided(
                r1 - r0,
                r1,
                hs,
                (&mut datt[r0 * t..], t),
                false,
                &dout[dof + r0 * c..],
                (c, 1),
                &qkv[qo + 2 * c..],
                (1, c3),
            );
            // dv[r0..r1] = att[r0.., r0..r1]ᵀ·dout[r0..] (rows above r0
            // have zero probability for these keys)
            matmul_strided(
                r1 - r0,
                hs,
                t - r0,
                (&mut dv[r0 * hs..], hs),
                false,
                &a[r0 * t + r0..],
                (1, t),
                &dout[dof + r0 * c..],
                (c, 1),
            );
            // softmax backward (scaled): dpre = att ⊙ (datt − Σ att·datt) / √hs
            for ti in r0..r1 {
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
        }
        for (r0, r1) in blocks(t) {
            // dq[r0..r1] = dpre[r0..r1, ..r1]·k[..r1]
            matmul_strided(
                r1 - r0,
                hs,
                r1,
                (&mut dq[r0 * hs..], hs),
                false,
                &datt[r0 * t..],
                (t, 1),
                &qkv[qo + c..],
                (c3, 1),
            );
            // dk[r0..r1] = dpre[r0.., r0..r1]ᵀ·q[r0..]
            matmul_strided(
                r1 - r0,
                hs,
                t - r0,
                (&mut dk[r0 * hs..], hs),
                false,
                &datt[r0 * t + r0..],
                (1, t),
                &qkv[qo + r0 * c3..],
                (c3, 1),
            );
        }
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
