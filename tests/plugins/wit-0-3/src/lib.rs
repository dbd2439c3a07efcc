//! A strategy built from source against `piper:strategy@0.3.0`, the contract
//! before `context-parallel` (`wit/0.3/`), with the raw bindings only:
//! tensor parallelism over every device with Megatron-SP (`sequence-
//! parallel`, the 0.3 addition), and with `fail=true` returns a directive's
//! error. The host must load it and plan exactly as the same directives
//! called natively.

#[allow(clippy::all)]
mod bindings {
    wit_bindgen::generate!({ path: "../../../wit/0.3", world: "strategy" });
}

use bindings::piper::strategy::dag::TrainingDag;
use bindings::piper::strategy::log::{log, Level};
use bindings::piper::strategy::types::{DagError, Filter};
use bindings::{Guest, OptionEntry, OptionSpec, OptionType, OptionValue, PluginInfo};

struct OldContract;

fn text(e: DagError) -> String {
    match e {
        DagError::DeviceOutOfRange(m) => format!("device-out-of-range: {m}"),
        other => format!("{other:?}"),
    }
}

impl Guest for OldContract {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "wit-0-3".into(),
            version: "0.3.0".into(),
            description: "built against piper:strategy@0.3.0".into(),
            options: vec![OptionSpec {
                name: "fail".into(),
                type_: OptionType::Bool,
                default: Some("false".into()),
                help: "return a directive's error".into(),
            }],
        }
    }

    fn apply(dag: &TrainingDag, options: Vec<OptionEntry>) -> Result<(), String> {
        let fail = options
            .iter()
            .any(|o| o.name == "fail" && matches!(o.value, OptionValue::Bool(true)));
        let devices = dag.cluster().devices;
        let all = Filter {
            tags: vec![],
            pass: None,
        };
        if fail {
            return dag.shard_tensor(&all, &[devices], "tp").map_err(text);
        }
        let group: Vec<u32> = (0..devices).collect();
        dag.shard_tensor(&all, &group, "tp").map_err(text)?;
        let segments = dag.sequence_parallel(&all).map_err(text)?;
        log(
            Level::Info,
            &format!("{segments} segments sequence-parallel"),
        );
        Ok(())
    }
}

bindings::export!(OldContract with_types_in bindings);
