//! `gpipe`: pipeline parallelism with the GPipe schedule — every stage runs all
//! its microbatches' forwards, then all their backwards.

use piper_sdk::pipeline::{pipeline_options, Layout, Pipeline};
use piper_sdk::{export_strategy, Dag, Error, Filter, Options, Pass, PluginInfo, Strategy};

pub struct GPipe;

impl Strategy for GPipe {
    fn info() -> PluginInfo {
        pipeline_options(
            PluginInfo::new(
                "gpipe",
                env!("CARGO_PKG_VERSION"),
                "GPipe: all forwards, then all backwards, per stage",
            ),
            "pipeline stages (default: devices ÷ data-parallel degree)",
            "microbatches per step (default: 2 × stages)",
        )
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        // 1. Stages on device groups; 2. microbatches, stages placed.
        let pipe = Pipeline::new(dag, options, Layout::Plain, "gpipe")?;
        pipe.split_place(dag, options)?;
        let mbs = pipe.microbatches;
        // 3. Per stage: F0 … F(m-1), then B0 … B(m-1).
        for s in 0..pipe.stages() {
            let mut groups: Vec<Vec<Filter>> = (0..mbs).map(|m| pipe.step(s, m, Pass::F)).collect();
            groups.extend((0..mbs).map(|m| pipe.step(s, m, Pass::B)));
            dag.order(&groups)?;
        }
        Ok(())
    }
}

export_strategy!(GPipe);
