//! `piper:strategy@0.1.x`, linked beside the current contract so components
//! built before 0.2.0 load and plan unchanged. Its types are the current
//! ones less `recompute`: each call converts its arguments, runs the current
//! host implementation (`host_impl.rs`: the same budgets, checks and
//! messages) and converts the result back.

use super::bindings::piper::strategy::{dag as d2, log as l2, types as t2};
use super::{DagHandle, PluginState};
use wasmtime::component::Resource;

pub(crate) mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/0.1",
        world: "strategy",
        imports: { default: trappable },
        with: { "piper:strategy/dag.training-dag": crate::plugin::DagHandle },
    });
}

use bindings::piper::strategy::{dag as d1, log as l1, types as t1};

type R1<T> = wasmtime::Result<Result<T, t1::DagError>>;

fn filter(f: t1::Filter) -> t2::Filter {
    t2::Filter {
        tags: f
            .tags
            .into_iter()
            .map(|t| t2::TagFilter {
                key: t.key,
                value: match t.value {
                    t1::TagMatch::Any => t2::TagMatch::Any,
                    t1::TagMatch::Index(i) => t2::TagMatch::Index(i),
                },
            })
            .collect(),
        pass: f.pass,
    }
}

fn tag(t: t2::Tag) -> t1::Tag {
    t1::Tag {
        key: t.key,
        index: t.index,
    }
}

fn info(n: t2::NodeInfo) -> t1::NodeInfo {
    let c = n.cost;
    t1::NodeInfo {
        id: n.id,
        op: n.op,
        tags: n.tags.into_iter().map(tag).collect(),
        devices: n.devices,
        stream: n.stream,
        priority: n.priority,
        segments: n.segments,
        cost: t1::NodeCost {
            flops: c.flops,
            param_bytes: c.param_bytes,
            act_in_bytes: c.act_in_bytes,
            act_out_bytes: c.act_out_bytes,
            saved_bytes: c.saved_bytes,
            comm_bytes: c.comm_bytes,
        },
    }
}

fn neighbour(n: t2::Neighbour) -> t1::Neighbour {
    t1::Neighbour {
        node: n.node,
        edge: match n.edge {
            t2::EdgeKind::Data => t1::EdgeKind::Data,
            t2::EdgeKind::Temporal => t1::EdgeKind::Temporal,
            t2::EdgeKind::Peer => t1::EdgeKind::Peer,
        },
    }
}

fn error(e: t2::DagError) -> t1::DagError {
    use t1::DagError as O;
    use t2::DagError as N;
    match e {
        N::UnknownTag(m) => O::UnknownTag(m),
        N::NoMatch(m) => O::NoMatch(m),
        N::WrongKind(m) => O::WrongKind(m),
        N::DeviceOutOfRange(m) => O::DeviceOutOfRange(m),
        N::EmptyDevices(m) => O::EmptyDevices(m),
        N::DuplicateDevice(m) => O::DuplicateDevice(m),
        N::Cycle(m) => O::Cycle(m),
        N::CrossDevice(m) => O::CrossDevice(m),
        N::Unplaced(m) => O::Unplaced(m),
        N::NonContiguous(m) => O::NonContiguous(m),
        N::AlreadySplit(m) => O::AlreadySplit(m),
        N::Unpaired(m) => O::Unpaired(m),
        N::UnknownNode(m) => O::UnknownNode(m),
        N::InvalidArgument(m) => O::InvalidArgument(m),
        N::Unsupported(m) => O::Unsupported(m),
        N::Limit(m) => O::Limit(m),
    }
}

/// A current result as the 0.1 one: the value converted by `f`, the error
/// by its case.
fn back<T, U>(r: wasmtime::Result<Result<T, t2::DagError>>, f: impl FnOnce(T) -> U) -> R1<U> {
    Ok(r?.map(f).map_err(error))
}

impl t1::Host for PluginState {}
impl d1::Host for PluginState {}

impl d1::HostTrainingDag for PluginState {
    fn split(&mut self, h: Resource<DagHandle>, f: t1::Filter, dim: String, n: u32) -> R1<()> {
        back(
            d2::HostTrainingDag::split(self, h, filter(f), dim, n),
            |v| v,
        )
    }
    fn place(
        &mut self,
        h: Resource<DagHandle>,
        f: t1::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R1<()> {
        back(
            d2::HostTrainingDag::place(self, h, filter(f), devices, stream),
            |v| v,
        )
    }
    fn replicate(
        &mut self,
        h: Resource<DagHandle>,
        f: t1::Filter,
        devices: Vec<u32>,
        o: t1::ReplicateOptions,
    ) -> R1<()> {
        let o = t2::ReplicateOptions {
            shard_optimizer: o.shard_optimizer,
            shard_grads: o.shard_grads,
            shard_params: o.shard_params,
            bucket_bytes: o.bucket_bytes,
            reduce_stream: o.reduce_stream,
            gather_stream: o.gather_stream,
            reshard_after_forward: o.reshard_after_forward,
        };
        back(
            d2::HostTrainingDag::replicate(self, h, filter(f), devices, o),
            |v| v,
        )
    }
    fn shard(
        &mut self,
        h: Resource<DagHandle>,
        f: t1::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R1<()> {
        back(
            d2::HostTrainingDag::shard(self, h, filter(f), devices, stream),
            |v| v,
        )
    }
    fn shard_tensor(
        &mut self,
        h: Resource<DagHandle>,
        f: t1::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R1<()> {
        back(
            d2::HostTrainingDag::shard_tensor(self, h, filter(f), devices, stream),
            |v| v,
        )
    }
    fn order(&mut self, h: Resource<DagHandle>, groups: Vec<Vec<t1::Filter>>) -> R1<()> {
        let groups = groups
            .into_iter()
            .map(|g| g.into_iter().map(filter).collect())
            .collect();
        back(d2::HostTrainingDag::order(self, h, groups), |v| v)
    }
    fn query(&mut self, h: Resource<DagHandle>, f: t1::Filter) -> R1<Vec<t1::NodeInfo>> {
        back(d2::HostTrainingDag::query(self, h, filter(f)), |v| {
            v.into_iter().map(info).collect()
        })
    }
    fn query_ids(&mut self, h: Resource<DagHandle>, f: t1::Filter) -> R1<Vec<u32>> {
        back(d2::HostTrainingDag::query_ids(self, h, filter(f)), |v| v)
    }
    fn node(&mut self, h: Resource<DagHandle>, id: u32) -> R1<t1::NodeInfo> {
        back(d2::HostTrainingDag::node(self, h, id), info)
    }
    fn neighbours(&mut self, h: Resource<DagHandle>, id: u32) -> R1<t1::Neighbours> {
        back(d2::HostTrainingDag::neighbours(self, h, id), |n| {
            t1::Neighbours {
                preds: n.preds.into_iter().map(neighbour).collect(),
                succs: n.succs.into_iter().map(neighbour).collect(),
            }
        })
    }
    fn tag_extents(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<Vec<t1::Tag>> {
        let tags = d2::HostTrainingDag::tag_extents(self, h)?;
        Ok(tags.into_iter().map(tag).collect())
    }
    fn cluster(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<t1::ClusterInfo> {
        let c = d2::HostTrainingDag::cluster(self, h)?;
        Ok(t1::ClusterInfo {
            devices: c.devices,
            memory_bytes: c.memory_bytes,
            link_bytes_per_s: c.link_bytes_per_s,
        })
    }
    fn add_temporal_edge(&mut self, h: Resource<DagHandle>, from: u32, to: u32) -> R1<()> {
        back(
            d2::HostTrainingDag::add_temporal_edge(self, h, from, to),
            |v| v,
        )
    }
    fn set_stream(&mut self, h: Resource<DagHandle>, f: t1::Filter, stream: String) -> R1<u32> {
        back(
            d2::HostTrainingDag::set_stream(self, h, filter(f), stream),
            |v| v,
        )
    }
    fn set_priority(&mut self, h: Resource<DagHandle>, f: t1::Filter, priority: i32) -> R1<u32> {
        back(
            d2::HostTrainingDag::set_priority(self, h, filter(f), priority),
            |v| v,
        )
    }
    fn drop(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<()> {
        d2::HostTrainingDag::drop(self, h)
    }
}

super::older_world!(l1, l2);
