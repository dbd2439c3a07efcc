//! Finite-difference checks of the Llama family's kernels (RMSNorm, RoPE,
//! SwiGLU, grouped-query packing) and of a whole small Llama's gradient
//! (grouped-query attention, q/k norms, untied head), with the helpers of
//! `tests.rs`.

use super::attention::{qkv_pack, qkv_unpack_backward};
use super::elementwise::{swiglu_backward, swiglu_forward};
use super::rmsnorm::*;
use super::rope::rope;
use super::tests::*;
use crate::model::{Family, ModelConfig};

#[test]
fn rmsnorm_gradients_match_finite_differences() {
    let (n, c) = (4, 8);
    let mut r = Rng(21);
    let (inp, w, dout) = (r.vec(n * c), r.vec(c), r.vec(n * c));
    let f = |i: &[f32], w: &[f32]| {
        let (mut o, mut s) = (vec![0.0; n * c], vec![0.0; n]);
        rmsnorm_forward(&mut o, &mut s, i, w, n, c, 1e-6);
        dot(&o, &dout)
    };
    let (mut o, mut s) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut o, &mut s, &inp, &w, n, c, 1e-6);
    // Each row's root mean square is 1 after the norm (unit weight).
    let (mut unit, mut s1) = (vec![0.0; n * c], vec![0.0; n]);
    rmsnorm_forward(&mut unit, &mut s1, &inp, &vec![1.0; c], n, c, 0.0);
    for row in unit.chunks(c) {
        let ms = row.iter().map(|x| x * x).sum::<f32>() / c as f32;
        assert!((ms - 1.0).abs() < 1e-5, "mean square {ms}");
    }
    let mut dinp = vec![0.0; n * c];
    rmsnorm_backward_input(&mut dinp, &dout, &inp, &w, &s, n, c);
    let mut dw = vec![0.0; c];
    rmsnorm_backward_weight(&mut dw, &dout, &inp, &s, n, c);
    check("rmsnorm dinp", &mut inp.clone(), &dinp, 1e-2, 2e-2, |x| {
        f(x, &w)
    });
    check("rmsnorm dweight", &mut w.clone(), &dw, 1e-2, 2e-2, |x| {
        f(&inp, x)
    });
}

#[test]
fn rope_rotates_pairs_by_position_and_its_backward_is_the_inverse() {
    let (b, t, heads, hd) = (2, 5, 3, 8);
    let mut r = Rng(22);
    let x = r.vec(b * t * heads * hd);
    let mut y = x.clone();
    rope(&mut y, b, t, heads, hd, 10_000.0, false);
    // Position 0 is not rotated; position 1's first pair turns by 1 radian
    // (θ^0 = 1): Hugging Face's rotate_half pairs channel i with i + hd/2.
    let row = heads * hd;
    assert_eq!(y[..row], x[..row]);
    let (a, bb) = (x[row], x[row + hd / 2]);
    let (c, s) = (1f64.cos() as f32, 1f64.sin() as f32);
    assert_eq!(y[row], a * c - bb * s);
    assert_eq!(y[row + hd / 2], bb * c + a * s);
    // A rotation keeps every pair's length.
    for (u, v) in x.chunks(hd).zip(y.chunks(hd)) {
        let len = |h: &[f32]| h.iter().map(|z| z * z).sum::<f32>();
        assert!((len(u) - len(v)).abs() < 1e-5);
    }
    // The backward (inverse rotation) is the forward's gradient.
    let dout = r.vec(x.len());
    let mut dx = dout.clone();
    rope(&mut dx, b, t, heads, hd, 10_000.0, true);
    check("rope dx", &mut x.clone(), &dx, 1e-2, 1e-3, |x| {
        let mut y = x.to_vec();
        rope(&mut y, b, t, heads, hd, 10_000.0, false);
        dot(&y, &dout)
    });
}

#[test]
fn swiglu_and_grouped_query_packing_gradients_match_finite_differences() {
    let mut r = Rng(23);
    let n = 40;
    let (g, u, dout) = (r.vec(n), r.vec(n), r.vec(n));
    // Large arguments too: σ saturates without overflow.
    let mut g = g.iter().map(|x| x * 6.0).collect::<Vec<_>>();
    g[0] = 30.0;
    g[1] = -30.0;
    let f = |g: &[f32], u: &[f32]| {
        let mut o = vec![0.0; n];
        swiglu_forward(&mut o, g, u);
        dot(&o, &dout)
    };
    let mut o = vec![0.0; n];
    swiglu_forward(&mut o, &g, &u);
    assert_eq!(o[0], 30.0 * u[0]);
    assert!(o[1].abs() < 1e-7);
    let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
    swiglu_backward(&mut dg, &mut du, &g, &u, &dout);
    check("swiglu dgate", &mut g.clone(), &dg, 1e-3, 2e-2, |x| {
        f(x, &u)
    });
    check("swiglu dup", &mut u.clone(), &du, 1e-2, 1e-3, |x| f(&g, x));
    // Packing: 4 query heads over 2 kv heads of 3 channels.
    let (rows, nh, kvh, hd) = (5, 4, 2, 3);
    let (q, k, v) = (
        r.vec(rows * nh * hd),
        r.vec(rows * kvh * hd),
        r.vec(rows * kvh * hd),
    );
    let mut qkv = vec![0.0; rows * 3 * nh * hd];
    qkv_pack(&mut qkv, &q, &k, &v, rows, nh, kvh, hd);
    // Query head 3 reads kv head 1.
    let qw = nh * hd;
    assert_eq!(qkv[qw + 3 * hd..qw + 4 * hd], k[hd..2 * hd]);
    assert_eq!(qkv[2 * qw + 2 * hd..2 * qw + 3 * hd], v[hd..2 * hd]);
    let dqkv = r.vec(qkv.len());
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    qkv_unpack_backward(&mut dq, &mut dk, &mut dv, &dqkv, rows, nh, kvh, hd);
    let pack = |q: &[f32], k: &[f32], v: &[f32]| {
        let mut o = vec![0.0; rows * 3 * qw];
        qkv_pack(&mut o, q, k, v, rows, nh, kvh, hd);
        dot(&o, &dqkv)
    };
    check("pack dq", &mut q.clone(), &dq, 1e-2, 1e-3, |x| {
        pack(x, &k, &v)
    });
    check("pack dk", &mut k.clone(), &dk, 1e-2, 1e-3, |x| {
        pack(&q, x, &v)
    });
    check("pack dv", &mut v.clone(), &dv, 1e-2, 1e-3, |x| {
        pack(&q, &k, x)
    });
}

/// A small Llama with everything the family has: 4 query heads over 2 kv
/// heads, q/k norms, an untied head, a head width apart from d_model / heads.
pub(super) fn small_llama() -> ModelConfig {
    ModelConfig {
        name: "fd-llama".into(),
        layers: 2,
        d_model: 16,
        heads: 4,
        seq_len: 6,
        vocab: 11,
        batch_size: 2,
        layers_per_region: 1,
        family: Family::Llama,
        kv_heads: Some(2),
        head_dim: Some(6),
        intermediate: Some(24),
        rope_theta: Some(500.0),
        qk_norm: true,
        norm_eps: Some(1e-6),
        ..Default::default()
    }
}

#[test]
fn whole_llama_gradient_matches_finite_differences() {
    let cfg = small_llama();
    cfg.validate().unwrap();
    let params: Tensors = initial(&cfg, 9)
        .into_iter()
        .map(|(n, v)| {
            // Matrices larger than the init's 0.02 so every path carries
            // signal; norm gains near 1 but not at it (gains of 3 on q and k
            // saturate the softmax, where central differences are not
            // accurate).
            let mut r = Rng(n.len() as u64);
            let gain = n.contains("norm");
            let v = v
                .iter()
                .map(|x| {
                    if gain {
                        x + 0.1 * r.f()
                    } else {
                        x * 3.0 + 0.05 * r.f()
                    }
                })
                .collect();
            (n, v)
        })
        .collect();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
    let targets: Vec<u32> = (0..12).map(|i| ((i * 3 + 1) % 11) as u32).collect();
    check_model_grads(
        "llama",
        &cfg,
        &params,
        (&tokens, &targets),
        &[
            "model.embed_tokens.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.1.self_attn.k_norm.weight",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.norm.weight",
            "lm_head.weight",
        ],
        |_| 1e-2,
    );
}

/// Qwen3-MoE's layer in small: every MLP 4 SwiGLU experts of width 12, top-2,
/// dropless, over the small Llama's attention.
#[test]
fn llama_expert_layers_gradient_matches_finite_differences() {
    let mut cfg = small_llama();
    let mut moe = crate::model::MoeConfig::new(4, 2);
    moe.hidden = Some(12);
    cfg.moe = Some(moe);
    cfg.validate().unwrap();
    let params: Tensors = initial(&cfg, 11)
        .into_iter()
        .map(|(n, v)| {
            let mut r = Rng(n.len() as u64 + 1);
            // Routers far apart, so probes keep every choice.
            let router = n.ends_with("mlp.gate.weight");
            let gain = n.contains("norm");
            let v = v
                .iter()
                .map(|x| match (router, gain) {
                    (true, _) => x * 60.0,
                    (_, true) => x + 0.1 * r.f(),
                    _ => x * 3.0 + 0.05 * r.f(),
                })
                .collect();
            (n, v)
        })
        .collect();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 5 % 11) as u32).collect();
    let targets: Vec<u32> = (0..12).map(|i| ((i * 7 + 2) % 11) as u32).collect();
    check_model_grads(
        "llama moe",
        &cfg,
        &params,
        (&tokens, &targets),
        &[
            "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.1.gate_proj.weight",
            "model.layers.1.mlp.experts.2.up_proj.weight",
            "model.layers.1.mlp.experts.3.down_proj.weight",
            "model.layers.1.self_attn.q_proj.weight",
            "model.embed_tokens.weight",
        ],
        // The router's weights are 60× the others: a step to scale.
        |name| {
            if name.ends_with("mlp.gate.weight") {
                1e-2
            } else {
                1e-3
            }
        },
    );
}

#[test]
fn llama_deferred_weight_passes_give_the_same_gradients() {
    let cfg = small_llama();
    let params = initial(&cfg, 5);
    let tokens: Vec<u32> = (0..12).map(|i| (i % 11) as u32).collect();
    let (loss, grads) = model_loss_and_grads(&cfg, &params, &tokens, &tokens);
    assert!((loss - (11f64).ln()).abs() < 0.2, "initial loss {loss}");
    assert_eq!(deferred_grads(&cfg, &params, &tokens), grads);
}
