//! The GPT-2 model as segments: parameters (GPT-2 names, llm.c layouts:
//! linear weights `[out, in]`), deterministic initialisation, and for each
//! segment a forward (with the caches backward needs), a backward-for-input
//! (which also stashes the gradients the weight pass needs) and a
//! backward-for-weights, composed from the kernels of this folder.

use super::attention::{attention_backward, attention_forward};
use super::elementwise::{gelu_backward, gelu_forward, residual_forward};
use super::embedding::{embedding_backward_weight, embedding_forward};
use super::layernorm::{layernorm_backward_input, layernorm_backward_weight, layernorm_forward};
use super::loss::{crossentropy_backward, crossentropy_forward};
use super::matmul::{matmul_backward_input, matmul_backward_weight, matmul_forward};
pub use crate::model::params::{decays, model_params, part_params, segment_params};
use crate::model::{ModelConfig, Part, Segment};
use std::collections::BTreeMap;

/// Tensors by GPT-2 name.
pub type Tensors = BTreeMap<String, Vec<f32>>;

/// The dimensions of one piece of work: `b` sequences of `t` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub v: usize,
}

impl Dims {
    pub fn new(cfg: &ModelConfig, b: usize) -> Self {
        Dims {
            b,
            t: cfg.seq_len as usize,
            c: cfg.d_model as usize,
            nh: cfg.heads as usize,
            v: cfg.vocab as usize,
        }
    }
    fn n(&self) -> usize {
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

/// What one part keeps from forward for backward.
#[derive(Clone, Debug, Default)]
pub struct BlockCache {
    layer: u32,
    x: Vec<f32>,
    ln1: Vec<f32>,
    ln1_mean: Vec<f32>,
    ln1_rstd: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    atty: Vec<f32>,
    x2: Vec<f32>,
    ln2: Vec<f32>,
    ln2_mean: Vec<f32>,
    ln2_rstd: Vec<f32>,
    fch: Vec<f32>,
    fch_gelu: Vec<f32>,
}

#[derive(Clone, Debug)]
pub enum PartCache {
    Embedding {
        tokens: Vec<u32>,
    },
    Block(Box<BlockCache>),
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
        let f = |v: &Vec<f32>| v.len() as u64 * 4;
        self.parts
            .iter()
            .map(|p| match p {
                PartCache::Embedding { tokens } => tokens.len() as u64 * 4,
                PartCache::Block(b) => [
                    &b.x,
                    &b.ln1,
                    &b.ln1_mean,
                    &b.ln1_rstd,
                    &b.qkv,
                    &b.att,
                    &b.atty,
                    &b.x2,
                    &b.ln2,
                    &b.ln2_mean,
                    &b.ln2_rstd,
                    &b.fch,
                    &b.fch_gelu,
                ]
                .iter()
                .map(|v| f(v))
                .sum(),
                PartCache::Head {
                    x,
                    lnf,
                    mean,
                    rstd,
                    probs,
                    targets,
                } => f(x) + f(lnf) + f(mean) + f(rstd) + f(probs) + targets.len() as u64 * 4,
            })
            .sum()
    }
}

/// Gradients the weight pass needs, produced by the input pass.
#[derive(Clone, Debug)]
pub enum PartStash {
    Embedding {
        dout: Vec<f32>,
    },
    Block {
        dout: Vec<f32>,
        dfch: Vec<f32>,
        dln2: Vec<f32>,
        dx2: Vec<f32>,
        dqkv: Vec<f32>,
        dln1: Vec<f32>,
    },
    Head {
        dlogits: Vec<f32>,
        dlnf: Vec<f32>,
    },
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
        let f = |v: &Vec<f32>| v.len() as u64 * 4;
        self.parts
            .iter()
            .map(|p| match p {
                PartStash::Embedding { dout } => f(dout),
                PartStash::Block {
                    dout,
                    dfch,
                    dln2,
                    dx2,
                    dqkv,
                    dln1,
                } => f(dout) + f(dfch) + f(dln2) + f(dx2) + f(dqkv) + f(dln1),
                PartStash::Head { dlogits, dlnf } => f(dlogits) + f(dlnf),
            })
            .sum::<u64>()
            + self.kept.as_ref().map_or(0, |c| c.bytes())
    }

    /// Keep from `cache` what [`segment_backward_weight`] reads.
    pub fn keep_for_weights(&mut self, cache: SegmentCache) {
        let parts = cache
            .parts
            .into_iter()
            .map(|p| match p {
                PartCache::Block(mut b) => {
                    b.qkv = Vec::new();
                    b.att = Vec::new();
                    b.fch = Vec::new();
                    PartCache::Block(b)
                }
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

fn p<'a>(params: &'a Tensors, name: &str) -> &'a [f32] {
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
        p(params, w),
        Some(p(params, bias)),
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
        p(params, w),
        p(params, bias),
        n,
        c,
    );
    (out, mean, rstd)
}

fn g<'a>(grads: &'a mut Tensors, name: &str) -> &'a mut Vec<f32> {
    grads
        .get_mut(name)
        .unwrap_or_else(|| panic!("gradient {name} is not on this device"))
}

/// Forward of a segment on `dims.b` sequences. `tokens` feed the embedding
/// (first segment), `input` the activations from the previous segment;
/// `targets` the loss (last segment). Returns the output activations (`None`
/// after the head), the cache, and the summed token losses when it has the head.
pub fn segment_forward(
    seg: &Segment,
    params: &Tensors,
    tokens: Option<&[u32]>,
    input: Option<Vec<f32>>,
    targets: Option<&[u32]>,
    dims: Dims,
) -> (Option<Vec<f32>>, SegmentCache, Option<f64>) {
    let Dims { b, t, c, nh, v } = dims;
    let n = dims.n();
    let mut x: Vec<f32> = input.unwrap_or_default();
    let mut caches = Vec::with_capacity(seg.parts.len());
    let mut loss = None;
    let mut out_present = true;
    for part in &seg.parts {
        match *part {
            Part::Embedding => {
                let tokens = tokens.expect("the embedding segment gets tokens");
                x = vec![0.0; n * c];
                embedding_forward(&mut x, tokens, p(params, "wte"), p(params, "wpe"), b, t, c);
                caches.push(PartCache::Embedding {
                    tokens: tokens.to_vec(),
                });
            }
            Part::Block(l) => {
                let name = |s: &str| format!("h.{l}.{s}");
                let lin = |w: &str, bias: &str, inp: &[f32], ic: usize, oc: usize| {
                    linear(params, &name(w), &name(bias), inp, n, ic, oc)
                };
                // x2 = x + attproj(attention(qkv(ln1(x))))
                let (ln1, ln1_mean, ln1_rstd) =
                    layernorm(params, &name("ln_1.weight"), &name("ln_1.bias"), &x, n, c);
                let qkv = lin("attn.c_attn.weight", "attn.c_attn.bias", &ln1, c, 3 * c);
                let mut att = vec![0.0; b * nh * t * t];
                let mut atty = vec![0.0; n * c];
                attention_forward(&mut atty, &mut att, &qkv, b, t, c, nh);
                let attproj = lin("attn.c_proj.weight", "attn.c_proj.bias", &atty, c, c);
                let mut x2 = vec![0.0; n * c];
                residual_forward(&mut x2, &x, &attproj);
                // out = x2 + fcproj(gelu(fc(ln2(x2))))
                let (ln2, ln2_mean, ln2_rstd) =
                    layernorm(params, &name("ln_2.weight"), &name("ln_2.bias"), &x2, n, c);
                let fch = lin("mlp.c_fc.weight", "mlp.c_fc.bias", &ln2, c, 4 * c);
                let mut fch_gelu = vec![0.0; n * 4 * c];
                gelu_forward(&mut fch_gelu, &fch);
                let fcproj = lin("mlp.c_proj.weight", "mlp.c_proj.bias", &fch_gelu, 4 * c, c);
                let mut out = vec![0.0; n * c];
                residual_forward(&mut out, &x2, &fcproj);
                caches.push(PartCache::Block(Box::new(BlockCache {
                    layer: l,
                    x: std::mem::replace(&mut x, out),
                    ln1,
                    ln1_mean,
                    ln1_rstd,
                    qkv,
                    att,
                    atty,
                    x2,
                    ln2,
                    ln2_mean,
                    ln2_rstd,
                    fch,
                    fch_gelu,
                })));
            }
            Part::Head => {
                let targets = targets.expect("the head segment gets targets");
                let (lnf, mean, rstd) = layernorm(params, "ln_f.weight", "ln_f.bias", &x, n, c);
                let mut logits = vec![0.0; n * v];
                matmul_forward(&mut logits, &lnf, p(params, "wte"), None, n, c, v);
                let mut probs = vec![0.0; n * v];
                loss = Some(crossentropy_forward(&mut probs, &logits, targets, n, v));
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
            Part::Attention(_) | Part::Experts(_) => {
                panic!("MoE segments are not supported by the CPU backend")
            }
        }
    }
    let out = out_present.then_some(x);
    (
        out,
        SegmentCache {
            dims,
            parts: caches,
        },
        loss,
    )
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
    let Dims { b, t, c, nh, v } = cache.dims;
    let n = b * t;
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
                matmul_backward_input(&mut dlnf, &dlogits, p(params, "wte"), n, c, v, false);
                let mut dx = vec![0.0; n * c];
                layernorm_backward_input(
                    &mut dx,
                    &dlnf,
                    x,
                    p(params, "ln_f.weight"),
                    mean,
                    rstd,
                    n,
                    c,
                );
                d = dx;
                stash.push(PartStash::Head { dlogits, dlnf });
            }
            PartCache::Block(k) => {
                let l = k.layer;
                let name = |s: &str| format!("h.{l}.{s}");
                let dout = std::mem::take(&mut d);
                // out = x2 + fcproj(gelu(fc(ln2(x2))))
                let mut dgelu = vec![0.0; n * 4 * c];
                matmul_backward_input(
                    &mut dgelu,
                    &dout,
                    p(params, &name("mlp.c_proj.weight")),
                    n,
                    4 * c,
                    c,
                    false,
                );
                let mut dfch = vec![0.0; n * 4 * c];
                gelu_backward(&mut dfch, &k.fch, &dgelu);
                let mut dln2 = vec![0.0; n * c];
                matmul_backward_input(
                    &mut dln2,
                    &dfch,
                    p(params, &name("mlp.c_fc.weight")),
                    n,
                    c,
                    4 * c,
                    false,
                );
                let mut dx2 = dout.clone();
                layernorm_backward_input(
                    &mut dx2,
                    &dln2,
                    &k.x2,
                    p(params, &name("ln_2.weight")),
                    &k.ln2_mean,
                    &k.ln2_rstd,
                    n,
                    c,
                );
                // x2 = x + attproj(attention(qkv(ln1(x))))
                let mut datty = vec![0.0; n * c];
                matmul_backward_input(
                    &mut datty,
                    &dx2,
                    p(params, &name("attn.c_proj.weight")),
                    n,
                    c,
                    c,
                    false,
                );
                let mut dqkv = vec![0.0; n * 3 * c];
                attention_backward(&mut dqkv, &datty, &k.qkv, &k.att, b, t, c, nh);
                let mut dln1 = vec![0.0; n * c];
                matmul_backward_input(
                    &mut dln1,
                    &dqkv,
                    p(params, &name("attn.c_attn.weight")),
                    n,
                    c,
                    3 * c,
                    false,
                );
                let mut dx = dx2.clone();
                layernorm_backward_input(
                    &mut dx,
                    &dln1,
                    &k.x,
                    p(params, &name("ln_1.weight")),
                    &k.ln1_mean,
                    &k.ln1_rstd,
                    n,
                    c,
                );
                d = dx;
                stash.push(PartStash::Block {
                    dout,
                    dfch,
                    dln2,
                    dx2,
                    dqkv,
                    dln1,
                });
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
    (
        has_input.then_some(d),
        SegmentStash {
            parts: stash,
            kept: None,
        },
    )
}

/// Backward for weights: accumulate the segment's parameter gradients.
pub fn segment_backward_weight(grads: &mut Tensors, cache: &SegmentCache, stash: &SegmentStash) {
    let Dims { b, t, c, v, .. } = cache.dims;
    let n = b * t;
    for (pc, st) in cache.parts.iter().zip(&stash.parts) {
        match (pc, st) {
            (PartCache::Embedding { tokens }, PartStash::Embedding { dout }) => {
                let mut dwpe = std::mem::take(g(grads, "wpe"));
                embedding_backward_weight(g(grads, "wte"), &mut dwpe, dout, tokens, b, t, c);
                *g(grads, "wpe") = dwpe;
            }
            (
                PartCache::Block(k),
                PartStash::Block {
                    dout,
                    dfch,
                    dln2,
                    dx2,
                    dqkv,
                    dln1,
                },
            ) => {
                let l = k.layer;
                let name = |s: &str| format!("h.{l}.{s}");
                let lin = |grads: &mut Tensors,
                           w: &str,
                           bias: &str,
                           dout: &[f32],
                           inp: &[f32],
                           ic: usize,
                           oc: usize| {
                    let mut db = std::mem::take(g(grads, &name(bias)));
                    matmul_backward_weight(g(grads, &name(w)), Some(&mut db), dout, inp, n, ic, oc);
                    *g(grads, &name(bias)) = db;
                };
                let ln = |grads: &mut Tensors,
                          w: &str,
                          bias: &str,
                          dout: &[f32],
                          inp: &[f32],
                          mean: &[f32],
                          rstd: &[f32]| {
                    let mut db = std::mem::take(g(grads, &name(bias)));
                    layernorm_backward_weight(
                        g(grads, &name(w)),
                        &mut db,
                        dout,
                        inp,
                        mean,
                        rstd,
                        n,
                        c,
                    );
                    *g(grads, &name(bias)) = db;
                };
                lin(
                    grads,
                    "mlp.c_proj.weight",
                    "mlp.c_proj.bias",
                    dout,
                    &k.fch_gelu,
                    4 * c,
                    c,
                );
                lin(
                    grads,
                    "mlp.c_fc.weight",
                    "mlp.c_fc.bias",
                    dfch,
                    &k.ln2,
                    c,
                    4 * c,
                );
                ln(
                    grads,
                    "ln_2.weight",
                    "ln_2.bias",
                    dln2,
                    &k.x2,
                    &k.ln2_mean,
                    &k.ln2_rstd,
                );
                lin(
                    grads,
                    "attn.c_proj.weight",
                    "attn.c_proj.bias",
                    dx2,
                    &k.atty,
                    c,
                    c,
                );
                lin(
                    grads,
                    "attn.c_attn.weight",
                    "attn.c_attn.bias",
                    dqkv,
                    &k.ln1,
                    c,
                    3 * c,
                );
                ln(
                    grads,
                    "ln_1.weight",
                    "ln_1.bias",
                    dln1,
                    &k.x,
                    &k.ln1_mean,
                    &k.ln1_rstd,
                );
            }
            (
                PartCache::Head {
                    x, lnf, mean, rstd, ..
                },
                PartStash::Head { dlogits, dlnf },
            ) => {
                matmul_backward_weight(g(grads, "wte"), None, dlogits, lnf, n, c, v);
                let mut db = std::mem::take(g(grads, "ln_f.bias"));
                layernorm_backward_weight(
                    g(grads, "ln_f.weight"),
                    &mut db,
                    dlnf,
                    x,
                    mean,
                    rstd,
                    n,
                    c,
                );
                *g(grads, "ln_f.bias") = db;
            }
            _ => unreachable!("stash and cache come from the same segment"),
        }
    }
}
