//! The host boundary under random calls: seeded random directive and
//! primitive sequences (random filters, device lists, counts, priorities and
//! names, extremes and empty values included) on a DAG with a host budget, as
//! a hostile plugin could make them through the WIT. Invariants: the host
//! never panics; every call succeeds or returns a typed error; after a failed
//! call the DAG equals its state before the call in full (`same_state`: node
//! and edge slots, interned names, specs), not only its JSON snapshot; a
//! successful sequence compiles or fails with a typed error.
//!
//! `PIPER_BOUNDARY_SECONDS=N cargo test -p piper --test boundary` runs for N
//! seconds instead of the fixed CI count.

use piper::compile::compile;
use piper::dag::{Cluster, DagBudget, Filter, NodeId, ReplicateOptions, TagMatch, TrainingDag};
use piper::model::ModelConfig;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// xorshift64*: a small seeded generator, so failures replay from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
    /// Small values mostly, extremes sometimes.
    fn u32(&mut self) -> u32 {
        match self.below(10) {
            0 => u32::MAX,
            1 => 0,
            2 => u32::MAX / 2 + 1,
            3..=5 => self.below(4) as u32,
            _ => self.below(64) as u32,
        }
    }
    fn i32(&mut self) -> i32 {
        let any = self.next() as i32;
        *self.pick(&[i32::MIN, i32::MAX, -1, 0, 1, any])
    }
    fn name(&mut self) -> String {
        match self.below(8) {
            0 => String::new(),
            1 => " ".into(),
            2 => "é\u{0}ü".into(),
            3 => "x".repeat(5000),
            _ => self
                .pick(&["MB", "PP", "EP", "PASS", "pp", "dp", "mb2", "compute"])
                .to_string(),
        }
    }
    fn filter(&mut self) -> Filter {
        let mut f = Filter::all();
        for _ in 0..self.below(4) {
            let key = self.name();
            f.tags.push((
                key,
                if self.below(3) == 0 {
                    TagMatch::Any
                } else {
                    TagMatch::Index(self.u32())
                },
            ));
        }
        if self.below(2) == 0 {
            let pass = *self.pick(&[
                "F",
                "B",
                "BI",
                "BW",
                "update",
                "send",
                "all-reduce",
                "marker",
                "Q",
                "",
            ]);
            f.pass = Some(pass.into());
        }
        f
    }
    fn devices(&mut self) -> Vec<u32> {
        match self.below(6) {
            0 => Vec::new(),
            1 => vec![u32::MAX],
            2 => vec![0, 0],
            _ => (0..1 + self.below(4))
                .map(|_| self.below(5) as u32)
                .collect(),
        }
    }
}

/// One random call; `Ok(true)` when it succeeded, `Ok(false)` for a typed
/// error, `Err` with the call for a panic.
fn random_call(rng: &mut Rng, dag: &mut TrainingDag) -> Result<bool, String> {
    let which = rng.below(12);
    let f = rng.filter();
    let what = format!("call {which} with filter {f}");
    let r = catch_unwind(AssertUnwindSafe(|| match which {
        0 => dag.split(&f, &rng.name(), rng.u32()).is_ok(),
        1 => dag.place(&f, &rng.devices(), &rng.name()).is_ok(),
        2 => {
            let o = ReplicateOptions {
                bucket_bytes: *rng.pick(&[0, 1, u64::MAX, 25 << 20]),
                reduce_stream: rng.name(),
                gather_stream: rng.name(),
                ..ReplicateOptions::zero(rng.below(4) as u8)
            };
            dag.replicate(&f, &rng.devices(), &o).is_ok()
        }
        3 => {
            let groups: Vec<Vec<Filter>> = (0..rng.below(5))
                .map(|_| (0..rng.below(3)).map(|_| rng.filter()).collect())
                .collect();
            dag.order(&groups).is_ok()
        }
        4 => dag.query(&f).is_ok(),
        5 => dag.node(NodeId(rng.u32())).is_ok(),
        6 => dag.neighbours(NodeId(rng.u32())).is_ok(),
        7 => dag
            .add_temporal_edge(NodeId(rng.u32()), NodeId(rng.u32()))
            .is_ok(),
        8 => dag.set_stream(&f, &rng.name()).is_ok(),
        9 => dag.set_priority(&f, rng.i32()).is_ok(),
        10 => dag.shard(&f, &rng.devices(), &rng.name()).is_ok(),
        _ => {
            // A well-formed step, so sequences get deep enough to matter.
            let n = 1 + rng.below(4) as u32;
            dag.split(&Filter::all(), &format!("D{}", rng.below(3)), n)
                .is_ok()
                || dag
                    .place(
                        &Filter::tag("PP", rng.below(8) as u32),
                        &[rng.below(4) as u32],
                        "pp",
                    )
                    .is_ok()
        }
    }));
    r.map_err(|_| what)
}

fn state_after_sync(dag: &TrainingDag) -> TrainingDag {
    let mut d = dag.clone();
    d.snapshot();
    d
}

#[test]
fn random_calls_never_panic_and_failed_calls_leave_the_dag_as_it_was() {
    let seconds: Option<u64> = std::env::var("PIPER_BOUNDARY_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok());
    let budget = DagBudget {
        max_nodes: 20_000,
        max_edges: 80_000,
        max_names: 64,
        max_work: 20_000_000,
    };
    let start = Instant::now();
    let (mut calls, mut failed, mut sequences) = (0u64, 0u64, 0u64);
    let mut seed = 0x5eed_u64;
    loop {
        let done = match seconds {
            Some(s) => start.elapsed() > Duration::from_secs(s),
            None => sequences >= 150,
        };
        if done {
            break;
        }
        seed += 1;
        sequences += 1;
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let devices = 1 + rng.below(4) as u32;
        let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(devices)).unwrap();
        dag.set_budget(Some(budget.clone()));
        for _ in 0..20 {
            let before = dag.clone();
            calls += 1;
            match random_call(&mut rng, &mut dag) {
                Err(call) => panic!("seed {seed}: the host panicked on {call}"),
                Ok(true) => {}
                Ok(false) => {
                    failed += 1;
                    assert!(
                        state_after_sync(&dag).same_state(&state_after_sync(&before)),
                        "seed {seed}: a failed call changed the DAG"
                    );
                }
            }
        }
        let compiled = catch_unwind(AssertUnwindSafe(|| {
            let mut d = dag.clone();
            d.set_budget(None);
            let _ = compile(&d);
        }));
        assert!(compiled.is_ok(), "seed {seed}: compile panicked");
    }
    eprintln!("{sequences} sequences, {calls} calls, {failed} typed errors");
    assert!(failed > 0 && failed < calls, "both outcomes are exercised");
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
            .map(|r| Filter::tag("PP", r).and("MB", mb).pass("B"))
            .collect()
    };
    let err = dag
        .order(&[many(0), vec![Filter::tag("MB", 0).pass("F")]])
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
    }));
    let before = dag.clone();
    let t = Instant::now();
    let err = dag
        .split(&Filter::all(), "MB", 4_000_000_000)
        .unwrap_err()
        .to_string();
    assert!(t.elapsed() < Duration::from_millis(500));
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
    dag.set_priority(&Filter::tag("MB", 1).pass("F"), i32::MAX)
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
    assert_eq!(first.op.to_string(), "F");
    assert_eq!(first.tags.get("MB"), Some(&1), "{:?}", first.tags);
}
