//! GPT-2's block halves: attention (`x + attproj(attention(qkv(ln1(x))))`)
//! and the dense MLP (`x + fcproj(gelu(fc(ln2(x))))`), forward (with their
//! caches), backward for the input (stashing what the weight pass reads),
//! backward for the weights, and a selective recompute's rebuild; tensor
//! parallel over a group when [`super::common::Peers`] says so.

// Compositions carry their shapes as arguments, as the kernels do.
#![allow(clippy::too_many_arguments)]

use super::block::{half, stash_of, Half, HalfBack, HalfStash};
use super::common::{bytes_of, Dims, Model, Reduce};
use crate::model::params::{AttnIds, MlpIds, Norm};
use crate::runtime::backend::{param, Backend, BackendError, ParamMap};

/// What an attention half keeps from forward for backward (`x2 = x +
/// attproj(attention(qkv(ln1(x))))`).
pub struct AttnCache<B: Backend> {
    pub(super) layer: u32,
    pub(super) x: B::Tensor,
    pub(super) ln1: B::Tensor,
    pub(super) ln1_mean: B::Tensor,
    pub(super) ln1_rstd: B::Tensor,
    pub(super) qkv: B::Tensor,
    pub(super) att: B::Tensor,
    pub(super) atty: B::Tensor,
}

/// What a dense MLP half keeps (`out = x2 + fcproj(gelu(fc(ln2(x2))))`).
pub struct MlpCache<B: Backend> {
    pub(super) layer: u32,
    pub(super) x2: B::Tensor,
    pub(super) ln2: B::Tensor,
    pub(super) ln2_mean: B::Tensor,
    pub(super) ln2_rstd: B::Tensor,
    pub(super) fch: B::Tensor,
    pub(super) fch_gelu: B::Tensor,
}

impl<B: Backend> AttnCache<B> {
    pub(super) fn bytes(&self) -> u64 {
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
    pub(super) fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
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
    pub(super) fn bytes(&self) -> u64 {
        bytes_of::<B>(&[
            &self.x2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
        ])
    }
    pub(super) fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
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

/// The attention half's gradients its weight pass reads.
pub struct AttnStash<B: Backend> {
    /// Gradient of the half's output (`x2`).
    pub(super) dout: B::Tensor,
    pub(super) dqkv: B::Tensor,
    pub(super) dln1: B::Tensor,
}

/// The dense MLP half's.
pub struct MlpStash<B: Backend> {
    pub(super) dout: B::Tensor,
    pub(super) dfch: B::Tensor,
    pub(super) dln2: B::Tensor,
}

impl<B: Backend> Model<'_, B> {
    /// ln1's output and the attention probabilities of an attention half.
    pub(super) fn rebuild_attn(
        &self,
        params: &ParamMap<B::Tensor>,
        a: &mut AttnCache<B>,
        dims: Dims,
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(), BackendError> {
        let Dims {
            b, t, c, nh, tp, ..
        } = dims;
        let (cl, nhl, n) = (c / tp, nh / tp, dims.n());
        // Under sequence parallelism the gathered norm output is kept.
        if !dims.sp {
            let ln1 = self.table.layer(a.layer).attn.ln1;
            (a.ln1, _, _) = self.layernorm(params, ln1, &a.x, n, c)?;
        }
        let mut atty = self.zeros(n * cl)?;
        a.att = self.attention(&mut atty, &a.qkv, (b, t, cl, nhl), &dims, reduce)?;
        Ok(())
    }

    /// ln2's output and GELU's of a dense MLP half.
    pub(super) fn rebuild_mlp(
        &self,
        params: &ParamMap<B::Tensor>,
        m: &mut MlpCache<B>,
        dims: Dims,
        _reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(), BackendError> {
        let (c, n) = (dims.c, dims.n());
        let hl = 4 * c / dims.tp;
        if !dims.sp {
            let (ln2, _) = self.dense(m.layer)?;
            (m.ln2, _, _) = self.layernorm(params, ln2, &m.x2, n, c)?;
        }
        // The kept pre-activation already has fc's bias; `gelu_forward` is
        // `bias_gelu_forward` without it (the same operations).
        let mut gelu = self.zeros(n * hl)?;
        self.b.gelu_forward(&mut gelu, &m.fch);
        m.fch_gelu = gelu;
        Ok(())
    }

    /// Attention half of layer `l`: `x2 = x + attproj(attention(qkv(ln1(x))))`;
    /// under tensor parallelism this device's heads only.
    pub(super) fn attn_forward(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        x: B::Tensor,
        dims: Dims,
        mut reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, AttnCache<B>), BackendError> {
        let Dims {
            b, t, c, nh, tp, ..
        } = dims;
        let (cl, nhl) = (c / tp, nh / tp);
        let n = dims.n();
        let AttnIds { ln1, qkv, proj } = self.table.layer(l).attn;
        let (ln1_out, ln1_mean, ln1_rstd) = self.layernorm(params, ln1, &x, dims.rows(), c)?;
        let (qkv_w, qkv_b) = qkv.parts();
        let (ln1_out, mut outs) = self.gathered_linears(
            params,
            ln1_out,
            &[(qkv_w, qkv_b, 3 * cl)],
            (n, c),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let qkv_out = outs
            .pop()
            .ok_or_else(|| BackendError::Device("no qkv".into()))?;
        let mut atty = self.zeros(n * cl)?;
        let att = self.attention(
            &mut atty,
            &qkv_out,
            (b, t, cl, nhl),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let x2 = self.onto_residual(
            params,
            (proj.weight, Some(proj.bias)),
            &atty,
            &x,
            (n, cl, c),
            &dims,
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
    pub(super) fn dense(&self, l: u32) -> Result<(Norm, MlpIds), BackendError> {
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
    pub(super) fn mlp_forward(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        x2: B::Tensor,
        dims: Dims,
        mut reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, MlpCache<B>), BackendError> {
        let c = dims.c;
        let hl = 4 * c / dims.tp;
        let n = dims.n();
        let (ln2, MlpIds { fc, proj }) = self.dense(l)?;
        let (ln2_out, ln2_mean, ln2_rstd) = self.layernorm(params, ln2, &x2, dims.rows(), c)?;
        let (ln2_out, mut outs) = self.gathered_linears(
            params,
            ln2_out,
            &[(fc.weight, None, hl)],
            (n, c),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let mut fch = outs
            .pop()
            .ok_or_else(|| BackendError::Device("no fc".into()))?;
        let mut fch_gelu = self.zeros(n * hl)?;
        self.b
            .bias_gelu_forward(&mut fch, &mut fch_gelu, param(params, fc.bias)?, hl);
        let out = self.onto_residual(
            params,
            (proj.weight, Some(proj.bias)),
            &fch_gelu,
            &x2,
            (n, hl, c),
            &dims,
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
    pub(super) fn attn_backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        k: &AttnCache<B>,
        dout: B::Tensor,
        dims: Dims,
        mut reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, AttnStash<B>), BackendError> {
        let Dims {
            b, t, c, nh, tp, ..
        } = dims;
        let (cl, nhl) = (c / tp, nh / tp);
        let n = dims.n();
        let AttnIds { ln1, qkv, proj } = self.table.layer(k.layer).attn;
        let (full, datty) = self.gathered_input_grad(
            params,
            &dout,
            proj.weight,
            (n, cl, c),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let mut dqkv = self.zeros(n * 3 * cl)?;
        let shape = (b, t, cl, nhl);
        let kept = (&k.atty, &k.att);
        self.attention_backward(
            &mut dqkv,
            &datty,
            &k.qkv,
            kept,
            shape,
            &dims,
            reduce.as_deref_mut(),
        )?;
        let dln1 = self.scattered_products(n, &dims, reduce, |rows| {
            self.input_grad_rows(params, &[(&dqkv, qkv.weight, 3 * cl)], rows, c)
        })?;
        let (dx, dln1) = self.back_to_residual(
            params,
            ln1,
            dln1,
            &dout,
            (&k.x, &k.ln1_mean, &k.ln1_rstd),
            (dims.rows(), c),
        )?;
        let dout = full.unwrap_or(dout);
        Ok((dx, AttnStash { dout, dqkv, dln1 }))
    }

    /// The dense MLP half's input gradient.
    pub(super) fn mlp_backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        k: &MlpCache<B>,
        dout: B::Tensor,
        dims: Dims,
        mut reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, MlpStash<B>), BackendError> {
        let c = dims.c;
        let hl = 4 * c / dims.tp;
        let n = dims.n();
        let (ln2, MlpIds { fc, proj }) = self.dense(k.layer)?;
        let (full, dgelu) = self.gathered_input_grad(
            params,
            &dout,
            proj.weight,
            (n, hl, c),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let mut dfch = self.zeros(n * hl)?;
        self.b.gelu_backward(&mut dfch, &k.fch, &dgelu);
        let dln2 = self.scattered_products(n, &dims, reduce, |rows| {
            self.input_grad_rows(params, &[(&dfch, fc.weight, hl)], rows, c)
        })?;
        let (dx2, dln2) = self.back_to_residual(
            params,
            ln2,
            dln2,
            &dout,
            (&k.x2, &k.ln2_mean, &k.ln2_rstd),
            (dims.rows(), c),
        )?;
        let dout = full.unwrap_or(dout);
        Ok((dx2, MlpStash { dout, dfch, dln2 }))
    }

    pub(super) fn attn_backward_weight(
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
        let rows = dims.rows();
        self.layernorm_weight(
            grads,
            ln1,
            &st.dln1,
            &k.x,
            &k.ln1_mean,
            &k.ln1_rstd,
            rows,
            c,
        )
    }

    pub(super) fn mlp_backward_weight(
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
        let rows = dims.rows();
        self.layernorm_weight(
            grads,
            ln2,
            &st.dln2,
            &k.x2,
            &k.ln2_mean,
            &k.ln2_rstd,
            rows,
            c,
        )
    }
}

impl<B: Backend> AttnStash<B> {
    fn bytes(&self) -> u64 {
        bytes_of::<B>(&[&self.dout, &self.dqkv, &self.dln1])
    }
}

impl<B: Backend> MlpStash<B> {
    fn bytes(&self) -> u64 {
        bytes_of::<B>(&[&self.dout, &self.dfch, &self.dln2])
    }
}

half!(AttnCache, AttnStash, "an attention half", norm: ln1, recomputed: att,
    weights_skip: (qkv, att), rebuild: rebuild_attn, input: attn_backward_input,
    weight: attn_backward_weight);
half!(MlpCache, MlpStash, "an MLP half", norm: ln2, recomputed: fch_gelu,
    weights_skip: (fch), rebuild: rebuild_mlp, input: mlp_backward_input,
    weight: mlp_backward_weight);
