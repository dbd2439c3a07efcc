//! `ep`: expert parallelism. The experts of every MoE layer are spread over
//! the devices its expert segment is data-parallel over (EP degree = that
//! DP degree, DeepSpeed-MoE's and Megatron's `ep = dp` layout): device `i` of
//! a group of `n` holds experts `i·E/n … (i+1)·E/n − 1`, tokens travel to
//! their experts and back by all-to-all. Composes with `dp`, `tp` and `cp`
//! (run them first: the experts spread over the whole dp × tp × cp mesh)
//! and the pipeline strategies (before or after): with no data parallelism
//! yet, `ep` replicates the whole model over `ep` devices itself, spread as
//! `dp` spreads them, so a pipeline applied next puts stage s on the group
//! shifted by s.

use piper_sdk::{
    export_strategy, strided_group, Dag, Error, Filter, NodeInfo, OptionSpec, Options, PluginInfo,
    ReplicateOptions, Strategy,
};
use std::collections::BTreeSet;

pub struct ExpertParallel;

impl Strategy for ExpertParallel {
    fn info() -> PluginInfo {
        PluginInfo::new(
            "ep",
            env!("CARGO_PKG_VERSION"),
            "Expert parallelism: spread each MoE layer's experts over its data-parallel group",
        )
        .option(OptionSpec::int(
            "ep",
            None,
            "expert-parallel degree (default: the data-parallel degree, or every device)",
        ))
        .option(OptionSpec::str(
            "stream",
            Some("ep"),
            "stream of the all-to-all exchanges",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let degree = options.u32("ep")?;
        let stream = options.str("stream")?.unwrap_or("ep");
        // 1. The experts: every node of an `EP`-tagged (MoE) segment.
        let experts = dag.query(&Filter::all().any("EP")).map_err(|e| {
            Error::msg(format!(
                "ep needs a mixture-of-experts model (a [moe] table): {}",
                e.message
            ))
        })?;
        // 2. Not data-parallel yet: the whole model replicated over `ep`
        //    devices, spread as `dp` spreads them.
        if experts.iter().all(|n| n.devices.len() <= 1) {
            let devices = dag.cluster().devices;
            let group = strided_group("ep", "ep", degree.unwrap_or(devices), devices)?;
            dag.replicate(&Filter::all(), &group, &ReplicateOptions::zero(0))?;
        }
        // 3. Each MoE layer's experts sharded over the group it is
        //    data-parallel over, tokens exchanged by all-to-all on `stream`.
        for layer in moe_layers(&experts) {
            let layer = Filter::tag("EP", layer);
            let group = dag.query(&layer)?[0].devices.clone();
            check_degree(degree, &group)?;
            dag.shard(&layer, &group, stream)?;
        }
        Ok(())
    }
}

/// The MoE layers (`EP` tag values) the nodes belong to, in order.
fn moe_layers(nodes: &[NodeInfo]) -> BTreeSet<u32> {
    nodes
        .iter()
        .filter_map(|n| n.tags.get("EP").copied())
        .collect()
}

/// An `ep` option must be the experts' data-parallel degree: one EP group
/// per layer (experts replicated over several EP groups are not supported).
fn check_degree(degree: Option<u32>, group: &[u32]) -> Result<(), Error> {
    match degree.filter(|d| *d as usize != group.len()) {
        Some(d) => Err(Error::msg(format!(
            "ep {d} must equal the data-parallel degree of the experts' devices {group:?} ({}); experts replicated over several EP groups are not supported",
            group.len()
        ))),
        None => Ok(()),
    }
}

export_strategy!(ExpertParallel);
