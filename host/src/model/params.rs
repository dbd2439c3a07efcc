//! The parameter table: every parameter of the model once, named by a typed
//! [`ParamId`], with its role, layer, expert, shape and the name it has in
//! checkpoints — GPT-2's, or Hugging Face's Llama names for the Llama family
//! (llm.c layouts inside: linear weights `[out, in]`). The one
//! source the cost hints (`cost.rs`: parameter counts, hence model-state bytes
//! in plans), the DAG's memory figures and the runtime (whose states are
//! indexed by id) read; names are used only at the checkpoint and dump edge
//! and to seed initialisation.
//!
//! A MoE block's attention half has GPT-2's attention parameters; its expert
//! half has `ln_2`, the router `mlp.router.weight` `[experts, d_model]` (no
//! bias) and per expert `mlp.experts.{e}.c_fc` / `c_proj` with GPT-2's MLP
//! layout. The Llama family's expert half (Qwen3-MoE) has
//! `post_attention_layernorm`, the router `mlp.gate.weight` and per expert
//! `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`, without biases.
//!
//! Ids are numbered in the order of the names (as strings), so every
//! walk over a device's states in id order (ZeRO's flat bucket layouts, the
//! sums of the gradient norm) is the order checkpoints list them in.

use super::{Family, ModelConfig, Part, Segment};
use std::collections::HashMap;

/// A parameter of the model: its index in the [`ParamTable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ParamId(u32);

impl ParamId {
    /// Its index in the table (and in every [`ParamId`]-indexed store).
    pub fn index(self) -> usize {
        self.0 as usize
    }
    /// The id of table index `i` (wire formats carry ids as indices).
    pub fn from_index(i: usize) -> Option<Self> {
        u32::try_from(i).ok().map(ParamId)
    }
}

/// What a parameter is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    TokenEmbedding,
    PositionEmbedding,
    Ln1Weight,
    Ln1Bias,
    QkvWeight,
    QkvBias,
    AttnProjWeight,
    AttnProjBias,
    Ln2Weight,
    Ln2Bias,
    FcWeight,
    FcBias,
    MlpProjWeight,
    MlpProjBias,
    Router,
    ExpertFcWeight,
    ExpertFcBias,
    ExpertProjWeight,
    ExpertProjBias,
    LnfWeight,
    LnfBias,
    // The Llama family (Hugging Face's names).
    EmbedTokens,
    AttnNorm,
    QProj,
    KProj,
    VProj,
    QNorm,
    KNorm,
    OProj,
    MlpNorm,
    GateProj,
    UpProj,
    DownProj,
    MoeGate,
    ExpertGate,
    ExpertUp,
    ExpertDown,
    FinalNorm,
    LmHead,
}

impl Role {
    /// A transformer block's own norm (before attention or the MLP; not
    /// the final norm, not q/k norms): what sequence parallelism runs on
    /// each member's rows of the residual stream.
    pub fn is_block_norm(self) -> bool {
        matches!(
            self,
            Role::Ln1Weight
                | Role::Ln1Bias
                | Role::Ln2Weight
                | Role::Ln2Bias
                | Role::AttnNorm
                | Role::MlpNorm
        )
    }
}

/// How a parameter starts (GPT-2's initialisation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Zeros,
    Ones,
    /// N(0, std²).
    Normal {
        std: f32,
    },
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

/// One parameter as a part lists it: role, layer and expert, shape. No
/// name is made until one is asked for ([`Entry::name`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub role: Role,
    pub layer: Option<u32>,
    pub expert: Option<u32>,
    pub shape: Vec<usize>,
}

impl Entry {
    fn new(role: Role, layer: Option<u32>, expert: Option<u32>, shape: Vec<usize>) -> Self {
        Entry {
            role,
            layer,
            expert,
            shape,
        }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Its GPT-2 name (`wte`, `h.3.attn.c_attn.weight`,
    /// `h.1.mlp.experts.2.c_fc.bias`), or its Hugging Face Llama name
    /// (`model.layers.0.self_attn.q_proj.weight`).
    pub fn name(&self) -> String {
        use Role::*;
        let l = self.layer.unwrap_or(0);
        let x = self.expert.unwrap_or(0);
        let h = |s: &str| format!("h.{l}.{s}");
        let e = |s: &str| format!("h.{l}.mlp.experts.{x}.{s}");
        let m = |s: &str| format!("model.layers.{l}.{s}");
        match self.role {
            TokenEmbedding => "wte".into(),
            PositionEmbedding => "wpe".into(),
            Ln1Weight => h("ln_1.weight"),
            Ln1Bias => h("ln_1.bias"),
            QkvWeight => h("attn.c_attn.weight"),
            QkvBias => h("attn.c_attn.bias"),
            AttnProjWeight => h("attn.c_proj.weight"),
            AttnProjBias => h("attn.c_proj.bias"),
            Ln2Weight => h("ln_2.weight"),
            Ln2Bias => h("ln_2.bias"),
            FcWeight => h("mlp.c_fc.weight"),
            FcBias => h("mlp.c_fc.bias"),
            MlpProjWeight => h("mlp.c_proj.weight"),
            MlpProjBias => h("mlp.c_proj.bias"),
            Router => h("mlp.router.weight"),
            ExpertFcWeight => e("c_fc.weight"),
            ExpertFcBias => e("c_fc.bias"),
            ExpertProjWeight => e("c_proj.weight"),
            ExpertProjBias => e("c_proj.bias"),
            LnfWeight => "ln_f.weight".into(),
            LnfBias => "ln_f.bias".into(),
            EmbedTokens => "model.embed_tokens.weight".into(),
            AttnNorm => m("input_layernorm.weight"),
            QProj => m("self_attn.q_proj.weight"),
            KProj => m("self_attn.k_proj.weight"),
            VProj => m("self_attn.v_proj.weight"),
            QNorm => m("self_attn.q_norm.weight"),
            KNorm => m("self_attn.k_norm.weight"),
            OProj => m("self_attn.o_proj.weight"),
            MlpNorm => m("post_attention_layernorm.weight"),
            GateProj => m("mlp.gate_proj.weight"),
            UpProj => m("mlp.up_proj.weight"),
            DownProj => m("mlp.down_proj.weight"),
            MoeGate => m("mlp.gate.weight"),
            ExpertGate => m(&format!("mlp.experts.{x}.gate_proj.weight")),
            ExpertUp => m(&format!("mlp.experts.{x}.up_proj.weight")),
            ExpertDown => m(&format!("mlp.experts.{x}.down_proj.weight")),
            FinalNorm => "model.norm.weight".into(),
            LmHead => "lm_head.weight".into(),
        }
    }

    /// Does weight decay apply (matrices and embeddings, not biases or norms)?
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }

    /// Its split under tensor parallelism.
    pub fn tp_split(&self) -> TpSplit {
        match self.role {
            Role::QkvWeight | Role::QkvBias => TpSplit::Rows { blocks: 3 },
            Role::FcWeight | Role::FcBias => TpSplit::Rows { blocks: 1 },
            Role::AttnProjWeight | Role::MlpProjWeight => TpSplit::Cols,
            // Heads are contiguous rows of q/k/v (kv heads split as query
            // heads do), hidden units rows of gate/up.
            Role::QProj | Role::KProj | Role::VProj | Role::GateProj | Role::UpProj => {
                TpSplit::Rows { blocks: 1 }
            }
            Role::OProj | Role::DownProj => TpSplit::Cols,
            _ => TpSplit::Replicated,
        }
    }

    /// GPT-2's initialisation: N(0, 0.02) weights, residual projections
    /// scaled by 1/√(2·layers), zero biases, unit layernorm gains. The
    /// Llama family's is Hugging Face's: N(0, 0.02) for every matrix and
    /// the embedding, unit norm gains.
    pub fn init(&self, layers: u32) -> Init {
        use Role::*;
        match self.role {
            Ln1Bias | QkvBias | AttnProjBias | Ln2Bias | FcBias | MlpProjBias | ExpertFcBias
            | ExpertProjBias | LnfBias => Init::Zeros,
            Ln1Weight | Ln2Weight | LnfWeight => Init::Ones,
            AttnProjWeight | MlpProjWeight | ExpertProjWeight => Init::Normal {
                std: 0.02 / (2.0 * layers as f32).sqrt(),
            },
            TokenEmbedding | PositionEmbedding | QkvWeight | FcWeight | Router | ExpertFcWeight => {
                Init::Normal { std: 0.02 }
            }
            AttnNorm | QNorm | KNorm | MlpNorm | FinalNorm => Init::Ones,
            EmbedTokens | QProj | KProj | VProj | OProj | GateProj | UpProj | DownProj
            | MoeGate | ExpertGate | ExpertUp | ExpertDown | LmHead => Init::Normal { std: 0.02 },
        }
    }

    /// Is it a linear weight that GPT-2 files store `[in, out]` (Conv1D)?
    pub fn is_conv1d(&self) -> bool {
        matches!(
            self.role,
            Role::QkvWeight
                | Role::AttnProjWeight
                | Role::FcWeight
                | Role::MlpProjWeight
                | Role::ExpertFcWeight
                | Role::ExpertProjWeight
        )
    }
}

/// The parameters of one part, in the part's order (the head lists `wte`
/// too when it is tied: it uses it).
pub fn part_entries(cfg: &ModelConfig, part: Part) -> Vec<Entry> {
    if cfg.family == Family::Llama {
        return llama_part_entries(cfg, part);
    }
    use Role::*;
    let (c, v, t) = (
        cfg.d_model as usize,
        cfg.vocab as usize,
        cfg.seq_len as usize,
    );
    match part {
        Part::Embedding => vec![
            Entry::new(TokenEmbedding, None, None, vec![v, c]),
            Entry::new(PositionEmbedding, None, None, vec![t, c]),
        ],
        Part::Block(l) => {
            let p = |r, shape| Entry::new(r, Some(l), None, shape);
            let mut out = part_entries(cfg, Part::Attention(l));
            out.extend([
                p(Ln2Weight, vec![c]),
                p(Ln2Bias, vec![c]),
                p(FcWeight, vec![4 * c, c]),
                p(FcBias, vec![4 * c]),
                p(MlpProjWeight, vec![c, 4 * c]),
                p(MlpProjBias, vec![c]),
            ]);
            out
        }
        Part::Attention(l) => {
            let p = |r, shape| Entry::new(r, Some(l), None, shape);
            vec![
                p(Ln1Weight, vec![c]),
                p(Ln1Bias, vec![c]),
                p(QkvWeight, vec![3 * c, c]),
                p(QkvBias, vec![3 * c]),
                p(AttnProjWeight, vec![c, c]),
                p(AttnProjBias, vec![c]),
            ]
        }
        Part::Experts(l) => {
            let Some(moe) = &cfg.moe else {
                return Vec::new();
            };
            let (e, hid) = (moe.experts as usize, moe.hidden_width(cfg.d_model) as usize);
            let p = |r, shape| Entry::new(r, Some(l), None, shape);
            let mut out = vec![
                p(Ln2Weight, vec![c]),
                p(Ln2Bias, vec![c]),
                p(Router, vec![e, c]),
            ];
            for x in 0..e as u32 {
                let q = |r, shape| Entry::new(r, Some(l), Some(x), shape);
                out.extend([
                    q(ExpertFcWeight, vec![hid, c]),
                    q(ExpertFcBias, vec![hid]),
                    q(ExpertProjWeight, vec![c, hid]),
                    q(ExpertProjBias, vec![c]),
                ]);
            }
            out
        }
        Part::Head => vec![
            Entry::new(LnfWeight, None, None, vec![c]),
            Entry::new(LnfBias, None, None, vec![c]),
            Entry::new(TokenEmbedding, None, None, vec![v, c]),
        ],
    }
}

/// A Llama-family part's parameters, in Hugging Face's order.
fn llama_part_entries(cfg: &ModelConfig, part: Part) -> Vec<Entry> {
    use Role::*;
    let a = cfg.arch();
    let (c, v) = (cfg.d_model as usize, cfg.vocab as usize);
    let (qw, kvw, hd, hid) = (
        a.q_width() as usize,
        a.kv_width() as usize,
        a.head_dim as usize,
        a.hidden as usize,
    );
    match part {
        Part::Embedding => vec![Entry::new(EmbedTokens, None, None, vec![v, c])],
        Part::Attention(l) => {
            let p = |r, shape| Entry::new(r, Some(l), None, shape);
            let mut out = vec![
                p(AttnNorm, vec![c]),
                p(QProj, vec![qw, c]),
                p(KProj, vec![kvw, c]),
                p(VProj, vec![kvw, c]),
            ];
            if a.qk_norm {
                out.extend([p(QNorm, vec![hd]), p(KNorm, vec![hd])]);
            }
            out.push(p(OProj, vec![c, qw]));
            out
        }
        Part::Block(l) => {
            let p = |r, shape| Entry::new(r, Some(l), None, shape);
            let mut out = llama_part_entries(cfg, Part::Attention(l));
            out.extend([
                p(MlpNorm, vec![c]),
                p(GateProj, vec![hid, c]),
                p(UpProj, vec![hid, c]),
                p(DownProj, vec![c, hid]),
            ]);
            out
        }
        Part::Experts(l) => {
            let Some(moe) = &cfg.moe else {
                return Vec::new();
            };
            let (e, eh) = (moe.experts as usize, moe.hidden_width(cfg.d_model) as usize);
            let p = |r, shape| Entry::new(r, Some(l), None, shape);
            let mut out = vec![p(MlpNorm, vec![c]), p(MoeGate, vec![e, c])];
            for x in 0..e as u32 {
                let q = |r, shape| Entry::new(r, Some(l), Some(x), shape);
                out.extend([
                    q(ExpertGate, vec![eh, c]),
                    q(ExpertUp, vec![eh, c]),
                    q(ExpertDown, vec![c, eh]),
                ]);
            }
            out
        }
        Part::Head => vec![
            Entry::new(FinalNorm, None, None, vec![c]),
            if a.tied {
                Entry::new(EmbedTokens, None, None, vec![v, c])
            } else {
                Entry::new(LmHead, None, None, vec![v, c])
            },
        ],
    }
}

/// The parameters a segment reads (each once, in order).
pub fn segment_entries(cfg: &ModelConfig, seg: &Segment) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    // An entry is one (role, layer, expert): a set, not a scan of `out`
    // (an expert segment of 128 experts has 515 entries).
    let mut seen = std::collections::HashSet::new();
    for p in &seg.parts {
        for e in part_entries(cfg, *p) {
            if seen.insert((e.role, e.layer, e.expert)) {
                out.push(e);
            }
        }
    }
    out
}

/// A linear layer's weight and bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    pub weight: ParamId,
    pub bias: ParamId,
}

impl Linear {
    /// Its weight and (present) bias, as the bias-optional compositions
    /// take a layer.
    pub fn parts(self) -> (ParamId, Option<ParamId>) {
        (self.weight, Some(self.bias))
    }
}

/// A layernorm's gain and bias.
pub type Norm = Linear;

/// An attention half: `x + proj(attention(qkv(ln1(x))))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnIds {
    pub ln1: Norm,
    pub qkv: Linear,
    pub proj: Linear,
}

/// A GELU MLP (a dense block's, or one expert's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpIds {
    pub fc: Linear,
    pub proj: Linear,
}

/// One expert's MLP: GPT-2's GELU MLP with biases, or the Llama family's
/// SwiGLU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertIds {
    Gelu(MlpIds),
    SwiGlu(SwiGluIds),
}

/// An expert half: its norm (a LayerNorm with bias, or an RMSNorm), the
/// router and every expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertsIds {
    pub norm: ParamId,
    pub norm_bias: Option<ParamId>,
    pub router: ParamId,
    pub experts: Vec<ExpertIds>,
}

/// A Llama-family attention half: `x + o(attention(rope(q), rope(k),
/// v))` of `norm(x)`, with Qwen3's per-head norms of q and k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlamaAttnIds {
    pub norm: ParamId,
    pub q: ParamId,
    pub k: ParamId,
    pub v: ParamId,
    pub q_norm: Option<ParamId>,
    pub k_norm: Option<ParamId>,
    pub o: ParamId,
}

/// A SwiGLU MLP: `down(silu(gate(x)) · up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwiGluIds {
    pub gate: ParamId,
    pub up: ParamId,
    pub down: ParamId,
}

/// One Llama-family layer's parameters (the MLP's norm and MLP absent on
/// expert layers, which have `experts`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlamaLayerIds {
    pub attn: LlamaAttnIds,
    pub mlp_norm: Option<ParamId>,
    pub mlp: Option<SwiGluIds>,
    pub experts: Option<ExpertsIds>,
}

/// The parameters only one family has.
#[derive(Clone, Debug)]
pub enum FamilyIds {
    Gpt2 {
        wpe: ParamId,
        lnf: Norm,
        layers: Vec<LayerIds>,
    },
    Llama {
        norm: ParamId,
        /// `lm_head`, or the token embedding when tied.
        lm_head: ParamId,
        layers: Vec<LlamaLayerIds>,
    },
}

/// One layer's parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerIds {
    pub attn: AttnIds,
    /// ln2 of a dense block (the expert half has its own in `experts`).
    pub ln2: Option<Norm>,
    /// The dense MLP (absent on MoE models).
    pub mlp: Option<MlpIds>,
    pub experts: Option<ExpertsIds>,
}

/// Every parameter of a model, once, by id.
#[derive(Clone, Debug)]
pub struct ParamTable {
    entries: Vec<Entry>,
    names: Vec<String>,
    by_name: HashMap<String, ParamId>,
    /// Ids in the model's order (embedding, layers, head).
    model_order: Vec<ParamId>,
    /// The token embedding (`wte`, `model.embed_tokens.weight`).
    pub wte: ParamId,
    pub family: FamilyIds,
    /// The norms' epsilon (RMSNorm's; GPT-2's LayerNorm keeps 1e-5).
    pub norm_eps: f32,
}

impl ParamTable {
    /// The table of `cfg`'s parameters.
    pub fn new(cfg: &ModelConfig) -> Self {
        let mut all: Vec<(String, Entry)> = Vec::new();
        let mut seen: HashMap<String, ()> = HashMap::new();
        for seg in cfg.segments() {
            for e in segment_entries(cfg, &seg) {
                let name = e.name();
                if seen.insert(name.clone(), ()).is_none() {
                    all.push((name, e));
                }
            }
        }
        let in_model_order: Vec<String> = all.iter().map(|(n, _)| n.clone()).collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        let by_name: HashMap<String, ParamId> = all
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.clone(), ParamId(i as u32)))
            .collect();
        let (names, entries): (Vec<String>, Vec<Entry>) = all.into_iter().unzip();
        let id = |role: Role, layer: Option<u32>, expert: Option<u32>| {
            let name = Entry::new(role, layer, expert, Vec::new()).name();
            by_name.get(&name).copied()
        };
        let pair = |w: Role, b: Role, l: Option<u32>| -> Option<Linear> {
            Some(Linear {
                weight: id(w, l, None)?,
                bias: id(b, l, None)?,
            })
        };
        use Role::*;
        let model_order = in_model_order.iter().map(|n| by_name[n]).collect();
        if cfg.family == Family::Llama {
            let must = |r: Role, l: Option<u32>| id(r, l, None).expect("the part lists it");
            let layers = (0..cfg.layers)
                .map(|l| {
                    let s = Some(l);
                    let mlp = match (
                        id(GateProj, s, None),
                        id(UpProj, s, None),
                        id(DownProj, s, None),
                    ) {
                        (Some(gate), Some(up), Some(down)) => Some(SwiGluIds { gate, up, down }),
                        _ => None,
                    };
                    let experts = cfg.moe.as_ref().map(|moe| ExpertsIds {
                        norm: must(MlpNorm, s),
                        norm_bias: None,
                        router: must(MoeGate, s),
                        experts: (0..moe.experts)
                            .map(|x| {
                                let e = |r| id(r, s, Some(x)).expect("every expert is listed");
                                ExpertIds::SwiGlu(SwiGluIds {
                                    gate: e(ExpertGate),
                                    up: e(ExpertUp),
                                    down: e(ExpertDown),
                                })
                            })
                            .collect(),
                    });
                    LlamaLayerIds {
                        experts,
                        attn: LlamaAttnIds {
                            norm: must(AttnNorm, s),
                            q: must(QProj, s),
                            k: must(KProj, s),
                            v: must(VProj, s),
                            q_norm: id(QNorm, s, None),
                            k_norm: id(KNorm, s, None),
                            o: must(OProj, s),
                        },
                        mlp_norm: mlp.and(id(MlpNorm, s, None)),
                        mlp,
                    }
                })
                .collect();
            let wte = must(EmbedTokens, None);
            return ParamTable {
                model_order,
                wte,
                norm_eps: cfg.arch().norm_eps,
                family: FamilyIds::Llama {
                    norm: must(FinalNorm, None),
                    lm_head: id(LmHead, None, None).unwrap_or(wte),
                    layers,
                },
                entries,
                names,
                by_name,
            };
        }
        let layers = (0..cfg.layers)
            .map(|l| {
                let s = Some(l);
                let attn = AttnIds {
                    ln1: pair(Ln1Weight, Ln1Bias, s).expect("every layer has attention"),
                    qkv: pair(QkvWeight, QkvBias, s).expect("every layer has attention"),
                    proj: pair(AttnProjWeight, AttnProjBias, s).expect("every layer has attention"),
                };
                let ln2 = pair(Ln2Weight, Ln2Bias, s);
                let mlp = match (
                    pair(FcWeight, FcBias, s),
                    pair(MlpProjWeight, MlpProjBias, s),
                ) {
                    (Some(fc), Some(proj)) => Some(MlpIds { fc, proj }),
                    _ => None,
                };
                let experts = cfg.moe.as_ref().map(|moe| ExpertsIds {
                    norm: ln2.expect("an expert half has ln2").weight,
                    norm_bias: ln2.map(|n| n.bias),
                    router: id(Router, s, None).expect("an expert half has a router"),
                    experts: (0..moe.experts)
                        .map(|x| {
                            let e = |w, b| Linear {
                                weight: id(w, s, Some(x)).expect("every expert is listed"),
                                bias: id(b, s, Some(x)).expect("every expert is listed"),
                            };
                            ExpertIds::Gelu(MlpIds {
                                fc: e(ExpertFcWeight, ExpertFcBias),
                                proj: e(ExpertProjWeight, ExpertProjBias),
                            })
                        })
                        .collect(),
                });
                LayerIds {
                    attn,
                    ln2: if mlp.is_some() { ln2 } else { None },
                    mlp,
                    experts,
                }
            })
            .collect();
        ParamTable {
            model_order,
            norm_eps: cfg.arch().norm_eps,
            wte: id(TokenEmbedding, None, None).expect("the embedding is listed"),
            family: FamilyIds::Gpt2 {
                wpe: id(PositionEmbedding, None, None).expect("the embedding is listed"),
                lnf: pair(LnfWeight, LnfBias, None).expect("the head is listed"),
                layers,
            },
            entries,
            names,
            by_name,
        }
    }

    /// How many parameters the model has (ids are `0..len`).
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Every id, in table (name) order.
    pub fn ids(&self) -> impl Iterator<Item = ParamId> + '_ {
        (0..self.entries.len() as u32).map(ParamId)
    }
    /// Every id in the model's order (embedding, layers, head): the order
    /// checkpoint files list them in.
    pub fn in_model_order(&self) -> &[ParamId] {
        &self.model_order
    }
    /// What parameter `id` is.
    pub fn entry(&self, id: ParamId) -> &Entry {
        &self.entries[id.index()]
    }
    /// Its GPT-2 name (checkpoints, dumps, messages).
    pub fn name(&self, id: ParamId) -> &str {
        &self.names[id.index()]
    }
    /// The parameter a GPT-2 name names, if the model has it.
    pub fn by_name(&self, name: &str) -> Option<ParamId> {
        self.by_name.get(name).copied()
    }
    /// Layer `l`'s parameters in a GPT-2 table.
    ///
    /// # Panics
    /// On a Llama table (the compositions dispatch on the family first).
    pub fn layer(&self, l: u32) -> &LayerIds {
        match &self.family {
            FamilyIds::Gpt2 { layers, .. } => &layers[l as usize],
            FamilyIds::Llama { .. } => panic!("a GPT-2 layer asked of a Llama table"),
        }
    }
    /// Layer `l`'s expert half, in either family.
    pub fn experts(&self, l: u32) -> Option<&ExpertsIds> {
        match &self.family {
            FamilyIds::Gpt2 { layers, .. } => layers.get(l as usize)?.experts.as_ref(),
            FamilyIds::Llama { layers, .. } => layers.get(l as usize)?.experts.as_ref(),
        }
    }
    /// GPT-2's position embedding and final layernorm.
    pub fn gpt2_ends(&self) -> Option<(ParamId, Norm)> {
        match &self.family {
            FamilyIds::Gpt2 { wpe, lnf, .. } => Some((*wpe, *lnf)),
            FamilyIds::Llama { .. } => None,
        }
    }
    /// Does `id` belong to one expert (and which)?
    pub fn expert_of(&self, id: ParamId) -> Option<u32> {
        self.entry(id).expert
    }

    /// The parameters a part reads, in the part's order.
    pub fn part(&self, cfg: &ModelConfig, part: Part) -> Vec<ParamId> {
        part_entries(cfg, part)
            .iter()
            .map(|e| self.by_name[&e.name()])
            .collect()
    }

    /// The parameters a segment reads (each once, in order).
    pub fn segment(&self, cfg: &ModelConfig, seg: &Segment) -> Vec<ParamId> {
        let mut out: Vec<ParamId> = Vec::new();
        for p in &seg.parts {
            for id in self.part(cfg, *p) {
                if !out.contains(&id) {
                    out.push(id);
                }
            }
        }
        out
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MoeConfig;

    #[test]
    fn ids_follow_the_names_and_every_layer_finds_its_parameters() {
        let cfg = ModelConfig::tiny();
        let t = ParamTable::new(&cfg);
        // 2 embeddings, 12 per block, ln_f: 2 + 8 × 12 + 2.
        assert_eq!(t.len(), 100);
        let names: Vec<&str> = t.ids().map(|i| t.name(i)).collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted, "ids are numbered in name order");
        assert_eq!(t.name(t.wte), "wte");
        assert_eq!(t.name(t.layer(3).attn.qkv.weight), "h.3.attn.c_attn.weight");
        assert_eq!(
            t.name(t.layer(7).mlp.unwrap().proj.bias),
            "h.7.mlp.c_proj.bias"
        );
        assert_eq!(
            t.by_name("h.0.ln_2.weight"),
            t.layer(0).ln2.map(|n| n.weight)
        );
        assert_eq!(t.by_name("h.99.ln_2.weight"), None);
        assert!(t.layer(0).experts.is_none());
    }

    #[test]
    fn expert_parameters_belong_to_their_expert_and_split_as_megatron_does() {
        let mut cfg = ModelConfig::tiny();
        cfg.moe = Some(MoeConfig::new(4, 2));
        let t = ParamTable::new(&cfg);
        let ex = t.layer(2).experts.as_ref().unwrap();
        let ExpertIds::Gelu(e3) = ex.experts[3] else {
            panic!("GPT-2's experts are GELU MLPs")
        };
        let ExpertIds::Gelu(e0) = ex.experts[0] else {
            panic!("GPT-2's experts are GELU MLPs")
        };
        assert_eq!(t.name(e3.fc.bias), "h.2.mlp.experts.3.c_fc.bias");
        assert_eq!(t.expert_of(e3.fc.bias), Some(3));
        assert_eq!(t.expert_of(ex.router), None);
        assert!(t.layer(2).mlp.is_none() && t.layer(2).ln2.is_none());
        let split = |id| t.entry(id).tp_split();
        assert_eq!(
            split(t.layer(0).attn.qkv.weight),
            TpSplit::Rows { blocks: 3 }
        );
        assert_eq!(split(t.layer(0).attn.proj.weight), TpSplit::Cols);
        assert_eq!(split(t.layer(0).attn.proj.bias), TpSplit::Replicated);
        assert_eq!(split(e0.fc.weight), TpSplit::Replicated);
        assert!(t.entry(ex.router).decays() && !t.entry(ex.norm).decays());
    }
}
