//! A strategy built from source against `piper:strategy@0.2.0`, the contract
//! before `sequence-parallel` (`wit/0.2/`), with the raw bindings only: a
//! GPipe-style pipeline (split into microbatches, region r on device
//! r·devices/regions) whose forwards get a `recompute` of the policy its
//! option names (the 0.2 addition, whose enum lives in 0.2's `dag`), and
//! with `fail=true` returns a directive's error. The host must load it and
//! plan exactly as the same directives called natively.

#[allow(clippy::all)]
mod bindings {
    wit_bindgen::generate!({ path: "../../../wit/0.2", world: "strategy" });
}

use bindings::piper::strategy::dag::{RecomputePolicy, TrainingDag};
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
        let opt = |name: &str, type_, default: &str, help: &str| OptionSpec {
            name: name.into(),
            type_,
            default: Some(default.into()),
            help: help.into(),
        };
        PluginInfo {
            name: "wit-0-2".into(),
            version: "0.2.0".into(),
            description: "built against piper:strategy@0.2.0".into(),
            options: vec![
                opt(
                    "microbatches",
                    OptionType::Int,
                    "2",
                    "microbatches per step",
                ),
                opt("policy", OptionType::Str, "selective", "full or selective"),
                opt(
                    "fail",
                    OptionType::Bool,
                    "false",
                    "return a directive's error",
                ),
            ],
        }
    }

    fn apply(dag: &TrainingDag, options: Vec<OptionEntry>) -> Result<(), String> {
        let (mut mbs, mut policy, mut fail) = (2u32, RecomputePolicy::Selective, false);
        for o in options {
            match (o.name.as_str(), o.value) {
                ("microbatches", OptionValue::Int(v)) => mbs = v as u32,
                ("policy", OptionValue::Str(v)) if v == "full" => policy = RecomputePolicy::Full,
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
        let forwards = Filter {
            tags: vec![],
            pass: Some("F".into()),
        };
        let made = dag.recompute(&forwards, policy).map_err(text)?;
        log(Level::Info, &format!("{made} forwards recomputed"));
        Ok(())
    }
}

bindings::export!(OldContract with_types_in bindings);
