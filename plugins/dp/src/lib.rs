//! `dp`: data parallelism. The whole model is replicated over `degree` devices
//! (default: all of them); gradients are all-reduced in buckets after the last
//! microbatch. Replicas are spread evenly (`degree=2` on 8 devices: [0, 4]) so a
//! pipeline strategy applied next can put stage s on [s, 4 + s], and `tp`
//! (before or after) gives each replica its group ([0, 1] and [4, 5]); the
//! `stride` option spaces them otherwise (`piper_sdk::mesh`).

use piper_sdk::{
    export_strategy, mesh, Dag, Error, Filter, OptionSpec, Options, PluginInfo, ReplicateOptions,
    Strategy,
};

pub struct DataParallel;

impl Strategy for DataParallel {
    fn info() -> PluginInfo {
        PluginInfo::new(
            "dp",
            env!("CARGO_PKG_VERSION"),
            "Data parallelism: replicate the model, all-reduce gradients",
        )
        .option(OptionSpec::int(
            "degree",
            None,
            "data-parallel degree (default: every device)",
        ))
        .option(OptionSpec::int(
            "bucket-bytes",
            Some("26214400"),
            "gradient bucket size in bytes (0: one all-reduce per segment)",
        ))
        .option(OptionSpec::str(
            "stream",
            Some("dp"),
            "stream of the gradient all-reduces",
        ))
        .option(OptionSpec::int(
            "stride",
            None,
            "devices between replicas (default: devices ÷ degree; tp's degree puts replicas next to each other)",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let devices = dag.cluster().devices;
        // 1. The whole model on one group: before any pipeline.
        let tp = mesh::model_group(dag, "dp")?.map_or(1, |g| g.len() as u32);
        let degree = options.u32("degree")?.unwrap_or(devices / tp.max(1));
        let stride = options.u32("stride")?;
        let group = mesh::replica_group("dp", "degree", degree, stride, devices)?;
        let opts = ReplicateOptions {
            bucket_bytes: options.u64("bucket-bytes")?.unwrap_or(25 << 20),
            reduce_stream: options.str("stream")?.unwrap_or("dp").to_string(),
            ..ReplicateOptions::zero(0)
        };
        // 2. Replicate every compute node over the group.
        dag.replicate(&Filter::all(), &group, &opts)?;
        Ok(())
    }
}

export_strategy!(DataParallel);
