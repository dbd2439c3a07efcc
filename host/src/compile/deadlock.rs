//! Deadlock check: execute the per-device plans abstractly before anything
//! runs. Every stream is a sequential program; an op starts when the ops it
//! waits on (other streams of its device) are done. A `send` completes on its
//! own (sends are buffered: the runtime never blocks a sender); a `recv`
//! completes once its matching `send` has; a collective completes when every
//! device of its group has it at the head of the same stream, naming the same
//! group. If no stream can move and some still have ops, the plan would
//! deadlock: the error names the devices and ops that wait on each other.

use super::plan::{DevicePlan, Op, OpKind};
use foldhash::{HashMap, HashSet, HashSetExt};
use std::collections::VecDeque;

/// A plan that cannot finish.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("the plan would deadlock: {}", .waits.join("; "))]
pub struct DeadlockError {
    /// One line per blocked device/stream on the wait cycle (or chain).
    pub waits: Vec<String>,
}

struct Machine<'a> {
    devices: &'a [DevicePlan],
    /// device index by device id
    dev_ix: HashMap<u32, usize>,
    /// pc[device][stream]
    pc: Vec<Vec<usize>>,
}

impl<'a> Machine<'a> {
    fn head(&self, d: usize, s: usize) -> Option<&'a Op> {
        self.devices[d].streams[s].ops.get(self.pc[d][s])
    }
    fn stream_ix(&self, d: usize, name: &str) -> Option<usize> {
        self.devices[d]
            .streams
            .iter()
            .position(|s| s.stream == name)
    }
    fn waits_done(&self, d: usize, op: &Op) -> bool {
        op.waits.iter().all(|w| match self.stream_ix(d, &w.stream) {
            Some(s) => self.pc[d][s] > w.op,
            None => false,
        })
    }
    /// Why the head of (d, s) cannot run, and which (device, stream) it waits on.
    fn blocker(&self, d: usize, s: usize) -> (String, Option<(usize, usize)>) {
        let dev = self.devices[d].device;
        let stream = &self.devices[d].streams[s].stream;
        let op = self.head(d, s).expect("blocked streams have a head");
        let at = format!(
            "device {dev} stream {stream} waits at {}#{}",
            op.label(),
            op.node
        );
        for w in op.waits.iter() {
            match self.stream_ix(d, &w.stream) {
                Some(ws) if self.pc[d][ws] <= w.op => {
                    return (
                        format!("{at} for op {} of its stream {}", w.op, w.stream),
                        Some((d, ws)),
                    )
                }
                None => {
                    return (
                        format!("{at} for a stream {} that does not exist", w.stream),
                        None,
                    )
                }
                _ => {}
            }
        }
        match op.op.as_str() {
            "recv" => {
                let peer = op.peer.unwrap_or(u32::MAX);
                let pair = op.pair.unwrap_or(u32::MAX);
                let Some(&pd) = self.dev_ix.get(&peer) else {
                    return (format!("{at} for device {peer}, which has no plan"), None);
                };
                let holder = self.devices[pd].streams.iter().enumerate().find(|(_, st)| {
                    st.ops
                        .iter()
                        .any(|o| o.op == "send" && o.node == pair && o.peer == Some(dev))
                });
                match holder {
                    Some((ps, _)) => (
                        format!("{at} for device {peer} to send #{pair}"),
                        Some((pd, ps)),
                    ),
                    None => (
                        format!("{at}, but device {peer} has no matching send #{pair}"),
                        None,
                    ),
                }
            }
            _ if op.group.is_some() => {
                for g in op.group.as_deref().unwrap() {
                    let Some(&gd) = self.dev_ix.get(g) else {
                        return (format!("{at} for device {g}, which has no plan"), None);
                    };
                    if gd == d {
                        continue;
                    }
                    let Some(gs) = self.stream_ix(gd, stream) else {
                        return (format!("{at}, but device {g} has no stream {stream}"), None);
                    };
                    match self.head(gd, gs) {
                        Some(h) if h.node == op.node && h.group != op.group => {
                            return (
                                format!(
                                    "{at} with group {:?}, but device {g} runs it with group {:?}",
                                    op.group.as_deref().unwrap_or(&[]),
                                    h.group.as_deref().unwrap_or(&[])
                                ),
                                None,
                            )
                        }
                        Some(h) if h.node == op.node && self.waits_done(gd, h) => {}
                        Some(h) if h.node == op.node => {
                            return (format!("{at} for device {g} to reach it"), Some((gd, gs)))
                        }
                        Some(h) => {
                            return (
                                format!(
                                    "{at} for device {g}, which is at {}#{}",
                                    h.label(),
                                    h.node
                                ),
                                Some((gd, gs)),
                            )
                        }
                        None => {
                            return (
                                format!(
                                    "{at}, but device {g} has finished stream {stream} without it"
                                ),
                                None,
                            )
                        }
                    }
                }
                (at, None)
            }
            _ => (at, None),
        }
    }
}

/// One op as the check sees it: 20 bytes, built once per plan in parallel
/// (the check itself is one sequential pass).
#[derive(Clone, Copy)]
struct Step {
    node: u32,
    /// `recv`: pair; collective: its group's index in [`Prog::groups`]
    /// (a send is keyed by its node and device alone).
    a: u32,
    /// `recv`: peer.
    b: u32,
    /// End of this op's waits in its stream's wait list (they start where
    /// the previous op's end).
    waits_end: u32,
    kind: Kind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    Recv,
    Collective,
    /// Runs on its own once its waits are done.
    Local,
}

/// A wait on a stream that does not exist: never done.
const NO_STREAM: u32 = u32::MAX;

/// One device's plan as steps.
struct Prog<'a> {
    steps: Vec<Vec<Step>>,
    /// Per stream: (stream index, op index) of each op's waits, in op order.
    waits: Vec<Vec<(u32, u32)>>,
    groups: Vec<&'a [u32]>,
    /// Each stream's name.
    names: Vec<&'a str>,
}

fn prog(d: &DevicePlan) -> Prog<'_> {
    let names: Vec<&str> = d.streams.iter().map(|s| &*s.stream).collect();
    // The first stream of a name is the one a wait means (as `stream_ix`).
    let index = |name: &str| {
        names
            .iter()
            .position(|n| *n == name)
            .map_or(NO_STREAM, |i| i as u32)
    };
    let mut groups = Vec::new();
    let mut steps = Vec::with_capacity(d.streams.len());
    let mut waits = Vec::with_capacity(d.streams.len());
    for st in &d.streams {
        let mut list = Vec::with_capacity(st.ops.len());
        let mut ws: Vec<(u32, u32)> = Vec::new();
        for op in &st.ops {
            ws.extend(
                op.waits
                    .iter()
                    .map(|w| (index(&w.stream), u32::try_from(w.op).unwrap_or(u32::MAX))),
            );
            let (kind, a, b) = match op.op {
                OpKind::Send => (Kind::Send, 0, 0),
                OpKind::Recv => (
                    Kind::Recv,
                    op.pair.unwrap_or(u32::MAX),
                    op.peer.unwrap_or(u32::MAX),
                ),
                _ => match op.group.as_deref() {
                    Some(g) if g.len() > 1 => {
                        groups.push(g);
                        (Kind::Collective, (groups.len() - 1) as u32, 0)
                    }
                    _ => (Kind::Local, 0, 0),
                },
            };
            list.push(Step {
                node: op.node,
                a,
                b,
                waits_end: ws.len() as u32,
                kind,
            });
        }
        steps.push(list);
        waits.push(ws);
    }
    Prog {
        steps,
        waits,
        groups,
        names,
    }
}

/// Execute the plans abstractly; `Err` names the waits that can never end.
///
/// One pass: each stream runs until it blocks, and a blocked stream is
/// parked where what it waits on will wake it (the stream it waits on, the
/// send it needs, the collective it joined), so each op is looked at a
/// bounded number of times. A collective completes when every device of its
/// group (the same group, on a stream of the same name) has joined it.
pub fn check_deadlock(devices: &[DevicePlan]) -> Result<(), DeadlockError> {
    use rayon::prelude::*;
    let progs: Vec<Prog> = devices.par_iter().map(prog).collect();
    let dev_ix: HashMap<u32, usize> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| (d.device, i))
        .collect();
    // Stream names across devices, as numbers.
    let mut name_ids: HashMap<&str, u32> = HashMap::default();
    let gid: Vec<Vec<u32>> = progs
        .iter()
        .map(|p| {
            p.names
                .iter()
                .map(|n| {
                    let next = name_ids.len() as u32;
                    *name_ids.entry(n).or_insert(next)
                })
                .collect()
        })
        .collect();
    let mut pc: Vec<Vec<u32>> = progs.iter().map(|p| vec![0; p.steps.len()]).collect();
    // Streams of a device parked on one of its streams: (needed pc, stream).
    let mut waiters: Vec<Vec<Vec<(u32, u32)>>> = progs
        .iter()
        .map(|p| vec![Vec::new(); p.steps.len()])
        .collect();
    let mut sent: HashSet<(u32, u32)> = HashSet::new();
    let mut pending: HashMap<(u32, u32), Vec<(u32, u32)>> = HashMap::default();
    // (node, stream name, group's first device, group size) → the group and
    // who has joined.
    type Joined<'a> = (&'a [u32], Vec<(u32, u32)>);
    let mut joined: HashMap<(u32, u32, u32, u32), Joined> = HashMap::default();
    let mut queue: VecDeque<(u32, u32)> = progs
        .iter()
        .enumerate()
        .flat_map(|(d, p)| (0..p.steps.len() as u32).map(move |s| (d as u32, s)))
        .collect();
    // Advance (d, s) past its head and wake what waited on it.
    fn advance(
        pc: &mut [Vec<u32>],
        waiters: &mut [Vec<Vec<(u32, u32)>>],
        queue: &mut VecDeque<(u32, u32)>,
        d: usize,
        s: usize,
    ) {
        pc[d][s] += 1;
        let now = pc[d][s];
        let w = &mut waiters[d][s];
        if !w.is_empty() {
            w.retain(|&(need, ws)| {
                if now > need {
                    queue.push_back((d as u32, ws));
                    false
                } else {
                    true
                }
            });
        }
    }
    while let Some((d, s)) = queue.pop_front() {
        let (d, s) = (d as usize, s as usize);
        let p = &progs[d];
        let me = devices[d].device;
        'run: loop {
            let at = pc[d][s] as usize;
            let Some(step) = p.steps[s].get(at) else {
                break;
            };
            let from = if at == 0 {
                0
            } else {
                p.steps[s][at - 1].waits_end as usize
            };
            for &(ws, need) in &p.waits[s][from..step.waits_end as usize] {
                if ws == NO_STREAM {
                    break 'run;
                }
                if pc[d][ws as usize] <= need {
                    waiters[d][ws as usize].push((need, s as u32));
                    break 'run;
                }
            }
            match step.kind {
                Kind::Send => {
                    sent.insert((step.node, me));
                    if let Some(list) = pending.remove(&(step.node, me)) {
                        queue.extend(list);
                    }
                    advance(&mut pc, &mut waiters, &mut queue, d, s);
                }
                Kind::Recv => {
                    let key = (step.a, step.b);
                    if !sent.contains(&key) {
                        pending.entry(key).or_default().push((d as u32, s as u32));
                        break;
                    }
                    advance(&mut pc, &mut waiters, &mut queue, d, s);
                }
                Kind::Collective => {
                    let group = p.groups[step.a as usize];
                    if !group.contains(&me) {
                        break;
                    }
                    let key = (step.node, gid[d][s], group[0], group.len() as u32);
                    let entry = joined.entry(key).or_insert_with(|| (group, Vec::new()));
                    // Another group under the same key, or this device's
                    // second stream of the name: never completes.
                    if entry.0 != group || entry.1.iter().any(|&(jd, _)| jd as usize == d) {
                        break;
                    }
                    entry.1.push((d as u32, s as u32));
                    if entry.1.len() < group.len() {
                        break;
                    }
                    let (_, members) = joined.remove(&key).expect("just joined");
                    for (jd, js) in members {
                        advance(&mut pc, &mut waiters, &mut queue, jd as usize, js as usize);
                        if (jd as usize, js as usize) != (d, s) {
                            queue.push_back((jd, js));
                        }
                    }
                }
                Kind::Local => advance(&mut pc, &mut waiters, &mut queue, d, s),
            }
        }
    }
    let m = Machine {
        devices,
        dev_ix,
        pc: pc
            .iter()
            .map(|p| p.iter().map(|&x| x as usize).collect())
            .collect(),
    };
    // Anything left is blocked forever.
    let blocked: Vec<(usize, usize)> = devices
        .iter()
        .enumerate()
        .flat_map(|(d, dp)| (0..dp.streams.len()).map(move |s| (d, s)))
        .filter(|&(d, s)| m.head(d, s).is_some())
        .collect();
    if blocked.is_empty() {
        return Ok(());
    }
    // Follow the wait-for chain from the first blocked stream until it repeats.
    let mut waits = Vec::new();
    let mut seen: Vec<(usize, usize)> = Vec::new();
    let mut cur = blocked[0];
    loop {
        if let Some(p) = seen.iter().position(|x| *x == cur) {
            waits.drain(..p);
            break;
        }
        seen.push(cur);
        let (why, next) = m.blocker(cur.0, cur.1);
        waits.push(why);
        match next {
            Some(n) if m.head(n.0, n.1).is_some() => cur = n,
            _ => break,
        }
    }
    Err(DeadlockError { waits })
}
