//! `piper:strategy@0.3.x`, linked beside the current contract so components
//! built before 0.4.0 load and plan unchanged. Its types are the current
//! ones (mapped onto them); its `dag` lacks `context-parallel`, so each call
//! runs the current host implementation (`host_impl.rs`: the same budgets,
//! checks and messages) as it is.

use super::bindings::piper::strategy::{dag as d3, log as l3, types as t};
use super::{DagHandle, PluginState};
use wasmtime::component::Resource;

pub(crate) mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/0.3",
        world: "strategy",
        imports: { default: trappable },
        with: {
            "piper:strategy/dag.training-dag": crate::plugin::DagHandle,
            "piper:strategy/types": crate::plugin::bindings::piper::strategy::types,
        },
    });
}

use bindings::piper::strategy::{dag as d2, log as l2};

type R<T> = wasmtime::Result<Result<T, t::DagError>>;
type H = Resource<DagHandle>;

impl d2::Host for PluginState {}

impl d2::HostTrainingDag for PluginState {
    fn split(&mut self, h: H, f: t::Filter, dim: String, n: u32) -> R<()> {
        d3::HostTrainingDag::split(self, h, f, dim, n)
    }
    fn place(&mut self, h: H, f: t::Filter, devices: Vec<u32>, stream: String) -> R<()> {
        d3::HostTrainingDag::place(self, h, f, devices, stream)
    }
    fn replicate(
        &mut self,
        h: H,
        f: t::Filter,
        devices: Vec<u32>,
        o: t::ReplicateOptions,
    ) -> R<()> {
        d3::HostTrainingDag::replicate(self, h, f, devices, o)
    }
    fn shard(&mut self, h: H, f: t::Filter, devices: Vec<u32>, stream: String) -> R<()> {
        d3::HostTrainingDag::shard(self, h, f, devices, stream)
    }
    fn shard_tensor(&mut self, h: H, f: t::Filter, devices: Vec<u32>, stream: String) -> R<()> {
        d3::HostTrainingDag::shard_tensor(self, h, f, devices, stream)
    }
    fn sequence_parallel(&mut self, h: H, f: t::Filter) -> R<u32> {
        d3::HostTrainingDag::sequence_parallel(self, h, f)
    }
    fn order(&mut self, h: H, groups: Vec<Vec<t::Filter>>) -> R<()> {
        d3::HostTrainingDag::order(self, h, groups)
    }
    fn recompute(&mut self, h: H, f: t::Filter, policy: d2::RecomputePolicy) -> R<u32> {
        let policy = match policy {
            d2::RecomputePolicy::Full => d3::RecomputePolicy::Full,
            d2::RecomputePolicy::Selective => d3::RecomputePolicy::Selective,
        };
        d3::HostTrainingDag::recompute(self, h, f, policy)
    }
    fn query(&mut self, h: H, f: t::Filter) -> R<Vec<t::NodeInfo>> {
        d3::HostTrainingDag::query(self, h, f)
    }
    fn query_ids(&mut self, h: H, f: t::Filter) -> R<Vec<u32>> {
        d3::HostTrainingDag::query_ids(self, h, f)
    }
    fn node(&mut self, h: H, id: u32) -> R<t::NodeInfo> {
        d3::HostTrainingDag::node(self, h, id)
    }
    fn neighbours(&mut self, h: H, id: u32) -> R<t::Neighbours> {
        d3::HostTrainingDag::neighbours(self, h, id)
    }
    fn tag_extents(&mut self, h: H) -> wasmtime::Result<Vec<t::Tag>> {
        d3::HostTrainingDag::tag_extents(self, h)
    }
    fn cluster(&mut self, h: H) -> wasmtime::Result<t::ClusterInfo> {
        d3::HostTrainingDag::cluster(self, h)
    }
    fn add_temporal_edge(&mut self, h: H, from: u32, to: u32) -> R<()> {
        d3::HostTrainingDag::add_temporal_edge(self, h, from, to)
    }
    fn set_stream(&mut self, h: H, f: t::Filter, stream: String) -> R<u32> {
        d3::HostTrainingDag::set_stream(self, h, f, stream)
    }
    fn set_priority(&mut self, h: H, f: t::Filter, priority: i32) -> R<u32> {
        d3::HostTrainingDag::set_priority(self, h, f, priority)
    }
    fn drop(&mut self, h: H) -> wasmtime::Result<()> {
        d3::HostTrainingDag::drop(self, h)
    }
}

super::older_world!(l2, l3);
