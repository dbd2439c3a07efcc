//! Finite-difference checks of every kernel's input and weight gradients, and
//! of the whole model's gradient on a small GPT. Central differences in f32
//! with step 1e-2 (1e-3 for the model); a check passes when
//! ‖analytic − numeric‖ / ‖numeric‖ < 2e-2 over the probed entries.

use super::attention::*;
use super::elementwise::*;
use super::embedding::*;
use super::layernorm::*;
use super::loss::*;
use super::matmul::*;
use super::{Cpu, CpuTensor};
use crate::model::params::ParamTable;
use crate::model::ModelConfig;
use crate::runtime::backend::{init, ParamMap};
use crate::runtime::model::{Dims, Model};
use std::collections::BTreeMap;

/// Host tensors by GPT-2 name: the tests pick parameters to probe by name.
pub(super) type Tensors = BTreeMap<String, Vec<f32>>;

/// A CPU device on the calling thread's pool.
pub(super) fn cpu() -> Cpu {
    Cpu::new(0, 1).unwrap()
}

/// Named tensors as a device's parameter store (on the CPU, host memory).
pub(super) fn by_id(table: &ParamTable, t: &Tensors) -> ParamMap<CpuTensor> {
    t.iter()
        .map(|(n, v)| (table.by_name(n).unwrap(), v.clone().into()))
        .collect()
}

/// A parameter store by name.
pub(super) fn by_name(table: &ParamTable, t: ParamMap<CpuTensor>) -> Tensors {
    t.into_iter()
        .map(|(id, v)| (table.name(id).to_string(), v.into_f32()))
        .collect()
}

/// Every parameter of `cfg` as initialised from `seed`, by name.
pub(super) fn initial(cfg: &ModelConfig, seed: u64) -> Tensors {
    let table = ParamTable::new(cfg);
    table
        .ids()
        .map(|id| {
            let v = init::param_values(&table, id, cfg.layers, seed);
            (table.name(id).to_string(), v)
        })
        .collect()
}

/// Zeros shaped like `t`.
pub(super) fn zeros_like(t: &Tensors) -> Tensors {
    t.iter()
        .map(|(k, v)| (k.clone(), vec![0.0; v.len()]))
        .collect()
}

pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn f(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(super) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

/// Compare `analytic` with central differences of `loss` w.r.t. `x`.
pub(super) fn check(
    name: &str,
    x: &mut [f32],
    analytic: &[f32],
    eps: f32,
    tol: f32,
    mut loss: impl FnMut(&[f32]) -> f64,
) {
    let (mut num2, mut diff2) = (0.0f64, 0.0f64);
    let stride = (x.len() / 64).max(1);
    for i in (0..x.len()).step_by(stride) {
        let orig = x[i];
        x[i] = orig + eps;
        let lp = loss(x);
        x[i] = orig - eps;
        let lm = loss(x);
        x[i] = orig;
        let num = (lp - lm) / (2.0 * eps as f64);
        num2 += num * num;
        diff2 += (num - analytic[i] as f64).powi(2);
    }
    let rel = (diff2.sqrt() / num2.sqrt().max(1e-12)) as f32;
    assert!(rel < tol, "{name}: relative error {rel:.3e} ≥ {tol:.0e}");
}

pub(super) fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64) * (*y as f64))
        .sum()
}

#[test]
fn matmul_gradients_match_finite_differences() {
    let (n, c, oc) = (6, 5, 7);
    let mut r = Rng(1);
    let (inp, mut w, mut b, dout) = (r.vec(n * c), r.vec(oc * c), r.vec(oc), r.vec(n * oc));
    let f = |i: &[f32], w: &[f32], b: &[f32]| {
        let mut o = vec![0.0; n * oc];
        matmul_forward(&mut o, i, w, Some(b), n, c, oc);
        dot(&o, &dout)
    };
    let mut dinp = vec![0.0; n * c];
    matmul_backward_input(&mut dinp, &dout, &w, n, c, oc, false);
    let (mut dw, mut db) = (vec![0.0; oc * c], vec![0.0; oc]);
    matmul_backward_weight(&mut dw, Some(&mut db), &dout, &inp, n, c, oc);
    let (w0, b0) = (w.clone(), b.clone());
    check("matmul dinp", &mut inp.clone(), &dinp, 1e-2, 2e-2, |x| {
        f(x, &w0, &b0)
    });
    let i0 = inp.clone();
    check("matmul dW", &mut w, &dw, 1e-2, 2e-2, |x| f(&i0, x, &b0));
    check("matmul db", &mut b, &db, 1e-2, 2e-2, |x| f(&i0, &w0, x));
}

#[test]
fn layernorm_gradients_match_finite_differences() {
    let (n, c) = (4, 8);
    let mut r = Rng(2);
    let (inp, w, b, dout) = (r.vec(n * c), r.vec(c), r.vec(c), r.vec(n * c));
    let f = |i: &[f32], w: &[f32], b: &[f32]| {
        let (mut o, mut m, mut s) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut o, &mut m, &mut s, i, w, b, n, c);
        dot(&o, &dout)
    };
    let (mut o, mut m, mut s) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_forward(&mut o, &mut m, &mut s, &inp, &w, &b, n, c);
    let mut dinp = vec![0.0; n * c];
    layernorm_backward_input(&mut dinp, &dout, &inp, &w, &m, &s, n, c);
    let (mut dw, mut db) = (vec![0.0; c], vec![0.0; c]);
    layernorm_backward_weight(&mut dw, &mut db, &dout, &inp, &m, &s, n, c);
    check("layernorm dinp", &mut inp.clone(), &dinp, 1e-2, 2e-2, |x| {
        f(x, &w, &b)
    });
    check("layernorm dweight", &mut w.clone(), &dw, 1e-2, 2e-2, |x| {
        f(&inp, x, &b)
    });
    check("layernorm dbias", &mut b.clone(), &db, 1e-2, 2e-2, |x| {
        f(&inp, &w, x)
    });
}

#[test]
fn attention_gradients_match_finite_differences() {
    let (b, t, c, nh) = (2, 5, 8, 2);
    let mut r = Rng(3);
    let (qkv, dout) = (r.vec(b * t * 3 * c), r.vec(b * t * c));
    let f = |q: &[f32]| {
        let (mut o, mut a) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
        attention_forward(&mut o, &mut a, q, b, t, c, nh);
        dot(&o, &dout)
    };
    let (mut o, mut a) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
    attention_forward(&mut o, &mut a, &qkv, b, t, c, nh);
    let mut dqkv = vec![0.0; qkv.len()];
    attention_backward(&mut dqkv, &dout, &qkv, &a, b, t, c, nh);
    check("attention dqkv", &mut qkv.clone(), &dqkv, 1e-2, 2e-2, f);
    // Causal: the output at t=0 does not depend on later keys/values.
    let mut q2 = qkv.clone();
    q2[(t - 1) * 3 * c + c] += 10.0;
    let mut o2 = vec![0.0; b * t * c];
    attention_forward(&mut o2, &mut a, &q2, b, t, c, nh);
    assert_eq!(o[..c], o2[..c]);
}

/// Past one block of the causal products (T = 150: blocks of 64, 64, 22),
/// output, probabilities and input gradient equal a naive reference in f64
/// (every score, softmax and sum written out), to float rounding.
#[test]
fn blocked_attention_matches_a_naive_reference_past_one_block() {
    let (b, t, c, nh) = (2, 150, 8, 2);
    let hs = c / nh;
    let mut r = Rng(11);
    let (qkv, dout) = (r.vec(b * t * 3 * c), r.vec(b * t * c));
    let (mut o, mut a) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
    attention_forward(&mut o, &mut a, &qkv, b, t, c, nh);
    let mut dqkv = vec![0.0; qkv.len()];
    attention_backward(&mut dqkv, &dout, &qkv, &a, b, t, c, nh);
    let at = |bi: usize, ti: usize, part: usize, h: usize, i: usize| {
        qkv[(bi * t + ti) * 3 * c + part * c + h * hs + i] as f64
    };
    let scale = 1.0 / (hs as f64).sqrt();
    let mut want_dqkv = vec![0.0f64; qkv.len()];
    let close = |x: f32, y: f64, what: &str| {
        assert!(
            (x as f64 - y).abs() <= 1e-5 * (1.0 + y.abs()),
            "{what}: {x} vs {y}"
        );
    };
    for bi in 0..b {
        for h in 0..nh {
            for ti in 0..t {
                let s: Vec<f64> = (0..=ti)
                    .map(|tj| {
                        (0..hs)
                            .map(|i| at(bi, ti, 0, h, i) * at(bi, tj, 1, h, i))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                let p: Vec<f64> = s.iter().map(|v| (v - m).exp() / z).collect();
                let row = &a[((bi * nh + h) * t + ti) * t..][..t];
                for tj in 0..t {
                    close(row[tj], if tj <= ti { p[tj] } else { 0.0 }, "probability");
                }
                let d = |i: usize| dout[(bi * t + ti) * c + h * hs + i] as f64;
                for i in 0..hs {
                    let y: f64 = (0..=ti).map(|tj| p[tj] * at(bi, tj, 2, h, i)).sum();
                    close(o[(bi * t + ti) * c + h * hs + i], y, "output");
                }
                // dp = dout·v ; ds = p ⊙ (dp − Σ p·dp)
                let dp: Vec<f64> = (0..=ti)
                    .map(|tj| (0..hs).map(|i| d(i) * at(bi, tj, 2, h, i)).sum())
                    .collect();
                let dot: f64 = (0..=ti).map(|tj| p[tj] * dp[tj]).sum();
                for tj in 0..=ti {
                    let ds = p[tj] * (dp[tj] - dot) * scale;
                    for i in 0..hs {
                        want_dqkv[(bi * t + ti) * 3 * c + h * hs + i] += ds * at(bi, tj, 1, h, i);
                        want_dqkv[(bi * t + tj) * 3 * c + c + h * hs + i] +=
                            ds * at(bi, ti, 0, h, i);
                        want_dqkv[(bi * t + tj) * 3 * c + 2 * c + h * hs + i] += p[tj] * d(i);
                    }
                }
            }
        }
    }
    for (x, y) in dqkv.iter().zip(&want_dqkv) {
        close(*x, *y, "dqkv");
    }
}

#[test]
fn gelu_residual_embedding_and_loss_gradients_match_finite_differences() {
    let mut r = Rng(4);
    let (x, dout) = (r.vec(32), r.vec(32));
    let mut dx = vec![0.0; 32];
    gelu_backward(&mut dx, &x, &dout);
    check("gelu", &mut x.clone(), &dx, 1e-2, 2e-2, |x| {
        let mut o = vec![0.0; 32];
        gelu_forward(&mut o, x);
        dot(&o, &dout)
    });
    let (mut da, mut db) = (vec![0.0; 32], vec![0.0; 32]);
    residual_backward(&mut da, &mut db, &dout);
    let y = r.vec(32);
    check("residual", &mut x.clone(), &da, 1e-2, 1e-3, |x| {
        let mut o = vec![0.0; 32];
        residual_forward(&mut o, x, &y);
        dot(&o, &dout)
    });
    // Embedding weights.
    let (b, t, c, v) = (2, 3, 4, 5);
    let tokens = vec![0u32, 4, 2, 2, 1, 0];
    let (wte, wpe, dout) = (r.vec(v * c), r.vec(t * c), r.vec(b * t * c));
    let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
    embedding_backward_weight(&mut dwte, Some(&mut dwpe), &dout, &tokens, b, t, c);
    let f = |e: &[f32], p: &[f32]| {
        let mut o = vec![0.0; b * t * c];
        embedding_forward(&mut o, &tokens, e, Some(p), b, t, c);
        dot(&o, &dout)
    };
    check("embedding dwte", &mut wte.clone(), &dwte, 1e-2, 1e-3, |e| {
        f(e, &wpe)
    });
    check("embedding dwpe", &mut wpe.clone(), &dwpe, 1e-2, 1e-3, |p| {
        f(&wte, p)
    });
    // Cross-entropy.
    let (n, v) = (3, 6);
    let (logits, targets) = (r.vec(n * v), vec![1u32, 5, 0]);
    let mut probs = vec![0.0; n * v];
    crossentropy_forward(&mut probs, &logits, &targets, n, v);
    let mut dl = vec![0.0; n * v];
    crossentropy_backward(&mut dl, &probs, &targets, n, v, 1.0);
    check("cross-entropy", &mut logits.clone(), &dl, 1e-2, 2e-2, |l| {
        let mut p = vec![0.0; n * v];
        crossentropy_forward(&mut p, l, &targets, n, v)
    });
}

fn small() -> ModelConfig {
    ModelConfig {
        name: "fd".into(),
        layers: 2,
        d_model: 16,
        heads: 2,
        seq_len: 6,
        vocab: 11,
        batch_size: 2,
        layers_per_region: 1,
        regions: None,
        moe: None,
        ..Default::default()
    }
}

/// Full forward/backward over every segment on one set of tensors.
pub(super) fn model_loss_and_grads(
    cfg: &ModelConfig,
    params: &Tensors,
    tokens: &[u32],
    targets: &[u32],
) -> (f64, Tensors) {
    let (b, table) = (cpu(), ParamTable::new(cfg));
    let m = Model::new(&b, &table);
    let p = by_id(&table, params);
    let dims = Dims::new(cfg, cfg.batch_size as usize);
    let scale = 1.0 / (dims.b * dims.t) as f32;
    let segs = cfg.segments();
    let mut caches = Vec::new();
    let mut x = None;
    let mut loss = 0.0;
    for s in &segs {
        let (out, cache, l) = m
            .forward(s, &p, Some(tokens), x.take(), Some(targets), dims, None)
            .unwrap();
        x = out;
        loss += l.iter().sum::<f64>();
        caches.push(cache);
    }
    let mut grads = by_id(&table, &zeros_like(params));
    let mut d = None;
    for cache in caches.iter().rev() {
        let (dinp, stash) = m.backward_input(&p, cache, d.take(), scale, None).unwrap();
        m.backward_weight(&mut grads, cache, &stash).unwrap();
        d = dinp;
    }
    (loss * scale as f64, by_name(&table, grads))
}

#[test]
fn whole_model_gradient_matches_finite_differences() {
    let cfg = small();
    let params: Tensors = initial(&cfg, 7)
        .into_iter()
        .map(|(n, v)| {
            // Perturb so biases and gains are not at their special values.
            let mut r = Rng(n.len() as u64);
            let v = v.iter().map(|x| x + 0.05 * r.f()).collect();
            (n, v)
        })
        .collect();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
    let targets: Vec<u32> = (0..12).map(|i| ((i * 3 + 1) % 11) as u32).collect();
    check_model_grads(
        "model",
        &cfg,
        &params,
        (&tokens, &targets),
        &[
            "wte",
            "wpe",
            "h.0.attn.c_attn.weight",
            "h.1.mlp.c_fc.bias",
            "h.1.ln_2.weight",
            "ln_f.bias",
            "h.0.mlp.c_proj.weight",
        ],
        |_| 1e-2,
    );
}

/// Each named parameter's gradient over the whole model against central
/// differences of the loss (step `step(name)`); every one must be nonzero.
pub(super) fn check_model_grads(
    what: &str,
    cfg: &ModelConfig,
    params: &Tensors,
    (tokens, targets): (&[u32], &[u32]),
    names: &[&str],
    step: impl Fn(&str) -> f32,
) {
    let (_, grads) = model_loss_and_grads(cfg, params, tokens, targets);
    for &name in names {
        let mut p = params.clone();
        let analytic = grads[name].clone();
        assert!(analytic.iter().any(|g| *g != 0.0), "{name}: no gradient");
        let mut x = p[name].clone();
        check(
            &format!("{what} d{name}"),
            &mut x,
            &analytic,
            step(name),
            3e-2,
            |v| {
                p.insert(name.to_string(), v.to_vec());
                model_loss_and_grads(cfg, &p, tokens, targets).0
            },
        );
    }
}

/// The gradients of a split backward: every `BI` first (each keeping in its
/// stash only what `BW` reads, the rest of its forward cache dropped, as
/// the runtime does), then every `BW`.
pub(super) fn deferred_grads(cfg: &ModelConfig, params: &Tensors, tokens: &[u32]) -> Tensors {
    let (b, table) = (cpu(), ParamTable::new(cfg));
    let m = Model::new(&b, &table);
    let p = by_id(&table, params);
    let dims = Dims::new(cfg, cfg.batch_size as usize);
    let scale = 1.0 / (dims.b * dims.t) as f32;
    let mut caches = Vec::new();
    let mut x = None;
    for s in &cfg.segments() {
        let (out, cache, _) = m
            .forward(s, &p, Some(tokens), x.take(), Some(tokens), dims, None)
            .unwrap();
        x = out;
        caches.push(cache);
    }
    let mut stashes = Vec::new();
    let mut d = None;
    for cache in caches.into_iter().rev() {
        let full = cache.bytes();
        let (dinp, mut stash) = m.backward_input(&p, &cache, d.take(), scale, None).unwrap();
        stash.keep_for_weights(cache);
        let kept = stash.kept.as_ref().unwrap().bytes();
        assert!(kept < full, "the weight pass keeps {kept} of {full} bytes");
        stashes.push(stash);
        d = dinp;
    }
    let mut deferred = by_id(&table, &zeros_like(params));
    for stash in &stashes {
        m.backward_weight(&mut deferred, stash.kept.as_ref().unwrap(), stash)
            .unwrap();
    }
    by_name(&table, deferred)
}

#[test]
fn deferred_weight_passes_give_the_same_gradients() {
    // Zero-bubble schedules run every BI first and the BWs later: the stash
    // must carry everything BW reads, so the gradients are bit-identical.
    let cfg = small();
    let params = initial(&cfg, 3);
    let tokens: Vec<u32> = (0..12).map(|i| (i % 11) as u32).collect();
    let (loss, grads) = model_loss_and_grads(&cfg, &params, &tokens, &tokens);
    // ln(vocab) at initialisation.
    assert!((loss - (11f64).ln()).abs() < 0.2, "initial loss {loss}");
    assert_eq!(deferred_grads(&cfg, &params, &tokens), grads);
}

/// Every kernel on 1, 2 and 3 threads: the same bits (work is split by
/// outputs only; gemm keeps each element's k-blocking). Sizes are large
/// enough that every kernel really splits.
#[test]
fn every_kernel_gives_the_same_bits_on_any_thread_count() {
    use super::adamw::adamw_update;
    use crate::runtime::backend::AdamW;
    let (b, t, c, nh, v) = (4usize, 64usize, 96usize, 4usize, 256usize);
    let n = b * t;
    let mut r = Rng(7);
    let x = r.vec(n * c);
    let dy = r.vec(n * c);
    let w = r.vec(4 * c * c);
    let bias = r.vec(4 * c);
    let lw = r.vec(c);
    let lb = r.vec(c);
    let qkv = r.vec(n * 3 * c);
    let logits = r.vec(n * v);
    let targets: Vec<u32> = (0..n as u32).map(|i| (i * 37) % v as u32).collect();
    let grad = r.vec(4 * c * c);
    // Everything a kernel writes, for one thread count.
    let run = |threads: usize| -> Vec<Vec<f32>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut outs = Vec::new();
            let mut out = vec![0.0; n * 4 * c];
            matmul_forward(&mut out, &x, &w, Some(&bias), n, c, 4 * c);
            let mut dinp = vec![0.5; n * c];
            matmul_backward_input(&mut dinp, &out, &w, n, c, 4 * c, true);
            let (mut dw, mut db) = (vec![0.25; 4 * c * c], vec![0.0; 4 * c]);
            matmul_backward_weight(&mut dw, Some(&mut db), &out, &x, n, c, 4 * c);
            outs.extend([out, dinp, dw, db]);
            let (mut ln, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
            layernorm_forward(&mut ln, &mut mean, &mut rstd, &x, &lw, &lb, n, c);
            let mut ldx = vec![0.0; n * c];
            layernorm_backward_input(&mut ldx, &dy, &x, &lw, &mean, &rstd, n, c);
            let (mut ldw, mut ldb) = (vec![0.0; c], vec![0.0; c]);
            layernorm_backward_weight(&mut ldw, &mut ldb, &dy, &x, &mean, &rstd, n, c);
            outs.extend([ln, mean, rstd, ldx, ldw, ldb]);
            let (mut ao, mut att) = (vec![0.0; n * c], vec![0.0; b * nh * t * t]);
            attention_forward(&mut ao, &mut att, &qkv, b, t, c, nh);
            let mut dqkv = vec![0.0; n * 3 * c];
            attention_backward(&mut dqkv, &dy, &qkv, &att, b, t, c, nh);
            outs.extend([ao, att, dqkv]);
            let (mut g, mut dg) = (vec![0.0; n * c], vec![0.0; n * c]);
            gelu_forward(&mut g, &x);
            gelu_backward(&mut dg, &x, &dy);
            let mut res = vec![0.0; n * c];
            residual_forward(&mut res, &x, &dy);
            let (mut ra, mut rb) = (vec![1.0; n * c], vec![2.0; n * c]);
            residual_backward(&mut ra, &mut rb, &dy);
            outs.extend([g, dg, res, ra, rb]);
            let mut probs = vec![0.0; n * v];
            let loss = crossentropy_forward(&mut probs, &logits, &targets, n, v);
            let mut dl = vec![0.0; n * v];
            crossentropy_backward(&mut dl, &probs, &targets, n, v, 1.0 / n as f32);
            outs.extend([
                probs,
                dl,
                vec![loss as f32, (loss - loss as f32 as f64) as f32],
            ]);
            let (mut p, mut m, mut vv) = (w.clone(), vec![0.0; w.len()], vec![0.0; w.len()]);
            for step in 1..=3 {
                adamw_update(
                    &mut p,
                    &grad,
                    &mut m,
                    &mut vv,
                    &AdamW::default(),
                    step,
                    0.5,
                    true,
                );
            }
            outs.extend([p, m, vv]);
            outs
        })
    };
    let one = run(1);
    for threads in [2, 3] {
        let many = run(threads);
        for (k, (a, b)) in one.iter().zip(&many).enumerate() {
            let same =
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "output {k} differs between 1 and {threads} threads");
        }
    }
}

/// A MoE half on 2 sequences of 5 tokens: 4 experts of width 12, top-2,
/// a visible balance loss; random parameters with the router scaled so
/// its logits are well apart (finite differences must not flip a choice).
/// Also the model whose table names them.
fn moe_layer(
    capacity_factor: Option<f64>,
) -> (crate::model::MoeConfig, MoeDims, Tensors, ModelConfig) {
    use crate::model::{MoeConfig, Part};
    let mut moe = MoeConfig::new(4, 2);
    moe.hidden = Some(12);
    moe.capacity_factor = capacity_factor;
    moe.aux_loss_coef = 0.1;
    let mut cfg = small();
    cfg.d_model = 8;
    cfg.seq_len = 5;
    cfg.moe = Some(moe);
    let d = MoeDims::new(&moe, 10, 5, 8);
    let mut r = Rng(11);
    let params = crate::model::params::part_entries(&cfg, Part::Experts(0))
        .into_iter()
        .map(|e| {
            let n = e.name();
            let scale = if n.contains("router") { 3.0 } else { 0.5 };
            let v = r.vec(e.numel()).iter().map(|x| x * scale).collect();
            (n, v)
        })
        .collect();
    (moe, d, params, cfg)
}

use crate::runtime::model::moe::{alone, ContextSum, ExpertGroup, MoeCache, MoeDims};

/// `Σ out · R + aux` of the MoE half, and its routing.
fn moe_loss(
    cfg: &ModelConfig,
    d: MoeDims,
    params: &Tensors,
    x: &[f32],
    r: &[f32],
) -> (f64, MoeCache<Cpu>) {
    let (out, cache, aux) = moe_fwd(cfg, params, x, d);
    (dot(&out, r) + aux, cache)
}

/// The MoE half of layer 0 on one device.
fn moe_fwd(
    cfg: &ModelConfig,
    params: &Tensors,
    x: &[f32],
    d: MoeDims,
) -> (Vec<f32>, MoeCache<Cpu>, f64) {
    let (b, table) = (cpu(), ParamTable::new(cfg));
    let moe = cfg.moe.unwrap();
    Model::new(&b, &table)
        .moe_forward(
            &by_id(&table, params),
            0,
            &moe,
            x.to_vec().into(),
            d,
            ExpertGroup::ALONE,
            &mut alone::<Cpu>,
            None,
        )
        .map(|(out, cache, aux)| (out.into_f32(), cache, aux))
        .unwrap()
}

fn check_moe_gradients(capacity_factor: Option<f64>) -> MoeCache<Cpu> {
    let (_, d, params, cfg) = moe_layer(capacity_factor);
    let (b, table) = (cpu(), ParamTable::new(&cfg));
    let m = Model::new(&b, &table);
    let mut rng = Rng(5);
    let (x, r) = (rng.vec(d.n * d.c), rng.vec(d.n * d.c));
    let (_, cache) = moe_loss(&cfg, d, &params, &x, &r);
    let p = by_id(&table, &params);
    let (dx, stash) = m
        .moe_backward_input(&p, &cache, r.clone().into(), 1.0, &mut alone::<Cpu>)
        .unwrap();
    let dx = dx.into_f32();
    let mut grads = by_id(&table, &zeros_like(&params));
    m.moe_backward_weight(&mut grads, &cache, &stash).unwrap();
    let grads = by_name(&table, grads);
    let routing = cache.routed.routing.choice.clone();
    // Every probe keeps the routing (else the loss is not differentiable there).
    let probe = |p: &Tensors, x: &[f32]| {
        let (l, c) = moe_loss(&cfg, d, p, x, &r);
        assert_eq!(
            c.routed.routing.choice, routing,
            "a probe changed the routing"
        );
        l
    };
    check("moe dx", &mut x.clone(), &dx, 1e-3, 2e-2, |v| {
        probe(&params, v)
    });
    for name in [
        "h.0.mlp.router.weight",
        "h.0.ln_2.weight",
        "h.0.ln_2.bias",
        "h.0.mlp.experts.1.c_fc.weight",
        "h.0.mlp.experts.2.c_fc.bias",
        "h.0.mlp.experts.0.c_proj.weight",
        "h.0.mlp.experts.3.c_proj.bias",
    ] {
        let mut p = params.clone();
        let mut v = p[name].clone();
        check(
            &format!("moe d{name}"),
            &mut v,
            &grads[name],
            1e-3,
            2e-2,
            |v| {
                p.insert(name.to_string(), v.to_vec());
                probe(&p, &x)
            },
        );
    }
    // BI then BW from the kept tensors: the same bits.
    let mut deferred = by_id(&table, &zeros_like(&params));
    let kept = cache.duplicate(&b).unwrap().keep_for_weights();
    assert!(kept.bytes() < cache.bytes());
    m.moe_backward_weight(&mut deferred, &kept, &stash).unwrap();
    assert_eq!(by_name(&table, deferred), grads);
    cache
}

#[test]
fn moe_gradients_match_finite_differences() {
    let cache = check_moe_gradients(None);
    assert_eq!(
        cache.routed.routing.dropped, 0,
        "dropless routes every choice"
    );
    assert_eq!(
        cache
            .routed
            .routing
            .rows
            .iter()
            .map(Vec::len)
            .sum::<usize>(),
        20
    );
}

/// Largest |a − b| over the larger magnitude of the two vectors.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().chain(b).fold(1e-12f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// One EP member's output, balance loss, input gradient and gradients.
type Member = (Vec<f32>, f64, Vec<f32>, Tensors);

/// Expert parallelism at the kernel level: the 4 experts spread over 2 and
/// 4 members (threads exchanging through the in-process all-to-all), each
/// member routing its own sequences, give one device's outputs, balance
/// loss and input gradients, each expert's gradients on its owner, and the
/// router's summed over members. Under context parallelism each member
/// holds a part of every sequence instead, and the group's sum of the
/// sequences' statistics makes the balance loss and its gradient the whole
/// sequences'.
#[test]
fn expert_parallel_moe_matches_one_device() {
    use crate::runtime::backend::BackendError;
    use crate::runtime::comm::{in_op_key, Comm, LocalComm};
    let (moe, _, params, cfg) = moe_layer(None);
    let table = ParamTable::new(&cfg);
    let c = 8;
    // (tokens, sequence length, whether members split the sequences)
    for (n, t, context) in [(20, 5, false), (40, 20, true)] {
        let full = MoeDims::new(&moe, n, t, c);
        let mut rng = Rng(9);
        let (x, r) = (rng.vec(n * c), rng.vec(n * c));
        let b = cpu();
        let m = Model::new(&b, &table);
        let (out, cache, aux) = moe_fwd(&cfg, &params, &x, full);
        let p = by_id(&table, &params);
        let (dx, stash) = m
            .moe_backward_input(&p, &cache, r.clone().into(), 0.5, &mut alone::<Cpu>)
            .unwrap();
        let dx = dx.into_f32();
        let mut grads = by_id(&table, &zeros_like(&params));
        m.moe_backward_weight(&mut grads, &cache, &stash).unwrap();
        let grads = by_name(&table, grads);
        for g in [2usize, 4] {
            let case = match context {
                true => format!("EP {g} × CP {g}"),
                false => format!("EP {g}"),
            };
            let comm = LocalComm::new(std::time::Duration::from_secs(10));
            let per = n / g;
            // Member `rank`'s rows: whole sequences, or its part of each.
            let rows = |rank: usize| -> Vec<usize> {
                match context {
                    false => (rank * per..(rank + 1) * per).collect(),
                    true => (0..n / t)
                        .flat_map(|s| s * t + rank * t / g..s * t + (rank + 1) * t / g)
                        .collect(),
                }
            };
            let take = |v: &[f32], rank: usize| -> Vec<f32> {
                rows(rank)
                    .into_iter()
                    .flat_map(|i| v[i * c..(i + 1) * c].to_vec())
                    .collect()
            };
            let devs: Vec<u32> = (0..g as u32).collect();
            let members: Vec<Member> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..g)
                    .map(|rank| {
                        let (comm, devs, params, table) = (&comm, &devs, &params, &table);
                        let (xs, rs) = (take(&x, rank), take(&r, rank));
                        s.spawn(move || {
                            let b = cpu();
                            let m = Model::new(&b, table);
                            let group = ExpertGroup { size: g, rank };
                            let mut ex =
                                |phase: u32,
                                 chunks: Vec<CpuTensor>|
                                 -> Result<Vec<CpuTensor>, BackendError> {
                                    let key = in_op_key(1, phase).unwrap();
                                    let chunks =
                                        chunks.into_iter().map(CpuTensor::into_f32).collect();
                                    let got = comm
                                        .all_to_all("moe", key, devs, rank as u32, chunks)
                                        .map_err(|e| BackendError::Exchange(e.to_string()))?;
                                    Ok(got
                                        .into_iter()
                                        .map(|c| std::sync::Arc::unwrap_or_clone(c).into())
                                        .collect())
                                };
                            let mut sum = |v: Vec<f32>| -> Result<Vec<f32>, BackendError> {
                                let key = in_op_key(1, 16).unwrap();
                                comm.all_reduce("stats", key, devs, rank as u32, v)
                                    .map(std::sync::Arc::unwrap_or_clone)
                                    .map_err(|e| BackendError::Exchange(e.to_string()))
                            };
                            let sum = context.then_some(&mut sum as &mut ContextSum<'_>);
                            // Shared weights and this member's experts only.
                            let mine: Tensors = params
                                .iter()
                                .filter(|(k, _)| {
                                    !k.contains("experts.")
                                        || group
                                            .local(4)
                                            .any(|e| k.contains(&format!("experts.{e}.")))
                                })
                                .map(|(k, v)| (k.clone(), v.clone()))
                                .collect();
                            let mine_ids = by_id(table, &mine);
                            let d = match context {
                                true => MoeDims::new(&moe, per, t / g, c).of_sequences(t),
                                false => MoeDims::new(&moe, per, t, c),
                            };
                            let (o, cache, a) = m
                                .moe_forward(&mine_ids, 0, &moe, xs.into(), d, group, &mut ex, sum)
                                .unwrap();
                            let (dxr, st) = m
                                .moe_backward_input(&mine_ids, &cache, rs.into(), 0.5, &mut ex)
                                .unwrap();
                            let mut gr = by_id(table, &zeros_like(&mine));
                            m.moe_backward_weight(&mut gr, &cache, &st).unwrap();
                            (o.into_f32(), a, dxr.into_f32(), by_name(table, gr))
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            // Every member's rows back at their places.
            let placed = |f: &dyn Fn(&Member) -> &Vec<f32>| {
                let mut all = vec![0.0f32; n * c];
                for (rank, mem) in members.iter().enumerate() {
                    for (j, i) in rows(rank).into_iter().enumerate() {
                        all[i * c..(i + 1) * c].copy_from_slice(&f(mem)[j * c..(j + 1) * c]);
                    }
                }
                all
            };
            assert!(rel_diff(&placed(&|m| &m.0), &out) < 1e-6, "{case}: outputs");
            assert!(
                rel_diff(&placed(&|m| &m.2), &dx) < 1e-6,
                "{case}: input gradients"
            );
            let aux_sum: f64 = members.iter().map(|m| m.1).sum();
            assert!(
                (aux_sum - aux).abs() < 1e-6 * aux.abs(),
                "{case}: balance loss {aux_sum} vs {aux}"
            );
            for (name, want) in &grads {
                let got: Vec<f32> = if name.contains("experts.") {
                    let holders: Vec<_> =
                        members.iter().filter(|m| m.3.contains_key(name)).collect();
                    assert_eq!(holders.len(), 1, "{case}: {name} on exactly one member");
                    holders[0].3[name].clone()
                } else {
                    let mut sum = vec![0.0; want.len()];
                    for m in &members {
                        sum.iter_mut().zip(&m.3[name]).for_each(|(a, b)| *a += b);
                    }
                    sum
                };
                assert!(
                    rel_diff(&got, want) < 1e-5,
                    "{case}: d{name} differs by {}",
                    rel_diff(&got, want)
                );
            }
        }
    }
}

#[test]
fn moe_capacity_drops_are_counted_and_add_nothing() {
    // Capacity ceil(0.5 × 10 × 2 / 4) = 3 per expert: some of the 20
    // choices must go.
    let cache = check_moe_gradients(Some(0.5));
    let r = &cache.routed.routing;
    let mut per_expert = [0u64; 4];
    for x in &r.choice {
        per_expert[*x as usize] += 1;
    }
    let expected: u64 = per_expert.iter().map(|c| c.saturating_sub(3)).sum();
    assert!(
        expected > 0,
        "the test routes more than capacity: {per_expert:?}"
    );
    assert_eq!(r.dropped, expected);
    assert!(r.rows.iter().all(|rows| rows.len() <= 3));
    // First choices are served before second choices.
    for rows in &r.rows {
        let firsts = rows.iter().take_while(|a| *a % 2 == 0).count();
        assert!(rows[firsts..].iter().all(|a| a % 2 == 1), "{rows:?}");
    }
    // A token whose every choice was dropped keeps its residual exactly.
    let (_, d, params, cfg) = moe_layer(Some(0.5));
    let mut rng = Rng(5);
    let x = rng.vec(d.n * d.c);
    let (out, c, _) = moe_fwd(&cfg, &params, &x, d);
    let slots_dropped = |t: usize| {
        (0..2).all(|j| {
            !c.routed
                .routing
                .rows
                .iter()
                .flatten()
                .any(|a| *a as usize == t * 2 + j)
        })
    };
    let mut seen = 0;
    for t in 0..d.n {
        if slots_dropped(t) {
            assert_eq!(out[t * d.c..][..d.c], x[t * d.c..][..d.c]);
            seen += 1;
        }
    }
    // And a bigger factor drops nothing.
    let mut loose = cfg.clone();
    loose.moe.as_mut().unwrap().capacity_factor = Some(2.0);
    let (_, c2, _) = moe_fwd(&loose, &params, &x, d);
    assert_eq!(c2.routed.routing.dropped, 0);
    assert!(seen > 0, "some token lost both choices");
}

#[test]
fn moe_model_gradient_matches_finite_differences_and_defers_exactly() {
    let mut cfg = small();
    let mut moe = crate::model::MoeConfig::new(3, 2);
    moe.hidden = Some(20);
    cfg.moe = Some(moe);
    let params: Tensors = initial(&cfg, 7)
        .into_iter()
        .map(|(n, mut v)| {
            let mut r = Rng(n.len() as u64 + 3);
            // Routers far apart, so probes keep every choice.
            let (scale, jitter) = if n.contains("router") {
                (60.0, 0.0)
            } else {
                (1.0, 0.05)
            };
            v.iter_mut().for_each(|x| *x = *x * scale + jitter * r.f());
            (n, v)
        })
        .collect();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
    let targets: Vec<u32> = (0..12).map(|i| ((i * 3 + 1) % 11) as u32).collect();
    check_model_grads(
        "moe model",
        &cfg,
        &params,
        (&tokens, &targets),
        &[
            "h.0.mlp.router.weight",
            "h.1.mlp.experts.2.c_fc.weight",
            "h.0.mlp.experts.0.c_proj.bias",
            "h.1.ln_2.weight",
            "h.0.attn.c_attn.weight",
            "wte",
        ],
        |_| 1e-3,
    );
}

/// bf16 storage with fp32 arithmetic: a kernel on bf16 operands gives what
/// the fp32 kernel gives on those operands' values, rounded once into a
/// bf16 result; an accumulating kernel adds to its bf16 output's value in
/// fp32; fp32 statistics beside bf16 activations stay fp32; storage is
/// charged 2 bytes an element; copies and sums cross dtypes.
#[test]
fn bf16_operands_are_computed_in_fp32_and_stored_rounded_once() {
    use crate::model::Dtype;
    use crate::runtime::backend::Backend;
    let b = cpu();
    let (n, c, oc) = (6, 64, 24);
    let mut rng = Rng(3);
    let (x, w, bias) = (rng.vec(n * c), rng.vec(oc * c), rng.vec(oc));
    let bf = |v: &[f32]| CpuTensor::from_f32(v.to_vec(), Dtype::Bf16);
    let (xr, wr) = (bf(&x).into_f32(), bf(&w).into_f32());
    let mut want = vec![0.0; n * oc];
    matmul_forward(&mut want, &xr, &wr, Some(&bias), n, c, oc);
    let mut out = b.zeros_as(n * oc, Dtype::Bf16).unwrap();
    let fp32_bias = CpuTensor::from(bias.clone());
    b.matmul_forward(&mut out, &bf(&x), &bf(&w), Some(&fp32_bias), n, c, oc);
    assert_eq!(out, bf(&want));
    assert_eq!(Cpu::bytes(&out), (n * oc * 2) as u64);
    assert_ne!(out.f32(), CpuTensor::from(want.clone()).f32(), "rounded");

    // Accumulating into a bf16 input gradient: fp32 sum of its value and
    // the product, rounded once.
    let d = rng.vec(n * oc);
    let start = rng.vec(n * c);
    let mut acc = bf(&start);
    b.matmul_backward_input(&mut acc, &bf(&d), &bf(&w), n, c, oc, true);
    let mut want = bf(&start).into_f32();
    matmul_backward_input(&mut want, &bf(&d).into_f32(), &wr, n, c, oc, true);
    assert_eq!(acc, bf(&want));

    // LayerNorm: bf16 activations, fp32 statistics.
    let (g, beta) = (rng.vec(c), rng.vec(c));
    let (mut y, mut mean, mut rstd) = (
        b.zeros_as(n * c, Dtype::Bf16).unwrap(),
        b.zeros(n).unwrap(),
        b.zeros(n).unwrap(),
    );
    let (gt, bt) = (CpuTensor::from(g.clone()), CpuTensor::from(beta.clone()));
    b.layernorm_forward(&mut y, &mut mean, &mut rstd, &bf(&x), &gt, &bt, n, c);
    let (mut wy, mut wm, mut wr_) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
    layernorm_forward(&mut wy, &mut wm, &mut wr_, &xr, &g, &beta, n, c);
    assert_eq!((y, mean, rstd), (bf(&wy), wm.into(), wr_.into()));

    // Copies and sums across dtypes.
    let mut wide = b.zeros(4).unwrap();
    b.copy(&mut wide, 1, &bf(&[0.1, 0.2, 0.3]), 0..3);
    let want: Vec<f32> = [0.0, 0.1, 0.2, 0.3]
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    assert_eq!(wide, CpuTensor::from(want.clone()));
    let narrow = b.cast(&wide, Dtype::Bf16).unwrap();
    assert_eq!(
        (Cpu::dtype(&narrow), b.download(&narrow).unwrap()),
        (Dtype::Bf16, want.clone())
    );
    let sq: f64 = want.iter().map(|v| (*v as f64).powi(2)).sum();
    assert_eq!(b.sum_squares(&[(&narrow, 0..4)]).unwrap(), sq);
}

/// A whole model with bf16 activations and bf16 parameters (fp32
/// gradients): every segment's saved tensors take what the cost model says
/// a bf16 run saves (activations 2 bytes, statistics 4) as closely as fp32's
/// do, the loss stays within bf16's reach of fp32's, and the gradients
/// point the same way.
#[test]
fn bf16_activations_are_saved_as_the_cost_model_counts_and_train_like_fp32() {
    use crate::model::{Dtype, Precision};
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 11).collect();
    let targets: Vec<u32> = (0..12).map(|i| (i * 5 + 1) % 11).collect();
    for family in ["gpt2", "llama"] {
        let fp32 = match family {
            "gpt2" => small(),
            _ => super::llama_tests::small_llama(),
        };
        let bf16 = ModelConfig {
            precision: Precision::BF16,
            ..fp32.clone()
        };
        let run = |cfg: &ModelConfig| {
            let (b, table) = (cpu(), ParamTable::new(cfg));
            let act = cfg.precision.params;
            let m = Model::new(&b, &table).with_act(act);
            let p: ParamMap<CpuTensor> = by_id(&table, &initial(cfg, 7))
                .into_iter()
                .map(|(id, t)| (id, t.cast(act)))
                .collect();
            let dims = Dims::new(cfg, cfg.batch_size as usize);
            let scale = 1.0 / (dims.b * dims.t) as f32;
            let (mut x, mut loss, mut caches, mut gaps) = (None, 0.0, Vec::new(), Vec::new());
            for s in &cfg.segments() {
                let (out, cache, l) = m
                    .forward(s, &p, Some(&tokens), x.take(), Some(&targets), dims, None)
                    .unwrap();
                gaps.push((cache.bytes(), s.cost.saved_bytes));
                x = out;
                loss += l.iter().sum::<f64>();
                caches.push(cache);
            }
            let mut grads = by_id(&table, &zeros_like(&initial(cfg, 7)));
            let mut d = None;
            for cache in caches.iter().rev() {
                let (dinp, stash) = m.backward_input(&p, cache, d.take(), scale, None).unwrap();
                m.backward_weight(&mut grads, cache, &stash).unwrap();
                d = dinp;
            }
            assert!(grads.iter().all(|(_, g)| g.dtype() == Dtype::F32));
            (loss * scale as f64, by_name(&table, grads), gaps)
        };
        let ((l32, g32, s32), (l16, g16, s16)) = (run(&fp32), run(&bf16));
        // What a segment saves, measured and costed: in bf16 about half of
        // fp32's, and no further from the cost model than fp32 is.
        for ((m32, c32), (m16, c16)) in s32.iter().zip(&s16) {
            assert!(
                *m16 * 10 < *m32 * 6 && *c16 * 10 < *c32 * 6,
                "{family}: {s16:?} vs {s32:?}"
            );
            assert!(
                m16.abs_diff(*c16) <= m32.abs_diff(*c32),
                "{family}: {s16:?} vs {s32:?}"
            );
        }
        assert!(
            (l16 - l32).abs() < 2e-3 * l32,
            "{family}: loss {l16} vs {l32}"
        );
        for (name, g) in &g32 {
            let h = &g16[name];
            let dot: f64 = g.iter().zip(h).map(|(a, b)| (a * b) as f64).sum();
            let norm = |v: &[f32]| v.iter().map(|a| (a * a) as f64).sum::<f64>().sqrt();
            let cos = dot / (norm(g) * norm(h)).max(1e-30);
            assert!(cos > 0.999, "{family} {name}: cosine {cos}");
        }
    }
}
