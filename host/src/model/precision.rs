//! The precision policy of a run: which dtype the parameters the kernels
//! read, the activations and what devices send are held in, which the
//! gradients are accumulated and reduced in, and which the optimizer's
//! master weights are. Part of the model stage because every byte figure
//! of the flow (cost hints, messages, collectives, model states) follows it.
//!
//! The policies people train with:
//! - `fp32` (the default): everything in fp32; the parameters are their own
//!   master weights.
//! - `bf16` (torchtitan's `MixedPrecisionPolicy(param_dtype=bf16,
//!   reduce_dtype=fp32)`, Megatron's `--bf16`): bf16 parameters, activations
//!   and messages; gradients accumulated and reduced in fp32; fp32 master
//!   weights and AdamW moments. A device holds per parameter 2 bytes of
//!   bf16 copy, 4 of fp32 gradient, 4 of fp32 master and 8 of moments,
//!   ZeRO sharding each as its stage says (Megatron's distributed-optimizer
//!   accounting).
//! - `bf16` with `reduce = "bf16"`: gradients on the wire in bf16 as well
//!   (half the data-parallel traffic, the sums rounded).
//!
//! Normalization statistics (mean, reciprocal standard deviation), token
//! ids and the loss stay fp32 under every policy, as in Apex's and
//! FlashAttention's kernels.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dtype {
    #[default]
    #[serde(rename = "fp32", alias = "f32", alias = "float32")]
    F32,
    #[serde(rename = "bf16", alias = "bfloat16")]
    Bf16,
}

impl Dtype {
    /// Bytes per element.
    pub const fn bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "fp32",
            Dtype::Bf16 => "bf16",
        }
    }

    /// A stable number for plan hashes.
    pub const fn code(self) -> u64 {
        match self {
            Dtype::F32 => 1,
            Dtype::Bf16 => 2,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes of an fp32 element: normalization statistics, the loss, master
/// weights and AdamW's moments under every policy.
pub const F32_BYTES: u64 = 4;

/// A precision policy (the run config's `[precision]` table; `--precision`
/// picks a named one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Precision {
    /// Parameters as the kernels read them, activations, and what pipeline
    /// stages, tensor-parallel sums, expert exchanges and ZeRO's parameter
    /// gathers move.
    pub params: Dtype,
    /// Gradients: accumulated over microbatches and reduced (all-reduce,
    /// reduce-scatter) in this dtype.
    #[serde(alias = "grads")]
    pub reduce: Dtype,
    /// The weights the optimizer steps. With fp32 parameters they are the
    /// parameters themselves; with bf16 parameters an fp32 copy.
    pub master: Dtype,
}

/// The names `--precision` takes.
pub const PRECISIONS: [&str; 2] = ["fp32", "bf16"];

impl Precision {
    /// Everything in fp32.
    pub const FP32: Precision = Precision {
        params: Dtype::F32,
        reduce: Dtype::F32,
        master: Dtype::F32,
    };

    /// bf16 parameters, activations and messages; fp32 gradients,
    /// reductions, master weights and moments.
    pub const BF16: Precision = Precision {
        params: Dtype::Bf16,
        reduce: Dtype::F32,
        master: Dtype::F32,
    };

    /// A named policy (`fp32`, `bf16`).
    pub fn named(name: &str) -> Result<Self, String> {
        match name.trim().to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Ok(Self::FP32),
            "bf16" | "bfloat16" => Ok(Self::BF16),
            other => Err(format!(
                "unknown precision `{other}`: choose one of {}",
                PRECISIONS.join(", ")
            )),
        }
    }

    pub fn is_fp32(&self) -> bool {
        *self == Self::FP32
    }

    /// A policy the flow can train with: fp32 master weights (AdamW's
    /// small steps vanish in bf16), and bf16 gradients only for bf16
    /// parameters.
    pub fn check(&self) -> Result<(), String> {
        if self.master != Dtype::F32 {
            return Err(format!(
                "[precision] master = \"{}\": master weights must be fp32 (AdamW's updates \
                 are below bf16's resolution and would be lost)",
                self.master
            ));
        }
        if self.params == Dtype::F32 && self.reduce == Dtype::Bf16 {
            return Err(
                "[precision] reduce = \"bf16\" needs params = \"bf16\": fp32 parameters \
                 keep fp32 gradients"
                    .into(),
            );
        }
        Ok(())
    }

    /// Bytes of an activation (and of a parameter as the kernels read it).
    pub const fn act_bytes(&self) -> u64 {
        self.params.bytes()
    }

    /// Bytes of a gradient element, accumulated and on the wire.
    pub const fn grad_bytes(&self) -> u64 {
        self.reduce.bytes()
    }

    /// Bytes of the master copy per parameter: none when the parameters
    /// are their own master weights.
    pub const fn master_bytes(&self) -> u64 {
        if self.params.bytes() == self.master.bytes() {
            0
        } else {
            self.master.bytes()
        }
    }

    /// Bytes a device holds per parameter element of each kind: the working
    /// parameters, gradients, master weights and AdamW's two fp32 moments.
    pub const fn state_bytes(&self) -> StateBytes {
        StateBytes {
            params: self.act_bytes(),
            grads: self.grad_bytes(),
            master: self.master_bytes(),
            moments: 2 * F32_BYTES,
        }
    }

    /// A stable word for plan hashes (fp32 plans do not hash it).
    pub const fn code(&self) -> u64 {
        self.params.code() | self.reduce.code() << 8 | self.master.code() << 16
    }
}

/// Bytes per parameter element of each model state (see
/// [`Precision::state_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateBytes {
    pub params: u64,
    pub grads: u64,
    pub master: u64,
    /// Both moments together.
    pub moments: u64,
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::FP32 => f.write_str("fp32"),
            Self::BF16 => f.write_str("bf16 (fp32 reduce, fp32 master)"),
            p => write!(
                f,
                "params {}, reduce {}, master {}",
                p.params, p.reduce, p.master
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_named_policies_hold_megatrons_bytes_per_parameter() {
        let s = Precision::named("bf16").unwrap().state_bytes();
        assert_eq!((s.params, s.grads, s.master, s.moments), (2, 4, 4, 8));
        let s = Precision::named("FP32").unwrap().state_bytes();
        assert_eq!((s.params, s.grads, s.master, s.moments), (4, 4, 0, 8));
        let e = Precision::named("fp16").unwrap_err();
        assert!(e.contains("fp16") && e.contains("fp32, bf16"), "{e}");
    }

    #[test]
    fn a_table_reads_its_dtypes_and_impossible_policies_are_named() {
        let p: Precision = toml::from_str("params = \"bf16\"\ngrads = \"bf16\"").unwrap();
        assert_eq!(
            (p.params, p.reduce, p.master),
            (Dtype::Bf16, Dtype::Bf16, Dtype::F32)
        );
        assert!(p.check().is_ok());
        assert_eq!(p.state_bytes().grads, 2);
        let bad: Precision = toml::from_str("params = \"bf16\"\nmaster = \"bf16\"").unwrap();
        assert!(bad
            .check()
            .unwrap_err()
            .contains("master weights must be fp32"));
        let bad: Precision = toml::from_str("reduce = \"bf16\"").unwrap();
        assert!(bad.check().unwrap_err().contains("needs params"));
        let unknown = toml::from_str::<Precision>("param = \"bf16\"").unwrap_err();
        assert!(unknown.to_string().contains("param"), "{unknown}");
        assert!(toml::from_str::<Precision>("params = \"fp8\"").is_err());
    }
}
