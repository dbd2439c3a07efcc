//! The host boundary under random calls: directive and primitive sequences
//! drawn by proptest (random filters, device lists, counts, priorities and
//! names, extremes and empty values included) on a DAG with a host budget, as
//! a hostile plugin could make them through the WIT. Invariants: the host
//! never panics; every call succeeds or returns a typed error; after a failed
//! call the DAG equals its state before the call in full (`same_state`: node
//! and edge slots, interned names, specs), not only its JSON snapshot; a
//! successful sequence compiles or fails with a typed error; and the bytes
//! the host allocates over the whole sequence (a counting global allocator,
//! per thread) stay under `max_bytes` plus a fixed slack.
//!
//! A failing sequence is shrunk to a minimal one and its seed saved in
//! `tests/boundary.proptest-regressions`, replayed first on every later run.
//! `PROPTEST_CASES=N cargo test -p piper --test boundary` runs N sequences
//! instead of the default count.

use piper::compile::compile;
use piper::dag::{
    Cluster, DagBudget, Filter, Label, NodeId, ReplicateOptions, TagMatch, TrainingDag,
    MAX_NAME_BYTES,
};
use piper::model::ModelConfig;
use proptest::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// Counts this thread's live bytes and their peak (tests run on several
/// threads; each measures its own).
struct Counting;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn account(delta: i64) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

// SAFETY: every call forwards to the system allocator unchanged; the
// counters are plain thread-locals that never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            account(l.size() as i64);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            account(l.size() as i64);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        account(-(l.size() as i64));
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            // Old and new both live while the block moves.
            account(new as i64);
            account(-(l.size() as i64));
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// This thread's live bytes now; resets the peak to them.
fn live_and_reset_peak() -> i64 {
    let now = LIVE.with(|l| l.get());
    PEAK.with(|p| p.set(now));
    now
}

fn peak() -> i64 {
    PEAK.with(|p| p.get())
}

/// The budget of the random sequences: small, so splits and orders reach it.
fn budget() -> DagBudget {
    DagBudget {
        max_nodes: 20_000,
        max_edges: 80_000,
        max_names: 64,
        max_work: 20_000_000,
        max_bytes: 4 << 20,
    }
}

/// What the host may allocate beyond `max_bytes` over a sequence: the
/// model and plugin-free bookkeeping, error messages, one call's arguments.
const SLACK: i64 = 2 << 20;

/// One call a plugin could make.
#[derive(Clone, Debug)]
enum Call {
    Split(Filter, String, u32),
    Place(Filter, Vec<u32>, String),
    Replicate(Filter, Vec<u32>, ReplicateOptions),
    Order(Vec<Vec<Filter>>),
    Query(Filter),
    Node(u32),
    Neighbours(u32),
    TemporalEdge(u32, u32),
    SetStream(Filter, String),
    SetPriority(Filter, i32),
    Shard(Filter, Vec<u32>, String),
    ShardTensor(Filter, Vec<u32>, String),
    /// A well-formed split or placement, so sequences get deep enough to
    /// matter.
    Step {
        dim: u32,
        n: u32,
        region: u32,
        device: u32,
    },
}

/// Small values mostly, extremes sometimes.
fn count() -> impl Strategy<Value = u32> {
    prop_oneof![
        1 => Just(u32::MAX),
        1 => Just(0u32),
        1 => Just(u32::MAX / 2 + 1),
        3 => 0..4u32,
        4 => 0..64u32,
    ]
}

fn priority() -> impl Strategy<Value = i32> {
    prop_oneof![
        Just(i32::MIN),
        Just(i32::MAX),
        Just(-1),
        Just(0),
        Just(1),
        any::<i32>()
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => Just(String::new()),
        1 => Just(" ".to_string()),
        1 => Just("é\u{0}ü".to_string()),
        1 => Just("x".repeat(5000)),
        1 => (60..70usize).prop_map(|n| "n".repeat(n)),
        4 => prop::sample::select(vec!["MB", "PP", "EP", "PASS", "pp", "dp", "mb2", "compute"])
            .prop_map(str::to_string),
    ]
}

fn filter() -> impl Strategy<Value = Filter> {
    let tag = (
        name(),
        prop_oneof![1 => Just(TagMatch::Any), 2 => count().prop_map(TagMatch::Index)],
    );
    // Names outside the labels are refused where a string becomes a
    // `Label` (the WIT edge, the filter parser), before the DAG.
    let pass = prop::option::of(prop::sample::select(Label::ALL.to_vec()));
    (prop::collection::vec(tag, 0..4), pass).prop_map(|(tags, pass)| Filter { tags, pass })
}

fn devices() -> impl Strategy<Value = Vec<u32>> {
    prop_oneof![
        1 => Just(Vec::new()),
        1 => Just(vec![u32::MAX]),
        1 => Just(vec![0, 0]),
        3 => prop::collection::vec(0..5u32, 1..5),
    ]
}

fn replicate_options() -> impl Strategy<Value = ReplicateOptions> {
    (
        0..4u8,
        prop::sample::select(vec![0, 1, u64::MAX, 25 << 20]),
        name(),
        name(),
    )
        .prop_map(
            |(zero, bucket_bytes, reduce_stream, gather_stream)| ReplicateOptions {
                bucket_bytes,
                reduce_stream,
                gather_stream,
                ..ReplicateOptions::zero(zero)
            },
        )
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        1 => (filter(), name(), count()).prop_map(|(f, d, n)| Call::Split(f, d, n)),
        1 => (filter(), devices(), name()).prop_map(|(f, d, s)| Call::Place(f, d, s)),
        1 => (filter(), devices(), replicate_options()).prop_map(|(f, d, o)| Call::Replicate(f, d, o)),
        1 => prop::collection::vec(prop::collection::vec(filter(), 0..3), 0..5).prop_map(Call::Order),
        1 => filter().prop_map(Call::Query),
        1 => count().prop_map(Call::Node),
        1 => count().prop_map(Call::Neighbours),
        1 => (count(), count()).prop_map(|(a, b)| Call::TemporalEdge(a, b)),
        1 => (filter(), name()).prop_map(|(f, s)| Call::SetStream(f, s)),
        1 => (filter(), priority()).prop_map(|(f, p)| Call::SetPriority(f, p)),
        1 => (filter(), devices(), name()).prop_map(|(f, d, s)| Call::Shard(f, d, s)),
        1 => (filter(), devices(), name()).prop_map(|(f, d, s)| Call::ShardTensor(f, d, s)),
        3 => (0..3u32, 1..64u32, 0..8u32, 0..4u32)
            .prop_map(|(dim, n, region, device)| Call::Step { dim, n, region, device }),
    ]
}

/// Make the call; whether it succeeded.
fn make(call: &Call, dag: &mut TrainingDag) -> bool {
    match call {
        Call::Split(f, d, n) => dag.split(f, d, *n).is_ok(),
        Call::Place(f, d, s) => dag.place(f, d, s).is_ok(),
        Call::Replicate(f, d, o) => dag.replicate(f, d, o).is_ok(),
        Call::Order(groups) => dag.order(groups).is_ok(),
        Call::Query(f) => dag.query(f).is_ok(),
        Call::Node(id) => dag.node(NodeId(*id)).is_ok(),
        Call::Neighbours(id) => dag.neighbours(NodeId(*id)).is_ok(),
        Call::TemporalEdge(a, b) => dag.add_temporal_edge(NodeId(*a), NodeId(*b)).is_ok(),
        Call::SetStream(f, s) => dag.set_stream(f, s).is_ok(),
        Call::SetPriority(f, p) => dag.set_priority(f, *p).is_ok(),
        Call::Shard(f, d, s) => dag.shard(f, d, s).is_ok(),
        Call::ShardTensor(f, d, s) => dag.shard_tensor(f, d, s).is_ok(),
        Call::Step {
            dim,
            n,
            region,
            device,
        } => {
            dag.split(&Filter::all(), &format!("D{dim}"), *n).is_ok()
                || dag
                    .place(&Filter::tag("PP", *region), &[*device], "pp")
                    .is_ok()
        }
    }
}

fn state_after_sync(dag: &TrainingDag) -> TrainingDag {
    let mut d = dag.clone();
    d.snapshot();
    d
}

/// A DAG of `tiny` on `devices` devices under the test budget.
fn fresh(devices: u32) -> TrainingDag {
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(devices)).unwrap();
    dag.set_budget(Some(budget()));
    dag
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 150,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_calls_never_panic_leave_failed_calls_unseen_and_stay_in_the_byte_budget(
        devices in 1..=4u32,
        calls in prop::collection::vec(call(), 1..20),
    ) {
        // Failed calls leave the DAG as it was; nothing panics.
        let mut dag = fresh(devices);
        let mut outcomes = Vec::new();
        for c in &calls {
            let before = dag.clone();
            dag.begin_call();
            let ok = catch_unwind(AssertUnwindSafe(|| make(c, &mut dag)));
            prop_assert!(ok.is_ok(), "the host panicked on {c:?}");
            let ok = ok.unwrap();
            if !ok {
                prop_assert!(
                    state_after_sync(&dag).same_state(&state_after_sync(&before)),
                    "a failed {c:?} changed the DAG"
                );
            }
            outcomes.push(ok);
        }
        // Every name the calls left in the DAG is a short label.
        let names = dag.tag_names().into_iter().chain(dag.stream_names().iter().cloned());
        for n in names {
            prop_assert!(n.len() <= MAX_NAME_BYTES, "a name of {} bytes was kept", n.len());
        }
        let compiled = catch_unwind(AssertUnwindSafe(|| {
            let mut d = dag.clone();
            d.set_budget(None);
            let _ = compile(&d);
        }));
        prop_assert!(compiled.is_ok(), "compile panicked");
        drop(dag);

        // The same calls again, nothing else held: the host's bytes over
        // the whole sequence stay within the budget and the slack.
        let base = live_and_reset_peak();
        let mut dag = fresh(devices);
        for (c, was) in calls.iter().zip(&outcomes) {
            dag.begin_call();
            prop_assert_eq!(make(c, &mut dag), *was, "{:?} did not replay", c);
        }
        let took = peak() - base;
        prop_assert!(
            took <= budget().max_bytes as i64 + SLACK,
            "the host held {} bytes at its peak, over {} + {SLACK}",
            took,
            budget().max_bytes
        );
    }
}

#[test]
fn a_failed_order_leaves_no_trace_in_the_graph() {
    // A cycle found after planning used to leave removed markers and edges
    // behind (other node ids after the failure); now nothing is added.
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(1)).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.snapshot();
    let before = dag.clone();
    let many = |mb| -> Vec<Filter> {
        (0..8)
            .map(|r| Filter::tag("PP", r).and("MB", mb).pass(Label::B))
            .collect()
    };
    let err = dag
        .order(&[many(0), vec![Filter::tag("MB", 0).pass(Label::F)]])
        .unwrap_err();
    assert!(err.to_string().contains("cycle"), "{err}");
    assert!(dag.same_state(&before));
}

#[test]
fn a_split_past_the_node_budget_is_refused_at_once() {
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(1)).unwrap();
    dag.set_budget(Some(DagBudget {
        max_nodes: 100_000,
        max_edges: 400_000,
        max_names: 64,
        max_work: u64::MAX / 2,
        max_bytes: u64::MAX / 2,
    }));
    let before = dag.clone();
    let t = Instant::now();
    let err = dag
        .split(&Filter::all(), "MB", 4_000_000_000)
        .unwrap_err()
        .to_string();
    // At once, not 4·10⁹ copies later (a busy machine is given slack).
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(
        err.contains("over the host budget `sandbox.max_nodes` = 100000"),
        "{err}"
    );
    assert!(err.contains("split({}, \"MB\", 4000000000)"), "{err}");
    assert!(dag.same_state(&before));
}

#[test]
fn extreme_priorities_compile_in_order() {
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(1)).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.set_priority(&Filter::all(), i32::MIN).unwrap();
    dag.set_priority(&Filter::tag("MB", 1).pass(Label::F), i32::MAX)
        .unwrap();
    let plan = compile(&dag).unwrap();
    // Microbatch 1's forward (highest priority) is ready with microbatch 0's at
    // the start: it runs first.
    let compute = plan.devices[0]
        .streams
        .iter()
        .find(|s| s.stream == "compute")
        .unwrap();
    let first = &compute.ops[0];
    assert_eq!(first.kind().to_string(), "F");
    assert_eq!(first.tags.get("MB"), Some(&1), "{:?}", first.tags);
}

#[test]
fn a_name_past_its_cap_is_refused_in_a_short_message() {
    let mut dag = fresh(2);
    let at_cap = "d".repeat(MAX_NAME_BYTES);
    dag.split(&Filter::all(), &at_cap, 2).unwrap();
    for long in ["e".repeat(MAX_NAME_BYTES + 1), "f".repeat(4 << 20)] {
        let before = dag.clone();
        let errs = [
            dag.split(&Filter::all(), &long, 2).unwrap_err().to_string(),
            dag.place(&Filter::all(), &[0], &long)
                .unwrap_err()
                .to_string(),
            dag.set_stream(&Filter::all(), &long)
                .unwrap_err()
                .to_string(),
        ];
        for e in errs {
            assert!(
                e.contains(&format!("a name of {} bytes", long.len())) && e.contains("name length"),
                "{e}"
            );
            // The name is clipped where the message quotes the call.
            assert!(e.len() < 1024, "a {}-byte error", e.len());
        }
        assert!(dag.same_state(&before));
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    })]

    /// The edge rule: random temporal edges between any two nodes of a
    /// recomputed, split model on one device are each accepted or refused
    /// with the DAG unchanged, and whatever was accepted never orders a
    /// forward after its own backward or after the update.
    #[test]
    fn temporal_edges_never_put_a_forward_after_its_backward_or_update(
        edges in prop::collection::vec((0..4096u32, 0..4096u32), 1..24),
        full in any::<bool>(),
    ) {
        let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(1)).unwrap();
        dag.place(&Filter::all(), &[0], "pp").unwrap();
        dag.split(&Filter::all(), "MB", 2).unwrap();
        let policy = if full {
            piper::dag::RecomputePolicy::Full
        } else {
            piper::dag::RecomputePolicy::Selective
        };
        dag.recompute(&Filter::tag("PP", 7), policy).unwrap();
        dag.snapshot();
        let ids: Vec<NodeId> = dag.query_ids(&Filter::all()).unwrap();
        for (a, b) in edges {
            let (from, to) = (ids[a as usize % ids.len()], ids[b as usize % ids.len()]);
            let before = dag.clone();
            if dag.add_temporal_edge(from, to).is_err() {
                prop_assert!(
                    state_after_sync(&dag).same_state(&state_after_sync(&before)),
                    "a refused edge {from:?} -> {to:?} changed the DAG"
                );
            }
        }
        // No forward is reachable from its own backward or from the update.
        let update = dag.query_ids(&Filter::all().pass(Label::Update)).unwrap();
        for f in dag.query(&Filter::all().pass(Label::F)).unwrap() {
            let (pp, mb) = (f.tags["PP"], f.tags["MB"]);
            let mine = Filter::tag("PP", pp).and("MB", mb);
            // (No edge splits a backward here: a BI is not expected.)
            let mut later = dag.query_ids(&mine.clone().pass(Label::B)).unwrap();
            later.extend(update.iter().copied());
            let mut seen = std::collections::HashSet::new();
            let mut stack = later.clone();
            while let Some(n) = stack.pop() {
                prop_assert!(n != f.id, "F{{PP:{pp},MB:{mb}}} runs after its backward or the update");
                if seen.insert(n) {
                    stack.extend(dag.neighbours(n).unwrap().1.into_iter().map(|x| x.node));
                }
            }
        }
    }
}
