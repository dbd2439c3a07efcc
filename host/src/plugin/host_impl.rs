//! The host side of the WIT interfaces: each `training-dag` method checks the
//! plugin's call budget, converts WIT values to the DAG's types, runs the
//! directive or primitive, and converts the result back.

use super::bindings::piper::strategy::{dag as wdag, log as wlog, types as wit};
use super::{Cause, DagHandle, PluginState};
use crate::dag::{self, DagError, DagErrorKind, Filter, NodeId, ReplicateOptions, TagMatch};
use wasmtime::component::Resource;

type R<T> = wasmtime::Result<Result<T, wit::DagError>>;

fn filter(f: wit::Filter) -> Filter {
    Filter {
        tags: f
            .tags
            .into_iter()
            .map(|t| {
                (
                    t.key,
                    match t.value {
                        wit::TagMatch::Any => TagMatch::Any,
                        wit::TagMatch::Index(i) => TagMatch::Index(i),
                    },
                )
            })
            .collect(),
        pass: f.pass,
    }
}

fn wit_error(e: &DagError) -> wit::DagError {
    let m = e.to_string();
    match e.kind {
        DagErrorKind::UnknownTag { .. } => wit::DagError::UnknownTag(m),
        DagErrorKind::NoMatch { .. } => wit::DagError::NoMatch(m),
        DagErrorKind::WrongKind { .. } => wit::DagError::WrongKind(m),
        DagErrorKind::DeviceOutOfRange { .. } => wit::DagError::DeviceOutOfRange(m),
        DagErrorKind::EmptyDevices => wit::DagError::EmptyDevices(m),
        DagErrorKind::DuplicateDevice { .. } => wit::DagError::DuplicateDevice(m),
        DagErrorKind::Cycle { .. } => wit::DagError::Cycle(m),
        DagErrorKind::CrossDevice { .. } => wit::DagError::CrossDevice(m),
        DagErrorKind::Unplaced { .. } => wit::DagError::Unplaced(m),
        DagErrorKind::NonContiguous { .. } => wit::DagError::NonContiguous(m),
        DagErrorKind::AlreadySplit { .. } => wit::DagError::AlreadySplit(m),
        DagErrorKind::Unpaired { .. } => wit::DagError::Unpaired(m),
        DagErrorKind::UnknownNode { .. } => wit::DagError::UnknownNode(m),
        DagErrorKind::InvalidArgument(_) => wit::DagError::InvalidArgument(m),
        DagErrorKind::Unsupported { .. } => wit::DagError::Unsupported(m),
    }
}

fn info(n: dag::NodeInfo) -> wit::NodeInfo {
    wit::NodeInfo {
        id: n.id.0,
        op: n.op,
        tags: n
            .tags
            .into_iter()
            .map(|(key, index)| wit::Tag { key, index })
            .collect(),
        devices: n.devices,
        stream: n.stream,
        priority: n.priority,
        segments: n.segments,
        cost: wit::NodeCost {
            flops: n.cost.flops,
            param_bytes: n.cost.param_bytes,
            act_in_bytes: n.cost.act_in_bytes,
            act_out_bytes: n.cost.act_out_bytes,
            saved_bytes: n.cost.saved_bytes,
            comm_bytes: n.cost.comm_bytes,
        },
    }
}

fn neighbour(n: dag::Neighbour) -> wit::Neighbour {
    wit::Neighbour {
        node: n.node.0,
        edge: match n.edge {
            "data" => wit::EdgeKind::Data,
            "temporal" => wit::EdgeKind::Temporal,
            _ => wit::EdgeKind::Peer,
        },
    }
}

impl PluginState {
    /// Count a host call; stop the plugin (trap) past the budget.
    fn enter(&mut self, handle: &Resource<DagHandle>) -> wasmtime::Result<&mut dag::TrainingDag> {
        self.calls += 1;
        if self.calls > self.max_calls {
            self.stop = Some(Cause::HostCalls(self.max_calls));
            wasmtime::bail!("host-call budget of {} spent", self.max_calls);
        }
        if self.table.iter_mut().count() > self.max_table_entries {
            self.stop = Some(Cause::Resources(self.max_table_entries));
            wasmtime::bail!("resource-table cap of {} reached", self.max_table_entries);
        }
        self.table.get(handle)?;
        Ok(self.dag.as_mut().expect("apply has a DAG"))
    }

    /// Convert a directive result, remembering errors for the final report.
    fn done<T>(&mut self, r: Result<T, DagError>) -> R<T> {
        Ok(r.map_err(|e| {
            self.last_directive_error = Some(e.to_string());
            wit_error(&e)
        }))
    }
}

impl wit::Host for PluginState {}
impl wdag::Host for PluginState {}

impl wdag::HostTrainingDag for PluginState {
    fn split(&mut self, h: Resource<DagHandle>, f: wit::Filter, dim: String, n: u32) -> R<()> {
        let r = self.enter(&h)?.split(&filter(f), &dim, n);
        self.done(r)
    }
    fn place(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R<()> {
        let r = self.enter(&h)?.place(&filter(f), &devices, &stream);
        self.done(r)
    }
    fn replicate(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        devices: Vec<u32>,
        o: wit::ReplicateOptions,
    ) -> R<()> {
        let o = ReplicateOptions {
            shard_optimizer: o.shard_optimizer,
            shard_grads: o.shard_grads,
            shard_params: o.shard_params,
            bucket_bytes: o.bucket_bytes,
            reduce_stream: o.reduce_stream,
            gather_stream: o.gather_stream,
            reshard_after_forward: o.reshard_after_forward,
        };
        let r = self.enter(&h)?.replicate(&filter(f), &devices, &o);
        self.done(r)
    }
    fn shard(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R<()> {
        let r = self.enter(&h)?.shard(&filter(f), &devices, &stream);
        self.done(r)
    }
    fn shard_tensor(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R<()> {
        let r = self.enter(&h)?.shard_tensor(&filter(f), &devices, &stream);
        self.done(r)
    }
    fn order(&mut self, h: Resource<DagHandle>, groups: Vec<Vec<wit::Filter>>) -> R<()> {
        let groups: Vec<Vec<Filter>> = groups
            .into_iter()
            .map(|g| g.into_iter().map(filter).collect())
            .collect();
        let r = self.enter(&h)?.order(&groups);
        self.done(r)
    }
    fn query(&mut self, h: Resource<DagHandle>, f: wit::Filter) -> R<Vec<wit::NodeInfo>> {
        let r = self.enter(&h)?.query(&filter(f));
        self.done(r.map(|v| v.into_iter().map(info).collect()))
    }
    fn query_ids(&mut self, h: Resource<DagHandle>, f: wit::Filter) -> R<Vec<u32>> {
        let r = self.enter(&h)?.query_ids(&filter(f));
        self.done(r.map(|v| v.into_iter().map(|i| i.0).collect()))
    }
    fn node(&mut self, h: Resource<DagHandle>, id: u32) -> R<wit::NodeInfo> {
        let r = self.enter(&h)?.node(NodeId(id));
        self.done(r.map(info))
    }
    fn neighbours(&mut self, h: Resource<DagHandle>, id: u32) -> R<wit::Neighbours> {
        let r = self.enter(&h)?.neighbours(NodeId(id));
        self.done(r.map(|(p, s)| wit::Neighbours {
            preds: p.into_iter().map(neighbour).collect(),
            succs: s.into_iter().map(neighbour).collect(),
        }))
    }
    fn tag_extents(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<Vec<wit::Tag>> {
        let ext = self.enter(&h)?.tag_extents();
        Ok(ext
            .into_iter()
            .map(|(key, index)| wit::Tag { key, index })
            .collect())
    }
    fn cluster(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<wit::ClusterInfo> {
        let c = self.enter(&h)?.cluster_info().clone();
        Ok(wit::ClusterInfo {
            devices: c.devices,
            memory_bytes: c.memory_bytes,
            link_bytes_per_s: c.link_bytes_per_s,
        })
    }
    fn add_temporal_edge(&mut self, h: Resource<DagHandle>, from: u32, to: u32) -> R<()> {
        let r = self.enter(&h)?.add_temporal_edge(NodeId(from), NodeId(to));
        self.done(r)
    }
    fn set_stream(&mut self, h: Resource<DagHandle>, f: wit::Filter, stream: String) -> R<u32> {
        let r = self.enter(&h)?.set_stream(&filter(f), &stream);
        self.done(r.map(|n| n as u32))
    }
    fn set_priority(&mut self, h: Resource<DagHandle>, f: wit::Filter, priority: i32) -> R<u32> {
        let r = self.enter(&h)?.set_priority(&filter(f), priority);
        self.done(r.map(|n| n as u32))
    }
    fn drop(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<()> {
        self.table.delete(h)?;
        Ok(())
    }
}

impl wlog::Host for PluginState {
    fn log(&mut self, level: wlog::Level, message: String) -> wasmtime::Result<()> {
        self.calls += 1;
        if self.calls > self.max_calls {
            self.stop = Some(Cause::HostCalls(self.max_calls));
            wasmtime::bail!("host-call budget of {} spent", self.max_calls);
        }
        let level = match level {
            wlog::Level::Trace => "trace",
            wlog::Level::Debug => "debug",
            wlog::Level::Info => "info",
            wlog::Level::Warn => "warn",
            wlog::Level::Error => "error",
        };
        if self.logs.len() < 10_000 {
            self.logs
                .push(format!("plugin {} [{level}]: {message}", self.plugin));
        }
        Ok(())
    }
}
