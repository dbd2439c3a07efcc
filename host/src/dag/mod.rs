//! The global training DAG: Piper's one intermediate representation. It holds
//! every computation and communication of a training step across all devices.
//! Its builder (`dag/builder.rs`) creates it from a model config (`model/`); strategies rewrite it only through
//! the directives (`split`, `place`, `replicate`, `order`, …) and primitives
//! (`query`, `node`, `neighbours`, …) defined as methods here; `compile/` turns
//! it into per-device plans.
//!
//! # Example
//! ```
//! use piper::model::ModelConfig;
//! use piper::dag::{Cluster, Filter, Label, TrainingDag};
//!
//! let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(2)).unwrap();
//! dag.split(&Filter::all(), "MB", 4).unwrap();
//! for region in 0..8 {
//!     dag.place(&Filter::tag("PP", region), &[region / 4], "pp").unwrap();
//! }
//! assert_eq!(dag.query(&Filter::all().pass(Label::Send)).unwrap().len(), 8);
//! ```
//!
//! # Node kinds and who owns them
//! - *Core* nodes: `F`/`B`/`BI`/`BW` compute nodes (one per segment, copied by
//!   `split`), `send`/`recv` pairs (inserted by `place` where a data edge
//!   crosses device groups) and `order` markers.
//! - *Derived* nodes: the `update` nodes, the data-parallel collectives
//!   inserted for `replicate` (all-reduce, ZeRO reduce-scatter / all-gather)
//!   and the tied-embedding all-reduce. They are a function of the core nodes'
//!   placement and replication and are rebuilt after every `split`, `place`
//!   and `replicate`; a stream, priority or temporal edge a strategy set on a
//!   derived node is carried over to its rebuilt counterpart.
//!
//! A node on several devices runs SPMD: data-parallel replicas are one node.

mod budget;
mod builder;
mod derived;
mod directives;
pub mod error;
pub mod filter;
mod primitives;
#[cfg(test)]
mod tests;
mod topo;

pub use budget::{DagBudget, MAX_NAMES_HARD};
pub use directives::ReplicateOptions;
pub use error::{DagError, DagErrorKind};
pub use filter::{Filter, Label, TagMatch, PASS_VALUES};
pub use primitives::{Neighbour, NodeInfo};

use crate::model::{ModelConfig, ModelError, Segment};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use petgraph::Direction;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

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
}

impl Pass {
    pub fn as_str(self) -> &'static str {
        match self {
            Pass::F => "F",
            Pass::B => "B",
            Pass::BI => "BI",
            Pass::BW => "BW",
        }
    }
    /// Does this pass produce weight gradients?
    pub fn makes_weight_grads(self) -> bool {
        matches!(self, Pass::B | Pass::BW)
    }
    /// Does this pass read the weights?
    pub fn reads_weights(self) -> bool {
        matches!(self, Pass::F | Pass::B | Pass::BI)
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
}

impl TensorKind {
    /// Does the size scale with the share of the batch the node runs?
    pub fn scales_with_batch(self) -> bool {
        matches!(
            self,
            TensorKind::Activation
                | TensorKind::ActGrad
                | TensorKind::Saved
                | TensorKind::Stash
                | TensorKind::Routed
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
    /// `shard-tensor`: the node's devices are one tensor-parallel group (each
    /// runs the whole batch share on its slice of the heads and MLP units);
    /// the stream named is where its reductions belong.
    pub tensor_parallel: Option<StreamId>,
    /// Identity of a derived node across rebuilds; `None` for core nodes.
    pub(crate) derived: Option<u64>,
    /// A strategy changed this derived node (stream, priority, temporal edge):
    /// the change is carried over when derived nodes are rebuilt.
    pub(crate) tweaked: bool,
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

/// The global training DAG.
#[derive(Clone)]
pub struct TrainingDag {
    pub(crate) graph: StableDiGraph<Node, EdgeKind>,
    model: ModelConfig,
    segments: Vec<Segment>,
    cluster: Cluster,
    tag_names: Vec<String>,
    streams: Vec<String>,
    pub(crate) specs: Vec<ReplicaSpec>,
    /// Split dimensions applied, in order (`MB`, …).
    pub(crate) split_dims: Vec<TagKey>,
    /// Stream of the tied-gradient all-reduce (the last `place` stream).
    pub(crate) tied_stream: StreamId,
    /// Derived nodes are stale: rebuilt before the next read or directive.
    pub(crate) dirty: bool,
    /// Filter index, built on first use after a structural change.
    pub(crate) index: std::sync::OnceLock<primitives::Index>,
    /// The host budget in force (plugin calls) and the work spent.
    pub(crate) meter: budget::Meter,
    /// Phase costs of the expert segments (MoE models).
    pub(crate) expert_phases: Option<crate::model::ExpertPhaseCost>,
    /// A topological order kept across `order` calls (`topo.rs`).
    pub(crate) topo: Option<topo::Topo>,
    /// Per segment, the elements of its experts' parameters (0 for a dense
    /// segment): read for every derived node, computed once.
    pub(crate) expert_param_elems: Vec<u64>,
}

pub(crate) const COMPUTE: StreamId = StreamId(0);

impl TrainingDag {
    /// Build the initial DAG of a model on a cluster (see `dag/builder.rs`).
    pub fn build(model: &ModelConfig, cluster: Cluster) -> Result<Self, ModelError> {
        builder::build(model, cluster)
    }

    /// An empty DAG for `model` (used by the builder).
    pub(crate) fn empty(model: ModelConfig, segments: Vec<Segment>, cluster: Cluster) -> Self {
        let expert_param_elems = segments
            .iter()
            .map(|s| match s.expert_block {
                None => 0,
                Some(_) => crate::model::params::segment_entries(&model, s)
                    .iter()
                    .filter(|e| e.expert.is_some())
                    .map(|e| e.numel() as u64)
                    .sum(),
            })
            .collect();
        TrainingDag {
            expert_param_elems,
            graph: StableDiGraph::new(),
            segments,
            cluster,
            tag_names: Vec::new(),
            streams: vec!["compute".into()],
            specs: Vec::new(),
            split_dims: Vec::new(),
            tied_stream: COMPUTE,
            dirty: true,
            index: std::sync::OnceLock::new(),
            meter: Default::default(),
            expert_phases: crate::model::expert_phases(&model),
            topo: None,
            model,
        }
    }

    pub fn model(&self) -> &ModelConfig {
        &self.model
    }
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }
    pub fn cluster_info(&self) -> &Cluster {
        &self.cluster
    }
    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.graph.node_count()
    }
    /// Number of edges.
    pub fn edge_count(&self) -> usize {
        self.graph.edge_count()
    }
    pub(crate) fn node_ref(&self, id: NodeId) -> Option<&Node> {
        self.graph.node_weight(id.ix())
    }
    pub(crate) fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.graph.node_indices().map(NodeId::of)
    }

    /// Add a node, keeping the filter index (if built) up to date.
    pub(crate) fn add_node(&mut self, node: Node) -> NodeIndex {
        let ix = self.graph.add_node(node);
        if let Some(index) = self.index.get_mut() {
            index.add(NodeId::of(ix), &self.graph[ix]);
        }
        ix
    }

    /// Record in the index that `id` now carries `key = v`.
    pub(crate) fn index_tag(&mut self, id: NodeId, key: TagKey, v: u32) {
        if let Some(index) = self.index.get_mut() {
            index.add_tag(id, &self.graph[id.ix()], key, v);
        }
    }

    /// Record in the index that `id` changed its op label.
    pub(crate) fn index_label(&mut self, id: NodeId) {
        if let Some(index) = self.index.get_mut() {
            index.add(id, &self.graph[id.ix()]);
        }
    }

    /// Intern a tag key.
    pub(crate) fn tag_key(&mut self, name: &str) -> TagKey {
        if let Some(i) = self.tag_names.iter().position(|n| n == name) {
            return TagKey(i as u16);
        }
        // Callers reachable from plugins check the name budget first
        // (`check_names`); this is the last line of defence for the u16 id.
        assert!(
            self.tag_names.len() < budget::MAX_NAMES_HARD as usize,
            "tag keys exceed their u16 ids"
        );
        self.tag_names.push(name.to_string());
        TagKey((self.tag_names.len() - 1) as u16)
    }
    pub(crate) fn find_tag(&self, name: &str) -> Option<TagKey> {
        self.tag_names
            .iter()
            .position(|n| n == name)
            .map(|i| TagKey(i as u16))
    }
    pub fn tag_name(&self, k: TagKey) -> &str {
        &self.tag_names[k.0 as usize]
    }
    /// Tag keys the DAG's nodes carry (keys are interned only when first
    /// set on a node), plus `PASS`.
    pub fn tag_names(&self) -> Vec<String> {
        let mut names = self.tag_names.clone();
        names.push("PASS".into());
        names
    }

    /// Intern a stream name.
    pub(crate) fn stream_id(&mut self, name: &str) -> StreamId {
        if let Some(i) = self.streams.iter().position(|n| n == name) {
            return StreamId(i as u16);
        }
        assert!(
            self.streams.len() < budget::MAX_NAMES_HARD as usize,
            "streams exceed their u16 ids"
        );
        self.streams.push(name.to_string());
        StreamId((self.streams.len() - 1) as u16)
    }
    pub fn stream_name(&self, s: StreamId) -> &str {
        &self.streams[s.0 as usize]
    }
    pub(crate) fn stream_name_opt(&self, s: StreamId) -> Option<&str> {
        self.streams.get(s.0 as usize).map(|x| x.as_str())
    }

    /// Tags as a name → index map (without `PASS`). A node has a handful of
    /// tags: inserted one by one (collecting would gather them in a vector
    /// and sort it first; the compiler makes one map per distinct tag set).
    pub fn tag_map(&self, tags: &Tags) -> BTreeMap<String, u32> {
        let mut map = BTreeMap::new();
        for (k, v) in &tags.0 {
            map.insert(self.tag_name(*k).to_string(), *v);
        }
        map
    }

    /// A readable node label for errors and tables: `F{PP:1,MB:3}#17`.
    pub fn label(&self, id: NodeId) -> String {
        match self.node_ref(id) {
            None => format!("#{}", id.0),
            Some(n) => {
                // At most 16 tags, then their count.
                let mut tags: Vec<String> = (n.tags.0.iter().take(16))
                    .map(|(k, v)| format!("{}:{v}", self.tag_name(*k)))
                    .collect();
                if n.tags.0.len() > 16 {
                    tags.push(format!("… ({} tags)", n.tags.0.len()));
                }
                format!("{}{{{}}}#{}", n.kind.label(), tags.join(","), id.0)
            }
        }
    }

    /// Data and temporal predecessors (what must finish first on the same device).
    pub(crate) fn preds(&self, id: NodeId) -> impl Iterator<Item = (NodeId, EdgeKind)> + '_ {
        self.graph
            .edges_directed(id.ix(), Direction::Incoming)
            .map(|e| (NodeId::of(e.source()), *e.weight()))
    }
    pub(crate) fn succs(&self, id: NodeId) -> impl Iterator<Item = (NodeId, EdgeKind)> + '_ {
        self.graph
            .edges_directed(id.ix(), Direction::Outgoing)
            .map(|e| (NodeId::of(e.target()), *e.weight()))
    }

    /// Every node's devices (for compile).
    pub(crate) fn devices_of(&self, id: NodeId) -> &[DeviceId] {
        &self.graph[id.ix()].devices
    }

    /// The share of the global batch one device of this node processes:
    /// `1 / (microbatch splits × data-parallel degree)`.
    pub fn batch_share_div(&self, id: NodeId) -> u64 {
        let n = &self.graph[id.ix()];
        // A tensor-parallel group runs one batch share together.
        let replicas = match n.tensor_parallel {
            Some(_) => 1,
            None => n.devices.len().max(1) as u64,
        };
        n.batch_div as u64 * replicas
    }

    /// A JSON snapshot of the DAG for debugging (derived nodes brought up to date first).
    pub fn snapshot(&mut self) -> serde_json::Value {
        self.sync();
        self.to_json()
    }

    /// A JSON snapshot of the DAG as it stands.
    pub fn to_json(&self) -> serde_json::Value {
        let nodes: Vec<serde_json::Value> = self
            .node_ids()
            .map(|id| {
                let n = &self.graph[id.ix()];
                serde_json::json!({
                    "id": id.0,
                    "op": n.kind.label(),
                    "kind": n.kind,
                    "tags": self.tag_map(&n.tags),
                    "devices": n.devices.iter().map(|d| d.0).collect::<Vec<_>>(),
                    "stream": self.stream_name(n.stream),
                    "priority": n.priority,
                    "batch_div": n.batch_div,
                    "derived": n.derived.is_some(),
                })
            })
            .collect();
        let edges: Vec<serde_json::Value> = self
            .graph
            .edge_references()
            .map(|e| {
                serde_json::json!({
                    "from": e.source().index(),
                    "to": e.target().index(),
                    "kind": e.weight(),
                })
            })
            .collect();
        serde_json::json!({
            "model": self.model,
            "cluster": self.cluster,
            "segments": self.segments,
            "nodes": nodes,
            "edges": edges,
        })
    }

    /// Full-state equality: every node and edge slot by index (so node ids
    /// agree too), interned tag keys and streams, replication specs, split
    /// dimensions, the tied-gradient stream, the staleness of derived nodes,
    /// the model and the cluster. The filter index (a cache) and the host
    /// budget (accounting) are not state. StableGraph's free lists are not
    /// reachable; equal node and edge bounds with equal vacancies stand in.
    pub fn same_state(&self, other: &Self) -> bool {
        use petgraph::stable_graph::EdgeIndex;
        use petgraph::visit::EdgeIndexable;
        let (g, h) = (&self.graph, &other.graph);
        if g.node_bound() != h.node_bound()
            || EdgeIndexable::edge_bound(g) != EdgeIndexable::edge_bound(h)
        {
            return false;
        }
        let nodes_eq = (0..g.node_bound())
            .all(|i| g.node_weight(NodeIndex::new(i)) == h.node_weight(NodeIndex::new(i)));
        let edges_eq = (0..EdgeIndexable::edge_bound(g)).all(|i| {
            let e = EdgeIndex::new(i);
            g.edge_endpoints(e) == h.edge_endpoints(e) && g.edge_weight(e) == h.edge_weight(e)
        });
        nodes_eq
            && edges_eq
            && self.tag_names == other.tag_names
            && self.streams == other.streams
            && self.specs == other.specs
            && self.split_dims == other.split_dims
            && self.tied_stream == other.tied_stream
            && self.dirty == other.dirty
            && self.model == other.model
            && self.cluster == other.cluster
    }

    /// Kahn's algorithm over every edge. `Err` holds one cycle.
    pub(crate) fn check_acyclic(&self) -> Result<(), Vec<NodeId>> {
        self.check_acyclic_with(&[], 0)
            .map(|_| ())
            .map_err(|c| c.into_iter().map(|i| NodeId(i as u32)).collect())
    }

    /// Kahn's algorithm over every edge plus `extra` edges, which may name
    /// `virtual_nodes` nodes numbered from the graph's node bound up (edges
    /// planned but not added yet). `Ok` holds each node's position in the
    /// order found (`u32::MAX` for vacant indices), `Err` one cycle, as node
    /// indices.
    pub(crate) fn check_acyclic_with(
        &self,
        extra: &[(usize, usize)],
        virtual_nodes: usize,
    ) -> Result<Vec<u32>, Vec<usize>> {
        let bound = self.graph.node_bound();
        let total = bound + virtual_nodes;
        let mut indeg = vec![0u32; total];
        // Extra edges as a compressed adjacency list (counting sort by source).
        let mut head = vec![0u32; total + 1];
        for &(a, b) in extra {
            head[a + 1] += 1;
            indeg[b] += 1;
        }
        for i in 0..total {
            head[i + 1] += head[i];
        }
        let mut fill = head.clone();
        let mut targets = vec![0usize; extra.len()];
        for &(a, b) in extra {
            targets[fill[a] as usize] = b;
            fill[a] += 1;
        }
        for e in self.graph.edge_references() {
            indeg[e.target().index()] += 1;
        }
        let live = |i: usize| i >= bound || self.graph.contains_node(NodeIndex::new(i));
        let mut stack: Vec<usize> = (0..total).filter(|&i| live(i) && indeg[i] == 0).collect();
        let mut seen = 0usize;
        let mut pos = vec![u32::MAX; total];
        while let Some(n) = stack.pop() {
            pos[n] = seen as u32;
            seen += 1;
            for &t in &targets[head[n] as usize..head[n + 1] as usize] {
                indeg[t] -= 1;
                if indeg[t] == 0 {
                    stack.push(t);
                }
            }
            if n < bound {
                for t in self
                    .graph
                    .neighbors_directed(NodeIndex::new(n), Direction::Outgoing)
                {
                    let t = t.index();
                    indeg[t] -= 1;
                    if indeg[t] == 0 {
                        stack.push(t);
                    }
                }
            }
        }
        if seen == self.graph.node_count() + virtual_nodes {
            return Ok(pos);
        }
        // Walk predecessors among the blocked nodes until one repeats.
        // Failure path only: extra edges by target, for the walk back.
        let preds = |i: usize| -> Vec<usize> {
            let mut v: Vec<usize> = extra
                .iter()
                .filter(|(_, b)| *b == i)
                .map(|(a, _)| *a)
                .collect();
            if i < bound {
                v.extend(
                    self.graph
                        .neighbors_directed(NodeIndex::new(i), Direction::Incoming)
                        .map(|t| t.index()),
                );
            }
            v
        };
        let Some(start) = (0..total).find(|&i| live(i) && indeg[i] > 0) else {
            return Err(Vec::new());
        };
        let mut path = vec![start];
        let mut pos: BTreeMap<usize, usize> = BTreeMap::from([(start, 0)]);
        let mut cur = start;
        loop {
            // A blocked node always has a blocked predecessor.
            let Some(next) = preds(cur).into_iter().find(|&p| indeg[p] > 0) else {
                return Err(path);
            };
            if let Some(&p) = pos.get(&next) {
                let mut cycle: Vec<usize> = path[p..].to_vec();
                cycle.reverse();
                cycle.push(cycle[0]);
                return Err(cycle);
            }
            pos.insert(next, path.len());
            path.push(next);
            cur = next;
        }
    }
}
