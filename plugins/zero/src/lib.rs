//! `zero`: ZeRO data parallelism (DeepSpeed's stages, FSDP's sharding) over a
//! data-parallel group. Stage 1 shards the optimizer states, stage 2 also the
//! gradients (reduce-scattered after every microbatch), stage 3 also the
//! parameters (all-gathered before every forward and backward use). Composes
//! with a pipeline applied after it, like `dp`.

use piper_sdk::{
    export_strategy, strided_group, Dag, Error, Filter, OptionSpec, Options, PluginInfo,
    ReplicateOptions, Strategy,
};

pub struct Zero;

impl Strategy for Zero {
    fn info() -> PluginInfo {
        PluginInfo::new("zero", env!("CARGO_PKG_VERSION"), "ZeRO-1/2/3: shard optimizer states, gradients, parameters over the DP group")
            .option(OptionSpec::int("stage", Some("1"), "ZeRO stage: 0 (plain DP), 1, 2 or 3"))
            .option(OptionSpec::int("dp", None, "data-parallel degree (default: every device)"))
            .option(OptionSpec::int("bucket-bytes", Some("26214400"), "reduction bucket size in bytes (stage 3 reduces per segment)"))
            .option(OptionSpec::bool("reshard-after-forward", Some("true"), "stage 3: free gathered parameters after each use (false: keep them from the first forward to the last backward)"))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let devices = dag.cluster().devices;
        let stage = options.u32("stage")?.unwrap_or(1);
        let degree = options.u32("dp")?.unwrap_or(devices);
        // Preconditions, with the numbers.
        if stage > 3 {
            return Err(Error::msg(format!(
                "zero needs stage 0, 1, 2 or 3: got {stage}"
            )));
        }
        let group = strided_group("zero", "dp", degree, devices)?;
        let opts = ReplicateOptions {
            bucket_bytes: options.u64("bucket-bytes")?.unwrap_or(25 << 20),
            reshard_after_forward: options.bool("reshard-after-forward")?.unwrap_or(true),
            ..ReplicateOptions::zero(stage as u8)
        };
        // Replicate every compute node with the stage's sharding.
        dag.replicate(&Filter::all(), &group, &opts)?;
        Ok(())
    }
}

export_strategy!(Zero);
