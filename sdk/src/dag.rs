//! The directive API a strategy calls: the [`Dag`] trait, implemented over the
//! WIT resource inside the sandbox and (feature `native`) directly over the
//! host's `TrainingDag`, so the same strategy source runs both ways.

use crate::bindings::piper::strategy::{dag as wdag, types as wit};
use crate::filter::Filter;
use std::collections::BTreeMap;

/// Why a directive or primitive failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DagErrorKind {
    UnknownTag,
    NoMatch,
    WrongKind,
    DeviceOutOfRange,
    EmptyDevices,
    DuplicateDevice,
    Cycle,
    CrossDevice,
    Unplaced,
    NonContiguous,
    AlreadySplit,
    Unpaired,
    UnknownNode,
    InvalidArgument,
    Unsupported,
    /// The host's call budget for this plugin is spent.
    Limit,
}

/// A failed directive: the kind and the host's full message (the call, its
/// arguments and the offending nodes). The DAG is unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct DagError {
    pub kind: DagErrorKind,
    pub message: String,
}

impl std::fmt::Display for DagError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DagError {}

/// Cost hints of a node as one device runs it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeCost {
    pub flops: f64,
    pub param_bytes: u64,
    pub act_in_bytes: u64,
    pub act_out_bytes: u64,
    pub saved_bytes: u64,
    pub comm_bytes: u64,
}

/// A node as a strategy sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeInfo {
    pub id: u32,
    /// `F`, `B`, `BI`, `BW`, `update`, `send`, `recv`, `all-reduce`, …
    pub op: String,
    pub tags: BTreeMap<String, u32>,
    pub devices: Vec<u32>,
    pub stream: String,
    pub priority: i32,
    pub segments: Vec<u32>,
    pub cost: NodeCost,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EdgeKind {
    Data,
    Temporal,
    Peer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Neighbour {
    pub node: u32,
    pub edge: EdgeKind,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Neighbours {
    pub preds: Vec<Neighbour>,
    pub succs: Vec<Neighbour>,
}

/// The cluster the DAG targets.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterInfo {
    pub devices: u32,
    pub memory_bytes: u64,
    pub link_bytes_per_s: f64,
}

/// Options of [`Dag::replicate`]: data parallelism and ZeRO.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicateOptions {
    /// ZeRO-1: shard optimizer states.
    pub shard_optimizer: bool,
    /// ZeRO-2: reduce-scatter and shard gradients.
    pub shard_grads: bool,
    /// ZeRO-3: shard parameters, all-gather before each use.
    pub shard_params: bool,
    /// Gradient bucket size (0: one collective per segment).
    pub bucket_bytes: u64,
    pub reduce_stream: String,
    pub gather_stream: String,
    /// ZeRO-3: free gathered parameters after each use.
    pub reshard_after_forward: bool,
}

impl Default for ReplicateOptions {
    fn default() -> Self {
        ReplicateOptions {
            shard_optimizer: false,
            shard_grads: false,
            shard_params: false,
            bucket_bytes: 25 << 20,
            reduce_stream: "dp".into(),
            gather_stream: "dp".into(),
            reshard_after_forward: true,
        }
    }
}

impl ReplicateOptions {
    /// Plain DP (0) or ZeRO stage 1, 2, 3.
    pub fn zero(stage: u8) -> Self {
        ReplicateOptions {
            shard_optimizer: stage >= 1,
            shard_grads: stage >= 2,
            shard_params: stage >= 3,
            ..Self::default()
        }
    }
}

/// The global training DAG, as a strategy rewrites it. See the crate docs for
/// what each directive does; every method leaves the DAG unchanged on error.
pub trait Dag {
    /// Copy the matched sub-DAG `n` times along `dim`, tagging copy i `dim = i`.
    fn split(&mut self, filter: &Filter, dim: &str, n: u32) -> Result<(), DagError>;
    /// Put the matched compute nodes on `devices` (several = SPMD); data edges
    /// that cross groups get send/recv pairs on `stream`.
    fn place(&mut self, filter: &Filter, devices: &[u32], stream: &str) -> Result<(), DagError>;
    /// Data parallelism (and ZeRO) over `devices`.
    fn replicate(
        &mut self,
        filter: &Filter,
        devices: &[u32],
        options: &ReplicateOptions,
    ) -> Result<(), DagError>;
    /// Expert parallelism.
    fn shard(&mut self, filter: &Filter, devices: &[u32], stream: &str) -> Result<(), DagError>;
    /// Tensor parallelism.
    fn shard_tensor(
        &mut self,
        filter: &Filter,
        devices: &[u32],
        stream: &str,
    ) -> Result<(), DagError>;
    /// Sequence parallelism (Megatron-SP, WIT 0.3.0) inside the segments
    /// of the matched tensor-parallel nodes: norms and the residual stream
    /// split along the tokens over the group, all-gather before and
    /// reduce-scatter after the tensor-parallel layers. Apply it after
    /// `shard_tensor`. Returns how many segments it covers.
    fn sequence_parallel(&mut self, filter: &Filter) -> Result<u32, DagError>;
    /// Context parallelism (WIT 0.4.0): each replica of the matched nodes
    /// becomes `degree` replicas, `tp` devices apart, that split its
    /// sequences into `2·degree` chunks (two each) and gather each other's
    /// keys and values for attention on `stream`. Apply it after
    /// `shard_tensor`, before `shard` and `recompute`. Returns how many
    /// nodes it changed.
    fn context_parallel(
        &mut self,
        filter: &Filter,
        degree: u32,
        exchange: KvExchange,
        stream: &str,
    ) -> Result<u32, DagError>;
    /// On one device: group i runs before group i+1.
    fn order(&mut self, groups: &[Vec<Filter>]) -> Result<(), DagError>;
    fn query(&mut self, filter: &Filter) -> Result<Vec<NodeInfo>, DagError>;
    fn query_ids(&mut self, filter: &Filter) -> Result<Vec<u32>, DagError>;
    fn node(&mut self, id: u32) -> Result<NodeInfo, DagError>;
    fn neighbours(&mut self, id: u32) -> Result<Neighbours, DagError>;
    /// For each tag key, how many indices it spans.
    fn tag_extents(&mut self) -> BTreeMap<String, u32>;
    fn cluster(&mut self) -> ClusterInfo;
    fn add_temporal_edge(&mut self, from: u32, to: u32) -> Result<(), DagError>;
    fn set_stream(&mut self, filter: &Filter, stream: &str) -> Result<u32, DagError>;
    fn set_priority(&mut self, filter: &Filter, priority: i32) -> Result<u32, DagError>;
    /// Activation recomputation: the matched forwards keep only what
    /// `policy` says; a recompute node (`Pass::R`) rebuilds the rest right
    /// before the backward. Apply it after every split, place, replicate,
    /// shard and shard-tensor. Returns how many forwards got one.
    fn recompute(&mut self, filter: &Filter, policy: RecomputePolicy) -> Result<u32, DagError>;
}

/// How context parallelism's ranks meet each other's keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvExchange {
    /// Around a ring, overlapped with the attention of the block in hand.
    Ring,
    /// All-gathered into whole sequences.
    AllGather,
}

impl KvExchange {
    /// `ring` or `all-gather`, as options spell it.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "ring" => Some(KvExchange::Ring),
            "all-gather" => Some(KvExchange::AllGather),
            _ => None,
        }
    }
}

/// What `recompute` keeps of a forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecomputePolicy {
    /// Only the segment's input (Megatron's full recompute).
    Full,
    /// The matmul outputs; norms, attention probabilities and activations
    /// are recomputed (Megatron's selective recompute).
    Selective,
}

impl RecomputePolicy {
    /// `full` or `selective`, as options spell it.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "full" => Some(RecomputePolicy::Full),
            "selective" => Some(RecomputePolicy::Selective),
            _ => None,
        }
    }
}

/// The DAG inside the sandbox: every call goes to the host through WIT.
pub(crate) struct WitDag<'a>(pub(crate) &'a wdag::TrainingDag);

fn err(e: wit::DagError) -> DagError {
    use wit::DagError as W;
    let (kind, message) = match e {
        W::UnknownTag(m) => (DagErrorKind::UnknownTag, m),
        W::NoMatch(m) => (DagErrorKind::NoMatch, m),
        W::WrongKind(m) => (DagErrorKind::WrongKind, m),
        W::DeviceOutOfRange(m) => (DagErrorKind::DeviceOutOfRange, m),
        W::EmptyDevices(m) => (DagErrorKind::EmptyDevices, m),
        W::DuplicateDevice(m) => (DagErrorKind::DuplicateDevice, m),
        W::Cycle(m) => (DagErrorKind::Cycle, m),
        W::CrossDevice(m) => (DagErrorKind::CrossDevice, m),
        W::Unplaced(m) => (DagErrorKind::Unplaced, m),
        W::NonContiguous(m) => (DagErrorKind::NonContiguous, m),
        W::AlreadySplit(m) => (DagErrorKind::AlreadySplit, m),
        W::Unpaired(m) => (DagErrorKind::Unpaired, m),
        W::UnknownNode(m) => (DagErrorKind::UnknownNode, m),
        W::InvalidArgument(m) => (DagErrorKind::InvalidArgument, m),
        W::Unsupported(m) => (DagErrorKind::Unsupported, m),
        W::Limit(m) => (DagErrorKind::Limit, m),
    };
    DagError { kind, message }
}

fn node_info(n: wit::NodeInfo) -> NodeInfo {
    NodeInfo {
        id: n.id,
        op: n.op,
        tags: n.tags.into_iter().map(|t| (t.key, t.index)).collect(),
        devices: n.devices,
        stream: n.stream,
        priority: n.priority,
        segments: n.segments,
        cost: NodeCost {
            flops: n.cost.flops,
            param_bytes: n.cost.param_bytes,
            act_in_bytes: n.cost.act_in_bytes,
            act_out_bytes: n.cost.act_out_bytes,
            saved_bytes: n.cost.saved_bytes,
            comm_bytes: n.cost.comm_bytes,
        },
    }
}

fn neighbour(n: wit::Neighbour) -> Neighbour {
    Neighbour {
        node: n.node,
        edge: match n.edge {
            wit::EdgeKind::Data => EdgeKind::Data,
            wit::EdgeKind::Temporal => EdgeKind::Temporal,
            wit::EdgeKind::Peer => EdgeKind::Peer,
        },
    }
}

impl Dag for WitDag<'_> {
    fn split(&mut self, filter: &Filter, dim: &str, n: u32) -> Result<(), DagError> {
        self.0.split(&filter.to_wit(), dim, n).map_err(err)
    }
    fn place(&mut self, filter: &Filter, devices: &[u32], stream: &str) -> Result<(), DagError> {
        self.0.place(&filter.to_wit(), devices, stream).map_err(err)
    }
    fn replicate(
        &mut self,
        filter: &Filter,
        devices: &[u32],
        o: &ReplicateOptions,
    ) -> Result<(), DagError> {
        let o = wit::ReplicateOptions {
            shard_optimizer: o.shard_optimizer,
            shard_grads: o.shard_grads,
            shard_params: o.shard_params,
            bucket_bytes: o.bucket_bytes,
            reduce_stream: o.reduce_stream.clone(),
            gather_stream: o.gather_stream.clone(),
            reshard_after_forward: o.reshard_after_forward,
        };
        self.0.replicate(&filter.to_wit(), devices, &o).map_err(err)
    }
    fn shard(&mut self, filter: &Filter, devices: &[u32], stream: &str) -> Result<(), DagError> {
        self.0.shard(&filter.to_wit(), devices, stream).map_err(err)
    }
    fn shard_tensor(
        &mut self,
        filter: &Filter,
        devices: &[u32],
        stream: &str,
    ) -> Result<(), DagError> {
        self.0
            .shard_tensor(&filter.to_wit(), devices, stream)
            .map_err(err)
    }
    fn sequence_parallel(&mut self, filter: &Filter) -> Result<u32, DagError> {
        self.0.sequence_parallel(&filter.to_wit()).map_err(err)
    }
    fn context_parallel(
        &mut self,
        filter: &Filter,
        degree: u32,
        exchange: KvExchange,
        stream: &str,
    ) -> Result<u32, DagError> {
        let exchange = match exchange {
            KvExchange::Ring => wdag::KvExchange::Ring,
            KvExchange::AllGather => wdag::KvExchange::AllGather,
        };
        self.0
            .context_parallel(&filter.to_wit(), degree, exchange, stream)
            .map_err(err)
    }
    fn order(&mut self, groups: &[Vec<Filter>]) -> Result<(), DagError> {
        let groups: Vec<Vec<wit::Filter>> = groups
            .iter()
            .map(|g| g.iter().map(|f| f.to_wit()).collect())
            .collect();
        self.0.order(&groups).map_err(err)
    }
    fn query(&mut self, filter: &Filter) -> Result<Vec<NodeInfo>, DagError> {
        self.0
            .query(&filter.to_wit())
            .map(|v| v.into_iter().map(node_info).collect())
            .map_err(err)
    }
    fn query_ids(&mut self, filter: &Filter) -> Result<Vec<u32>, DagError> {
        self.0.query_ids(&filter.to_wit()).map_err(err)
    }
    fn node(&mut self, id: u32) -> Result<NodeInfo, DagError> {
        self.0.node(id).map(node_info).map_err(err)
    }
    fn neighbours(&mut self, id: u32) -> Result<Neighbours, DagError> {
        self.0
            .neighbours(id)
            .map(|n| Neighbours {
                preds: n.preds.into_iter().map(neighbour).collect(),
                succs: n.succs.into_iter().map(neighbour).collect(),
            })
            .map_err(err)
    }
    fn tag_extents(&mut self) -> BTreeMap<String, u32> {
        self.0
            .tag_extents()
            .into_iter()
            .map(|t| (t.key, t.index))
            .collect()
    }
    fn cluster(&mut self) -> ClusterInfo {
        let c = self.0.cluster();
        ClusterInfo {
            devices: c.devices,
            memory_bytes: c.memory_bytes,
            link_bytes_per_s: c.link_bytes_per_s,
        }
    }
    fn add_temporal_edge(&mut self, from: u32, to: u32) -> Result<(), DagError> {
        self.0.add_temporal_edge(from, to).map_err(err)
    }
    fn set_stream(&mut self, filter: &Filter, stream: &str) -> Result<u32, DagError> {
        self.0.set_stream(&filter.to_wit(), stream).map_err(err)
    }
    fn recompute(&mut self, filter: &Filter, policy: RecomputePolicy) -> Result<u32, DagError> {
        let policy = match policy {
            RecomputePolicy::Full => wdag::RecomputePolicy::Full,
            RecomputePolicy::Selective => wdag::RecomputePolicy::Selective,
        };
        self.0.recompute(&filter.to_wit(), policy).map_err(err)
    }
    fn set_priority(&mut self, filter: &Filter, priority: i32) -> Result<u32, DagError> {
        self.0.set_priority(&filter.to_wit(), priority).map_err(err)
    }
}

#[cfg(feature = "native")]
mod native {
    //! The same API directly on the host's DAG, for comparing sandboxed and
    //! native execution of one strategy source.
    use super::*;
    use crate::filter::{Pass, TagMatch};
    use piper::dag as host;

    fn filter(f: &Filter) -> host::Filter {
        let mut h = host::Filter::all();
        for (k, m) in &f.tags {
            h = match m {
                TagMatch::Any => h.any(k),
                TagMatch::Index(i) => h.and(k, *i),
            };
        }
        if let Some(p) = f.pass {
            h = h.pass(match p {
                Pass::F => host::Label::F,
                Pass::B => host::Label::B,
                Pass::BI => host::Label::BI,
                Pass::BW => host::Label::BW,
                Pass::R => host::Label::R,
                Pass::Update => host::Label::Update,
                Pass::Send => host::Label::Send,
                Pass::Recv => host::Label::Recv,
                Pass::AllReduce => host::Label::AllReduce,
                Pass::ReduceScatter => host::Label::ReduceScatter,
                Pass::AllGather => host::Label::AllGather,
                Pass::AllToAll => host::Label::AllToAll,
                Pass::Marker => host::Label::Marker,
            });
        }
        h
    }

    fn err(e: host::DagError) -> DagError {
        use host::DagErrorKind as K;
        let kind = match &e.kind {
            K::UnknownTag { .. } => DagErrorKind::UnknownTag,
            K::NoMatch { .. } => DagErrorKind::NoMatch,
            K::WrongKind { .. } => DagErrorKind::WrongKind,
            K::DeviceOutOfRange { .. } => DagErrorKind::DeviceOutOfRange,
            K::EmptyDevices => DagErrorKind::EmptyDevices,
            K::DuplicateDevice { .. } => DagErrorKind::DuplicateDevice,
            K::Cycle { .. } => DagErrorKind::Cycle,
            K::CrossDevice { .. } => DagErrorKind::CrossDevice,
            K::Unplaced { .. } => DagErrorKind::Unplaced,
            K::NonContiguous { .. } => DagErrorKind::NonContiguous,
            K::AlreadySplit { .. } => DagErrorKind::AlreadySplit,
            K::Unpaired { .. } => DagErrorKind::Unpaired,
            K::UnknownNode { .. } => DagErrorKind::UnknownNode,
            K::InvalidArgument(_) => DagErrorKind::InvalidArgument,
            K::Unsupported { .. } => DagErrorKind::Unsupported,
            K::Limit { .. } => DagErrorKind::Limit,
        };
        DagError {
            kind,
            message: e.to_string(),
        }
    }

    fn info(n: host::NodeInfo) -> NodeInfo {
        NodeInfo {
            id: n.id.0,
            op: n.op,
            tags: n.tags,
            devices: n.devices,
            stream: n.stream,
            priority: n.priority,
            segments: n.segments,
            cost: NodeCost {
                flops: n.cost.flops,
                param_bytes: n.cost.param_bytes,
                act_in_bytes: n.cost.act_in_bytes,
                act_out_bytes: n.cost.act_out_bytes,
                saved_bytes: n.cost.saved_bytes,
                comm_bytes: n.cost.comm_bytes,
            },
        }
    }

    fn nb(n: host::Neighbour) -> Neighbour {
        Neighbour {
            node: n.node.0,
            edge: match n.edge {
                host::EdgeKind::Data { .. } => EdgeKind::Data,
                host::EdgeKind::Temporal => EdgeKind::Temporal,
                host::EdgeKind::Peer => EdgeKind::Peer,
            },
        }
    }

    impl Dag for host::TrainingDag {
        fn split(&mut self, f: &Filter, dim: &str, n: u32) -> Result<(), DagError> {
            host::TrainingDag::split(self, &filter(f), dim, n).map_err(err)
        }
        fn place(&mut self, f: &Filter, devices: &[u32], stream: &str) -> Result<(), DagError> {
            host::TrainingDag::place(self, &filter(f), devices, stream).map_err(err)
        }
        fn replicate(
            &mut self,
            f: &Filter,
            devices: &[u32],
            o: &ReplicateOptions,
        ) -> Result<(), DagError> {
            let o = host::ReplicateOptions {
                shard_optimizer: o.shard_optimizer,
                shard_grads: o.shard_grads,
                shard_params: o.shard_params,
                bucket_bytes: o.bucket_bytes,
                reduce_stream: o.reduce_stream.clone(),
                gather_stream: o.gather_stream.clone(),
                reshard_after_forward: o.reshard_after_forward,
            };
            host::TrainingDag::replicate(self, &filter(f), devices, &o).map_err(err)
        }
        fn shard(&mut self, f: &Filter, devices: &[u32], stream: &str) -> Result<(), DagError> {
            host::TrainingDag::shard(self, &filter(f), devices, stream).map_err(err)
        }
        fn shard_tensor(
            &mut self,
            f: &Filter,
            devices: &[u32],
            stream: &str,
        ) -> Result<(), DagError> {
            host::TrainingDag::shard_tensor(self, &filter(f), devices, stream).map_err(err)
        }
        fn sequence_parallel(&mut self, f: &Filter) -> Result<u32, DagError> {
            host::TrainingDag::sequence_parallel(self, &filter(f)).map_err(err)
        }
        fn context_parallel(
            &mut self,
            f: &Filter,
            degree: u32,
            exchange: KvExchange,
            stream: &str,
        ) -> Result<u32, DagError> {
            let exchange = match exchange {
                KvExchange::Ring => host::KvExchange::Ring,
                KvExchange::AllGather => host::KvExchange::AllGather,
            };
            host::TrainingDag::context_parallel(self, &filter(f), degree, exchange, stream)
                .map_err(err)
        }
        fn order(&mut self, groups: &[Vec<Filter>]) -> Result<(), DagError> {
            let groups: Vec<Vec<host::Filter>> = groups
                .iter()
                .map(|g| g.iter().map(filter).collect())
                .collect();
            host::TrainingDag::order(self, &groups).map_err(err)
        }
        fn query(&mut self, f: &Filter) -> Result<Vec<NodeInfo>, DagError> {
            host::TrainingDag::query(self, &filter(f))
                .map(|v| v.into_iter().map(info).collect())
                .map_err(err)
        }
        fn query_ids(&mut self, f: &Filter) -> Result<Vec<u32>, DagError> {
            host::TrainingDag::query_ids(self, &filter(f))
                .map(|v| v.into_iter().map(|i| i.0).collect())
                .map_err(err)
        }
        fn node(&mut self, id: u32) -> Result<NodeInfo, DagError> {
            host::TrainingDag::node(self, host::NodeId(id))
                .map(info)
                .map_err(err)
        }
        fn neighbours(&mut self, id: u32) -> Result<Neighbours, DagError> {
            host::TrainingDag::neighbours(self, host::NodeId(id))
                .map(|(p, s)| Neighbours {
                    preds: p.into_iter().map(nb).collect(),
                    succs: s.into_iter().map(nb).collect(),
                })
                .map_err(err)
        }
        fn tag_extents(&mut self) -> BTreeMap<String, u32> {
            host::TrainingDag::tag_extents(self)
        }
        fn cluster(&mut self) -> ClusterInfo {
            let c = self.cluster_info();
            ClusterInfo {
                devices: c.devices,
                memory_bytes: c.memory_bytes,
                link_bytes_per_s: c.link_bytes_per_s,
            }
        }
        fn add_temporal_edge(&mut self, from: u32, to: u32) -> Result<(), DagError> {
            host::TrainingDag::add_temporal_edge(self, host::NodeId(from), host::NodeId(to))
                .map_err(err)
        }
        fn set_stream(&mut self, f: &Filter, stream: &str) -> Result<u32, DagError> {
            host::TrainingDag::set_stream(self, &filter(f), stream)
                .map(|n| n as u32)
                .map_err(err)
        }
        fn recompute(&mut self, f: &Filter, policy: RecomputePolicy) -> Result<u32, DagError> {
            let policy = match policy {
                RecomputePolicy::Full => host::RecomputePolicy::Full,
                RecomputePolicy::Selective => host::RecomputePolicy::Selective,
            };
            host::TrainingDag::recompute(self, &filter(f), policy).map_err(err)
        }
        fn set_priority(&mut self, f: &Filter, priority: i32) -> Result<u32, DagError> {
            host::TrainingDag::set_priority(self, &filter(f), priority)
                .map(|n| n as u32)
                .map_err(err)
        }
    }
}
