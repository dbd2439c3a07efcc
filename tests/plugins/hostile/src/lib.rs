//! A plugin that misbehaves on purpose, chosen by its `mode` option. The host's
//! tests check that each misbehaviour is stopped with a specific message, that
//! the host survives, and that the next plugin runs normally.

use piper_sdk::{
    log, Dag, DagErrorKind, Error, Filter, LogLevel, OptionSpec, Options, Pass, PluginInfo,
    Strategy,
};
use std::hint::black_box;
use std::sync::atomic::{AtomicU32, Ordering};

pub struct Hostile;

/// Survives between runs only if the host reuses instances (it must not).
static RUNS: AtomicU32 = AtomicU32::new(0);

fn recurse(n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    let mut pad = [0u8; 256];
    pad[0] = n as u8;
    black_box(&mut pad);
    1 + recurse(black_box(n - 1)) + pad[0] as u64 % 2
}

/// The normal part: everything on device 0.
fn place_all(dag: &mut dyn Dag) -> Result<(), Error> {
    dag.place(&Filter::all(), &[0], "pp")?;
    Ok(())
}

impl Strategy for Hostile {
    fn info() -> PluginInfo {
        PluginInfo::new(
            "hostile",
            "0.1.0",
            "misbehaves on purpose, for sandbox tests",
        )
        .option(OptionSpec::str(
            "mode",
            Some("ok"),
            "ok | loop | alloc | recurse | panic | error | nomatch | cycle | flood | global \
             | sleep | huge-split | log-flood | print-flood | priority | long-string \
             | long-list | names | path-flood | big-error | wasi-resources \
             | filter-flood | split-chain | tag-flood | query-hoard | alias-args | part-split",
        ))
        .option(OptionSpec::int(
            "calls",
            Some("50000000"),
            "host calls made by mode=flood",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        match options.str("mode")?.unwrap_or("ok") {
            "ok" => place_all(dag),
            "loop" => {
                let mut x = 0u64;
                loop {
                    x = black_box(x.wrapping_add(1));
                }
            }
            "alloc" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(black_box(vec![1u8; 1 << 20]));
                }
            }
            "recurse" => {
                black_box(recurse(black_box(u64::MAX)));
                Ok(())
            }
            "panic" => panic!("hostile plugin panics on purpose"),
            "error" => Err(Error::msg("hostile plugin refuses to plan")),
            "nomatch" => {
                dag.place(&Filter::tag("PP", 999), &[0], "pp")?;
                Ok(())
            }
            "cycle" => {
                place_all(dag)?;
                dag.split(&Filter::all(), "MB", 2)?;
                // The backward of microbatch 0 before its own forward.
                dag.order(&[
                    vec![Filter::tag("PP", 0).and("MB", 0).pass(Pass::B)],
                    vec![Filter::tag("PP", 0).and("MB", 0).pass(Pass::F)],
                ])?;
                Ok(())
            }
            "flood" => {
                let calls = options.u64("calls")?.unwrap_or(50_000_000);
                for _ in 0..calls {
                    black_box(dag.cluster());
                }
                place_all(dag)
            }
            "global" => {
                let seen = RUNS.fetch_add(1, Ordering::SeqCst);
                if seen > 0 {
                    return Err(Error::msg(format!("saw state from {seen} earlier run(s)")));
                }
                place_all(dag)
            }
            // --- the host boundary: legal calls with hostile arguments ---
            "sleep" => {
                // WASI poll on the monotonic clock: must not block the host.
                std::thread::sleep(std::time::Duration::from_secs(3600));
                place_all(dag)
            }
            "huge-split" => {
                dag.split(&Filter::all(), "MB", 4_000_000_000)?;
                place_all(dag)
            }
            "log-flood" => {
                let line = "x".repeat(16 << 20);
                for _ in 0..2000 {
                    log(LogLevel::Info, black_box(&line));
                }
                place_all(dag)
            }
            "print-flood" => {
                let line = "y".repeat(1 << 16);
                for _ in 0..100_000 {
                    println!("{}", black_box(&line));
                }
                place_all(dag)
            }
            "priority" => {
                // Extremes are legal priorities: the plan must still compile.
                place_all(dag)?;
                dag.set_priority(&Filter::all(), i32::MIN)?;
                dag.set_priority(&Filter::all().pass(Pass::B), i32::MAX)?;
                Ok(())
            }
            "long-string" => {
                let name = "s".repeat(10 << 20);
                dag.place(&Filter::all(), &[0], &name)?;
                Ok(())
            }
            "long-list" => {
                let devices = vec![0u32; 4 << 20];
                dag.place(&Filter::all(), &devices, "pp")?;
                Ok(())
            }
            "names" => {
                place_all(dag)?;
                for i in 0..1_000_000u32 {
                    dag.set_stream(&Filter::all().pass(Pass::F), &format!("stream-{i}"))?;
                }
                Ok(())
            }
            "path-flood" => {
                // Each refused temporal edge (it would close a cycle) costs
                // the host a search of the graph; the cycle errors are
                // ignored, the budget's is not.
                place_all(dag)?;
                dag.split(&Filter::all(), "MB", 256)?;
                // Microbatch 0's first forward reaches every one of its
                // backwards.
                let f = dag.query_ids(&Filter::tag("MB", 0).pass(Pass::F))?;
                let b = dag.query_ids(&Filter::tag("MB", 0).pass(Pass::B))?;
                for _ in 0..10_000_000u64 {
                    match black_box(dag.add_temporal_edge(black_box(b[0]), f[0])) {
                        Err(e) if e.kind == DagErrorKind::Cycle => {}
                        other => other?,
                    }
                }
                Ok(())
            }
            "wasi-resources" => {
                // Hold WASI resources (zero-length clock pollables) until the
                // resource table is full: they count against the same cap.
                let mut held = Vec::new();
                for _ in 0..10_000_000u64 {
                    held.push(wasip2::clocks::monotonic_clock::subscribe_duration(0));
                }
                black_box(&held);
                place_all(dag)
            }
            // --- legal calls that make the host hold memory in bulk ---
            "filter-flood" => {
                // One order whose first group is 300 000 filters matching
                // every node: each filter's matches are a list the host makes.
                place_all(dag)?;
                dag.split(&Filter::all(), "MB", 16)?;
                dag.order(&[vec![Filter::all(); 300_000], vec![Filter::all()]])?;
                Ok(())
            }
            "split-chain" => {
                // Doubling splits along new dimensions until the host says no.
                place_all(dag)?;
                for i in 0..64 {
                    dag.split(&Filter::all(), &format!("D{i}"), 2)?;
                }
                Ok(())
            }
            "tag-flood" => {
                // Splits of one copy along 1 000 dimensions: no new nodes,
                // but every node carries every tag (and the index lists them).
                place_all(dag)?;
                dag.split(&Filter::all(), "MB", 1024)?;
                for i in 0..1000 {
                    dag.split(&Filter::all(), &format!("T{i}"), 1)?;
                }
                Ok(())
            }
            "query-hoard" => {
                // Every node's record, again and again, all kept.
                place_all(dag)?;
                dag.split(&Filter::all(), "MB", 64)?;
                let mut hoard = Vec::new();
                for _ in 0..100_000 {
                    hoard.push(dag.query(&Filter::all())?);
                }
                black_box(&hoard);
                Ok(())
            }
            "part-split" => {
                // Microbatch 0 split again on its own: its halves would
                // train rows microbatch 1 trains too (the host refuses it).
                place_all(dag)?;
                dag.split(&Filter::all(), "MB", 2)?;
                dag.split(&Filter::tag("MB", 0), "X", 2)?;
                Ok(())
            }
            "big-error" => {
                // A 16 MiB error message: the host shows a bounded part.
                Err(Error::msg("e".repeat(16 << 20)))
            }
            other => Err(Error::msg(format!("unknown mode `{other}`"))),
        }
    }
}

/// The exports: `Hostile` through the SDK, except `mode=alias-args` and
/// `mode=bad-pass`, which call the raw bindings with arguments the SDK's
/// types cannot make.
struct Export;

impl piper_sdk::bindings::Guest for Export {
    fn info() -> piper_sdk::bindings::PluginInfo {
        piper_sdk::__export::info::<Hostile>()
    }
    fn apply(
        dag: &piper_sdk::bindings::piper::strategy::dag::TrainingDag,
        options: Vec<piper_sdk::bindings::OptionEntry>,
    ) -> Result<(), String> {
        let mode = options.iter().find_map(|o| match &o.value {
            piper_sdk::bindings::OptionValue::Str(m) if o.name == "mode" => Some(m.as_str()),
            _ => None,
        });
        match mode {
            Some("alias-args") => aliased_arguments(dag),
            Some("bad-pass") => unknown_pass(dag),
            _ => piper_sdk::__export::apply::<Hostile>(dag, options),
        }
    }
}

piper_sdk::bindings::export!(Export with_types_in piper_sdk::bindings);

/// One `split` whose filter has 1 Mi tags whose keys all point at the same
/// 4 KiB string: 12 MiB of guest memory that lifting would copy into 4 GiB
/// of host strings.
fn aliased_arguments(
    dag: &piper_sdk::bindings::piper::strategy::dag::TrainingDag,
) -> Result<(), String> {
    use piper_sdk::bindings::piper::strategy::types::{Filter as RawFilter, TagFilter, TagMatch};
    let key = "k".repeat(4096);
    let tags: Vec<TagFilter> = (0..1 << 20)
        .map(|_| TagFilter {
            // SAFETY: never dropped (forgotten below) and never written:
            // only its pointer and length are passed to the host.
            key: unsafe { String::from_raw_parts(key.as_ptr() as *mut u8, key.len(), key.len()) },
            value: TagMatch::Any,
        })
        .collect();
    let filter = RawFilter { tags, pass: None };
    let r = dag.split(&filter, "MB", 2);
    std::mem::forget(filter);
    r.map_err(|e| format!("{e:?}"))
}

/// A `query` whose filter's `PASS` is no node label (the SDK's `Pass` enum
/// cannot say it; the WIT's string can). The host's refusal is returned.
fn unknown_pass(
    dag: &piper_sdk::bindings::piper::strategy::dag::TrainingDag,
) -> Result<(), String> {
    use piper_sdk::bindings::piper::strategy::types::{DagError, Filter as RawFilter};
    let filter = RawFilter {
        tags: Vec::new(),
        pass: Some("forward".into()),
    };
    match dag.query(&filter) {
        Ok(nodes) => Err(format!(
            "the host accepted PASS `forward`: {} nodes",
            nodes.len()
        )),
        Err(DagError::InvalidArgument(m)) => Err(m),
        Err(e) => Err(format!("another refusal than invalid-argument: {e:?}")),
    }
}
