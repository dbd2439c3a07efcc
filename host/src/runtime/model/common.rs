//! What every model family composes with: a segment's shapes ([`Dims`]),
//! the [`Model`] over a backend and its parameter table, the group a
//! spread segment meets ([`Peers`]: a tensor-parallel sum or an expert
//! exchange), and the layers the families share (linear, layernorm, the
//! row-parallel projection onto the residual, their weight gradients).
//! Parameters are read by id ([`ParamTable`]); linear weights are `[out,
//! in]` (llm.c's layout).

// Compositions carry their shapes as arguments, as the kernels do.
#![allow(clippy::too_many_arguments)]

use crate::model::params::{Norm, ParamId, ParamTable};
use crate::model::{Arch, Dtype, ModelConfig, MoeConfig};
use crate::runtime::backend::{
    grad_mut, grad_pair, param, Backend, BackendError, ParamMap, SeqRows,
};

/// The dimensions of one piece of work: `b` sequences of `t` tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub v: usize,
    /// The MoE configuration, for expert halves.
    pub moe: Option<MoeConfig>,
    /// Tensor-parallel degree: attention and the MLP hold `1/tp` of their
    /// heads and hidden units (1: whole).
    pub tp: usize,
    /// This member's rank in its tensor-parallel group.
    pub tp_rank: usize,
    /// Sequence parallelism over the tensor-parallel group: inside blocks
    /// the residual stream and the norms hold [`Dims::rows`] rows.
    pub sp: bool,
    /// The architecture (the Llama family's shapes and constants).
    pub arch: Arch,
    /// The memory-efficient attention kernel (see [`crate::model::Attention`]):
    /// attention keeps a log-sum-exp `[b, heads, t]` (fp32) instead of the
    /// probabilities.
    pub flash: bool,
    /// The whole sequence's length (`t` unless context-parallel).
    pub seq: usize,
    /// Context parallelism: the group's size and this member's rank, and
    /// whether its keys and values go around a ring (else all-gathered).
    pub cp: usize,
    pub cp_rank: usize,
    pub ring: bool,
}

impl Dims {
    pub fn new(cfg: &ModelConfig, b: usize) -> Self {
        Dims {
            b,
            t: cfg.seq_len as usize,
            c: cfg.d_model as usize,
            nh: cfg.heads as usize,
            v: cfg.vocab as usize,
            moe: cfg.moe,
            tp: 1,
            tp_rank: 0,
            sp: false,
            arch: cfg.arch(),
            flash: cfg.flash_attention(),
            seq: cfg.seq_len as usize,
            cp: 1,
            cp_rank: 0,
            ring: false,
        }
    }
    /// Rank `rank` of a context-parallel group of `cp` (`ring`: its keys
    /// and values go around a ring): its two chunks of each sequence (see
    /// [`SeqRows::balanced`]).
    pub fn with_context(self, cp: usize, rank: usize, ring: bool) -> Self {
        let d = Dims {
            cp: cp.max(1),
            cp_rank: rank,
            ring,
            ..self
        };
        Dims {
            t: d.held().len(),
            ..d
        }
    }
    /// Which of the sequence's positions this device's `t` rows are:
    /// under context parallelism its two chunks (attention meets the
    /// others' keys and values over the group), otherwise all of them.
    pub fn held(&self) -> SeqRows {
        SeqRows::balanced(self.seq, self.cp, self.cp_rank)
    }
    /// Context-parallel: this device holds part of each sequence.
    pub fn context(&self) -> bool {
        self.cp > 1
    }
    /// The whole-batch row (`sequence × seq + position`) of each row held.
    pub fn held_rows(&self) -> Vec<u32> {
        let held = self.held();
        (0..self.b * self.t)
            .map(|i| (i / self.t * self.seq + held.position(i % self.t)) as u32)
            .collect()
    }
    /// The position of each row held.
    pub fn held_positions(&self) -> Vec<u32> {
        let held = self.held();
        (0..self.b * self.t)
            .map(|i| held.position(i % self.t) as u32)
            .collect()
    }
    pub fn n(&self) -> usize {
        self.b * self.t
    }
    /// Rows of the residual stream inside a block on this device: `1/tp`
    /// of the tokens under sequence parallelism, all of them otherwise.
    pub fn rows(&self) -> usize {
        if self.sp {
            self.n() / self.tp.max(1)
        } else {
            self.n()
        }
    }
}

/// The model's computation on one device: its backend, the parameter
/// table its states are indexed by, and the dtype it stores activations and
/// their gradients in (the precision policy's; normalization statistics
/// stay fp32, and the kernels compute in fp32 whatever the storage).
pub struct Model<'a, B: Backend> {
    pub b: &'a B,
    pub table: &'a ParamTable,
    pub act: Dtype,
}

impl<B: Backend> Clone for Model<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Model<'_, B> {}

/// What a tensor-parallel group does with one member's tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coll {
    /// Every member's partial result added in group order (Megatron's `g`
    /// in forward, `f`'s backward).
    Sum,
    /// Sequence parallelism: every member's rows, in rank order (the
    /// whole tensor from each member's `1/tp` of its rows).
    Gather,
    /// Sequence parallelism: this member's rows of a whole tensor every
    /// member holds (no exchange).
    Shard,
    /// Context parallelism: the whole sequences `[b, seq, w]` from each
    /// context-parallel member's rows `[b, t, w]` (its chunks), in
    /// position order.
    ContextGather,
    /// Context parallelism's ring: hand the tensor to the next member
    /// (returns nothing; never blocks).
    ContextSend,
    /// Context parallelism's ring: the previous member's tensor of this
    /// member's oldest send not yet matched (the argument is not read).
    ContextRecv,
    /// Context parallelism: the sum over the context-parallel group of a
    /// whole-sequence tensor `[b, seq, w]`, this member's rows of it.
    ContextScatter,
    /// Sequence parallelism's overlapped gather: post this member's rows
    /// to every other member at once (returns nothing; never blocks).
    Post,
    /// The rows member `m` posted (the argument is not read).
    Take(usize),
    /// Sequence parallelism's overlapped reduce-scatter: this member's
    /// partial result for member `m`'s rows, sent to it (kept when `m` is
    /// this member; returns nothing; never blocks).
    Part(usize),
    /// Every member's [`Coll::Part`] for this member's rows (its `1/tp`
    /// of them, contiguous, in rank order), summed in device order (fp32,
    /// rounded once).
    Parts,
}

/// A tensor-parallel group's collectives ([`Coll`]) on this member's tensor.
pub type Reduce<'a, B> =
    dyn FnMut(Coll, <B as Backend>::Tensor) -> Result<<B as Backend>::Tensor, BackendError> + 'a;

/// A gathered tensor (`None`: it was whole already) and its products.
type Gathered<B> = (Option<<B as Backend>::Tensor>, Vec<<B as Backend>::Tensor>);

/// The rows each member of a sequence-parallel group of `tp` holds of `n`.
fn sp_rows(n: usize, tp: usize) -> Result<usize, BackendError> {
    match n.is_multiple_of(tp) {
        true => Ok(n / tp),
        false => Err(BackendError::Exchange(format!(
            "{n} rows do not split over a sequence-parallel group of {tp}"
        ))),
    }
}

/// A segment spread over a group of devices.
pub enum Peers<'a, 'b, B: Backend> {
    /// Expert parallelism (`shard`): this device's place in the EP group and
    /// the all-to-all that reaches its members.
    Experts {
        group: ExpertGroup,
        exchange: &'a mut Exchange<'b, B>,
        /// Under context parallelism, the sum over the group that splits
        /// this device's sequences.
        context: Option<&'a mut ContextSum<'b>>,
    },
    /// Tensor parallelism (`shard-tensor`) or context parallelism: the
    /// group's collectives; the shapes are in [`Dims`].
    Tensor {
        reduce: &'a mut Reduce<'b, B>,
        context: Option<&'a mut ContextSum<'b>>,
    },
}

impl<B: Backend> Peers<'_, '_, B> {
    pub(super) fn reduce(&mut self) -> Option<&mut Reduce<'_, B>> {
        match self {
            Peers::Tensor { reduce, .. } => Some(&mut **reduce),
            Peers::Experts { .. } => None,
        }
    }
    /// The context-parallel group's sum, when the sequences are split.
    pub(super) fn context(&mut self) -> Option<&mut ContextSum<'_>> {
        match self {
            Peers::Tensor { context, .. } | Peers::Experts { context, .. } => {
                context.as_deref_mut().map(|c| c as &mut ContextSum<'_>)
            }
        }
    }
}

/// Host values summed over a context-parallel group (fp32, in member
/// order): statistics of whole sequences whose tokens the group shares,
/// such as a MoE layer's sequence-wise balance loss.
pub type ContextSum<'a> = dyn FnMut(Vec<f32>) -> Result<Vec<f32>, BackendError> + 'a;

/// A spread computation that met no group.
fn no_group(what: &str) -> BackendError {
    BackendError::Exchange(format!("{what} runs without its group"))
}

/// Device bytes of the given tensors.
pub(super) fn bytes_of<B: Backend>(ts: &[&B::Tensor]) -> u64 {
    ts.iter().map(|t| B::bytes(t)).sum()
}

/// A layernorm's output, mean and rstd.
type Normed<B> = (
    <B as Backend>::Tensor,
    <B as Backend>::Tensor,
    <B as Backend>::Tensor,
);

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
pub type Exchange<'a, B> = dyn FnMut(u32, Vec<<B as Backend>::Tensor>) -> Result<Vec<<B as Backend>::Tensor>, BackendError>
    + 'a;

/// The exchange of one device alone: its chunk comes back.
pub fn alone<B: Backend>(_: u32, chunks: Vec<B::Tensor>) -> Result<Vec<B::Tensor>, BackendError> {
    Ok(chunks)
}

impl<'a, B: Backend> Model<'a, B> {
    /// fp32 activations.
    pub fn new(b: &'a B, table: &'a ParamTable) -> Self {
        Model {
            b,
            table,
            act: Dtype::F32,
        }
    }

    /// The same model storing activations as `act`.
    pub fn with_act(self, act: Dtype) -> Self {
        Model { act, ..self }
    }

    /// `n` zeros in the activation dtype.
    pub(super) fn zeros(&self, n: usize) -> Result<B::Tensor, BackendError> {
        self.b.zeros_as(n, self.act)
    }

    /// Causal attention of `nh` heads of `qkv[b·t, 3c]` into `out[b·t, c]`;
    /// what its backward reads besides them: the probabilities, or with
    /// `dims.flash` the rows' log-sum-exp (fp32).
    pub(super) fn attention(
        &self,
        out: &mut B::Tensor,
        qkv: &B::Tensor,
        (b, t, c, nh): (usize, usize, usize, usize),
        dims: &Dims,
        group: Option<&mut Reduce<'_, B>>,
    ) -> Result<B::Tensor, BackendError> {
        if dims.context() && dims.ring {
            // Each member's block in turn (its own first), passed on
            // before it is attended to, merged into the rows' output.
            let g = group.ok_or_else(|| no_group("context-parallel attention"))?;
            // The merged output stays fp32 until the last block.
            let (cp, rank) = (dims.cp, dims.cp_rank);
            let mut lse = self.b.zeros(b * nh * t)?;
            let mut merged = self.b.zeros(b * t * c)?;
            let mut cur: Option<B::Tensor> = None;
            for s in 0..cp {
                let src = (rank + cp - s) % cp;
                let block = cur.as_ref().unwrap_or(qkv);
                if s + 1 < cp {
                    g(Coll::ContextSend, self.b.duplicate(block)?)?;
                }
                let rows = (dims.held(), SeqRows::balanced(dims.seq, cp, src));
                self.b.flash_ring_forward(
                    &mut merged,
                    &mut lse,
                    qkv,
                    block,
                    b,
                    c,
                    nh,
                    rows,
                    s == 0,
                );
                if s + 1 < cp {
                    cur = Some(g(Coll::ContextRecv, Default::default())?);
                }
            }
            *out = self.b.cast(&merged, B::dtype(out))?;
            return Ok(lse);
        }
        if dims.context() {
            // The group's chunks make whole sequences; this device's
            // queries attend to every key before them.
            let g = group.ok_or_else(|| no_group("context-parallel attention"))?;
            let whole = g(Coll::ContextGather, self.b.duplicate(qkv)?)?;
            let mut lse = self.b.zeros(b * nh * t)?;
            let seq = dims.seq;
            self.b
                .flash_attention_forward(out, &mut lse, &whole, b, seq, c, nh, dims.held());
            return Ok(lse);
        }
        if dims.flash {
            let mut lse = self.b.zeros(b * nh * t)?;
            let all = SeqRows::all(t);
            self.b
                .flash_attention_forward(out, &mut lse, qkv, b, t, c, nh, all);
            return Ok(lse);
        }
        let mut att = self.zeros(b * nh * t * t)?;
        self.b.attention_forward(out, &mut att, qkv, b, t, c, nh);
        Ok(att)
    }

    /// [`Model::attention`]'s backward: `dqkv += ∂out/∂qkv · dout`, from
    /// what it kept (`kept`) and its output.
    /// Under context parallelism the keys' and values' gradients of the
    /// whole sequences are summed over the group onto their holders.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward(
        &self,
        dqkv: &mut B::Tensor,
        dout: &B::Tensor,
        qkv: &B::Tensor,
        (out, kept): (&B::Tensor, &B::Tensor),
        (b, t, c, nh): (usize, usize, usize, usize),
        dims: &Dims,
        group: Option<&mut Reduce<'_, B>>,
    ) -> Result<(), BackendError> {
        if dims.context() && dims.ring {
            // Each member's block in turn, its key and value gradients
            // (fp32) travelling with it back to its holder.
            let g = group.ok_or_else(|| no_group("context-parallel attention"))?;
            let (cp, rank) = (dims.cp, dims.cp_rank);
            let mut dq = self.b.zeros(b * t * 3 * c)?;
            let mut dkv = self.b.zeros(b * t * 3 * c)?;
            let mut cur: Option<B::Tensor> = None;
            for s in 0..cp {
                let src = (rank + cp - s) % cp;
                let block = cur.as_ref().unwrap_or(qkv);
                if s + 1 < cp {
                    g(Coll::ContextSend, self.b.duplicate(block)?)?;
                }
                let rows = (dims.held(), SeqRows::balanced(dims.seq, cp, src));
                self.b.flash_ring_backward(
                    &mut dq, &mut dkv, dout, qkv, block, out, kept, b, c, nh, rows,
                );
                g(Coll::ContextSend, dkv)?;
                if s + 1 < cp {
                    cur = Some(g(Coll::ContextRecv, Default::default())?);
                }
                dkv = g(Coll::ContextRecv, Default::default())?;
            }
            // Back home: this member's own keys' and values' gradients.
            self.b.add(&mut dq, &dkv);
            let dq = self.b.cast(&dq, B::dtype(dqkv))?;
            self.b.add(dqkv, &dq);
            return Ok(());
        }
        if dims.context() {
            let g = group.ok_or_else(|| no_group("context-parallel attention"))?;
            let whole = g(Coll::ContextGather, self.b.duplicate(qkv)?)?;
            let seq = dims.seq;
            // fp32 gradients, summed over the group before one rounding.
            let mut dwhole = self.b.zeros(b * seq * 3 * c)?;
            self.b.flash_attention_backward(
                &mut dwhole,
                dout,
                &whole,
                out,
                kept,
                b,
                seq,
                c,
                nh,
                dims.held(),
            );
            drop(whole);
            let mine = g(Coll::ContextScatter, dwhole)?;
            let mine = self.b.cast(&mine, B::dtype(dqkv))?;
            self.b.add(dqkv, &mine);
            return Ok(());
        }
        match dims.flash {
            true => self.b.flash_attention_backward(
                dqkv,
                dout,
                qkv,
                out,
                kept,
                b,
                t,
                c,
                nh,
                SeqRows::all(t),
            ),
            false => self
                .b
                .attention_backward(dqkv, dout, qkv, kept, b, t, c, nh),
        }
        Ok(())
    }

    /// Rotary embeddings of `x[b·t, heads·hd]` at the positions of the rows
    /// held (under context parallelism, through the whole sequences: the
    /// rows placed at their positions, rotated, taken back).
    pub(super) fn rope_held(
        &self,
        x: &mut B::Tensor,
        dims: &Dims,
        (heads, hd): (usize, usize),
        inverse: bool,
    ) -> Result<(), BackendError> {
        let theta = dims.arch.rope_theta;
        if !dims.context() {
            self.b.rope(x, dims.b, dims.t, heads, hd, theta, inverse);
            return Ok(());
        }
        let w = heads * hd;
        let rows = dims.held_rows();
        let mut whole = self.zeros(dims.b * dims.seq * w)?;
        self.b.scatter_add_rows(&mut whole, x, 0, &rows, 1, w);
        self.b
            .rope(&mut whole, dims.b, dims.seq, heads, hd, theta, inverse);
        self.b.gather_rows(x, 0, &whole, &rows, 1, w);
        Ok(())
    }

    /// The linear layer `(W, b)` on `inp[n, ic]`: `inp · Wᵀ (+ b)`, `[n, oc]`.
    pub(super) fn linear(
        &self,
        params: &ParamMap<B::Tensor>,
        (w, bias): (ParamId, Option<ParamId>),
        inp: &B::Tensor,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<B::Tensor, BackendError> {
        let bias = match bias {
            Some(b) => Some(param(params, b)?),
            None => None,
        };
        let mut out = self.zeros(n * oc)?;
        self.b
            .matmul_forward(&mut out, inp, param(params, w)?, bias, n, ic, oc);
        Ok(out)
    }

    /// The layernorm `norm` on `inp[n, c]`: (output, mean, rstd).
    pub(super) fn layernorm(
        &self,
        params: &ParamMap<B::Tensor>,
        norm: Norm,
        inp: &B::Tensor,
        n: usize,
        c: usize,
    ) -> Result<Normed<B>, BackendError> {
        let (mut out, mut mean, mut rstd) =
            (self.zeros(n * c)?, self.b.zeros(n)?, self.b.zeros(n)?);
        self.b.layernorm_forward(
            &mut out,
            &mut mean,
            &mut rstd,
            inp,
            param(params, norm.weight)?,
            param(params, norm.bias)?,
            n,
            c,
        );
        Ok((out, mean, rstd))
    }

    /// Products of a tensor `x` of `n` rows of `w` of which this member
    /// holds its `1/tp` under sequence parallelism (all of them otherwise):
    /// `f(x_rows, rows)` gives the products' outputs for those rows, of
    /// widths `outs`. Returns the whole tensor (every member's rows in rank
    /// order; `None` when `x` is whole already) and the products for all
    /// `n` rows. Under sequence parallelism this member's rows are posted
    /// to the group at once and each member's multiplied as it arrives,
    /// its own first, so the exchange overlaps the products (Megatron's
    /// `--tp-comm-overlap`; pairwise, not a ring).
    pub(super) fn gathered_products(
        &self,
        x: &B::Tensor,
        (n, w): (usize, usize),
        outs: &[usize],
        dims: &Dims,
        group: Option<&mut Reduce<'_, B>>,
        mut f: impl FnMut(&B::Tensor, usize) -> Result<Vec<B::Tensor>, BackendError>,
    ) -> Result<Gathered<B>, BackendError> {
        let g = match group {
            Some(g) if dims.sp && dims.tp > 1 => g,
            _ => return Ok((None, f(x, n)?)),
        };
        let (tp, rank) = (dims.tp, dims.tp_rank);
        let per = sp_rows(n, tp)?;
        g(Coll::Post, self.b.duplicate(x)?)?;
        let mut whole = self.b.zeros_as(n * w, B::dtype(x))?;
        let mut all = Vec::with_capacity(outs.len());
        for ow in outs {
            all.push(self.zeros(n * ow)?);
        }
        for s in 0..tp {
            let m = (rank + tp - s) % tp;
            let taken = match s {
                0 => None,
                _ => Some(g(Coll::Take(m), Default::default())?),
            };
            let rows = taken.as_ref().unwrap_or(x);
            self.b.copy(&mut whole, m * per * w, rows, 0..per * w);
            let got = f(rows, per)?;
            if got.len() != outs.len() {
                return Err(BackendError::Device(format!(
                    "{} products of a gathered tensor, not {}",
                    got.len(),
                    outs.len()
                )));
            }
            for ((o, p), ow) in all.iter_mut().zip(&got).zip(outs) {
                self.b.copy(o, m * per * ow, p, 0..per * ow);
            }
        }
        Ok((Some(whole), all))
    }

    /// Products summed over the tensor-parallel group: `f(rows)` is this
    /// member's part `[rows.len(), w]` of the sum's rows `rows` (of `n`).
    /// Under sequence parallelism the sum's rows are scattered (this
    /// member's `1/tp` of them): each other member's part is computed and
    /// sent as soon as it is done, this member's own last, then the parts
    /// of its rows are summed, so the products overlap the exchange.
    /// Otherwise the whole sum (alone: the product itself).
    pub(super) fn scattered_products(
        &self,
        n: usize,
        dims: &Dims,
        group: Option<&mut Reduce<'_, B>>,
        mut f: impl FnMut(std::ops::Range<usize>) -> Result<B::Tensor, BackendError>,
    ) -> Result<B::Tensor, BackendError> {
        let g = match group {
            Some(g) if dims.sp && dims.tp > 1 => g,
            Some(g) => return g(Coll::Sum, f(0..n)?),
            None => return f(0..n),
        };
        let (tp, rank) = (dims.tp, dims.tp_rank);
        let per = sp_rows(n, tp)?;
        for s in 1..=tp {
            let m = (rank + s) % tp;
            g(Coll::Part(m), f(m * per..(m + 1) * per)?)?;
        }
        g(Coll::Parts, Default::default())
    }

    /// Rows `rows` of `t` (rows of `w`), or `None` when they are all of it.
    pub(super) fn rows(
        &self,
        t: &B::Tensor,
        rows: std::ops::Range<usize>,
        w: usize,
    ) -> Result<Option<B::Tensor>, BackendError> {
        if rows.start == 0 && rows.end * w == B::len(t) {
            return Ok(None);
        }
        let mut out = self.b.zeros_as(rows.len() * w, B::dtype(t))?;
        self.b.copy(&mut out, 0, t, rows.start * w..rows.end * w);
        Ok(Some(out))
    }

    /// `dx += dY_i · W_i` over `(dY_i [n, oc_i], W_i)` for rows `rows`: a
    /// column-parallel layer's input gradient `[rows.len(), ic]`, this
    /// member's part of its sum.
    pub(super) fn input_grad_rows(
        &self,
        params: &ParamMap<B::Tensor>,
        lins: &[(&B::Tensor, ParamId, usize)],
        rows: std::ops::Range<usize>,
        ic: usize,
    ) -> Result<B::Tensor, BackendError> {
        let r = rows.len();
        let mut dx = self.zeros(r * ic)?;
        for (i, (dy, w, oc)) in lins.iter().enumerate() {
            let part = self.rows(dy, rows.clone(), *oc)?;
            let dy = part.as_ref().unwrap_or(dy);
            self.b
                .matmul_backward_input(&mut dx, dy, param(params, *w)?, r, ic, *oc, i > 0);
        }
        Ok(dx)
    }

    /// The row-parallel layer's input gradient `dout · W` (`W` `[c, ic]`)
    /// from this member's rows of `dout` (`[rows, c]` under sequence
    /// parallelism, overlapped with the gather as in
    /// [`Model::gathered_products`]): the whole `dout` (`None` when it was
    /// whole), which the weight pass reads, and the gradient `[n, ic]`.
    pub(super) fn gathered_input_grad(
        &self,
        params: &ParamMap<B::Tensor>,
        dout: &B::Tensor,
        w: ParamId,
        (n, ic, c): (usize, usize, usize),
        dims: &Dims,
        group: Option<&mut Reduce<'_, B>>,
    ) -> Result<(Option<B::Tensor>, B::Tensor), BackendError> {
        let weight = param(params, w)?;
        let (whole, mut d) = self.gathered_products(dout, (n, c), &[ic], dims, group, |x, r| {
            let mut d = self.zeros(r * ic)?;
            self.b
                .matmul_backward_input(&mut d, x, weight, r, ic, c, false);
            Ok(vec![d])
        })?;
        let d = d
            .pop()
            .ok_or_else(|| BackendError::Device("no input gradient".into()))?;
        Ok((whole, d))
    }

    /// Column-parallel linears `(W, bias, oc)` on a norm's output `x[rows,
    /// c]`: made whole over the group under sequence parallelism,
    /// overlapped with the products ([`Model::gathered_products`]). Returns
    /// the whole norm output and the linears' outputs `[n, oc]`.
    pub(super) fn gathered_linears(
        &self,
        params: &ParamMap<B::Tensor>,
        x: B::Tensor,
        lins: &[(ParamId, Option<ParamId>, usize)],
        (n, c): (usize, usize),
        dims: &Dims,
        group: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, Vec<B::Tensor>), BackendError> {
        let outs: Vec<usize> = lins.iter().map(|l| l.2).collect();
        let (whole, outs) = self.gathered_products(&x, (n, c), &outs, dims, group, |x, r| {
            lins.iter()
                .map(|(w, bias, oc)| self.linear(params, (*w, *bias), x, r, c, *oc))
                .collect()
        })?;
        Ok((whole.unwrap_or(x), outs))
    }

    /// The row-parallel end of a tensor-parallel layer: `inp[n, ic] · Wᵀ`
    /// summed over the group (its rows of the sum under sequence
    /// parallelism, overlapped: [`Model::scattered_products`]), then
    /// `+ bias`.
    fn row_parallel(
        &self,
        params: &ParamMap<B::Tensor>,
        (w, bias): (ParamId, Option<ParamId>),
        inp: &B::Tensor,
        (n, ic, oc): (usize, usize, usize),
        dims: &Dims,
        reduce: &mut Reduce<'_, B>,
    ) -> Result<B::Tensor, BackendError> {
        let weight = param(params, w)?;
        let mut out = self.scattered_products(n, dims, Some(reduce), |rows| {
            let r = rows.len();
            let part = self.rows(inp, rows, ic)?;
            let mut out = self.zeros(r * oc)?;
            let x = part.as_ref().unwrap_or(inp);
            self.b.matmul_forward(&mut out, x, weight, None, r, ic, oc);
            Ok(out)
        })?;
        if let Some(b) = bias {
            self.b.add_bias(&mut out, param(params, b)?, oc);
        }
        Ok(out)
    }

    /// A block's projection back onto the residual stream: `res + inp · Wᵀ
    /// (+ bias)`, the residual fused into the GEMM; under tensor
    /// parallelism the row-parallel product is summed over the group first
    /// (reduce-scattered onto the residual's rows under sequence
    /// parallelism), then the residual added.
    pub(super) fn onto_residual(
        &self,
        params: &ParamMap<B::Tensor>,
        (w, bias): (ParamId, Option<ParamId>),
        inp: &B::Tensor,
        res: &B::Tensor,
        shape: (usize, usize, usize),
        dims: &Dims,
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<B::Tensor, BackendError> {
        let (n, ic, oc) = shape;
        match reduce {
            None => {
                let mut out = self.zeros(n * oc)?;
                let bias = match bias {
                    Some(b) => Some(param(params, b)?),
                    None => None,
                };
                self.b.matmul_forward_residual(
                    &mut out,
                    res,
                    inp,
                    param(params, w)?,
                    bias,
                    n,
                    ic,
                    oc,
                );
                Ok(out)
            }
            Some(reduce) => {
                let proj = self.row_parallel(params, (w, bias), inp, shape, dims, reduce)?;
                let mut out = self.zeros(B::len(&proj))?;
                self.b.residual_forward(&mut out, res, &proj);
                Ok(out)
            }
        }
    }

    /// The end of a half's backward: the gradient of its layernorm's output
    /// `dln` (summed over a tensor-parallel group, this member's rows of
    /// it under sequence parallelism: [`Model::scattered_products`]),
    /// through the layernorm (its input, mean and rstd on `rows` rows),
    /// added to the residual's `dout`: the half's input gradient, and
    /// `dln` for the weight pass.
    pub(super) fn back_to_residual(
        &self,
        params: &ParamMap<B::Tensor>,
        norm: Norm,
        dln: B::Tensor,
        dout: &B::Tensor,
        (x, mean, rstd): (&B::Tensor, &B::Tensor, &B::Tensor),
        (rows, c): (usize, usize),
    ) -> Result<(B::Tensor, B::Tensor), BackendError> {
        let mut dx = self.b.duplicate(dout)?;
        self.b.layernorm_backward_input(
            &mut dx,
            &dln,
            x,
            param(params, norm.weight)?,
            mean,
            rstd,
            rows,
            c,
        );
        Ok((dx, dln))
    }

    /// Accumulate linear layer `lin`'s gradients from `dout[n, oc]` and `inp[n, ic]`.
    pub(super) fn linear_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        (w, bias): (ParamId, Option<ParamId>),
        dout: &B::Tensor,
        inp: &B::Tensor,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Result<(), BackendError> {
        match bias {
            Some(b) => {
                let (dw, db) = grad_pair(grads, w, b)?;
                self.b
                    .matmul_backward_weight(dw, Some(db), dout, inp, n, ic, oc);
            }
            None => self
                .b
                .matmul_backward_weight(grad_mut(grads, w)?, None, dout, inp, n, ic, oc),
        }
        Ok(())
    }

    /// Accumulate layernorm `norm`'s gradients.
    pub(super) fn layernorm_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        norm: Norm,
        dout: &B::Tensor,
        inp: &B::Tensor,
        mean: &B::Tensor,
        rstd: &B::Tensor,
        n: usize,
        c: usize,
    ) -> Result<(), BackendError> {
        let (dw, db) = grad_pair(grads, norm.weight, norm.bias)?;
        self.b
            .layernorm_backward_weight(dw, db, dout, inp, mean, rstd, n, c);
        Ok(())
    }
}
