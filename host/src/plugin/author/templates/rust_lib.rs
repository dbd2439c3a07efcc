//! `{{name}}`: a Piper strategy. It starts as the smallest one that runs —
//! every segment on device 0 — for you to grow (see the SDK's docs in
//! `piper-sdk/src/lib.rs`, and the bundled strategies in Piper's `plugins/`).

use piper_sdk::{export_strategy, Dag, Error, Filter, Options, PluginInfo, Strategy};

pub struct Plugin;

impl Strategy for Plugin {
    fn info() -> PluginInfo {
        PluginInfo::new("{{name}}", "0.1.0", "every segment on device 0 (a skeleton to grow)")
    }

    fn apply(dag: &mut dyn Dag, _options: &Options) -> Result<(), Error> {
        dag.place(&Filter::all(), &[0], "pp")?;
        Ok(())
    }
}

export_strategy!(Plugin);
