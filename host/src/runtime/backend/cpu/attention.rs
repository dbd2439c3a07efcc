//! Causal multi-head self-attention from a packed `qkv[B,T,3C]`: per head,
//! `att = softmax(q·kᵀ/√hs)` masked to `t2 ≤ t`, `out = att·v`. The softmax
//! probabilities are cached for backward. No weights: the whole backward is a
//! backward-for-input. Per (sequence, head) the products are GEMMs on strided
//! views of `qkv`, blocked by the mask: query rows go in blocks of
//! [`BLOCK`], and each block's products stop at its last key, so the blocks
//! above the diagonal are never computed (at T = 256 that is 10 of 16
//! blocks' work, as a causal kernel does). The (sequence, head) pairs run in
//! parallel on the device's threads, each into its own buffers; results are
//! then copied or added into the packed outputs by rows in parallel (each
//! element receives one value, so the order does not matter). The softmax
//! sums in [`lanes`]' fixed order.

use super::elementwise::exp_small;
use super::lanes;
use super::matmul::matmul_strided;
use super::par;
use std::cell::RefCell;
use std::thread::LocalKey;

/// Query rows per block of the causal products: large enough for GEMM to
/// run at speed, small enough to skip most of the masked triangle.
const BLOCK: usize = 64;

thread_local! {
    /// Working memory of the attention kernels, kept on each thread between
    /// calls: the per-(sequence, head) outputs, and one head's probability
    /// gradients. Every element is written before it is read, so a buffer
    /// is zeroed once, when it grows, not at every call.
    static ITEMS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static DATT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `f` on `n` floats of `cell`'s buffer (contents unspecified).
pub(super) fn scratch<R>(
    cell: &'static LocalKey<RefCell<Vec<f32>>>,
    n: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    cell.with(|c| match c.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < n {
                v.resize(n, 0.0);
            }
            f(&mut v[..n])
        }
        // In use further up this thread's stack (a kernel run by rayon's
        // work stealing while another waits): a buffer of its own.
        Err(_) => f(&mut vec![0.0; n]),
    })
}

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

/// Each (sequence, head) item's `[t, hs]` output (`head(k)` for item
/// `bi·nh + h`) copied into its head's columns of `out[b·t, c]`, by rows in
/// parallel (each element gets one value).
pub(super) fn merge_heads<'a>(
    out: &mut [f32],
    head: impl Fn(usize) -> &'a [f32] + Sync,
    (b, t, c, nh): (usize, usize, usize, usize),
) {
    let hs = c / nh;
    par::rows_mut(&mut out[..b * t * c], c, |r0, block| {
        for (i, row) in block.chunks_exact_mut(c).enumerate() {
            let (bi, ti) = ((r0 + i) / t, (r0 + i) % t);
            for (h, dst) in row.chunks_exact_mut(hs).enumerate() {
                dst.copy_from_slice(&head(bi * nh + h)[ti * hs..][..hs]);
            }
        }
    });
}

/// Each (sequence, head) item's gradients (its dv, dq and dk in turn, `[t,
/// hs]` each) added into the packed `dqkv[b·t, 3c]`, by rows in parallel
/// (each element gets one item's value).
pub(super) fn add_head_grads(
    dqkv: &mut [f32],
    items: &[&mut [f32]],
    (b, t, c, nh): (usize, usize, usize, usize),
) {
    let (hs, c3) = (c / nh, 3 * c);
    par::rows_mut(&mut dqkv[..b * t * c3], c3, |r0, block| {
        for (i, row) in block.chunks_exact_mut(c3).enumerate() {
            let (bi, ti) = ((r0 + i) / t, (r0 + i) % t);
            for (part, dst) in row.chunks_exact_mut(hs).enumerate() {
                // q, k, v parts in turn, each `nh` heads wide.
                let (which, h) = (part / nh, part % nh);
                let item = &items[bi * nh + h];
                let src = &item[[1, 2, 0][which] * t * hs..][..t * hs];
                for (x, y) in dst.iter_mut().zip(&src[ti * hs..][..hs]) {
                    *x += y;
                }
            }
        }
    });
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
    scratch(&ITEMS, b * nh * t * hs, |outs| {
        let mut items: Vec<(&mut [f32], &mut [f32])> = att[..b * nh * t * t]
            .chunks_mut(t * t)
            .zip(outs.chunks_mut(t * hs))
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
                    let (live, masked) = a[ti * t..(ti + 1) * t].split_at_mut(ti + 1);
                    for v in live.iter_mut() {
                        *v *= scale;
                    }
                    let maxv = lanes::max(live);
                    // e^(v − max) ≤ 1 without libm (its loop vectorizes); below
                    // e^-80 a probability is 0 to f32 anyway.
                    for v in live.iter_mut() {
                        *v = exp_small((*v - maxv).max(-80.0));
                    }
                    let inv = 1.0 / lanes::sum(live);
                    for v in live.iter_mut() {
                        *v *= inv;
                    }
                    masked.fill(0.0);
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
        merge_heads(out, |k| &*items[k].1, (b, t, c, nh));
    })
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
    scratch(&ITEMS, b * nh * 3 * t * hs, |grads| {
        let mut items: Vec<&mut [f32]> = grads.chunks_mut(3 * t * hs).collect();
        par::each_mut(&mut items, |k, item| {
            let (bi, h) = (k / nh, k % nh);
            let (dv, rest) = item.split_at_mut(t * hs);
            let (dq, dk) = rest.split_at_mut(t * hs);
            scratch(&DATT, t * t, |datt| {
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
                        let ar = &a[ti * t..][..=ti];
                        let (live, masked) = datt[ti * t..(ti + 1) * t].split_at_mut(ti + 1);
                        let dot = lanes::dot(ar, live);
                        for (d, &p) in live.iter_mut().zip(ar) {
                            *d = p * (*d - dot) * scale;
                        }
                        masked.fill(0.0);
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
            })
        });
        add_head_grads(dqkv, &items, (b, t, c, nh));
    })
}
