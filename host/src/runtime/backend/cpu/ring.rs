//! Context parallelism's ring steps of the memory-efficient attention
//! ([`super::flash`]): a rank's query rows meet one block of keys and values
//! at a time — its own, then each other rank's as they come round the ring
//! — each at its positions in the whole sequence (a key counts for a query
//! at or after it). The forward merges each block into the running output
//! and log-sum-exp (the output rescaled as the row maximum grows, as inside
//! one block); the backward, from the final output and log-sum-exp, adds
//! each block's share to the queries' gradients and to the block's keys'
//! and values' gradients, which travel with the block back to its holder.
//! Tiles, the online softmax and the recomputed probabilities are
//! [`super::flash`]'s; the (sequence, head) pairs run in parallel.

use super::attention::scratch;
use super::flash::{backward_tile, blocks_of, count, forward_tile, BLOCK, ITEMS, KEYS, TILE};
use super::lanes;
use super::par;

/// One forward ring step: into `out[B,R,C]` and `lse[B,NH,R]` (the query
/// rows `qrows` of `q[B,R,3C]`; `first`: nothing merged yet) the attention
/// over the keys and values of `kv[B,K,3C]` at positions `krows` (its k and
/// v parts). A row that sees no key of the block is left as it was (`lse`
/// −∞ until one does).
#[allow(clippy::too_many_arguments)]
pub fn ring_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    kv: &[f32],
    (b, c, nh): (usize, usize, usize),
    qrows: &[(usize, usize)],
    krows: &[(usize, usize)],
    first: bool,
) {
    let _k = super::profile::span("ring_forward");
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    let (tr, tk) = (count(qrows), count(krows));
    let (qblocks, kblocks) = (blocks_of(qrows, BLOCK), blocks_of(krows, KEYS));
    let old_out = &*out;
    let old_lse = &*lse;
    let merged = scratch(&ITEMS, b * nh * tr * (hs + 1), |items_buf| {
        let mut items: Vec<&mut [f32]> = items_buf.chunks_mut(tr * (hs + 1)).collect();
        par::each_mut(&mut items, |k, item| {
            let (bi, h) = (k / nh, k % nh);
            let (o, l) = item.split_at_mut(tr * hs);
            for r in 0..tr {
                let at = (bi * tr + r) * c + h * hs;
                match first {
                    true => o[r * hs..(r + 1) * hs].fill(0.0),
                    false => o[r * hs..(r + 1) * hs].copy_from_slice(&old_out[at..at + hs]),
                }
                l[r] = match first {
                    true => f32::NEG_INFINITY,
                    false => old_lse[(bi * nh + h) * tr + r],
                };
            }
            let qo = bi * tr * c3 + h * hs;
            let ko = bi * tk * c3 + h * hs;
            scratch(&TILE, BLOCK * KEYS + 2 * BLOCK, |buf| {
                let (s, stats) = buf.split_at_mut(BLOCK * KEYS);
                let (m, sum) = stats.split_at_mut(BLOCK);
                for &(r0, r1, lr) in &qblocks {
                    let nr = r1 - r0;
                    // The merged output so far, as a running maximum (its
                    // log-sum-exp) and sum (1), accumulating in place.
                    let acc = &mut o[lr * hs..(lr + nr) * hs];
                    for i in 0..nr {
                        m[i] = l[lr + i];
                        sum[i] = if m[i].is_finite() { 1.0 } else { 0.0 };
                    }
                    let mut seen = false;
                    for &(k0, k1, lk) in kblocks.iter().filter(|(k0, _, _)| *k0 < r1) {
                        let nc = k1.min(r1) - k0;
                        seen = true;
                        let src = (
                            &q[qo + lr * c3..],
                            &kv[ko + c + lk * c3..],
                            &kv[ko + 2 * c + lk * c3..],
                        );
                        let stats = (&mut m[..], &mut sum[..]);
                        forward_tile(s, stats, acc, src, (nr, nc, hs, c3), (r0, k0), scale);
                    }
                    if !seen {
                        continue;
                    }
                    for i in 0..nr {
                        if sum[i] > 0.0 {
                            let inv = 1.0 / sum[i];
                            for x in &mut acc[i * hs..(i + 1) * hs] {
                                *x *= inv;
                            }
                            l[lr + i] = m[i] + sum[i].ln();
                        }
                    }
                }
            })
        });
        // The merged rows, by (sequence, row), then each head's lse.
        let mut rows = vec![0.0f32; b * tr * c];
        let mut lses = vec![0.0f32; b * nh * tr];
        for (k, item) in items.iter().enumerate() {
            let (bi, h) = (k / nh, k % nh);
            let (o, l) = item.split_at(tr * hs);
            for r in 0..tr {
                rows[(bi * tr + r) * c + h * hs..][..hs].copy_from_slice(&o[r * hs..][..hs]);
            }
            lses[(bi * nh + h) * tr..][..tr].copy_from_slice(l);
        }
        (rows, lses)
    });
    out[..b * tr * c].copy_from_slice(&merged.0);
    lse[..b * nh * tr].copy_from_slice(&merged.1);
}

/// One backward ring step: from the query rows' final `out` and `lse` (and
/// their output gradient `dout[B,R,C]`), add into the query part of
/// `dq[B,R,3C]` and into the key and value parts of `dkv[B,K,3C]` the
/// gradients through the keys and values of `kv` at positions `krows`.
#[allow(clippy::too_many_arguments)]
pub fn ring_backward(
    dq: &mut [f32],
    dkv: &mut [f32],
    dout: &[f32],
    (q, kv): (&[f32], &[f32]),
    (out, lse): (&[f32], &[f32]),
    (b, c, nh): (usize, usize, usize),
    qrows: &[(usize, usize)],
    krows: &[(usize, usize)],
) {
    let _k = super::profile::span("ring_backward");
    let hs = c / nh;
    let scale = 1.0 / (hs as f32).sqrt();
    let c3 = 3 * c;
    let (tr, tk) = (count(qrows), count(krows));
    let (qblocks, kblocks) = (blocks_of(qrows, BLOCK), blocks_of(krows, KEYS));
    let per = (tr + 2 * tk) * hs;
    scratch(&ITEMS, b * nh * per, |grads| {
        let mut items: Vec<&mut [f32]> = grads.chunks_mut(per).collect();
        par::each_mut(&mut items, |k, item| {
            let (bi, h) = (k / nh, k % nh);
            item.fill(0.0);
            let (gq, rest) = item.split_at_mut(tr * hs);
            let (gk, gv) = rest.split_at_mut(tk * hs);
            let qo = bi * tr * c3 + h * hs;
            let ko = bi * tk * c3 + h * hs;
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
                for &(k0, k1, lk) in &kblocks {
                    for &(r0, r1, lr) in qblocks.iter().filter(|(_, r1, _)| *r1 > k0) {
                        let (nr, nc) = (r1 - r0, k1.min(r1) - k0);
                        let src = (
                            &q[qo + lr * c3..],
                            &kv[ko + c + lk * c3..],
                            &kv[ko + 2 * c + lk * c3..],
                            &dout[dof + lr * c..],
                        );
                        let grads = (&mut gq[lr * hs..], &mut gk[lk * hs..], &mut gv[lk * hs..]);
                        let stats = (&d[lr..], &l[lr..]);
                        let shape = (nr, nc, hs, c3, c);
                        backward_tile((p, dp), stats, src, grads, shape, (r0, k0), scale);
                    }
                }
            })
        });
        // Each item's parts into their heads' columns (each element gets
        // one item's value).
        par::rows_mut(&mut dq[..b * tr * c3], c3, |r0, block| {
            for (i, row) in block.chunks_exact_mut(c3).enumerate() {
                let (bi, ti) = ((r0 + i) / tr, (r0 + i) % tr);
                for h in 0..nh {
                    let src = &items[bi * nh + h][ti * hs..][..hs];
                    for (x, y) in row[h * hs..][..hs].iter_mut().zip(src) {
                        *x += y;
                    }
                }
            }
        });
        par::rows_mut(&mut dkv[..b * tk * c3], c3, |r0, block| {
            for (i, row) in block.chunks_exact_mut(c3).enumerate() {
                let (bi, ti) = ((r0 + i) / tk, (r0 + i) % tk);
                for h in 0..nh {
                    let item = &items[bi * nh + h];
                    let (gk, gv) = (
                        &item[(tr + ti) * hs..][..hs],
                        &item[(tr + tk + ti) * hs..][..hs],
                    );
                    for (x, y) in row[c + h * hs..][..hs].iter_mut().zip(gk) {
                        *x += y;
                    }
                    for (x, y) in row[2 * c + h * hs..][..hs].iter_mut().zip(gv) {
                        *x += y;
                    }
                }
            }
        });
    })
}

#[cfg(test)]
mod tests {
    use super::super::flash::tests::{chunks, rows_of, values};
    use super::super::flash::{flash_backward, flash_forward};
    use super::*;

    /// Every rank's rows by the ring (its own block first, then each other
    /// rank's in ring order) equal the whole sequence's rows, and the ring's
    /// gradients, summed onto their holders, equal the whole sequence's.
    #[test]
    fn the_ring_gives_the_whole_sequences_rows_and_gradients() {
        for (b, t, c, nh, cp) in [(2, 152, 64, 4, 2), (1, 128, 32, 2, 4), (1, 600, 32, 2, 2)] {
            let qkv = values(b * t * 3 * c, t as u32 + 3);
            let dout = values(b * t * c, 11 + t as u32);
            let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
            flash_forward(&mut out, &mut lse, &qkv, b, t, c, nh, &[(0, t)]);
            let mut whole = vec![0.0; b * t * 3 * c];
            flash_backward(&mut whole, &dout, &qkv, &out, &lse, b, t, c, nh, &[(0, t)]);
            let chunk = t / (2 * cp);
            let tr = 2 * chunk;
            let local =
                |full: &[f32], w: usize, r: usize| rows_of(full, w, (b, t), &chunks(t, cp, r));
            let mut grads: Vec<Vec<f32>> = (0..cp).map(|_| vec![0.0; b * tr * 3 * c]).collect();
            for r in 0..cp {
                let mine = local(&qkv, 3 * c, r);
                let (mut o, mut l) = (vec![0.0; b * tr * c], vec![0.0; b * nh * tr]);
                for s in 0..cp {
                    let src = (r + cp - s) % cp;
                    let kv = local(&qkv, 3 * c, src);
                    let shape = (b, c, nh);
                    ring_forward(
                        &mut o,
                        &mut l,
                        &mine,
                        &kv,
                        shape,
                        &chunks(t, cp, r),
                        &chunks(t, cp, src),
                        s == 0,
                    );
                }
                let want = local(&out, c, r);
                for (i, (x, y)) in o.iter().zip(&want).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                        "cp {cp} rank {r}: out[{i}] {x} vs {y}"
                    );
                }
                let g = local(&dout, c, r);
                let mut dq = vec![0.0; b * tr * 3 * c];
                for s in 0..cp {
                    let src = (r + cp - s) % cp;
                    let kv = local(&qkv, 3 * c, src);
                    ring_backward(
                        &mut dq,
                        &mut grads[src],
                        &g,
                        (&mine, &kv),
                        (&o, &l),
                        (b, c, nh),
                        &chunks(t, cp, r),
                        &chunks(t, cp, src),
                    );
                }
                for (x, y) in grads[r].iter_mut().zip(&dq) {
                    *x += y;
                }
            }
            for (r, got) in grads.iter().enumerate() {
                let want = local(&whole, 3 * c, r);
                for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                        "cp {cp} rank {r}: dqkv[{i}] {x} vs {y}"
                    );
                }
            }
        }
    }
}
