//! The mixture-of-experts half of a MoE block: `out = x + Σ_j w_j ·
//! expert_{e_j}(ln2(x))`, with its router, capacity and load-balancing loss.
//! Forward, backward-for-input (which stashes what the weight pass reads) and
//! backward-for-weights, composed from this folder's kernels.
//!
//! The arithmetic, as a user of Megatron or DeepSpeed would expect it:
//! - **Router**: `probs = softmax(ln2(x) · Wrᵀ)` over the experts (no bias);
//!   each token picks its `top_k` largest (ties: the lower expert index), and
//!   the picked probabilities are renormalised to sum to 1 (Qwen3's
//!   `norm_topk_prob`, Mixtral).
//! - **Experts**: GPT-2 MLPs (`c_fc`, GELU, `c_proj`) of width `hidden`.
//! - **Capacity** (when `capacity_factor` is set): each expert takes at most
//!   `ceil(capacity_factor × tokens × top_k / experts)` assignments of the
//!   tokens routed together (one forward on one device: a microbatch's
//!   share). First choices are served before second choices, each in token
//!   order (GShard); an assignment past capacity is dropped: it adds nothing
//!   and the token keeps its residual. Dropped assignments are counted.
//! - **Load-balancing loss**, sequence-wise (DeepSeek-V3): per sequence,
//!   `aux = E · Σ_e f_e · P_e` with `f_e` the share of the sequence's top-k
//!   choices that picked `e` (before drops, not differentiated) and `P_e` the
//!   mean router probability of `e`; the training loss adds `aux_loss_coef ×`
//!   the mean of `aux` over the global batch's sequences. Per sequence, so
//!   the loss is the same however sequences are split into microbatches and
//!   data-parallel replicas.

use super::elementwise::{gelu_backward, gelu_forward};
use super::gpt::{grad_of, param_of, Tensors};
use super::layernorm::{layernorm_backward_input, layernorm_backward_weight, layernorm_forward};
use super::matmul::{matmul_backward_input, matmul_backward_weight, matmul_forward};
use crate::model::params::expert_param;
use crate::model::MoeConfig;

/// Marks an assignment dropped for capacity.
const DROPPED: u32 = u32::MAX;

/// Shapes of one MoE forward: `n` tokens in sequences of `t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    pub n: usize,
    pub t: usize,
    pub c: usize,
    pub e: usize,
    pub k: usize,
    pub hid: usize,
}

impl MoeDims {
    pub fn new(moe: &MoeConfig, n: usize, t: usize, c: usize) -> Self {
        MoeDims {
            n,
            t,
            c,
            e: moe.experts as usize,
            k: moe.top_k as usize,
            hid: moe.hidden_width(c as u32) as usize,
        }
    }
}

/// Where each token's choices went.
#[derive(Clone, Debug, Default)]
pub struct Routing {
    /// `[n, k]`: the expert of each choice.
    pub choice: Vec<u32>,
    /// `[n, k]`: its renormalised weight.
    pub weight: Vec<f32>,
    /// `[n, k]`: its row in the expert's batch, or dropped.
    pub slot: Vec<u32>,
    /// Per expert: the assignments (`token × k + j`) it runs, in row order.
    pub rows: Vec<Vec<u32>>,
    /// Assignments dropped for capacity.
    pub dropped: u64,
}

/// What the MoE half keeps from forward for backward.
#[derive(Clone, Debug, Default)]
pub struct MoeCache {
    pub layer: u32,
    pub dims: Option<MoeDims>,
    pub aux_coef: f32,
    pub x: Vec<f32>,
    pub ln: Vec<f32>,
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
    /// `[n, e]` router probabilities.
    pub probs: Vec<f32>,
    pub routing: Routing,
    /// Per expert: `c_fc` output, its GELU and `c_proj` output, `[rows, ·]`.
    pub fc: Vec<Vec<f32>>,
    pub act: Vec<Vec<f32>>,
    pub y: Vec<Vec<f32>>,
}

fn floats(v: &[f32]) -> u64 {
    v.len() as u64 * 4
}

impl MoeCache {
    pub fn bytes(&self) -> u64 {
        let r = &self.routing;
        let per_expert = |v: &Vec<Vec<f32>>| v.iter().map(|x| floats(x)).sum::<u64>();
        [&self.x, &self.ln, &self.mean, &self.rstd, &self.probs, &r.weight]
            .iter()
            .map(|v| floats(v))
            .sum::<u64>()
            + (r.choice.len() + r.slot.len() + r.rows.iter().map(Vec::len).sum::<usize>()) as u64
                * 4
            + per_expert(&self.fc)
            + per_expert(&self.act)
            + per_expert(&self.y)
    }

    /// What the weight pass reads (inputs of the matmuls and the layernorm,
    /// the routing); the rest is freed at `BI`.
    pub fn keep_for_weights(mut self) -> Self {
        self.probs = Vec::new();
        self.fc = Vec::new();
        self.y = Vec::new();
        self
    }
}

/// Gradients the weight pass needs, produced by the input pass.
#[derive(Clone, Debug, Default)]
pub struct MoeStash {
    /// Per expert: gradient of its output rows and of its `c_fc` output.
    pub dy: Vec<Vec<f32>>,
    pub dfc: Vec<Vec<f32>>,
    /// `[n, e]` gradient of the router logits; `[n, c]` of ln2's output.
    pub dlogits: Vec<f32>,
    pub dln: Vec<f32>,
}

impl MoeStash {
    pub fn bytes(&self) -> u64 {
        let per_expert = |v: &Vec<Vec<f32>>| v.iter().map(|x| floats(x)).sum::<u64>();
        per_expert(&self.dy) + per_expert(&self.dfc) + floats(&self.dlogits) + floats(&self.dln)
    }
}

/// Softmax of each row of `logits[n, e]`.
fn softmax_rows(logits: &[f32], e: usize) -> Vec<f32> {
    let mut probs = vec![0.0; logits.len()];
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
    probs
}

/// Top-k choices of every token, renormalised weights, and the capacity
/// assignment (first choices first, each in token order).
pub fn route(probs: &[f32], d: MoeDims, capacity_factor: Option<f64>) -> Routing {
    let _k = super::profile::span("moe_route");
    let MoeDims { n, e, k, .. } = d;
    let mut choice = vec![0u32; n * k];
    let mut weight = vec![0.0f32; n * k];
    for t in 0..n {
        let p = &probs[t * e..][..e];
        let ch = &mut choice[t * k..][..k];
        // Selection by repeated max: k is small; ties go to the lower index.
        let mut taken = vec![false; e];
        let mut sum = 0.0f32;
        for c in ch.iter_mut() {
            let mut best = usize::MAX;
            for (x, &px) in p.iter().enumerate() {
                if !taken[x] && (best == usize::MAX || px > p[best]) {
                    best = x;
                }
            }
            taken[best] = true;
            *c = best as u32;
            sum += p[best];
        }
        for (w, c) in weight[t * k..][..k].iter_mut().zip(ch.iter()) {
            *w = p[*c as usize] / sum;
        }
    }
    let cap = capacity_factor.map_or(usize::MAX, |cf| {
        // cf ≤ 1e6 and n·k ≤ 2^60 (checked by the config): finite.
        (cf * (n * k) as f64 / e as f64).ceil() as usize
    });
    let mut rows: Vec<Vec<u32>> = vec![Vec::new(); e];
    let mut slot = vec![DROPPED; n * k];
    let mut dropped = 0u64;
    for j in 0..k {
        for t in 0..n {
            let a = t * k + j;
            let r = &mut rows[choice[a] as usize];
            if r.len() < cap {
                slot[a] = r.len() as u32;
                r.push(a as u32);
            } else {
                dropped += 1;
            }
        }
    }
    Routing {
        choice,
        weight,
        slot,
        rows,
        dropped,
    }
}

/// Rows of `src[·, c]` picked by the assignments `rows` (`token × k + j`).
fn gather(src: &[f32], rows: &[u32], k: usize, c: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * c);
    for &a in rows {
        let t = a as usize / k;
        out.extend_from_slice(&src[t * c..][..c]);
    }
    out
}

/// Per-sequence choice shares `f[s, e]` (before drops).
fn choice_shares(r: &Routing, d: MoeDims) -> Vec<f32> {
    let MoeDims { n, t, e, k, .. } = d;
    let seqs = n / t;
    let mut f = vec![0.0f32; seqs * e];
    let per = 1.0 / (t * k) as f32;
    for (a, &x) in r.choice.iter().enumerate() {
        let s = a / k / t;
        f[s * e + x as usize] += per;
    }
    f
}

/// Forward of layer `l`'s MoE half on `x[n, c]`: the output, the cache, and
/// the load-balancing loss to add to the summed token losses
/// (`aux_loss_coef × t × Σ_sequences aux`).
pub fn moe_forward(
    params: &Tensors,
    l: u32,
    moe: &MoeConfig,
    x: Vec<f32>,
    d: MoeDims,
) -> (Vec<f32>, MoeCache, f64) {
    let MoeDims { n, t, c, e, k, hid } = d;
    let name = |s: &str| format!("h.{l}.{s}");
    let (mut ln, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_forward(
        &mut ln,
        &mut mean,
        &mut rstd,
        &x,
        param_of(params, &name("ln_2.weight")),
        param_of(params, &name("ln_2.bias")),
        n,
        c,
    );
    let mut logits = vec![0.0; n * e];
    matmul_forward(
        &mut logits,
        &ln,
        param_of(params, &name("mlp.router.weight")),
        None,
        n,
        c,
        e,
    );
    let probs = softmax_rows(&logits, e);
    let routing = route(&probs, d, moe.capacity_factor);
    let (mut fcs, mut acts, mut ys) = (Vec::new(), Vec::new(), Vec::new());
    for (x_, rows) in routing.rows.iter().enumerate() {
        let m = rows.len();
        let (mut fc, mut act, mut y) = (vec![0.0; m * hid], vec![0.0; m * hid], vec![0.0; m * c]);
        if m > 0 {
            let inp = gather(&ln, rows, k, c);
            let w = |s: &str| param_of(params, &expert_param(l, x_, s));
            matmul_forward(&mut fc, &inp, w("c_fc.weight"), Some(w("c_fc.bias")), m, c, hid);
            gelu_forward(&mut act, &fc);
            matmul_forward(&mut y, &act, w("c_proj.weight"), Some(w("c_proj.bias")), m, hid, c);
        }
        fcs.push(fc);
        acts.push(act);
        ys.push(y);
    }
    // Combine in token order, choices in order: the same additions whatever
    // the capacity did.
    let mut out = x.clone();
    for tok in 0..n {
        let o = &mut out[tok * c..][..c];
        for j in 0..k {
            let a = tok * k + j;
            let s = routing.slot[a];
            if s == DROPPED {
                continue;
            }
            let w = routing.weight[a];
            let y = &ys[routing.choice[a] as usize][s as usize * c..][..c];
            for (oi, yi) in o.iter_mut().zip(y) {
                *oi += w * yi;
            }
        }
    }
    // Sequence-wise balance loss.
    let f = choice_shares(&routing, d);
    let mut aux = 0.0f64;
    for s in 0..n / t {
        let mut p_mean = vec![0.0f64; e];
        for tok in s * t..(s + 1) * t {
            for (pm, p) in p_mean.iter_mut().zip(&probs[tok * e..][..e]) {
                *pm += *p as f64;
            }
        }
        let dot: f64 = (0..e)
            .map(|x| f[s * e + x] as f64 * p_mean[x] / t as f64)
            .sum();
        aux += e as f64 * dot;
    }
    let aux_loss = moe.aux_loss_coef * t as f64 * aux;
    let cache = MoeCache {
        layer: l,
        dims: Some(d),
        aux_coef: moe.aux_loss_coef as f32,
        x,
        ln,
        mean,
        rstd,
        probs,
        routing,
        fc: fcs,
        act: acts,
        y: ys,
    };
    (out, cache, aux_loss)
}

/// Backward for the input from `dout[n, c]` (`loss_scale` = 1 / tokens of
/// the global batch): the input gradient and the weight pass's stash.
pub fn moe_backward_input(
    params: &Tensors,
    cache: &MoeCache,
    dout: Vec<f32>,
    loss_scale: f32,
) -> (Vec<f32>, MoeStash) {
    let d = cache.dims.expect("a MoE cache has its shapes");
    let MoeDims { n, t, c, e, k, hid } = d;
    let l = cache.layer;
    let name = |s: &str| format!("h.{l}.{s}");
    let r = &cache.routing;
    // Through the combine: each kept assignment's output gradient and the
    // gradient of its weight.
    let mut dweight = vec![0.0f32; n * k];
    let mut dln = vec![0.0f32; n * c];
    let (mut dys, mut dfcs) = (Vec::with_capacity(e), Vec::with_capacity(e));
    for (x_, rows) in r.rows.iter().enumerate() {
        let m = rows.len();
        let mut dy = vec![0.0f32; m * c];
        for (row, &a) in rows.iter().enumerate() {
            let tok = a as usize / k;
            let g = &dout[tok * c..][..c];
            let y = &cache.y[x_][row * c..][..c];
            dweight[a as usize] = g.iter().zip(y).map(|(a, b)| a * b).sum();
            let w = r.weight[a as usize];
            for (di, gi) in dy[row * c..][..c].iter_mut().zip(g) {
                *di = w * gi;
            }
        }
        let mut dfc = vec![0.0f32; m * hid];
        if m > 0 {
            let w = |s: &str| param_of(params, &expert_param(l, x_, s));
            let mut dact = vec![0.0f32; m * hid];
            matmul_backward_input(&mut dact, &dy, w("c_proj.weight"), m, hid, c, false);
            gelu_backward(&mut dfc, &cache.fc[x_], &dact);
            let mut dinp = vec![0.0f32; m * c];
            matmul_backward_input(&mut dinp, &dfc, w("c_fc.weight"), m, c, hid, false);
            for (row, &a) in rows.iter().enumerate() {
                let tok = a as usize / k;
                for (di, gi) in dln[tok * c..][..c].iter_mut().zip(&dinp[row * c..][..c]) {
                    *di += gi;
                }
            }
        }
        dys.push(dy);
        dfcs.push(dfc);
    }
    // Through the renormalisation w_j = p_j / Σ p, the balance loss and the
    // softmax, to the router logits.
    let f = choice_shares(r, d);
    let aux = cache.aux_coef * e as f32 * loss_scale;
    let mut dlogits = vec![0.0f32; n * e];
    for tok in 0..n {
        let p = &cache.probs[tok * e..][..e];
        let mut dp: Vec<f32> = f[(tok / t) * e..][..e].iter().map(|fx| aux * fx).collect();
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
    matmul_backward_input(
        &mut dln,
        &dlogits,
        param_of(params, &name("mlp.router.weight")),
        n,
        c,
        e,
        true,
    );
    let mut dx = dout;
    layernorm_backward_input(
        &mut dx,
        &dln,
        &cache.x,
        param_of(params, &name("ln_2.weight")),
        &cache.mean,
        &cache.rstd,
        n,
        c,
    );
    (
        dx,
        MoeStash {
            dy: dys,
            dfc: dfcs,
            dlogits,
            dln,
        },
    )
}

/// Backward for the weights: accumulate the router's, the experts' and
/// ln2's gradients.
pub fn moe_backward_weight(grads: &mut Tensors, cache: &MoeCache, stash: &MoeStash) {
    let d = cache.dims.expect("a MoE cache has its shapes");
    let MoeDims { n, c, e, k, hid, .. } = d;
    let l = cache.layer;
    let name = |s: &str| format!("h.{l}.{s}");
    for (x_, rows) in cache.routing.rows.iter().enumerate() {
        let m = rows.len();
        if m == 0 {
            continue;
        }
        let mut lin = |w: &str, b: &str, dout: &[f32], inp: &[f32], ic: usize, oc: usize| {
            let mut db = std::mem::take(grad_of(grads, &expert_param(l, x_, b)));
            matmul_backward_weight(
                grad_of(grads, &expert_param(l, x_, w)),
                Some(&mut db),
                dout,
                inp,
                m,
                ic,
                oc,
            );
            *grad_of(grads, &expert_param(l, x_, b)) = db;
        };
        lin("c_proj.weight", "c_proj.bias", &stash.dy[x_], &cache.act[x_], hid, c);
        let inp = gather(&cache.ln, rows, k, c);
        lin("c_fc.weight", "c_fc.bias", &stash.dfc[x_], &inp, c, hid);
    }
    matmul_backward_weight(
        grad_of(grads, &name("mlp.router.weight")),
        None,
        &stash.dlogits,
        &cache.ln,
        n,
        c,
        e,
    );
    let mut db = std::mem::take(grad_of(grads, &name("ln_2.bias")));
    layernorm_backward_weight(
        grad_of(grads, &name("ln_2.weight")),
        &mut db,
        &stash.dln,
        &cache.x,
        &cache.mean,
        &cache.rstd,
        n,
        c,
    );
    *grad_of(grads, &name("ln_2.bias")) = db;
}
