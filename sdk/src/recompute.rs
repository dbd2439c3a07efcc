//! Activation recomputation as strategies ask for it: which `PP` regions'
//! forwards get a recompute node, read from the options the `recompute`
//! plugin (and the pipeline plugins' `recompute` option) take.

use crate::dag::{Dag, DagErrorKind, RecomputePolicy};
use crate::filter::{Filter, Pass};
use crate::{Error, OptionSpec, Options};

/// The `recompute` option of a pipeline plugin: `none` (default), `full`
/// or `selective`, applied to every region after the schedule is ordered.
pub fn recompute_option() -> OptionSpec {
    OptionSpec::str(
        "recompute",
        Some("none"),
        "activation recomputation after the schedule: none, full (keep each segment's input, rerun its forward before the backward) or selective",
    )
}

/// A policy's text (option `option` of plugin `who`), `none` as `None`.
pub fn parse_policy(text: &str, option: &str, who: &str) -> Result<Option<RecomputePolicy>, Error> {
    match text.trim() {
        "none" => Ok(None),
        t => RecomputePolicy::parse(t).map(Some).ok_or_else(|| {
            Error::msg(format!(
                "{who}: {option} `{}` is not none, full or selective",
                t.chars().take(40).collect::<String>()
            ))
        }),
    }
}

/// Apply a pipeline plugin's `recompute` option (last, after `order`).
pub fn apply_option(dag: &mut dyn Dag, options: &Options, who: &str) -> Result<u32, Error> {
    let text = options.str("recompute")?.unwrap_or("none");
    match parse_policy(text, "recompute", who)? {
        None => Ok(0),
        Some(policy) => {
            let regions = every_region(dag);
            recompute_regions(dag, policy, &regions)
        }
    }
}

/// Every `PP` region of the model.
pub fn every_region(dag: &mut dyn Dag) -> Vec<u32> {
    let n = dag.tag_extents().get("PP").copied().unwrap_or(0);
    (0..n).collect()
}

/// Recompute the forwards of the given `PP` regions; returns how many got
/// a recompute node. Under `full`, a region whose forwards are all phases
/// of a split expert pass (which the host leaves alone) is skipped; any
/// other refusal is the strategy's error.
pub fn recompute_regions(
    dag: &mut dyn Dag,
    policy: RecomputePolicy,
    regions: &[u32],
) -> Result<u32, Error> {
    let mut made = 0u32;
    for &r in regions {
        match dag.recompute(&Filter::tag("PP", r).pass(Pass::F), policy) {
            Ok(n) => made += n,
            Err(e) if e.kind == DagErrorKind::Unsupported && policy == RecomputePolicy::Full => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(made)
}
