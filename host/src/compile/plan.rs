//! Per-device execution plans: what the runtime executes and the simulator
//! costs. A plan is plain data (serde), has a stable hash, and renders as a
//! readable per-device table.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// The IR vocabulary a plan is written in; the runtime reads it from here.
pub use crate::dag::{CommPurpose, ExpertPhase, Spread, TensorKind};

/// The compiled plan of every device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Hash (hex, 16 chars) of everything below: equal plans, equal hashes,
    /// on every machine (a fixed word hash, not the std hasher).
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

/// One instruction. Fields shared by the devices of an SPMD node are
/// reference-counted, so a plan over many devices stays cheap to build.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Op {
    pub op: OpKind,
    /// The DAG node this op runs.
    pub node: u32,
    pub tags: Arc<BTreeMap<String, u32>>,
    #[serde(default, skip_serializing_if = "is_empty")]
    pub segments: Arc<[u32]>,
    /// `send`: destination device; `recv`: source device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<u32>,
    /// `send`/`recv`: the send node's id, the same on both sides.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pair: Option<u32>,
    /// Collectives: the devices that run it together (this device included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<Arc<[u32]>>,
    /// Compute ops spread over `group` (expert or tensor parallelism): the
    /// group exchanges inside the op, unless the op is one phase of a split
    /// expert pass (the exchanges are all-to-all ops of their own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread: Option<Spread>,
    /// A phase of an expert segment's pass split by `shard`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ExpertPhase>,
    /// Why a communication op exists (`pipeline`, `grad-sync`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purpose: Option<CommPurpose>,
    /// Microbatch split factor × data-parallel degree: the op runs
    /// `1/batch_div` of the global batch.
    pub batch_div: u64,
    /// Compute: FLOPs; communication: bytes moved per device.
    #[serde(default)]
    pub flops: f64,
    #[serde(default)]
    pub bytes: u64,
    /// Ops of other streams on this device that must finish first.
    /// Shared by the devices of an SPMD node whose waits are the same.
    #[serde(default, skip_serializing_if = "no_waits")]
    pub waits: Arc<[Wait]>,
    /// Local producers of the tensors this op reads, with the tensor kind.
    #[serde(default, skip_serializing_if = "no_inputs")]
    pub inputs: Arc<[Input]>,
    /// Compute ops: this device's index in the node's data-parallel group.
    #[serde(default)]
    pub replica: u32,
    /// Compute ops: the microbatch (linear index over every split dimension)
    /// and how many there are; the op runs batch piece
    /// `microbatch × DP degree + replica` of `batch_div`.
    #[serde(default)]
    pub microbatch: u32,
    #[serde(default = "one")]
    pub microbatches: u32,
    /// Communication ops: what they move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<TensorKind>,
    /// The ZeRO stage of the segments this op computes or reduces (0: plain
    /// DP or none), so the runtime knows how their states are sharded.
    #[serde(default)]
    pub zero: u8,
    /// Compute and update ops: parameter bytes of their segments (the
    /// simulator costs an optimizer step from it). Derived: not hashed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub param_bytes: u64,
    /// Bytes of the transient buffers this op leaves on its device for local
    /// readers (the simulator's memory over time). Derived: not hashed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub out_bytes: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn one() -> u32 {
    1
}

fn no_waits(v: &Arc<[Wait]>) -> bool {
    v.is_empty()
}

fn no_inputs(v: &Arc<[Input]>) -> bool {
    v.is_empty()
}

/// A tensor an op reads: produced by `node` on this device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Input {
    pub node: u32,
    pub tensor: TensorKind,
}

/// What an op does; serialized as `F`, `B`, `BI`, `BW`, `update`, `send`,
/// `recv`, `all-reduce`, `reduce-scatter`, `all-gather` or `all-to-all`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum OpKind {
    F,
    B,
    BI,
    BW,
    #[serde(rename = "update")]
    Update,
    #[serde(rename = "send")]
    Send,
    #[serde(rename = "recv")]
    Recv,
    #[serde(rename = "all-reduce")]
    AllReduce,
    #[serde(rename = "reduce-scatter")]
    ReduceScatter,
    #[serde(rename = "all-gather")]
    AllGather,
    #[serde(rename = "all-to-all")]
    AllToAll,
}

impl OpKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OpKind::F => "F",
            OpKind::B => "B",
            OpKind::BI => "BI",
            OpKind::BW => "BW",
            OpKind::Update => "update",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::AllReduce => "all-reduce",
            OpKind::ReduceScatter => "reduce-scatter",
            OpKind::AllGather => "all-gather",
            OpKind::AllToAll => "all-to-all",
        }
    }
    /// From a DAG node label (`None` for markers, which never reach a plan).
    pub fn from_label(s: &str) -> Option<Self> {
        [
            OpKind::F,
            OpKind::B,
            OpKind::BI,
            OpKind::BW,
            OpKind::Update,
            OpKind::Send,
            OpKind::Recv,
            OpKind::AllReduce,
            OpKind::ReduceScatter,
            OpKind::AllGather,
            OpKind::AllToAll,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
    pub fn is_compute(self) -> bool {
        matches!(self, OpKind::F | OpKind::B | OpKind::BI | OpKind::BW)
    }
    /// Send, receive or a collective.
    pub fn is_comm(self) -> bool {
        matches!(self, OpKind::Send | OpKind::Recv) || self.is_collective()
    }
    pub fn is_collective(self) -> bool {
        matches!(
            self,
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll
        )
    }
}

impl PartialEq<&str> for OpKind {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn is_empty(v: &Arc<[u32]>) -> bool {
    v.is_empty()
}

/// A cross-stream dependency: op `op` (index) of stream `stream`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wait {
    pub stream: Arc<str>,
    pub op: usize,
}

/// A fixed 64-bit word hash (FxHash's mixing step, applied twice with
/// different seeds for 128 bits): stable across runs, builds and machines.
struct StableHasher([u64; 2]);

const SEED: [u64; 2] = [0x243f_6a88_85a3_08d3, 0x1319_8a2e_0370_7344];

/// One stream's part of the plan hash: its name, its ops in order, their
/// count. `shared`: the op is its node's first in plan order (what every
/// device's op of the node shares is hashed there only).
pub(crate) struct StreamHasher(StableHasher);

impl StreamHasher {
    pub(crate) fn new(stream: &str) -> Self {
        let mut h = StableHasher(SEED);
        h.bytes(stream.as_bytes());
        StreamHasher(h)
    }
    pub(crate) fn op(&mut self, o: &Op, shared: bool) {
        self.0.op(o, shared);
    }
    pub(crate) fn finish(mut self, ops: usize) -> [u64; 2] {
        self.0.word(ops as u64);
        self.0 .0
    }
}

impl StableHasher {
    const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;
    fn word(&mut self, w: u64) {
        self.0[0] = (self.0[0].rotate_left(5) ^ w).wrapping_mul(Self::K);
        self.0[1] = (self.0[1].rotate_left(7) ^ w ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(Self::K);
    }
    fn bytes(&mut self, b: &[u8]) {
        self.word(b.len() as u64);
        for c in b.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.word(u64::from_le_bytes(w));
        }
    }
    fn words(&mut self, ws: &[u32]) {
        self.word(ws.len() as u64);
        for w in ws {
            self.word(*w as u64);
        }
    }
    /// One op; `shared`: also what every device's op of its node shares.
    fn op(&mut self, o: &Op, shared: bool) {
        self.bytes(o.op.as_str().as_bytes());
        self.word(o.node as u64);
        if shared {
            for (k, v) in o.tags.iter() {
                self.bytes(k.as_bytes());
                self.word(*v as u64);
            }
            self.words(&o.segments);
            self.bytes(o.purpose.map_or("", |p| p.as_str()).as_bytes());
            self.word(o.batch_div);
            self.word(o.flops.to_bits());
            self.word(o.bytes);
        }
        self.word(o.peer.map_or(u64::MAX, |p| p as u64));
        self.word(o.pair.map_or(u64::MAX, |p| p as u64));
        self.words(o.group.as_deref().unwrap_or(&[]));
        self.word(o.spread.map_or(0, |s| s as u64 + 1));
        self.word(o.phase.map_or(0, |p| p as u64 + 1));
        for w in o.waits.iter() {
            self.bytes(w.stream.as_bytes());
            self.word(w.op as u64);
        }
        self.word(o.inputs.len() as u64);
        for i in o.inputs.iter() {
            self.word(i.node as u64);
            self.word(i.tensor as u64);
        }
        self.word(o.replica as u64);
        self.word(o.microbatch as u64);
        self.word(o.microbatches as u64);
        self.word(o.tensor.map_or(u64::MAX, |t| t as u64));
        self.word(o.zero as u64);
    }
}

impl Op {
    /// Short label: `F[PP0 MB3]`, `send[PP1 MB0]→2`, `all-reduce[PP3]`.
    pub fn label(&self) -> String {
        let tags: Vec<String> = self.tags.iter().map(|(k, v)| format!("{k}{v}")).collect();
        let mut s = if tags.is_empty() {
            self.op.to_string()
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
    /// Hash of the plan body (everything but `hash`): each stream's ops
    /// hashed on their own ([`StreamHasher`], in parallel), then each
    /// device's sizes and stream hashes, then the devices in order. The
    /// compiler hashes each stream as it builds it, the same way.
    pub fn compute_hash(&self) -> String {
        use rayon::prelude::*;
        // What every device of a node shares is hashed at its first op (the
        // first device in plan order that runs the node).
        let bound = self
            .devices
            .iter()
            .flat_map(|d| d.streams.iter().flat_map(|s| s.ops.iter()))
            .map(|o| o.node as usize + 1)
            .max()
            .unwrap_or(0);
        let mut first = vec![u32::MAX; bound];
        for (di, d) in self.devices.iter().enumerate() {
            for o in d.streams.iter().flat_map(|s| s.ops.iter()) {
                let f = &mut first[o.node as usize];
                if *f == u32::MAX {
                    *f = di as u32;
                }
            }
        }
        let parts: Vec<Vec<[u64; 2]>> = self
            .devices
            .par_iter()
            .enumerate()
            .map(|(di, d)| {
                d.streams
                    .iter()
                    .map(|s| {
                        let mut h = StreamHasher::new(&s.stream);
                        for o in &s.ops {
                            h.op(o, first[o.node as usize] == di as u32);
                        }
                        h.finish(s.ops.len())
                    })
                    .collect()
            })
            .collect();
        self.hash_of(&parts)
    }

    /// The plan hash from each device's stream hashes (`parts[device]`, in
    /// stream order).
    pub(crate) fn hash_of(&self, parts: &[Vec<[u64; 2]>]) -> String {
        let mut h = StableHasher(SEED);
        h.bytes(self.model.as_bytes());
        h.word(self.batch_size as u64);
        h.word(self.devices.len() as u64);
        for (d, streams) in self.devices.iter().zip(parts) {
            h.word(d.device as u64);
            h.word(d.peak_bytes);
            h.word(d.model_state_bytes);
            h.word(d.transient_peak_bytes);
            h.word(streams.len() as u64);
            for p in streams {
                h.word(p[0]);
                h.word(p[1]);
            }
        }
        format!("{:016x}", h.0[0] ^ h.0[1].rotate_left(32))
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
