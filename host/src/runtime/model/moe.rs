//! The mixture-of-experts half of a MoE block over any [`Backend`]:
//! `out = x + Σ_j w_j · expert_{e_j}(ln2(x))`, with its router, capacity
//! and load-balancing loss. Forward, backward-for-input (which stashes what
//! the weight pass reads) and backward-for-weights, each as the phases a
//! split expert pass runs as ops of their own (dispatch, experts, combine).
//!
//! The arithmetic, as a user of Megatron or DeepSpeed would expect it:
//! - **Router**: `probs = softmax(ln2(x) · Wrᵀ)` over the experts (no bias;
//!   `Wr` is `[experts, d_model]`, (out, in) as every linear weight here);
//!   each token picks its `top_k` largest (ties: the lower expert index), and
//!   the picked probabilities are renormalised to sum to 1 (Qwen3's
//!   `norm_topk_prob`, Mixtral). Routing is a host decision: the
//!   probabilities are read back once per layer's forward.
//! - **Experts**: GPT-2 MLPs (`c_fc`, GELU, `c_proj`) of width `hidden`.
//! - **Capacity** (when `capacity_factor` is set): each expert takes at most
//!   `ceil(capacity_factor × tokens × top_k / experts)` assignments of the
//!   tokens routed together (one forward on one device: a microbatch's
//!   share, so a plan with other microbatches drops other assignments).
//!   First choices are served before second choices, each in token order
//!   (GShard); an assignment past capacity is dropped: it adds nothing and
//!   the token keeps its residual. Dropped assignments are counted.
//! - **Load-balancing loss**, sequence-wise (DeepSeek-V3): per sequence,
//!   `aux = E · Σ_e f_e · P_e` with `f_e` the share of the sequence's top-k
//!   choices that picked `e` (before drops, not differentiated) and `P_e` the
//!   mean router probability of `e`; each layer adds `aux_loss_coef ×` the
//!   mean of `aux` over the global batch's sequences to the training loss.
//!   Per sequence, so the loss is the same however sequences are split into
//!   microbatches and data-parallel replicas; under context parallelism,
//!   where a device holds chunks of each sequence, `f_e` and `P_e` are
//!   summed over the group first (a [`ContextSum`]), and each member adds
//!   its rows' share of the term.
//! - **Expert parallelism**: with an EP group of `g` devices, device `r`
//!   holds experts `r·E/g … (r+1)·E/g − 1`. Routing stays local; the rows each
//!   expert runs go to its owner and the outputs come back through an
//!   [`Exchange`] (an all-to-all over the group; the identity on one device),
//!   twice in forward (dispatch, combine) and twice in the input backward.
//!   An expert runs the rows of every source in group order, so per row the
//!   arithmetic is the one-device arithmetic; only weight-gradient sums see a
//!   different row order. A member's chunk for another starts with its row
//!   count per expert (base-256 digits: small integers every dtype holds
//!   exactly), then the rows.
//! - **Precision**: the activations, the router's probabilities, the rows
//!   exchanged and their gradients are held in the model's activation
//!   dtype (bf16 under a bf16 policy; arithmetic in fp32 inside each
//!   kernel); the normalization statistics, the routing weights' gradient
//!   and the routing itself fp32, the weight gradients fp32.

// Compositions carry their shapes as arguments, as the kernels do.
#![allow(clippy::too_many_arguments)]

pub use super::common::{alone, ContextSum, Exchange, ExpertGroup};
use super::common::{bytes_of, Model};
use crate::model::params::{ExpertIds, ExpertsIds};
use crate::model::MoeConfig;
pub use crate::runtime::backend::routing::{route, MoeDims, Routing, DROPPED};
use crate::runtime::backend::{grad_mut, param, Backend, BackendError, ParamMap};

/// Per-sequence statistics of one forward's routing, `[seqs, 2e]`: each
/// expert's count of the sequence's top-k choices held here (before drops),
/// then its router probabilities summed over those tokens.
fn sequence_stats(probs: &[f32], r: &Routing, d: MoeDims) -> Vec<f64> {
    let MoeDims { n, t, e, k, .. } = d;
    let mut stats = vec![0.0f64; n / t * 2 * e];
    for (a, &x) in r.choice.iter().enumerate() {
        stats[a / k / t * 2 * e + x as usize] += 1.0;
    }
    for tok in 0..n {
        let sums = &mut stats[tok / t * 2 * e + e..][..e];
        for (pm, p) in sums.iter_mut().zip(&probs[tok * e..][..e]) {
            *pm += *p as f64;
        }
    }
    stats
}

/// The sequence-wise balance loss from whole sequences' statistics
/// ([`sequence_stats`], summed over a context-parallel group): the choice
/// shares `f[s, e]` the router's backward reads, and the term this device
/// adds to its summed token losses, `aux_coef × t × Σ_sequences aux` for
/// its `t` rows of each (the group's terms add up to the whole sequences').
fn balance_loss(stats: &[f64], d: MoeDims, aux_coef: f64) -> (Vec<f32>, f64) {
    let MoeDims { t, e, k, seq, .. } = d;
    let choices = (seq * k) as f64;
    let mut shares = Vec::with_capacity(stats.len() / 2);
    let mut aux = 0.0f64;
    for s in stats.chunks_exact(2 * e) {
        let (counts, sums) = s.split_at(e);
        let f: Vec<f32> = counts.iter().map(|c| (c / choices) as f32).collect();
        let dot: f64 = (0..e).map(|x| f[x] as f64 * sums[x] / seq as f64).sum();
        aux += e as f64 * dot;
        shares.extend(f);
    }
    (shares, aux_coef * t as f64 * aux)
}

/// Values a row count takes in a chunk's head: its base-256 digits, low
/// first (each exact in bf16, whose significand holds 8 bits).
const COUNT_DIGITS: usize = 4;

/// `n`'s digits for a chunk's head.
fn count_digits(n: usize) -> Result<[f32; COUNT_DIGITS], BackendError> {
    let n = u32::try_from(n)
        .map_err(|_| BackendError::Exchange(format!("MoE dispatch: {n} rows for one expert")))?;
    Ok(std::array::from_fn(|i| ((n >> (8 * i)) & 0xff) as f32))
}

/// The row counts of a chunk's head, each digit checked.
fn read_counts(head: &[f32], from: usize) -> Result<Vec<usize>, BackendError> {
    head.chunks(COUNT_DIGITS)
        .map(|digits| {
            digits.iter().rev().try_fold(0usize, |acc, &x| {
                match x.fract() == 0.0 && (0.0..256.0).contains(&x) {
                    true => Ok(acc * 256 + x as usize),
                    false => Err(BackendError::Exchange(format!(
                        "MoE dispatch from member {from}: a row count digit {x} is not one"
                    ))),
                }
            })
        })
        .collect()
}

/// Check a received chunk's length before it is cut.
fn expect_len(what: &str, got: usize, want: usize) -> Result<(), BackendError> {
    match got == want {
        true => Ok(()),
        false => Err(BackendError::Exchange(format!(
            "MoE {what}: received {got} floats, expected {want}"
        ))),
    }
}

/// What the dispatch phase keeps (this device's tokens and their routing).
pub struct MoeRouted<B: Backend> {
    pub layer: u32,
    pub dims: MoeDims,
    pub group: ExpertGroup,
    pub aux_coef: f64,
    pub x: B::Tensor,
    pub ln: B::Tensor,
    pub mean: B::Tensor,
    pub rstd: B::Tensor,
    pub probs: B::Tensor,
    pub routing: Routing,
    /// Each sequence's choice shares `f[s, e]` (its whole length's, under
    /// context parallelism), which the router's backward reads.
    pub shares: Vec<f32>,
    /// This forward's balance-loss term.
    pub aux: f64,
}

impl<B: Backend> MoeRouted<B> {
    pub fn bytes(&self) -> u64 {
        bytes_of::<B>(&[&self.x, &self.ln, &self.mean, &self.rstd, &self.probs])
            + self.routing.bytes()
    }
    fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        Ok(MoeRouted {
            layer: self.layer,
            dims: self.dims,
            group: self.group,
            aux_coef: self.aux_coef,
            x: b.duplicate(&self.x)?,
            ln: b.duplicate(&self.ln)?,
            mean: b.duplicate(&self.mean)?,
            rstd: b.duplicate(&self.rstd)?,
            probs: b.duplicate(&self.probs)?,
            routing: self.routing.clone(),
            shares: self.shares.clone(),
            aux: self.aux,
        })
    }
}

/// What the experts phase keeps (this device's experts, every source's rows).
pub struct MoeExperts<B: Backend> {
    /// Per local expert: the rows from each member.
    pub src_rows: Vec<Vec<usize>>,
    pub xin: Vec<B::Tensor>,
    /// The input projections' outputs: per local expert GELU's `c_fc`, or
    /// SwiGLU's gate then up (see `Model::fc_width`).
    pub fc: Vec<B::Tensor>,
    pub act: Vec<B::Tensor>,
}

fn each_bytes<B: Backend>(ts: &[B::Tensor]) -> u64 {
    ts.iter().map(|t| B::bytes(t)).sum()
}

fn duplicate_each<B: Backend>(b: &B, ts: &[B::Tensor]) -> Result<Vec<B::Tensor>, BackendError> {
    ts.iter().map(|t| b.duplicate(t)).collect()
}

impl<B: Backend> MoeExperts<B> {
    pub fn bytes(&self) -> u64 {
        each_bytes::<B>(&self.xin) + each_bytes::<B>(&self.fc) + each_bytes::<B>(&self.act)
    }
    fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        Ok(MoeExperts {
            src_rows: self.src_rows.clone(),
            xin: duplicate_each(b, &self.xin)?,
            fc: duplicate_each(b, &self.fc)?,
            act: duplicate_each(b, &self.act)?,
        })
    }
}

/// What the MoE half keeps from forward for backward: the dispatch phase's
/// routing side (this device's tokens), the combine's inputs, and the
/// experts phase's side (this device's experts, the rows of every source).
pub struct MoeCache<B: Backend> {
    pub routed: MoeRouted<B>,
    /// Per expert (all of them): the outputs of this device's rows.
    pub ys: Vec<B::Tensor>,
    pub experts: MoeExperts<B>,
}

impl<B: Backend> MoeCache<B> {
    pub fn bytes(&self) -> u64 {
        self.routed.bytes() + each_bytes::<B>(&self.ys) + self.experts.bytes()
    }

    /// What the weight pass reads (inputs of the matmuls and the layernorm,
    /// the routing); the rest is freed at `BI`.
    pub fn keep_for_weights(mut self) -> Self {
        self.routed.probs = Default::default();
        self.experts.fc = Vec::new();
        self.ys = Vec::new();
        self
    }

    pub fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        Ok(MoeCache {
            routed: self.routed.duplicate(b)?,
            ys: duplicate_each(b, &self.ys)?,
            experts: self.experts.duplicate(b)?,
        })
    }
}

/// Gradients the weight pass needs, produced by the input pass.
pub struct MoeStash<B: Backend> {
    /// Per local expert: gradient of its output rows and of its `c_fc` output.
    pub dy: Vec<B::Tensor>,
    pub dfc: Vec<B::Tensor>,
    /// `[n, e]` gradient of the router logits; `[n, c]` of ln2's output.
    pub dlogits: B::Tensor,
    pub dln: B::Tensor,
}

impl<B: Backend> MoeStash<B> {
    pub fn bytes(&self) -> u64 {
        each_bytes::<B>(&self.dy)
            + each_bytes::<B>(&self.dfc)
            + bytes_of::<B>(&[&self.dlogits, &self.dln])
    }
}

/// What the backward's combine phase hands its dispatch phase: the output
/// gradient (the residual's part of the input gradient) and the gradient of
/// each choice's weight.
pub struct MoeCombined<B: Backend> {
    pub dout: B::Tensor,
    pub dweight: B::Tensor,
}

impl<B: Backend> MoeCombined<B> {
    pub fn bytes(&self) -> u64 {
        bytes_of::<B>(&[&self.dout, &self.dweight])
    }
}

/// What the backward's experts phase keeps for the weight gradients of the
/// local experts: their output and hidden gradients.
pub struct MoeExpertGrads<B: Backend> {
    pub dy: Vec<B::Tensor>,
    pub dfc: Vec<B::Tensor>,
}

impl<B: Backend> MoeExpertGrads<B> {
    pub fn bytes(&self) -> u64 {
        each_bytes::<B>(&self.dy) + each_bytes::<B>(&self.dfc)
    }
}

impl<B: Backend> Model<'_, B> {
    /// Layer `l`'s expert-half parameters.
    fn experts_ids(&self, l: u32) -> Result<&ExpertsIds, BackendError> {
        self.table
            .experts(l)
            .ok_or_else(|| BackendError::Device(format!("layer {l} has no experts")))
    }

    /// Expert `x`'s MLP in layer `l`.
    fn expert(&self, l: u32, x: usize) -> Result<ExpertIds, BackendError> {
        self.experts_ids(l)?
            .experts
            .get(x)
            .copied()
            .ok_or_else(|| BackendError::Device(format!("layer {l} has no expert {x}")))
    }

    /// Member `p`'s chunk for each member: the blocks of its experts, one
    /// after the other (`blocks[x]` is expert `x`'s rows).
    fn by_owner(
        &self,
        blocks: Vec<B::Tensor>,
        g: ExpertGroup,
        e: usize,
    ) -> Result<Vec<B::Tensor>, BackendError> {
        let mut blocks: Vec<Option<B::Tensor>> = blocks.into_iter().map(Some).collect();
        (0..g.size)
            .map(|p| {
                let experts = g.experts_of(e, p);
                if experts.len() == 1 {
                    return Ok(blocks[experts.start].take().unwrap_or_default());
                }
                let len: usize = experts
                    .clone()
                    .map(|x| blocks[x].as_ref().map_or(0, B::len))
                    .sum();
                let mut chunk = self.zeros(len)?;
                let mut at = 0;
                for x in experts {
                    if let Some(b) = &blocks[x] {
                        self.b.copy(&mut chunk, at, b, 0..B::len(b));
                        at += B::len(b);
                    }
                }
                Ok(chunk)
            })
            .collect()
    }

    /// Per source: the rows of `blocks` (one per local expert, rows of every
    /// source in group order) that came from it, expert by expert.
    fn split_back(
        &self,
        blocks: &[B::Tensor],
        src_rows: &[Vec<usize>],
        size: usize,
        width: usize,
    ) -> Result<Vec<B::Tensor>, BackendError> {
        let mut back = (0..size)
            .map(|s| {
                let len: usize = src_rows.iter().map(|r| r[s] * width).sum();
                self.zeros(len)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut filled = vec![0usize; size];
        for (i, block) in blocks.iter().enumerate() {
            let mut at = 0;
            for (s, b) in back.iter_mut().enumerate() {
                let len = src_rows[i][s] * width;
                self.b.copy(b, filled[s], block, at..at + len);
                filled[s] += len;
                at += len;
            }
        }
        Ok(back)
    }

    /// Forward of layer `l`'s MoE half on `x[n, c]` in the EP group `group`
    /// (every member calls it together): the output, the cache, and the
    /// load-balancing loss term. The three phases ([`Model::moe_dispatch`],
    /// [`Model::moe_experts`], [`Model::moe_combine`]) with the two
    /// exchanges between them. `context`: the group sharing this device's
    /// sequences under context parallelism.
    pub fn moe_forward(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        moe: &MoeConfig,
        x: B::Tensor,
        d: MoeDims,
        group: ExpertGroup,
        exchange: &mut Exchange<'_, B>,
        context: Option<&mut ContextSum<'_>>,
    ) -> Result<(B::Tensor, MoeCache<B>, f64), BackendError> {
        let (routed, chunks) = self.moe_dispatch(params, l, moe, x, d, group, context)?;
        let got = exchange(0, chunks)?;
        let (experts, back) = self.moe_experts(params, l, d, group, &got)?;
        drop(got);
        let got = exchange(1, back)?;
        self.moe_combine(routed, experts, got)
    }

    /// Dispatch phase: ln2, the router, top-k routing with capacity; the rows
    /// for each member of the group (per expert of theirs: the row count as
    /// bits, then the rows). Under context parallelism (`context`, the sum
    /// over the group holding the other chunks of these sequences) the
    /// balance loss's statistics are the whole sequences'; capacity stays
    /// per device (its tokens are the ones routed together).
    pub fn moe_dispatch(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        moe: &MoeConfig,
        x: B::Tensor,
        d: MoeDims,
        group: ExpertGroup,
        context: Option<&mut ContextSum<'_>>,
    ) -> Result<(MoeRouted<B>, Vec<B::Tensor>), BackendError> {
        let MoeDims { n, c, e, k, .. } = d;
        let ids = self.experts_ids(l)?;
        let (mut ln, mut mean, mut rstd) =
            (self.zeros(n * c)?, Default::default(), self.b.zeros(n)?);
        match ids.norm_bias {
            Some(bias) => {
                mean = self.b.zeros(n)?;
                self.b.layernorm_forward(
                    &mut ln,
                    &mut mean,
                    &mut rstd,
                    &x,
                    param(params, ids.norm)?,
                    param(params, bias)?,
                    n,
                    c,
                )
            }
            None => self.b.rmsnorm_forward(
                &mut ln,
                &mut rstd,
                &x,
                param(params, ids.norm)?,
                n,
                c,
                self.table.norm_eps,
            ),
        }
        let mut logits = self.zeros(n * e)?;
        self.b
            .matmul_forward(&mut logits, &ln, param(params, ids.router)?, None, n, c, e);
        let mut probs = self.zeros(n * e)?;
        self.b.softmax_rows(&mut probs, &logits, e);
        let host_probs = self.b.download(&probs)?;
        let routing = route(&host_probs, d, moe.capacity_factor);
        let mut stats = sequence_stats(&host_probs, &routing, d);
        if let Some(sum) = context {
            // Counts are integers and fp32 holds them exactly; the sums'
            // partials are rounded once for the wire.
            let got = sum(stats.iter().map(|x| *x as f32).collect())?;
            expect_len("balance statistics", got.len(), stats.len())?;
            stats = got.into_iter().map(f64::from).collect();
        }
        let (shares, aux) = balance_loss(&stats, d, moe.aux_loss_coef);
        let mut chunks = Vec::with_capacity(group.size);
        for p in 0..group.size {
            let experts = group.experts_of(e, p);
            let rows: usize = experts.clone().map(|x| routing.rows[x].len()).sum();
            let mut head: Vec<f32> = Vec::with_capacity(experts.len() * COUNT_DIGITS);
            for x in experts.clone() {
                head.extend(count_digits(routing.rows[x].len())?);
            }
            let mut chunk = self.zeros(head.len() + rows * c)?;
            self.b.write(&mut chunk, 0, &head);
            let mut at = head.len();
            for x in experts {
                self.b
                    .gather_rows(&mut chunk, at, &ln, &routing.rows[x], k, c);
                at += routing.rows[x].len() * c;
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
            shares,
            aux,
        };
        Ok((routed, chunks))
    }

    /// Experts phase: every source's rows (`got`, one chunk per member, as
    /// [`Model::moe_dispatch`] packs them) through this device's experts, in
    /// group order; the outputs for each source.
    pub fn moe_experts(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        d: MoeDims,
        group: ExpertGroup,
        got: &[B::Tensor],
    ) -> Result<(MoeExperts<B>, Vec<B::Tensor>), BackendError> {
        let MoeDims { c, e, hid, .. } = d;
        expect_len("dispatch", got.len(), group.size)?;
        let local = group.local(e);
        let per = local.len();
        let mut src_rows = vec![vec![0usize; group.size]; per];
        for (s, chunk) in got.iter().enumerate() {
            let len = B::len(chunk);
            let head = per * COUNT_DIGITS;
            if len < head {
                return Err(BackendError::Exchange(format!(
                    "MoE dispatch from member {s}: {len} values, no row counts"
                )));
            }
            let counts = read_counts(&self.b.download_range(chunk, 0..head)?, s)?;
            let total = counts
                .iter()
                .try_fold(0usize, |a, m| a.checked_add(m.checked_mul(c)?));
            expect_len(
                &format!("dispatch from member {s}"),
                len - head,
                total.unwrap_or(usize::MAX),
            )?;
            for (i, m) in counts.into_iter().enumerate() {
                src_rows[i][s] = m;
            }
        }
        let (mut xin, mut fcs, mut acts, mut outs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let width = self.fc_width();
        let mut offsets = vec![per * COUNT_DIGITS; group.size];
        for (i, x_) in local.clone().enumerate() {
            let m: usize = src_rows[i].iter().sum();
            let mut inp = self.zeros(m * c)?;
            let mut at = 0;
            for (s, chunk) in got.iter().enumerate() {
                let len = src_rows[i][s] * c;
                self.b
                    .copy(&mut inp, at, chunk, offsets[s]..offsets[s] + len);
                offsets[s] += len;
                at += len;
            }
            let mut fc: Vec<B::Tensor> = (0..width)
                .map(|_| self.zeros(m * hid))
                .collect::<Result<_, _>>()?;
            let (mut act, mut y) = (self.zeros(m * hid)?, self.zeros(m * c)?);
            if m > 0 {
                let (out_w, out_b) = match self.expert(l, x_)? {
                    ExpertIds::Gelu(w) => {
                        self.b.matmul_forward(
                            &mut fc[0],
                            &inp,
                            param(params, w.fc.weight)?,
                            Some(param(params, w.fc.bias)?),
                            m,
                            c,
                            hid,
                        );
                        self.b.gelu_forward(&mut act, &fc[0]);
                        (w.proj.weight, Some(w.proj.bias))
                    }
                    ExpertIds::SwiGlu(w) => {
                        for (out, wt) in fc.iter_mut().zip([w.gate, w.up]) {
                            self.b
                                .matmul_forward(out, &inp, param(params, wt)?, None, m, c, hid);
                        }
                        self.b.swiglu_forward(&mut act, &fc[0], &fc[1]);
                        (w.down, None)
                    }
                };
                let bias = match out_b {
                    Some(b) => Some(param(params, b)?),
                    None => None,
                };
                self.b
                    .matmul_forward(&mut y, &act, param(params, out_w)?, bias, m, hid, c);
            }
            xin.push(inp);
            fcs.extend(fc);
            acts.push(act);
            outs.push(y);
        }
        let back = self.split_back(&outs, &src_rows, group.size, c)?;
        let experts = MoeExperts {
            src_rows,
            xin,
            fc: fcs,
            act: acts,
        };
        Ok((experts, back))
    }

    /// Combine phase: the returned outputs (`got`, one chunk per member)
    /// weighted into the residual; the output, the whole cache for backward
    /// and the balance-loss term.
    pub fn moe_combine(
        &self,
        routed: MoeRouted<B>,
        experts: MoeExperts<B>,
        got: Vec<B::Tensor>,
    ) -> Result<(B::Tensor, MoeCache<B>, f64), BackendError> {
        let MoeDims { c, e, .. } = routed.dims;
        let group = routed.group;
        let routing = &routed.routing;
        expect_len("combine", got.len(), group.size)?;
        let mut ys: Vec<B::Tensor> = Vec::with_capacity(e);
        for (p, chunk) in got.into_iter().enumerate() {
            let experts = group.experts_of(e, p);
            let want: usize = experts.clone().map(|x| routing.rows[x].len() * c).sum();
            expect_len(&format!("combine from member {p}"), B::len(&chunk), want)?;
            if experts.len() == 1 {
                ys.push(chunk);
                continue;
            }
            let mut at = 0;
            for x in experts {
                let len = routing.rows[x].len() * c;
                let mut block = self.zeros(len)?;
                self.b.copy(&mut block, 0, &chunk, at..at + len);
                at += len;
                ys.push(block);
            }
        }
        let mut out = self.b.duplicate(&routed.x)?;
        self.b.moe_combine(&mut out, &ys, routing, c);
        let aux = routed.aux;
        let cache = MoeCache {
            routed,
            ys,
            experts,
        };
        Ok((out, cache, aux))
    }

    /// Backward for the input from `dout[n, c]` (`loss_scale` = 1 / tokens of
    /// the global batch), every member of the EP group together: the input
    /// gradient and the weight pass's stash. The three backward phases
    /// ([`Model::moe_back_combine`], [`Model::moe_back_experts`],
    /// [`Model::moe_back_dispatch`]) with the two exchanges between them.
    pub fn moe_backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        cache: &MoeCache<B>,
        dout: B::Tensor,
        loss_scale: f32,
        exchange: &mut Exchange<'_, B>,
    ) -> Result<(B::Tensor, MoeStash<B>), BackendError> {
        let (combined, chunks) = self.moe_back_combine(cache, dout)?;
        let got = exchange(2, chunks)?;
        let (grads, back) = self.moe_back_experts(params, cache, &got)?;
        drop(got);
        let got = exchange(3, back)?;
        let (dx, mut stash) = self.moe_back_dispatch(params, cache, combined, &got, loss_scale)?;
        stash.dy = grads.dy;
        stash.dfc = grads.dfc;
        Ok((dx, stash))
    }

    /// Backward combine phase: each kept assignment's output gradient, for
    /// the expert's owner (one chunk per member), and the gradient of its
    /// weight.
    pub fn moe_back_combine(
        &self,
        cache: &MoeCache<B>,
        dout: B::Tensor,
    ) -> Result<(MoeCombined<B>, Vec<B::Tensor>), BackendError> {
        let MoeDims { n, c, e, k, .. } = cache.routed.dims;
        let r = &cache.routed.routing;
        let mut dweight = self.b.zeros(n * k)?;
        let mut dys = r
            .rows
            .iter()
            .map(|rows| self.zeros(rows.len() * c))
            .collect::<Result<Vec<_>, _>>()?;
        self.b
            .moe_combine_backward(&mut dweight, &mut dys, &dout, &cache.ys, r, c);
        let chunks = self.by_owner(dys, cache.routed.group, e)?;
        Ok((MoeCombined { dout, dweight }, chunks))
    }

    /// Backward experts phase: the output gradients of every source's rows
    /// (`got`) through this device's experts; the input gradients for each
    /// source, and what the expert weight gradients read.
    pub fn moe_back_experts(
        &self,
        params: &ParamMap<B::Tensor>,
        cache: &MoeCache<B>,
        got: &[B::Tensor],
    ) -> Result<(MoeExpertGrads<B>, Vec<B::Tensor>), BackendError> {
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
                B::len(chunk),
                want,
            )?;
        }
        let (mut dys, mut dfcs, mut dins) = (Vec::new(), Vec::new(), Vec::new());
        let width = self.fc_width();
        for (i, x_) in local.clone().enumerate() {
            let m: usize = cache.experts.src_rows[i].iter().sum();
            let mut dy = self.zeros(m * c)?;
            let mut at = 0;
            for (s, chunk) in got.iter().enumerate() {
                let len = cache.experts.src_rows[i][s] * c;
                self.b
                    .copy(&mut dy, at, chunk, offsets[s]..offsets[s] + len);
                offsets[s] += len;
                at += len;
            }
            let mut dfc: Vec<B::Tensor> = (0..width)
                .map(|_| self.zeros(m * hid))
                .collect::<Result<_, _>>()?;
            let mut dinp = self.zeros(m * c)?;
            if m > 0 {
                let fc = &cache.experts.fc[i * width..(i + 1) * width];
                let (w_out, w_in) = match self.expert(l, x_)? {
                    ExpertIds::Gelu(w) => (w.proj.weight, vec![w.fc.weight]),
                    ExpertIds::SwiGlu(w) => (w.down, vec![w.gate, w.up]),
                };
                let mut dact = self.zeros(m * hid)?;
                self.b.matmul_backward_input(
                    &mut dact,
                    &dy,
                    param(params, w_out)?,
                    m,
                    hid,
                    c,
                    false,
                );
                match dfc.as_mut_slice() {
                    [d] => self.b.gelu_backward(d, &fc[0], &dact),
                    [dg, du] => self.b.swiglu_backward(dg, du, &fc[0], &fc[1], &dact),
                    _ => unreachable!("an expert has one or two input projections"),
                }
                for (j, (d, w)) in dfc.iter().zip(w_in).enumerate() {
                    self.b
                        .matmul_backward_input(&mut dinp, d, param(params, w)?, m, c, hid, j > 0);
                }
            }
            dys.push(dy);
            dfcs.extend(dfc);
            dins.push(dinp);
        }
        let back = self.split_back(&dins, &cache.experts.src_rows, group.size, c)?;
        Ok((MoeExpertGrads { dy: dys, dfc: dfcs }, back))
    }

    /// Backward dispatch phase: the returned input gradients (`got`)
    /// scattered back to the tokens, then through the renormalisation, the
    /// balance loss, the router and ln2 into the residual's gradient; the
    /// input gradient and the router's and ln2's part of the stash (the
    /// experts' part comes from [`Model::moe_back_experts`]).
    pub fn moe_back_dispatch(
        &self,
        params: &ParamMap<B::Tensor>,
        cache: &MoeCache<B>,
        combined: MoeCombined<B>,
        got: &[B::Tensor],
        loss_scale: f32,
    ) -> Result<(B::Tensor, MoeStash<B>), BackendError> {
        let d = cache.routed.dims;
        let MoeDims { n, t, c, e, k, .. } = d;
        let (l, group) = (cache.routed.layer, cache.routed.group);
        let ids = self.experts_ids(l)?;
        let r = &cache.routed.routing;
        let MoeCombined { dout, dweight } = combined;
        expect_len("input gradients", got.len(), group.size)?;
        expect_len("output gradient", B::len(&dout), n * c)?;
        let mut dln = self.zeros(n * c)?;
        for (p, chunk) in got.iter().enumerate() {
            let experts = group.experts_of(e, p);
            let want: usize = experts.clone().map(|x| r.rows[x].len() * c).sum();
            expect_len(
                &format!("input gradients from member {p}"),
                B::len(chunk),
                want,
            )?;
            let mut at = 0;
            for x_ in experts {
                self.b
                    .scatter_add_rows(&mut dln, chunk, at, &r.rows[x_], k, c);
                at += r.rows[x_].len() * c;
            }
        }
        // Through the renormalisation w_j = p_j / Σ p, the balance loss and the
        // softmax, to the router logits.
        let f = &cache.routed.shares;
        let aux = cache.routed.aux_coef as f32 * e as f32 * loss_scale;
        let mut dlogits = self.zeros(n * e)?;
        self.b
            .router_backward(&mut dlogits, &cache.routed.probs, &dweight, f, aux, r, t, e);
        self.b.matmul_backward_input(
            &mut dln,
            &dlogits,
            param(params, ids.router)?,
            n,
            c,
            e,
            true,
        );
        let mut dx = dout;
        match ids.norm_bias {
            Some(_) => self.b.layernorm_backward_input(
                &mut dx,
                &dln,
                &cache.routed.x,
                param(params, ids.norm)?,
                &cache.routed.mean,
                &cache.routed.rstd,
                n,
                c,
            ),
            None => self.b.rmsnorm_backward_input(
                &mut dx,
                &dln,
                &cache.routed.x,
                param(params, ids.norm)?,
                &cache.routed.rstd,
                n,
                c,
            ),
        }
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
    pub fn moe_backward_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        cache: &MoeCache<B>,
        stash: &MoeStash<B>,
    ) -> Result<(), BackendError> {
        self.moe_experts_weight(grads, cache, &stash.dy, &stash.dfc)?;
        self.moe_router_weight(grads, cache, stash)
    }

    /// The local experts' weight gradients from their output and hidden
    /// gradients.
    pub fn moe_experts_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        cache: &MoeCache<B>,
        dy: &[B::Tensor],
        dfc: &[B::Tensor],
    ) -> Result<(), BackendError> {
        let MoeDims { c, e, hid, .. } = cache.routed.dims;
        let l = cache.routed.layer;
        let width = self.fc_width();
        for (i, x_) in cache.routed.group.local(e).enumerate() {
            let m: usize = cache.experts.src_rows[i].iter().sum();
            if m == 0 {
                continue;
            }
            let (act, xin) = (&cache.experts.act[i], &cache.experts.xin[i]);
            let dfc = &dfc[i * width..(i + 1) * width];
            match self.expert(l, x_)? {
                ExpertIds::Gelu(w) => {
                    self.linear_weight(grads, w.proj.parts(), &dy[i], act, m, hid, c)?;
                    self.linear_weight(grads, w.fc.parts(), &dfc[0], xin, m, c, hid)?;
                }
                ExpertIds::SwiGlu(w) => {
                    self.linear_weight(grads, (w.down, None), &dy[i], act, m, hid, c)?;
                    self.linear_weight(grads, (w.gate, None), &dfc[0], xin, m, c, hid)?;
                    self.linear_weight(grads, (w.up, None), &dfc[1], xin, m, c, hid)?;
                }
            }
        }
        Ok(())
    }

    /// The router's and ln2's weight gradients.
    pub fn moe_router_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        cache: &MoeCache<B>,
        stash: &MoeStash<B>,
    ) -> Result<(), BackendError> {
        let MoeDims { n, c, e, .. } = cache.routed.dims;
        let ids = self.experts_ids(cache.routed.layer)?;
        self.b.matmul_backward_weight(
            grad_mut(grads, ids.router)?,
            None,
            &stash.dlogits,
            &cache.routed.ln,
            n,
            c,
            e,
        );
        match ids.norm_bias {
            Some(bias) => self.layernorm_weight(
                grads,
                crate::model::params::Norm {
                    weight: ids.norm,
                    bias,
                },
                &stash.dln,
                &cache.routed.x,
                &cache.routed.mean,
                &cache.routed.rstd,
                n,
                c,
            ),
            None => {
                self.b.rmsnorm_backward_weight(
                    grad_mut(grads, ids.norm)?,
                    &stash.dln,
                    &cache.routed.x,
                    &cache.routed.rstd,
                    n,
                    c,
                );
                Ok(())
            }
        }
    }

    /// Input projections per expert: GELU's `c_fc` (1), SwiGLU's gate and
    /// up (2); `MoeExperts::fc` and the `dfc` gradients hold that many per
    /// local expert, in order.
    fn fc_width(&self) -> usize {
        match self.table.family {
            crate::model::params::FamilyIds::Gpt2 { .. } => 1,
            crate::model::params::FamilyIds::Llama { .. } => 2,
        }
    }
}
