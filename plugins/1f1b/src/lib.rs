//! `1f1b`: pipeline parallelism with the one-forward-one-backward schedule
//! (PipeDream-Flush, Megatron's default). Stage s of p runs p − s − 1 warm-up
//! forwards, then alternates one forward and one backward, then drains the
//! remaining backwards: at most p − s microbatches of activations are alive.

use piper_sdk::pipeline::{pipeline_options, Layout, Pipeline};
use piper_sdk::{export_strategy, Dag, Error, Filter, Options, Pass, PluginInfo, Strategy};

pub struct OneFOneB;

/// The 1F1B order of stage `s` of `p` over `m` microbatches, as (pass, microbatch).
pub fn schedule(p: u32, s: u32, m: u32) -> Vec<(Pass, u32)> {
    let warmup = (p - s - 1).min(m);
    let mut steps: Vec<(Pass, u32)> = (0..warmup).map(|i| (Pass::F, i)).collect();
    for i in 0..m - warmup {
        steps.push((Pass::F, warmup + i));
        steps.push((Pass::B, i));
    }
    steps.extend((m - warmup..m).map(|i| (Pass::B, i)));
    steps
}

impl Strategy for OneFOneB {
    fn info() -> PluginInfo {
        pipeline_options(
            PluginInfo::new(
                "1f1b",
                env!("CARGO_PKG_VERSION"),
                "1F1B pipeline schedule (PipeDream-Flush)",
            ),
            "pipeline stages (default: devices ÷ data-parallel degree)",
            "microbatches per step (default: 2 × stages)",
        )
        .option(piper_sdk::recompute::recompute_option())
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        // 1. Stages on device groups; 2. microbatches, stages placed.
        let pipe = Pipeline::new(dag, options, Layout::Plain, "1f1b")?;
        pipe.split_place(dag, options)?;
        let (p, mbs) = (pipe.stages(), pipe.microbatches);
        // 3. Per stage: warm-up forwards, 1F1B steady state, cool-down backwards.
        for s in 0..p {
            let groups: Vec<Vec<Filter>> = schedule(p, s, mbs)
                .into_iter()
                .map(|(pass, m)| pipe.step(s, m, pass))
                .collect();
            dag.order(&groups)?;
        }
        // 4. Megatron's `--recompute-granularity`, if asked for.
        piper_sdk::recompute::apply_option(dag, options, "1f1b")?;
        Ok(())
    }
}

export_strategy!(OneFOneB);
