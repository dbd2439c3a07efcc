//! `dualpipev`: DeepSeek's DualPipeV ("cut-in-half" DualPipe, DeepSeek-V3
//! report and the `dualpipev.py` reference). The model is cut into `2p`
//! stages folded into a V: device `r` of `p` holds stage `r` (on the way
//! down) and stage `2p − 1 − r` (on the way back), so the first device also
//! computes the loss. Its schedule pairs a forward of one stage with a
//! backward of the other (overlapped F&B pairs) in the steady state and
//! defers weight passes into the warm-up and cool-down bubbles. One copy of
//! the parameters, unlike DualPipe.

use piper_sdk::dualpipe::{dual_groups_and_pairs, dual_schedule, interleave_pair};
use piper_sdk::pipeline::{pipeline_options, Layout, Pipeline};
use piper_sdk::{export_strategy, Dag, Error, OptionSpec, Options, PluginInfo, Strategy};

pub struct DualPipeV;

impl Strategy for DualPipeV {
    fn info() -> PluginInfo {
        pipeline_options(
            PluginInfo::new(
            "dualpipev",
            env!("CARGO_PKG_VERSION"),
            "DeepSeek's DualPipeV: V-shaped placement, 2 stages per device, overlapped F&B pairs",
        ),
            "model stages, 2 per device (default: 2 × devices ÷ data-parallel degree)",
            "microbatches per step, at least 2 × devices (default: 2 × stages)",
        )
        .option(OptionSpec::bool(
            "overlap",
            Some("true"),
            "on a model whose expert passes are split into phases (`ep` on a stream of its own), alternate each overlapped pair's forward and backward phase by phase so each all-to-all hides behind the other's compute",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let who = "dualpipev";
        // 1. The V, two stages per device (an even count): stage s < p on
        //    device s, stage s ≥ p on device 2p − 1 − s; enough microbatches.
        let pipe = Pipeline::new(dag, options, Layout::V, who)?;
        let (p, m) = (pipe.positions(), pipe.microbatches);
        if m < 2 * p {
            return Err(Error::msg(format!(
                "{who} needs microbatches ≥ 2·devices: got {m} microbatches for {p} devices"
            )));
        }
        // 2. Microbatches; both stages of each device placed on it.
        pipe.split_place(dag, options)?;
        // 3. Per device: DeepSeek's eight-part schedule; phase 0 is the stage
        //    on the way down, phase 1 the one on the way back.
        //    With `overlap`, each F&B pair alternates phase by phase.
        let overlap = options.bool("overlap")?.unwrap_or(true);
        let all: Vec<u32> = (0..m).collect();
        for r in 0..p {
            let steps = dual_schedule(p, r, m, r == p - 1)?;
            let (groups, pairs) =
                dual_groups_and_pairs(&pipe, &steps, [r, 2 * p - 1 - r], [&all, &all])?;
            dag.order(&groups)?;
            if overlap {
                for pair in pairs {
                    if !interleave_pair(dag, &pipe, pair)? {
                        break;
                    }
                }
            }
        }
        Ok(())
    }
}

export_strategy!(DualPipeV);
