//! Cluster descriptions for the simulator: presets and TOML files.
//!
//! ```toml
//! name = "my-cluster"
//! nodes = 4
//! devices_per_node = 8
//! peak_flops = 989e12          # per device, dense BF16
//! memory_bytes = 80e9          # per device
//! memory_bytes_per_s = 3.35e12 # HBM bandwidth (optimizer steps)
//! intra_bytes_per_s = 450e9    # per direction, inside a node (NVLink)
//! intra_latency_s = 3e-6
//! inter_bytes_per_s = 50e9     # per device, between nodes (InfiniBand NDR 400G)
//! inter_latency_s = 10e-6
//! [efficiency]                 # achieved fraction of peak per op kind
//! F = 0.55
//! B = 0.5
//! [op_overhead_s]              # fixed seconds per compute op (launches, framework)
//! F = 0.0
//! ```
//!
//! `device = "h100-sxm"` (or a `[device]` table) names the GPU model, so
//! compute ops cost from their shapes (`sim/device.rs`); left out, from
//! the per-pass efficiencies alone.
//!
//! `compute_slots = 2` says a node's devices share its compute (virtual
//! devices on one machine's cores): up to 2 compute ops run at full speed
//! at once, more share it equally. Left out, every device computes on its
//! own, as GPUs do.

use super::device::DeviceClass;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A bundled device class (the files are part of the build; a test parses
/// each).
fn bundled(name: &str) -> DeviceClass {
    DeviceClass::bundled(name).expect("bundled device classes parse")
}

/// Fraction of peak FLOP/s each op kind achieves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Efficiency {
    #[serde(rename = "F")]
    pub f: f64,
    #[serde(rename = "B")]
    pub b: f64,
    #[serde(rename = "BI")]
    pub bi: f64,
    #[serde(rename = "BW")]
    pub bw: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Efficiency {
            f: 0.55,
            b: 0.5,
            bi: 0.45,
            bw: 0.55,
        }
    }
}

/// Fixed seconds per compute op of each kind, on top of its FLOPs: kernel
/// launches and framework work (`piper calibrate` measures it on CPU).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Overhead {
    #[serde(rename = "F")]
    pub f: f64,
    #[serde(rename = "B")]
    pub b: f64,
    #[serde(rename = "BI")]
    pub bi: f64,
    #[serde(rename = "BW")]
    pub bw: f64,
}

impl From<[f64; 4]> for Overhead {
    /// F, B, BI, BW in that order.
    fn from([f, b, bi, bw]: [f64; 4]) -> Self {
        Overhead { f, b, bi, bw }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    pub name: String,
    pub nodes: u32,
    pub devices_per_node: u32,
    pub peak_flops: f64,
    pub memory_bytes: f64,
    pub memory_bytes_per_s: f64,
    pub intra_bytes_per_s: f64,
    pub intra_latency_s: f64,
    pub inter_bytes_per_s: f64,
    pub inter_latency_s: f64,
    #[serde(default)]
    pub efficiency: Efficiency,
    #[serde(default)]
    pub op_overhead_s: Overhead,
    /// Compute ops a node runs at full speed at once, when its devices
    /// share its compute (CPU cores ÷ kernel threads per device); `None`:
    /// each device has its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_slots: Option<f64>,
    /// The GPU model, for costs from op shapes (`device = "h100-sxm"`, or
    /// a `[device]` table; see [`super::device`]); `None`: per-pass
    /// efficiencies alone.
    #[serde(
        default,
        deserialize_with = "super::device::deserialize",
        skip_serializing_if = "Option::is_none"
    )]
    pub device: Option<DeviceClass>,
    /// The framework runs each elementwise op as its own kernel, as
    /// PyTorch eager does (`model::cost`'s eager traffic: norms and
    /// rotary over fp32 copies); `false`: fused kernels, as Piper's
    /// backends, `torch.compile` and TransformerEngine run them. Read with
    /// a device class only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eager: bool,
}

/// A cluster description that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("unknown cluster `{0}`: presets are h100-8x, h100-cluster:NODES, h200-1, cpu-local, or give a TOML file")]
    Unknown(String),
    #[error("cannot read the cluster file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cluster file {path}: {message}")]
    Parse { path: String, message: String },
    #[error(transparent)]
    Device(#[from] super::device::DeviceError),
    #[error("cluster `{name}`: {field} = {value} must be {why}")]
    Field {
        name: String,
        field: &'static str,
        value: f64,
        why: &'static str,
    },
}

impl Cluster {
    /// One node of 8 H100 SXM over NVLink 4 (dense BF16 peak).
    pub fn h100_8x() -> Self {
        let device = bundled("h100-sxm");
        Cluster {
            name: "h100-8x".into(),
            nodes: 1,
            devices_per_node: 8,
            peak_flops: device.peak_flops,
            memory_bytes: device.memory_bytes,
            memory_bytes_per_s: device.memory_bytes_per_s,
            intra_bytes_per_s: 450e9,
            intra_latency_s: 3e-6,
            inter_bytes_per_s: 50e9,
            inter_latency_s: 10e-6,
            efficiency: Efficiency::default(),
            op_overhead_s: Overhead::default(),
            compute_slots: None,
            device: Some(device),
            eager: false,
        }
    }

    /// `nodes` H100 nodes over InfiniBand NDR (400 Gb/s per GPU).
    pub fn h100_cluster(nodes: u32) -> Self {
        Cluster {
            name: format!("h100-cluster:{nodes}"),
            nodes,
            ..Self::h100_8x()
        }
    }

    /// One H200 (141 GB HBM3e at 4.8 TB/s).
    pub fn h200_1() -> Self {
        let device = bundled("h200-sxm");
        Cluster {
            name: "h200-1".into(),
            nodes: 1,
            devices_per_node: 1,
            peak_flops: device.peak_flops,
            memory_bytes: device.memory_bytes,
            memory_bytes_per_s: device.memory_bytes_per_s,
            device: Some(device),
            ..Self::h100_8x()
        }
    }

    /// This machine's virtual CPU devices before calibration: one core's
    /// worth each, sharing the machine's cores when more compute at once,
    /// in-memory transfers.
    pub fn cpu_local_default() -> Self {
        Cluster {
            name: "cpu-local".into(),
            nodes: 1,
            devices_per_node: 64,
            peak_flops: 20e9,
            memory_bytes: 8e9,
            memory_bytes_per_s: 10e9,
            intra_bytes_per_s: 5e9,
            intra_latency_s: 20e-6,
            inter_bytes_per_s: 5e9,
            inter_latency_s: 20e-6,
            efficiency: Efficiency {
                f: 1.0,
                b: 1.0,
                bi: 1.0,
                bw: 1.0,
            },
            op_overhead_s: Overhead::default(),
            compute_slots: Some(
                std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64),
            ),
            device: None,
            eager: false,
        }
    }

    /// A preset by name (`h100-cluster:N` sets the node count), or a TOML file.
    /// `cpu-local` reads `$PIPER_HOME/cpu-local.toml` when calibration wrote it.
    pub fn resolve(spec: &str, devices: u32) -> Result<Self, ClusterError> {
        let c = match spec {
            "h100-8x" => Self::h100_8x(),
            "h200-1" => Self::h200_1(),
            "cpu-local" => {
                let f = crate::home::piper_home().join("cpu-local.toml");
                if f.is_file() {
                    Self::from_file(&f)?
                } else {
                    Self::cpu_local_default()
                }
            }
            "h100-cluster" => Self::h100_cluster(devices.div_ceil(8).max(1)),
            s if s.starts_with("h100-cluster:") => {
                let n: u32 = s["h100-cluster:".len()..]
                    .parse()
                    .map_err(|_| ClusterError::Unknown(s.into()))?;
                Self::h100_cluster(n)
            }
            s if Path::new(s).is_file() || s.ends_with(".toml") => Self::from_file(Path::new(s))?,
            s => return Err(ClusterError::Unknown(s.into())),
        };
        c.validate()?;
        Ok(c)
    }

    pub fn from_file(path: &Path) -> Result<Self, ClusterError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ClusterError::Read {
            path: shown.clone(),
            source,
        })?;
        let c: Cluster = toml::from_str(&text).map_err(|e| ClusterError::Parse {
            path: shown,
            message: e.to_string(),
        })?;
        c.validate()?;
        Ok(c)
    }

    /// Every rate positive and finite, latencies non-negative.
    pub fn validate(&self) -> Result<(), ClusterError> {
        let field = |field: &'static str, value: f64, why: &'static str| ClusterError::Field {
            name: self.name.clone(),
            field,
            value,
            why,
        };
        for (f, v) in [
            ("peak_flops", self.peak_flops),
            ("memory_bytes", self.memory_bytes),
            ("memory_bytes_per_s", self.memory_bytes_per_s),
            ("intra_bytes_per_s", self.intra_bytes_per_s),
            ("inter_bytes_per_s", self.inter_bytes_per_s),
            ("efficiency.F", self.efficiency.f),
            ("efficiency.B", self.efficiency.b),
            ("efficiency.BI", self.efficiency.bi),
            ("efficiency.BW", self.efficiency.bw),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(field(f, v, "positive and finite"));
            }
        }
        for (f, v) in [
            ("intra_latency_s", self.intra_latency_s),
            ("inter_latency_s", self.inter_latency_s),
            ("op_overhead_s.F", self.op_overhead_s.f),
            ("op_overhead_s.B", self.op_overhead_s.b),
            ("op_overhead_s.BI", self.op_overhead_s.bi),
            ("op_overhead_s.BW", self.op_overhead_s.bw),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(field(f, v, "zero or more and finite"));
            }
        }
        if let Some(s) = self.compute_slots {
            if !(s.is_finite() && s > 0.0) {
                return Err(field("compute_slots", s, "positive and finite"));
            }
        }
        if self.devices_per_node == 0 {
            return Err(field("devices_per_node", 0.0, "at least 1"));
        }
        if let Some(d) = &self.device {
            d.validate()?;
        }
        Ok(())
    }

    pub fn devices(&self) -> u64 {
        u64::from(self.nodes) * u64::from(self.devices_per_node)
    }

    /// Whether two devices share a node.
    pub fn same_node(&self, a: u32, b: u32) -> bool {
        a / self.devices_per_node == b / self.devices_per_node
    }
}
