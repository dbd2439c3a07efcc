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
//!   `split`), `R` recompute nodes (`recompute`), `send`/`recv` pairs
//!   (inserted by `place` where a data edge crosses device groups) and
//!   `order` markers.
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
mod kinds;
mod primitives;
mod recompute;
#[cfg(test)]
mod tests;
mod topo;

pub use budget::{DagBudget, MAX_NAMES_HARD, MAX_NAME_BYTES};
pub use directives::ReplicateOptions;
pub use error::{human_bytes, DagError, DagErrorKind};
pub use filter::{Filter, Label, TagMatch, PASS_VALUES};
pub use kinds::*;
pub use primitives::{Neighbour, NodeInfo};
pub use recompute::RecomputePolicy;

use crate::model::{ModelConfig, ModelError, Segment};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use petgraph::Direction;
use std::collections::BTreeMap;

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
    /// Recompute nodes `recompute` added (placement is final once any exist).
    pub(crate) recomputes: u32,
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
            recomputes: 0,
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
    /// Every stream name the DAG has interned.
    pub fn stream_names(&self) -> &[String] {
        &self.streams
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
        n.batch_div as u64 * n.replicas() as u64
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
            && self.recomputes == other.recomputes
            && self.dirty == other.dirty
            && self.model == other.model
            && self.cluster == other.cluster
    }
}
