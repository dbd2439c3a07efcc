//! The strategy fuzzer: random strategies from the whole directive
//! vocabulary (split, place, replicate at every ZeRO stage, shard,
//! shard-tensor, sequence-parallel, context-parallel with both exchanges,
//! recompute with both policies, order, set-stream, set-priority, temporal
//! edges) over random region subsets, device lists and streams, on the tiny
//! GPT-2, Llama and MoE models, on 1–8 devices. The property: the host
//! refuses with a clean error, or the plan trains 2 steps at one device's
//! losses and step-1 gradients (1e-5), with no panic and no hang (every
//! wait is bounded). A plan whose measured peak passes its planned one is
//! counted apart ([`Outcome::OverPeak`]) and held to 3% of the plans that
//! train: the plan's memory follows compile's order of each device's ops,
//! and the runtime may interleave its streams otherwise.
//!
//! The cases come from proptest: seeded and reproducible, and a failing case
//! shrinks and prints as a Rust strategy (the `Debug` of a [`Program`]) to
//! paste into a test. The test command runs [`CASES`] cases from a fixed
//! seed (about a minute here); `PROPTEST_CASES=N` runs more, and `cargo bench -p piper
//! --bench fuzz` runs thousands and prints the rates.

use piper::compile::compile;
use piper::dag::{
    Cluster, Filter, KvExchange, Label, NodeId, RecomputePolicy, ReplicateOptions, TrainingDag,
};
use piper::model::{ModelConfig, MoeConfig};
use piper::verify::{Baseline, VerifyError};
use proptest::prelude::*;
use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Cases the test command runs.
pub const CASES: u32 = 1500;

/// Steps each plan trains beside one device.
const STEPS: u32 = 2;

/// The models: tiny GPT-2, tiny Llama, tiny GPT-2 with a dropless MoE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    Gpt2,
    Llama,
    Moe,
}

impl Model {
    pub fn config(self) -> ModelConfig {
        // Fewer layers than `tiny`'s 8 (4 regions): every layout still has
        // regions to differ between, and a step stays a few milliseconds.
        let small = |m: ModelConfig| ModelConfig {
            layers: 4,
            batch_size: 16,
            seq_len: 32,
            attention: piper::model::Attention::Flash,
            ..m
        };
        match self {
            Model::Gpt2 => small(ModelConfig::tiny()),
            Model::Llama => small(ModelConfig::llama_tiny()),
            Model::Moe => {
                let mut moe = MoeConfig::new(4, 2);
                moe.hidden = Some(64);
                small(ModelConfig {
                    name: "tiny-moe-dropless".into(),
                    moe: Some(moe),
                    ..ModelConfig::tiny()
                })
            }
        }
    }
}

/// One directive or primitive call, with its arguments.
#[derive(Clone, PartialEq)]
pub enum Call {
    Split {
        f: F,
        n: u32,
    },
    Place {
        f: F,
        devices: Vec<u32>,
        stream: &'static str,
    },
    Replicate {
        f: F,
        devices: Vec<u32>,
        zero: u8,
    },
    Shard {
        f: F,
        devices: Vec<u32>,
        stream: &'static str,
    },
    ShardTensor {
        f: F,
        devices: Vec<u32>,
    },
    SequenceParallel {
        f: F,
    },
    ContextParallel {
        f: F,
        degree: u32,
        ring: bool,
    },
    Recompute {
        f: F,
        full: bool,
    },
    Order {
        groups: Vec<Vec<F>>,
    },
    SetStream {
        f: F,
        stream: &'static str,
    },
    SetPriority {
        f: F,
        priority: i32,
    },
    /// A temporal edge from the `a`-th node `from` matches to the `b`-th
    /// `to` matches (indices wrap).
    Temporal {
        from: F,
        a: u32,
        to: F,
        b: u32,
    },
}

/// A filter: tag values (`PP`, `MB`) and an optional pass.
#[derive(Clone, PartialEq)]
pub struct F {
    pub pp: Option<u32>,
    pub mb: Option<u32>,
    pub pass: Option<Label>,
    /// Only the expert segments' nodes (any `EP` value).
    pub ep: bool,
}

impl F {
    pub fn all() -> Self {
        F {
            pp: None,
            mb: None,
            pass: None,
            ep: false,
        }
    }
    pub fn pp(r: u32) -> Self {
        F {
            pp: Some(r),
            ..F::all()
        }
    }
    fn filter(&self) -> Filter {
        let mut f = Filter::all();
        if let Some(r) = self.pp {
            f = f.and("PP", r);
        }
        if let Some(m) = self.mb {
            f = f.and("MB", m);
        }
        if self.ep {
            f = f.any("EP");
        }
        if let Some(p) = self.pass {
            f = f.pass(p);
        }
        f
    }
}

impl fmt::Debug for F {
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = "Filter::all()".to_string();
        if let Some(r) = self.pp {
            s.push_str(&format!(".and(\"PP\", {r})"));
        }
        if let Some(m) = self.mb {
            s.push_str(&format!(".and(\"MB\", {m})"));
        }
        if self.ep {
            s.push_str(".any(\"EP\")");
        }
        if let Some(p) = self.pass {
            s.push_str(&format!(".pass(Label::{p:?})"));
        }
        out.write_str(&s)
    }
}

impl fmt::Debug for Call {
    /// The call as a line of a Rust strategy on `dag: &mut TrainingDag`.
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Call::Split { f, n } => write!(out, "dag.split(&{f:?}, \"MB\", {n})?;"),
            Call::Place { f, devices, stream } => {
                write!(out, "dag.place(&{f:?}, &{devices:?}, {stream:?})?;")
            }
            Call::Replicate { f, devices, zero } => write!(
                out,
                "dag.replicate(&{f:?}, &{devices:?}, &ReplicateOptions::zero({zero}))?;"
            ),
            Call::Shard { f, devices, stream } => {
                write!(out, "dag.shard(&{f:?}, &{devices:?}, {stream:?})?;")
            }
            Call::ShardTensor { f, devices } => {
                write!(out, "dag.shard_tensor(&{f:?}, &{devices:?}, \"tp\")?;")
            }
            Call::SequenceParallel { f } => write!(out, "dag.sequence_parallel(&{f:?})?;"),
            Call::ContextParallel { f, degree, ring } => write!(
                out,
                "dag.context_parallel(&{f:?}, {degree}, KvExchange::{}, \"cp\")?;",
                if *ring { "Ring" } else { "AllGather" }
            ),
            Call::Recompute { f, full } => write!(
                out,
                "dag.recompute(&{f:?}, RecomputePolicy::{})?;",
                if *full { "Full" } else { "Selective" }
            ),
            Call::Order { groups } => {
                let groups: Vec<String> = groups
                    .iter()
                    .map(|g| {
                        let fs: Vec<String> = g.iter().map(|f| format!("{f:?}")).collect();
                        format!("vec![{}]", fs.join(", "))
                    })
                    .collect();
                write!(out, "dag.order(&[{}])?;", groups.join(", "))
            }
            Call::SetStream { f, stream } => write!(out, "dag.set_stream(&{f:?}, {stream:?})?;"),
            Call::SetPriority { f, priority } => {
                write!(out, "dag.set_priority(&{f:?}, {priority})?;")
            }
            Call::Temporal { from, a, to, b } => write!(
                out,
                "{{ let (x, y) = (dag.query_ids(&{from:?})?, dag.query_ids(&{to:?})?); dag.add_temporal_edge(x[{a} % x.len()], y[{b} % y.len()])?; }}"
            ),
        }
    }
}

/// A strategy: its model, cluster and calls.
#[derive(Clone)]
pub struct Program {
    pub model: Model,
    pub devices: u32,
    pub calls: Vec<Call>,
}

impl fmt::Debug for Program {
    /// The whole strategy as Rust to paste into a test.
    fn fmt(&self, out: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(out, "// {:?} on {} devices", self.model, self.devices)?;
        writeln!(
            out,
            "let mut dag = TrainingDag::build(&Model::{:?}.config(), Cluster::new({}))?;",
            self.model, self.devices
        )?;
        for c in &self.calls {
            writeln!(out, "{c:?}")?;
        }
        Ok(())
    }
}

/// What the host made of a strategy.
#[derive(Debug)]
pub enum Outcome {
    /// A directive refused it (a clean error naming the call).
    Refused(String),
    /// Compile refused the DAG it left (a clean error naming what).
    NotCompiled(String),
    /// It trained at one device's numbers.
    Ran,
    /// It trained at one device's numbers, but a device's measured peak
    /// passed the plan's (by more than `verify::PEAK_SLACK`): the plan's
    /// memory follows the order compile built, and the runtime interleaved
    /// the device's streams otherwise.
    OverPeak(String),
    /// It broke the property: the reason.
    Failed(String),
}

impl Program {
    /// Apply every call in turn.
    pub fn apply(&self, dag: &mut TrainingDag) -> Result<(), piper::dag::DagError> {
        for c in &self.calls {
            match c {
                Call::Split { f, n } => dag.split(&f.filter(), "MB", *n)?,
                Call::Place { f, devices, stream } => dag.place(&f.filter(), devices, stream)?,
                Call::Replicate { f, devices, zero } => {
                    dag.replicate(&f.filter(), devices, &ReplicateOptions::zero(*zero))?
                }
                Call::Shard { f, devices, stream } => dag.shard(&f.filter(), devices, stream)?,
                Call::ShardTensor { f, devices } => dag.shard_tensor(&f.filter(), devices, "tp")?,
                Call::SequenceParallel { f } => {
                    dag.sequence_parallel(&f.filter())?;
                }
                Call::ContextParallel { f, degree, ring } => {
                    let how = if *ring {
                        KvExchange::Ring
                    } else {
                        KvExchange::AllGather
                    };
                    dag.context_parallel(&f.filter(), *degree, how, "cp")?;
                }
                Call::Recompute { f, full } => {
                    let policy = if *full {
                        RecomputePolicy::Full
                    } else {
                        RecomputePolicy::Selective
                    };
                    dag.recompute(&f.filter(), policy)?;
                }
                Call::Order { groups } => {
                    let g: Vec<Vec<Filter>> = groups
                        .iter()
                        .map(|g| g.iter().map(F::filter).collect())
                        .collect();
                    dag.order(&g)?
                }
                Call::SetStream { f, stream } => {
                    dag.set_stream(&f.filter(), stream)?;
                }
                Call::SetPriority { f, priority } => {
                    dag.set_priority(&f.filter(), *priority)?;
                }
                Call::Temporal { from, a, to, b } => {
                    let x: Vec<NodeId> = dag.query_ids(&from.filter())?;
                    let y: Vec<NodeId> = dag.query_ids(&to.filter())?;
                    if let (false, false) = (x.is_empty(), y.is_empty()) {
                        let (u, v) = (x[*a as usize % x.len()], y[*b as usize % y.len()]);
                        dag.add_temporal_edge(u, v)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Run the property on this strategy.
    pub fn run(&self) -> Outcome {
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_inner()));
        match caught {
            Ok(o) => o,
            Err(p) => Outcome::Failed(format!("panicked: {}", panic_text(&p))),
        }
    }

    fn run_inner(&self) -> Outcome {
        let cfg = self.model.config();
        let mut dag = match TrainingDag::build(&cfg, Cluster::new(self.devices)) {
            Ok(d) => d,
            Err(e) => return Outcome::Failed(format!("the model does not build: {e}")),
        };
        if let Err(e) = self.apply(&mut dag) {
            return Outcome::Refused(e.to_string());
        }
        let plan = match compile(&dag) {
            Ok(p) => p,
            Err(e) => return Outcome::NotCompiled(e.to_string()),
        };
        let base = baseline(self.model);
        match base.check(plan, Some(Duration::from_secs(30))) {
            Ok(v) => match v.failure() {
                None => Outcome::Ran,
                // Right numbers, but a device passed its planned peak.
                Some(why)
                    if v.missing.is_empty()
                        && v.grad_diff <= piper::verify::TOLERANCE
                        && v.loss_diff <= piper::verify::TOLERANCE =>
                {
                    Outcome::OverPeak(format!("{} {why}", cfg.name))
                }
                Some(why) => Outcome::Failed(format!("the plan compiled, but {} {why}", cfg.name)),
            },
            Err(e @ VerifyError::Run { .. }) => {
                Outcome::Failed(format!("the plan compiled, but training failed: {e}"))
            }
            Err(e) => Outcome::Failed(format!("the plan compiled, but: {e}")),
        }
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}

/// Each model's one-device run, trained once per process.
fn baseline(m: Model) -> &'static Baseline {
    static BASES: OnceLock<Mutex<Vec<(Model, &'static Baseline)>>> = OnceLock::new();
    let bases = BASES.get_or_init(|| Mutex::new(Vec::new()));
    let mut list = bases.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, b)) = list.iter().find(|(k, _)| *k == m) {
        return b;
    }
    let b: &'static Baseline = Box::leak(Box::new(
        Baseline::of(&m.config(), STEPS).expect("one device trains"),
    ));
    list.push((m, b));
    b
}

/// How a region (or a run of regions) lays out its tensors.
#[derive(Clone, Copy, Debug)]
enum Layout {
    Place,
    Replicate { zero: u8 },
    Tensor { sp: bool },
    Context { ring: bool, zero: u8 },
    Experts { zero: u8 },
}

/// A stage: consecutive regions on one device list with one layout.
#[derive(Clone, Debug)]
struct Stage {
    regions: u32,
    devices: Vec<u32>,
    layout: Layout,
}

fn layout(model: Model, devices: u32) -> impl Strategy<Value = Layout> {
    let context = (any::<bool>(), 0u8..=1).prop_map(|(ring, zero)| Layout::Context { ring, zero });
    let experts = (0u8..=1).prop_map(|zero| Layout::Experts { zero });
    // Layouts that cannot apply (experts without a MoE, context
    // parallelism on one device) come rarely: their refusals are tested,
    // but a case refused proves less than one that trains.
    let (c, e) = (
        if devices > 1 { 2 } else { 0 },
        if model == Model::Moe { 2 } else { 0 },
    );
    prop_oneof![
        2 => Just(Layout::Place),
        2 => (0u8..=3).prop_map(|zero| Layout::Replicate { zero }),
        2 => any::<bool>().prop_map(|sp| Layout::Tensor { sp }),
        c + 1 => context,
        e + 1 => experts,
    ]
}

/// A device list: all of them, a contiguous run, or any subsequence, cut
/// to a power-of-two length (heads, experts and the batch divide by it)
/// most of the time.
fn device_list(devices: u32) -> impl Strategy<Value = Vec<u32>> {
    let all: Vec<u32> = (0..devices).collect();
    (
        prop_oneof![
            Just(all.clone()),
            (0..devices, 1..=devices).prop_map(move |(a, n)| (a..(a + n).min(devices)).collect()),
            proptest::sample::subsequence(all, 1..=devices as usize),
        ],
        proptest::bool::weighted(0.8),
    )
        .prop_map(|(mut list, pow2): (Vec<u32>, bool)| {
            if pow2 {
                let keep = 1usize << list.len().ilog2();
                list.truncate(keep);
            }
            list
        })
}

fn stage(model: Model, devices: u32) -> impl Strategy<Value = Stage> {
    (1u32..=2, device_list(devices), layout(model, devices)).prop_map(
        |(regions, devices, layout)| Stage {
            regions,
            devices,
            layout,
        },
    )
}

/// The calls that give `stage` (its first region `r0`) its layout; the
/// highest device they place anything on.
fn lay_out(calls: &mut Vec<Call>, stage: &Stage, r0: u32, regions: u32, cluster: u32) -> u32 {
    let mut top = 0;
    for r in r0..(r0 + stage.regions).min(regions) {
        let f = F::pp(r);
        let devices = stage.devices.clone();
        top = top.max(*devices.iter().max().unwrap_or(&0));
        match stage.layout {
            Layout::Place => calls.push(Call::Place {
                f,
                devices: vec![devices[0]],
                stream: "pp",
            }),
            Layout::Replicate { zero } => calls.push(Call::Replicate { f, devices, zero }),
            Layout::Tensor { sp } => {
                calls.push(Call::ShardTensor {
                    f: f.clone(),
                    devices,
                });
                if sp {
                    calls.push(Call::SequenceParallel { f });
                }
            }
            Layout::Context { ring, zero } => {
                // Context parallelism pairs each replica's device `d` with
                // `d + 1`: the list's even devices with a neighbour are
                // the replicas (its first one if it has none).
                let even: Vec<u32> = devices
                    .iter()
                    .copied()
                    .filter(|d| d % 2 == 0 && d + 1 < cluster)
                    .collect();
                let devices = if even.is_empty() {
                    vec![devices[0]]
                } else {
                    even
                };
                top = top.max(devices.iter().max().unwrap_or(&0) + 1);
                calls.push(Call::Replicate {
                    f: f.clone(),
                    devices,
                    zero,
                });
                calls.push(Call::ContextParallel { f, degree: 2, ring });
            }
            Layout::Experts { zero } => {
                calls.push(Call::Replicate {
                    f: f.clone(),
                    devices: devices.clone(),
                    zero,
                });
                calls.push(Call::Shard {
                    f: F { ep: true, ..f },
                    devices,
                    stream: "ep",
                });
            }
        }
    }
    top
}

/// What comes after the layouts: orders, streams, priorities, temporal
/// edges, recomputation.
#[derive(Clone, Debug)]
enum Tweak {
    /// All forwards of region `r` before its backwards, microbatch by
    /// microbatch (GPipe's order for one region).
    ForwardsFirst {
        r: u32,
    },
    /// Region `r`'s recompute nodes (or its backwards) on a stream of
    /// their own.
    OwnStream {
        r: u32,
        recompute: bool,
    },
    Priority {
        r: u32,
        pass: Label,
        priority: i32,
    },
    Temporal {
        r: u32,
        s: u32,
        a: u32,
        b: u32,
    },
    Recompute {
        r: Option<u32>,
        full: bool,
    },
}

fn tweak(regions: u32) -> impl Strategy<Value = Tweak> {
    let r = 0..regions;
    prop_oneof![
        r.clone().prop_map(|r| Tweak::ForwardsFirst { r }),
        (r.clone(), any::<bool>()).prop_map(|(r, recompute)| Tweak::OwnStream { r, recompute }),
        (
            r.clone(),
            prop_oneof![Just(Label::F), Just(Label::B), Just(Label::R)],
            -3i32..=3
        )
            .prop_map(|(r, pass, priority)| Tweak::Priority { r, pass, priority }),
        (r.clone(), r.clone(), 0u32..8, 0u32..8).prop_map(|(r, s, a, b)| Tweak::Temporal {
            r,
            s,
            a,
            b
        }),
        (proptest::option::of(r), any::<bool>()).prop_map(|(r, full)| Tweak::Recompute { r, full }),
    ]
}

/// Random strategies (see the module docs).
pub fn program() -> impl Strategy<Value = Program> {
    (
        prop_oneof![Just(Model::Gpt2), Just(Model::Llama), Just(Model::Moe)],
        prop_oneof![Just(1u32), Just(2), Just(2), Just(4), Just(8)],
    )
        .prop_flat_map(|(model, devices)| {
            let regions = 4u32;
            (
                Just(model),
                Just(devices),
                // Microbatches: none, 2 or 4 (a split takes the whole model).
                proptest::option::of(prop_oneof![Just(2u32), Just(4)]),
                proptest::collection::vec(stage(model, devices), 1..=3),
                proptest::collection::vec(tweak(regions), 0..=3),
            )
        })
        .prop_map(|(model, cluster, split, stages, tweaks)| {
            let regions = 4u32;
            let mut calls = Vec::new();
            let mbs = split.unwrap_or(1);
            if let Some(n) = split {
                calls.push(Call::Split { f: F::all(), n });
            }
            let (mut r0, mut top) = (0, 0);
            for s in &stages {
                if r0 >= regions {
                    break;
                }
                top = top.max(lay_out(&mut calls, s, r0, regions, cluster));
                r0 += s.regions;
            }
            // Regions no stage reached stay with the last stage's devices.
            if r0 < regions {
                let last = stages.last().expect("at least one stage");
                let rest = Stage {
                    regions: regions - r0,
                    ..last.clone()
                };
                top = top.max(lay_out(&mut calls, &rest, r0, regions, cluster));
            }
            // The cluster ends at the highest device used: devices past it
            // would only be refused as idle.
            let devices = (top + 1).min(cluster).max(1);
            // Recomputation comes after every layout directive; a recompute
            // stream or priority only where there are recompute nodes.
            let recomputed = |r: u32| {
                tweaks
                    .iter()
                    .any(|t| matches!(t, Tweak::Recompute { r: x, .. } if x.is_none_or(|x| x == r)))
            };
            let (mut late, mut recompute) = (Vec::new(), Vec::new());
            for t in tweaks.iter().cloned() {
                let t = match t {
                    Tweak::OwnStream { r, recompute: true } if !recomputed(r) => Tweak::OwnStream {
                        r,
                        recompute: false,
                    },
                    Tweak::Priority {
                        r,
                        pass: Label::R,
                        priority,
                    } if !recomputed(r) => Tweak::Priority {
                        r,
                        pass: Label::B,
                        priority,
                    },
                    t => t,
                };
                match t {
                    Tweak::ForwardsFirst { r } => {
                        let step = |m: u32, pass| F {
                            pp: Some(r),
                            mb: (mbs > 1).then_some(m),
                            pass: Some(pass),
                            ep: false,
                        };
                        let mut groups: Vec<Vec<F>> =
                            (0..mbs).map(|m| vec![step(m, Label::F)]).collect();
                        groups.extend((0..mbs).map(|m| vec![step(m, Label::B)]));
                        late.push(Call::Order { groups });
                    }
                    Tweak::OwnStream { r, recompute: rc } => late.push(Call::SetStream {
                        f: F {
                            pass: Some(if rc { Label::R } else { Label::B }),
                            ..F::pp(r)
                        },
                        stream: if rc { "recompute" } else { "backward" },
                    }),
                    Tweak::Priority { r, pass, priority } => late.push(Call::SetPriority {
                        f: F {
                            pass: Some(pass),
                            ..F::pp(r)
                        },
                        priority,
                    }),
                    Tweak::Temporal { r, s, a, b } => late.push(Call::Temporal {
                        from: F {
                            pass: Some(Label::F),
                            ..F::pp(r)
                        },
                        a,
                        to: F {
                            pass: Some(Label::B),
                            ..F::pp(s)
                        },
                        b,
                    }),
                    Tweak::Recompute { r, full } => recompute.push(Call::Recompute {
                        f: r.map_or_else(F::all, F::pp),
                        full,
                    }),
                }
            }
            calls.extend(recompute);
            calls.extend(late);
            Program {
                model,
                devices,
                calls,
            }
        })
}

/// How many cases ended each way.
#[derive(Default, Debug)]
pub struct Tally {
    pub refused: u32,
    pub not_compiled: u32,
    pub ran: u32,
    pub over_peak: u32,
    pub failed: u32,
}

impl Tally {
    pub fn add(&mut self, o: &Outcome) {
        match o {
            Outcome::Refused(_) => self.refused += 1,
            Outcome::NotCompiled(_) => self.not_compiled += 1,
            Outcome::Ran => self.ran += 1,
            Outcome::OverPeak(_) => self.over_peak += 1,
            Outcome::Failed(_) => self.failed += 1,
        }
    }
}

/// Every strategy is refused with a clean error or trains at one device's
/// numbers within its planned peaks; and the generator reaches training
/// (a fuzzer whose strategies were all refused would prove nothing).
#[test]
fn every_strategy_is_refused_cleanly_or_trains_at_one_devices_numbers() {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(CASES);
    // One fixed seed (`PROPTEST_RNG_SEED` picks another): every run tries
    // the same strategies, after the failures saved beside this file.
    let base = ProptestConfig::default();
    let rng_seed = match base.rng_seed {
        proptest::test_runner::RngSeed::Random => proptest::test_runner::RngSeed::Fixed(1),
        fixed => fixed,
    };
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases,
        rng_seed,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        source_file: Some(file!()),
        ..base
    });
    let tally = Mutex::new(Tally::default());
    let result = runner.run(&program(), |p| {
        let o = p.run();
        if std::env::var_os("PIPER_FUZZ_SHOW").is_some() && !matches!(o, Outcome::OverPeak(_)) {
            eprintln!("{o:?}");
        }
        tally.lock().unwrap_or_else(|e| e.into_inner()).add(&o);
        if let Outcome::OverPeak(why) = &o {
            eprintln!("over its planned peak: {why}\nthe strategy:\n{p:?}");
        }
        if let Outcome::Failed(why) = o {
            return Err(TestCaseError::fail(format!("{why}\nthe strategy:\n{p:?}")));
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let t = tally.into_inner().unwrap_or_else(|e| e.into_inner());
    eprintln!("fuzz: {t:?}");
    let trained = t.ran + t.over_peak;
    assert!(
        trained * 4 >= t.refused + t.not_compiled + trained,
        "fewer than a quarter of the strategies trained: {t:?}"
    );
    // Peaks past the plan's are a known gap of the memory plan (streams
    // interleaved otherwise than compile ordered them): held to a few in
    // a hundred of the plans that trained, each printed above.
    assert!(
        t.over_peak * 100 <= trained * 3,
        "more than 3% of the plans that trained passed their planned peak: {t:?}"
    );
}
