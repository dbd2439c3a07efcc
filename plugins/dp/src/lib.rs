//! `dp`: data parallelism. The whole model is replicated over `degree` devices
//! (default: all of them); gradients are all-reduced in buckets after the last
//! microbatch. Devices are spread evenly (`degree=2` on 8 devices: [0, 4]) so a
//! pipeline strategy applied next can put stage s on [s, 4 + s].

use piper_sdk::{
    export_strategy, strided_group, Dag, Error, Filter, OptionSpec, Options, PluginInfo,
    ReplicateOptions, Strategy,
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
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let devices = dag.cluster().devices;
        let degree = options.u32("degree")?.unwrap_or(devices);
        let group = strided_group("dp", "degree", degree, devices)?;
        let opts = ReplicateOptions {
            bucket_bytes: options.u64("bucket-bytes")?.unwrap_or(25 << 20),
            reduce_stream: options.str("stream")?.unwrap_or("dp").to_string(),
            ..ReplicateOptions::zero(0)
        };
        // Replicate every compute node over the group.
        dag.replicate(&Filter::all(), &group, &opts)?;
        Ok(())
    }
}

export_strategy!(DataParallel);
