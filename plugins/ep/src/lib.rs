//! `ep`: expert parallelism. The experts of every MoE layer are spread over
//! the devices its expert segment is data-parallel over (EP degree = that
//! DP degree, DeepSpeed-MoE's and Megatron's `ep = dp` layout): device `i` of
//! a group of `n` holds experts `i·E/n … (i+1)·E/n − 1`, tokens travel to
//! their experts and back by all-to-all. Composes with `dp` (run it first)
//! and the pipeline strategies (before or after): with no data parallelism
//! yet, `ep` replicates the whole model over `ep` devices itself, spread as
//! `dp` spreads them, so a pipeline applied next puts stage s on the group
//! shifted by s.

use piper_sdk::{
    export_strategy, strided_group, Dag, Error, Filter, OptionSpec, Options, PluginInfo,
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
        let devices = dag.cluster().devices;
        let degree = options.u32("ep")?;
        let stream = options.str("stream")?.unwrap_or("ep").to_string();
        let experts = Filter::all().any("EP");
        let nodes = dag.query(&experts).map_err(|e| {
            Error::msg(format!(
                "ep needs a mixture-of-experts model (a [moe] table): {}",
                e.message
            ))
        })?;
        // Not data-parallel yet: replicate everything over `ep` devices.
        if nodes.iter().all(|n| n.devices.len() <= 1) {
            let group = strided_group("ep", "ep", degree.unwrap_or(devices), devices)?;
            dag.replicate(&Filter::all(), &group, &ReplicateOptions::zero(0))?;
        }
        // Each MoE layer (EP index) on the group it is data-parallel over.
        let blocks: BTreeSet<u32> = nodes
            .iter()
            .filter_map(|n| n.tags.get("EP").copied())
            .collect();
        for b in blocks {
            let f = Filter::tag("EP", b);
            let group = dag.query(&f)?[0].devices.clone();
            if let Some(d) = degree.filter(|d| *d as usize != group.len()) {
                return Err(Error::msg(format!(
                    "ep {d} must equal the data-parallel degree of the experts' devices {group:?} ({}); experts replicated over several EP groups are not supported",
                    group.len()
                )));
            }
            dag.shard(&f, &group, &stream)?;
        }
        Ok(())
    }
}

export_strategy!(ExpertParallel);
