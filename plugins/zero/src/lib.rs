//! `zero`: ZeRO data parallelism (DeepSpeed's stages, FSDP's sharding) over a
//! data-parallel group. Stage 1 shards the optimizer states, stage 2 also the
//! gradients (reduce-scattered after every microbatch), stage 3 also the
//! parameters (all-gathered before every forward and backward use). Composes
//! like `dp`: with a pipeline applied after it and with `tp` in either order
//! (each tensor-parallel rank shards over its own replicas, as Megatron's
//! distributed optimizer and FSDP × TP do).

use piper_sdk::{
    export_strategy, mesh, Dag, Error, Filter, OptionSpec, Options, PluginInfo, ReplicateOptions,
    Strategy,
};

pub struct Zero;

impl Strategy for Zero {
    fn info() -> PluginInfo {
        PluginInfo::new("zero", env!("CARGO_PKG_VERSION"), "ZeRO-1/2/3: shard optimizer states, gradients, parameters over the DP group")
            .option(OptionSpec::int("stage", Some("1"), "ZeRO stage: 0 (plain DP), 1, 2 or 3"))
            .option(OptionSpec::int("dp", None, "data-parallel degree (default: every device)"))
            .option(OptionSpec::int("bucket-bytes", Some("26214400"), "reduction bucket size in bytes (stage 3 reduces per segment)"))
            .option(OptionSpec::bool("reshard-after-forward", Some("true"), "stage 3: free gathered parameters after each use (false: keep them from the first forward to the last backward)"))
            .option(OptionSpec::int("stride", None, "devices between replicas (default: devices ÷ dp; tp's degree puts replicas next to each other)"))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let devices = dag.cluster().devices;
        let stage = options.u32("stage")?.unwrap_or(1);
        let tp = mesh::model_group(dag, "zero")?.map_or(1, |g| g.len() as u32);
        let degree = options.u32("dp")?.unwrap_or(devices / tp.max(1));
        // Preconditions, with the numbers.
        if stage > 3 {
            return Err(Error::msg(format!(
                "zero needs stage 0, 1, 2 or 3: got {stage}"
            )));
        }
        let group = mesh::replica_group("zero", "dp", degree, options.u32("stride")?, devices)?;
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
