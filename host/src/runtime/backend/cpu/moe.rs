//! The mixture-of-experts kernels: the router's softmax, moving token rows
//! to and from the experts' batches, the weighted combine and its backward,
//! and the router's gradient (the arithmetic: `runtime/model/moe.rs`). Token by
//! token on the calling thread, each sum in a fixed order.

use crate::runtime::backend::Routing;

/// Marks an assignment dropped for capacity.
use crate::runtime::backend::routing::DROPPED;

/// Softmax of each row of `logits[·, e]`.
pub fn softmax_rows(probs: &mut [f32], logits: &[f32], e: usize) {
    let _k = super::profile::span("moe_router_softmax");
    for (p, l) in probs.chunks_exact_mut(e).zip(logits.chunks_exact(e)) {
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (pi, li) in p.iter_mut().zip(l) {
            *pi = (li - m).exp();
            sum += *pi;
        }
        let inv = 1.0 / sum;
        p.iter_mut().for_each(|x| *x *= inv);
    }
}

/// `out[at..]` = the rows of `src[·, c]` of the assignments' tokens.
pub fn gather_rows(
    out: &mut [f32],
    at: usize,
    src: &[f32],
    assignments: &[u32],
    k: usize,
    c: usize,
) {
    let mut o = at;
    for &a in assignments {
        let t = a as usize / k;
        out[o..o + c].copy_from_slice(&src[t * c..][..c]);
        o += c;
    }
}

/// `dst[token] += src[at..]`, a row per assignment.
pub fn scatter_add_rows(
    dst: &mut [f32],
    src: &[f32],
    at: usize,
    assignments: &[u32],
    k: usize,
    c: usize,
) {
    let mut at = at;
    for &a in assignments {
        let tok = a as usize / k;
        for (di, gi) in dst[tok * c..][..c].iter_mut().zip(&src[at..at + c]) {
            *di += gi;
        }
        at += c;
    }
}

/// `out[token] += weight · y` over every kept choice, token by token,
/// choices in order: the same additions whatever the capacity did.
pub fn combine<T: AsRef<[f32]>>(out: &mut [f32], ys: &[T], r: &Routing, c: usize) {
    let _k = super::profile::span("moe_combine");
    let k = r.k;
    let n = r.choice.len() / k.max(1);
    for tok in 0..n {
        let o = &mut out[tok * c..][..c];
        for j in 0..k {
            let a = tok * k + j;
            let s = r.slot[a];
            if s == DROPPED {
                continue;
            }
            let w = r.weight[a];
            let y = &ys[r.choice[a] as usize].as_ref()[s as usize * c..][..c];
            for (oi, yi) in o.iter_mut().zip(y) {
                *oi += w * yi;
            }
        }
    }
}

/// Backward of [`combine`]: per expert and row, the choice's weight
/// gradient and its output's gradient.
pub fn combine_backward<T: AsRef<[f32]>, U: AsMut<[f32]>>(
    dweight: &mut [f32],
    dys: &mut [U],
    dout: &[f32],
    ys: &[T],
    r: &Routing,
    c: usize,
) {
    let _k = super::profile::span("moe_combine_backward");
    let k = r.k;
    for (x_, rows) in r.rows.iter().enumerate() {
        let dy = dys[x_].as_mut();
        for (row, &a) in rows.iter().enumerate() {
            let tok = a as usize / k;
            let g = &dout[tok * c..][..c];
            let y = &ys[x_].as_ref()[row * c..][..c];
            dweight[a as usize] = g.iter().zip(y).map(|(a, b)| a * b).sum();
            let w = r.weight[a as usize];
            for (di, gi) in dy[row * c..][..c].iter_mut().zip(g) {
                *di = w * gi;
            }
        }
    }
}

/// The router logits' gradient: each token's choice-weight gradients
/// through the renormalisation `w_j = p_j / Σ p`, plus the balance loss's
/// `aux · f[sequence, x]`, then through the softmax.
#[allow(clippy::too_many_arguments)]
pub fn router_backward(
    dlogits: &mut [f32],
    probs: &[f32],
    dweight: &[f32],
    shares: &[f32],
    aux: f32,
    r: &Routing,
    t: usize,
    e: usize,
) {
    let _k = super::profile::span("moe_router_backward");
    let k = r.k;
    let n = r.choice.len() / k.max(1);
    for tok in 0..n {
        let p = &probs[tok * e..][..e];
        let mut dp: Vec<f32> = shares[(tok / t) * e..][..e]
            .iter()
            .map(|fx| aux * fx)
            .collect();
        let ch = &r.choice[tok * k..][..k];
        let w = &r.weight[tok * k..][..k];
        let dw = &dweight[tok * k..][..k];
        let sum: f32 = ch.iter().map(|x| p[*x as usize]).sum();
        let wdw: f32 = w.iter().zip(dw).map(|(a, b)| a * b).sum();
        for (x, g) in ch.iter().zip(dw) {
            dp[*x as usize] += (g - wdw) / sum;
        }
        let pdp: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        for ((dl, px), g) in dlogits[tok * e..][..e].iter_mut().zip(p).zip(&dp) {
            *dl = px * (g - pdp);
        }
    }
}
