//! The GPT-2 model as segments: parameters (GPT-2 names, llm.c layouts:
//! linear weights `[out, in]`), deterministic initialisation, and for each
//! segment a forward (with the caches backward needs), a backward-for-input
//! (which also stashes the gradients the weight pass needs) and a
//! backward-for-weights, composed from the kernels of this folder.

use super::attention::{attention_backward, attention_forward};
use super::elementwise::{bias_gelu_forward, gelu_backward, residual_forward};
use super::embedding::{embedding_backward_weight, embedding_forward};
use super::layernorm::{layernorm_backward_input, layernorm_backward_weight, layernorm_forward};
use super::loss::{crossentropy_backward, crossentropy_forward};
use super::matmul::{
    matmul_backward_input, matmul_backward_weight, matmul_forward, matmul_forward_residual,
};
use super::moe::{
    alone, moe_backward_input, moe_backward_weight, moe_forward, Exchange, ExpertGroup, MoeCache,
    MoeDims, MoeStash,
};
pub use crate::model::params::{decays, model_params, part_params, segment_params};
use crate::model::{ModelConfig, MoeConfig, Part, Segment};
use std::collections::BTreeMap;

/// Tensors by GPT-2 name.
pub type Tensors = BTreeMap<String, Vec<f32>>;

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
        }
    }
    pub fn n(&self) -> usize {
        self.b * self.t
    }
}

/// SplitMix64: a small, well-mixed generator for reproducible initialisation.
struct SplitMix(u64);
impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        // Box–Muller.
        let (u1, u2) = (self.uniform(), self.uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

fn name_seed(seed: u64, name: &str) -> u64 {
    // FNV-1a of the name, mixed with the seed: every parameter's values depend
    // only on (seed, name), wherever it is placed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by
/// 1/√(2·layers), zero biases, unit layernorm gains.
pub fn init_param(cfg: &ModelConfig, seed: u64, name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    if name.ends_with(".bias") {
        return vec![0.0; n];
    }
    if name.contains("ln_") && name.ends_with(".weight") {
        return vec![1.0; n];
    }
    let mut std = 0.02f32;
    if name.ends_with("c_proj.weight") {
        std /= (2.0 * cfg.layers as f32).sqrt();
    }
    let mut rng = SplitMix(name_seed(seed, name));
    (0..n).map(|_| rng.normal() * std).collect()
}

/// What an attention half keeps from forward for backward (`x2 = x +
/// attproj(attention(qkv(ln1(x))))`).
#[derive(Clone, Debug, Default)]
pub struct AttnCache {
    layer: u32,
    x: Vec<f32>,
    ln1: Vec<f32>,
    ln1_mean: Vec<f32>,
    ln1_rstd: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    atty: Vec<f32>,
}

/// What a dense MLP half keeps (`out = x2 + fcproj(gelu(fc(ln2(x2))))`).
#[derive(Clone, Debug, Default)]
pub struct MlpCache {
    layer: u32,
    x2: Vec<f32>,
    ln2: Vec<f32>,
    ln2_mean: Vec<f32>,
    ln2_rstd: Vec<f32>,
    fch: Vec<f32>,
    fch_gelu: Vec<f32>,
}

fn floats(v: &[f32]) -> u64 {
    v.len() as u64 * 4
}

impl AttnCache {
    fn bytes(&self) -> u64 {
        [
            &self.x,
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.att,
            &self.atty,
        ]
        .iter()
        .map(|v| floats(v))
        .sum()
    }
}

impl MlpCache {
    fn bytes(&self) -> u64 {
        [
            &self.x2,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
        ]
        .iter()
        .map(|v| floats(v))
        .sum()
    }
}

#[derive(Clone, Debug)]
pub enum PartCache {
    Embedding {
        tokens: Vec<u32>,
    },
    Block(Box<AttnCache>, Box<MlpCache>),
    Attention(Box<AttnCache>),
    Experts(Box<MoeCache>),
    Head {
        x: Vec<f32>,
        lnf: Vec<f32>,
        mean: Vec<f32>,
        rstd: Vec<f32>,
        probs: Vec<f32>,
        targets: Vec<u32>,
    },
}

/// A segment's forward cache.
#[derive(Clone, Debug)]
pub struct SegmentCache {
    pub dims: Dims,
    pub parts: Vec<PartCache>,
}

impl SegmentCache {
    pub fn bytes(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| match p {
                PartCache::Embedding { tokens } => tokens.len() as u64 * 4,
                PartCache::Block(a, m) => a.bytes() + m.bytes(),
                PartCache::Attention(a) => a.bytes(),
                PartCache::Experts(m) => m.bytes(),
                PartCache::Head {
                    x,
                    lnf,
                    mean,
                    rstd,
                    probs,
                    targets,
                } => {
                    floats(x)
                        + floats(lnf)
                        + floats(mean)
                        + floats(rstd)
                        + floats(probs)
                        + targets.len() as u64 * 4
                }
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
}

/// The attention half's gradients its weight pass reads.
#[derive(Clone, Debug)]
pub struct AttnStash {
    /// Gradient of the half's output (`x2`).
    dout: Vec<f32>,
    dqkv: Vec<f32>,
    dln1: Vec<f32>,
}

/// The dense MLP half's.
#[derive(Clone, Debug)]
pub struct MlpStash {
    dout: Vec<f32>,
    dfch: Vec<f32>,
    dln2: Vec<f32>,
}

/// Gradients the weight pass needs, produced by the input pass.
#[derive(Clone, Debug)]
pub enum PartStash {
    Embedding { dout: Vec<f32> },
    Block(AttnStash, MlpStash),
    Attention(AttnStash),
    Experts(Box<MoeStash>),
    Head { dlogits: Vec<f32>, dlnf: Vec<f32> },
}

#[derive(Clone, Debug)]
pub struct SegmentStash {
    pub parts: Vec<PartStash>,
    /// The forward tensors the weight pass reads (inputs of the matmuls and
    /// layernorms), kept by a split backward so the rest of the forward
    /// cache (attention probabilities, qkv, the MLP pre-activation, the
    /// head's probabilities) is freed at `BI` instead of living until `BW`.
    pub kept: Option<SegmentCache>,
}

impl SegmentStash {
    pub fn bytes(&self) -> u64 {
        let attn = |a: &AttnStash| floats(&a.dout) + floats(&a.dqkv) + floats(&a.dln1);
        let mlp = |m: &MlpStash| floats(&m.dout) + floats(&m.dfch) + floats(&m.dln2);
        self.parts
            .iter()
            .map(|p| match p {
                PartStash::Embedding { dout } => floats(dout),
                PartStash::Block(a, m) => attn(a) + mlp(m),
                PartStash::Attention(a) => attn(a),
                PartStash::Experts(m) => m.bytes(),
                PartStash::Head { dlogits, dlnf } => floats(dlogits) + floats(dlnf),
            })
            .sum::<u64>()
            + self.kept.as_ref().map_or(0, |c| c.bytes())
    }

    /// Keep from `cache` what [`segment_backward_weight`] reads.
    pub fn keep_for_weights(&mut self, cache: SegmentCache) {
        let attn = |mut a: Box<AttnCache>| {
            a.qkv = Vec::new();
            a.att = Vec::new();
            a
        };
        let parts = cache
            .parts
            .into_iter()
            .map(|p| match p {
                PartCache::Block(a, mut m) => {
                    m.fch = Vec::new();
                    PartCache::Block(attn(a), m)
                }
                PartCache::Attention(a) => PartCache::Attention(attn(a)),
                PartCache::Experts(m) => PartCache::Experts(Box::new(m.keep_for_weights())),
                PartCache::Head {
                    x, lnf, mean, rstd, ..
                } => PartCache::Head {
                    x,
                    lnf,
                    mean,
                    rstd,
                    probs: Vec::new(),
                    targets: Vec::new(),
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

/// A parameter by name (the plan put it on this device).
pub(super) fn param_of<'a>(params: &'a Tensors, name: &str) -> &'a [f32] {
    params
        .get(name)
        .unwrap_or_else(|| panic!("parameter {name} is not on this device"))
}

/// The named linear layer on `inp[n, ic]`: `inp · Wᵀ + b`, `[n, oc]`.
fn linear(
    params: &Tensors,
    w: &str,
    bias: &str,
    inp: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
) -> Vec<f32> {
    let mut out = vec![0.0; n * oc];
    matmul_forward(
        &mut out,
        inp,
        param_of(params, w),
        Some(param_of(params, bias)),
        n,
        ic,
        oc,
    );
    out
}

/// The named layernorm on `inp[n, c]`: (output, mean, rstd).
fn layernorm(
    params: &Tensors,
    w: &str,
    bias: &str,
    inp: &[f32],
    n: usize,
    c: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_forward(
        &mut out,
        &mut mean,
        &mut rstd,
        inp,
        param_of(params, w),
        param_of(params, bias),
        n,
        c,
    );
    (out, mean, rstd)
}

/// A parameter's gradient by name.
pub(super) fn grad_of<'a>(grads: &'a mut Tensors, name: &str) -> &'a mut Vec<f32> {
    grads
        .get_mut(name)
        .unwrap_or_else(|| panic!("gradient {name} is not on this device"))
}

/// A tensor-parallel group's sum (Megatron's `g` in forward, `f`'s
/// backward): every member's partial result added in group order.
pub type Reduce<'a> = dyn FnMut(Vec<f32>) -> Result<Vec<f32>, String> + 'a;

/// The row-parallel end of a tensor-parallel layer: `inp[n, ic] · Wᵀ`
/// summed over the group, then `+ bias`; one device: [`linear`] itself.
fn row_parallel(
    params: &Tensors,
    w: &str,
    bias: &str,
    inp: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
    reduce: Option<&mut Reduce<'_>>,
) -> Result<Vec<f32>, String> {
    let Some(reduce) = reduce else {
        return Ok(linear(params, w, bias, inp, n, ic, oc));
    };
    let mut part = vec![0.0; n * oc];
    matmul_forward(&mut part, inp, param_of(params, w), None, n, ic, oc);
    let mut out = reduce(part)?;
    let b = param_of(params, bias);
    for row in out.chunks_exact_mut(oc) {
        for (o, x) in row.iter_mut().zip(b) {
            *o += x;
        }
    }
    Ok(out)
}

/// A block's projection back onto the residual stream: `res + inp · Wᵀ +
/// bias`, the residual fused into the GEMM ([`matmul_forward_residual`]);
/// under tensor parallelism the row-parallel product is summed over the
/// group first ([`row_parallel`]), then the residual added.
fn onto_residual(
    params: &Tensors,
    w: &str,
    bias: &str,
    inp: &[f32],
    res: &[f32],
    (n, ic, oc): (usize, usize, usize),
    reduce: Option<&mut Reduce<'_>>,
) -> Result<Vec<f32>, String> {
    let mut out = vec![0.0; n * oc];
    match reduce {
        None => matmul_forward_residual(
            &mut out,
            res,
            inp,
            param_of(params, w),
            param_of(params, bias),
            n,
            ic,
            oc,
        ),
        reduce => {
            let proj = row_parallel(params, w, bias, inp, n, ic, oc, reduce)?;
            residual_forward(&mut out, res, &proj);
        }
    }
    Ok(out)
}

/// Attention half of layer `l`: `x2 = x + attproj(attention(qkv(ln1(x))))`;
/// under tensor parallelism this device's heads only.
fn attn_forward(
    params: &Tensors,
    l: u32,
    x: Vec<f32>,
    dims: Dims,
    reduce: Option<&mut Reduce<'_>>,
) -> Result<(Vec<f32>, AttnCache), String> {
    let Dims {
        b, t, c, nh, tp, ..
    } = dims;
    let (cl, nhl) = (c / tp, nh / tp);
    let n = dims.n();
    let name = |s: &str| format!("h.{l}.{s}");
    let (ln1, ln1_mean, ln1_rstd) =
        layernorm(params, &name("ln_1.weight"), &name("ln_1.bias"), &x, n, c);
    let qkv = linear(
        params,
        &name("attn.c_attn.weight"),
        &name("attn.c_attn.bias"),
        &ln1,
        n,
        c,
        3 * cl,
    );
    let mut att = vec![0.0; b * nhl * t * t];
    let mut atty = vec![0.0; n * cl];
    attention_forward(&mut atty, &mut att, &qkv, b, t, cl, nhl);
    let x2 = onto_residual(
        params,
        &name("attn.c_proj.weight"),
        &name("attn.c_proj.bias"),
        &atty,
        &x,
        (n, cl, c),
        reduce,
    )?;
    let cache = AttnCache {
        layer: l,
        x,
        ln1,
        ln1_mean,
        ln1_rstd,
        qkv,
        att,
        atty,
    };
    Ok((x2, cache))
}

/// Dense MLP half of layer `l`: `out = x2 + fcproj(gelu(fc(ln2(x2))))`;
/// under tensor parallelism this device's hidden units only.
fn mlp_forward(
    params: &Tensors,
    l: u32,
    x2: Vec<f32>,
    dims: Dims,
    reduce: Option<&mut Reduce<'_>>,
) -> Result<(Vec<f32>, MlpCache), String> {
    let c = dims.c;
    let hl = 4 * c / dims.tp;
    let n = dims.n();
    let name = |s: &str| format!("h.{l}.{s}");
    let (ln2, ln2_mean, ln2_rstd) =
        layernorm(params, &name("ln_2.weight"), &name("ln_2.bias"), &x2, n, c);
    let mut fch = vec![0.0; n * hl];
    matmul_forward(
        &mut fch,
        &ln2,
        param_of(params, &name("mlp.c_fc.weight")),
        None,
        n,
        c,
        hl,
    );
    let mut fch_gelu = vec![0.0; n * hl];
    bias_gelu_forward(
        &mut fch,
        &mut fch_gelu,
        param_of(params, &name("mlp.c_fc.bias")),
        hl,
    );
    let out = onto_residual(
        params,
        &name("mlp.c_proj.weight"),
        &name("mlp.c_proj.bias"),
        &fch_gelu,
        &x2,
        (n, hl, c),
        reduce,
    )?;
    let cache = MlpCache {
        layer: l,
        x2,
        ln2,
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
    params: &Tensors,
    k: &AttnCache,
    dout: Vec<f32>,
    dims: Dims,
    reduce: Option<&mut Reduce<'_>>,
) -> Result<(Vec<f32>, AttnStash), String> {
    let Dims {
        b, t, c, nh, tp, ..
    } = dims;
    let (cl, nhl) = (c / tp, nh / tp);
    let n = dims.n();
    let l = k.layer;
    let name = |s: &str| format!("h.{l}.{s}");
    let mut datty = vec![0.0; n * cl];
    matmul_backward_input(
        &mut datty,
        &dout,
        param_of(params, &name("attn.c_proj.weight")),
        n,
        cl,
        c,
        false,
    );
    let mut dqkv = vec![0.0; n * 3 * cl];
    attention_backward(&mut dqkv, &datty, &k.qkv, &k.att, b, t, cl, nhl);
    let mut dln1 = vec![0.0; n * c];
    matmul_backward_input(
        &mut dln1,
        &dqkv,
        param_of(params, &name("attn.c_attn.weight")),
        n,
        c,
        3 * cl,
        false,
    );
    let (dx, dln1) = into_residual(
        params,
        &name("ln_1.weight"),
        dln1,
        reduce,
        &dout,
        (&k.x, &k.ln1_mean, &k.ln1_rstd),
        c,
    )?;
    Ok((dx, AttnStash { dout, dqkv, dln1 }))
}

/// The end of a half's backward: the gradient of its layernorm's output
/// `dln` (summed over a tensor-parallel group first), through the layernorm
/// (`weight`; its input, mean and rstd), added to the residual's `dout`:
/// the half's input gradient, and `dln` for the weight pass.
fn into_residual(
    params: &Tensors,
    weight: &str,
    mut dln: Vec<f32>,
    reduce: Option<&mut Reduce<'_>>,
    dout: &[f32],
    (x, mean, rstd): (&[f32], &[f32], &[f32]),
    c: usize,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    if let Some(reduce) = reduce {
        dln = reduce(dln)?;
    }
    let mut dx = dout.to_vec();
    let n = dout.len() / c;
    layernorm_backward_input(&mut dx, &dln, x, param_of(params, weight), mean, rstd, n, c);
    Ok((dx, dln))
}

/// The dense MLP half's input gradient.
fn mlp_backward_input(
    params: &Tensors,
    k: &MlpCache,
    dout: Vec<f32>,
    dims: Dims,
    reduce: Option<&mut Reduce<'_>>,
) -> Result<(Vec<f32>, MlpStash), String> {
    let c = dims.c;
    let hl = 4 * c / dims.tp;
    let n = dims.n();
    let l = k.layer;
    let name = |s: &str| format!("h.{l}.{s}");
    let mut dgelu = vec![0.0; n * hl];
    matmul_backward_input(
        &mut dgelu,
        &dout,
        param_of(params, &name("mlp.c_proj.weight")),
        n,
        hl,
        c,
        false,
    );
    let mut dfch = vec![0.0; n * hl];
    gelu_backward(&mut dfch, &k.fch, &dgelu);
    let mut dln2 = vec![0.0; n * c];
    matmul_backward_input(
        &mut dln2,
        &dfch,
        param_of(params, &name("mlp.c_fc.weight")),
        n,
        c,
        hl,
        false,
    );
    let (dx2, dln2) = into_residual(
        params,
        &name("ln_2.weight"),
        dln2,
        reduce,
        &dout,
        (&k.x2, &k.ln2_mean, &k.ln2_rstd),
        c,
    )?;
    Ok((dx2, MlpStash { dout, dfch, dln2 }))
}

/// Accumulate linear layer `w`/`bias`'s gradients from `dout[n, oc]` and `inp[n, ic]`.
pub(super) fn linear_weight(
    grads: &mut Tensors,
    w: &str,
    bias: &str,
    dout: &[f32],
    inp: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
) {
    let mut db = std::mem::take(grad_of(grads, bias));
    matmul_backward_weight(grad_of(grads, w), Some(&mut db), dout, inp, n, ic, oc);
    *grad_of(grads, bias) = db;
}

/// Accumulate layernorm `w`/`bias`'s gradients.
pub(super) fn layernorm_weight(
    grads: &mut Tensors,
    w: &str,
    bias: &str,
    dout: &[f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    let mut db = std::mem::take(grad_of(grads, bias));
    layernorm_backward_weight(grad_of(grads, w), &mut db, dout, inp, mean, rstd, n, c);
    *grad_of(grads, bias) = db;
}

fn attn_backward_weight(grads: &mut Tensors, k: &AttnCache, st: &AttnStash, dims: Dims) {
    let (n, c, cl) = (dims.n(), dims.c, dims.c / dims.tp);
    let l = k.layer;
    let name = |s: &str| format!("h.{l}.{s}");
    linear_weight(
        grads,
        &name("attn.c_proj.weight"),
        &name("attn.c_proj.bias"),
        &st.dout,
        &k.atty,
        n,
        cl,
        c,
    );
    linear_weight(
        grads,
        &name("attn.c_attn.weight"),
        &name("attn.c_attn.bias"),
        &st.dqkv,
        &k.ln1,
        n,
        c,
        3 * cl,
    );
    layernorm_weight(
        grads,
        &name("ln_1.weight"),
        &name("ln_1.bias"),
        &st.dln1,
        &k.x,
        &k.ln1_mean,
        &k.ln1_rstd,
        n,
        c,
    );
}

fn mlp_backward_weight(grads: &mut Tensors, k: &MlpCache, st: &MlpStash, dims: Dims) {
    let (n, c, hl) = (dims.n(), dims.c, 4 * dims.c / dims.tp);
    let l = k.layer;
    let name = |s: &str| format!("h.{l}.{s}");
    linear_weight(
        grads,
        &name("mlp.c_proj.weight"),
        &name("mlp.c_proj.bias"),
        &st.dout,
        &k.fch_gelu,
        n,
        hl,
        c,
    );
    linear_weight(
        grads,
        &name("mlp.c_fc.weight"),
        &name("mlp.c_fc.bias"),
        &st.dfch,
        &k.ln2,
        n,
        c,
        hl,
    );
    layernorm_weight(
        grads,
        &name("ln_2.weight"),
        &name("ln_2.bias"),
        &st.dln2,
        &k.x2,
        &k.ln2_mean,
        &k.ln2_rstd,
        n,
        c,
    );
}

fn moe_dims(dims: Dims) -> (MoeConfig, MoeDims) {
    let moe = dims.moe.expect("an expert half runs on a MoE model");
    let d = MoeDims::new(&moe, dims.n(), dims.t, dims.c);
    (moe, d)
}

/// What a segment's forward gives: its output activations (`None` after
/// the head), its cache, and what it adds to the summed token losses.
pub type Forward = (Option<Vec<f32>>, SegmentCache, Option<f64>);

/// A segment spread over a group of devices (errors as text: the runtime
/// names the device and op).
pub enum Peers<'a, 'b> {
    /// Expert parallelism (`shard`): this device's place in the EP group and
    /// the all-to-all that reaches its members.
    Experts {
        group: ExpertGroup,
        exchange: &'a mut Exchange<'b, String>,
    },
    /// Tensor parallelism (`shard-tensor`): the group's sum; the shapes are
    /// in [`Dims::tp`].
    Tensor { reduce: &'a mut Reduce<'b> },
}

impl Peers<'_, '_> {
    fn reduce(&mut self) -> Option<&mut Reduce<'_>> {
        match self {
            Peers::Tensor { reduce } => Some(&mut **reduce),
            Peers::Experts { .. } => None,
        }
    }
}

/// Forward of a segment on `dims.b` sequences, every expert on this device.
/// `tokens` feed the embedding (first segment), `input` the activations from
/// the previous segment; `targets` the loss (last segment). Returns the
/// output activations (`None` after the head), the cache, and what the
/// segment adds to the summed token losses: the cross-entropy at the head,
/// the load-balancing loss of expert halves.
pub fn segment_forward(
    seg: &Segment,
    params: &Tensors,
    tokens: Option<&[u32]>,
    input: Option<Vec<f32>>,
    targets: Option<&[u32]>,
    dims: Dims,
) -> Forward {
    segment_forward_in(seg, params, tokens, input, targets, dims, None)
        .unwrap_or_else(|e| unreachable!("one device's exchange cannot fail: {e}"))
}

/// [`segment_forward`] on a segment spread over a group (every member calls
/// it for the same microbatch together).
pub fn segment_forward_in(
    seg: &Segment,
    params: &Tensors,
    tokens: Option<&[u32]>,
    input: Option<Vec<f32>>,
    targets: Option<&[u32]>,
    dims: Dims,
    mut peers: Option<Peers<'_, '_>>,
) -> Result<Forward, String> {
    let Dims { b, t, c, v, .. } = dims;
    let n = dims.n();
    let mut x: Vec<f32> = input.unwrap_or_default();
    let mut caches = Vec::with_capacity(seg.parts.len());
    let mut loss: Option<f64> = None;
    let mut out_present = true;
    for part in &seg.parts {
        match *part {
            Part::Embedding => {
                let tokens = tokens.expect("the embedding segment gets tokens");
                x = vec![0.0; n * c];
                embedding_forward(
                    &mut x,
                    tokens,
                    param_of(params, "wte"),
                    param_of(params, "wpe"),
                    b,
                    t,
                    c,
                );
                caches.push(PartCache::Embedding {
                    tokens: tokens.to_vec(),
                });
            }
            Part::Block(l) => {
                let inp = std::mem::take(&mut x);
                let (x2, attn) = attn_forward(
                    params,
                    l,
                    inp,
                    dims,
                    peers.as_mut().and_then(|s| s.reduce()),
                )?;
                let (out, mlp) =
                    mlp_forward(params, l, x2, dims, peers.as_mut().and_then(|s| s.reduce()))?;
                x = out;
                caches.push(PartCache::Block(Box::new(attn), Box::new(mlp)));
            }
            Part::Attention(l) => {
                let inp = std::mem::take(&mut x);
                let (x2, attn) = attn_forward(
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
                let (moe, d) = moe_dims(dims);
                let inp = std::mem::take(&mut x);
                let (out, cache, aux) = match peers.as_mut() {
                    Some(Peers::Experts { group, exchange }) => {
                        moe_forward(params, l, &moe, inp, d, *group, *exchange)?
                    }
                    _ => moe_forward(params, l, &moe, inp, d, ExpertGroup::ALONE, &mut alone)?,
                };
                x = out;
                *loss.get_or_insert(0.0) += aux;
                caches.push(PartCache::Experts(Box::new(cache)));
            }
            Part::Head => {
                let targets = targets.expect("the head segment gets targets");
                let (lnf, mean, rstd) = layernorm(params, "ln_f.weight", "ln_f.bias", &x, n, c);
                let mut logits = vec![0.0; n * v];
                matmul_forward(&mut logits, &lnf, param_of(params, "wte"), None, n, c, v);
                let mut probs = vec![0.0; n * v];
                *loss.get_or_insert(0.0) +=
                    crossentropy_forward(&mut probs, &logits, targets, n, v);
                caches.push(PartCache::Head {
                    x: std::mem::take(&mut x),
                    lnf,
                    mean,
                    rstd,
                    probs,
                    targets: targets.to_vec(),
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
/// `loss_scale` = 1 / tokens of the global batch) to the gradient of the
/// segment's input (`None` for the first segment), stashing what the weight
/// pass needs.
pub fn segment_backward_input(
    params: &Tensors,
    cache: &SegmentCache,
    dout: Option<Vec<f32>>,
    loss_scale: f32,
) -> (Option<Vec<f32>>, SegmentStash) {
    segment_backward_input_in(params, cache, dout, loss_scale, None)
        .unwrap_or_else(|e| unreachable!("one device's exchange cannot fail: {e}"))
}

/// [`segment_backward_input`] on a segment spread over a group.
pub fn segment_backward_input_in(
    params: &Tensors,
    cache: &SegmentCache,
    dout: Option<Vec<f32>>,
    loss_scale: f32,
    mut peers: Option<Peers<'_, '_>>,
) -> Result<(Option<Vec<f32>>, SegmentStash), String> {
    let dims = cache.dims;
    let Dims { c, v, .. } = dims;
    let n = dims.n();
    let mut d: Vec<f32> = dout.unwrap_or_default();
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
                let mut dlogits = vec![0.0; n * v];
                crossentropy_backward(&mut dlogits, probs, targets, n, v, loss_scale);
                let mut dlnf = vec![0.0; n * c];
                matmul_backward_input(&mut dlnf, &dlogits, param_of(params, "wte"), n, c, v, false);
                let mut dx = vec![0.0; n * c];
                layernorm_backward_input(
                    &mut dx,
                    &dlnf,
                    x,
                    param_of(params, "ln_f.weight"),
                    mean,
                    rstd,
                    n,
                    c,
                );
                d = dx;
                stash.push(PartStash::Head { dlogits, dlnf });
            }
            PartCache::Block(attn, mlp) => {
                let dout = std::mem::take(&mut d);
                let (dx2, ms) = mlp_backward_input(
                    params,
                    mlp,
                    dout,
                    dims,
                    peers.as_mut().and_then(|s| s.reduce()),
                )?;
                let (dx, at) = attn_backward_input(
                    params,
                    attn,
                    dx2,
                    dims,
                    peers.as_mut().and_then(|s| s.reduce()),
                )?;
                d = dx;
                stash.push(PartStash::Block(at, ms));
            }
            PartCache::Attention(attn) => {
                let dout = std::mem::take(&mut d);
                let (dx, at) = attn_backward_input(
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
                        moe_backward_input(params, m, dout, loss_scale, *exchange)?
                    }
                    _ => moe_backward_input(params, m, dout, loss_scale, &mut alone)?,
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
pub fn segment_backward_weight(grads: &mut Tensors, cache: &SegmentCache, stash: &SegmentStash) {
    let Dims { b, t, c, v, .. } = cache.dims;
    let n = b * t;
    for (pc, st) in cache.parts.iter().zip(&stash.parts) {
        match (pc, st) {
            (PartCache::Embedding { tokens }, PartStash::Embedding { dout }) => {
                let mut dwpe = std::mem::take(grad_of(grads, "wpe"));
                embedding_backward_weight(grad_of(grads, "wte"), &mut dwpe, dout, tokens, b, t, c);
                *grad_of(grads, "wpe") = dwpe;
            }
            (PartCache::Block(attn, mlp), PartStash::Block(at, ms)) => {
                mlp_backward_weight(grads, mlp, ms, cache.dims);
                attn_backward_weight(grads, attn, at, cache.dims);
            }
            (PartCache::Attention(attn), PartStash::Attention(at)) => {
                attn_backward_weight(grads, attn, at, cache.dims);
            }
            (PartCache::Experts(m), PartStash::Experts(ms)) => {
                moe_backward_weight(grads, m, ms);
            }
            (
                PartCache::Head {
                    x, lnf, mean, rstd, ..
                },
                PartStash::Head { dlogits, dlnf },
            ) => {
                matmul_backward_weight(grad_of(grads, "wte"), None, dlogits, lnf, n, c, v);
                layernorm_weight(grads, "ln_f.weight", "ln_f.bias", dlnf, x, mean, rstd, n, c);
            }
            _ => unreachable!("stash and cache come from the same segment"),
        }
    }
}
