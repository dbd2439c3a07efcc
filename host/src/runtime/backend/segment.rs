//! The model as segments, over any [`Backend`] (GPT-2's halves here, the
//! Llama family's in [`super::llama`]): for each segment a
//! forward (with the caches backward needs, as device tensors), a
//! backward-for-input (which also stashes the gradients the weight pass
//! needs) and a backward-for-weights, composed from the backend's kernels.
//! Parameters are read by id ([`ParamTable`]); linear weights are `[out,
//! in]` (llm.c's layout).

// Compositions carry their shapes as arguments, as the kernels do.
#![allow(clippy::too_many_arguments)]

use super::llama::{LlamaAttnCache, LlamaAttnStash, SwiGluCache, SwiGluStash};
use super::moe::{Exchange, ExpertGroup, MoeCache, MoeDims, MoeStash};
use super::{grad_mut, grad_pair, param, Backend, BackendError, ParamMap};
use crate::model::params::FamilyIds;
use crate::model::params::{AttnIds, MlpIds, Norm, ParamId, ParamTable};
use crate::model::{Arch, Family, ModelConfig, MoeConfig, Part, Segment};

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
    /// The architecture (the Llama family's shapes and constants).
    pub arch: Arch,
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
            arch: cfg.arch(),
        }
    }
    pub fn n(&self) -> usize {
        self.b * self.t
    }
}

/// The model's computation on one device: its backend and the parameter
/// table its states are indexed by.
pub struct Model<'a, B: Backend> {
    pub b: &'a B,
    pub table: &'a ParamTable,
}

impl<B: Backend> Clone for Model<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Model<'_, B> {}

/// A tensor-parallel group's sum (Megatron's `g` in forward, `f`'s
/// backward): every member's partial result added in group order.
pub type Reduce<'a, B> =
    dyn FnMut(<B as Backend>::Tensor) -> Result<<B as Backend>::Tensor, BackendError> + 'a;

/// A segment spread over a group of devices.
pub enum Peers<'a, 'b, B: Backend> {
    /// Expert parallelism (`shard`): this device's place in the EP group and
    /// the all-to-all that reaches its members.
    Experts {
        group: ExpertGroup,
        exchange: &'a mut Exchange<'b, B>,
    },
    /// Tensor parallelism (`shard-tensor`): the group's sum; the shapes are
    /// in [`Dims::tp`].
    Tensor { reduce: &'a mut Reduce<'b, B> },
}

impl<B: Backend> Peers<'_, '_, B> {
    fn reduce(&mut self) -> Option<&mut Reduce<'_, B>> {
        match self {
            Peers::Tensor { reduce } => Some(&mut **reduce),
            Peers::Experts { .. } => None,
        }
    }
}

/// What an attention half keeps from forward for backward (`x2 = x +
/// attproj(attention(qkv(ln1(x))))`).
pub struct AttnCache<B: Backend> {
    layer: u32,
    x: B::Tensor,
    ln1: B::Tensor,
    ln1_mean: B::Tensor,
    ln1_rstd: B::Tensor,
    qkv: B::Tensor,
    att: B::Tensor,
    atty: B::Tensor,
}

/// What a dense MLP half keeps (`out = x2 + fcproj(gelu(fc(ln2(x2))))`).
pub struct MlpCache<B: Backend> {
    layer: u32,
    x2: B::Tensor,
    ln2: B::Tensor,
    ln2_mean: B::Tensor,
    ln2_rstd: B::Tensor,
    fch: B::Tensor,
    fch_gelu: B::Tensor,
}

/// Device bytes of the given tensors.
pub(super) fn bytes_of<B: Backend>(ts: &[&B::Tensor]) -> u64 {
    ts.iter().map(|t| B::bytes(t)).sum()
}

impl<B: Backend> AttnCache<B> {
    fn bytes(&self) -> u64 {
        bytes_of::<B>(&[
            &self.x,
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.att,
            &self.atty,
        ])
    }
    fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        Ok(AttnCache {
            layer: self.layer,
            x: b.duplicate(&self.x)?,
            ln1: b.duplicate(&self.ln1)?,
            ln1_mean: b.duplicate(&self.ln1_mean)?,
            ln1_rstd: b.duplicate(&self.ln1_rstd)?,
            qkv: b.duplicate(&self.qkv)?,
            att: b.duplicate(&self.att)?,
            atty: b.duplicate(&self.atty)?,
        })
    }
}

impl<B: Backend> MlpCache<B> {
    fn bytes(&self) -> u64 {
        bytes_of::<B>(&[
            &self.x2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
        ])
    }
    fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        Ok(MlpCache {
            layer: self.layer,
            x2: b.duplicate(&self.x2)?,
            ln2: b.duplicate(&self.ln2)?,
            ln2_mean: b.duplicate(&self.ln2_mean)?,
            ln2_rstd: b.duplicate(&self.ln2_rstd)?,
            fch: b.duplicate(&self.fch)?,
            fch_gelu: b.duplicate(&self.fch_gelu)?,
        })
    }
}

/// What each part of a segment keeps from forward.
pub enum PartCache<B: Backend> {
    Embedding {
        tokens: B::Ids,
    },
    Block(Box<AttnCache<B>>, Box<MlpCache<B>>),
    LlamaBlock(Box<LlamaAttnCache<B>>, Box<SwiGluCache<B>>),
    Attention(Box<AttnCache<B>>),
    LlamaAttention(Box<LlamaAttnCache<B>>),
    Experts(Box<MoeCache<B>>),
    /// The final norm (`mean` empty for RMSNorm), head and loss.
    Head {
        x: B::Tensor,
        lnf: B::Tensor,
        mean: B::Tensor,
        rstd: B::Tensor,
        probs: B::Tensor,
        targets: B::Ids,
    },
}

/// A segment's forward cache.
pub struct SegmentCache<B: Backend> {
    pub dims: Dims,
    pub parts: Vec<PartCache<B>>,
}

impl<B: Backend> SegmentCache<B> {
    pub fn bytes(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| match p {
                PartCache::Embedding { tokens } => B::ids_bytes(tokens),
                PartCache::Block(a, m) => a.bytes() + m.bytes(),
                PartCache::LlamaBlock(a, m) => a.bytes() + m.bytes(),
                PartCache::Attention(a) => a.bytes(),
                PartCache::LlamaAttention(a) => a.bytes(),
                PartCache::Experts(m) => m.bytes(),
                PartCache::Head {
                    x,
                    lnf,
                    mean,
                    rstd,
                    probs,
                    targets,
                } => bytes_of::<B>(&[x, lnf, mean, rstd, probs]) + B::ids_bytes(targets),
            })
            .sum()
    }

    /// Expert assignments this forward routed and dropped for capacity
    /// (zero without experts).
    pub fn moe_counts(&self) -> (u64, u64) {
        self.parts.iter().fold((0, 0), |(r, d), p| match p {
            PartCache::Experts(m) => (
                r + m.routed.routing.choice.len() as u64,
                d + m.routed.routing.dropped,
            ),
            _ => (r, d),
        })
    }

    /// A device copy (a forward cache two backward ops read).
    /// What a selective recompute keeps of this cache: the norm outputs,
    /// the attention probabilities and the activations are dropped
    /// ([`Model::rebuild`] computes them again); expert parts, the head and
    /// the embedding keep everything.
    pub fn thin(mut self) -> Self {
        for p in &mut self.parts {
            match p {
                PartCache::Block(a, m) => {
                    (a.ln1, a.att) = Default::default();
                    (m.ln2, m.fch_gelu) = Default::default();
                }
                PartCache::Attention(a) => (a.ln1, a.att) = Default::default(),
                PartCache::LlamaBlock(a, m) => {
                    (a.ln1, a.att) = Default::default();
                    (m.ln2, m.act) = Default::default();
                }
                PartCache::LlamaAttention(a) => (a.ln1, a.att) = Default::default(),
                PartCache::Embedding { .. } | PartCache::Experts(_) | PartCache::Head { .. } => {}
            }
        }
        self
    }

    pub fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        let parts = self
            .parts
            .iter()
            .map(|p| {
                Ok(match p {
                    PartCache::Embedding { tokens } => PartCache::Embedding {
                        tokens: b.duplicate_ids(tokens)?,
                    },
                    PartCache::Block(a, m) => {
                        PartCache::Block(Box::new(a.duplicate(b)?), Box::new(m.duplicate(b)?))
                    }
                    PartCache::LlamaBlock(a, m) => {
                        PartCache::LlamaBlock(Box::new(a.duplicate(b)?), Box::new(m.duplicate(b)?))
                    }
                    PartCache::Attention(a) => PartCache::Attention(Box::new(a.duplicate(b)?)),
                    PartCache::LlamaAttention(a) => {
                        PartCache::LlamaAttention(Box::new(a.duplicate(b)?))
                    }
                    PartCache::Experts(m) => PartCache::Experts(Box::new(m.duplicate(b)?)),
                    PartCache::Head {
                        x,
                        lnf,
                        mean,
                        rstd,
                        probs,
                        targets,
                    } => PartCache::Head {
                        x: b.duplicate(x)?,
                        lnf: b.duplicate(lnf)?,
                        mean: b.duplicate(mean)?,
                        rstd: b.duplicate(rstd)?,
                        probs: b.duplicate(probs)?,
                        targets: b.duplicate_ids(targets)?,
                    },
                })
            })
            .collect::<Result<Vec<_>, BackendError>>()?;
        Ok(SegmentCache {
            dims: self.dims,
            parts,
        })
    }
}

/// The attention half's gradients its weight pass reads.
pub struct AttnStash<B: Backend> {
    /// Gradient of the half's output (`x2`).
    dout: B::Tensor,
    dqkv: B::Tensor,
    dln1: B::Tensor,
}

/// The dense MLP half's.
pub struct MlpStash<B: Backend> {
    dout: B::Tensor,
    dfch: B::Tensor,
    dln2: B::Tensor,
}

/// Gradients the weight pass needs, produced by the input pass.
pub enum PartStash<B: Backend> {
    Embedding { dout: B::Tensor },
    Block(AttnStash<B>, MlpStash<B>),
    LlamaBlock(Box<LlamaAttnStash<B>>, Box<SwiGluStash<B>>),
    Attention(AttnStash<B>),
    LlamaAttention(Box<LlamaAttnStash<B>>),
    Experts(Box<MoeStash<B>>),
    Head { dlogits: B::Tensor, dlnf: B::Tensor },
}

/// A segment's input-pass stash.
pub struct SegmentStash<B: Backend> {
    pub parts: Vec<PartStash<B>>,
    /// The forward tensors the weight pass reads (inputs of the matmuls and
    /// layernorms), kept by a split backward so the rest of the forward
    /// cache (attention probabilities, qkv, the MLP pre-activation, the
    /// head's probabilities) is freed at `BI` instead of living until `BW`.
    pub kept: Option<SegmentCache<B>>,
}

impl<B: Backend> SegmentStash<B> {
    pub fn bytes(&self) -> u64 {
        let attn = |a: &AttnStash<B>| bytes_of::<B>(&[&a.dout, &a.dqkv, &a.dln1]);
        let mlp = |m: &MlpStash<B>| bytes_of::<B>(&[&m.dout, &m.dfch, &m.dln2]);
        self.parts
            .iter()
            .map(|p| match p {
                PartStash::Embedding { dout } => B::bytes(dout),
                PartStash::Block(a, m) => attn(a) + mlp(m),
                PartStash::LlamaBlock(a, m) => a.bytes() + m.bytes(),
                PartStash::LlamaAttention(a) => a.bytes(),
                PartStash::Attention(a) => attn(a),
                PartStash::Experts(m) => m.bytes(),
                PartStash::Head { dlogits, dlnf } => bytes_of::<B>(&[dlogits, dlnf]),
            })
            .sum::<u64>()
            + self.kept.as_ref().map_or(0, |c| c.bytes())
    }

    /// Keep from `cache` what [`Model::backward_weight`] reads.
    pub fn keep_for_weights(&mut self, cache: SegmentCache<B>) {
        let attn = |mut a: Box<AttnCache<B>>| {
            a.qkv = Default::default();
            a.att = Default::default();
            a
        };
        let parts = cache
            .parts
            .into_iter()
            .map(|p| match p {
                PartCache::Block(a, mut m) => {
                    m.fch = Default::default();
                    PartCache::Block(attn(a), m)
                }
                PartCache::LlamaBlock(a, m) => PartCache::LlamaBlock(
                    Box::new(a.keep_for_weights()),
                    Box::new(m.keep_for_weights()),
                ),
                PartCache::Attention(a) => PartCache::Attention(attn(a)),
                PartCache::LlamaAttention(a) => {
                    PartCache::LlamaAttention(Box::new(a.keep_for_weights()))
                }
                PartCache::Experts(m) => PartCache::Experts(Box::new(m.keep_for_weights())),
                PartCache::Head {
                    x, lnf, mean, rstd, ..
                } => PartCache::Head {
                    x,
                    lnf,
                    mean,
                    rstd,
                    probs: Default::default(),
                    targets: Default::default(),
                },
                e => e,
            })
            .collect();
        self.kept = Some(SegmentCache {
            dims: cache.dims,
            parts,
        });
    }
}

/// A layernorm's output, mean and rstd.
type Normed<B> = (
    <B as Backend>::Tensor,
    <B as Backend>::Tensor,
    <B as Backend>::Tensor,
);

/// What a segment's forward gives: its output activations (`None` after
/// the head), its cache, and its terms of the summed token losses (the
/// cross-entropy at the head, the load-balancing loss of expert halves), in
/// order; the step adds them up once it ends.
pub type Forward<B> = (
    Option<<B as Backend>::Tensor>,
    SegmentCache<B>,
    Vec<<B as Backend>::Scalar>,
);

impl<'a, B: Backend> Model<'a, B> {
    /// A selective recompute: the tensors [`SegmentCache::thin`] dropped,
    /// computed again with the forward's kernels from what it kept (the
    /// same bits as the forward's).
    pub fn rebuild(
        &self,
        params: &ParamMap<B::Tensor>,
        mut cache: SegmentCache<B>,
    ) -> Result<SegmentCache<B>, BackendError> {
        let dims = cache.dims;
        for p in &mut cache.parts {
            match p {
                PartCache::Block(a, m) => {
                    self.rebuild_attn(params, a, dims)?;
                    self.rebuild_mlp(params, m, dims)?;
                }
                PartCache::Attention(a) => self.rebuild_attn(params, a, dims)?,
                PartCache::LlamaBlock(a, m) => {
                    self.rebuild_llama_attn(params, a, dims)?;
                    self.rebuild_swiglu(params, m, dims)?;
                }
                PartCache::LlamaAttention(a) => self.rebuild_llama_attn(params, a, dims)?,
                PartCache::Embedding { .. } | PartCache::Experts(_) | PartCache::Head { .. } => {}
            }
        }
        Ok(cache)
    }

    /// ln1's output and the attention probabilities of an attention half.
    fn rebuild_attn(
        &self,
        params: &ParamMap<B::Tensor>,
        a: &mut AttnCache<B>,
        dims: Dims,
    ) -> Result<(), BackendError> {
        let Dims {
            b, t, c, nh, tp, ..
        } = dims;
        let (cl, nhl, n) = (c / tp, nh / tp, dims.n());
        let ln1 = self.table.layer(a.layer).attn.ln1;
        (a.ln1, _, _) = self.layernorm(params, ln1, &a.x, n, c)?;
        let mut att = self.b.zeros(b * nhl * t * t)?;
        let mut atty = self.b.zeros(n * cl)?;
        self.b
            .attention_forward(&mut atty, &mut att, &a.qkv, b, t, cl, nhl);
        a.att = att;
        Ok(())
    }

    /// ln2's output and GELU's of a dense MLP half.
    fn rebuild_mlp(
        &self,
        params: &ParamMap<B::Tensor>,
        m: &mut MlpCache<B>,
        dims: Dims,
    ) -> Result<(), BackendError> {
        let (c, n) = (dims.c, dims.n());
        let hl = 4 * c / dims.tp;
        let (ln2, _) = self.dense(m.layer)?;
        (m.ln2, _, _) = self.layernorm(params, ln2, &m.x2, n, c)?;
        // The kept pre-activation already has fc's bias; `gelu_forward` is
        // `bias_gelu_forward` without it (the same operations).
        let mut gelu = self.b.zeros(n * hl)?;
        self.b.gelu_forward(&mut gelu, &m.fch);
        m.fch_gelu = gelu;
        Ok(())
    }

    pub fn new(b: &'a B, table: &'a ParamTable) -> Self {
        Model { b, table }
    }

    /// The head's weight (the tied embedding, or `lm_head`) and its final
    /// norm's gain.
    fn head_ids(&self) -> (crate::model::params::ParamId, crate::model::params::ParamId) {
        match &self.table.family {
            FamilyIds::Gpt2 { lnf, .. } => (self.table.wte, lnf.weight),
            FamilyIds::Llama { norm, lm_head, .. } => (*lm_head, *norm),
        }
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
        let mut out = self.b.zeros(n * oc)?;
        self.b
            .matmul_forward(&mut out, inp, param(params, w)?, bias, n, ic, oc);
        Ok(out)
    }

    /// The layernorm `norm` on `inp[n, c]`: (output, mean, rstd).
    fn layernorm(
        &self,
        params: &ParamMap<B::Tensor>,
        norm: Norm,
        inp: &B::Tensor,
        n: usize,
        c: usize,
    ) -> Result<Normed<B>, BackendError> {
        let (mut out, mut mean, mut rstd) =
            (self.b.zeros(n * c)?, self.b.zeros(n)?, self.b.zeros(n)?);
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

    /// The row-parallel end of a tensor-parallel layer: `inp[n, ic] · Wᵀ`
    /// summed over the group, then `+ bias`; one device: the layer itself.
    fn row_parallel(
        &self,
        params: &ParamMap<B::Tensor>,
        (w, bias): (ParamId, Option<ParamId>),
        inp: &B::Tensor,
        (n, ic, oc): (usize, usize, usize),
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<B::Tensor, BackendError> {
        let bias = match bias {
            Some(b) => Some(param(params, b)?),
            None => None,
        };
        let mut part = self.b.zeros(n * oc)?;
        let Some(reduce) = reduce else {
            self.b
                .matmul_forward(&mut part, inp, param(params, w)?, bias, n, ic, oc);
            return Ok(part);
        };
        self.b
            .matmul_forward(&mut part, inp, param(params, w)?, None, n, ic, oc);
        let mut out = reduce(part)?;
        if let Some(bias) = bias {
            self.b.add_bias(&mut out, bias, oc);
        }
        Ok(out)
    }

    /// A block's projection back onto the residual stream: `res + inp · Wᵀ
    /// (+ bias)`, the residual fused into the GEMM; under tensor
    /// parallelism the row-parallel product is summed over the group first,
    /// then the residual added.
    pub(super) fn onto_residual(
        &self,
        params: &ParamMap<B::Tensor>,
        (w, bias): (ParamId, Option<ParamId>),
        inp: &B::Tensor,
        res: &B::Tensor,
        shape: (usize, usize, usize),
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<B::Tensor, BackendError> {
        let (n, ic, oc) = shape;
        let mut out = self.b.zeros(n * oc)?;
        match reduce {
            None => {
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
                )
            }
            reduce => {
                let proj = self.row_parallel(params, (w, bias), inp, shape, reduce)?;
                self.b.residual_forward(&mut out, res, &proj);
            }
        }
        Ok(out)
    }

    /// Attention half of layer `l`: `x2 = x + attproj(attention(qkv(ln1(x))))`;
    /// under tensor parallelism this device's heads only.
    fn attn_forward(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        x: B::Tensor,
        dims: Dims,
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, AttnCache<B>), BackendError> {
        let Dims {
            b, t, c, nh, tp, ..
        } = dims;
        let (cl, nhl) = (c / tp, nh / tp);
        let n = dims.n();
        let AttnIds { ln1, qkv, proj } = self.table.layer(l).attn;
        let (ln1_out, ln1_mean, ln1_rstd) = self.layernorm(params, ln1, &x, n, c)?;
        let qkv_out = self.linear(params, qkv.parts(), &ln1_out, n, c, 3 * cl)?;
        let mut att = self.b.zeros(b * nhl * t * t)?;
        let mut atty = self.b.zeros(n * cl)?;
        self.b
            .attention_forward(&mut atty, &mut att, &qkv_out, b, t, cl, nhl);
        let x2 = self.onto_residual(
            params,
            (proj.weight, Some(proj.bias)),
            &atty,
            &x,
            (n, cl, c),
            reduce,
        )?;
        let cache = AttnCache {
            layer: l,
            x,
            ln1: ln1_out,
            ln1_mean,
            ln1_rstd,
            qkv: qkv_out,
            att,
            atty,
        };
        Ok((x2, cache))
    }

    /// The ids of layer `l`'s dense half.
    fn dense(&self, l: u32) -> Result<(Norm, MlpIds), BackendError> {
        let layer = self.table.layer(l);
        match (layer.ln2, layer.mlp) {
            (Some(ln2), Some(mlp)) => Ok((ln2, mlp)),
            _ => Err(BackendError::Device(format!(
                "layer {l} has no dense MLP (a MoE model's layers have experts)"
            ))),
        }
    }

    /// Dense MLP half of layer `l`: `out = x2 + fcproj(gelu(fc(ln2(x2))))`;
    /// under tensor parallelism this device's hidden units only.
    fn mlp_forward(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        x2: B::Tensor,
        dims: Dims,
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, MlpCache<B>), BackendError> {
        let c = dims.c;
        let hl = 4 * c / dims.tp;
        let n = dims.n();
        let (ln2, MlpIds { fc, proj }) = self.dense(l)?;
        let (ln2_out, ln2_mean, ln2_rstd) = self.layernorm(params, ln2, &x2, n, c)?;
        let mut fch = self.b.zeros(n * hl)?;
        self.b.matmul_forward(
            &mut fch,
            &ln2_out,
            param(params, fc.weight)?,
            None,
            n,
            c,
            hl,
        );
        let mut fch_gelu = self.b.zeros(n * hl)?;
        self.b
            .bias_gelu_forward(&mut fch, &mut fch_gelu, param(params, fc.bias)?, hl);
        let out = self.onto_residual(
            params,
            (proj.weight, Some(proj.bias)),
            &fch_gelu,
            &x2,
            (n, hl, c),
            reduce,
        )?;
        let cache = MlpCache {
            layer: l,
            x2,
            ln2: ln2_out,
            ln2_mean,
            ln2_rstd,
            fch,
            fch_gelu,
        };
        Ok((out, cache))
    }

    /// The attention half's input gradient from its output gradient `dout`
    /// (kept in the stash for the weight pass); under tensor parallelism the
    /// gradient of ln1's output is summed over the group.
    fn attn_backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        k: &AttnCache<B>,
        dout: B::Tensor,
        dims: Dims,
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, AttnStash<B>), BackendError> {
        let Dims {
            b, t, c, nh, tp, ..
        } = dims;
        let (cl, nhl) = (c / tp, nh / tp);
        let n = dims.n();
        let AttnIds { ln1, qkv, proj } = self.table.layer(k.layer).attn;
        let mut datty = self.b.zeros(n * cl)?;
        self.b.matmul_backward_input(
            &mut datty,
            &dout,
            param(params, proj.weight)?,
            n,
            cl,
            c,
            false,
        );
        let mut dqkv = self.b.zeros(n * 3 * cl)?;
        self.b
            .attention_backward(&mut dqkv, &datty, &k.qkv, &k.att, b, t, cl, nhl);
        let mut dln1 = self.b.zeros(n * c)?;
        self.b.matmul_backward_input(
            &mut dln1,
            &dqkv,
            param(params, qkv.weight)?,
            n,
            c,
            3 * cl,
            false,
        );
        let (dx, dln1) = self.back_to_residual(
            params,
            ln1,
            dln1,
            reduce,
            &dout,
            (&k.x, &k.ln1_mean, &k.ln1_rstd),
            (n, c),
        )?;
        Ok((dx, AttnStash { dout, dqkv, dln1 }))
    }

    /// The end of a half's backward: the gradient of its layernorm's output
    /// `dln` (summed over a tensor-parallel group first), through the
    /// layernorm (its input, mean and rstd), added to the residual's `dout`:
    /// the half's input gradient, and `dln` for the weight pass.
    fn back_to_residual(
        &self,
        params: &ParamMap<B::Tensor>,
        norm: Norm,
        mut dln: B::Tensor,
        reduce: Option<&mut Reduce<'_, B>>,
        dout: &B::Tensor,
        (x, mean, rstd): (&B::Tensor, &B::Tensor, &B::Tensor),
        (n, c): (usize, usize),
    ) -> Result<(B::Tensor, B::Tensor), BackendError> {
        if let Some(reduce) = reduce {
            dln = reduce(dln)?;
        }
        let mut dx = self.b.duplicate(dout)?;
        self.b.layernorm_backward_input(
            &mut dx,
            &dln,
            x,
            param(params, norm.weight)?,
            mean,
            rstd,
            n,
            c,
        );
        Ok((dx, dln))
    }

    /// The dense MLP half's input gradient.
    fn mlp_backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        k: &MlpCache<B>,
        dout: B::Tensor,
        dims: Dims,
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, MlpStash<B>), BackendError> {
        let c = dims.c;
        let hl = 4 * c / dims.tp;
        let n = dims.n();
        let (ln2, MlpIds { fc, proj }) = self.dense(k.layer)?;
        let mut dgelu = self.b.zeros(n * hl)?;
        self.b.matmul_backward_input(
            &mut dgelu,
            &dout,
            param(params, proj.weight)?,
            n,
            hl,
            c,
            false,
        );
        let mut dfch = self.b.zeros(n * hl)?;
        self.b.gelu_backward(&mut dfch, &k.fch, &dgelu);
        let mut dln2 = self.b.zeros(n * c)?;
        self.b
            .matmul_backward_input(&mut dln2, &dfch, param(params, fc.weight)?, n, c, hl, false);
        let (dx2, dln2) = self.back_to_residual(
            params,
            ln2,
            dln2,
            reduce,
            &dout,
            (&k.x2, &k.ln2_mean, &k.ln2_rstd),
            (n, c),
        )?;
        Ok((dx2, MlpStash { dout, dfch, dln2 }))
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

    fn attn_backward_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        k: &AttnCache<B>,
        st: &AttnStash<B>,
        dims: Dims,
    ) -> Result<(), BackendError> {
        let (n, c, cl) = (dims.n(), dims.c, dims.c / dims.tp);
        let AttnIds { ln1, qkv, proj } = self.table.layer(k.layer).attn;
        self.linear_weight(grads, proj.parts(), &st.dout, &k.atty, n, cl, c)?;
        self.linear_weight(grads, qkv.parts(), &st.dqkv, &k.ln1, n, c, 3 * cl)?;
        self.layernorm_weight(grads, ln1, &st.dln1, &k.x, &k.ln1_mean, &k.ln1_rstd, n, c)
    }

    fn mlp_backward_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        k: &MlpCache<B>,
        st: &MlpStash<B>,
        dims: Dims,
    ) -> Result<(), BackendError> {
        let (n, c, hl) = (dims.n(), dims.c, 4 * dims.c / dims.tp);
        let (ln2, MlpIds { fc, proj }) = self.dense(k.layer)?;
        self.linear_weight(grads, proj.parts(), &st.dout, &k.fch_gelu, n, hl, c)?;
        self.linear_weight(grads, fc.parts(), &st.dfch, &k.ln2, n, c, hl)?;
        self.layernorm_weight(grads, ln2, &st.dln2, &k.x2, &k.ln2_mean, &k.ln2_rstd, n, c)
    }

    /// Forward of a segment on `dims.b` sequences. `tokens` feed the
    /// embedding (first segment), `input` the activations from the previous
    /// segment; `targets` the loss (last segment). With `peers`, the segment
    /// is spread over a group and every member calls this for the same
    /// microbatch together.
    pub fn forward(
        &self,
        seg: &Segment,
        params: &ParamMap<B::Tensor>,
        tokens: Option<&[u32]>,
        input: Option<B::Tensor>,
        targets: Option<&[u32]>,
        dims: Dims,
        mut peers: Option<Peers<'_, '_, B>>,
    ) -> Result<Forward<B>, BackendError> {
        let Dims { b, t, c, v, .. } = dims;
        let n = dims.n();
        let missing = |what: &str| {
            BackendError::Device(format!("segment {} runs without its {what}", seg.index))
        };
        let mut x: B::Tensor = input.unwrap_or_default();
        let mut caches = Vec::with_capacity(seg.parts.len());
        let mut loss: Vec<B::Scalar> = Vec::new();
        let mut out_present = true;
        for part in &seg.parts {
            match *part {
                Part::Embedding => {
                    let tokens = tokens.ok_or_else(|| missing("tokens"))?;
                    let ids = self.b.upload_ids(tokens)?;
                    x = self.b.zeros(n * c)?;
                    let wpe = match self.table.gpt2_ends() {
                        Some((wpe, _)) => Some(param(params, wpe)?),
                        None => None,
                    };
                    self.b.embedding_forward(
                        &mut x,
                        &ids,
                        param(params, self.table.wte)?,
                        wpe,
                        b,
                        t,
                        c,
                    );
                    caches.push(PartCache::Embedding { tokens: ids });
                }
                Part::Block(l) if dims.arch.family == Family::Llama => {
                    let inp = std::mem::take(&mut x);
                    let (x2, attn) = self.llama_attn_forward(
                        params,
                        l,
                        inp,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    let (out, mlp) = self.swiglu_forward(
                        params,
                        l,
                        x2,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    x = out;
                    caches.push(PartCache::LlamaBlock(Box::new(attn), Box::new(mlp)));
                }
                Part::Attention(l) if dims.arch.family == Family::Llama => {
                    let inp = std::mem::take(&mut x);
                    let (x2, attn) = self.llama_attn_forward(
                        params,
                        l,
                        inp,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    x = x2;
                    caches.push(PartCache::LlamaAttention(Box::new(attn)));
                }
                Part::Block(l) => {
                    let inp = std::mem::take(&mut x);
                    let (x2, attn) = self.attn_forward(
                        params,
                        l,
                        inp,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    let (out, mlp) = self.mlp_forward(
                        params,
                        l,
                        x2,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    x = out;
                    caches.push(PartCache::Block(Box::new(attn), Box::new(mlp)));
                }
                Part::Attention(l) => {
                    let inp = std::mem::take(&mut x);
                    let (x2, attn) = self.attn_forward(
                        params,
                        l,
                        inp,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    x = x2;
                    caches.push(PartCache::Attention(Box::new(attn)));
                }
                Part::Experts(l) => {
                    let moe = dims.moe.ok_or_else(|| missing("MoE configuration"))?;
                    let d = MoeDims::new(&moe, n, t, c);
                    let inp = std::mem::take(&mut x);
                    let (out, cache, aux) = match peers.as_mut() {
                        Some(Peers::Experts { group, exchange }) => {
                            self.moe_forward(params, l, &moe, inp, d, *group, *exchange)?
                        }
                        _ => self.moe_forward(
                            params,
                            l,
                            &moe,
                            inp,
                            d,
                            ExpertGroup::ALONE,
                            &mut super::moe::alone::<B>,
                        )?,
                    };
                    x = out;
                    loss.push(self.b.scalar(aux));
                    caches.push(PartCache::Experts(Box::new(cache)));
                }
                Part::Head => {
                    let targets = targets.ok_or_else(|| missing("targets"))?;
                    let targets = self.b.upload_ids(targets)?;
                    let (lnf, mean, rstd, head) = match &self.table.family {
                        FamilyIds::Gpt2 { lnf, .. } => {
                            let (o, m, r) = self.layernorm(params, *lnf, &x, n, c)?;
                            (o, m, r, self.table.wte)
                        }
                        FamilyIds::Llama { norm, lm_head, .. } => {
                            let (o, r) =
                                self.rmsnorm(params, *norm, &x, n, c, dims.arch.norm_eps)?;
                            (o, Default::default(), r, *lm_head)
                        }
                    };
                    let mut logits = self.b.zeros(n * v)?;
                    self.b
                        .matmul_forward(&mut logits, &lnf, param(params, head)?, None, n, c, v);
                    let mut probs = self.b.zeros(n * v)?;
                    loss.push(
                        self.b
                            .crossentropy_forward(&mut probs, &logits, &targets, n, v),
                    );
                    caches.push(PartCache::Head {
                        x: std::mem::take(&mut x),
                        lnf,
                        mean,
                        rstd,
                        probs,
                        targets,
                    });
                    out_present = false;
                }
            }
        }
        let out = out_present.then_some(x);
        Ok((
            out,
            SegmentCache {
                dims,
                parts: caches,
            },
            loss,
        ))
    }

    /// Backward for inputs: from `dout` (or, for the head, the loss with
    /// `loss_scale` = 1 / tokens of the global batch) to the gradient of
    /// the segment's input (`None` for the first segment), stashing what
    /// the weight pass needs.
    pub fn backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        cache: &SegmentCache<B>,
        dout: Option<B::Tensor>,
        loss_scale: f32,
        mut peers: Option<Peers<'_, '_, B>>,
    ) -> Result<(Option<B::Tensor>, SegmentStash<B>), BackendError> {
        let dims = cache.dims;
        let Dims { c, v, .. } = dims;
        let n = dims.n();
        let mut d: B::Tensor = dout.unwrap_or_default();
        let mut stash = Vec::with_capacity(cache.parts.len());
        let mut has_input = true;
        for pc in cache.parts.iter().rev() {
            match pc {
                PartCache::Head {
                    x,
                    mean,
                    rstd,
                    probs,
                    targets,
                    ..
                } => {
                    let mut dlogits = self.b.zeros(n * v)?;
                    self.b
                        .crossentropy_backward(&mut dlogits, probs, targets, n, v, loss_scale);
                    let mut dlnf = self.b.zeros(n * c)?;
                    let (head, norm) = self.head_ids();
                    self.b.matmul_backward_input(
                        &mut dlnf,
                        &dlogits,
                        param(params, head)?,
                        n,
                        c,
                        v,
                        false,
                    );
                    let mut dx = self.b.zeros(n * c)?;
                    match &self.table.family {
                        FamilyIds::Gpt2 { .. } => self.b.layernorm_backward_input(
                            &mut dx,
                            &dlnf,
                            x,
                            param(params, norm)?,
                            mean,
                            rstd,
                            n,
                            c,
                        ),
                        FamilyIds::Llama { .. } => self.b.rmsnorm_backward_input(
                            &mut dx,
                            &dlnf,
                            x,
                            param(params, norm)?,
                            rstd,
                            n,
                            c,
                        ),
                    }
                    d = dx;
                    stash.push(PartStash::Head { dlogits, dlnf });
                }
                PartCache::Block(attn, mlp) => {
                    let dout = std::mem::take(&mut d);
                    let (dx2, ms) = self.mlp_backward_input(
                        params,
                        mlp,
                        dout,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    let (dx, at) = self.attn_backward_input(
                        params,
                        attn,
                        dx2,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    d = dx;
                    stash.push(PartStash::Block(at, ms));
                }
                PartCache::LlamaBlock(attn, mlp) => {
                    let dout = std::mem::take(&mut d);
                    let (dx2, ms) = self.swiglu_backward_input(
                        params,
                        mlp,
                        dout,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    let (dx, at) = self.llama_attn_backward_input(
                        params,
                        attn,
                        dx2,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    d = dx;
                    stash.push(PartStash::LlamaBlock(Box::new(at), Box::new(ms)));
                }
                PartCache::LlamaAttention(attn) => {
                    let dout = std::mem::take(&mut d);
                    let (dx, at) = self.llama_attn_backward_input(
                        params,
                        attn,
                        dout,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    d = dx;
                    stash.push(PartStash::LlamaAttention(Box::new(at)));
                }
                PartCache::Attention(attn) => {
                    let dout = std::mem::take(&mut d);
                    let (dx, at) = self.attn_backward_input(
                        params,
                        attn,
                        dout,
                        dims,
                        peers.as_mut().and_then(|s| s.reduce()),
                    )?;
                    d = dx;
                    stash.push(PartStash::Attention(at));
                }
                PartCache::Experts(m) => {
                    let dout = std::mem::take(&mut d);
                    let (dx, ms) = match peers.as_mut() {
                        Some(Peers::Experts { exchange, .. }) => {
                            self.moe_backward_input(params, m, dout, loss_scale, *exchange)?
                        }
                        _ => self.moe_backward_input(
                            params,
                            m,
                            dout,
                            loss_scale,
                            &mut super::moe::alone::<B>,
                        )?,
                    };
                    d = dx;
                    stash.push(PartStash::Experts(Box::new(ms)));
                }
                PartCache::Embedding { .. } => {
                    stash.push(PartStash::Embedding {
                        dout: std::mem::take(&mut d),
                    });
                    has_input = false;
                }
            }
        }
        stash.reverse();
        Ok((
            has_input.then_some(d),
            SegmentStash {
                parts: stash,
                kept: None,
            },
        ))
    }

    /// Backward for weights: accumulate the segment's parameter gradients.
    pub fn backward_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        cache: &SegmentCache<B>,
        stash: &SegmentStash<B>,
    ) -> Result<(), BackendError> {
        let Dims { b, t, c, v, .. } = cache.dims;
        let n = b * t;
        for (pc, st) in cache.parts.iter().zip(&stash.parts) {
            match (pc, st) {
                (PartCache::Embedding { tokens }, PartStash::Embedding { dout }) => {
                    match self.table.gpt2_ends() {
                        Some((wpe, _)) => {
                            let (dwte, dwpe) = grad_pair(grads, self.table.wte, wpe)?;
                            self.b.embedding_backward_weight(
                                dwte,
                                Some(dwpe),
                                dout,
                                tokens,
                                b,
                                t,
                                c,
                            );
                        }
                        None => self.b.embedding_backward_weight(
                            grad_mut(grads, self.table.wte)?,
                            None,
                            dout,
                            tokens,
                            b,
                            t,
                            c,
                        ),
                    }
                }
                (PartCache::LlamaBlock(attn, mlp), PartStash::LlamaBlock(at, ms)) => {
                    self.swiglu_backward_weight(grads, mlp, ms, cache.dims)?;
                    self.llama_attn_backward_weight(grads, attn, at, cache.dims)?;
                }
                (PartCache::LlamaAttention(attn), PartStash::LlamaAttention(at)) => {
                    self.llama_attn_backward_weight(grads, attn, at, cache.dims)?;
                }
                (PartCache::Block(attn, mlp), PartStash::Block(at, ms)) => {
                    self.mlp_backward_weight(grads, mlp, ms, cache.dims)?;
                    self.attn_backward_weight(grads, attn, at, cache.dims)?;
                }
                (PartCache::Attention(attn), PartStash::Attention(at)) => {
                    self.attn_backward_weight(grads, attn, at, cache.dims)?;
                }
                (PartCache::Experts(m), PartStash::Experts(ms)) => {
                    self.moe_backward_weight(grads, m, ms)?;
                }
                (
                    PartCache::Head {
                        x, lnf, mean, rstd, ..
                    },
                    PartStash::Head { dlogits, dlnf },
                ) => {
                    let (head, _) = self.head_ids();
                    self.b.matmul_backward_weight(
                        grad_mut(grads, head)?,
                        None,
                        dlogits,
                        lnf,
                        n,
                        c,
                        v,
                    );
                    match &self.table.family {
                        FamilyIds::Gpt2 { lnf: norm, .. } => {
                            self.layernorm_weight(grads, *norm, dlnf, x, mean, rstd, n, c)?
                        }
                        FamilyIds::Llama { norm, .. } => self.b.rmsnorm_backward_weight(
                            grad_mut(grads, *norm)?,
                            dlnf,
                            x,
                            rstd,
                            n,
                            c,
                        ),
                    }
                }
                _ => {
                    return Err(BackendError::Device(
                        "a weight pass whose stash is not its cache's segment's".into(),
                    ))
                }
            }
        }
        Ok(())
    }
}
