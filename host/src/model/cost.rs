//! Cost hints per model part, from the config alone: FLOPs, parameters,
//! activation bytes in and out, and bytes saved for backward. All figures are
//! for the whole global batch (`batch_size × seq_len` tokens); the DAG scales
//! them by the share of the batch a node runs. Activations count in the
//! precision policy's activation dtype (`b`), normalization statistics,
//! token ids and the loss in fp32 (`s`).

use super::{Family, ModelConfig, Part, F32_BYTES};
use serde::{Deserialize, Serialize};

/// Cost hints of a part (or a sum of parts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PartCost {
    /// Forward FLOPs (multiply-add = 2).
    pub fwd_flops: f64,
    /// Backward FLOPs, input and weight gradients together (≈ 2× forward).
    pub bwd_flops: f64,
    /// Of `bwd_flops`, the share that computes weight gradients.
    pub bwd_weight_flops: f64,
    /// Parameters owned, in elements.
    pub param_elems: u64,
    /// Activation bytes entering the part.
    pub act_in_bytes: u64,
    /// Activation bytes leaving the part.
    pub act_out_bytes: u64,
    /// Bytes kept from forward for backward.
    pub saved_bytes: u64,
    /// Bytes a split backward's `BI` hands to its `BW`: the forward tensors
    /// the weight gradients read (matmul and layernorm inputs) and the
    /// output gradient of every weight.
    #[serde(default)]
    pub stash_bytes: u64,
    /// Of `saved_bytes`, what a selective recompute keeps (the layer
    /// inputs, norm statistics, q/k/v, attention output, residual and MLP
    /// pre-activations); the rest its recompute computes again.
    #[serde(default)]
    pub kept_bytes: u64,
    /// FLOPs of a selective recompute: QKᵀ, softmax and AV again (the norms
    /// and activations it also reruns are elementwise).
    #[serde(default)]
    pub recompute_flops: f64,
}

impl PartCost {
    pub fn add(&mut self, o: &PartCost) {
        if self.param_elems == 0 && self.fwd_flops == 0.0 {
            self.act_in_bytes = o.act_in_bytes;
        }
        self.fwd_flops += o.fwd_flops;
        self.bwd_flops += o.bwd_flops;
        self.bwd_weight_flops += o.bwd_weight_flops;
        self.param_elems += o.param_elems;
        self.act_out_bytes = o.act_out_bytes;
        self.saved_bytes += o.saved_bytes;
        self.stash_bytes += o.stash_bytes;
        self.kept_bytes += o.kept_bytes;
        self.recompute_flops += o.recompute_flops;
    }
}

/// Cost of one part over the global batch.
pub fn part_cost(cfg: &ModelConfig, part: Part) -> PartCost {
    if cfg.family == Family::Llama {
        return llama_part_cost(cfg, part);
    }
    let d = cfg.d_model as f64;
    let t = cfg.seq_len as f64;
    let v = cfg.vocab as f64;
    let h = cfg.heads as f64;
    let n = cfg.batch_size as f64 * t; // tokens
    let (e, k, hid) = cfg
        .moe
        .as_ref()
        .map(|m| {
            (
                m.experts as f64,
                m.top_k as f64,
                m.hidden_width(cfg.d_model) as f64,
            )
        })
        .unwrap_or((0.0, 0.0, 0.0));
    let (b, s) = (cfg.precision.act_bytes() as f64, F32_BYTES as f64);
    let hidden = n * d * b; // one (tokens × d_model) tensor
    let attn_flops = 4.0 * n * t * d; // QKᵀ and AV
    let (p, recompute) = probs(cfg, h, t, b, s, 0.5 * attn_flops);
    let (fwd, wgrad_share, saved, stash, act_in, act_out) = match part {
        Part::Embedding => (
            n * d,
            1.0,
            n * 4.0,          // token ids
            n * 4.0 + hidden, // token ids + output gradient
            n * 4.0,
            hidden,
        ),
        Part::Block(_) => (
            2.0 * n * 12.0 * d * d + attn_flops,
            0.5,
            // x, ln1, qkv, attention out, residual, ln2, fc, gelu (15 d),
            // attention probabilities (h t; or the log-sum-exp), layernorm
            // mean/rstd ×2
            (15.0 * d + p) * n * b + 4.0 * n * s,
            // weight pass: x, ln1, attention out, residual, ln2, gelu (9 d)
            // + mean/rstd ×2, and the gradients of out, fc, ln2, residual,
            // qkv, ln1 (11 d)
            20.0 * d * n * b + 4.0 * n * s,
            hidden,
            hidden,
        ),
        Part::Attention(_) => (
            2.0 * n * 4.0 * d * d + attn_flops,
            0.5,
            // x, ln1, qkv, attention out (6 d), probabilities, mean/rstd
            (6.0 * d + p) * n * b + 2.0 * n * s,
            // weight pass: x, ln1, attention out + mean/rstd, and the
            // gradients of out, qkv, ln1 (5 d)
            8.0 * d * n * b + 2.0 * n * s,
            hidden,
            hidden,
        ),
        Part::Experts(_) => (
            // router + top_k expert MLPs per token
            2.0 * n * d * e + 2.0 * n * k * 2.0 * d * hid,
            0.5,
            // x, ln2 (2 d), mean/rstd, router probabilities (e), the
            // routing (expert, weight, slot and row of each assignment:
            // 4 k), and per assignment the expert's input and output (2 d)
            // and its hidden pre-activation and GELU (2 hid)
            ((2.0 * d + e) + k * (2.0 * hid + 2.0 * d)) * n * b + (2.0 + 4.0 * k) * n * s,
            // weight pass: x, ln2, mean/rstd, the routing, per assignment
            // the expert's input (d) and GELU out (hid); router logits'
            // gradient (e), gradients of ln2 (d) and per assignment of the
            // expert's hidden (hid) and output (d)
            ((3.0 * d + e) + k * (2.0 * hid + 2.0 * d)) * n * b + (2.0 + 4.0 * k) * n * s,
            hidden,
            hidden,
        ),
        Part::Head => (
            2.0 * n * d * v + 5.0 * n * v,
            0.5,
            (d + v) * n * b + 2.0 * n * s,
            // weight pass: x, ln_f out, mean/rstd, and the gradients of the
            // logits and of ln_f's output
            (3.0 * d + v) * n * b + 2.0 * n * s,
            hidden,
            s, // the loss
        ),
    };
    // Selective recompute drops the layernorm outputs, the attention
    // probabilities and GELU's output, and reruns the attention core.
    let (dropped, rerun) = match part {
        Part::Block(_) => ((6.0 * d + p) * n * b, attn_flops),
        Part::Attention(_) => ((d + p) * n * b, attn_flops),
        _ => (0.0, 0.0),
    };
    let pc = selective(
        finish(cfg, part, (fwd, wgrad_share, saved, stash, act_in, act_out)),
        dropped,
        rerun,
    );
    with_recompute(pc, part, recompute)
}

/// What the attention core keeps a token for its backward, in activation
/// elements, and the FLOPs its backward adds: the probabilities (`h·t`),
/// or with the memory-efficient kernel one fp32 log-sum-exp a head (`h·s/b`)
/// and the scores' product computed again (`qk`, half the core's FLOPs).
fn probs(cfg: &ModelConfig, h: f64, t: f64, b: f64, s: f64, qk: f64) -> (f64, f64) {
    match cfg.flash_attention() {
        true => (h * s / b, qk),
        false => (h * t, 0.0),
    }
}

/// An attention part's backward with the memory-efficient kernel's
/// recomputed scores.
fn with_recompute(mut pc: PartCost, part: Part, flops: f64) -> PartCost {
    if matches!(part, Part::Block(_) | Part::Attention(_)) {
        pc.bwd_flops += flops;
    }
    pc
}

/// A part's cost with what selective recompute drops and reruns.
fn selective(mut pc: PartCost, dropped: f64, rerun: f64) -> PartCost {
    pc.kept_bytes = pc.saved_bytes.saturating_sub(dropped as u64);
    pc.recompute_flops = rerun;
    pc
}

/// A part's cost from its forward FLOPs and bytes: backward is twice the
/// forward, the weight pass `wgrad_share` of it; the parameters are the
/// part's entries of the parameter table, the head's tied embedding the
/// embedding's.
fn finish(
    cfg: &ModelConfig,
    part: Part,
    (fwd, wgrad_share, saved, stash, act_in, act_out): (f64, f64, f64, f64, f64, f64),
) -> PartCost {
    use super::params::Role;
    let params: f64 = super::params::part_entries(cfg, part)
        .iter()
        .filter(|e| {
            !(part == Part::Head && matches!(e.role, Role::TokenEmbedding | Role::EmbedTokens))
        })
        .map(|e| e.shape.iter().map(|x| *x as f64).product::<f64>())
        .sum::<f64>();
    PartCost {
        fwd_flops: fwd,
        bwd_flops: 2.0 * fwd,
        bwd_weight_flops: 2.0 * fwd * wgrad_share,
        param_elems: params as u64,
        act_in_bytes: act_in as u64,
        act_out_bytes: act_out as u64,
        saved_bytes: saved as u64,
        stash_bytes: stash as u64,
        kept_bytes: saved as u64,
        recompute_flops: 0.0,
    }
}

/// A Llama-family part's cost: the tensors its composition
/// (`runtime/model/llama.rs`) keeps, counted the same way.
fn llama_part_cost(cfg: &ModelConfig, part: Part) -> PartCost {
    let a = cfg.arch();
    let d = cfg.d_model as f64;
    let t = cfg.seq_len as f64;
    let v = cfg.vocab as f64;
    let (h, kvh) = (a.heads as f64, a.kv_heads as f64);
    let (qw, kvw, hid) = (a.q_width() as f64, a.kv_width() as f64, a.hidden as f64);
    let n = cfg.batch_size as f64 * t;
    let (b, s) = (cfg.precision.act_bytes() as f64, F32_BYTES as f64);
    let hidden = n * d * b;
    let qk = if a.qk_norm { 1.0 } else { 0.0 };
    let core = 4.0 * n * t * qw;
    let (p, recompute) = probs(cfg, h, t, b, s, 0.5 * core);
    // Attention half: projections, QKᵀ and AV, rotary and norms.
    let attn_fwd = 2.0 * n * d * (2.0 * qw + 2.0 * kvw) + core;
    // x, norm out, rstd; q, k before their norms and their rstds (qk_norm);
    // the packed rotated q/k/v (3 qw), probabilities (h t; or the
    // log-sum-exp), attention out.
    let attn_saved =
        (2.0 * d + qk * (qw + kvw) + 4.0 * qw + p) * n * b + (1.0 + qk * (h + kvh)) * n * s;
    // weight pass: x, norm out, rstd, attention out (+ q/k and rstds); the
    // gradients of out, q, k, v, norm out (+ q/k after their norms).
    let attn_stash =
        (2.0 * d + qw + qk * (qw + kvw)) + (2.0 * d + qw + 2.0 * kvw + qk * (qw + kvw));
    let attn_stash = attn_stash * n * b + (1.0 + qk * (h + kvh)) * n * s;
    let mlp_fwd = 2.0 * n * 3.0 * d * hid;
    // x2, norm out, rstd, gate, up, silu(gate)·up.
    let mlp_saved = (2.0 * d + 3.0 * hid) * n * b + n * s;
    // weight pass: x2, norm out, rstd, silu(gate)·up; the gradients of
    // out, gate, up, norm out.
    let mlp_stash = (2.0 * d + hid + 2.0 * d + 2.0 * hid) * n * b + n * s;
    let (fwd, saved, stash, act_in, act_out) = match part {
        Part::Embedding => (n * d, n * 4.0, n * 4.0 + hidden, n * 4.0, hidden),
        Part::Block(_) => (
            attn_fwd + mlp_fwd,
            attn_saved + mlp_saved,
            attn_stash + mlp_stash,
            hidden,
            hidden,
        ),
        Part::Attention(_) => (attn_fwd, attn_saved, attn_stash, hidden, hidden),
        Part::Experts(_) => {
            let m = cfg.moe.as_ref();
            let (e, k, eh) = m.map_or((0.0, 0.0, 0.0), |m| {
                (
                    m.experts as f64,
                    m.top_k as f64,
                    m.hidden_width(cfg.d_model) as f64,
                )
            });
            // As GPT-2's experts (the routing, each assignment's input
            // and output), with SwiGLU's gate, up and product (3 eh) and
            // one rstd.
            (
                2.0 * n * d * e + 2.0 * n * k * 3.0 * d * eh,
                ((2.0 * d + e) + k * (3.0 * eh + 2.0 * d)) * n * b + (1.0 + 4.0 * k) * n * s,
                ((3.0 * d + e) + k * (3.0 * eh + 2.0 * d)) * n * b + (1.0 + 4.0 * k) * n * s,
                hidden,
                hidden,
            )
        }
        Part::Head => (
            2.0 * n * d * v + 5.0 * n * v,
            (2.0 * d + v) * n * b + n * s,
            (3.0 * d + v) * n * b + n * s,
            hidden,
            s,
        ),
    };
    let share = if part == Part::Embedding { 1.0 } else { 0.5 };
    // Selective recompute drops the norm outputs, the probabilities and
    // SwiGLU's output, and reruns the attention core.
    let (dropped, rerun) = match part {
        Part::Block(_) => ((2.0 * d + p + hid) * n * b, core),
        Part::Attention(_) => ((d + p) * n * b, core),
        _ => (0.0, 0.0),
    };
    let pc = selective(
        finish(cfg, part, (fwd, share, saved, stash, act_in, act_out)),
        dropped,
        rerun,
    );
    with_recompute(pc, part, recompute)
}

/// How an expert segment's work divides between the phases `shard` splits
/// it into for overlap (dispatch: ln2, router, routing; experts; combine:
/// the weighted sum), over the global batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertPhaseCost {
    /// Share of the segment's FLOPs (forward and backward alike) per phase,
    /// in [`crate::dag::ExpertPhase`] order: dispatch, experts, combine.
    pub flop_share: [f64; 3],
    /// Bytes of the rows one exchange moves: `tokens × top_k × d_model`.
    pub routed_bytes: u64,
    /// Bytes the dispatch phase keeps for the combine (x, ln2, probabilities,
    /// routing) and the experts phase (their inputs and hidden tensors).
    pub dispatch_saved: u64,
    pub experts_saved: u64,
}

/// The phase costs of the model's expert segments (`None` for a dense model).
pub fn expert_phases(cfg: &ModelConfig) -> Option<ExpertPhaseCost> {
    let m = cfg.moe.as_ref()?;
    let d = cfg.d_model as f64;
    let n = cfg.batch_size as f64 * cfg.seq_len as f64;
    let (e, k, hid) = (
        m.experts as f64,
        m.top_k as f64,
        m.hidden_width(cfg.d_model) as f64,
    );
    let b = cfg.precision.act_bytes() as f64;
    // GELU experts have two projections and keep two hidden tensors per
    // row; SwiGLU experts three of each.
    let mats = if cfg.family == Family::Llama {
        3.0
    } else {
        2.0
    };
    let dispatch = 2.0 * n * d * e + 10.0 * n * d;
    let experts = 2.0 * n * k * mats * d * hid;
    let combine = 2.0 * n * k * d;
    let total = dispatch + experts + combine;
    Some(ExpertPhaseCost {
        flop_share: [dispatch / total, experts / total, combine / total],
        routed_bytes: (n * k * d * b) as u64,
        // x, ln2, probabilities in the activation dtype; the statistics
        // and the routing (expert, weight, slot and row of each
        // assignment) in fp32.
        dispatch_saved: ((2.0 * d + e) * n * b + (2.0 + 4.0 * k) * n * F32_BYTES as f64) as u64,
        experts_saved: (k * (mats * hid + d) * n * b) as u64,
    })
}

/// What a compute op runs, in shapes, for the simulator's shape-aware
/// costs (`sim::device`): its weight products, its attention kernel's work,
/// the bytes its memory-bound kernels stream and its kernel count. Figures
/// for one device's op (its rows, its tensor-parallel slices).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpShape {
    pub gemms: Vec<Gemm>,
    /// FLOPs of the attention kernel (causal tiles skipped), and whether
    /// it runs forward (its rate differs by direction).
    pub attention_flops: f64,
    pub attention_forward: bool,
    /// The key length the attention kernel sees.
    pub attention_seq: f64,
    /// Bytes read and written by the norms, activations, residual adds,
    /// rotary, embedding lookups and the loss.
    pub stream_bytes: f64,
    pub kernels: f64,
    /// The same elementwise work as PyTorch eager runs it ([`Eager`]):
    /// its bytes and, with the products, its kernels.
    pub eager_stream_bytes: f64,
    pub eager_kernels: f64,
    /// Of its in-op tensor-parallel exchange, the bytes that run beside
    /// its products: sequence parallelism's gathers and reduce-scatters
    /// inside the blocks (not the gather where a run of blocks ends, nor a
    /// plain all-reduce).
    pub tp_overlap_bytes: f64,
    /// Bytes of a product's operand element.
    pub elem_bytes: f64,
}

/// `count` products of an `m × k` by a `k × n` matrix.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub m: f64,
    pub n: f64,
    pub k: f64,
    pub count: f64,
}

/// Which work of a part a pass runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    Forward,
    /// A selective recompute: the attention core and the dropped
    /// elementwise outputs again.
    Core,
    /// Input and weight gradients.
    Backward,
    InputGrads,
    WeightGrads,
}

/// How a device runs a part: its rows (tokens), its tensor-parallel degree
/// (with sequence parallelism or not), and the group its experts are
/// spread over (1: all experts on every device).
#[derive(Clone, Copy, Debug)]
pub struct Placement {
    pub rows: f64,
    pub tp: f64,
    pub sp: bool,
    pub ep: f64,
}

/// How tensor parallelism splits a weight.
#[derive(Clone, Copy, PartialEq)]
enum Split {
    /// Output columns (q/k/v, fc, gate/up, the vocabulary).
    Col,
    /// Input rows (attention out, fc2/down).
    Row,
    /// Whole on each device (the router).
    Whole,
    /// One per expert, `rows` assignments per token.
    Expert,
}

/// A part's weights `(k, n, split)`, with its elementwise traffic per token
/// in forward (elements, split into what tensor parallelism replicates and
/// what it slices), its elementwise kernel count, and whether it attends.
struct PartWork {
    weights: Vec<(f64, f64, Split)>,
    replicated: f64,
    sliced: f64,
    elementwise: f64,
    attends: bool,
    /// What a selective recompute streams again besides the attention
    /// core: its norms (replicated) and its activation (sliced).
    rerun: (f64, f64),
    /// The same elementwise work as PyTorch eager runs it.
    eager: Eager,
}

/// A part's elementwise work as PyTorch eager runs it (torchtitan's Llama
/// without `torch.compile`): each op its own kernel, reading its inputs and
/// writing its output, so an RMSNorm is seven kernels over fp32 copies
/// (`x.float()`, `pow`, `mean`, `rsqrt`, `x·r`, `type_as`, `·weight`), a
/// rotary embedding three (upcast, complex product, `type_as`), SwiGLU two
/// (`silu`, `·up`), the loss an fp32 copy of the logits and a
/// `log_softmax`; autograd's backward runs each op's gradient kernels.
/// Bytes per token, (replicated, sliced) as [`PartWork`]'s; GPT-2's
/// LayerNorm and GELU, the embedding and the experts run one kernel each,
/// as fused.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Eager {
    fwd: (f64, f64),
    bwd: (f64, f64),
    /// What a selective recompute streams again (the norms, the activation).
    rerun: (f64, f64),
    /// Kernels forward (backward launches twice as many) and in a
    /// selective recompute.
    kernels: f64,
    rerun_kernels: f64,
}

/// Eager bytes per element, (forward, backward), for activations of `b`
/// bytes (fp32 copies cost nothing when they are fp32 already).
struct EagerOps {
    rmsnorm: (f64, f64),
    rotary: (f64, f64),
    swiglu: (f64, f64),
    residual: (f64, f64),
    loss: (f64, f64),
}

impl EagerOps {
    fn of(b: f64) -> Self {
        // An upcast to fp32 and its way back (`type_as`), each direction.
        let up = if b < 4.0 { b + 4.0 } else { 0.0 };
        EagerOps {
            // pow 8, mean 4, x·r 8, ·weight 2b; backward: ·weight's two
            // gradients 4b, x·r's two 16, pow's 12, their sum 12.
            rmsnorm: (2.0 * up + 20.0 + 2.0 * b, 2.0 * up + 40.0 + 4.0 * b),
            // The complex product reads and writes fp32.
            rotary: (2.0 * up + 8.0, 2.0 * up + 8.0),
            swiglu: (5.0 * b, 9.0 * b),
            residual: (3.0 * b, 6.0 * b),
            // `log_softmax` 8; backward: nll's 4, log_softmax's 12.
            loss: (up + 8.0, up + 16.0),
        }
    }
}

impl Eager {
    /// What eager runs as the fused model counts it.
    fn fused(w: &PartWork, b: f64) -> Self {
        Eager {
            fwd: (w.replicated * b, w.sliced * b),
            bwd: (2.0 * w.replicated * b, 2.0 * w.sliced * b),
            rerun: (w.rerun.0 * b, w.rerun.1 * b),
            kernels: w.elementwise,
            rerun_kernels: if w.attends { 3.0 } else { 0.0 },
        }
    }
}

fn part_work(cfg: &ModelConfig, part: Part) -> PartWork {
    let mut w = fused_work(cfg, part);
    w.eager = eager_work(cfg, part, &w);
    w
}

/// [`Eager`] of `part` (`w` its fused work).
fn eager_work(cfg: &ModelConfig, part: Part, w: &PartWork) -> Eager {
    let b = cfg.precision.act_bytes() as f64;
    let fused = Eager::fused(w, b);
    let a = cfg.arch();
    let d = f64::from(cfg.d_model);
    let (qk_width, hid) = (f64::from(a.q_width() + a.kv_width()), f64::from(a.hidden));
    let qk = if a.qk_norm { 1.0 } else { 0.0 };
    let o = EagerOps::of(b);
    // Forward (`false`) or backward (`true`) bytes of an op.
    let pick = |p: (f64, f64), back: bool| if back { p.1 } else { p.0 };
    let norm_res = |back| d * (pick(o.rmsnorm, back) + pick(o.residual, back));
    let attn = |back| {
        (
            norm_res(back),
            qk_width * (pick(o.rotary, back) + qk * pick(o.rmsnorm, back)),
        )
    };
    let mlp = |back| (norm_res(back), hid * pick(o.swiglu, back));
    let add = |x: (f64, f64), y: (f64, f64)| (x.0 + y.0, x.1 + y.1);
    let llama = cfg.family == Family::Llama;
    // Norm and residual 8 kernels, rotary 3 per tensor, a q/k norm 7,
    // SwiGLU 2.
    match part {
        Part::Block(_) if llama => Eager {
            fwd: add(attn(false), mlp(false)),
            bwd: add(attn(true), mlp(true)),
            rerun: (2.0 * d * o.rmsnorm.0, hid * o.swiglu.0),
            kernels: 16.0 + 6.0 + 14.0 * qk + 2.0,
            rerun_kernels: 16.0,
        },
        Part::Attention(_) if llama => Eager {
            fwd: attn(false),
            bwd: attn(true),
            rerun: (d * o.rmsnorm.0, 0.0),
            kernels: 8.0 + 6.0 + 14.0 * qk,
            rerun_kernels: 7.0,
        },
        Part::Head => Eager {
            fwd: (
                if llama { d * o.rmsnorm.0 } else { fused.fwd.0 },
                f64::from(cfg.vocab) * o.loss.0,
            ),
            bwd: (
                if llama { d * o.rmsnorm.1 } else { fused.bwd.0 },
                f64::from(cfg.vocab) * o.loss.1,
            ),
            kernels: if llama { 10.0 } else { 4.0 },
            ..fused
        },
        _ => fused,
    }
}

fn fused_work(cfg: &ModelConfig, part: Part) -> PartWork {
    let a = cfg.arch();
    let d = f64::from(cfg.d_model);
    let v = f64::from(cfg.vocab);
    let (qw, kvw, hid) = (
        f64::from(a.q_width()),
        f64::from(a.kv_width()),
        f64::from(a.hidden),
    );
    let llama = cfg.family == Family::Llama;
    let qk = if a.qk_norm { 1.0 } else { 0.0 };
    // Each elementwise kernel reads its inputs and writes its output once:
    // a norm 2 rows of d, a residual add 3; rotary reads and writes q and
    // k; GELU reads and writes the hidden row, SwiGLU reads two and writes
    // one.
    let attention = || -> (Vec<(f64, f64, Split)>, f64, f64, f64) {
        match llama {
            true => (
                vec![
                    (d, qw, Split::Col),
                    (d, kvw, Split::Col),
                    (d, kvw, Split::Col),
                    (qw, d, Split::Row),
                ],
                5.0,
                2.0 * (qw + kvw) * (1.0 + qk),
                3.0 + 2.0 * qk,
            ),
            false => (
                vec![(d, 3.0 * d, Split::Col), (d, d, Split::Row)],
                5.0,
                0.0,
                2.0,
            ),
        }
    };
    let mlp = |w: f64| -> (Vec<(f64, f64, Split)>, f64, f64, f64) {
        match llama {
            true => (
                vec![(d, w, Split::Col), (d, w, Split::Col), (w, d, Split::Row)],
                5.0,
                3.0 * w,
                3.0,
            ),
            false => (
                vec![(d, w, Split::Col), (w, d, Split::Row)],
                5.0,
                2.0 * w,
                3.0,
            ),
        }
    };
    let act = if llama { 3.0 * hid } else { 2.0 * hid };
    let pw = |(weights, rep, sliced, ew): (Vec<(f64, f64, Split)>, f64, f64, f64),
              rerun: (f64, f64)| PartWork {
        weights,
        replicated: rep * d,
        sliced,
        elementwise: ew,
        attends: true,
        rerun,
        eager: Eager::default(),
    };
    match part {
        Part::Embedding => PartWork {
            weights: Vec::new(),
            replicated: if llama { 2.0 * d } else { 3.0 * d },
            sliced: 0.0,
            elementwise: if llama { 1.0 } else { 2.0 },
            attends: false,
            rerun: (0.0, 0.0),
            eager: Eager::default(),
        },
        Part::Block(_) => {
            let (mut w, r, s, e) = attention();
            let (w2, r2, s2, e2) = mlp(hid);
            w.extend(w2);
            pw((w, r + r2, s + s2, e + e2), (4.0 * d, act))
        }
        Part::Attention(_) => pw(attention(), (2.0 * d, 0.0)),
        Part::Experts(_) => {
            let m = cfg.moe.as_ref();
            let (e, k, eh) = m.map_or((1.0, 1.0, 0.0), |m| {
                (
                    f64::from(m.experts),
                    f64::from(m.top_k),
                    f64::from(m.hidden_width(cfg.d_model)),
                )
            });
            let (w, _, act, ew) = mlp(eh);
            let mut weights = vec![(d, e, Split::Whole)];
            weights.extend(w.into_iter().map(|(a, b, _)| (a, b, Split::Expert)));
            // norm, router softmax, the rows copied to and from their
            // experts, the activation per assignment, the weighted sum.
            PartWork {
                weights,
                replicated: 5.0 * d + 2.0 * e + k * (4.0 * d + act),
                sliced: 0.0,
                elementwise: ew + 4.0,
                attends: false,
                rerun: (0.0, 0.0),
                eager: Eager::default(),
            }
        }
        Part::Head => PartWork {
            weights: vec![(d, v, Split::Col)],
            replicated: 2.0 * d,
            sliced: v,
            elementwise: 2.0,
            attends: false,
            rerun: (0.0, 0.0),
            eager: Eager::default(),
        },
    }
}

/// The shapes of `work` on `parts` as placed: the products' rows are the
/// device's tokens (an expert's, the tokens routed to it), a
/// tensor-parallel slice divides the columns or the rows it splits;
/// backward runs each product twice more (`dX = dY·Wᵀ`: `m × k × n`,
/// `dW = Xᵀ·dY`: `k × n × m`) and streams twice the forward's bytes. The
/// attention kernel's FLOPs are the forward's `QKᵀ` and `AV` over the
/// causal half (`2·rows·T·q_width`), 2.5 times that backward (the
/// memory-efficient kernel recomputes the scores).
pub fn op_shape(cfg: &ModelConfig, parts: &[Part], work: Work, at: Placement) -> OpShape {
    let b = cfg.precision.act_bytes() as f64;
    let t = f64::from(cfg.seq_len);
    let q_width = f64::from(cfg.arch().q_width());
    let (e, top_k) = cfg.moe.as_ref().map_or((1.0, 1.0), |m| {
        (f64::from(m.experts.max(1)), f64::from(m.top_k))
    });
    let mut s = OpShape {
        attention_forward: matches!(work, Work::Forward | Work::Core),
        attention_seq: t,
        elem_bytes: b,
        ..OpShape::default()
    };
    let rep = if at.sp { at.tp } else { 1.0 };
    for part in parts {
        let w = part_work(cfg, *part);
        let fwd_bytes = (w.replicated / rep + w.sliced / at.tp) * at.rows * b;
        let (stream, gemm_passes) = match work {
            Work::Forward => (fwd_bytes, [true, false, false]),
            Work::Core => (
                (w.rerun.0 / rep + w.rerun.1 / at.tp) * at.rows * b,
                [false, false, false],
            ),
            Work::Backward => (2.0 * fwd_bytes, [false, true, true]),
            Work::InputGrads => (2.0 * fwd_bytes, [false, true, false]),
            Work::WeightGrads => (0.0, [false, false, true]),
        };
        s.stream_bytes += stream;
        let eager = w.eager;
        let per_row = |(r, sl): (f64, f64)| (r / rep + sl / at.tp) * at.rows;
        s.eager_stream_bytes += match work {
            Work::Forward => per_row(eager.fwd),
            Work::Core => per_row(eager.rerun),
            Work::Backward | Work::InputGrads => per_row(eager.bwd),
            Work::WeightGrads => 0.0,
        };
        let mut products = 0.0;
        for (k, n, split) in &w.weights {
            let (m, n, k, count) = match split {
                Split::Col => (at.rows, n / at.tp, *k, 1.0),
                Split::Row => (at.rows, *n, k / at.tp, 1.0),
                Split::Whole => (at.rows, *n, *k, 1.0),
                Split::Expert => {
                    // Each device holds e / ep experts and takes the
                    // assignments routed to them from its group; on a
                    // tensor-parallel mesh its share of the rows.
                    let local = (e / at.ep).max(1.0);
                    let rows = at.rows / at.tp * top_k * at.ep / e;
                    (rows, *n, *k, local)
                }
            };
            for (run, g) in gemm_passes.iter().zip([
                Gemm { m, n, k, count },
                Gemm {
                    m,
                    n: k,
                    k: n,
                    count,
                },
                Gemm {
                    m: k,
                    n,
                    k: m,
                    count,
                },
            ]) {
                if *run {
                    s.gemms.push(g);
                    products += count;
                }
            }
        }
        if w.attends && work != Work::WeightGrads {
            let fwd = 2.0 * at.rows * t * q_width / at.tp;
            s.attention_flops += match work {
                Work::Forward | Work::Core => fwd,
                _ => 2.5 * fwd,
            };
            s.kernels += 1.0;
            s.eager_kernels += 1.0;
        }
        s.kernels += products
            + match work {
                Work::WeightGrads => 0.0,
                Work::Backward | Work::InputGrads => 2.0 * w.elementwise,
                Work::Forward => w.elementwise,
                // The norms and the activation again.
                Work::Core if w.attends => 3.0,
                Work::Core => 0.0,
            };
        s.eager_kernels += products
            + match work {
                Work::WeightGrads => 0.0,
                Work::Backward | Work::InputGrads => 2.0 * eager.kernels,
                Work::Forward => eager.kernels,
                Work::Core => eager.rerun_kernels,
            };
    }
    s
}
