//! The forward-only plan of a compiled training plan, for evaluation: the
//! same devices, streams and strategies' placement, keeping the forward
//! compute ops and the communication they read (pipeline activations, ZeRO-3
//! parameter gathers, the all-to-alls between expert phases), dropping
//! backward, gradient reductions, norms and updates. After compilation,
//! beside the training plan; the runtime runs it with the same devices.
//!
//! A kept op keeps its order in its stream. Its cross-stream waits become
//! waits on kept ops: a wait on a dropped op is replaced by what that op
//! itself came after (its own waits and its stream's earlier ops), so every
//! ordering the training plan implied between kept ops survives.

use super::plan::{DevicePlan, OpKind, Plan, StreamIx, StreamPlan, Wait};
use super::{check_deadlock, DeadlockError};
use std::collections::HashSet;

/// The forward-only plan of `plan`, deadlock-checked.
pub fn forward_only(plan: &Plan) -> Result<Plan, DeadlockError> {
    let keep = kept_nodes(plan);
    let devices = plan
        .devices
        .iter()
        .map(|d| device_forward(d, &keep))
        .collect::<Vec<_>>();
    check_deadlock(&devices)?;
    let mut out = Plan {
        hash: String::new(),
        model: plan.model.clone(),
        batch_size: plan.batch_size,
        precision: plan.precision,
        devices,
    };
    out.hash = out.compute_hash();
    Ok(out)
}

/// Nodes of the forward pass: every forward compute op, what they read
/// (transitively), and the sends paired with kept receives.
fn kept_nodes(plan: &Plan) -> HashSet<u32> {
    let ops = || {
        plan.devices
            .iter()
            .flat_map(|d| &d.streams)
            .flat_map(|s| &s.ops)
    };
    let mut keep: HashSet<u32> = ops()
        .filter(|o| o.kind() == OpKind::F)
        .map(|o| o.node)
        .collect();
    loop {
        let mut more = Vec::new();
        for o in ops().filter(|o| keep.contains(&o.node)) {
            more.extend(o.inputs.iter().map(|i| i.node));
            if o.kind() == OpKind::Recv {
                more.extend(o.pair());
            }
        }
        let before = keep.len();
        keep.extend(more);
        if keep.len() == before {
            return keep;
        }
    }
}

fn device_forward(d: &DevicePlan, keep: &HashSet<u32>) -> DevicePlan {
    let streams = &d.streams;
    // New position of each kept op.
    let new_at: Vec<Vec<Option<usize>>> = streams
        .iter()
        .map(|s| {
            let mut n = 0;
            s.ops
                .iter()
                .map(|o| {
                    keep.contains(&o.node).then(|| {
                        n += 1;
                        n - 1
                    })
                })
                .collect()
        })
        .collect();
    let after = frontiers(streams, &new_at);
    let streams_out = streams
        .iter()
        .enumerate()
        .map(|(s, stream)| StreamPlan {
            stream: stream.stream.clone(),
            ops: stream
                .ops
                .iter()
                .enumerate()
                .filter(|(i, _)| new_at[s][*i].is_some())
                .map(|(i, op)| {
                    // What the op comes after, its own stream's order aside.
                    let mut f = vec![None; streams.len()];
                    for w in op.waits.iter() {
                        let t = w.stream.ix();
                        if let Some(g) = (streams.get(t).is_some_and(|st| w.op < st.ops.len()))
                            .then(|| after[t][w.op].as_ref())
                            .flatten()
                        {
                            merge(&mut f, g);
                        }
                    }
                    if i > 0 {
                        if let Some(g) = &after[s][i - 1] {
                            merge(&mut f, g);
                        }
                    }
                    let waits: Vec<Wait> = f
                        .iter()
                        .enumerate()
                        .filter(|(t, _)| *t != s)
                        .filter_map(|(t, at)| {
                            Some(Wait {
                                stream: StreamIx(t as u32),
                                op: (*at)?,
                            })
                        })
                        .collect();
                    let mut op = op.clone();
                    op.waits = waits.into();
                    op
                })
                .collect(),
        })
        .collect();
    DevicePlan {
        device: d.device,
        peak_bytes: d.peak_bytes,
        model_state_bytes: d.model_state_bytes,
        transient_peak_bytes: d.transient_peak_bytes,
        streams: streams_out,
    }
}

/// Per stream and op, the frontier an op comes after: `after[s][i][t]` is
/// the last kept op of stream `t` (new positions, from `new_at`) that op `i`
/// of stream `s` comes after, itself included.
type Frontiers = Vec<Vec<Option<Vec<Option<usize>>>>>;

fn frontiers(streams: &[StreamPlan], new_at: &[Vec<Option<usize>>]) -> Frontiers {
    let mut after: Frontiers = streams.iter().map(|s| vec![None; s.ops.len()]).collect();
    // Iterative depth-first: an op's frontier needs its stream predecessor's
    // and its waits' first (a deadlock-free plan has no cycle among them).
    let mut on_stack: Vec<Vec<bool>> = streams.iter().map(|s| vec![false; s.ops.len()]).collect();
    for (s0, stream) in streams.iter().enumerate() {
        for i0 in 0..stream.ops.len() {
            let mut stack = vec![(s0, i0)];
            on_stack[s0][i0] = true;
            while let Some(&(s, i)) = stack.last() {
                if after[s][i].is_some() {
                    on_stack[s][i] = false;
                    stack.pop();
                    continue;
                }
                let op = &streams[s].ops[i];
                let mut deps: Vec<(usize, usize)> = op
                    .waits
                    .iter()
                    .map(|w| (w.stream.ix(), w.op))
                    .filter(|(t, j)| streams.get(*t).is_some_and(|st| *j < st.ops.len()))
                    .collect();
                if i > 0 {
                    deps.push((s, i - 1));
                }
                let pending: Vec<(usize, usize)> = deps
                    .iter()
                    .copied()
                    .filter(|(t, j)| after[*t][*j].is_none() && !on_stack[*t][*j])
                    .collect();
                if !pending.is_empty() {
                    for &(t, j) in &pending {
                        on_stack[t][j] = true;
                    }
                    stack.extend(pending);
                    continue;
                }
                let mut f = vec![None; streams.len()];
                for (t, j) in deps {
                    if let Some(g) = &after[t][j] {
                        merge(&mut f, g);
                    }
                }
                if let Some(n) = new_at[s][i] {
                    f[s] = Some(n);
                }
                after[s][i] = Some(f);
                on_stack[s][i] = false;
                stack.pop();
            }
        }
    }
    after
}

/// `into` is after `from` too: the later op of each stream.
fn merge(into: &mut [Option<usize>], from: &[Option<usize>]) {
    for (a, b) in into.iter_mut().zip(from) {
        *a = (*a).max(*b);
    }
}
