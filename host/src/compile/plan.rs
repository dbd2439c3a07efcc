//! Per-device execution plans: what the runtime executes and the simulator
//! costs. A plan is plain data (serde), has a stable hash, and renders as a
//! readable per-device table.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The compiled plan of every device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// sha256 (hex, 16 chars) of everything below; equal plans, equal hashes.
    pub hash: String,
    pub model: String,
    /// Global batch in sequences.
    pub batch_size: u32,
    pub devices: Vec<DevicePlan>,
}

/// One device's program: an ordered op list per logical stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DevicePlan {
    pub device: u32,
    /// Predicted peak: model states plus the transient peak.
    pub peak_bytes: u64,
    /// Parameters, gradients and optimizer states resident on the device.
    pub model_state_bytes: u64,
    /// Peak of transient buffers (activations, saved tensors, gathered
    /// parameters, per-microbatch gradients).
    pub transient_peak_bytes: u64,
    pub streams: Vec<StreamPlan>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StreamPlan {
    pub stream: String,
    pub ops: Vec<Op>,
}

/// One instruction.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Op {
    /// `F`, `B`, `BI`, `BW`, `update`, `send`, `recv`, `all-reduce`,
    /// `reduce-scatter`, `all-gather` or `all-to-all`.
    pub op: String,
    /// The DAG node this op runs.
    pub node: u32,
    pub tags: BTreeMap<String, u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<u32>,
    /// `send`: destination device; `recv`: source device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<u32>,
    /// `send`/`recv`: the send node's id, the same on both sides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pair: Option<u32>,
    /// Collectives: the devices that run it together (this device included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<Vec<u32>>,
    /// Why a communication op exists (`pipeline`, `grad-sync`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purpose: Option<String>,
    /// Microbatch split factor × data-parallel degree: the op runs
    /// `1/batch_div` of the global batch.
    pub batch_div: u64,
    /// Compute: FLOPs; communication: bytes moved per device.
    #[serde(default)]
    pub flops: f64,
    #[serde(default)]
    pub bytes: u64,
    /// Ops of other streams on this device that must finish first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waits: Vec<Wait>,
    /// Local producers of the tensors this op reads.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<u32>,
}

/// A cross-stream dependency: op `op` (index) of stream `stream`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wait {
    pub stream: String,
    pub op: usize,
}

impl Op {
    /// Short label: `F[PP0 MB3]`, `send[PP1 MB0]→2`, `all-reduce[PP3]`.
    pub fn label(&self) -> String {
        let tags: Vec<String> = self.tags.iter().map(|(k, v)| format!("{k}{v}")).collect();
        let mut s = if tags.is_empty() {
            self.op.clone()
        } else {
            format!("{}[{}]", self.op, tags.join(" "))
        };
        match (self.op.as_str(), self.peer) {
            ("send", Some(p)) => write!(s, "→{p}").unwrap(),
            ("recv", Some(p)) => write!(s, "←{p}").unwrap(),
            _ => {}
        }
        s
    }
}

impl Plan {
    /// Hash of the plan body (everything but `hash`).
    pub fn compute_hash(&self) -> String {
        let body = serde_json::to_vec(&(&self.model, self.batch_size, &self.devices))
            .expect("plans serialize");
        let digest = Sha256::digest(&body);
        digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plans serialize")
    }

    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// A device's ops of one pass kind on its compute stream, as labels.
    pub fn compute_labels(&self, device: u32) -> Vec<String> {
        self.devices[device as usize]
            .streams
            .iter()
            .filter(|s| s.stream == "compute")
            .flat_map(|s| s.ops.iter().map(|o| o.label()))
            .collect()
    }

    /// Readable per-device table of ops per stream.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        writeln!(
            out,
            "plan {} — model {}, global batch {}, {} device(s)",
            self.hash,
            self.model,
            self.batch_size,
            self.devices.len()
        )
        .unwrap();
        for d in &self.devices {
            writeln!(
                out,
                "\ndevice {}: peak {} (model states {}, transient {})",
                d.device,
                human_bytes(d.peak_bytes),
                human_bytes(d.model_state_bytes),
                human_bytes(d.transient_peak_bytes)
            )
            .unwrap();
            let width = d.streams.iter().map(|s| s.stream.len()).max().unwrap_or(0);
            for s in &d.streams {
                let mut line = format!("  {:width$} | ", s.stream);
                let indent = line.chars().count();
                let mut col = indent;
                for (i, op) in s.ops.iter().enumerate() {
                    let l = op.label();
                    if col + l.chars().count() > 110 && col > indent {
                        line.push('\n');
                        line.push_str(&" ".repeat(indent));
                        col = indent;
                    } else if i > 0 {
                        line.push(' ');
                        col += 1;
                    }
                    col += l.chars().count();
                    line.push_str(&l);
                }
                writeln!(out, "{line}").unwrap();
            }
        }
        out
    }
}

/// `1.50 MiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
