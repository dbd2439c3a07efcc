//! Memory-efficient causal attention (FlashAttention-2's algorithm) from
//! the same packed `qkv[B,T,3C]` as [`super::attention`]: per (sequence,
//! head) the queries go in blocks of [`BLOCK`] rows, each block walks the
//! key blocks at or below the diagonal with an online softmax (a running
//! row maximum and sum, the output rescaled as the maximum grows), and only
//! the output and each row's log-sum-exp `lse[B,NH,T]` are kept: O(T) a
//! head where the probabilities are O(T²). The backward recomputes each
//! tile's probabilities from `lse` (`P = exp(s − lse)`), with `D = Σ dO ⊙ O`
//! per row standing in for the softmax's `Σ P ⊙ dP`; blocks above the
//! diagonal are never computed, in either direction. The (sequence, head)
//! pairs run in parallel, each into buffers of its own, then copied or
//! added into the packed outputs by rows.
//!
//! Equal to the probability-keeping kernel within fp32 rounding (the sums
//! run in another order): `super::tests` compares the two.

use super::attention::{add_head_grads, merge_heads, scratch};
use super::elementwise::exp_small;
use super::lanes;
use super::matmul::matmul_strided;
use super::par;
use std::cell::RefCell;

/// Query rows per tile (the causal skipping's grain).
pub(super) const BLOCK: usize = 64;
/// Key rows per tile: wider tiles make fewer, larger products. A multiple
/// of [`BLOCK`], so a query block lies wholly at or below a key block's
/// start or wholly above it.
pub(super) const KEYS: usize = 4 * BLOCK;

thread_local! {
    /// Per (sequence, head) outputs or gradients, kept between calls.
    pub(super) static ITEMS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// One tile's scores, probabilities and their gradients, and a query
    /// block's running statistics and output.
    pub(super) static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The blocks of `size` rows of `t`: `(first, end)`.
fn blocks(t: usize, size: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(size)).map(move |i| (i * size, ((i + 1) * size).min(t)))
}

/// Keys at or before query `q` among the keys `c0..c0 + nc`.
pub(super) fn live(q: usize, c0: usize, nc: usize) -> usize {
    (q + 1).saturating_sub(c0).min(nc)
}

/// The blocks of `size` rows of the ranges `rows` (positions, taken in
/// order): `(first, end, local first)`, a block never crossing a range.
pub(super) fn blocks_of(rows: &[(usize, usize)], size: usize) -> Vec<(usize, usize, usize)> {
    let mut local = 0;
    let mut out = Vec::new();
    for &(g0, g1) in rows {
        for (r0, r1) in blocks(g1 - g0, size) {
            out.push((g0 + r0, g0 + r1, local + r0));
        }
        local += g1 - g0;
    }
    out
}

/// How many rows the ranges `rows` hold.
pub(super) fn count(rows: &[(usize, usize)]) -> usize {
    rows.iter().map(|(a, e)| e - a).sum()
}

/// Forward: for the query rows at the positions `rows` of each sequence of
/// `qkv[B,T,3C]` (all of them, or context parallelism's chunks), `out[B,R,C]`
/// and the rows' log-sum-exp `lse[B,NH,R]` (of the scaled scores), `R` the
/// rows' count; each attends to the keys at or before its position.
#[allow(clippy::too_many_arguments)]
pub fn flash_forward(
    out: &mut [f32],
    lse: &mut [f32],
    qkv: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    rows: &[(usize, usize)],
) {
    let _k = super::profile::span("flash_forward");
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    let (tr, qblocks) = (count(rows), blocks_of(rows, BLOCK));
    scratch(&ITEMS, b * nh * tr * hs, |outs| {
        let mut items: Vec<(&mut [f32], &mut [f32])> = outs
            .chunks_mut(tr * hs)
            .zip(lse[..b * nh * tr].chunks_mut(tr))
            .collect();
        par::each_mut(&mut items, |k, (o, l)| {
            let (bi, h) = (k / nh, k % nh);
            let qo = bi * t * c3 + h * hs;
            let tile = BLOCK * KEYS + 2 * BLOCK;
            scratch(&TILE, tile, |buf| {
                let (s, stats) = buf.split_at_mut(BLOCK * KEYS);
                let (m, sum) = stats.split_at_mut(BLOCK);
                for &(r0, r1, lr) in &qblocks {
                    let nr = r1 - r0;
                    // The block's output accumulates in place, rescaled.
                    let acc = &mut o[lr * hs..(lr + nr) * hs];
                    acc.fill(0.0);
                    m[..nr].fill(f32::NEG_INFINITY);
                    sum[..nr].fill(0.0);
                    for (c0, c1) in blocks(t, KEYS).take_while(|(c0, _)| *c0 < r1) {
                        // Keys past the block's last query are never live.
                        let nc = c1.min(r1) - c0;
                        let (k, v) = (&qkv[qo + c + c0 * c3..], &qkv[qo + 2 * c + c0 * c3..]);
                        let src = (&qkv[qo + r0 * c3..], k, v);
                        forward_tile(s, (m, sum), acc, src, (nr, nc, hs, c3), (r0, c0), scale);
                    }
                    for i in 0..nr {
                        let inv = 1.0 / sum[i];
                        for x in &mut acc[i * hs..(i + 1) * hs] {
                            *x *= inv;
                        }
                        l[lr + i] = m[i] + sum[i].ln();
                    }
                }
            })
        });
        merge_heads(out, |k| &*items[k].0, (b, tr, c, nh));
    })
}

/// Backward: `dqkv[B,T,3C] += ∂out/∂qkv · dout`, from the forward's `out`
/// and `lse` (`dout`, `out`, `lse` hold the rows `rows`, as
/// [`flash_forward`] made them; the query gradients of other rows stay
/// as they are).
#[allow(clippy::too_many_arguments)]
pub fn flash_backward(
    dqkv: &mut [f32],
    dout: &[f32],
    qkv: &[f32],
    out: &[f32],
    lse: &[f32],
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    rows: &[(usize, usize)],
) {
    let _k = super::profile::span("flash_backward");
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    let (tr, qblocks) = (count(rows), blocks_of(rows, BLOCK));
    scratch(&ITEMS, b * nh * 3 * t * hs, |grads| {
        let mut items: Vec<&mut [f32]> = grads.chunks_mut(3 * t * hs).collect();
        par::each_mut(&mut items, |k, item| {
            let (bi, h) = (k / nh, k % nh);
            item.fill(0.0);
            let (dv, rest) = item.split_at_mut(t * hs);
            let (dq, dk) = rest.split_at_mut(t * hs);
            let qo = bi * t * c3 + h * hs;
            let dof = bi * tr * c + h * hs;
            let l = &lse[(bi * nh + h) * tr..][..tr];
            scratch(&TILE, 2 * BLOCK * KEYS + tr, |buf| {
                let (p, rest) = buf.split_at_mut(BLOCK * KEYS);
                let (dp, d) = rest.split_at_mut(BLOCK * KEYS);
                // D = Σ dO ⊙ O per row.
                for (ti, di) in d.iter_mut().enumerate() {
                    let (g, o) = (&dout[dof + ti * c..][..hs], &out[dof + ti * c..][..hs]);
                    *di = lanes::dot(g, o);
                }
                for (c0, c1) in blocks(t, KEYS) {
                    for &(r0, r1, lr) in qblocks.iter().filter(|(_, r1, _)| *r1 > c0) {
                        let (nr, nc) = (r1 - r0, c1.min(r1) - c0);
                        let src = (
                            &qkv[qo + r0 * c3..],
                            &qkv[qo + c + c0 * c3..],
                            &qkv[qo + 2 * c + c0 * c3..],
                            &dout[dof + lr * c..],
                        );
                        let grads = (&mut dq[r0 * hs..], &mut dk[c0 * hs..], &mut dv[c0 * hs..]);
                        let stats = (&d[lr..], &l[lr..]);
                        let shape = (nr, nc, hs, c3, c);
                        backward_tile((p, dp), stats, src, grads, shape, (r0, c0), scale);
                    }
                }
            })
        });
        add_head_grads(dqkv, &items, (b, t, c, nh));
    })
}

/// One forward tile: the `nr` query rows at `q` (positions from `r0`)
/// against the `nc` keys at `k` (positions from `k0`; their values at `v`),
/// merged into the rows' running maximum `m`, sum `sum` and output `acc`
/// (`hs` wide; rows `c3` apart in the packed tensors). A row that sees no
/// key of the tile is left as it was.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward_tile(
    s: &mut [f32],
    (m, sum): (&mut [f32], &mut [f32]),
    acc: &mut [f32],
    (q, k, v): (&[f32], &[f32], &[f32]),
    (nr, nc, hs, c3): (usize, usize, usize, usize),
    (r0, k0): (usize, usize),
    scale: f32,
) {
    // s = q·kᵀ
    matmul_strided(nr, nc, hs, (s, nc), false, q, (c3, 1), k, (1, c3));
    for i in 0..nr {
        let row = &mut s[i * nc..(i + 1) * nc];
        let n = live(r0 + i, k0, nc);
        let (keys, masked) = row.split_at_mut(n);
        masked.fill(0.0);
        if n == 0 {
            continue;
        }
        for x in keys.iter_mut() {
            *x *= scale;
        }
        let m_new = m[i].max(lanes::max(keys));
        for x in keys.iter_mut() {
            *x = exp_small((*x - m_new).max(-80.0));
        }
        // Nothing merged yet (m = −∞): the old terms weigh nothing.
        let alpha = match m[i].is_finite() {
            true => exp_small((m[i] - m_new).max(-80.0)),
            false => 0.0,
        };
        sum[i] = sum[i] * alpha + lanes::sum(keys);
        m[i] = m_new;
        for x in &mut acc[i * hs..(i + 1) * hs] {
            *x *= alpha;
        }
    }
    // acc += p·v
    matmul_strided(nr, hs, nc, (acc, hs), true, s, (nc, 1), v, (c3, 1));
}

/// One backward tile: the `nr` query rows at `q` (positions from `r0`,
/// their `D = Σ dO ⊙ O` and log-sum-exp in `d` and `l`, their output
/// gradient at `dout`, rows `c` apart) against the `nc` keys at `k`
/// (positions from `k0`, values at `v`): the probabilities recomputed,
/// `dq` += ds·k, `dk` += dsᵀ·q, `dv` += pᵀ·dout (each `hs` wide).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_tile(
    (p, dp): (&mut [f32], &mut [f32]),
    (d, l): (&[f32], &[f32]),
    (q, k, v, dout): (&[f32], &[f32], &[f32], &[f32]),
    (dq, dk, dv): (&mut [f32], &mut [f32], &mut [f32]),
    (nr, nc, hs, c3, c): (usize, usize, usize, usize, usize),
    (r0, k0): (usize, usize),
    scale: f32,
) {
    // p = exp(q·kᵀ·scale − lse), zero where not live.
    matmul_strided(nr, nc, hs, (p, nc), false, q, (c3, 1), k, (1, c3));
    for i in 0..nr {
        let row = &mut p[i * nc..(i + 1) * nc];
        let (keys, masked) = row.split_at_mut(live(r0 + i, k0, nc));
        for x in keys.iter_mut() {
            *x = exp_small((*x * scale - l[i]).max(-80.0));
        }
        masked.fill(0.0);
    }
    // dv += pᵀ·dout
    matmul_strided(nc, hs, nr, (dv, hs), true, p, (1, nc), dout, (c, 1));
    // dp = dout·vᵀ
    matmul_strided(nr, nc, hs, (dp, nc), false, dout, (c, 1), v, (1, c3));
    // ds = p ⊙ (dp − D)·scale, into dp.
    for i in 0..nr {
        let (pr, dr) = (&p[i * nc..][..nc], &mut dp[i * nc..][..nc]);
        for (g, &x) in dr.iter_mut().zip(pr) {
            *g = x * (*g - d[i]) * scale;
        }
    }
    // dq += ds·k
    matmul_strided(nr, hs, nc, (dq, hs), true, dp, (nc, 1), k, (c3, 1));
    // dk += dsᵀ·q
    matmul_strided(nc, hs, nr, (dk, hs), true, dp, (1, nc), q, (c3, 1));
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::attention::{attention_backward, attention_forward};
    use super::*;

    /// Deterministic values in about ±2 (a scale where softmax is peaked).
    pub(in crate::runtime::backend::cpu) fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32 - 0.5) * 4.0
            })
            .collect()
    }

    /// Rank `r` of `cp`'s chunks of a `t`-long sequence (Megatron's
    /// causal balancing, as context parallelism holds them).
    pub(in crate::runtime::backend::cpu) fn chunks(
        t: usize,
        cp: usize,
        r: usize,
    ) -> Vec<(usize, usize)> {
        crate::runtime::backend::SeqRows::balanced(t, cp, r).ranges()
    }

    /// The rows `rows` (positions) of each of the `b` sequences of
    /// `full[b·t, w]`, one sequence after the other.
    pub(in crate::runtime::backend::cpu) fn rows_of(
        full: &[f32],
        w: usize,
        (b, t): (usize, usize),
        rows: &[(usize, usize)],
    ) -> Vec<f32> {
        (0..b)
            .flat_map(|bi| rows.iter().map(move |&(a, e)| (bi, a, e)))
            .flat_map(|(bi, a, e)| full[(bi * t + a) * w..(bi * t + e) * w].to_vec())
            .collect()
    }

    #[test]
    fn equals_the_probability_keeping_kernel_forward_and_backward() {
        // Lengths off the tiles (1, 63, 65, 150), on them (128), and over
        // several key tiles (600), with heads of 16.
        for (b, t, c, nh) in [
            (1, 1, 32, 2),
            (2, 63, 64, 4),
            (1, 65, 32, 2),
            (2, 150, 64, 4),
            (1, 128, 48, 3),
            (1, 600, 32, 2),
        ] {
            let qkv = values(b * t * 3 * c, t as u32);
            let dout = values(b * t * c, 7 + t as u32);
            let (mut out, mut att) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
            attention_forward(&mut out, &mut att, &qkv, b, t, c, nh);
            let (mut fout, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
            flash_forward(&mut fout, &mut lse, &qkv, b, t, c, nh, &[(0, t)]);
            let close = |what: &str, x: &[f32], y: &[f32], tol: f32| {
                for (i, (a, e)) in x.iter().zip(y).enumerate() {
                    assert!(
                        (a - e).abs() <= tol * (1.0 + e.abs()),
                        "T {t}: {what}[{i}] {a} vs {e}"
                    );
                }
            };
            close("out", &fout, &out, 1e-5);
            // The log-sum-exp gives back each kept probability.
            let hs = c / nh;
            let scale = 1.0 / (hs as f32).sqrt();
            let (bi, h, ti) = (b - 1, nh - 1, t - 1);
            let q = &qkv[bi * t * 3 * c + ti * 3 * c + h * hs..][..hs];
            let k0 = &qkv[bi * t * 3 * c + c + h * hs..][..hs];
            let p0 = ((lanes::dot(q, k0) * scale) - lse[(bi * nh + h) * t + ti]).exp();
            close(
                "p[last, 0]",
                &[p0],
                &[att[(bi * nh + h) * t * t + ti * t]],
                1e-5,
            );
            let mut want = vec![0.5; b * t * 3 * c];
            let mut got = want.clone();
            attention_backward(&mut want, &dout, &qkv, &att, b, t, c, nh);
            flash_backward(&mut got, &dout, &qkv, &fout, &lse, b, t, c, nh, &[(0, t)]);
            close("dqkv", &got, &want, 1e-4);
        }
    }

    #[test]
    fn context_parallel_chunks_give_the_whole_sequence_rows_and_gradients() {
        // Each of cp ranks holds chunks r and 2·cp − 1 − r of 2·cp
        // (Megatron's causal balancing); chunks off the tiles too (T 150
        // over 2·2: 37.5 is not whole, so 152).
        for (b, t, c, nh, cp) in [(2, 152, 64, 4, 2), (1, 128, 32, 2, 4), (1, 600, 32, 2, 2)] {
            let qkv = values(b * t * 3 * c, t as u32 + 1);
            let dout = values(b * t * c, 9 + t as u32);
            let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
            flash_forward(&mut out, &mut lse, &qkv, b, t, c, nh, &[(0, t)]);
            let mut whole = vec![0.0; b * t * 3 * c];
            flash_backward(&mut whole, &dout, &qkv, &out, &lse, b, t, c, nh, &[(0, t)]);
            let chunk = t / (2 * cp);
            let mut summed = vec![0.0; b * t * 3 * c];
            for r in 0..cp {
                let rows = chunks(t, cp, r);
                let tr = 2 * chunk;
                let local = |full: &[f32], w: usize| rows_of(full, w, (b, t), &rows);
                let (mut o, mut l) = (vec![0.0; b * tr * c], vec![0.0; b * nh * tr]);
                flash_forward(&mut o, &mut l, &qkv, b, t, c, nh, &rows);
                let want = local(&out, c);
                for (i, (x, y)) in o.iter().zip(&want).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                        "cp {cp} rank {r}: out[{i}] {x} vs {y}"
                    );
                }
                flash_backward(
                    &mut summed,
                    &local(&dout, c),
                    &qkv,
                    &o,
                    &l,
                    b,
                    t,
                    c,
                    nh,
                    &rows,
                );
            }
            for (i, (x, y)) in summed.iter().zip(&whole).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                    "cp {cp}: dqkv[{i}] {x} vs {y}"
                );
            }
        }
    }
}
