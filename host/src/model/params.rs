//! The parameter table: every parameter of a part by GPT-2 name and shape
//! (llm.c layouts: linear weights `[out, in]`). The one source both the cost
//! hints (`cost.rs`: parameter counts, hence model-state bytes in plans) and
//! the CPU kernels (`runtime/backend/cpu/gpt.rs`, `moe.rs`) read. A MoE
//! block's attention half has GPT-2's attention names; its expert half has
//! `ln_2`, the router `mlp.router.weight` `[experts, d_model]` (no bias) and
//! per expert `mlp.experts.{e}.c_fc` / `c_proj` with GPT-2's MLP layout.

use super::{ModelConfig, Part, Segment};

/// Parameter names and shapes of one part (the head lists `wte` too: it uses it).
pub fn part_params(cfg: &ModelConfig, part: Part) -> Vec<(String, Vec<usize>)> {
    let (c, v, t) = (
        cfg.d_model as usize,
        cfg.vocab as usize,
        cfg.seq_len as usize,
    );
    match part {
        Part::Embedding => vec![("wte".into(), vec![v, c]), ("wpe".into(), vec![t, c])],
        Part::Block(l) => {
            let p = |s: &str| format!("h.{l}.{s}");
            let mut out = part_params(cfg, Part::Attention(l));
            out.extend([
                (p("ln_2.weight"), vec![c]),
                (p("ln_2.bias"), vec![c]),
                (p("mlp.c_fc.weight"), vec![4 * c, c]),
                (p("mlp.c_fc.bias"), vec![4 * c]),
                (p("mlp.c_proj.weight"), vec![c, 4 * c]),
                (p("mlp.c_proj.bias"), vec![c]),
            ]);
            out
        }
        Part::Attention(l) => {
            let p = |s: &str| format!("h.{l}.{s}");
            vec![
                (p("ln_1.weight"), vec![c]),
                (p("ln_1.bias"), vec![c]),
                (p("attn.c_attn.weight"), vec![3 * c, c]),
                (p("attn.c_attn.bias"), vec![3 * c]),
                (p("attn.c_proj.weight"), vec![c, c]),
                (p("attn.c_proj.bias"), vec![c]),
            ]
        }
        Part::Experts(l) => {
            let Some(moe) = &cfg.moe else {
                return Vec::new();
            };
            let (e, hid) = (moe.experts as usize, moe.hidden_width(cfg.d_model) as usize);
            let p = |s: &str| format!("h.{l}.{s}");
            let mut out = vec![
                (p("ln_2.weight"), vec![c]),
                (p("ln_2.bias"), vec![c]),
                (p("mlp.router.weight"), vec![e, c]),
            ];
            for x in 0..e {
                out.extend([
                    (expert_param(l, x, "c_fc.weight"), vec![hid, c]),
                    (expert_param(l, x, "c_fc.bias"), vec![hid]),
                    (expert_param(l, x, "c_proj.weight"), vec![c, hid]),
                    (expert_param(l, x, "c_proj.bias"), vec![c]),
                ]);
            }
            out
        }
        Part::Head => vec![
            ("ln_f.weight".into(), vec![c]),
            ("ln_f.bias".into(), vec![c]),
            ("wte".into(), vec![v, c]),
        ],
    }
}

/// Name of expert `e`'s parameter `what` (`c_fc.weight`, …) in layer `l`.
pub fn expert_param(l: u32, e: usize, what: &str) -> String {
    format!("h.{l}.mlp.experts.{e}.{what}")
}

/// The expert a parameter belongs to (the inverse of [`expert_param`]);
/// `None` for every other parameter.
pub fn expert_of(name: &str) -> Option<usize> {
    let (_, rest) = name.split_once(".mlp.experts.")?;
    rest.split_once('.')?.0.parse().ok()
}

/// Names and shapes of the parameters a segment reads (deduplicated, in order).
pub fn segment_params(cfg: &ModelConfig, seg: &Segment) -> Vec<(String, Vec<usize>)> {
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    for p in &seg.parts {
        for (n, s) in part_params(cfg, *p) {
            if !out.iter().any(|(m, _)| *m == n) {
                out.push((n, s));
            }
        }
    }
    out
}

/// Every parameter of the model, GPT-2 names, each once.
pub fn model_params(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    for seg in cfg.segments() {
        for (n, s) in segment_params(cfg, &seg) {
            if !out.iter().any(|(m, _)| *m == n) {
                out.push((n, s));
            }
        }
    }
    out
}

/// Does weight decay apply (matrices and embeddings, not biases or norms)?
pub fn decays(shape: &[usize]) -> bool {
    shape.len() >= 2
}

/// How tensor parallelism (`shard-tensor`, Megatron) splits a parameter
/// over a group of `t` devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpSplit {
    /// Whole on every device (layernorms, the row-parallel biases, and
    /// everything outside attention and the MLP).
    Replicated,
    /// Column-parallel layers (`[out, in]` layout: output rows split): the
    /// rows of each of `blocks` equal blocks (q, k, v of `c_attn`: 3).
    Rows { blocks: usize },
    /// Row-parallel layers: the input columns split.
    Cols,
}

/// The split of parameter `name` (GPT-2 names).
pub fn tp_split(name: &str) -> TpSplit {
    let suffix = |s: &str| name.ends_with(s) && name.starts_with("h.");
    if suffix(".attn.c_attn.weight") || suffix(".attn.c_attn.bias") {
        TpSplit::Rows { blocks: 3 }
    } else if suffix(".mlp.c_fc.weight") || suffix(".mlp.c_fc.bias") {
        TpSplit::Rows { blocks: 1 }
    } else if suffix(".attn.c_proj.weight") || suffix(".mlp.c_proj.weight") {
        TpSplit::Cols
    } else {
        TpSplit::Replicated
    }
}

/// Member `r` of `t`'s part of a tensor of `shape`: the contiguous ranges
/// of the row-major full tensor it holds, in order (their concatenation is
/// its local tensor), and its local shape. The sizes divide (checked by
/// `shard-tensor`).
pub fn tp_ranges(
    shape: &[usize],
    split: TpSplit,
    t: usize,
    r: usize,
) -> (Vec<std::ops::Range<usize>>, Vec<usize>) {
    let n: usize = shape.iter().product();
    let cols = if shape.len() == 2 { shape[1] } else { 1 };
    let rows = n / cols.max(1);
    match split {
        TpSplit::Replicated => (std::iter::once(0..n).collect(), shape.to_vec()),
        TpSplit::Rows { blocks } => {
            let per_block = rows / blocks;
            let mine = per_block / t;
            let ranges = (0..blocks)
                .map(|b| {
                    let start = (b * per_block + r * mine) * cols;
                    start..start + mine * cols
                })
                .collect();
            let mut local = shape.to_vec();
            local[0] = mine * blocks;
            (ranges, local)
        }
        TpSplit::Cols => {
            let mine = cols / t;
            let ranges = (0..rows)
                .map(|i| {
                    let start = i * cols + r * mine;
                    start..start + mine
                })
                .collect();
            (ranges, vec![rows, mine])
        }
    }
}
