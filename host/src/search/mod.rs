//! Search: the best strategy for a model and a cluster. The candidates
//! ([`space`]) are compositions of strategy plugins — the bundled library
//! and any a user names — so the answer is a program a user can read and
//! edit, not a config of flags. The last stage of the flow: it builds on
//! `plugin/` (applying), `compile/` (plans, their hashes and predicted
//! peaks) and `sim/` (timing).
//!
//! Each candidate goes through, cheapest first: a memory lower bound from
//! the model's parameter count and the candidate's shape (ZeRO stage,
//! degrees, copies; activations left out), which cuts what cannot fit before
//! any plan is built; applying its plugins and compiling (every core), with
//! the plan hash kept so a plan two candidates share is simulated once; the
//! plan's predicted peaks against the cap; and the simulator on the cluster.
//! Every candidate ends in one [`Outcome`], so none is skipped silently.
//! Last, the fastest pipelines are tried again with their stages cut where
//! the cost hints balance them (the pipeline plugins' `boundaries`), rather
//! than in equal runs of regions.

pub mod space;

use crate::compile::{compile, Plan};
use crate::dag::{Cluster as DagCluster, TrainingDag};
use crate::model::ModelConfig;
use crate::plugin::{Plugin, PluginHost};
use crate::sim::{self, Cluster, Simulation};
use rayon::prelude::*;
use space::{Candidate, Shape};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What became of one candidate.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// Its model states alone (a lower bound) pass the cap.
    CutByEstimate { bytes: u64 },
    /// A plugin refused it or its plan did not compile.
    Failed { reason: String },
    /// Its plan predicts a device's peak over the cap.
    OverCap { peak: u64, device: u32 },
    /// Its plan equals an earlier candidate's (same hash).
    Duplicate { of: usize },
    /// The time budget ran out before it was tried.
    NotTried,
    /// Compiled, fits, simulated.
    Simulated(Box<Scored>),
}

/// A simulated candidate's figures.
#[derive(Clone, Debug)]
pub struct Scored {
    pub hash: String,
    pub step_time: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs of a step over the cluster's peak for the step.
    pub mfu: f64,
    pub bubble: f64,
    /// The largest exposed communication of a device, seconds.
    pub exposed_comm: f64,
    /// The largest compute time of a device, seconds.
    pub busy: f64,
    /// Predicted peak bytes per device.
    pub peaks: Vec<u64>,
    /// The timeline, kept for the fastest [`Query::keep`] candidates only
    /// (a search holds figures, not every plan and timeline it made).
    pub sim: Option<Simulation>,
}

impl Scored {
    pub fn peak(&self) -> u64 {
        self.peaks.iter().copied().max().unwrap_or(0)
    }
}

/// What to search for.
pub struct Query<'a> {
    pub model: &'a ModelConfig,
    pub cluster: &'a Cluster,
    pub devices: u32,
    /// Bytes each device may hold.
    pub cap: u64,
    pub candidates: Vec<Candidate>,
    /// Every plugin the candidates name, loaded (or why not).
    pub plugins: Plugins,
    /// Stop trying new candidates after this long.
    pub budget: Option<Duration>,
    /// Timelines to keep: the fastest this many candidates' (a report's).
    pub keep: usize,
}

/// Plugins by the name candidates give them.
pub type Plugins = HashMap<String, Result<Plugin, String>>;

/// Every candidate with its outcome, in enumeration order.
pub struct Search {
    pub candidates: Vec<Candidate>,
    pub outcomes: Vec<Outcome>,
    /// The last candidates are the fastest pipelines tried again with
    /// balanced stages: the index of each one's even-cut original.
    pub balanced_from: Vec<usize>,
    pub elapsed: Duration,
}

impl Search {
    /// The simulated candidates, fastest first (ties: enumeration order).
    pub fn ranked(&self) -> Vec<(usize, &Scored)> {
        let mut r: Vec<(usize, &Scored)> = self
            .outcomes
            .iter()
            .enumerate()
            .filter_map(|(i, o)| match o {
                Outcome::Simulated(s) => Some((i, s.as_ref())),
                _ => None,
            })
            .collect();
        r.sort_by(|a, b| a.1.step_time.total_cmp(&b.1.step_time).then(a.0.cmp(&b.0)));
        r
    }
    /// The balanced candidates with their even-cut originals, both
    /// simulated: (balanced, original) indices.
    pub fn balanced_pairs(&self) -> Vec<(usize, usize)> {
        let base = self.candidates.len() - self.balanced_from.len();
        (self.balanced_from.iter().enumerate())
            .map(|(k, of)| (base + k, *of))
            .filter(|(b, o)| {
                matches!(self.outcomes[*b], Outcome::Simulated(_))
                    && matches!(self.outcomes[*o], Outcome::Simulated(_))
            })
            .collect()
    }
    /// How many candidates ended each way.
    pub fn count(&self, f: impl Fn(&Outcome) -> bool) -> usize {
        self.outcomes.iter().filter(|o| f(o)).count()
    }
}

/// A lower bound of the bytes the fullest device of `shape` holds for
/// `model`: the average device's model states ([`states_lower_bound`]) and
/// the activations one microbatch keeps for the backward of one model chunk
/// (every schedule holds them when that chunk's first backward starts),
/// split over every degree as if nothing were replicated. The fullest
/// device holds at least the average.
pub fn memory_lower_bound(model: &ModelConfig, shape: &Shape) -> u64 {
    let saved: f64 = model
        .segments()
        .iter()
        .map(|s| s.cost.saved_bytes as f64)
        .sum();
    let spread = [
        shape.dp,
        shape.microbatches,
        shape.pp,
        shape.chunks,
        shape.tp,
        shape.cp,
    ]
    .iter()
    .map(|x| f64::from((*x).max(1)))
    .product::<f64>();
    states_lower_bound(model, shape).saturating_add((saved / spread) as u64)
}

/// A lower bound of the bytes a device of `shape` holds for `model`: its
/// share of the parameters, gradients, master weights and AdamW moments (in
/// the precision policy's bytes, ZeRO-sharded as the stage says),
/// activations left out. The heaviest device holds at least the average.
pub fn states_lower_bound(model: &ModelConfig, shape: &Shape) -> u64 {
    let segments = model.segments();
    let expert: u64 = (segments.iter())
        .filter(|s| s.expert_block.is_some())
        .map(|s| s.param_elems)
        .sum();
    let dense = model.param_count().saturating_sub(expert);
    // ZeRO shards over the data- and context-parallel replicas together.
    let dp = f64::from(shape.dp.max(1)) * f64::from(shape.cp.max(1));
    let shard = |stage: u8| if shape.zero >= stage { dp } else { 1.0 };
    let b = model.precision.state_bytes();
    let per_elem = b.params as f64 / shard(3)
        + b.grads as f64 / shard(2)
        + (b.master + b.moments) as f64 / shard(1);
    let elems = dense as f64 + expert as f64 / f64::from(shape.ep.max(1));
    let spread = f64::from(shape.pp.max(1)) * f64::from(shape.tp.max(1));
    (elems * per_elem * f64::from(shape.copies.max(1)) / spread) as u64
}

/// The plugins the candidates name, each loaded once by `load` (a bundled
/// name or a path: [`PluginHost::load`]; the command line also resolves
/// registry references).
pub fn load_all(
    candidates: &[Candidate],
    load: impl Fn(&str) -> Result<Plugin, String>,
) -> Plugins {
    let mut plugins = HashMap::new();
    for c in candidates {
        for s in &c.steps {
            if !plugins.contains_key(&s.plugin) {
                plugins.insert(s.plugin.clone(), load(&s.plugin));
            }
        }
    }
    plugins
}

/// Apply a candidate's strategies to a fresh DAG and compile it.
fn plan_of(host: &PluginHost, q: &Query, c: &Candidate) -> Result<Plan, String> {
    let mut dag =
        TrainingDag::build(q.model, DagCluster::new(q.devices)).map_err(|e| e.to_string())?;
    for s in &c.steps {
        let p = match q.plugins.get(&s.plugin) {
            Some(Ok(p)) => p,
            Some(Err(e)) => return Err(e.clone()),
            None => return Err(format!("plugin `{}` was not loaded", s.plugin)),
        };
        host.apply(p, &mut dag, &s.options)
            .map_err(|e| e.to_string())?;
    }
    compile(&dag).map_err(|e| format!("compiling: {e}"))
}

/// Model FLOPs of one step (forward and backward of every segment).
fn step_flops(model: &ModelConfig) -> f64 {
    model
        .segments()
        .iter()
        .map(|s| s.cost.fwd_flops + s.cost.bwd_flops)
        .sum()
}

/// The fastest simulated pipelines tried again with their stages cut at
/// boundaries balanced by the cost hints ([`space::balanced`]).
pub const REFINED: usize = 16;

/// Try every candidate; see the module docs for the order of the checks.
/// Then the [`REFINED`] fastest pipelines again with balanced stages, as
/// candidates of their own after the enumerated ones.
pub fn search(host: &PluginHost, q: Query) -> Search {
    let start = Instant::now();
    let mut all = q.candidates.clone();
    let mut first: HashMap<String, usize> = HashMap::new();
    let mut outcomes = evaluate(host, &q, &all, 0, start, &mut first);
    let mut ranked: Vec<(usize, f64)> = (outcomes.iter().enumerate())
        .filter_map(|(i, o)| match o {
            Outcome::Simulated(s) => Some((i, s.step_time)),
            _ => None,
        })
        .collect();
    ranked.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    let (balanced_from, balanced): (Vec<usize>, Vec<Candidate>) = (ranked.iter())
        .filter_map(|(i, _)| space::balanced(&all[*i], q.model).map(|c| (*i, c)))
        .take(REFINED)
        .unzip();
    let base = all.len();
    all.extend(balanced);
    let more = evaluate(host, &q, &all[base..], base, start, &mut first);
    outcomes.extend(more);
    Search {
        candidates: all,
        outcomes,
        balanced_from,
        elapsed: start.elapsed(),
    }
}

/// The outcomes of `candidates` (numbered from `base` in the search), a
/// chunk at a time.
fn evaluate(
    host: &PluginHost,
    q: &Query,
    candidates: &[Candidate],
    base: usize,
    start: Instant,
    first: &mut HashMap<String, usize>,
) -> Vec<Outcome> {
    // A few candidates per core at a time: their plans live only until
    // they are simulated, so memory follows the chunk, not the space.
    let chunk = 4 * rayon::current_num_threads().max(1);
    let mut outcomes = Vec::with_capacity(candidates.len());
    for (k, part) in candidates.chunks(chunk).enumerate() {
        let at = base + k * chunk;
        outcomes.extend(evaluate_chunk(host, q, part, at, start, first));
        keep_fastest_timelines(&mut outcomes, q.keep);
    }
    outcomes
}

/// Drop the timelines of all but the fastest `keep` simulated outcomes
/// (ties: enumeration order, as [`Search::ranked`] orders them).
fn keep_fastest_timelines(outcomes: &mut [Outcome], keep: usize) {
    let mut with: Vec<(f64, usize)> = (outcomes.iter().enumerate())
        .filter_map(|(i, o)| match o {
            Outcome::Simulated(s) if s.sim.is_some() => Some((s.step_time, i)),
            _ => None,
        })
        .collect();
    if with.len() <= keep {
        return;
    }
    with.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    for &(_, i) in &with[keep..] {
        if let Outcome::Simulated(s) = &mut outcomes[i] {
            s.sim = None;
        }
    }
}

/// [`evaluate`] of one chunk: estimate, plan, duplicates (against
/// `first`, every plan hash seen so far), cap, simulation.
fn evaluate_chunk(
    host: &PluginHost,
    q: &Query,
    candidates: &[Candidate],
    base: usize,
    start: Instant,
    first: &mut HashMap<String, usize>,
) -> Vec<Outcome> {
    let over_budget = || q.budget.is_some_and(|b| start.elapsed() > b);
    let n = candidates.len();
    // Phase 1, every core: the estimate, then apply and compile.
    let planned: Vec<Result<Plan, Outcome>> = candidates
        .par_iter()
        .map(|c| {
            if let Some(shape) = &c.shape {
                let bytes = memory_lower_bound(q.model, shape);
                if bytes > q.cap {
                    return Err(Outcome::CutByEstimate { bytes });
                }
            }
            if over_budget() {
                return Err(Outcome::NotTried);
            }
            plan_of(host, q, c).map_err(|reason| Outcome::Failed { reason })
        })
        .collect();
    // In enumeration order: duplicates of an earlier plan, and plans whose
    // predicted peak passes the cap.
    let mut outcomes: Vec<Option<Outcome>> = vec![None; n];
    let mut to_simulate: Vec<(usize, Plan)> = Vec::new();
    for (i, r) in planned.into_iter().enumerate() {
        match r {
            Err(o) => outcomes[i] = Some(o),
            Ok(plan) => {
                if let Some(&of) = first.get(&plan.hash) {
                    outcomes[i] = Some(Outcome::Duplicate { of });
                    continue;
                }
                first.insert(plan.hash.clone(), base + i);
                let worst = (plan.devices.iter())
                    .map(|d| (d.peak_bytes, d.device))
                    .max()
                    .unwrap_or((0, 0));
                if worst.0 > q.cap {
                    outcomes[i] = Some(Outcome::OverCap {
                        peak: worst.0,
                        device: worst.1,
                    });
                } else {
                    to_simulate.push((i, plan));
                }
            }
        }
    }
    // Phase 2, every core: simulate what fits.
    let flops = step_flops(q.model);
    let tokens = f64::from(q.model.batch_size) * f64::from(q.model.seq_len);
    let done = Mutex::new(Vec::new());
    to_simulate.into_par_iter().for_each(|(i, plan)| {
        let o = match sim::simulate(&plan, q.cluster) {
            Err(e) => Outcome::Failed {
                reason: format!("simulating: {e}"),
            },
            Ok(s) => {
                let exposed = (s.devices.iter())
                    .map(|d| d.exposed_comm.values().sum::<f64>())
                    .fold(0.0, f64::max);
                let busy = s.devices.iter().map(|d| d.busy).fold(0.0, f64::max);
                let t = s.step_time.max(f64::MIN_POSITIVE);
                Outcome::Simulated(Box::new(Scored {
                    hash: plan.hash.clone(),
                    step_time: s.step_time,
                    tokens_per_s: tokens / t,
                    mfu: flops / (t * f64::from(q.devices) * q.cluster.peak_flops),
                    bubble: s.bubble,
                    exposed_comm: exposed,
                    busy,
                    peaks: plan.devices.iter().map(|d| d.peak_bytes).collect(),
                    sim: Some(s),
                }))
            }
        };
        done.lock().unwrap_or_else(|p| p.into_inner()).push((i, o));
    });
    for (i, o) in done.into_inner().unwrap_or_else(|p| p.into_inner()) {
        outcomes[i] = Some(o);
    }
    outcomes
        .into_iter()
        .map(|o| o.unwrap_or(Outcome::NotTried))
        .collect()
}

/// Why `a` (faster) beat `b`: the figures that differ most, largest first.
pub fn why(a: &Scored, b: &Scored) -> String {
    let time = sim::report::human_time;
    let idle = |s: &Scored| s.bubble * s.step_time;
    let mut parts: Vec<(f64, String)> = vec![
        (
            (idle(b) - idle(a)).abs(),
            format!(
                "bubble {:.1}% vs {:.1}%",
                a.bubble * 100.0,
                b.bubble * 100.0
            ),
        ),
        (
            (b.exposed_comm - a.exposed_comm).abs(),
            format!(
                "exposed communication {} vs {}",
                time(a.exposed_comm),
                time(b.exposed_comm)
            ),
        ),
        (
            (b.busy - a.busy).abs(),
            format!("compute per device {} vs {}", time(a.busy), time(b.busy)),
        ),
    ];
    parts.sort_by(|x, y| y.0.total_cmp(&x.0));
    let speed = b.step_time / a.step_time.max(f64::MIN_POSITIVE);
    format!(
        "{speed:.2}× faster: {}",
        parts
            .iter()
            .filter(|p| p.0 > 0.0)
            .take(2)
            .map(|p| p.1.clone())
            .collect::<Vec<_>>()
            .join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_states_bound_shrinks_with_zero_stages_and_spreading() {
        let m = ModelConfig::gpt2_small();
        let s = |dp, zero, tp, pp| Shape {
            dp,
            zero,
            tp,
            cp: 1,
            ep: 1,
            pp,
            copies: 1,
            microbatches: 1,
            chunks: 1,
        };
        let full = states_lower_bound(&m, &s(1, 0, 1, 1));
        assert_eq!(full, m.param_count() * 16);
        let z1 = states_lower_bound(&m, &s(4, 1, 1, 1));
        let z3 = states_lower_bound(&m, &s(4, 3, 1, 1));
        assert_eq!(z1, m.param_count() * (4 + 4 + 2));
        assert_eq!(z3, m.param_count() * 4);
        assert_eq!(states_lower_bound(&m, &s(1, 0, 2, 2)), full / 4);
        // DP without ZeRO holds everything on every replica.
        assert_eq!(states_lower_bound(&m, &s(8, 0, 1, 1)), full);
    }
}
