//! `tp`: tensor parallelism (Megatron). Every segment runs on a group of
//! `tp` devices, each with `1/tp` of the attention heads and MLP units; the
//! row-parallel outputs and the input gradients of the column-parallel
//! layers are summed over the group. Devices are spread as `dp` spreads
//! them (`tp=2` on 4 devices: [0, 2]), so a pipeline applied next puts
//! stage s on the group shifted by s. Dense segments only (experts: `ep`);
//! not combined with `dp` yet.

use piper_sdk::{
    export_strategy, strided_group, Dag, Error, Filter, OptionSpec, Options, PluginInfo, Strategy,
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
            "tensor-parallel degree (default: every device)",
        ))
        .option(OptionSpec::str(
            "stream",
            Some("tp"),
            "stream of the tensor-parallel all-reduces",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let devices = dag.cluster().devices;
        let degree = options.u32("tp")?.unwrap_or(devices);
        let group = strided_group("tp", "tp", degree, devices)?;
        let stream = options.str("stream")?.unwrap_or("tp");
        dag.shard_tensor(&Filter::all(), &group, stream)?;
        Ok(())
    }
}

export_strategy!(TensorParallel);
