//! A strategy built from source against `piper:strategy@0.1.0`, the contract
//! before `recompute` (`wit/0.1/`), with the raw bindings only: a GPipe-style
//! pipeline (split into microbatches, region r on device r·devices/regions)
//! that also reads back through every primitive whose types cross the WIT
//! (query, node, neighbours, tag-extents, cluster, log), and with
//! `fail=true` returns a directive's error. The host must load it and plan
//! exactly as the same directives called natively.

#[allow(clippy::all)]
mod bindings {
    wit_bindgen::generate!({ path: "../../../wit/0.1", world: "strategy" });
}

use bindings::piper::strategy::dag::TrainingDag;
use bindings::piper::strategy::log::{log, Level};
use bindings::piper::strategy::types::{DagError, Filter, TagFilter, TagMatch};
use bindings::{Guest, OptionEntry, OptionSpec, OptionType, OptionValue, PluginInfo};

struct OldContract;

fn region(r: u32) -> Filter {
    Filter {
        tags: vec![TagFilter {
            key: "PP".into(),
            value: TagMatch::Index(r),
        }],
        pass: None,
    }
}

fn text(e: DagError) -> String {
    match e {
        DagError::DeviceOutOfRange(m) => format!("device-out-of-range: {m}"),
        other => format!("{other:?}"),
    }
}

impl Guest for OldContract {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "wit-0-1".into(),
            version: "0.1.0".into(),
            description: "built against piper:strategy@0.1.0".into(),
            options: vec![
                OptionSpec {
                    name: "microbatches".into(),
                    type_: OptionType::Int,
                    default: Some("2".into()),
                    help: "microbatches per step".into(),
                },
                OptionSpec {
                    name: "fail".into(),
                    type_: OptionType::Bool,
                    default: Some("false".into()),
                    help: "return a directive's error".into(),
                },
            ],
        }
    }

    fn apply(dag: &TrainingDag, options: Vec<OptionEntry>) -> Result<(), String> {
        let mut mbs = 2u32;
        let mut fail = false;
        for o in options {
            match (o.name.as_str(), o.value) {
                ("microbatches", OptionValue::Int(v)) => mbs = v as u32,
                ("fail", OptionValue::Bool(v)) => fail = v,
                _ => {}
            }
        }
        let devices = dag.cluster().devices;
        if fail {
            return dag.place(&region(0), &[devices], "pp").map_err(text);
        }
        let regions = dag
            .tag_extents()
            .into_iter()
            .find(|t| t.key == "PP")
            .map_or(1, |t| t.index);
        let all = Filter {
            tags: vec![],
            pass: None,
        };
        dag.split(&all, "MB", mbs).map_err(text)?;
        for r in 0..regions {
            dag.place(&region(r), &[r * devices / regions], "pp")
                .map_err(text)?;
        }
        // Read back through the primitives whose records cross the WIT.
        let f0 = Filter {
            pass: Some("F".into()),
            ..region(0)
        };
        let first = dag.query(&f0).map_err(text)?;
        let node = dag.node(first[0].id).map_err(text)?;
        let around = dag.neighbours(node.id).map_err(text)?;
        if node.op != "F" || node.devices != [0] || around.succs.is_empty() {
            return Err(format!(
                "read back {} on {:?} with {} successors",
                node.op,
                node.devices,
                around.succs.len()
            ));
        }
        log(
            Level::Info,
            &format!(
                "{} regions over {devices} devices, {} forwards of region 0",
                regions,
                first.len()
            ),
        );
        Ok(())
    }
}

bindings::export!(OldContract with_types_in bindings);
