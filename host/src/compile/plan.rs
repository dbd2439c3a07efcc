//! Per-device execution plans: what the runtime executes and the simulator
//! costs. A plan is plain data (serde), has a stable hash, and renders as a
//! readable per-device table.

use crate::dag::{CommOp, Pass, PASS_VALUES};
use crate::model::Precision;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// The IR vocabulary a plan is written in; the runtime reads it from here.
pub use super::relayout::{Holding, Piece, Relayout};
pub use crate::dag::{CommPurpose, ExpertPhase, Spread, TensorKind};
pub use crate::model::cost::{Gemm, OpShape};

/// The compiled plan of every device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Hash (hex, 16 chars) of everything below: equal plans, equal hashes,
    /// on every machine (a fixed word hash, not the std hasher).
    pub hash: String,
    pub model: String,
    /// Global batch in sequences.
    pub batch_size: u32,
    /// The precision policy every byte figure of the plan counts in (in
    /// JSON and in the hash only when it is not fp32, so fp32 plans read
    /// and hash as before it existed).
    #[serde(default, skip_serializing_if = "Precision::is_fp32")]
    pub precision: Precision,
    pub devices: Vec<DevicePlan>,
}

/// One device's program: an ordered op list per logical stream. In JSON a
/// wait names its stream (see [`Wait`]).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(try_from = "DeviceIn")]
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

#[derive(Clone, Debug, PartialEq)]
pub struct StreamPlan {
    pub stream: String,
    pub ops: Vec<Op>,
}

/// One instruction. What every device's op of a node shares is one
/// reference-counted [`OpCommon`], read through `Deref` (`op.tags`,
/// `op.flops`, …), so a plan over many devices stays cheap to build; in JSON
/// an op is one flat object.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    /// What the op does, with what that needs on this device.
    pub act: Act,
    /// The DAG node this op runs.
    pub node: u32,
    /// What the node's op on every device shares.
    pub common: Arc<OpCommon>,
    /// Ops of other streams on this device that must finish first.
    /// Shared by the devices of an SPMD node whose waits are the same.
    pub waits: Arc<[Wait]>,
    /// Local producers of the tensors this op reads, with the tensor kind.
    pub inputs: Arc<[Input]>,
    /// Compute ops: this device's index in the node's data-parallel group.
    pub replica: u32,
    /// Bytes of the transient buffers this op leaves on its device for local
    /// readers (the simulator's memory over time). Derived: not hashed.
    pub out_bytes: u64,
}

/// What the ops of one node share on every device that runs it.
#[derive(Clone, Debug, PartialEq)]
pub struct OpCommon {
    pub tags: Arc<BTreeMap<String, u32>>,
    pub segments: Arc<[u32]>,
    /// Compute ops spread over `group` (expert or tensor parallelism): the
    /// group exchanges inside the op, unless the op is one phase of a split
    /// expert pass (the exchanges are all-to-all ops of their own).
    pub spread: Option<Spread>,
    /// A phase of an expert segment's pass split by `shard`.
    pub phase: Option<ExpertPhase>,
    /// Microbatch split factor × data-parallel degree: the op runs
    /// `1/batch_div` of the global batch.
    pub batch_div: u64,
    /// Compute: FLOPs; communication: bytes moved per device.
    pub flops: f64,
    pub bytes: u64,
    /// Compute ops: the microbatch (linear index over every split dimension)
    /// and how many there are; the op runs batch piece
    /// `microbatch × DP degree + replica` of `batch_div`.
    pub microbatch: u32,
    pub microbatches: u32,
    /// Communication ops: what they move.
    pub tensor: Option<TensorKind>,
    /// The ZeRO stage of the segments this op computes or reduces (0: plain
    /// DP or none), so the runtime knows how their states are sharded.
    pub zero: u8,
    /// Compute ops: parameter bytes of their segments; update ops: the
    /// parameters one device steps (its ZeRO shard, TP slices, own
    /// experts), which the simulator costs the optimizer step from.
    /// Derived: not hashed.
    pub param_bytes: u64,
    /// Compute ops: the node's tensor-parallel degree (1: none). A `Tensor`
    /// spread's group size; under an `Experts` spread over a mesh, each
    /// tensor-parallel group (`tp` consecutive members of `group`) splits
    /// its replica's sequences, rank `j` taking the `j`-th share.
    pub tp: u32,
    /// Compute ops of a `Tensor` spread: sequence parallelism (the residual
    /// stream and norms split along the tokens over the group).
    pub sp: bool,
    /// Compute ops: the context-parallel degree (1: none). Each group of
    /// `cp` consecutive replicas runs one batch share, replica `r` holding
    /// chunks `r mod cp` and `2·cp − 1 − r mod cp` of each sequence (of
    /// `2·cp`), its attention meeting the others' keys and values.
    pub cp: u32,
    /// Compute ops of a context-parallel node: the keys and values go
    /// around a ring (else all-gathered).
    pub cp_ring: bool,
    /// Compute ops: the bytes a device sends for its context-parallel
    /// exchanges inside the op (see `dag::NodeCost::cp_bytes`). Derived:
    /// not hashed.
    pub cp_bytes: u64,
    /// Compute ops: what the op runs in shapes, for the simulator's
    /// shape-aware costs.
    pub shape: Shapes,
}

/// A compute op's shapes, derived from the model: not part of the plan's
/// identity (not hashed, not in JSON, equal whatever they hold), so a plan
/// read back from JSON equals the one written and costs by its FLOPs alone.
#[derive(Clone, Debug, Default)]
pub struct Shapes(pub Option<Arc<OpShape>>);

impl PartialEq for Shapes {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::ops::Deref for Op {
    type Target = OpCommon;
    fn deref(&self) -> &OpCommon {
        &self.common
    }
}

/// Editing a shared field (`op.flops *= 2.0`) copies the node's common part
/// for this op first, so the node's ops on other devices are unchanged.
impl std::ops::DerefMut for Op {
    fn deref_mut(&mut self) -> &mut OpCommon {
        Arc::make_mut(&mut self.common)
    }
}

/// What one op does, each kind holding exactly what it needs on its device.
#[derive(Clone, Debug, PartialEq)]
pub enum Act {
    /// A compute pass of the node's segments. `group`: the devices a pass
    /// spread by tensor or expert parallelism exchanges with inside the op
    /// (this one included); `None` for a pass that runs alone.
    Compute {
        pass: Pass,
        group: Option<Arc<[u32]>>,
        /// The context-parallel group (this device included), in rank order.
        context: Option<Arc<[u32]>>,
    },
    /// Hand the node's tensor to device `to`; its `recv` names the same
    /// `pair` (the send node's id).
    Send { to: u32, pair: u32 },
    /// Take the tensor device `from` sent under `pair`.
    Recv { from: u32, pair: u32 },
    /// Run `what` together with the other members of `group` (this device
    /// included).
    Collective { what: Collective, group: Arc<[u32]> },
    /// Move a batch-sized tensor from its producer's layout to its
    /// consumer's over `group` (this device included): see [`Relayout`].
    Relayout {
        group: Arc<[u32]>,
        spec: Arc<Relayout>,
    },
    /// The optimizer step of the node's segments.
    Update,
}

/// A collective by what it is for; each runs as one kind of NCCL call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// All-reduce of the squared gradient norm over every device holding
    /// parameters (clipping by the global norm).
    GradNorm,
    /// The data-parallel replicas' gradients summed: an all-reduce, or a
    /// reduce-scatter (`scatter`) leaving each member its ZeRO shard.
    GradSync { scatter: bool },
    /// All-reduce of the tied embedding's and LM head's gradients across
    /// stages.
    TiedGrad,
    /// All-reduce of a segment's parameter copies' gradients (DualPipe's
    /// two model copies).
    CopyGrad,
    /// ZeRO-1/2: all-gather of the updated parameter shards after the step.
    ParamRefresh,
    /// ZeRO-3: all-gather of a segment's parameters before a use.
    ParamGather,
    /// Expert parallelism: the all-to-all between two phases of an expert
    /// segment's pass.
    Experts,
}

impl Collective {
    /// The collective a DAG node of this op and purpose runs (`None`: a
    /// pairing no directive makes, refused by the compiler).
    pub fn of(op: CommOp, purpose: CommPurpose) -> Option<Collective> {
        use CommPurpose as P;
        Some(match (op, purpose) {
            (CommOp::AllReduce, P::GradNorm) => Collective::GradNorm,
            (CommOp::AllReduce, P::GradSync) => Collective::GradSync { scatter: false },
            (CommOp::ReduceScatter, P::GradSync) => Collective::GradSync { scatter: true },
            (CommOp::AllReduce, P::TiedGrad) => Collective::TiedGrad,
            (CommOp::AllReduce, P::CopyGrad) => Collective::CopyGrad,
            (CommOp::AllGather, P::ParamRefresh) => Collective::ParamRefresh,
            (CommOp::AllGather, P::ParamGather) => Collective::ParamGather,
            (CommOp::AllToAll, P::Experts) => Collective::Experts,
            _ => return None,
        })
    }
    pub fn kind(self) -> OpKind {
        match self {
            Collective::GradNorm | Collective::TiedGrad | Collective::CopyGrad => OpKind::AllReduce,
            Collective::GradSync { scatter: false } => OpKind::AllReduce,
            Collective::GradSync { scatter: true } => OpKind::ReduceScatter,
            Collective::ParamRefresh | Collective::ParamGather => OpKind::AllGather,
            Collective::Experts => OpKind::AllToAll,
        }
    }
    pub fn purpose(self) -> CommPurpose {
        match self {
            Collective::GradNorm => CommPurpose::GradNorm,
            Collective::GradSync { .. } => CommPurpose::GradSync,
            Collective::TiedGrad => CommPurpose::TiedGrad,
            Collective::CopyGrad => CommPurpose::CopyGrad,
            Collective::ParamRefresh => CommPurpose::ParamRefresh,
            Collective::ParamGather => CommPurpose::ParamGather,
            Collective::Experts => CommPurpose::Experts,
        }
    }
}

impl Act {
    /// The op's name in plans (the DAG label of its node).
    pub fn kind(&self) -> OpKind {
        match self {
            Act::Compute { pass, .. } => OpKind::of_pass(*pass),
            Act::Send { .. } => OpKind::Send,
            Act::Recv { .. } => OpKind::Recv,
            Act::Collective { what, .. } => what.kind(),
            Act::Relayout { .. } => OpKind::AllToAll,
            Act::Update => OpKind::Update,
        }
    }
    /// A send to device `dev`?
    pub fn sends_to(&self, dev: u32) -> bool {
        matches!(*self, Act::Send { to, .. } if to == dev)
    }
}

impl Op {
    /// Short label: `F[PP0 MB3]`, `send[PP1 MB0]→2`, `all-reduce[PP3]`.
    pub fn label(&self) -> String {
        // At most 16 tags, then their count.
        let mut tags: Vec<String> = (self.tags.iter().take(16))
            .map(|(k, v)| format!("{k}{v}"))
            .collect();
        if self.tags.len() > 16 {
            tags.push(format!("… ({} tags)", self.tags.len()));
        }
        let kind = self.kind();
        let mut s = if tags.is_empty() {
            kind.to_string()
        } else {
            format!("{kind}[{}]", tags.join(" "))
        };
        match self.act {
            Act::Send { to, .. } => write!(s, "→{to}").unwrap(),
            Act::Recv { from, .. } => write!(s, "←{from}").unwrap(),
            _ => {}
        }
        s
    }
    pub fn kind(&self) -> OpKind {
        self.act.kind()
    }
    /// Why a communication op exists (`pipeline`, `grad-sync`, …).
    pub fn purpose(&self) -> Option<CommPurpose> {
        match &self.act {
            Act::Send { .. } | Act::Recv { .. } => Some(CommPurpose::Pipeline),
            Act::Collective { what, .. } => Some(what.purpose()),
            Act::Relayout { .. } => Some(CommPurpose::Relayout),
            Act::Compute { .. } | Act::Update => None,
        }
    }
    /// The devices the op runs together with (this one included): a
    /// collective's, or a spread compute pass's.
    pub fn group(&self) -> Option<&Arc<[u32]>> {
        match &self.act {
            Act::Compute { group, .. } => group.as_ref(),
            Act::Collective { group, .. } | Act::Relayout { group, .. } => Some(group),
            _ => None,
        }
    }
    /// A relayout's spec.
    pub fn relayout(&self) -> Option<&Arc<Relayout>> {
        match &self.act {
            Act::Relayout { spec, .. } => Some(spec),
            _ => None,
        }
    }
    /// A context-parallel compute pass's group (this device included).
    pub fn context_group(&self) -> Option<&Arc<[u32]>> {
        match &self.act {
            Act::Compute { context, .. } => context.as_ref(),
            _ => None,
        }
    }
    /// A send's destination or a recv's source.
    pub fn peer(&self) -> Option<u32> {
        match self.act {
            Act::Send { to, .. } => Some(to),
            Act::Recv { from, .. } => Some(from),
            _ => None,
        }
    }
    /// A send's or recv's pairing key (the send node's id).
    pub fn pair(&self) -> Option<u32> {
        match self.act {
            Act::Send { pair, .. } | Act::Recv { pair, .. } => Some(pair),
            _ => None,
        }
    }
}

/// A device as its JSON object: its fields, then its streams, each op one
/// flat object whose waits name their streams.
#[derive(Serialize)]
struct DeviceOut<'a> {
    device: u32,
    peak_bytes: u64,
    model_state_bytes: u64,
    transient_peak_bytes: u64,
    streams: StreamsOut<'a>,
}

struct StreamsOut<'a>(&'a [StreamPlan]);

#[derive(Serialize)]
struct StreamOut<'a> {
    stream: &'a str,
    ops: OpsOut<'a>,
}

struct OpsOut<'a> {
    ops: &'a [Op],
    streams: &'a [StreamPlan],
}

impl Serialize for DevicePlan {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        DeviceOut {
            device: self.device,
            peak_bytes: self.peak_bytes,
            model_state_bytes: self.model_state_bytes,
            transient_peak_bytes: self.transient_peak_bytes,
            streams: StreamsOut(&self.streams),
        }
        .serialize(s)
    }
}

impl Serialize for StreamsOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|st| StreamOut {
            stream: &st.stream,
            ops: OpsOut {
                ops: &st.ops,
                streams: self.0,
            },
        }))
    }
}

impl Serialize for OpsOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let n = self.streams.len();
        if let Some(w) = self
            .ops
            .iter()
            .flat_map(|o| o.waits.iter())
            .find(|w| w.stream.ix() >= n)
        {
            return Err(serde::ser::Error::custom(format!(
                "a wait on stream #{} of a device with {n} streams",
                w.stream.0
            )));
        }
        let name = |w: &Wait| self.streams[w.stream.ix()].stream.as_str();
        s.collect_seq(self.ops.iter().map(|o| FlatOp::of(o, name)))
    }
}

/// A device read from JSON, before its waits' stream names are resolved.
#[derive(Deserialize)]
struct DeviceIn {
    device: u32,
    peak_bytes: u64,
    model_state_bytes: u64,
    transient_peak_bytes: u64,
    streams: Vec<StreamIn>,
}

#[derive(Deserialize)]
struct StreamIn {
    stream: String,
    ops: Vec<FlatOp<'static>>,
}

impl TryFrom<DeviceIn> for DevicePlan {
    type Error = String;
    fn try_from(d: DeviceIn) -> Result<DevicePlan, String> {
        let names: Vec<String> = d.streams.iter().map(|s| s.stream.clone()).collect();
        // A wait means the device's first stream of its name.
        let at = |name: &str| {
            names
                .iter()
                .position(|n| n == name)
                .map(|p| StreamIx(p as u32))
        };
        let streams = d
            .streams
            .into_iter()
            .map(|s| {
                let ops = s
                    .ops
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| {
                        f.into_op(at).map_err(|e| {
                            format!("device {}: op {i} of stream `{}`: {e}", d.device, s.stream)
                        })
                    })
                    .collect::<Result<Vec<Op>, String>>()?;
                Ok(StreamPlan {
                    stream: s.stream,
                    ops,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(DevicePlan {
            device: d.device,
            peak_bytes: d.peak_bytes,
            model_state_bytes: d.model_state_bytes,
            transient_peak_bytes: d.transient_peak_bytes,
            streams,
        })
    }
}

/// An op as one flat JSON object (the plan's file format).
#[derive(Serialize, Deserialize)]
struct FlatOp<'a> {
    op: OpKind,
    node: u32,
    tags: Arc<BTreeMap<String, u32>>,
    #[serde(default, skip_serializing_if = "is_empty")]
    segments: Arc<[u32]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    peer: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pair: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    group: Option<Arc<[u32]>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    spread: Option<Spread>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    phase: Option<ExpertPhase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    purpose: Option<CommPurpose>,
    batch_div: u64,
    #[serde(default)]
    flops: f64,
    #[serde(default)]
    bytes: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    waits: Vec<NamedWait<'a>>,
    #[serde(default, skip_serializing_if = "no_inputs")]
    inputs: Arc<[Input]>,
    #[serde(default)]
    replica: u32,
    #[serde(default)]
    microbatch: u32,
    #[serde(default = "one")]
    microbatches: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tensor: Option<TensorKind>,
    #[serde(default)]
    zero: u8,
    #[serde(default, skip_serializing_if = "is_zero")]
    param_bytes: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    out_bytes: u64,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    tp: u32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    sp: bool,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    cp: u32,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    cp_ring: bool,
    #[serde(default, skip_serializing_if = "is_zero")]
    cp_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    context: Option<Arc<[u32]>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    relayout: Option<Arc<Relayout>>,
}

/// A wait in JSON: the stream by its name.
#[derive(Serialize, Deserialize)]
struct NamedWait<'a> {
    stream: std::borrow::Cow<'a, str>,
    op: usize,
}

impl<'a> FlatOp<'a> {
    /// `name`: a wait's stream name.
    fn of(o: &'a Op, name: impl Fn(&Wait) -> &'a str) -> FlatOp<'a> {
        let c = &*o.common;
        FlatOp {
            op: o.kind(),
            node: o.node,
            tags: c.tags.clone(),
            segments: c.segments.clone(),
            peer: o.peer(),
            pair: o.pair(),
            group: o.group().cloned(),
            spread: c.spread,
            phase: c.phase,
            purpose: o.purpose(),
            batch_div: c.batch_div,
            flops: c.flops,
            bytes: c.bytes,
            waits: o
                .waits
                .iter()
                .map(|w| NamedWait {
                    stream: name(w).into(),
                    op: w.op,
                })
                .collect(),
            inputs: o.inputs.clone(),
            replica: o.replica,
            microbatch: c.microbatch,
            microbatches: c.microbatches,
            tensor: c.tensor,
            zero: c.zero,
            param_bytes: c.param_bytes,
            out_bytes: o.out_bytes,
            tp: c.tp,
            sp: c.sp,
            cp: c.cp,
            cp_ring: c.cp_ring,
            cp_bytes: c.cp_bytes,
            context: o.context_group().cloned(),
            relayout: o.relayout().cloned(),
        }
    }

    /// The op, its waits' streams found by `at`; `Err`: what it lacks (a
    /// stream, a peer, a group) or an op and purpose no plan pairs.
    fn into_op(self, at: impl Fn(&str) -> Option<StreamIx>) -> Result<Op, String> {
        let waits = self
            .waits
            .iter()
            .map(|w| {
                let stream = at(&w.stream).ok_or_else(|| {
                    format!("it waits on stream `{}`, which this device lacks", w.stream)
                })?;
                Ok(Wait { stream, op: w.op })
            })
            .collect::<Result<Arc<[Wait]>, String>>()?;
        let kind = self.op;
        let lacks = |what: &str| format!("a `{kind}` op without its `{what}`");
        let (peer, pair) = (self.peer.ok_or_else(|| lacks("peer")), self.pair);
        let pair = pair.ok_or_else(|| lacks("pair"));
        let act = match kind {
            OpKind::Update => Act::Update,
            OpKind::Send => Act::Send {
                to: peer?,
                pair: pair?,
            },
            OpKind::Recv => Act::Recv {
                from: peer?,
                pair: pair?,
            },
            _ => match (kind.pass(), kind.comm()) {
                (Some(pass), _) => Act::Compute {
                    pass,
                    group: self.group,
                    context: self.context,
                },
                (None, Some(CommOp::AllToAll)) if self.purpose == Some(CommPurpose::Relayout) => {
                    Act::Relayout {
                        group: self.group.ok_or_else(|| lacks("group"))?,
                        spec: self.relayout.ok_or_else(|| lacks("relayout"))?,
                    }
                }
                (None, Some(op)) => {
                    let purpose = self.purpose.ok_or_else(|| lacks("purpose"))?;
                    Act::Collective {
                        what: Collective::of(op, purpose).ok_or_else(|| {
                            format!("`{kind}` for `{}` is no op of a plan", purpose.as_str())
                        })?,
                        group: self.group.ok_or_else(|| lacks("group"))?,
                    }
                }
                (None, None) => unreachable!("update, send and recv are matched above"),
            },
        };
        Ok(Op {
            act,
            node: self.node,
            common: Arc::new(OpCommon {
                tags: self.tags,
                segments: self.segments,
                spread: self.spread,
                phase: self.phase,
                batch_div: self.batch_div,
                flops: self.flops,
                bytes: self.bytes,
                microbatch: self.microbatch,
                microbatches: self.microbatches,
                tensor: self.tensor,
                zero: self.zero,
                param_bytes: self.param_bytes,
                tp: self.tp,
                sp: self.sp,
                cp: self.cp,
                cp_ring: self.cp_ring,
                cp_bytes: self.cp_bytes,
                shape: Shapes(None),
            }),
            waits,
            inputs: self.inputs,
            replica: self.replica,
            out_bytes: self.out_bytes,
        })
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn one() -> u32 {
    1
}

fn is_one(v: &u32) -> bool {
    *v == 1
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
/// `recv`, `all-reduce`, `reduce-scatter`, `all-gather`, `all-to-all` or `R`.
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
    /// A forward run again before its backward (`recompute`).
    R,
}

impl OpKind {
    /// Every op kind, in [`crate::dag::Label`]'s order (a label less the marker).
    #[cfg(test)]
    const ALL: [OpKind; 12] = [
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
        OpKind::R,
    ];
    /// Its name: its label's, from the DAG's one name table.
    pub fn as_str(self) -> &'static str {
        PASS_VALUES[self as usize]
    }
    /// The compute op of a pass.
    pub fn of_pass(pass: Pass) -> OpKind {
        match pass {
            Pass::F => OpKind::F,
            Pass::B => OpKind::B,
            Pass::BI => OpKind::BI,
            Pass::BW => OpKind::BW,
            Pass::R => OpKind::R,
        }
    }
    /// A compute op's pass.
    pub fn pass(self) -> Option<Pass> {
        Some(match self {
            OpKind::F => Pass::F,
            OpKind::B => Pass::B,
            OpKind::BI => Pass::BI,
            OpKind::BW => Pass::BW,
            OpKind::R => Pass::R,
            _ => return None,
        })
    }
    /// A communication op's DAG op.
    pub fn comm(self) -> Option<CommOp> {
        Some(match self {
            OpKind::Send => CommOp::Send,
            OpKind::Recv => CommOp::Recv,
            OpKind::AllReduce => CommOp::AllReduce,
            OpKind::ReduceScatter => CommOp::ReduceScatter,
            OpKind::AllGather => CommOp::AllGather,
            OpKind::AllToAll => CommOp::AllToAll,
            _ => return None,
        })
    }
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            OpKind::F | OpKind::B | OpKind::BI | OpKind::BW | OpKind::R
        )
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

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn is_empty(v: &Arc<[u32]>) -> bool {
    v.is_empty()
}

/// A stream of one device: its position in [`DevicePlan::streams`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamIx(pub u32);

impl StreamIx {
    pub fn ix(self) -> usize {
        self.0 as usize
    }
}

/// A cross-stream dependency: op `op` (index) of stream `stream` of the
/// same device. In the plan's JSON the stream is named, and a name means
/// the device's first stream of that name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wait {
    pub stream: StreamIx,
    pub op: usize,
}

/// A fixed 64-bit word hash (FxHash's mixing step, applied twice with
/// different seeds for 128 bits): stable across runs, builds and machines.
struct StableHasher([u64; 2]);

const SEED: [u64; 2] = [0x243f_6a88_85a3_08d3, 0x1319_8a2e_0370_7344];

/// One stream's part of the plan hash: its name, its ops in order, their
/// count. Each op is a few packed words: enums by their codes, ids in pairs,
/// a wait by its stream's position among the device's streams (the first
/// stream of its name). What every device's op of a node shares is hashed at
/// the node's first op in plan order (`shared`).
pub(crate) struct StreamHasher(StableHasher);

impl StreamHasher {
    pub(crate) fn new(stream: &str) -> Self {
        let mut h = StableHasher(SEED);
        h.bytes(stream.as_bytes());
        StreamHasher(h)
    }
    /// `waits`: each of the op's waits as (stream position, op index).
    pub(crate) fn op(
        &mut self,
        o: &Op,
        shared: bool,
        waits: impl ExactSizeIterator<Item = (u32, u32)>,
    ) {
        self.0.op(o, shared, waits);
    }
    pub(crate) fn finish(mut self, ops: usize) -> [u64; 2] {
        self.0.word(ops as u64);
        self.0 .0
    }
}

/// Two 32-bit values as one word.
fn pair(a: u32, b: u32) -> u64 {
    a as u64 | (b as u64) << 32
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
        for c in ws.chunks(2) {
            self.word(pair(c[0], c.get(1).copied().unwrap_or(0)));
        }
    }
    /// One op; `shared`: also what every device's op of its node shares.
    fn op(&mut self, o: &Op, shared: bool, waits: impl ExactSizeIterator<Item = (u32, u32)>) {
        let code = |x: Option<u8>| x.map_or(0, |v| v as u64 + 1);
        self.word(
            o.kind() as u64
                | code(o.spread.map(|s| s as u8)) << 8
                | code(o.phase.map(|p| p as u8)) << 16
                | code(o.tensor.map(|t| t as u8)) << 24
                | (o.zero as u64) << 32
                | code(o.purpose().map(|p| p as u8)) << 40
                | (shared as u64) << 48,
        );
        self.word(pair(o.node, o.replica));
        self.word(pair(
            o.peer().unwrap_or(u32::MAX),
            o.pair().unwrap_or(u32::MAX),
        ));
        self.word(pair(o.microbatch, o.microbatches));
        if shared {
            for (k, v) in o.tags.iter() {
                self.bytes(k.as_bytes());
                self.word(*v as u64);
            }
            self.words(&o.segments);
            self.word(o.batch_div);
            self.word(o.flops.to_bits());
            self.word(o.bytes);
            if o.tp > 1 {
                self.word(u64::from(o.tp) | u64::from(o.sp) << 32);
            }
            if o.cp > 1 {
                self.word(u64::from(o.cp) << 40 | u64::from(o.cp_ring) << 39);
            }
        }
        self.words(o.group().map_or(&[][..], |g| &g[..]));
        if let Some(g) = o.context_group() {
            self.words(g);
        }
        if let Some(r) = o.relayout().filter(|_| shared) {
            self.word(r.position_bytes);
            for h in r.from.iter().chain(&r.to) {
                match h {
                    Some(h) => {
                        self.words(&h.rows);
                        self.words(h.spans.as_flattened());
                    }
                    None => self.word(u64::MAX),
                }
            }
        }
        self.word(waits.len() as u64);
        for (s, i) in waits {
            self.word(pair(s, i));
        }
        self.word(o.inputs.len() as u64);
        for i in o.inputs.iter() {
            self.word(pair(i.node, i.tensor as u32));
        }
    }
}

impl Plan {
    /// Bytes each device sends per step by this plan, as the runtime's
    /// transports move them: its sends, (N−1)/N of each reduce-scatter's,
    /// all-gather's and all-to-all's buffer over N members, twice that for
    /// an all-reduce; the exchanges inside tensor-, context- and
    /// expert-parallel compute ops as their hints count them.
    pub fn predicted_sent_bytes(&self) -> Vec<u64> {
        self.devices
            .iter()
            .map(|d| {
                let ops = d.streams.iter().flat_map(|s| s.ops.iter());
                let part = |op: &Op| {
                    let n = op.group().map_or(1, |g| g.len()).max(1) as f64;
                    op.bytes as f64 * (n - 1.0) / n
                };
                ops.map(|op| {
                    if let Some(r) = op.relayout() {
                        return r.sent_bytes(d.device) as f64;
                    }
                    op.cp_bytes as f64
                        + match op.kind() {
                            OpKind::Send => op.bytes as f64,
                            // A tensor-parallel pass sums over its group inside the op
                            // (a sequence-parallel weight pass, its norms' gradients).
                            OpKind::F | OpKind::R | OpKind::B | OpKind::BI | OpKind::BW
                                if op.spread == Some(Spread::Tensor) =>
                            {
                                2.0 * part(op)
                            }
                            // An expert pass exchanging inside its op: its two
                            // all-to-alls (and a sequence split's gather).
                            OpKind::F | OpKind::R | OpKind::B | OpKind::BI
                                if op.spread == Some(Spread::Experts) && op.phase.is_none() =>
                            {
                                2.0 * part(op)
                            }
                            OpKind::AllReduce => 2.0 * part(op),
                            OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll => {
                                part(op)
                            }
                            _ => 0.0,
                        }
                })
                .sum::<f64>()
                .round() as u64
            })
            .collect()
    }

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
                            let waits = o
                                .waits
                                .iter()
                                .map(|w| (w.stream.0, u32::try_from(w.op).unwrap_or(u32::MAX)));
                            h.op(o, first[o.node as usize] == di as u32, waits);
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
        if !self.precision.is_fp32() {
            h.word(self.precision.code());
        }
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
            "plan {} — model {}, global batch {}, {} device(s){}",
            self.hash,
            self.model,
            self.batch_size,
            self.devices.len(),
            match self.precision.is_fp32() {
                true => String::new(),
                false => format!(", precision {}", self.precision),
            }
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

pub use crate::dag::human_bytes;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dag::Label;

    /// `OpKind` follows `Label`'s order, so a label's index is its op's:
    /// each op is named as its label and serialized under that name.
    #[test]
    fn op_kinds_are_the_labels_less_the_marker() {
        for (i, op) in OpKind::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i);
            assert_eq!(op.as_str(), Label::ALL[i].as_str());
            assert_eq!(
                serde_json::to_string(op).unwrap(),
                format!("\"{}\"", op.as_str())
            );
        }
        assert_eq!(OpKind::ALL.len() + 1, Label::ALL.len());
        assert_eq!(Label::ALL[OpKind::ALL.len()], Label::Marker);
    }
}
