//! `cp`: context parallelism (Megatron's `--context-parallel-size`,
//! torchtitan's `context_parallel_degree`). Each replica of the model (its
//! tensor-parallel group, or its device) becomes `cp` replicas, `tp` devices
//! apart, that run one batch share together: every sequence is cut into
//! `2·cp` chunks and replica `r` holds chunks `r` and `2·cp − 1 − r` (the
//! causal triangle's work spread evenly). Attention meets the group's keys
//! and values around a ring (`exchange=ring`, the default: each block passed
//! on while the one in hand is attended to) or all-gathered
//! (`exchange=all-gather`); everything else runs on the replica's own
//! tokens. Gradients are reduced
//! over the data- and context-parallel replicas together.
//!
//! Composes on the device mesh of `piper_sdk::mesh`: apply `tp` first (its
//! groups stay innermost), then `cp`, then `dp` or `zero` (either side of
//! `cp`: each data-parallel replica gets the whole tp × cp block), then
//! `ep` on a MoE model (its experts spread over the dp × cp mesh), a
//! pipeline and `recompute`. The model must run the memory-efficient
//! attention (`attention = "flash"`, or `auto` above 1024 tokens) and its
//! sequence length divide by `2·cp`.

use piper_sdk::{
    export_strategy, mesh, Dag, Error, Filter, KvExchange, OptionSpec, Options, PluginInfo,
    Strategy,
};

pub struct ContextParallel;

impl Strategy for ContextParallel {
    fn info() -> PluginInfo {
        PluginInfo::new(
            "cp",
            env!("CARGO_PKG_VERSION"),
            "Context parallelism: split every sequence over a group, attention gathering keys and values",
        )
        .option(OptionSpec::int(
            "cp",
            None,
            "context-parallel degree (default: every device the model's group leaves)",
        ))
        .option(OptionSpec::str(
            "exchange",
            Some("ring"),
            "how the ranks meet each other's keys and values: `ring` (passed on while the block in hand is attended to) or `all-gather`",
        ))
        .option(OptionSpec::str(
            "stream",
            Some("cp"),
            "stream of the context-parallel exchanges",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let devices = dag.cluster().devices;
        // 1. The model on one group (tp and dp before are fine).
        let group = mesh::model_group(dag, "cp")?.map_or(1, |g| g.len() as u32);
        let degree = options.u32("cp")?.unwrap_or(devices / group.max(1));
        if degree == 0 || group.saturating_mul(degree) > devices {
            return Err(Error::msg(format!(
                "cp = {degree} over a model group of {group} devices does not fit the {devices} devices: give cp between 1 and {}",
                devices / group.max(1)
            )));
        }
        // 2. Each replica's sequences over `degree` replicas, laid `tp`
        //    devices apart by the host.
        let stream = options.str("stream")?.unwrap_or("cp");
        let how = options.str("exchange")?.unwrap_or("ring");
        let exchange = KvExchange::parse(how).ok_or_else(|| {
            Error::msg(format!("exchange = {how:?}: give `ring` or `all-gather`"))
        })?;
        dag.context_parallel(&Filter::all(), degree, exchange, stream)?;
        Ok(())
    }
}

export_strategy!(ContextParallel);
