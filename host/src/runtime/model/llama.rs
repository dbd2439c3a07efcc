//! The Llama family's block as segments compose it, over any [`Backend`]
//! (Llama 3, Qwen3): `x2 = x + o(attention(rope(q), rope(k), v))` of
//! `rmsnorm(x)`, with grouped-query attention (each key/value head serves
//! `heads / kv_heads` query heads) and Qwen3's per-head RMSNorm of q and k
//! before the rotation; then `out = x2 + down(silu(gate(h)) · up(h))` of
//! `h = rmsnorm(x2)`. No biases. Each half is a forward (with the caches
//! backward needs), a backward-for-input and a backward-for-weights, as
//! GPT-2's halves in [`super::gpt2`], and splits the same way under
//! tensor parallelism: this device's query and kv heads, its hidden units.
//!
//! The q/k norms' weights are whole on every tensor-parallel member, but
//! each member sees only its heads: their gradient is summed over the
//! group in the input pass (the group's sum is only there) and added in
//! the weight pass.

// Compositions carry their shapes as arguments, as the kernels do.
#![allow(clippy::too_many_arguments)]

use super::block::{half, stash_of, Half, HalfBack, HalfStash};
use super::common::{bytes_of, Coll, Dims, Model, Reduce};
use crate::model::params::{FamilyIds, LlamaAttnIds, ParamId, SwiGluIds};
use crate::runtime::backend::{grad_mut, param, Backend, BackendError, ParamMap};

/// Local shapes of one member: query heads, kv heads, channels per head,
/// MLP hidden units.
#[derive(Clone, Copy)]
struct Local {
    nh: usize,
    kvh: usize,
    hd: usize,
    hidden: usize,
}

impl Local {
    fn of(dims: &Dims) -> Self {
        let a = dims.arch;
        Local {
            nh: a.heads as usize / dims.tp,
            kvh: a.kv_heads as usize / dims.tp,
            hd: a.head_dim as usize,
            hidden: a.hidden as usize / dims.tp,
        }
    }
    fn qw(&self) -> usize {
        self.nh * self.hd
    }
    fn kvw(&self) -> usize {
        self.kvh * self.hd
    }
}

/// What an attention half keeps from forward.
pub struct LlamaAttnCache<B: Backend> {
    pub(super) layer: u32,
    pub(super) x: B::Tensor,
    pub(super) ln1: B::Tensor,
    pub(super) rstd1: B::Tensor,
    /// q and k before their norms, and the norms' rstd (qk_norm only).
    pub(super) q_raw: B::Tensor,
    pub(super) k_raw: B::Tensor,
    pub(super) q_rstd: B::Tensor,
    pub(super) k_rstd: B::Tensor,
    /// Rotated q, k and v, packed with kv heads repeated.
    pub(super) qkv: B::Tensor,
    pub(super) att: B::Tensor,
    pub(super) atty: B::Tensor,
}

/// What a SwiGLU half keeps.
pub struct SwiGluCache<B: Backend> {
    pub(super) layer: u32,
    pub(super) x2: B::Tensor,
    pub(super) ln2: B::Tensor,
    pub(super) rstd2: B::Tensor,
    pub(super) gate: B::Tensor,
    pub(super) up: B::Tensor,
    pub(super) act: B::Tensor,
}

/// The attention half's gradients its weight pass reads.
pub struct LlamaAttnStash<B: Backend> {
    dout: B::Tensor,
    /// Gradients of the projections' outputs (before the q/k norms).
    dq: B::Tensor,
    dk: B::Tensor,
    dv: B::Tensor,
    /// Gradients after the q/k norms (qk_norm without tensor parallelism).
    dqn: B::Tensor,
    dkn: B::Tensor,
    /// The q/k norms' weight gradients, summed over a tensor-parallel group.
    qk_grads: Option<(B::Tensor, B::Tensor)>,
    dln1: B::Tensor,
}

/// The SwiGLU half's.
pub struct SwiGluStash<B: Backend> {
    dout: B::Tensor,
    dgate: B::Tensor,
    dup: B::Tensor,
    dln2: B::Tensor,
}

impl<B: Backend> LlamaAttnCache<B> {
    pub(super) fn bytes(&self) -> u64 {
        bytes_of::<B>(&[
            &self.x,
            &self.ln1,
            &self.rstd1,
            &self.q_raw,
            &self.k_raw,
            &self.q_rstd,
            &self.k_rstd,
            &self.qkv,
            &self.att,
            &self.atty,
        ])
    }
    pub(super) fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        Ok(LlamaAttnCache {
            layer: self.layer,
            x: b.duplicate(&self.x)?,
            ln1: b.duplicate(&self.ln1)?,
            rstd1: b.duplicate(&self.rstd1)?,
            q_raw: b.duplicate(&self.q_raw)?,
            k_raw: b.duplicate(&self.k_raw)?,
            q_rstd: b.duplicate(&self.q_rstd)?,
            k_rstd: b.duplicate(&self.k_rstd)?,
            qkv: b.duplicate(&self.qkv)?,
            att: b.duplicate(&self.att)?,
            atty: b.duplicate(&self.atty)?,
        })
    }
}

impl<B: Backend> SwiGluCache<B> {
    pub(super) fn bytes(&self) -> u64 {
        bytes_of::<B>(&[
            &self.x2,
            &self.ln2,
            &self.rstd2,
            &self.gate,
            &self.up,
            &self.act,
        ])
    }
    pub(super) fn duplicate(&self, b: &B) -> Result<Self, BackendError> {
        Ok(SwiGluCache {
            layer: self.layer,
            x2: b.duplicate(&self.x2)?,
            ln2: b.duplicate(&self.ln2)?,
            rstd2: b.duplicate(&self.rstd2)?,
            gate: b.duplicate(&self.gate)?,
            up: b.duplicate(&self.up)?,
            act: b.duplicate(&self.act)?,
        })
    }
}

impl<B: Backend> Model<'_, B> {
    fn llama_attn_ids(&self, l: u32) -> Result<LlamaAttnIds, BackendError> {
        match &self.table.family {
            FamilyIds::Llama { layers, .. } => layers
                .get(l as usize)
                .map(|x| x.attn)
                .ok_or_else(|| BackendError::Device(format!("the model has no layer {l}"))),
            FamilyIds::Gpt2 { .. } => Err(BackendError::Device(
                "a Llama layer asked of a GPT-2 model".into(),
            )),
        }
    }

    fn swiglu_ids(&self, l: u32) -> Result<(ParamId, SwiGluIds), BackendError> {
        match &self.table.family {
            FamilyIds::Llama { layers, .. } => layers
                .get(l as usize)
                .and_then(|x| x.mlp_norm.zip(x.mlp))
                .ok_or_else(|| {
                    BackendError::Device(format!(
                        "layer {l} has no dense MLP (a mixture-of-experts model's layers have experts)"
                    ))
                }),
            FamilyIds::Gpt2 { .. } => Err(BackendError::Device(
                "a Llama layer asked of a GPT-2 model".into(),
            )),
        }
    }

    /// RMSNorm with weight `w` over rows of `c`: (output, rstd).
    pub(super) fn rmsnorm(
        &self,
        params: &ParamMap<B::Tensor>,
        w: ParamId,
        inp: &B::Tensor,
        n: usize,
        c: usize,
        eps: f32,
    ) -> Result<(B::Tensor, B::Tensor), BackendError> {
        let (mut out, mut rstd) = (self.zeros(n * c)?, self.b.zeros(n)?);
        self.b
            .rmsnorm_forward(&mut out, &mut rstd, inp, param(params, w)?, n, c, eps);
        Ok((out, rstd))
    }

    /// The end of a half's backward: `dln` (summed over a tensor-parallel
    /// group, onto the residual's `n` rows under sequence parallelism:
    /// [`Model::scattered_products`]) through the RMSNorm, added to the
    /// residual's `dout`.
    fn rms_back_to_residual(
        &self,
        params: &ParamMap<B::Tensor>,
        w: ParamId,
        dln: B::Tensor,
        dout: &B::Tensor,
        (x, rstd): (&B::Tensor, &B::Tensor),
        (n, c): (usize, usize),
    ) -> Result<(B::Tensor, B::Tensor), BackendError> {
        let mut dx = self.b.duplicate(dout)?;
        self.b
            .rmsnorm_backward_input(&mut dx, &dln, x, param(params, w)?, rstd, n, c);
        Ok((dx, dln))
    }

    /// Attention half of layer `l`.
    pub(super) fn llama_attn_forward(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        x: B::Tensor,
        dims: Dims,
        mut reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, LlamaAttnCache<B>), BackendError> {
        let ids = self.llama_attn_ids(l)?;
        let Dims { b, t, c, .. } = dims;
        let n = dims.n();
        let a = dims.arch;
        let lc = Local::of(&dims);
        let (qw, kvw, hd) = (lc.qw(), lc.kvw(), lc.hd);
        let (ln1, rstd1) = self.rmsnorm(params, ids.norm, &x, dims.rows(), c, a.norm_eps)?;
        let (ln1, qkv) = self.gathered_linears(
            params,
            ln1,
            &[(ids.q, None, qw), (ids.k, None, kvw), (ids.v, None, kvw)],
            (n, c),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let Ok::<[B::Tensor; 3], _>([mut q, mut k, v]) = qkv.try_into() else {
            return Err(BackendError::Device("no q, k and v".into()));
        };
        let (mut q_raw, mut k_raw, mut q_rstd, mut k_rstd) = Default::default();
        if let (Some(qn), Some(kn)) = (ids.q_norm, ids.k_norm) {
            let (qo, qr) = self.rmsnorm(params, qn, &q, n * lc.nh, hd, a.norm_eps)?;
            let (ko, kr) = self.rmsnorm(params, kn, &k, n * lc.kvh, hd, a.norm_eps)?;
            q_raw = std::mem::replace(&mut q, qo);
            k_raw = std::mem::replace(&mut k, ko);
            (q_rstd, k_rstd) = (qr, kr);
        }
        self.rope_held(&mut q, &dims, (lc.nh, hd), false)?;
        self.rope_held(&mut k, &dims, (lc.kvh, hd), false)?;
        let mut qkv = self.zeros(n * 3 * qw)?;
        self.b.qkv_pack(&mut qkv, &q, &k, &v, n, lc.nh, lc.kvh, hd);
        drop((q, k, v));
        let mut atty = self.zeros(n * qw)?;
        let att = self.attention(
            &mut atty,
            &qkv,
            (b, t, qw, lc.nh),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let shape = (n, qw, c);
        let x2 = self.onto_residual(params, (ids.o, None), &atty, &x, shape, &dims, reduce)?;
        Ok((
            x2,
            LlamaAttnCache {
                layer: l,
                x,
                ln1,
                rstd1,
                q_raw,
                k_raw,
                q_rstd,
                k_rstd,
                qkv,
                att,
                atty,
            },
        ))
    }

    /// A selective recompute of a Llama attention half: the norm's output
    /// and the probabilities.
    pub(super) fn rebuild_llama_attn(
        &self,
        params: &ParamMap<B::Tensor>,
        a: &mut LlamaAttnCache<B>,
        dims: Dims,
        reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(), BackendError> {
        let ids = self.llama_attn_ids(a.layer)?;
        let Dims { b, t, c, .. } = dims;
        let n = dims.n();
        let lc = Local::of(&dims);
        let qw = lc.qw();
        // Under sequence parallelism the gathered norm output is kept.
        if !dims.sp {
            (a.ln1, _) = self.rmsnorm(params, ids.norm, &a.x, n, c, dims.arch.norm_eps)?;
        }
        let mut atty = self.zeros(n * qw)?;
        a.att = self.attention(&mut atty, &a.qkv, (b, t, qw, lc.nh), &dims, reduce)?;
        Ok(())
    }

    /// A selective recompute of a SwiGLU half: the norm's output and
    /// `silu(gate)·up`.
    pub(super) fn rebuild_swiglu(
        &self,
        params: &ParamMap<B::Tensor>,
        m: &mut SwiGluCache<B>,
        dims: Dims,
        _reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(), BackendError> {
        let (norm, _) = self.swiglu_ids(m.layer)?;
        let (n, c) = (dims.n(), dims.c);
        let hl = Local::of(&dims).hidden;
        if !dims.sp {
            (m.ln2, _) = self.rmsnorm(params, norm, &m.x2, n, c, dims.arch.norm_eps)?;
        }
        let mut act = self.zeros(n * hl)?;
        self.b.swiglu_forward(&mut act, &m.gate, &m.up);
        m.act = act;
        Ok(())
    }

    /// SwiGLU half of layer `l`.
    pub(super) fn swiglu_forward(
        &self,
        params: &ParamMap<B::Tensor>,
        l: u32,
        x2: B::Tensor,
        dims: Dims,
        mut reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, SwiGluCache<B>), BackendError> {
        let (norm, ids) = self.swiglu_ids(l)?;
        let (n, c) = (dims.n(), dims.c);
        let hl = Local::of(&dims).hidden;
        let (ln2, rstd2) = self.rmsnorm(params, norm, &x2, dims.rows(), c, dims.arch.norm_eps)?;
        let (ln2, gate_up) = self.gathered_linears(
            params,
            ln2,
            &[(ids.gate, None, hl), (ids.up, None, hl)],
            (n, c),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let Ok::<[B::Tensor; 2], _>([gate, up]) = gate_up.try_into() else {
            return Err(BackendError::Device("no gate and up".into()));
        };
        let mut act = self.zeros(n * hl)?;
        self.b.swiglu_forward(&mut act, &gate, &up);
        let shape = (n, hl, c);
        let out = self.onto_residual(params, (ids.down, None), &act, &x2, shape, &dims, reduce)?;
        Ok((
            out,
            SwiGluCache {
                layer: l,
                x2,
                ln2,
                rstd2,
                gate,
                up,
                act,
            },
        ))
    }

    /// The attention half's input gradient.
    pub(super) fn llama_attn_backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        k: &LlamaAttnCache<B>,
        dout: B::Tensor,
        dims: Dims,
        mut reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, LlamaAttnStash<B>), BackendError> {
        let ids = self.llama_attn_ids(k.layer)?;
        let Dims { b, t, c, .. } = dims;
        let n = dims.n();
        let lc = Local::of(&dims);
        let (qw, kvw, hd) = (lc.qw(), lc.kvw(), lc.hd);
        let (full, datty) = self.gathered_input_grad(
            params,
            &dout,
            ids.o,
            (n, qw, c),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let mut dqkv = self.zeros(n * 3 * qw)?;
        let shape = (b, t, qw, lc.nh);
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
        drop(datty);
        let (mut dq, mut dk, mut dv) = (
            self.zeros(n * qw)?,
            self.zeros(n * kvw)?,
            self.zeros(n * kvw)?,
        );
        self.b
            .qkv_unpack_backward(&mut dq, &mut dk, &mut dv, &dqkv, n, lc.nh, lc.kvh, hd);
        drop(dqkv);
        self.rope_held(&mut dq, &dims, (lc.nh, hd), true)?;
        self.rope_held(&mut dk, &dims, (lc.kvh, hd), true)?;
        let (mut dqn, mut dkn, mut qk_grads) = (Default::default(), Default::default(), None);
        if let (Some(qn), Some(kn)) = (ids.q_norm, ids.k_norm) {
            let mut dq_raw = self.zeros(n * qw)?;
            self.b.rmsnorm_backward_input(
                &mut dq_raw,
                &dq,
                &k.q_raw,
                param(params, qn)?,
                &k.q_rstd,
                n * lc.nh,
                hd,
            );
            let mut dk_raw = self.zeros(n * kvw)?;
            self.b.rmsnorm_backward_input(
                &mut dk_raw,
                &dk,
                &k.k_raw,
                param(params, kn)?,
                &k.k_rstd,
                n * lc.kvh,
                hd,
            );
            if let Some(reduce) = reduce.as_mut() {
                // Each member's heads' share of the norms' weight gradients,
                // summed over the group.
                let (mut gq, mut gk) = (self.b.zeros(hd)?, self.b.zeros(hd)?);
                self.b
                    .rmsnorm_backward_weight(&mut gq, &dq, &k.q_raw, &k.q_rstd, n * lc.nh, hd);
                self.b
                    .rmsnorm_backward_weight(&mut gk, &dk, &k.k_raw, &k.k_rstd, n * lc.kvh, hd);
                qk_grads = Some((reduce(Coll::Sum, gq)?, reduce(Coll::Sum, gk)?));
            } else {
                (dqn, dkn) = (dq, dk);
            }
            (dq, dk) = (dq_raw, dk_raw);
        }
        let lins = [(&dq, ids.q, qw), (&dk, ids.k, kvw), (&dv, ids.v, kvw)];
        let dln1 = self.scattered_products(n, &dims, reduce, |rows| {
            self.input_grad_rows(params, &lins, rows, c)
        })?;
        let (dx, dln1) = self.rms_back_to_residual(
            params,
            ids.norm,
            dln1,
            &dout,
            (&k.x, &k.rstd1),
            (dims.rows(), c),
        )?;
        let dout = full.unwrap_or(dout);
        Ok((
            dx,
            LlamaAttnStash {
                dout,
                dq,
                dk,
                dv,
                dqn,
                dkn,
                qk_grads,
                dln1,
            },
        ))
    }

    /// The SwiGLU half's input gradient.
    pub(super) fn swiglu_backward_input(
        &self,
        params: &ParamMap<B::Tensor>,
        k: &SwiGluCache<B>,
        dout: B::Tensor,
        dims: Dims,
        mut reduce: Option<&mut Reduce<'_, B>>,
    ) -> Result<(B::Tensor, SwiGluStash<B>), BackendError> {
        let (norm, ids) = self.swiglu_ids(k.layer)?;
        let (n, c) = (dims.n(), dims.c);
        let hl = Local::of(&dims).hidden;
        let (full, dact) = self.gathered_input_grad(
            params,
            &dout,
            ids.down,
            (n, hl, c),
            &dims,
            reduce.as_deref_mut(),
        )?;
        let (mut dgate, mut dup) = (self.zeros(n * hl)?, self.zeros(n * hl)?);
        self.b
            .swiglu_backward(&mut dgate, &mut dup, &k.gate, &k.up, &dact);
        drop(dact);
        let lins = [(&dgate, ids.gate, hl), (&dup, ids.up, hl)];
        let dln2 = self.scattered_products(n, &dims, reduce, |rows| {
            self.input_grad_rows(params, &lins, rows, c)
        })?;
        let (dx2, dln2) = self.rms_back_to_residual(
            params,
            norm,
            dln2,
            &dout,
            (&k.x2, &k.rstd2),
            (dims.rows(), c),
        )?;
        let dout = full.unwrap_or(dout);
        Ok((
            dx2,
            SwiGluStash {
                dout,
                dgate,
                dup,
                dln2,
            },
        ))
    }

    pub(super) fn llama_attn_backward_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        k: &LlamaAttnCache<B>,
        st: &LlamaAttnStash<B>,
        dims: Dims,
    ) -> Result<(), BackendError> {
        let ids = self.llama_attn_ids(k.layer)?;
        let (n, c) = (dims.n(), dims.c);
        let lc = Local::of(&dims);
        let (qw, kvw, hd) = (lc.qw(), lc.kvw(), lc.hd);
        self.linear_weight(grads, (ids.o, None), &st.dout, &k.atty, n, qw, c)?;
        self.linear_weight(grads, (ids.q, None), &st.dq, &k.ln1, n, c, qw)?;
        self.linear_weight(grads, (ids.k, None), &st.dk, &k.ln1, n, c, kvw)?;
        self.linear_weight(grads, (ids.v, None), &st.dv, &k.ln1, n, c, kvw)?;
        if let (Some(qn), Some(kn)) = (ids.q_norm, ids.k_norm) {
            match &st.qk_grads {
                Some((gq, gk)) => {
                    self.b.add(grad_mut(grads, qn)?, gq);
                    self.b.add(grad_mut(grads, kn)?, gk);
                }
                None => {
                    self.b.rmsnorm_backward_weight(
                        grad_mut(grads, qn)?,
                        &st.dqn,
                        &k.q_raw,
                        &k.q_rstd,
                        n * lc.nh,
                        hd,
                    );
                    self.b.rmsnorm_backward_weight(
                        grad_mut(grads, kn)?,
                        &st.dkn,
                        &k.k_raw,
                        &k.k_rstd,
                        n * lc.kvh,
                        hd,
                    );
                }
            }
        }
        self.b.rmsnorm_backward_weight(
            grad_mut(grads, ids.norm)?,
            &st.dln1,
            &k.x,
            &k.rstd1,
            dims.rows(),
            c,
        );
        Ok(())
    }

    pub(super) fn swiglu_backward_weight(
        &self,
        grads: &mut ParamMap<B::Tensor>,
        k: &SwiGluCache<B>,
        st: &SwiGluStash<B>,
        dims: Dims,
    ) -> Result<(), BackendError> {
        let (norm, ids) = self.swiglu_ids(k.layer)?;
        let (n, c) = (dims.n(), dims.c);
        let hl = Local::of(&dims).hidden;
        self.linear_weight(grads, (ids.down, None), &st.dout, &k.act, n, hl, c)?;
        self.linear_weight(grads, (ids.gate, None), &st.dgate, &k.ln2, n, c, hl)?;
        self.linear_weight(grads, (ids.up, None), &st.dup, &k.ln2, n, c, hl)?;
        self.b.rmsnorm_backward_weight(
            grad_mut(grads, norm)?,
            &st.dln2,
            &k.x2,
            &k.rstd2,
            dims.rows(),
            c,
        );
        Ok(())
    }
}

impl<B: Backend> LlamaAttnStash<B> {
    fn bytes(&self) -> u64 {
        let qk = self
            .qk_grads
            .as_ref()
            .map_or(0, |(q, k)| bytes_of::<B>(&[q, k]));
        bytes_of::<B>(&[
            &self.dout, &self.dq, &self.dk, &self.dv, &self.dqn, &self.dkn, &self.dln1,
        ]) + qk
    }
}

impl<B: Backend> SwiGluStash<B> {
    fn bytes(&self) -> u64 {
        bytes_of::<B>(&[&self.dout, &self.dgate, &self.dup, &self.dln2])
    }
}

// The weight pass reads all but the packed q/k/v and the probabilities;
// all but the gate and up projections.
half!(LlamaAttnCache, LlamaAttnStash, "a Llama attention half", norm: ln1, recomputed: att,
    weights_skip: (qkv, att), rebuild: rebuild_llama_attn, input: llama_attn_backward_input,
    weight: llama_attn_backward_weight);
half!(SwiGluCache, SwiGluStash, "a SwiGLU half", norm: ln2, recomputed: act,
    weights_skip: (gate, up), rebuild: rebuild_swiglu, input: swiglu_backward_input,
    weight: swiglu_backward_weight);
