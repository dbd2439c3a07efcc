//! A measured step as a [`Simulation`]: the runtime's trace (`piper train
//! --trace`, Chrome-trace JSON) read back onto the plan it ran, so a real
//! run is drawn and summed up exactly as a simulated one, and the two can be
//! set side by side.
//!
//! Times are aligned per clock: one process's devices share a clock, so an
//! in-process run is drawn as it happened; in an MPI job every rank's clock
//! is its own, and each rank's devices start at that rank's first op of the
//! step.

use super::{assemble, OpIndex, SimError, Simulation};
use crate::compile::plan::{OpKind, Plan};
use std::collections::BTreeMap;

/// One step of a run, as measured.
#[derive(Clone, Debug)]
pub struct Measured {
    pub sim: Simulation,
    /// The step drawn.
    pub step: u32,
    /// Every step in the trace with its measured time (first op start to
    /// last op end), seconds.
    pub step_times: Vec<(u32, f64)>,
}

fn bad(why: String) -> SimError {
    SimError::Trace(why)
}

/// The step drawn when none is asked for: the median by time, leaving out
/// the first when there are three or more (it pays for warm-up).
pub fn median_step(step_times: &[(u32, f64)]) -> Option<u32> {
    let mut v: Vec<(u32, f64)> = step_times.to_vec();
    if v.len() >= 3 {
        let first = v.iter().map(|s| s.0).min()?;
        v.retain(|s| s.0 != first);
    }
    v.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
    v.get((v.len().max(1) - 1) / 2).map(|s| s.0)
}

/// Read `trace` (as the runtime writes it) onto `plan` and build step
/// `step`'s timeline (default: [`median_step`]). Every op of the plan must
/// appear exactly once in that step.
pub fn from_trace(
    plan: &Plan,
    trace: &serde_json::Value,
    step: Option<u32>,
) -> Result<Measured, SimError> {
    let ops = trace_ops(trace)?;
    let (step, step_times) = pick_step(&ops, step)?;
    let ix = OpIndex::of(plan);
    let (mut start, end, clock_of) = onto_plan(&ix, &ops, step)?;
    as_simulated(plan, &ix, &mut start, &end, &clock_of);
    Ok(Measured {
        sim: assemble(plan, &ix, &start, &end),
        step,
        step_times,
    })
}

/// One plan op's event in a trace.
struct TraceOp {
    step: u32,
    /// The clock its times are on (one per process).
    clock: u32,
    device: u32,
    stream: u32,
    op: u32,
    /// Start and duration, µs.
    ts: f64,
    dur: f64,
}

/// The trace's plan ops: its complete events, less the kernels nested
/// under them (`cat: kernel`). A field missing or out of range is an error
/// naming the event.
fn trace_ops(trace: &serde_json::Value) -> Result<Vec<TraceOp>, SimError> {
    let events = trace["traceEvents"].as_array().ok_or_else(|| {
        bad("no `traceEvents` array: not a trace written by `piper train --trace`".into())
    })?;
    let mut ops = Vec::with_capacity(events.len());
    for e in events
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] != "kernel")
    {
        let num = |v: &serde_json::Value, what: &str| {
            v.as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| {
                    bad(format!(
                        "event `{}`: {what} is missing or not a number",
                        e["name"]
                    ))
                })
        };
        let int = |v: &serde_json::Value, what: &str| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| {
                    bad(format!(
                        "event `{}`: {what} is missing or not a small integer",
                        e["name"]
                    ))
                })
        };
        ops.push(TraceOp {
            step: int(&e["args"]["step"], "args.step")?,
            clock: int(&e["args"]["clock"], "args.clock").unwrap_or(0),
            device: int(&e["pid"], "pid (the device)")?,
            stream: int(&e["tid"], "tid (the stream)")?,
            op: int(&e["args"]["op"], "args.op")?,
            ts: num(&e["ts"], "ts")?,
            dur: num(&e["dur"], "dur")?,
        });
    }
    Ok(ops)
}

/// Each step's time (first start to last end, seconds), and the step to
/// read: `step` if the trace has it, else the median one.
fn pick_step(ops: &[TraceOp], step: Option<u32>) -> Result<(u32, Vec<(u32, f64)>), SimError> {
    let mut span: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    for o in ops {
        let e = span.entry(o.step).or_insert((f64::INFINITY, 0.0));
        e.0 = e.0.min(o.ts);
        e.1 = e.1.max(o.ts + o.dur);
    }
    let step_times: Vec<(u32, f64)> = span.iter().map(|(s, (a, b))| (*s, (b - a) / 1e6)).collect();
    let step = match step {
        Some(s) if span.contains_key(&s) => s,
        Some(s) => {
            return Err(bad(format!(
                "step {s} is not in the trace (it has steps {:?})",
                span.keys().collect::<Vec<_>>()
            )))
        }
        None => median_step(&step_times).ok_or_else(|| bad("the trace has no ops".into()))?,
    };
    Ok((step, step_times))
}

/// Step `step`'s ops onto the plan's: each op's start and end (seconds
/// from its clock's first start in the step) and its clock. Every plan op
/// exactly once, and nothing the plan lacks.
type OnPlan = (Vec<f64>, Vec<f64>, Vec<u32>);

fn onto_plan(ix: &OpIndex, ops: &[TraceOp], step: u32) -> Result<OnPlan, SimError> {
    let n = ix.at.len();
    let mut t0: BTreeMap<u32, f64> = BTreeMap::new();
    for o in ops.iter().filter(|o| o.step == step) {
        let e = t0.entry(o.clock).or_insert(f64::INFINITY);
        *e = e.min(o.ts);
    }
    let mut start = vec![f64::NAN; n];
    let mut end = vec![f64::NAN; n];
    let mut clock_of = vec![0u32; n];
    for o in ops.iter().filter(|o| o.step == step) {
        let (d, si, op) = (o.device, o.stream, o.op);
        let g = ix
            .base
            .get(d as usize)
            .and_then(|b| b.get(si as usize))
            .map(|b0| b0 + op as usize)
            .filter(|&g| {
                g < n && ix.at[g].0 == d && ix.local[g] as u32 == si && ix.at[g].2 == op
            })
            .ok_or_else(|| {
                bad(format!(
                    "step {step}: device {d} stream {si} op {op} is not in this plan (was the trace written for another plan?)"
                ))
            })?;
        if !start[g].is_nan() {
            return Err(bad(format!(
                "step {step}: device {d} stream {si} op {op} appears twice"
            )));
        }
        start[g] = (o.ts - t0[&o.clock]) / 1e6;
        end[g] = start[g] + o.dur / 1e6;
        clock_of[g] = o.clock;
    }
    if let Some(g) = start.iter().position(|s| s.is_nan()) {
        let (d, _, op) = ix.at[g];
        return Err(bad(format!(
            "step {step}: {} of the plan's {n} ops are missing from the trace, e.g. device {d} stream `{}` op {op} (a partial or another plan's trace)",
            start.iter().filter(|s| s.is_nan()).count(),
            ix.streams[ix.at[g].1 as usize]
        )));
    }
    Ok((start, end, clock_of))
}

/// Measured starts drawn as the simulator draws them. A recv blocks from
/// when its stream reaches it until the data is there; the simulator starts
/// it when the send has ended, and counts the wait before as idle, not
/// communication: the same here when the send's device shares the recv's
/// clock. A collective likewise runs once the last member has arrived.
fn as_simulated(plan: &Plan, ix: &OpIndex, start: &mut [f64], end: &[f64], clock_of: &[u32]) {
    let n = ix.at.len();
    let mut sends = std::collections::HashMap::new();
    let mut arrived: std::collections::HashMap<(u32, u32), f64> = Default::default();
    for g in 0..n {
        let (_, o) = ix.op(plan, g);
        match o.kind() {
            OpKind::Send => {
                sends.insert((ix.at[g].0, o.node), g);
            }
            k if k.is_collective() => {
                let t = arrived.entry((o.node, clock_of[g])).or_insert(0.0);
                *t = t.max(start[g]);
            }
            _ => {}
        }
    }
    for g in 0..n {
        let (_, o) = ix.op(plan, g);
        if o.kind().is_collective() {
            start[g] = start[g].max(arrived[&(o.node, clock_of[g])]).min(end[g]);
        }
        if o.kind() != OpKind::Recv {
            continue;
        }
        if let Some(&sg) = o.peer().zip(o.pair()).and_then(|k| sends.get(&k)) {
            if clock_of[sg] == clock_of[g] {
                start[g] = start[g].max(end[sg]).min(end[g]);
            }
        }
    }
}

/// Where a run's compute time went: seconds per kernel (summed over every
/// device and step but the first), largest first, and the summed time of the
/// compute and update ops they ran in.
pub fn kernel_totals(trace: &serde_json::Value) -> (Vec<(String, f64)>, f64) {
    let empty = Vec::new();
    let events = trace["traceEvents"].as_array().unwrap_or(&empty);
    let steps: std::collections::BTreeSet<u64> = events
        .iter()
        .filter_map(|e| e["args"]["step"].as_u64())
        .collect();
    // The first step pays for warm-up: left out when there are others.
    let skip = steps.first().copied().filter(|_| steps.len() > 1);
    let counted = |e: &&serde_json::Value| e["ph"] == "X" && e["args"]["step"].as_u64() != skip;
    let mut by: BTreeMap<String, f64> = BTreeMap::new();
    let mut compute = 0.0;
    for e in events.iter().filter(counted) {
        let dur = e["dur"].as_f64().unwrap_or(0.0) / 1e6;
        match e["cat"].as_str() {
            Some("kernel") => {
                *by.entry(e["name"].as_str().unwrap_or("?").to_string())
                    .or_default() += dur
            }
            Some("compute") => compute += dur,
            _ => {}
        }
    }
    let mut v: Vec<(String, f64)> = by.into_iter().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    (v, compute)
}
