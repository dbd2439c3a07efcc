//! A strategy compiled against a future major version of the WIT contract
//! (`piper:strategy@1.0.0`). The host accepts 0.1.x and must refuse it at load.

#[allow(clippy::all)]
mod bindings {
    wit_bindgen::generate!({ path: "wit", world: "strategy" });
}

use bindings::piper::strategy::dag::TrainingDag;
use bindings::{Guest, OptionEntry, PluginInfo};

struct FromTheFuture;

impl Guest for FromTheFuture {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "from-the-future".into(),
            version: "1.0.0".into(),
            description: "built against piper:strategy@1.0.0".into(),
            options: vec![],
        }
    }
    fn apply(dag: &TrainingDag, _options: Vec<OptionEntry>) -> Result<(), String> {
        let _ = dag.cluster();
        Ok(())
    }
}

bindings::export!(FromTheFuture with_types_in bindings);
