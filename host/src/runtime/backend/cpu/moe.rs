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
//! - **Expert parallelism**: with an EP group of `g` devices, device `r`
//!   holds experts `r·E/g … (r+1)·E/g − 1`. Routing stays local; the rows each
//!   expert runs go to its owner and the outputs come back through an
//!   [`Exchange`] (an all-to-all over the group; the identity on one device),
//!   twice in forward (dispatch, combine) and twice in the input backward.
//!   An expert runs the rows of every source in group order, so per row the
//!   arithmetic is the one-device arithmetic; only weight-gradient sums see a
//!   different row order.

use super::elementwise::{gelu_backward, gelu_forward};
use super::gpt::{grad_of, layernorm_weight, linear_weight, param_of, Tensors};
use super::layernorm::{layernorm_backward_input, layernorm_forward};
use super::matmul::{matmul_backward_input, matmul_backward_weight, matmul_forward};
use crate::model::params::expert_param;
use crate::model::MoeConfig;
use std::sync::Arc;

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

/// This device's place in its expert-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertGroup {
    pub size: usize,
    pub rank: usize,
}

impl ExpertGroup {
    /// One device holding every expert.
    pub const ALONE: ExpertGroup = ExpertGroup { size: 1, rank: 0 };

    /// The experts member `rank` holds (`E` divisible by the size: checked
    /// by `shard`).
    pub fn experts_of(&self, e: usize, rank: usize) -> std::ops::Range<usize> {
        let per = e / self.size.max(1);
        rank * per..(rank + 1) * per
    }
    pub fn local(&self, e: usize) -> std::ops::Range<usize> {
        self.experts_of(e, self.rank)
    }
}

/// An all-to-all over the EP group: one chunk per member in, one chunk from
/// each member out. `phase` tells the four exchanges of a layer apart.
pub type Exchange<'a, E> = dyn FnMut(u32, Vec<Vec<f32>>) -> Result<Vec<Arc<Vec<f32>>>, E> + 'a;

/// The exchange of one device alone: its chunk comes back.
pub fn alone(_: u32, chunks: Vec<Vec<f32>>) -> Result<Vec<Arc<Vec<f32>>>, String> {
    Ok(chunks.into_iter().map(Arc::new).collect())
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

/// What the MoE half keeps from forward for backward: the dispatch phase's
/// routing side (this device's tokens), the combine's inputs, and the
/// experts phase's side (this device's experts, the rows of every source).
#[derive(Clone, Debug)]
pub struct MoeCache {
    pub routed: MoeRouted,
    /// Per expert (all of them): the outputs of this device's rows.
    pub ys: Vec<Arc<Vec<f32>>>,
    pub experts: MoeExperts,
}

fn floats(v: &[f32]) -> u64 {
    v.len() as u64 * 4
}

fn floats_each<T: AsRef<[f32]>>(v: &[T]) -> u64 {
    v.iter().map(|x| floats(x.as_ref())).sum()
}

impl MoeCache {
    pub fn bytes(&self) -> u64 {
        self.routed.bytes() + self.ys.iter().map(|y| floats(y)).sum::<u64>() + self.experts.bytes()
    }

    /// What the weight pass reads (inputs of the matmuls and the layernorm,
    /// the routing); the rest is freed at `BI`.
    pub fn keep_for_weights(mut self) -> Self {
        self.routed.probs = Vec::new();
        self.experts.fc = Vec::new();
        self.ys = Vec::new();
        self
    }
}

/// Gradients the weight pass needs, produced by the input pass.
#[derive(Clone, Debug, Default)]
pub struct MoeStash {
    /// Per local expert: gradient of its output rows and of its `c_fc` output.
    pub dy: Vec<Vec<f32>>,
    pub dfc: Vec<Vec<f32>>,
    /// `[n, e]` gradient of the router logits; `[n, c]` of ln2's output.
    pub dlogits: Vec<f32>,
    pub dln: Vec<f32>,
}

impl MoeStash {
    pub fn bytes(&self) -> u64 {
        floats_each(&self.dy) + floats_each(&self.dfc) + floats(&self.dlogits) + floats(&self.dln)
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
    let mut taken = vec![false; e];
    for t in 0..n {
        let p = &probs[t * e..][..e];
        let ch = &mut choice[t * k..][..k];
        // Selection by repeated max: k is small; ties go to the lower index.
        taken.iter_mut().for_each(|x| *x = false);
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

/// Rows of `src[·, c]` picked by the assignments `rows` (`token × k + j`),
/// appended to `out`.
fn gather_into(out: &mut Vec<f32>, src: &[f32], rows: &[u32], k: usize, c: usize) {
    for &a in rows {
        let t = a as usize / k;
        out.extend_from_slice(&src[t * c..][..c]);
    }
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

/// Split the per-expert row blocks `blocks` (each `rows × width`) by
/// member: member `p` gets the blocks of its experts, concatenated.
fn by_owner(blocks: &[Vec<f32>], g: ExpertGroup, e: usize) -> Vec<Vec<f32>> {
    (0..g.size)
        .map(|p| {
            g.experts_of(e, p)
                .flat_map(|x| blocks[x].iter().copied())
                .collect()
        })
        .collect()
}

/// Cut each member's chunk into per-expert blocks of the given row counts.
fn split_blocks(chunk: &[f32], rows: impl Iterator<Item = usize>, width: usize) -> Vec<Vec<f32>> {
    let mut at = 0;
    rows.map(|m| {
        let b = chunk[at..at + m * width].to_vec();
        at += m * width;
        b
    })
    .collect()
}

/// Check a received chunk's length before it is cut.
fn expect_len<E: From<String>>(what: &str, got: usize, want: usize) -> Result<(), E> {
    match got == want {
        true => Ok(()),
        false => Err(format!("MoE {what}: received {got} floats, expected {want}").into()),
    }
}

/// Forward of layer `l`'s MoE half on `x[n, c]` in the EP group `group`
/// (every member calls it together): the output, the cache, and the
/// load-balancing loss to add to the summed token losses (`aux_loss_coef ×
/// t × Σ_sequences aux`). The three phases ([`moe_dispatch`],
/// [`moe_experts`], [`moe_combine`]) with the two exchanges between them.
pub fn moe_forward<E: From<String>>(
    params: &Tensors,
    l: u32,
    moe: &MoeConfig,
    x: Vec<f32>,
    d: MoeDims,
    group: ExpertGroup,
    exchange: &mut Exchange<'_, E>,
) -> Result<(Vec<f32>, MoeCache, f64), E> {
    let (routed, chunks) = moe_dispatch(params, l, moe, x, d, group);
    let got = exchange(0, chunks)?;
    let (experts, back) = moe_experts(params, l, d, group, &got)?;
    drop(got);
    let got = exchange(1, back)?;
    moe_combine(routed, experts, got)
}

/// What the dispatch phase keeps (this device's tokens and their routing).
#[derive(Clone, Debug)]
pub struct MoeRouted {
    pub layer: u32,
    pub dims: MoeDims,
    pub group: ExpertGroup,
    pub aux_coef: f64,
    pub x: Vec<f32>,
    pub ln: Vec<f32>,
    pub mean: Vec<f32>,
    pub rstd: Vec<f32>,
    pub probs: Vec<f32>,
    pub routing: Routing,
}

impl MoeRouted {
    pub fn bytes(&self) -> u64 {
        let r = &self.routing;
        floats(&self.x)
            + floats(&self.ln)
            + floats(&self.mean)
            + floats(&self.rstd)
            + floats(&self.probs)
            + floats(&r.weight)
            + (r.choice.len() + r.slot.len() + r.rows.iter().map(Vec::len).sum::<usize>()) as u64
                * 4
    }
}

/// What the experts phase keeps (this device's experts, every source's rows).
#[derive(Clone, Debug, Default)]
pub struct MoeExperts {
    pub src_rows: Vec<Vec<usize>>,
    pub xin: Vec<Vec<f32>>,
    pub fc: Vec<Vec<f32>>,
    pub act: Vec<Vec<f32>>,
}

impl MoeExperts {
    pub fn bytes(&self) -> u64 {
        floats_each(&self.xin) + floats_each(&self.fc) + floats_each(&self.act)
    }
}

/// Dispatch phase: ln2, the router, top-k routing with capacity; the rows
/// for each member of the group (per expert of theirs: the row count as
/// bits, then the rows).
pub fn moe_dispatch(
    params: &Tensors,
    l: u32,
    moe: &MoeConfig,
    x: Vec<f32>,
    d: MoeDims,
    group: ExpertGroup,
) -> (MoeRouted, Vec<Vec<f32>>) {
    let MoeDims { n, c, e, k, .. } = d;
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
    let mut chunks = Vec::with_capacity(group.size);
    for p in 0..group.size {
        let experts = group.experts_of(e, p);
        let rows: usize = experts.clone().map(|x| routing.rows[x].len()).sum();
        let mut chunk = Vec::with_capacity(experts.len() + rows * c);
        chunk.extend(
            experts
                .clone()
                .map(|x| f32::from_bits(routing.rows[x].len() as u32)),
        );
        for x in experts {
            gather_into(&mut chunk, &ln, &routing.rows[x], k, c);
        }
        chunks.push(chunk);
    }
    let routed = MoeRouted {
        layer: l,
        dims: d,
        group,
        aux_coef: moe.aux_loss_coef,
        x,
        ln,
        mean,
        rstd,
        probs,
        routing,
    };
    (routed, chunks)
}

/// Experts phase: every source's rows (`got`, one chunk per member, as
/// [`moe_dispatch`] packs them) through this device's experts, in group
/// order; the outputs for each source.
pub fn moe_experts<E: From<String>>(
    params: &Tensors,
    l: u32,
    d: MoeDims,
    group: ExpertGroup,
    got: &[Arc<Vec<f32>>],
) -> Result<(MoeExperts, Vec<Vec<f32>>), E> {
    let MoeDims { c, e, hid, .. } = d;
    expect_len("dispatch", got.len(), group.size)?;
    let local = group.local(e);
    let per = local.len();
    let mut src_rows = vec![vec![0usize; group.size]; per];
    for (s, chunk) in got.iter().enumerate() {
        if chunk.len() < per {
            return Err(format!(
                "MoE dispatch from member {s}: {} floats, no row counts",
                chunk.len()
            )
            .into());
        }
        let counts: Vec<usize> = chunk[..per].iter().map(|x| x.to_bits() as usize).collect();
        let total = counts
            .iter()
            .try_fold(0usize, |a, m| a.checked_add(m.checked_mul(c)?));
        expect_len(
            &format!("dispatch from member {s}"),
            chunk.len() - per,
            total.unwrap_or(usize::MAX),
        )?;
        for (i, m) in counts.into_iter().enumerate() {
            src_rows[i][s] = m;
        }
    }
    let (mut xin, mut fcs, mut acts, mut outs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut offsets = vec![per; group.size];
    for (i, x_) in local.clone().enumerate() {
        let m: usize = src_rows[i].iter().sum();
        let mut inp = Vec::with_capacity(m * c);
        for (s, chunk) in got.iter().enumerate() {
            let len = src_rows[i][s] * c;
            inp.extend_from_slice(&chunk[offsets[s]..offsets[s] + len]);
            offsets[s] += len;
        }
        let (mut fc, mut act, mut y) = (vec![0.0; m * hid], vec![0.0; m * hid], vec![0.0; m * c]);
        if m > 0 {
            let w = |s: &str| param_of(params, &expert_param(l, x_, s));
            matmul_forward(
                &mut fc,
                &inp,
                w("c_fc.weight"),
                Some(w("c_fc.bias")),
                m,
                c,
                hid,
            );
            gelu_forward(&mut act, &fc);
            matmul_forward(
                &mut y,
                &act,
                w("c_proj.weight"),
                Some(w("c_proj.bias")),
                m,
                hid,
                c,
            );
        }
        xin.push(inp);
        fcs.push(fc);
        acts.push(act);
        outs.push(y);
    }
    let back = split_back(&outs, &src_rows, group.size, c);
    let experts = MoeExperts {
        src_rows,
        xin,
        fc: fcs,
        act: acts,
    };
    Ok((experts, back))
}

/// Combine phase: the returned outputs (`got`, one chunk per member)
/// weighted into the residual, and the balance loss; the output, the whole
/// cache for backward and the loss term.
pub fn moe_combine<E: From<String>>(
    routed: MoeRouted,
    experts: MoeExperts,
    got: Vec<Arc<Vec<f32>>>,
) -> Result<(Vec<f32>, MoeCache, f64), E> {
    let d = routed.dims;
    let MoeDims { n, t, c, e, k, .. } = d;
    let group = routed.group;
    let routing = &routed.routing;
    expect_len("combine", got.len(), group.size)?;
    let mut ys: Vec<Arc<Vec<f32>>> = Vec::with_capacity(e);
    for (p, chunk) in got.into_iter().enumerate() {
        let experts = group.experts_of(e, p);
        let want: usize = experts.clone().map(|x| routing.rows[x].len() * c).sum();
        expect_len(&format!("combine from member {p}"), chunk.len(), want)?;
        if experts.len() == 1 {
            ys.push(chunk);
            continue;
        }
        for b in split_blocks(&chunk, experts.map(|x| routing.rows[x].len()), c) {
            ys.push(Arc::new(b));
        }
    }
    // Combine in token order, choices in order: the same additions whatever
    // the capacity did.
    let mut out = routed.x.clone();
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
    let f = choice_shares(routing, d);
    let probs = &routed.probs;
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
    let aux_loss = routed.aux_coef * t as f64 * aux;
    let cache = MoeCache {
        routed,
        ys,
        experts,
    };
    Ok((out, cache, aux_loss))
}

/// Per source: the rows of `blocks` (one per local expert, rows of every
/// source in group order) that came from it, expert by expert.
fn split_back(
    blocks: &[Vec<f32>],
    src_rows: &[Vec<usize>],
    size: usize,
    width: usize,
) -> Vec<Vec<f32>> {
    let mut back: Vec<Vec<f32>> = vec![Vec::new(); size];
    for (i, block) in blocks.iter().enumerate() {
        let mut at = 0;
        for (s, b) in back.iter_mut().enumerate() {
            let len = src_rows[i][s] * width;
            b.extend_from_slice(&block[at..at + len]);
            at += len;
        }
    }
    back
}

/// Backward for the input from `dout[n, c]` (`loss_scale` = 1 / tokens of
/// the global batch), every member of the EP group together: the input
/// gradient and the weight pass's stash. The three backward phases
/// ([`moe_back_combine`], [`moe_back_experts`], [`moe_back_dispatch`]) with
/// the two exchanges between them.
pub fn moe_backward_input<E: From<String>>(
    params: &Tensors,
    cache: &MoeCache,
    dout: Vec<f32>,
    loss_scale: f32,
    exchange: &mut Exchange<'_, E>,
) -> Result<(Vec<f32>, MoeStash), E> {
    let (combined, chunks) = moe_back_combine(cache, dout);
    let got = exchange(2, chunks)?;
    let (grads, back) = moe_back_experts(params, cache, &got)?;
    drop(got);
    let got = exchange(3, back)?;
    let (dx, mut stash) = moe_back_dispatch(params, cache, combined, &got, loss_scale)?;
    stash.dy = grads.dy;
    stash.dfc = grads.dfc;
    Ok((dx, stash))
}

/// What the backward's combine phase hands its dispatch phase: the output
/// gradient (the residual's part of the input gradient) and the gradient of
/// each choice's weight.
#[derive(Clone, Debug, Default)]
pub struct MoeCombined {
    pub dout: Vec<f32>,
    pub dweight: Vec<f32>,
}

impl MoeCombined {
    pub fn bytes(&self) -> u64 {
        floats(&self.dout) + floats(&self.dweight)
    }
}

/// What the backward's experts phase keeps for the weight gradients of the
/// local experts: their output and hidden gradients.
#[derive(Clone, Debug, Default)]
pub struct MoeExpertGrads {
    pub dy: Vec<Vec<f32>>,
    pub dfc: Vec<Vec<f32>>,
}

impl MoeExpertGrads {
    pub fn bytes(&self) -> u64 {
        floats_each(&self.dy) + floats_each(&self.dfc)
    }
}

/// Backward combine phase: each kept assignment's output gradient, for the
/// expert's owner (one chunk per member), and the gradient of its weight.
pub fn moe_back_combine(cache: &MoeCache, dout: Vec<f32>) -> (MoeCombined, Vec<Vec<f32>>) {
    let MoeDims { n, c, e, k, .. } = cache.routed.dims;
    let r = &cache.routed.routing;
    let mut dweight = vec![0.0f32; n * k];
    let mut dys_here: Vec<Vec<f32>> = Vec::with_capacity(e);
    for (x_, rows) in r.rows.iter().enumerate() {
        let mut dy = vec![0.0f32; rows.len() * c];
        for (row, &a) in rows.iter().enumerate() {
            let tok = a as usize / k;
            let g = &dout[tok * c..][..c];
            let y = &cache.ys[x_][row * c..][..c];
            dweight[a as usize] = g.iter().zip(y).map(|(a, b)| a * b).sum();
            let w = r.weight[a as usize];
            for (di, gi) in dy[row * c..][..c].iter_mut().zip(g) {
                *di = w * gi;
            }
        }
        dys_here.push(dy);
    }
    let chunks = by_owner(&dys_here, cache.routed.group, e);
    (MoeCombined { dout, dweight }, chunks)
}

/// Backward experts phase: the output gradients of every source's rows
/// (`got`) through this device's experts; the input gradients for each
/// source, and what the expert weight gradients read.
pub fn moe_back_experts<E: From<String>>(
    params: &Tensors,
    cache: &MoeCache,
    got: &[Arc<Vec<f32>>],
) -> Result<(MoeExpertGrads, Vec<Vec<f32>>), E> {
    let MoeDims { c, e, hid, .. } = cache.routed.dims;
    let (l, group) = (cache.routed.layer, cache.routed.group);
    expect_len("output gradients", got.len(), group.size)?;
    let local = group.local(e);
    let mut offsets = vec![0usize; group.size];
    for (s, chunk) in got.iter().enumerate() {
        let want: usize = (0..local.len())
            .map(|i| cache.experts.src_rows[i][s] * c)
            .sum();
        expect_len(
            &format!("output gradients from member {s}"),
            chunk.len(),
            want,
        )?;
    }
    let (mut dys, mut dfcs, mut dins) = (Vec::new(), Vec::new(), Vec::new());
    for (i, x_) in local.clone().enumerate() {
        let m: usize = cache.experts.src_rows[i].iter().sum();
        let mut dy = Vec::with_capacity(m * c);
        for (s, chunk) in got.iter().enumerate() {
            let len = cache.experts.src_rows[i][s] * c;
            dy.extend_from_slice(&chunk[offsets[s]..offsets[s] + len]);
            offsets[s] += len;
        }
        let mut dfc = vec![0.0f32; m * hid];
        let mut dinp = vec![0.0f32; m * c];
        if m > 0 {
            let w = |s: &str| param_of(params, &expert_param(l, x_, s));
            let mut dact = vec![0.0f32; m * hid];
            matmul_backward_input(&mut dact, &dy, w("c_proj.weight"), m, hid, c, false);
            gelu_backward(&mut dfc, &cache.experts.fc[i], &dact);
            matmul_backward_input(&mut dinp, &dfc, w("c_fc.weight"), m, c, hid, false);
        }
        dys.push(dy);
        dfcs.push(dfc);
        dins.push(dinp);
    }
    let back = split_back(&dins, &cache.experts.src_rows, group.size, c);
    Ok((MoeExpertGrads { dy: dys, dfc: dfcs }, back))
}

/// Backward dispatch phase: the returned input gradients (`got`)
/// scattered back to the tokens, then through the renormalisation, the
/// balance loss, the router and ln2 into the residual's gradient; the input
/// gradient and the router's and ln2's part of the stash (the experts'
/// part comes from [`moe_back_experts`]).
pub fn moe_back_dispatch<E: From<String>>(
    params: &Tensors,
    cache: &MoeCache,
    combined: MoeCombined,
    got: &[Arc<Vec<f32>>],
    loss_scale: f32,
) -> Result<(Vec<f32>, MoeStash), E> {
    let d = cache.routed.dims;
    let MoeDims { n, t, c, e, k, .. } = d;
    let (l, group) = (cache.routed.layer, cache.routed.group);
    let name = |s: &str| format!("h.{l}.{s}");
    let r = &cache.routed.routing;
    let MoeCombined { dout, dweight } = combined;
    expect_len("input gradients", got.len(), group.size)?;
    expect_len("output gradient", dout.len(), n * c)?;
    let mut dln = vec![0.0f32; n * c];
    for (p, chunk) in got.iter().enumerate() {
        let experts = group.experts_of(e, p);
        let want: usize = experts.clone().map(|x| r.rows[x].len() * c).sum();
        expect_len(
            &format!("input gradients from member {p}"),
            chunk.len(),
            want,
        )?;
        let mut at = 0;
        for x_ in experts {
            for &a in &r.rows[x_] {
                let tok = a as usize / k;
                for (di, gi) in dln[tok * c..][..c].iter_mut().zip(&chunk[at..at + c]) {
                    *di += gi;
                }
                at += c;
            }
        }
    }
    // Through the renormalisation w_j = p_j / Σ p, the balance loss and the
    // softmax, to the router logits.
    let f = choice_shares(r, d);
    let aux = cache.routed.aux_coef as f32 * e as f32 * loss_scale;
    let mut dlogits = vec![0.0f32; n * e];
    for tok in 0..n {
        let p = &cache.routed.probs[tok * e..][..e];
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
        &cache.routed.x,
        param_of(params, &name("ln_2.weight")),
        &cache.routed.mean,
        &cache.routed.rstd,
        n,
        c,
    );
    Ok((
        dx,
        MoeStash {
            dy: Vec::new(),
            dfc: Vec::new(),
            dlogits,
            dln,
        },
    ))
}

/// Backward for the weights: accumulate the router's, this device's
/// experts' and ln2's gradients (no communication).
pub fn moe_backward_weight(grads: &mut Tensors, cache: &MoeCache, stash: &MoeStash) {
    moe_experts_weight(grads, cache, &stash.dy, &stash.dfc);
    moe_router_weight(grads, cache, stash);
}

/// The local experts' weight gradients from their output and hidden
/// gradients.
pub fn moe_experts_weight(
    grads: &mut Tensors,
    cache: &MoeCache,
    dy: &[Vec<f32>],
    dfc: &[Vec<f32>],
) {
    let MoeDims { c, e, hid, .. } = cache.routed.dims;
    let l = cache.routed.layer;
    for (i, x_) in cache.routed.group.local(e).enumerate() {
        let m: usize = cache.experts.src_rows[i].iter().sum();
        if m == 0 {
            continue;
        }
        let p = |w: &str| expert_param(l, x_, w);
        let (w2, b2) = (p("c_proj.weight"), p("c_proj.bias"));
        linear_weight(grads, &w2, &b2, &dy[i], &cache.experts.act[i], m, hid, c);
        let (w1, b1) = (p("c_fc.weight"), p("c_fc.bias"));
        linear_weight(grads, &w1, &b1, &dfc[i], &cache.experts.xin[i], m, c, hid);
    }
}

/// The router's and ln2's weight gradients.
pub fn moe_router_weight(grads: &mut Tensors, cache: &MoeCache, stash: &MoeStash) {
    let MoeDims { n, c, e, .. } = cache.routed.dims;
    let l = cache.routed.layer;
    let name = |s: &str| format!("h.{l}.{s}");
    matmul_backward_weight(
        grad_of(grads, &name("mlp.router.weight")),
        None,
        &stash.dlogits,
        &cache.routed.ln,
        n,
        c,
        e,
    );
    layernorm_weight(
        grads,
        &name("ln_2.weight"),
        &name("ln_2.bias"),
        &stash.dln,
        &cache.routed.x,
        &cache.routed.mean,
        &cache.routed.rstd,
        n,
        c,
    );
}
