//! Device classes: what the simulator knows of a GPU beyond its peak, so an
//! op's time follows its shapes (issue 58's shape-aware costs). A class is a
//! TOML data file under `sim/devices/`, each figure with its source; a
//! cluster names one (`device = "h100-sxm"`) or writes one inline
//! (`[device]`). Clusters without one (`cpu-local`, older files) keep the
//! per-pass efficiencies alone.
//!
//! With a class, a compute op that carries its shapes
//! ([`crate::compile::plan::OpShape`]) costs, on top of its fixed overhead
//! (arithmetic at the dense BF16 peak, or at the FP32 one for fp32 operands):
//! - each weight product `m × n × k` at the pass's large-product rate
//!   (the cluster's `efficiency`), times the share of SMs its output tiles
//!   keep busy over its waves, times `k / (k + k_overhead)`; never faster
//!   than its operands and result over HBM;
//! - the attention core at the fused kernel's measured rate for its pass,
//!   scaled by `T / (T + seq_half)` for a key length `T`;
//! - the memory-bound kernels (norms, activations, residuals, rotary,
//!   embedding, loss) as their bytes over HBM at `memory_efficiency`;
//! - a launch gap per kernel;
//!
//! and while a transfer or collective of its device is in flight, compute
//! runs `comm_slowdown` slower (the simulator's contended run).

use serde::{Deserialize, Deserializer, Serialize};

/// The bundled device classes, by name.
const BUNDLED: [(&str, &str); 4] = [
    ("h100-sxm", include_str!("devices/h100-sxm.toml")),
    ("h200-sxm", include_str!("devices/h200-sxm.toml")),
    ("a100-sxm", include_str!("devices/a100-sxm.toml")),
    ("h100-hbm2e", include_str!("devices/h100-hbm2e.toml")),
];

/// The attention kernel's achieved fraction of peak per pass, and the key
/// length at which it reaches half of that.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionRate {
    #[serde(rename = "F")]
    pub f: f64,
    #[serde(rename = "B")]
    pub b: f64,
    pub seq_half: f64,
}

/// A GPU model's figures for shape-aware costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceClass {
    pub name: String,
    /// Dense BF16 FLOP/s, HBM bytes and bytes/s: the datasheet's, which the
    /// presets take. Costs read the cluster's own (one source: a cluster
    /// file or a calibration may set them).
    pub peak_flops: f64,
    /// FP32 FLOP/s without tensor cores: fp32 products and kernels (the
    /// CUDA backend's fp32 runs cuBLAS's default math, no TF32).
    pub fp32_flops: f64,
    pub memory_bytes: f64,
    pub memory_bytes_per_s: f64,
    /// Streaming multiprocessors: how many output tiles run at once.
    pub sms: u32,
    /// Output tile of a large product (rows, columns).
    pub gemm_tile: [u32; 2],
    /// A tile's fixed work in units of its main loop's k steps.
    pub gemm_k_overhead: f64,
    /// Fraction of `memory_bytes_per_s` a streaming kernel reaches.
    pub memory_efficiency: f64,
    /// Seconds between two dependent kernels on one stream.
    pub kernel_launch_s: f64,
    /// The fraction of its speed compute loses while a transfer or a
    /// collective of its device is in flight (NCCL's SMs and HBM traffic).
    pub comm_slowdown: f64,
    pub attention: AttentionRate,
}

/// A device class that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("unknown device class `{0}`: bundled are h100-sxm, h200-sxm, a100-sxm, h100-hbm2e, or write a [device] table")]
    Unknown(String),
    #[error("the bundled device class `{name}` does not parse (a build defect): {message}")]
    Bundled { name: String, message: String },
    #[error("device class `{name}`: {field} = {value} must be {why}")]
    Field {
        name: String,
        field: &'static str,
        value: f64,
        why: &'static str,
    },
}

impl DeviceClass {
    /// A bundled class by name.
    pub fn bundled(name: &str) -> Result<Self, DeviceError> {
        let (_, text) = BUNDLED
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| DeviceError::Unknown(name.into()))?;
        // The bundled files are part of the build and tested to parse.
        let c: DeviceClass = toml::from_str(text).map_err(|e| DeviceError::Bundled {
            name: name.into(),
            message: e.to_string(),
        })?;
        c.validate()?;
        Ok(c)
    }

    /// Every figure in its range: rates and sizes positive and finite,
    /// fractions at most 1, the launch gap zero or more.
    pub fn validate(&self) -> Result<(), DeviceError> {
        let field = |field: &'static str, value: f64, why: &'static str| DeviceError::Field {
            name: self.name.clone(),
            field,
            value,
            why,
        };
        for (f, v) in [
            ("peak_flops", self.peak_flops),
            ("fp32_flops", self.fp32_flops),
            ("memory_bytes", self.memory_bytes),
            ("memory_bytes_per_s", self.memory_bytes_per_s),
            ("attention.seq_half", self.attention.seq_half),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(field(f, v, "positive and finite"));
            }
        }
        for (f, v) in [
            ("memory_efficiency", self.memory_efficiency),
            ("attention.F", self.attention.f),
            ("attention.B", self.attention.b),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 1.0) {
                return Err(field(f, v, "in (0, 1]"));
            }
        }
        if !(self.comm_slowdown.is_finite() && (0.0..1.0).contains(&self.comm_slowdown)) {
            return Err(field("comm_slowdown", self.comm_slowdown, "in [0, 1)"));
        }
        for (f, v) in [
            ("gemm_k_overhead", self.gemm_k_overhead),
            ("kernel_launch_s", self.kernel_launch_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(field(f, v, "zero or more and finite"));
            }
        }
        for (f, v) in [
            ("sms", self.sms),
            ("gemm_tile[0]", self.gemm_tile[0]),
            ("gemm_tile[1]", self.gemm_tile[1]),
        ] {
            if v == 0 {
                return Err(field(f, 0.0, "at least 1"));
            }
        }
        Ok(())
    }

    /// The share of the large-product rate an `m × n × k` product runs at:
    /// the SMs its output tiles keep busy over its waves, and its depth.
    pub fn gemm_share(&self, m: f64, n: f64, k: f64) -> f64 {
        let [tm, tn] = self.gemm_tile.map(f64::from);
        let tiles = (m / tm).ceil().max(1.0) * (n / tn).ceil().max(1.0);
        let sms = f64::from(self.sms);
        let waves = (tiles / sms).ceil();
        let busy = tiles / (waves * sms);
        busy * k / (k + self.gemm_k_overhead)
    }

    /// The attention kernel's fraction of peak for a pass (`forward`, or
    /// a backward) at key length `t`.
    pub fn attention_rate(&self, forward: bool, t: f64) -> f64 {
        let r = if forward {
            self.attention.f
        } else {
            self.attention.b
        };
        r * t / (t + self.attention.seq_half)
    }
}

/// A cluster's `device`: a bundled class's name or an inline table.
pub(super) fn deserialize<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<DeviceClass>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Spec {
        Name(String),
        Table(Box<DeviceClass>),
    }
    match Option::<Spec>::deserialize(d)? {
        None => Ok(None),
        Some(Spec::Name(n)) => DeviceClass::bundled(&n)
            .map(Some)
            .map_err(serde::de::Error::custom),
        Some(Spec::Table(c)) => Ok(Some(*c)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bundled_class_parses_and_names_itself() {
        for (name, _) in BUNDLED {
            let c = DeviceClass::bundled(name).unwrap();
            assert_eq!(c.name, name);
        }
        assert!(matches!(
            DeviceClass::bundled("tpu-v9"),
            Err(DeviceError::Unknown(_))
        ));
    }

    #[test]
    fn small_and_skinny_products_run_below_the_large_rate() {
        let h = DeviceClass::bundled("h100-sxm").unwrap();
        // Llama-3-8B's MLP on 16K tokens: 64 × 56 tiles over 132 SMs.
        let big = h.gemm_share(16384.0, 14336.0, 4096.0);
        assert!(big > 0.95, "{big}");
        // One sequence of 128 tokens through a 768-wide layer: 6 tiles.
        let small = h.gemm_share(128.0, 768.0, 768.0);
        assert!(small < 0.05, "{small}");
        // 133 tiles: a second wave with one tile in it.
        let ragged = h.gemm_share(128.0 * 133.0, 256.0, 4096.0);
        assert!((0.45..0.55).contains(&ragged), "{ragged}");
        // A shallow product pays its epilogue.
        assert!(h.gemm_share(16384.0, 16384.0, 64.0) < 0.55);
    }

    #[test]
    fn the_attention_rate_follows_the_published_curve() {
        let h = DeviceClass::bundled("h100-sxm").unwrap();
        // FlashAttention-3 paper, FA2 head dim 128 causal forward on H100:
        // 191, 298, 333 TFLOP/s at 512, 2K, 8K tokens.
        for (t, tflops) in [(512.0, 191.0), (2048.0, 298.0), (8192.0, 333.0)] {
            let got = h.attention_rate(true, t) * h.peak_flops / 1e12;
            assert!((got / tflops - 1.0).abs() < 0.06, "{t}: {got} vs {tflops}");
        }
    }

    #[test]
    fn a_class_out_of_range_is_refused_by_field() {
        let mut c = DeviceClass::bundled("a100-sxm").unwrap();
        c.memory_efficiency = 1.5;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("memory_efficiency = 1.5"), "{e}");
        c.memory_efficiency = 0.9;
        c.sms = 0;
        assert!(c.validate().unwrap_err().to_string().contains("sms"));
    }
}
