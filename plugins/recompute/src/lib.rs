//! `recompute`: activation recomputation (Megatron's `--recompute-granularity`,
//! torchtitan's activation checkpointing) as a strategy of its own, composed
//! after the ones that place the model: the chosen `PP` regions' forwards
//! drop their saved tensors and a recompute node (`R`) rebuilds them right
//! before each backward, trading one more forward for the activations.

use piper_sdk::pipeline::{echo, parse_region_list, RegionListError};
use piper_sdk::recompute::{every_region, parse_policy, recompute_regions};
use piper_sdk::{export_strategy, Dag, Error, OptionSpec, Options, PluginInfo, Strategy};

pub struct Recompute;

impl Strategy for Recompute {
    fn info() -> PluginInfo {
        PluginInfo::new(
            "recompute",
            env!("CARGO_PKG_VERSION"),
            "activation recomputation: rerun chosen regions' forwards before their backwards",
        )
        .option(OptionSpec::str(
            "policy",
            Some("full"),
            "full (keep each segment's input) or selective (keep the matmul outputs)",
        ))
        .option(OptionSpec::int(
            "every",
            Some("1"),
            "recompute every n-th PP region (0, n, 2n, …)",
        ))
        .option(OptionSpec::str(
            "regions",
            None,
            "the PP regions to recompute, e.g. 0/2/5 (instead of `every`)",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let who = "recompute";
        let text = options.str("policy")?.unwrap_or("full");
        let Some(policy) = parse_policy(text, "policy", who)? else {
            return Ok(());
        };
        let all = every_region(dag);
        let regions: Vec<u32> = match options.str("regions")? {
            Some(list) => {
                let chosen = parse_regions(list)?;
                if let Some(r) = chosen.iter().find(|r| !all.contains(r)) {
                    return Err(Error::msg(format!(
                        "recompute: region {r} is past the model's {} PP regions",
                        all.len()
                    )));
                }
                chosen
            }
            None => {
                let every = options.u32("every")?.unwrap_or(1);
                if every == 0 {
                    return Err(Error::msg("recompute needs every ≥ 1: got 0"));
                }
                all.into_iter().filter(|r| r % every == 0).collect()
            }
        };
        if recompute_regions(dag, policy, &regions)? == 0 {
            return Err(Error::msg(format!(
                "recompute: no forward of regions {regions:?} could be recomputed (already recomputed, or phases of split expert passes)"
            )));
        }
        Ok(())
    }
}

/// The `regions` option: PP region indices ([`parse_region_list`]: `0/2/5`
/// or `[0, 2, 5]`), each named once.
fn parse_regions(text: &str) -> Result<Vec<u32>, Error> {
    // Past any model's regions long before it costs anything.
    let out = parse_region_list(text, 1 << 16).map_err(|e| match e {
        RegionListError::TooMany => Error::msg("recompute: regions name more than 65536 regions"),
        RegionListError::NotAnIndex(item) => Error::msg(format!(
            "recompute: regions `{}`: `{item}` is not a region index (e.g. `0/2/5`)",
            echo(text)
        )),
    })?;
    let mut seen = std::collections::BTreeSet::new();
    if let Some(r) = out.iter().find(|r| !seen.insert(**r)) {
        return Err(Error::msg(format!(
            "recompute: regions name region {r} twice"
        )));
    }
    Ok(out)
}

export_strategy!(Recompute);
