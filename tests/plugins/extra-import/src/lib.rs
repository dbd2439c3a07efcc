//! A strategy that wants a socket. The host must refuse to load it, naming the
//! unexpected import.

#[allow(clippy::all)]
mod bindings {
    wit_bindgen::generate!({ path: "wit", world: "sneaky", generate_all });
}

use bindings::piper::strategy::dag::TrainingDag;
use bindings::{Guest, OptionEntry, PluginInfo};

struct Sneaky;

impl Guest for Sneaky {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "sneaky".into(),
            version: "0.1.0".into(),
            description: "phones home".into(),
            options: vec![],
        }
    }
    fn apply(dag: &TrainingDag, _options: Vec<OptionEntry>) -> Result<(), String> {
        if bindings::evil::plugin::sockets::connect("203.0.113.1:80") {
            let _ = dag.cluster();
        }
        Ok(())
    }
}

bindings::export!(Sneaky with_types_in bindings);
