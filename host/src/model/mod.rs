//! Model: the first stage of the flow. A decoder of the GPT-2 or the Llama
//! family ([`Family`]: Llama 3, Qwen3) described by a [`ModelConfig`] (preset, TOML file or Rust), cut into annotated
//! [`Segment`]s, each carrying cost hints. A leaf of the crate: it depends on
//! nothing else here; `dag/`'s builder turns a config into the initial global
//! training DAG.
//!
//! Decisions recorded here (see also `docs/internals/model.md`):
//! - `batch_size` is the *global* batch in sequences. The micro-batch size a
//!   device runs is `batch_size / (DP degree × microbatches)`; the compiler
//!   checks that it divides.
//! - Layers are grouped into `PP` regions (`layers_per_region`, default 1, or an
//!   explicit `regions` list of layer counts). The embedding joins the first
//!   region; final norm, tied LM head and loss join the last.
//! - A MoE layer is two segments: the attention half and the expert half
//!   (ln2, router, experts, combine), which is tagged `EP` with the index of
//!   the MoE block. The router sits with the experts so that the activation
//!   between segments stays one `tokens × d_model` tensor.

pub mod cost;
pub mod params;
mod precision;

use serde::{Deserialize, Serialize};
use std::path::Path;

pub use cost::{expert_phases, part_cost, ExpertPhaseCost, PartCost};
pub use precision::{Dtype, Precision, StateBytes, F32_BYTES, PRECISIONS};

/// Errors of the model stage: a config that cannot describe a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown model `{name}`: built-in presets are {known:?}, or give a path to a .toml model file")]
    UnknownPreset {
        name: String,
        known: Vec<&'static str>,
    },
    #[error("cannot read model file {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("model file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("model `{name}`: {message}")]
    Invalid { name: String, message: String },
}

/// Mixture-of-experts MLP: every layer's MLP is replaced by a router and
/// `experts` GELU MLPs of which `top_k` run per token (see
/// `runtime/model/moe.rs` for the exact arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    pub experts: u32,
    pub top_k: u32,
    /// Width of each expert's hidden layer (default 4 × d_model, GPT-2's MLP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden: Option<u32>,
    /// Tokens an expert takes per routing group (the tokens one device
    /// routes in one forward): `ceil(capacity_factor × tokens × top_k /
    /// experts)`; assignments beyond it are dropped (counted and reported).
    /// Absent: dropless, as Megatron's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
    /// Weight of the sequence-wise load-balancing loss (default 0.01).
    #[serde(default = "default_aux_coef")]
    pub aux_loss_coef: f64,
}

fn default_aux_coef() -> f64 {
    0.01
}

impl MoeConfig {
    /// `experts` experts, `top_k` per token, defaults otherwise.
    pub fn new(experts: u32, top_k: u32) -> Self {
        MoeConfig {
            experts,
            top_k,
            hidden: None,
            capacity_factor: None,
            aux_loss_coef: default_aux_coef(),
        }
    }

    /// Each expert's hidden width.
    pub fn hidden_width(&self, d_model: u32) -> u32 {
        self.hidden.unwrap_or(d_model.saturating_mul(4))
    }
}

/// The architecture a config describes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// GPT-2: learned positions, LayerNorm with biases, GELU MLP of
    /// 4·d_model, biases everywhere, tied head.
    #[default]
    Gpt2,
    /// Llama 3 / Qwen3: RMSNorm, rotary positions, SwiGLU MLP of
    /// `intermediate`, grouped-query attention (`kv_heads`), no biases,
    /// a head of its own unless `tie_embeddings`; Qwen3's per-head q/k
    /// RMSNorm with `qk_norm`.
    Llama,
}

impl Family {
    pub fn is_gpt2(&self) -> bool {
        *self == Family::Gpt2
    }
    pub fn name(&self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
        }
    }
}

/// A config's architecture with every default resolved: what the
/// parameter table, the cost hints and the kernels read.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arch {
    pub family: Family,
    /// Query heads and key/value heads (equal without grouped-query attention).
    pub heads: u32,
    pub kv_heads: u32,
    /// Channels per head (`d_model / heads` unless given).
    pub head_dim: u32,
    /// Hidden width of a dense MLP: 4·d_model (GPT-2) or `intermediate`.
    pub hidden: u32,
    /// Rotary base (Llama).
    pub rope_theta: f64,
    /// Per-head RMSNorm of queries and keys (Qwen3).
    pub qk_norm: bool,
    /// The head reads the token embedding (GPT-2 always).
    pub tied: bool,
    /// The norms' epsilon.
    pub norm_eps: f32,
}

impl Arch {
    /// Width of the queries (and of attention's output): heads × head_dim.
    pub fn q_width(&self) -> u32 {
        self.heads * self.head_dim
    }
    /// Width of the keys and of the values: kv_heads × head_dim.
    pub fn kv_width(&self) -> u32 {
        self.kv_heads * self.head_dim
    }
}

/// A decoder (GPT-2 or Llama family) and the global batch it trains on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    #[serde(default = "default_name")]
    pub name: String,
    pub layers: u32,
    pub d_model: u32,
    pub heads: u32,
    pub seq_len: u32,
    pub vocab: u32,
    /// Global batch in sequences (all data-parallel replicas and microbatches together).
    pub batch_size: u32,
    /// Layers per `PP` region when `regions` is not given.
    #[serde(default = "one")]
    pub layers_per_region: u32,
    /// Explicit region sizes in layers; must sum to `layers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regions: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
    /// `gpt2` (default) or `llama`; the fields below are the Llama
    /// family's (Hugging Face's `LlamaConfig` / `Qwen3Config` names).
    #[serde(default, skip_serializing_if = "Family::is_gpt2")]
    pub family: Family,
    /// Key/value heads of grouped-query attention (default `heads`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<u32>,
    /// Channels per head (default `d_model / heads`; Qwen3 sets 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<u32>,
    /// SwiGLU hidden width (required for `llama`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intermediate: Option<u32>,
    /// Rotary base (default 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// The head reuses the token embedding (default false for `llama`;
    /// GPT-2's is always tied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_embeddings: Option<bool>,
    /// Qwen3's per-head RMSNorm of queries and keys.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
    /// RMSNorm's epsilon (default 1e-5; Qwen3 uses 1e-6). GPT-2's
    /// LayerNorm always uses 1e-5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// Which attention kernel trains it: `auto` (default), `probs` or
    /// `flash` (see [`Attention`]).
    #[serde(default, skip_serializing_if = "Attention::is_auto")]
    pub attention: Attention,
    /// The run's precision policy: a run setting (`--precision`, the run
    /// config's `[precision]` table), not a model file's, carried here
    /// because every byte figure of the flow follows it.
    #[serde(skip)]
    pub precision: Precision,
}

/// The attention kernel: the one that keeps each head's T×T probabilities
/// for the backward (`probs`), or the memory-efficient one that keeps a
/// log-sum-exp a row and recomputes them (`flash`, FlashAttention's
/// algorithm: O(T) memory a head, a fifth more FLOPs in the backward).
/// `auto` takes `probs` up to [`Attention::AUTO_FLASH_ABOVE`] tokens (on the
/// CPU it is the faster: flash runs at 0.72–0.89 of its speed there) and
/// `flash` beyond, where the probabilities outgrow everything else a
/// layer keeps (Llama-3-8B at 8192: 4 GiB a layer and sequence in bf16).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Attention {
    #[default]
    Auto,
    Probs,
    Flash,
}

impl Attention {
    /// Sequences longer than this train with `flash` under `auto`.
    pub const AUTO_FLASH_ABOVE: u32 = 1024;
    pub fn is_auto(&self) -> bool {
        *self == Attention::Auto
    }
}

/// What a TOML file leaves out: the serde defaults (`custom`, one layer
/// per region, GPT-2), with every size 0 — a struct literal completes
/// itself with `..Default::default()` and must give the sizes.
impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: default_name(),
            layers: 0,
            d_model: 0,
            heads: 0,
            seq_len: 0,
            vocab: 0,
            batch_size: 0,
            layers_per_region: 1,
            regions: None,
            moe: None,
            family: Family::Gpt2,
            kv_heads: None,
            head_dim: None,
            intermediate: None,
            rope_theta: None,
            tie_embeddings: None,
            qk_norm: false,
            norm_eps: None,
            attention: Attention::Auto,
            precision: Precision::FP32,
        }
    }
}

fn default_name() -> String {
    "custom".into()
}
fn one() -> u32 {
    1
}

/// Names of the built-in presets.
pub const PRESETS: [&str; 3] = ["tiny", "gpt2-small", "llama-tiny"];

/// The most layers a model may have (the largest published, Llama 3.1
/// 405B, has 126).
pub const MAX_LAYERS: u32 = 1 << 14;

impl ModelConfig {
    /// `tiny`: trains in seconds on a CPU. 8 layers, each its own `PP` region, so
    /// pipelines of 2, 4 or 8 stages fit; global batch 32 so DP × microbatches up
    /// to 32 divide it. Byte-level vocabulary.
    pub fn tiny() -> Self {
        ModelConfig {
            name: "tiny".into(),
            layers: 8,
            d_model: 64,
            heads: 4,
            seq_len: 64,
            vocab: 256,
            batch_size: 32,
            layers_per_region: 1,
            regions: None,
            moe: None,
            ..Default::default()
        }
    }

    /// `bench-128`: 128 one-layer regions of a narrow GPT, the model the
    /// benchmarks plan at PP=16 × 256 microbatches (planning only: never
    /// trained).
    pub fn bench_128() -> Self {
        ModelConfig {
            name: "bench-128".into(),
            layers: 128,
            d_model: 256,
            heads: 8,
            seq_len: 128,
            vocab: 1024,
            batch_size: 2048,
            layers_per_region: 1,
            regions: None,
            moe: None,
            ..Default::default()
        }
    }

    /// `gpt2-small`: the 124M GPT-2 configuration.
    pub fn gpt2_small() -> Self {
        ModelConfig {
            name: "gpt2-small".into(),
            layers: 12,
            d_model: 768,
            heads: 12,
            seq_len: 1024,
            vocab: 50257,
            batch_size: 32,
            layers_per_region: 1,
            regions: None,
            moe: None,
            ..Default::default()
        }
    }

    /// `llama-tiny`: `tiny`'s shape in the Llama family, with what makes it
    /// Llama and Qwen3 all in use: 4 query heads over 2 key/value heads,
    /// SwiGLU of width 176, rotary positions, q/k norms, an untied head.
    pub fn llama_tiny() -> Self {
        ModelConfig {
            name: "llama-tiny".into(),
            family: Family::Llama,
            kv_heads: Some(2),
            intermediate: Some(176),
            rope_theta: Some(10_000.0),
            tie_embeddings: Some(false),
            qk_norm: true,
            norm_eps: Some(1e-6),
            ..Self::tiny()
        }
    }

    /// The architecture with its defaults resolved (call after
    /// [`ModelConfig::validate`]: the sizes divide).
    pub fn arch(&self) -> Arch {
        let llama = self.family == Family::Llama;
        let head_dim = self
            .head_dim
            .unwrap_or(self.d_model / self.heads.max(1))
            .max(1);
        Arch {
            family: self.family,
            heads: self.heads,
            kv_heads: if llama {
                self.kv_heads.unwrap_or(self.heads)
            } else {
                self.heads
            },
            head_dim: if llama {
                head_dim
            } else {
                self.d_model / self.heads.max(1)
            },
            hidden: if llama {
                self.intermediate.unwrap_or(0)
            } else {
                self.d_model.saturating_mul(4)
            },
            rope_theta: self.rope_theta.unwrap_or(10_000.0),
            qk_norm: llama && self.qk_norm,
            tied: !llama || self.tie_embeddings.unwrap_or(false),
            norm_eps: if llama {
                self.norm_eps.unwrap_or(1e-5) as f32
            } else {
                1e-5
            },
        }
    }

    /// A preset by name.
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "gpt2-small" => Ok(Self::gpt2_small()),
            "llama-tiny" => Ok(Self::llama_tiny()),
            _ => Err(ModelError::UnknownPreset {
                name: name.into(),
                known: PRESETS.to_vec(),
            }),
        }
    }

    /// A preset name, or else a path to a TOML model file.
    pub fn from_name_or_file(spec: &str) -> Result<Self, ModelError> {
        if PRESETS.contains(&spec) {
            return Self::preset(spec);
        }
        let path = Path::new(spec);
        if path.extension().is_some_and(|e| e == "toml") || path.exists() {
            return Self::from_toml_file(path);
        }
        Self::preset(spec)
    }

    /// Parse a model from TOML text; `origin` names the source in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ModelError> {
        let cfg: ModelConfig = toml::from_str(text).map_err(|e| ModelError::Parse {
            path: origin.into(),
            message: e.to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn from_toml_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let mut cfg = Self::from_toml_str(&text, &path.display().to_string())?;
        if cfg.name == "custom" {
            if let Some(stem) = path.file_stem() {
                cfg.name = stem.to_string_lossy().into_owned();
            }
        }
        Ok(cfg)
    }

    fn invalid(&self, message: impl Into<String>) -> ModelError {
        ModelError::Invalid {
            name: self.name.clone(),
            message: message.into(),
        }
    }

    /// Check that the numbers describe a model that can be built: every
    /// count at least 1 and at most its cap, products that fit.
    /// Does the memory-efficient attention kernel train this model (see
    /// [`Attention`])?
    pub fn flash_attention(&self) -> bool {
        match self.attention {
            Attention::Flash => true,
            Attention::Probs => false,
            Attention::Auto => self.seq_len > Attention::AUTO_FLASH_ABOVE,
        }
    }

    pub fn validate(&self) -> Result<(), ModelError> {
        self.precision.check().map_err(|m| self.invalid(m))?;
        for (field, v) in [
            ("layers", self.layers),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("seq_len", self.seq_len),
            ("vocab", self.vocab),
            ("batch_size", self.batch_size),
            ("layers_per_region", self.layers_per_region),
        ] {
            if v == 0 {
                return Err(self.invalid(format!("{field} must be at least 1, got 0")));
            }
        }
        // Counts are bounded before anything is sized from them (a model
        // of 4·10⁹ layers would be refused, not built layer by layer).
        for (field, v, max) in [
            ("layers", self.layers, MAX_LAYERS),
            ("heads", self.heads, 1 << 16),
            ("d_model", self.d_model, 1 << 24),
            ("seq_len", self.seq_len, 1 << 24),
            ("vocab", self.vocab, 1 << 24),
            ("batch_size", self.batch_size, 1 << 24),
        ] {
            if v > max {
                return Err(self.invalid(format!("{field} must be at most {max}, got {v}")));
            }
        }
        self.validate_family()?;
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.heads) {
            return Err(self.invalid(format!(
                "d_model must be divisible by heads: d_model {} heads {}",
                self.d_model, self.heads
            )));
        }
        // Sizes come from TOML: bound them so every byte and FLOP count the
        // host derives (products of these) fits a u64 with room to spare.
        let limit = 1u64 << 60;
        let (b, t, c, v, l) = (
            self.batch_size as u64,
            self.seq_len as u64,
            self.d_model as u64,
            self.vocab as u64,
            self.layers as u64,
        );
        let experts = self.moe.as_ref().map_or(1, |m| m.experts.max(1) as u64);
        let arch = self.arch();
        let hidden = self
            .moe
            .as_ref()
            .map_or(arch.hidden as u64, |m| m.hidden_width(self.d_model) as u64);
        // Attention's widths may pass d_model (Qwen3: 16 heads of 128 over 1024).
        let c = c.max(arch.q_width() as u64);
        for (what, product) in [
            (
                "batch_size × seq_len × vocab",
                b.checked_mul(t).and_then(|x| x.checked_mul(v)),
            ),
            (
                "batch_size × seq_len × 4·d_model",
                b.checked_mul(t)
                    .and_then(|x| x.checked_mul(c.saturating_mul(4))),
            ),
            (
                "layers × experts × 12·d_model²",
                l.checked_mul(experts)
                    .and_then(|x| x.checked_mul(c.checked_mul(c)?.checked_mul(12)?)),
            ),
            (
                "layers × experts × 3·d_model × hidden",
                l.checked_mul(experts)
                    .and_then(|x| x.checked_mul(c.checked_mul(hidden)?.checked_mul(3)?)),
            ),
            (
                "batch_size × seq_len × top_k × hidden",
                b.checked_mul(t).and_then(|x| {
                    x.checked_mul(self.moe.as_ref().map_or(1, |m| m.top_k as u64))?
                        .checked_mul(hidden)
                }),
            ),
            ("vocab × d_model", v.checked_mul(c)),
            (
                "batch_size × heads × seq_len²",
                b.checked_mul(self.heads as u64)
                    .and_then(|x| x.checked_mul(t.checked_mul(t)?)),
            ),
        ] {
            if product.is_none_or(|p| p > limit) {
                return Err(self.invalid(format!(
                    "the model is too large to describe: {what} exceeds 2^60 (batch_size {b}, seq_len {t}, d_model {c}, vocab {v}, layers {l})"
                )));
            }
        }
        if let Some(regions) = &self.regions {
            let sum = regions.iter().try_fold(0u32, |a, r| a.checked_add(*r));
            if regions.contains(&0) || sum != Some(self.layers) {
                return Err(self.invalid(format!(
                    "regions {regions:?} must be non-zero layer counts summing to layers = {}",
                    self.layers
                )));
            }
        } else if !self.layers.is_multiple_of(self.layers_per_region) {
            return Err(self.invalid(format!(
                "layers ({}) must be divisible by layers_per_region ({})",
                self.layers, self.layers_per_region
            )));
        }
        if let Some(moe) = &self.moe {
            if moe.experts == 0 || moe.top_k == 0 || moe.top_k > moe.experts {
                return Err(self.invalid(format!(
                    "moe needs 1 ≤ top_k ≤ experts: experts {} top_k {}",
                    moe.experts, moe.top_k
                )));
            }
            if moe.experts > 4096 {
                return Err(self.invalid(format!(
                    "moe.experts must be at most 4096, got {}",
                    moe.experts
                )));
            }
            if moe.hidden == Some(0) {
                return Err(self.invalid("moe.hidden must be at least 1, got 0"));
            }
            if let Some(cf) = moe.capacity_factor {
                if !(cf.is_finite() && cf > 0.0 && cf <= 1e6) {
                    return Err(self.invalid(format!(
                        "moe.capacity_factor must be a number in (0, 1e6], got {cf}"
                    )));
                }
            }
            if !(moe.aux_loss_coef.is_finite() && (0.0..=1e3).contains(&moe.aux_loss_coef)) {
                return Err(self.invalid(format!(
                    "moe.aux_loss_coef must be a number in [0, 1000], got {}",
                    moe.aux_loss_coef
                )));
            }
        }
        Ok(())
    }

    /// The Llama family's fields: present only there, and sizes that fit.
    fn validate_family(&self) -> Result<(), ModelError> {
        let llama_only = [
            ("kv_heads", self.kv_heads.is_some()),
            ("head_dim", self.head_dim.is_some()),
            ("intermediate", self.intermediate.is_some()),
            ("rope_theta", self.rope_theta.is_some()),
            ("tie_embeddings", self.tie_embeddings.is_some()),
            ("qk_norm", self.qk_norm),
            ("norm_eps", self.norm_eps.is_some()),
        ];
        if self.family == Family::Gpt2 {
            if let Some((field, _)) = llama_only.iter().find(|(_, set)| *set) {
                return Err(self.invalid(format!(
                    "`{field}` belongs to the Llama family: add family = \"llama\" (GPT-2 has LayerNorm, learned positions, a 4·d_model GELU MLP and a tied head)"
                )));
            }
            return Ok(());
        }
        let intermediate = self.intermediate.ok_or_else(|| {
            self.invalid("family = \"llama\" needs `intermediate`, the SwiGLU MLP's hidden width (Llama 3 8B: 14336)")
        })?;
        if intermediate == 0 || intermediate > 1 << 24 {
            return Err(self.invalid(format!(
                "intermediate must be in 1..=16777216, got {intermediate}"
            )));
        }
        let kv = self.kv_heads.unwrap_or(self.heads);
        if kv == 0 || self.heads == 0 || !self.heads.is_multiple_of(kv) {
            return Err(self.invalid(format!(
                "kv_heads must divide heads (each key/value head serves heads / kv_heads query heads): heads {} kv_heads {kv}",
                self.heads
            )));
        }
        if let Some(hd) = self.head_dim {
            if hd == 0 || hd > 1 << 16 {
                return Err(self.invalid(format!("head_dim must be in 1..=65536, got {hd}")));
            }
        }
        let hd = self.head_dim.unwrap_or(self.d_model / self.heads.max(1));
        if !hd.is_multiple_of(2) {
            return Err(self.invalid(format!(
                "rotary embeddings rotate pairs of channels: head_dim must be even, got {hd}"
            )));
        }
        if let Some(theta) = self.rope_theta {
            if !(theta.is_finite() && theta > 1.0 && theta <= 1e12) {
                return Err(self.invalid(format!(
                    "rope_theta must be a number in (1, 1e12], got {theta}"
                )));
            }
        }
        if let Some(eps) = self.norm_eps {
            if !(eps.is_finite() && eps > 0.0 && eps <= 1.0) {
                return Err(self.invalid(format!("norm_eps must be a number in (0, 1], got {eps}")));
            }
        }
        Ok(())
    }

    /// Can tensor parallelism over `n` devices split this model (heads,
    /// key/value heads and the MLP's hidden units each divide by `n`)? The
    /// message names the numbers when not.
    pub fn tensor_split(&self, n: u32) -> Result<(), String> {
        let a = self.arch();
        let n = n.max(1);
        match a.family {
            Family::Gpt2 if !a.heads.is_multiple_of(n) || !a.hidden.is_multiple_of(n) => Err(format!(
                "tensor parallelism over {n} devices needs the heads ({}) and the MLP width 4·d_model ({}) to divide by {n}",
                a.heads, a.hidden
            )),
            Family::Llama
                if !a.heads.is_multiple_of(n)
                    || !a.kv_heads.is_multiple_of(n)
                    || !a.hidden.is_multiple_of(n) =>
            {
                Err(format!(
                    "tensor parallelism over {n} devices splits query heads ({}), key/value heads (kv_heads {}) and the MLP's hidden units (intermediate {}): each must divide by {n}",
                    a.heads, a.kv_heads, a.hidden
                ))
            }
            _ => Ok(()),
        }
    }

    /// Layer counts of the `PP` regions, in order.
    pub fn region_sizes(&self) -> Vec<u32> {
        match &self.regions {
            Some(r) => r.clone(),
            None => vec![self.layers_per_region; (self.layers / self.layers_per_region) as usize],
        }
    }

    /// Total parameter count (the tied embedding/head counted once).
    pub fn param_count(&self) -> u64 {
        self.segments().iter().map(|s| s.param_elems).sum()
    }

    /// Cut the model into segments: the units that get one `F` and one `B` node.
    pub fn segments(&self) -> Vec<Segment> {
        let sizes = self.region_sizes();
        let n_regions = sizes.len() as u32;
        let mut segments: Vec<Segment> = Vec::new();
        let mut layer = 0u32;
        let mut expert_block = 0u32;
        for (region, &size) in sizes.iter().enumerate() {
            let region = region as u32;
            let mut parts: Vec<Part> = Vec::new();
            if region == 0 {
                parts.push(Part::Embedding);
            }
            for _ in 0..size {
                if self.moe.is_some() {
                    parts.push(Part::Attention(layer));
                    // The expert half is its own segment, tagged EP.
                    segments.push(Segment::new(self, region, None, std::mem::take(&mut parts)));
                    segments.push(Segment::new(
                        self,
                        region,
                        Some(expert_block),
                        vec![Part::Experts(layer)],
                    ));
                    expert_block += 1;
                } else {
                    parts.push(Part::Block(layer));
                }
                layer += 1;
            }
            if region == n_regions - 1 {
                parts.push(Part::Head);
            }
            if !parts.is_empty() {
                segments.push(Segment::new(self, region, None, parts));
            }
        }
        // Drop empty dense segments (a MoE region whose parts all went to experts)
        // and number them.
        segments.retain(|s| !s.parts.is_empty());
        for (i, s) in segments.iter_mut().enumerate() {
            s.index = i as u32;
        }
        segments
    }
}

/// One piece of the model a segment runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Part {
    /// Token embedding (owns a tied head's weight), + GPT-2's positions.
    Embedding,
    /// A dense pre-LN transformer block.
    Block(u32),
    /// Attention half of a MoE block (ln1, attention, residual).
    Attention(u32),
    /// Expert half of a MoE block (ln2, router, top-k, experts, weighted
    /// combine, residual, load-balancing loss).
    Experts(u32),
    /// Final norm, LM head (tied, or the Llama family's own) and
    /// cross-entropy loss.
    Head,
}

/// A contiguous piece of the model with its annotations and cost hints for the
/// whole global batch (the DAG scales activations by microbatches and DP).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    pub index: u32,
    /// `PP` region.
    pub region: u32,
    /// `EP` index when this segment holds experts.
    pub expert_block: Option<u32>,
    pub parts: Vec<Part>,
    /// Parameters this segment owns (the tied `wte` belongs to the embedding).
    pub param_elems: u64,
    /// Parameters it uses but does not own (the LM head's tied `wte`).
    pub tied_elems: u64,
    pub cost: PartCost,
}

impl Segment {
    fn new(cfg: &ModelConfig, region: u32, expert_block: Option<u32>, parts: Vec<Part>) -> Self {
        let mut cost = PartCost::default();
        let mut tied = 0;
        for p in &parts {
            let c = part_cost(cfg, *p);
            cost.add(&c);
            if matches!(p, Part::Head) && cfg.arch().tied {
                tied = cfg.vocab as u64 * cfg.d_model as u64;
            }
        }
        Segment {
            index: 0,
            region,
            expert_block,
            param_elems: cost.param_elems,
            tied_elems: tied,
            parts,
            cost,
        }
    }

    pub fn has_embedding(&self) -> bool {
        self.parts.contains(&Part::Embedding)
    }
    pub fn has_head(&self) -> bool {
        self.parts.contains(&Part::Head)
    }
    /// Short human name: `emb+L0`, `L3`, `L7+head`, `L2.experts`.
    pub fn name(&self) -> String {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Embedding => "emb".to_string(),
                Part::Block(l) => format!("L{l}"),
                Part::Attention(l) => format!("L{l}.attn"),
                Part::Experts(l) => format!("L{l}.experts"),
                Part::Head => "head".to_string(),
            })
            .collect::<Vec<_>>()
            .join("+")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_has_124m_parameters() {
        let p = ModelConfig::gpt2_small().param_count();
        // GPT-2 small: 124,439,808 parameters with the tied head.
        assert_eq!(p, 124_439_808);
    }

    #[test]
    fn tiny_has_eight_regions_and_divisible_batch() {
        let t = ModelConfig::tiny();
        let segs = t.segments();
        assert_eq!(segs.len(), 8);
        assert!(segs[0].has_embedding() && segs[7].has_head());
        assert_eq!(t.batch_size % 32, 0);
        assert_eq!(
            segs.iter().map(|s| s.region).collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>()
        );
    }

    #[test]
    fn moe_splits_expert_halves_into_ep_segments() {
        let mut t = ModelConfig::tiny();
        t.moe = Some(MoeConfig::new(4, 2));
        let segs = t.segments();
        let experts: Vec<_> = segs.iter().filter_map(|s| s.expert_block).collect();
        assert_eq!(experts, (0..8).collect::<Vec<_>>());
        // 8 attention halves + 8 expert halves + the head.
        assert_eq!(segs.len(), 17);
        assert!(segs.last().unwrap().has_head());
        assert!(segs[0].has_embedding() && segs[1].expert_block == Some(0));
        // Expert parameters belong to their expert, the others to none.
        let entries = super::params::segment_entries(&t, &segs[1]);
        let experts: Vec<u32> = entries.iter().filter_map(|e| e.expert).collect();
        assert_eq!(experts, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
        assert_eq!(
            entries.len(),
            experts.len() + 3,
            "ln_2 and the router are nobody's"
        );
    }

    /// The example TOMLs of Llama 3 and Qwen3 have the parameter counts of
    /// the published checkpoints (the sums of their safetensors' shapes).
    #[test]
    fn llama_and_qwen3_shapes_have_the_published_parameter_counts() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/models");
        for (file, want) in [
            ("llama3-8b.toml", 8_030_261_248u64),
            ("qwen3-0.6b.toml", 596_049_920),
            ("qwen3-8b.toml", 8_190_735_360),
            ("qwen3-30b-a3b.toml", 30_532_122_624),
        ] {
            let cfg = ModelConfig::from_toml_file(&dir.join(file)).unwrap();
            assert_eq!(cfg.param_count(), want, "{file}");
        }
        let t = ModelConfig::llama_tiny();
        t.validate().unwrap();
        assert_eq!(t.arch().kv_width(), 32);
    }

    #[test]
    fn llama_fields_are_checked_and_belong_to_their_family() {
        let base = "layers = 2\nd_model = 32\nheads = 4\nseq_len = 8\nvocab = 64\nbatch_size = 2\n";
        let err = |extra: &str| {
            ModelConfig::from_toml_str(&format!("{base}{extra}"), "m.toml")
                .unwrap_err()
                .to_string()
        };
        assert!(err("kv_heads = 2\n").contains("`kv_heads` belongs to the Llama family"));
        let llama = "family = \"llama\"\n";
        assert!(err(llama).contains("needs `intermediate`"));
        let e = err(&format!("{llama}intermediate = 64\nkv_heads = 3\n"));
        assert!(
            e.contains("kv_heads must divide heads") && e.contains("heads 4 kv_heads 3"),
            "{e}"
        );
        let e = err(&format!("{llama}intermediate = 64\nhead_dim = 7\n"));
        assert!(e.contains("head_dim must be even, got 7"), "{e}");
        let e = err(&format!("{llama}intermediate = 64\nrope_theta = -1.0\n"));
        assert!(e.contains("rope_theta"), "{e}");
        let ok = ModelConfig::from_toml_str(
            &format!("{base}{llama}intermediate = 64\nkv_heads = 2\n"),
            "m.toml",
        )
        .unwrap();
        assert!(ok.tensor_split(2).is_ok());
        assert!(ok.tensor_split(4).unwrap_err().contains("kv_heads 2"));
    }

    #[test]
    fn toml_model_file_parses_and_rejects_bad_numbers() {
        let ok = "name = \"m\"\nlayers = 4\nd_model = 32\nheads = 4\nseq_len = 16\nvocab = 256\nbatch_size = 8\nregions = [1, 3]\n";
        let cfg = ModelConfig::from_toml_str(ok, "m.toml").unwrap();
        assert_eq!(cfg.region_sizes(), vec![1, 3]);
        let bad = ok.replace("heads = 4", "heads = 5");
        let err = ModelConfig::from_toml_str(&bad, "m.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("divisible by heads"), "{err}");
        let unknown = format!("{ok}colour = 3\n");
        let err = ModelConfig::from_toml_str(&unknown, "m.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("colour"), "{err}");
        let err = ModelConfig::preset("huge").unwrap_err().to_string();
        assert!(err.contains("tiny") && err.contains("huge"), "{err}");
    }
}
