//! `{{name}}`: a Piper strategy. It starts as the smallest one that runs on
//! any number of devices — data parallelism over all of them — for you to
//! grow (see the SDK's docs in `piper-sdk/src/lib.rs`, and the bundled
//! strategies in Piper's `plugins/`).

use piper_sdk::{
    export_strategy, Dag, Error, Filter, Options, PluginInfo, ReplicateOptions, Strategy,
};

pub struct Plugin;

impl Strategy for Plugin {
    fn info() -> PluginInfo {
        PluginInfo::new(
            "{{name}}",
            "0.1.0",
            "data parallelism over every device (a skeleton to grow)",
        )
    }

    fn apply(dag: &mut dyn Dag, _options: &Options) -> Result<(), Error> {
        let devices: Vec<u32> = (0..dag.cluster().devices).collect();
        dag.replicate(&Filter::all(), &devices, &ReplicateOptions::default())?;
        Ok(())
    }
}

export_strategy!(Plugin);
