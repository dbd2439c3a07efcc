//! Deadlock check: execute the per-device plans abstractly before anything
//! runs. Every stream is a sequential program; an op starts when the ops it
//! waits on (other streams of its device) are done. A `send` completes on its
//! own (sends are buffered: the runtime never blocks a sender); a `recv`
//! completes once its matching `send` has; a collective completes when every
//! device of its group has it at the head of the same stream. If no stream can
//! move and some still have ops, the plan would deadlock: the error names the
//! devices and ops that wait on each other.

use super::plan::{DevicePlan, Op};
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
    sent: HashSet<(u32, u32)>,
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
        for w in &op.waits {
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

/// Execute the plans abstractly; `Err` names the waits that can never end.
pub fn check_deadlock(devices: &[DevicePlan]) -> Result<(), DeadlockError> {
    let mut m = Machine {
        devices,
        dev_ix: devices
            .iter()
            .enumerate()
            .map(|(i, d)| (d.device, i))
            .collect(),
        pc: devices.iter().map(|d| vec![0; d.streams.len()]).collect(),
        sent: HashSet::new(),
    };
    let mut queue: VecDeque<(usize, usize)> = VecDeque::new();
    let mut queued: Vec<Vec<bool>> = devices
        .iter()
        .map(|d| vec![true; d.streams.len()])
        .collect();
    for (d, dp) in devices.iter().enumerate() {
        for s in 0..dp.streams.len() {
            queue.push_back((d, s));
        }
    }
    let wake_device =
        |d: usize, queue: &mut VecDeque<(usize, usize)>, queued: &mut Vec<Vec<bool>>| {
            for (s, q) in queued[d].iter_mut().enumerate() {
                if !*q {
                    *q = true;
                    queue.push_back((d, s));
                }
            }
        };
    while let Some((d, s)) = queue.pop_front() {
        queued[d][s] = false;
        while let Some(op) = m.head(d, s) {
            if !m.waits_done(d, op) {
                break;
            }
            let me = devices[d].device;
            match op.op.as_str() {
                "send" => {
                    m.sent.insert((op.node, me));
                    m.pc[d][s] += 1;
                    if let Some(&pd) = op.peer.and_then(|p| m.dev_ix.get(&p)) {
                        wake_device(pd, &mut queue, &mut queued);
                    }
                }
                "recv" => {
                    let key = (op.pair.unwrap_or(u32::MAX), op.peer.unwrap_or(u32::MAX));
                    if !m.sent.contains(&key) {
                        break;
                    }
                    m.pc[d][s] += 1;
                }
                _ if op.group.as_ref().is_some_and(|g| g.len() > 1) => {
                    let group = op.group.as_ref().unwrap();
                    let stream = &devices[d].streams[s].stream;
                    let mut members = Vec::new();
                    let ready = group.iter().all(|g| {
                        let Some(&gd) = m.dev_ix.get(g) else {
                            return false;
                        };
                        let Some(gs) = m.stream_ix(gd, stream) else {
                            return false;
                        };
                        members.push((gd, gs));
                        m.head(gd, gs)
                            .is_some_and(|h| h.node == op.node && m.waits_done(gd, h))
                    });
                    if !ready {
                        break;
                    }
                    for (gd, gs) in members {
                        m.pc[gd][gs] += 1;
                        if gd != d {
                            wake_device(gd, &mut queue, &mut queued);
                        }
                    }
                }
                _ => m.pc[d][s] += 1,
            }
            // Other streams of this device may have been waiting on this one.
            wake_device(d, &mut queue, &mut queued);
            queued[d][s] = false;
        }
    }
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
