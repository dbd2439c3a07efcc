//! The DAG's vocabulary: node and device ids, what a node does
//! ([`NodeKind`]: a compute [`Pass`], `update`, a [`CommOp`], a marker), what
//! its edges carry ([`EdgeKind`], [`TensorKind`]), its tags, the cluster, and
//! the replication specs `replicate` records. `TrainingDag` (`mod.rs`) holds
//! them; compile and the runtime read them.

use super::Label;
use petgraph::stable_graph::NodeIndex;
use serde::{Deserialize, Serialize};

/// A node's id: stable across rewrites (petgraph `StableDiGraph` index).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub u32);

/// A device index in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceId(pub u32);

/// An interned logical stream name (`compute`, `pp`, `dp`, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u16);

/// An interned tag key (`PP`, `EP`, `MB`, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TagKey(pub u16);

impl NodeId {
    pub(crate) fn ix(self) -> NodeIndex {
        NodeIndex::new(self.0 as usize)
    }
    pub(crate) fn of(ix: NodeIndex) -> Self {
        NodeId(ix.index() as u32)
    }
}

/// Compute passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Pass {
    /// Forward.
    F,
    /// Fused backward (input and weight gradients).
    B,
    /// Backward for inputs.
    BI,
    /// Backward for weights.
    BW,
    /// Recompute: the forward run again right before its backward, to
    /// rebuild the saved tensors `recompute` dropped after `F`.
    R,
}

impl Pass {
    pub fn as_str(self) -> &'static str {
        match self {
            Pass::F => "F",
            Pass::B => "B",
            Pass::BI => "BI",
            Pass::BW => "BW",
            Pass::R => "R",
        }
    }
    /// Does this pass produce weight gradients?
    pub fn makes_weight_grads(self) -> bool {
        matches!(self, Pass::B | Pass::BW)
    }
    /// Does this pass read the weights?
    pub fn reads_weights(self) -> bool {
        matches!(self, Pass::F | Pass::B | Pass::BI | Pass::R)
    }
}

/// A phase of an expert segment's pass, when `shard` splits it so its
/// all-to-alls run as nodes of their own (on the `shard` stream) that other
/// compute can overlap. Forward runs dispatch → experts → combine, backward
/// the reverse (combine → experts → dispatch); an all-to-all sits between
/// consecutive phases. The backward's dispatch phase (its last) computes the
/// segment's weight gradients (or hands `BW` its stash).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpertPhase {
    /// ln2, router, top-k routing, rows packed per owner (backward: the
    /// input gradients scattered back to tokens, router and ln2).
    Dispatch,
    /// The local experts on every source's rows.
    Experts,
    /// The weighted sum of the returned rows and the residual (backward:
    /// the output gradients of each row and of its weight).
    Combine,
}

impl ExpertPhase {
    pub const ALL: [ExpertPhase; 3] = [
        ExpertPhase::Dispatch,
        ExpertPhase::Experts,
        ExpertPhase::Combine,
    ];
    /// Index in forward order (the `PART` tag plugins read).
    pub fn index(self) -> u32 {
        self as u32
    }
    pub fn as_str(self) -> &'static str {
        match self {
            ExpertPhase::Dispatch => "dispatch",
            ExpertPhase::Experts => "experts",
            ExpertPhase::Combine => "combine",
        }
    }
    /// The phases of a pass in execution order.
    pub fn order(pass: Pass) -> [ExpertPhase; 3] {
        let mut a = Self::ALL;
        if pass != Pass::F {
            a.reverse();
        }
        a
    }
}

/// Communication operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CommOp {
    Send,
    Recv,
    AllReduce,
    ReduceScatter,
    AllGather,
    AllToAll,
}

impl CommOp {
    pub fn as_str(self) -> &'static str {
        match self {
            CommOp::Send => "send",
            CommOp::Recv => "recv",
            CommOp::AllReduce => "all-reduce",
            CommOp::ReduceScatter => "reduce-scatter",
            CommOp::AllGather => "all-gather",
            CommOp::AllToAll => "all-to-all",
        }
    }
    pub fn is_p2p(self) -> bool {
        matches!(self, CommOp::Send | CommOp::Recv)
    }
}

/// How a compute op shares its work with the other devices of its group
/// (plans carry it; the runtime exchanges inside the op).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Spread {
    /// `shard`: experts spread over the group, tokens exchanged by all-to-all.
    Experts,
    /// `shard-tensor`: heads and MLP units split, partial sums all-reduced.
    Tensor,
}

/// Why a communication node exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CommPurpose {
    /// Pipeline activation / gradient transfer (from `place`).
    Pipeline,
    /// Data-parallel gradient reduction (from `replicate`).
    GradSync,
    /// ZeRO-3 parameter gather before a use.
    ParamGather,
    /// ZeRO-1/2 parameter gather after the sharded optimizer step.
    ParamRefresh,
    /// Gradient all-reduce of the tied embedding / LM head across stages.
    TiedGrad,
    /// Gradient all-reduce of a segment's parameter copies: a segment whose
    /// nodes run on several device groups (DualPipe's two model copies)
    /// holds a copy on each, reduced together before the update.
    CopyGrad,
    /// All-reduce of the squared gradient norm over every device holding
    /// parameters, so clipping uses the global norm however the gradients are
    /// spread (stages) or sharded (ZeRO).
    GradNorm,
    /// Expert parallelism: the all-to-all between two phases of an expert
    /// segment's pass (rows to their experts' owners and back).
    Experts,
    /// A tensor moved between two layouts where a data edge joins them
    /// (compile plans it: `compile/layout.rs`).
    Relayout,
}

impl CommPurpose {
    /// The name in plans and tables (`grad-sync`, …; as serialized).
    pub fn as_str(self) -> &'static str {
        match self {
            CommPurpose::Pipeline => "pipeline",
            CommPurpose::GradSync => "grad-sync",
            CommPurpose::ParamGather => "param-gather",
            CommPurpose::ParamRefresh => "param-refresh",
            CommPurpose::TiedGrad => "tied-grad",
            CommPurpose::CopyGrad => "copy-grad",
            CommPurpose::GradNorm => "grad-norm",
            CommPurpose::Experts => "experts",
            CommPurpose::Relayout => "relayout",
        }
    }
}

/// What a data edge carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TensorKind {
    /// Forward activation (scales with the batch share).
    Activation,
    /// Gradient of an activation (scales with the batch share).
    ActGrad,
    /// Tensors kept from forward for backward (scale with the batch share).
    Saved,
    /// Parameter gradients accumulated over microbatches (they live in the
    /// device's gradient buffer, a model state).
    ParamGrad,
    /// One microbatch's parameter gradients, alive until its reduce-scatter
    /// (ZeRO-2/3).
    MicroGrad,
    /// What a `BI` hands its `BW`: the per-layer output gradients the weight
    /// gradients are computed from (scales with the batch share).
    Stash,
    /// Parameters (ZeRO gathers).
    Param,
    /// Rows exchanged between the phases of an expert segment (scales with
    /// the batch share).
    Routed,
    /// What a forward keeps for its selective recompute `R`, which rebuilds
    /// the saved tensors from it (scales with the batch share).
    Kept,
}

impl TensorKind {
    /// How many kinds there are (arrays indexed by kind).
    pub const COUNT: usize = TensorKind::Kept as usize + 1;

    /// Does the size scale with the share of the batch the node runs?
    pub fn scales_with_batch(self) -> bool {
        matches!(
            self,
            TensorKind::Activation
                | TensorKind::ActGrad
                | TensorKind::Saved
                | TensorKind::Stash
                | TensorKind::Routed
                | TensorKind::Kept
        )
    }
}

/// A communication node's payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comm {
    pub op: CommOp,
    pub purpose: CommPurpose,
    pub tensor: TensorKind,
    /// Bytes this node moves per device: for batch-scaled tensors the
    /// full-batch figure (divided at compile time), else exact.
    pub bytes: u64,
    /// Segments whose tensors it moves.
    pub segments: Vec<u32>,
    /// Point-to-point: the peer of each device of the node's group, element-wise.
    pub peers: Vec<DeviceId>,
    /// Collectives: the groups that run it (a partition of the node's devices).
    pub groups: Vec<Vec<DeviceId>>,
    /// Point-to-point: the other half of the pair.
    pub pair: Option<NodeId>,
}

/// What a node does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeKind {
    Compute {
        pass: Pass,
        segment: u32,
        /// `Some` for a phase of an expert segment split by `shard`.
        phase: Option<ExpertPhase>,
    },
    Update {
        segments: Vec<u32>,
    },
    Comm(Comm),
    Marker,
}

impl NodeKind {
    /// Does this node produce its segment's weight gradients (a `B` or
    /// `BW`; of a split expert backward, its last phase)?
    pub fn makes_weight_grads(&self) -> bool {
        matches!(self, NodeKind::Compute { pass, phase, .. }
            if pass.makes_weight_grads()
                && phase.is_none_or(|p| p == ExpertPhase::Dispatch))
    }

    /// The node's label: what a filter's `PASS` matches, and the op name
    /// in plans.
    pub fn label(&self) -> &'static str {
        Label::of(self).as_str()
    }
}

/// Sorted `(key, index)` pairs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Tags(pub(crate) Vec<(TagKey, u32)>);

impl Tags {
    pub fn get(&self, k: TagKey) -> Option<u32> {
        self.0.iter().find(|(key, _)| *key == k).map(|(_, v)| *v)
    }
    pub fn remove(&mut self, k: TagKey) {
        self.0.retain(|(key, _)| *key != k);
    }
    pub fn set(&mut self, k: TagKey, v: u32) {
        match self.0.binary_search_by_key(&k, |(key, _)| *key) {
            Ok(i) => self.0[i].1 = v,
            Err(i) => self.0.insert(i, (k, v)),
        }
    }
}

/// A node of the global training DAG.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub kind: NodeKind,
    pub tags: Tags,
    /// The device group; empty until placed. Several devices = SPMD.
    pub devices: Vec<DeviceId>,
    pub stream: StreamId,
    pub priority: i32,
    /// How many pieces `split` cut the batch into for this node.
    pub batch_div: u32,
    /// Replication spec (index into the DAG's specs) for compute nodes.
    pub replica: Option<u32>,
    /// `shard-tensor`: the node's devices are tensor-parallel groups of
    /// `degree` consecutive devices (each runs its replica's batch share on
    /// its slice of the heads and MLP units); the stream named is where
    /// their reductions belong. See [`Node::tp_groups`].
    pub tensor_parallel: Option<TensorParallel>,
    /// `context-parallel`: each `degree` consecutive replicas (of
    /// `tp_degree` devices each) split their batch share's sequences
    /// instead of holding a batch share each. See [`Node::cp_degree`].
    pub context_parallel: Option<ContextParallel>,
    /// Identity of a derived node across rebuilds; `None` for core nodes.
    pub(crate) derived: Option<u64>,
    /// A strategy changed this derived node (stream, priority, temporal edge):
    /// the change is carried over when derived nodes are rebuilt.
    pub(crate) tweaked: bool,
}

/// A node's tensor parallelism (`shard-tensor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorParallel {
    /// Where the group's reductions belong.
    pub stream: StreamId,
    /// Devices per tensor-parallel group.
    pub degree: u32,
    /// `sequence-parallel`: norms and the residual stream inside the
    /// segment are split along the sequence over the group (Megatron-SP).
    pub sequence: bool,
}

/// A node's context parallelism (`context-parallel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextParallel {
    /// Where the group's exchanges belong.
    pub stream: StreamId,
    /// Replicas per context-parallel group.
    pub degree: u32,
    /// How the group's keys and values meet.
    pub exchange: KvExchange,
}

/// How context parallelism's ranks meet each other's keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum KvExchange {
    /// Around a ring: each rank's block passes to the next while the
    /// attention of the block in hand runs; partial outputs merge by their
    /// log-sum-exp; in backward the key and value gradients travel with
    /// their block back to its holder.
    Ring,
    /// All-gathered into whole sequences (the gradients reduce-scattered).
    AllGather,
}

impl Node {
    /// Replicas per context-parallel group (1 when not context-parallel).
    pub fn cp_degree(&self) -> u32 {
        self.context_parallel.map_or(1, |c| c.degree.max(1))
    }

    /// The context-parallel group of the node's `i`-th device: the devices
    /// at its tensor-parallel rank in the `cp` replicas of its group, in
    /// rank order (with `tp` 2 and `cp` 2 on [0..8): device 5 meets [5, 7]).
    pub fn cp_group(devices: &[DeviceId], tp: u32, cp: u32, i: usize) -> Vec<DeviceId> {
        let (tp, cp) = (tp.max(1) as usize, cp.max(1) as usize);
        let (unit, j) = (i / tp, i % tp);
        let first = unit - unit % cp;
        (first..first + cp)
            .filter_map(|u| devices.get(u * tp + j).copied())
            .collect()
    }

    /// Devices per tensor-parallel group (1 when not tensor-parallel).
    pub fn tp_degree(&self) -> u32 {
        self.tensor_parallel.map_or(1, |t| t.degree.max(1))
    }

    /// Data-parallel replicas: the device list holds this many
    /// tensor-parallel groups one after the other (one device each when
    /// not tensor-parallel).
    pub fn replicas(&self) -> u32 {
        (self.devices.len() as u32 / self.tp_degree()).max(1)
    }

    /// The device mesh of a node on `devices` with tensor-parallel degree
    /// `t`: replica `i`'s group is `devices[i·t .. (i+1)·t]`; the
    /// data-parallel group of tensor-parallel rank `j` is every `t`-th
    /// device from `j`.
    pub fn tp_groups(devices: &[DeviceId], t: u32) -> impl Iterator<Item = &[DeviceId]> {
        devices.chunks(t.max(1) as usize)
    }

    /// The data-parallel groups of a mesh (see [`Node::tp_groups`]): one
    /// per tensor-parallel rank.
    pub fn dp_groups(devices: &[DeviceId], t: u32) -> Vec<Vec<DeviceId>> {
        let t = t.max(1) as usize;
        (0..t.min(devices.len()))
            .map(|j| devices.iter().skip(j).step_by(t).copied().collect())
            .collect()
    }

    /// A core node at priority 0, unreplicated, not tensor-parallel.
    pub(crate) fn new(
        kind: NodeKind,
        tags: Tags,
        devices: Vec<DeviceId>,
        stream: StreamId,
        batch_div: u32,
    ) -> Node {
        Node {
            kind,
            tags,
            devices,
            stream,
            priority: 0,
            batch_div,
            replica: None,
            tensor_parallel: None,
            context_parallel: None,
            derived: None,
            tweaked: false,
        }
    }
}

/// What an edge means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EdgeKind {
    /// A tensor flows; `bytes` as in [`Comm::bytes`].
    Data { tensor: TensorKind, bytes: u64 },
    /// Ordering only, on one device.
    Temporal,
    /// A send to its recv (crosses devices).
    Peer,
}

/// The cluster the DAG targets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub devices: u32,
    /// Memory per device in bytes.
    pub memory_bytes: u64,
    /// Link bandwidth between devices, bytes/s (for the simulator).
    pub link_bytes_per_s: f64,
}

impl Cluster {
    /// `n` devices with 16 GiB each and 50 GB/s links.
    pub fn new(n: u32) -> Self {
        Cluster {
            devices: n,
            memory_bytes: 16 << 30,
            link_bytes_per_s: 50e9,
        }
    }
}

/// A replication spec recorded by `replicate`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ReplicaSpec {
    pub zero: u8,
    pub bucket_bytes: u64,
    pub reduce_stream: StreamId,
    pub gather_stream: StreamId,
    pub reshard_after_forward: bool,
    /// `shard`: the experts of these (expert) segments are spread over the
    /// replica group, exchanging tokens by all-to-all; the stream named is
    /// where the exchange belongs.
    pub expert_parallel: Option<StreamId>,
}

impl ReplicaSpec {
    /// The spec of a node that is not data-parallel (one replica, no
    /// gradient sync), for `shard` on a tensor-parallel mesh alone.
    pub(crate) fn alone() -> Self {
        ReplicaSpec {
            zero: 0,
            bucket_bytes: 0,
            reduce_stream: super::COMPUTE,
            gather_stream: super::COMPUTE,
            reshard_after_forward: false,
            expert_parallel: None,
        }
    }
}
