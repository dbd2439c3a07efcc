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
    let events = trace["traceEvents"].as_array().ok_or_else(|| {
        bad("no `traceEvents` array: not a trace written by `piper train --trace`".into())
    })?;
    // (step, clock, device, stream, op, start µs, duration µs)
    let mut ops = Vec::with_capacity(events.len());
    // Plan ops only: the kernels nested under them (`cat: kernel`) are not ops.
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
        ops.push((
            int(&e["args"]["step"], "args.step")?,
            int(&e["args"]["clock"], "args.clock").unwrap_or(0),
            int(&e["pid"], "pid (the device)")?,
            int(&e["tid"], "tid (the stream)")?,
            int(&e["args"]["op"], "args.op")?,
            num(&e["ts"], "ts")?,
            num(&e["dur"], "dur")?,
        ));
    }
    let mut span: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
    for &(s, _, _, _, _, ts, dur) in &ops {
        let e = span.entry(s).or_insert((f64::INFINITY, 0.0));
        e.0 = e.0.min(ts);
        e.1 = e.1.max(ts + dur);
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
    let ix = OpIndex::of(plan);
    let n = ix.at.len();
    let mut t0: BTreeMap<u32, f64> = BTreeMap::new();
    for &(_, clock, _, _, _, ts, _) in ops.iter().filter(|o| o.0 == step) {
        let e = t0.entry(clock).or_insert(f64::INFINITY);
        *e = e.min(ts);
    }
    let mut start = vec![f64::NAN; n];
    let mut end = vec![f64::NAN; n];
    let mut clock_of = vec![0u32; n];
    for &(_, clock, d, si, op, ts, dur) in ops.iter().filter(|o| o.0 == step) {
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
        start[g] = (ts - t0[&clock]) / 1e6;
        end[g] = start[g] + dur / 1e6;
        clock_of[g] = clock;
    }
    if let Some(g) = start.iter().position(|s| s.is_nan()) {
        let (d, _, op) = ix.at[g];
        return Err(bad(format!(
            "step {step}: {} of the plan's {n} ops are missing from the trace, e.g. device {d} stream `{}` op {op} (a partial or another plan's trace)",
            start.iter().filter(|s| s.is_nan()).count(),
            ix.streams[ix.at[g].1 as usize]
        )));
    }
    // A recv blocks from when its stream reaches it until the data is
    // there; the simulator starts it when the send has ended, and counts
    // the wait before as idle, not communication. Drawn the same way when
    // the send's device shares the recv's clock.
    let op_at = |g: usize| {
        let (d, _, i) = ix.at[g];
        &plan.devices[d as usize].streams[ix.local[g] as usize].ops[i as usize]
    };
    let mut sends = std::collections::HashMap::new();
    // A collective likewise runs once the last member has arrived.
    let mut arrived: std::collections::HashMap<(u32, u32), f64> = Default::default();
    for g in 0..n {
        let o = op_at(g);
        match o.op {
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
        let o = op_at(g);
        if o.op.is_collective() {
            start[g] = start[g].max(arrived[&(o.node, clock_of[g])]).min(end[g]);
        }
        if o.op != OpKind::Recv {
            continue;
        }
        if let Some(&sg) = o.peer.zip(o.pair).and_then(|k| sends.get(&k)) {
            if clock_of[sg] == clock_of[g] {
                start[g] = start[g].max(end[sg]).min(end[g]);
            }
        }
    }
    Ok(Measured {
        sim: assemble(plan, &ix, &start, &end),
        step,
        step_times,
    })
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
