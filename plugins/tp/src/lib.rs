//! `tp`: tensor parallelism (Megatron). Every segment runs on a group of
//! `tp` consecutive devices (inside a node: `tp=2` is [0, 1]), each with
//! `1/tp` of the attention heads and MLP units; the row-parallel outputs
//! and the input gradients of the column-parallel layers are summed over
//! the group. Composes with `dp` and `zero` in either order (each replica
//! gets its own group, gradients are reduced over each rank's replicas)
//! and with a pipeline applied after it (stage s on the groups shifted by
//! s·tp): the device mesh of `piper_sdk::mesh`. On a MoE model the expert
//! halves join the mesh and split each replica's sequences over the group:
//! apply `ep` next to spread their experts over the whole mesh. With
//! `sequence-parallel=true` (Megatron-SP) the norms and the residual stream
//! inside each segment split along the tokens over the group too, the
//! all-reduces becoming all-gathers and reduce-scatters.

use piper_sdk::{
    export_strategy, mesh, Dag, Error, Filter, OptionSpec, Options, PluginInfo, Strategy,
};

pub struct TensorParallel;

impl Strategy for TensorParallel {
    fn info() -> PluginInfo {
        PluginInfo::new(
            "tp",
            env!("CARGO_PKG_VERSION"),
            "Tensor parallelism: split attention heads and MLP units over a group",
        )
        .option(OptionSpec::int(
            "tp",
            None,
            "tensor-parallel degree (default: every device of a data-parallel replica)",
        ))
        .option(OptionSpec::str(
            "stream",
            Some("tp"),
            "stream of the tensor-parallel all-reduces",
        ))
        .option(OptionSpec::bool(
            "sequence-parallel",
            Some("false"),
            "Megatron-SP: norms and the residual stream split along the tokens over the group (all-gather / reduce-scatter instead of all-reduce)",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let devices = dag.cluster().devices;
        // 1. The model on one group (data parallelism before is fine).
        let replicas = mesh::model_group(dag, "tp")?.map_or(1, |g| g.len() as u32);
        let degree = options.u32("tp")?.unwrap_or(devices / replicas.max(1));
        // 2. Heads and MLP units over `degree` consecutive devices, laid on
        //    every data-parallel replica by the host.
        let group = mesh::contiguous_group("tp", "tp", degree, devices)?;
        let stream = options.str("stream")?.unwrap_or("tp");
        dag.shard_tensor(&Filter::all(), &group, stream)?;
        if options.bool("sequence-parallel")?.unwrap_or(false) && degree > 1 {
            dag.sequence_parallel(&Filter::all())?;
        }
        Ok(())
    }
}

export_strategy!(TensorParallel);
