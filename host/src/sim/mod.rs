//! Simulator: the per-device plans the runtime executes, timed by a cost
//! model instead of run. The last stage of the flow for a user choosing a
//! strategy for a cluster they do not have.
//!
//! Execution follows the runtime's rules exactly: each stream runs its ops in
//! order; an op starts when its stream's previous op and its cross-stream
//! `waits` are done; a `recv` ends when the matching `send`'s bytes have
//! arrived (sends are buffered: a send ends when its bytes are on the link,
//! whether or not the receiver is there yet); a collective starts when every
//! device of its group has reached it and ends for all together.
//!
//! Costs ([`cost`]): a compute op costs its FLOPs at the device's peak times
//! an efficiency per op kind, or on a cluster with a device class
//! ([`device`]) its products, attention and memory-bound kernels from its
//! shapes; an optimizer step reads and writes its states
//! at memory bandwidth; a p2p transfer costs α + bytes/β of the link it
//! crosses (NVLink inside a node, the network between nodes); a collective
//! the better of ring and tree over its group's slowest link.

pub mod calibrate;
pub mod cluster;
pub mod cost;
pub mod device;
pub mod measured;
pub mod report;

pub use cluster::{Cluster, ClusterError};
pub use cost::{CostModel, UnitCosts};

use crate::compile::plan::{Act, Op, OpKind, Plan, Spread, StreamPlan};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

/// What a span of a timeline shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanKind {
    F,
    B,
    BI,
    BW,
    /// A forward recomputed before its backward.
    R,
    Update,
    /// A send, recv or collective.
    Comm,
}

impl SpanKind {
    fn of(k: OpKind) -> Self {
        match k {
            OpKind::F => SpanKind::F,
            OpKind::B => SpanKind::B,
            OpKind::BI => SpanKind::BI,
            OpKind::BW => SpanKind::BW,
            OpKind::R => SpanKind::R,
            OpKind::Update => SpanKind::Update,
            _ => SpanKind::Comm,
        }
    }
    pub fn is_compute(self) -> bool {
        !matches!(self, SpanKind::Comm)
    }
}

/// One op on the timeline.
#[derive(Clone, Debug)]
pub struct Span {
    pub device: u32,
    /// Index into [`Simulation::streams`].
    pub stream: u16,
    pub kind: SpanKind,
    /// `F mb3 s1`: pass, microbatch, segment (or the comm op and its peer).
    pub label: Label,
    pub start: f64,
    pub end: f64,
}

/// One device's figures.
#[derive(Clone, Debug, Default)]
pub struct DeviceSummary {
    /// Time computing (F, B, BI, BW, update), seconds.
    pub busy: f64,
    /// Step time minus `busy`.
    pub idle: f64,
    /// Communication time not hidden under computation, per stream (and
    /// [`IN_OP_EXCHANGE`], [`IN_OP_TP_SUMS`]: exchanges inside expert
    /// and tensor-parallel compute ops, counted in `busy` too).
    pub exposed_comm: BTreeMap<String, f64>,
    /// Model states plus the peak of transient buffers over the step.
    pub peak_bytes: u64,
    /// (time, bytes in use): model states plus live transient buffers,
    /// after every change.
    pub memory: Vec<(f64, u64)>,
}

/// A simulated step.
#[derive(Clone, Debug)]
pub struct Simulation {
    pub step_time: f64,
    pub devices: Vec<DeviceSummary>,
    pub spans: Vec<Span>,
    pub streams: Vec<String>,
    /// Mean over devices of idle ÷ step time.
    pub bubble: f64,
    pub ops: usize,
}

/// A plan the simulator cannot time.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("device {device}, stream {stream}, op {index} ({label}): {why}")]
    Plan {
        device: u32,
        stream: String,
        index: usize,
        label: String,
        why: String,
    },
    #[error("trace: {0}")]
    Trace(String),
    #[error("the plan never finishes: {stuck} ops wait forever, e.g. device {device} stream {stream} op {index} ({label})")]
    Stuck {
        stuck: usize,
        device: u32,
        stream: String,
        index: usize,
        label: String,
    },
}

/// What a span shows as text, kept small (a plan may have millions of ops):
/// `F mb3 s1`, `send mb3 s1 →2`, `all-reduce s4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Label {
    pub op: OpKind,
    pub microbatch: Option<u32>,
    pub segment: Option<u32>,
    pub peer: Option<u32>,
}

impl Label {
    fn of(op: &crate::compile::plan::Op) -> Self {
        Label {
            op: op.kind(),
            microbatch: (op.microbatches > 1).then_some(op.microbatch),
            segment: op.segments.first().copied(),
            peer: op.peer(),
        }
    }
}

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.op.as_str())?;
        if let Some(m) = self.microbatch {
            write!(f, " mb{m}")?;
        }
        if let Some(s) = self.segment {
            write!(f, " s{s}")?;
        }
        match (self.op, self.peer) {
            (OpKind::Send, Some(p)) => write!(f, " →{p}"),
            (OpKind::Recv, Some(p)) => write!(f, " ←{p}"),
            _ => Ok(()),
        }
    }
}

/// Every op of a plan in one flat order (device, stream, op), with the
/// stream names made global: how the simulator and a measured run agree on
/// which op a time belongs to.
pub(crate) struct OpIndex {
    pub streams: Vec<String>,
    /// `base[device][stream]`: the global id of that stream's first op.
    pub base: Vec<Vec<usize>>,
    /// (device, global stream id, op index) of every op.
    pub at: Vec<(u32, u16, u32)>,
    /// The stream's index on its device, per op.
    pub local: Vec<u16>,
}

impl OpIndex {
    /// Op `g` of `plan` and its stream.
    pub fn op<'p>(&self, plan: &'p Plan, g: usize) -> (&'p StreamPlan, &'p Op) {
        let (d, _, i) = self.at[g];
        let s = &plan.devices[d as usize].streams[self.local[g] as usize];
        (s, &s.ops[i as usize])
    }

    pub fn of(plan: &Plan) -> Self {
        let mut streams: Vec<String> = Vec::new();
        let mut stream_ix: HashMap<&str, u16> = HashMap::new();
        let mut base: Vec<Vec<usize>> = Vec::with_capacity(plan.devices.len());
        let mut at: Vec<(u32, u16, u32)> = Vec::new();
        let mut local: Vec<u16> = Vec::new();
        for d in &plan.devices {
            let mut b = Vec::with_capacity(d.streams.len());
            for (li, s) in d.streams.iter().enumerate() {
                let si = *stream_ix.entry(s.stream.as_str()).or_insert_with(|| {
                    streams.push(s.stream.clone());
                    (streams.len() - 1) as u16
                });
                b.push(at.len());
                for i in 0..s.ops.len() {
                    at.push((d.device, si, i as u32));
                    local.push(li as u16);
                }
            }
            base.push(b);
        }
        OpIndex {
            streams,
            base,
            at,
            local,
        }
    }
}

/// Time `plan` under `costs`.
pub fn simulate(plan: &Plan, costs: &dyn CostModel) -> Result<Simulation, SimError> {
    let ix = OpIndex::of(plan);
    let (deps, indeg) = dependencies(plan, &ix)?;
    let n = ix.at.len();
    let mut clock = Clock {
        indeg,
        ready_at: vec![0f64; n],
        start: vec![f64::NAN; n],
        end: vec![f64::NAN; n],
        done: 0,
    };
    match (costs.shared_compute(), costs.contention()) {
        // Devices of a node share its compute: ops in time order.
        (Some(share), _) => run_shared(&ix, plan, costs, share, &deps, &mut clock),
        // Compute slows while its device communicates: in time order too.
        (None, Some(slowdown)) => {
            run_contended(&ix, plan, costs, slowdown, &deps, &mut clock, devices(plan))
        }
        (None, None) => run_in_dependency_order(&ix, plan, costs, &deps, &mut clock),
    }
    if clock.done < n {
        let g = (0..n).find(|&g| clock.end[g].is_nan()).unwrap_or(0);
        let (s, o) = ix.op(plan, g);
        return Err(SimError::Stuck {
            stuck: n - clock.done,
            device: ix.at[g].0,
            stream: s.stream.clone(),
            index: ix.at[g].2 as usize,
            label: o.label(),
        });
    }
    finish(plan, &ix, costs, &clock.start, &clock.end)
}

/// The plan's ops (global ids) as a dependency graph.
struct Deps {
    /// Successors in one flat array (CSR): `succ[head[g]..head[g + 1]]`.
    succ: Vec<u32>,
    head: Vec<u32>,
    /// Each receive's send (`usize::MAX` for other ops).
    send_of: Vec<usize>,
    /// Each collective node's member ops.
    members: HashMap<u32, Vec<usize>>,
}

impl Deps {
    fn succs(&self, g: usize) -> &[u32] {
        &self.succ[self.head[g] as usize..self.head[g + 1] as usize]
    }
    /// A member of collective `node` has arrived (`arrived` counts them):
    /// the group's members when it was the last.
    fn arrive(&self, arrived: &mut HashMap<u32, usize>, node: u32) -> Option<&[usize]> {
        let group = &self.members[&node];
        let c = arrived.entry(node).or_insert(0);
        *c += 1;
        (*c == group.len()).then_some(&group[..])
    }
}

/// Each op's dependencies (the previous op of its stream, its waits, a
/// receive's send), and how many each op has. A wait or receive the plan
/// cannot satisfy is an error naming the op.
fn dependencies(plan: &Plan, ix: &OpIndex) -> Result<(Deps, Vec<u32>), SimError> {
    let (base, at) = (&ix.base, &ix.at);
    let n = at.len();
    let err = |g: usize, why: String| {
        let (s, o) = ix.op(plan, g);
        SimError::Plan {
            device: at[g].0,
            stream: s.stream.clone(),
            index: at[g].2 as usize,
            label: o.label(),
            why,
        }
    };
    // Sends by (device, node); collective members by node.
    let mut sends: HashMap<(u32, u32), usize> = HashMap::new();
    let mut members: HashMap<u32, Vec<usize>> = HashMap::new();
    for (g, &(device, _, _)) in at.iter().enumerate() {
        let (_, o) = ix.op(plan, g);
        match o.act {
            Act::Send { .. } => {
                sends.insert((device, o.node), g);
            }
            Act::Collective { .. } | Act::Relayout { .. } => {
                members.entry(o.node).or_default().push(g)
            }
            Act::Compute { .. } | Act::Recv { .. } | Act::Update => {}
        }
    }
    let mut edges: Vec<(u32, u32)> = Vec::with_capacity(2 * n);
    let mut indeg = vec![0u32; n];
    let mut send_of = vec![usize::MAX; n];
    for (d, dp) in plan.devices.iter().enumerate() {
        for (si, s) in dp.streams.iter().enumerate() {
            let b0 = base[d][si];
            for (i, o) in s.ops.iter().enumerate() {
                let g = b0 + i;
                let mut deps: Vec<usize> = Vec::new();
                if i > 0 {
                    deps.push(g - 1);
                }
                for w in o.waits.iter() {
                    let wsi = w.stream.ix();
                    let Some(ws) = dp.streams.get(wsi) else {
                        return Err(err(
                            g,
                            format!("waits on stream #{wsi}, which this device lacks"),
                        ));
                    };
                    if w.op >= ws.ops.len() {
                        return Err(err(
                            g,
                            format!("waits on op {} of `{}`, which has fewer", w.op, ws.stream),
                        ));
                    }
                    deps.push(base[d][wsi] + w.op);
                }
                if let Act::Recv { from: peer, pair } = o.act {
                    let Some(&sg) = sends.get(&(peer, pair)) else {
                        return Err(err(g, format!("no matching send on device {peer}")));
                    };
                    send_of[g] = sg;
                    deps.push(sg);
                }
                for dep in deps {
                    edges.push((dep as u32, g as u32));
                    indeg[g] += 1;
                }
            }
        }
    }
    let mut head = vec![0u32; n + 1];
    for &(a, _) in &edges {
        head[a as usize + 1] += 1;
    }
    for g in 0..n {
        head[g + 1] += head[g];
    }
    let mut fill = head.clone();
    let mut succ = vec![0u32; edges.len()];
    for &(a, b) in &edges {
        succ[fill[a as usize] as usize] = b;
        fill[a as usize] += 1;
    }
    let deps = Deps {
        succ,
        head,
        send_of,
        members,
    };
    Ok((deps, indeg))
}

/// A run's state per op: dependencies still to end, when the last ended,
/// start and end; and how many ops have ended.
struct Clock {
    indeg: Vec<u32>,
    ready_at: Vec<f64>,
    start: Vec<f64>,
    end: Vec<f64>,
    done: usize,
}

impl Clock {
    /// Op `g` has ended: its successors' dependencies count down; `ready`
    /// gets each that has none left.
    fn release(&mut self, deps: &Deps, g: usize, mut ready: impl FnMut(usize, f64)) {
        for &s in deps.succs(g) {
            let s = s as usize;
            self.ready_at[s] = self.ready_at[s].max(self.end[g]);
            self.indeg[s] -= 1;
            if self.indeg[s] == 0 {
                ready(s, self.ready_at[s]);
            }
        }
        self.done += 1;
    }
}

/// The time-ordered run under shared compute (see [`SharedRun`]).
fn run_shared(
    ix: &OpIndex,
    plan: &Plan,
    costs: &dyn CostModel,
    share: Sharing,
    deps: &Deps,
    clock: &mut Clock,
) {
    let at = &ix.at;
    let mut run = SharedRun {
        share,
        now: 0.0,
        ready: BinaryHeap::new(),
        active: HashMap::new(),
    };
    for g in (0..at.len()).filter(|&g| clock.indeg[g] == 0) {
        run.ready.push(Reverse((Time(0.0), g)));
    }
    let mut arrived: HashMap<u32, usize> = HashMap::new();
    loop {
        let next_ready = run.ready.peek().map_or(f64::INFINITY, |r| (r.0).0 .0);
        let (next_end, finishing) = run.next_end();
        if next_ready.is_infinite() && next_end.is_infinite() {
            break;
        }
        if next_end < next_ready {
            run.advance(next_end);
            let (node, k) = finishing;
            let Some(ops) = run.active.get_mut(&node) else {
                break;
            };
            let (g, _) = ops.swap_remove(k);
            clock.end[g] = next_end;
            clock.release(deps, g, |s, t| run.ready.push(Reverse((Time(t), s))));
            continue;
        }
        let Some(Reverse((Time(t), g))) = run.ready.pop() else {
            break;
        };
        run.advance(t);
        let (_, o) = ix.op(plan, g);
        let d = at[g].0;
        match o.act {
            Act::Collective { .. } | Act::Relayout { .. } => {
                let Some(group) = deps.arrive(&mut arrived, o.node) else {
                    continue;
                };
                let devs: Vec<u32> = group.iter().map(|&m| at[m].0).collect();
                let t = costs.collective(o, &devs);
                for &m in group {
                    clock.start[m] = run.now;
                    clock.end[m] = run.now + t;
                }
                for &m in group {
                    clock.release(deps, m, |s, t| run.ready.push(Reverse((Time(t), s))));
                }
                continue;
            }
            Act::Send { to, .. } => {
                clock.start[g] = run.now;
                clock.end[g] = run.now + costs.p2p(o.bytes, d, to);
            }
            Act::Recv { .. } => {
                clock.start[g] = run.now;
                clock.end[g] = run.now.max(clock.end[deps.send_of[g]]);
            }
            Act::Compute { .. } | Act::Update => {
                clock.start[g] = run.now;
                let work = costs.compute(o);
                if work > 0.0 {
                    let node = d / share.devices_per_node.max(1);
                    run.active.entry(node).or_default().push((g, work));
                    continue;
                }
                clock.end[g] = run.now;
            }
        }
        clock.release(deps, g, |s, t| run.ready.push(Reverse((Time(t), s))));
    }
}

/// How a node's devices share its compute ([`CostModel::shared_compute`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sharing {
    pub devices_per_node: u32,
    /// Compute ops that run at full speed at once on a node; more share
    /// it equally.
    pub slots: f64,
}

/// A time for the ready heap, ordered by `total_cmp`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Time {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

/// The time-ordered run of [`simulate`] under shared compute: ops become
/// ready at their dependencies' ends; running compute ops of a node
/// progress at `min(1, slots ÷ running)` of their full speed.
struct SharedRun {
    share: Sharing,
    now: f64,
    ready: BinaryHeap<Reverse<(Time, usize)>>,
    /// Per node: (op, seconds of work left at full speed).
    active: HashMap<u32, Vec<(usize, f64)>>,
}

impl SharedRun {
    fn rate(&self, running: usize) -> f64 {
        (self.share.slots / running.max(1) as f64).min(1.0)
    }
    /// The first end among running ops, and which (node, position).
    fn next_end(&self) -> (f64, (u32, usize)) {
        let mut best = (f64::INFINITY, (0, 0));
        for (node, ops) in &self.active {
            let r = self.rate(ops.len());
            for (k, (_, left)) in ops.iter().enumerate() {
                let t = self.now + left / r;
                if t < best.0 || (t == best.0 && (*node, k) < best.1) {
                    best = (t, (*node, k));
                }
            }
        }
        best
    }
    /// Move the clock to `t`, every running op progressing at its rate.
    fn advance(&mut self, t: f64) {
        let dt = t - self.now;
        if dt > 0.0 {
            for ops in self.active.values_mut() {
                let r = (self.share.slots / ops.len().max(1) as f64).min(1.0);
                for (_, left) in ops.iter_mut() {
                    *left = (*left - dt * r).max(0.0);
                }
            }
            self.now = t;
        }
    }
}

/// One past the highest device id of the plan.
fn devices(plan: &Plan) -> usize {
    plan.devices
        .iter()
        .map(|d| d.device as usize + 1)
        .max()
        .unwrap_or(0)
}

/// An event of [`run_contended`]: a compute op's projected end (valid while
/// its device's rate is the one it was projected at), or the end of a
/// transfer or collective on some devices.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ending {
    Compute { op: usize, version: u64 },
    Comm { devices: Vec<u32> },
}

/// A device's running compute ops under contention.
#[derive(Default)]
struct Running {
    /// (op, seconds of work left at full speed).
    ops: Vec<(usize, f64)>,
    /// When `ops` last progressed.
    since: f64,
    /// Transfers and collectives of the device in flight.
    comm: u32,
    /// Bumped when the rate changes: older projections are stale.
    version: u64,
}

impl Running {
    fn rate(&self, slowdown: f64) -> f64 {
        if self.comm > 0 {
            1.0 - slowdown
        } else {
            1.0
        }
    }
    /// Progress every running op to `t` at the current rate.
    fn progress(&mut self, t: f64, slowdown: f64) {
        let r = self.rate(slowdown);
        let dt = t - self.since;
        if dt > 0.0 {
            for (_, left) in &mut self.ops {
                *left = (*left - dt * r).max(0.0);
            }
        }
        self.since = self.since.max(t);
    }
}

/// The time-ordered run when compute and communication share a device
/// (the cluster's device class sets `slowdown`): a compute op progresses
/// at `1 − slowdown` of its speed while a transfer (sender and receiver)
/// or a collective of its device is in flight, at full speed otherwise.
/// Communication keeps its own time. With `slowdown` 0 the timeline is
/// [`run_in_dependency_order`]'s.
#[allow(clippy::too_many_arguments)]
fn run_contended(
    ix: &OpIndex,
    plan: &Plan,
    costs: &dyn CostModel,
    slowdown: f64,
    deps: &Deps,
    clock: &mut Clock,
    devices: usize,
) {
    let at = &ix.at;
    let mut dev: Vec<Running> = (0..devices).map(|_| Running::default()).collect();
    let mut ready: BinaryHeap<Reverse<(Time, usize)>> = BinaryHeap::new();
    let mut ends: BinaryHeap<Reverse<(Time, Ending)>> = BinaryHeap::new();
    for g in (0..at.len()).filter(|&g| clock.indeg[g] == 0) {
        ready.push(Reverse((Time(0.0), g)));
    }
    let mut arrived: HashMap<u32, usize> = HashMap::new();
    // A device's rate changes at `t` by `delta` transfers in flight.
    let change = |dev: &mut Vec<Running>,
                  ends: &mut BinaryHeap<Reverse<(Time, Ending)>>,
                  d: u32,
                  t: f64,
                  delta: i32| {
        let Some(r) = dev.get_mut(d as usize) else {
            return;
        };
        let before = r.rate(slowdown);
        r.progress(t, slowdown);
        r.comm = r.comm.saturating_add_signed(delta);
        let after = r.rate(slowdown);
        if before != after {
            r.version += 1;
            for &(op, left) in &r.ops {
                let end = t + left / after;
                ends.push(Reverse((
                    Time(end),
                    Ending::Compute {
                        op,
                        version: r.version,
                    },
                )));
            }
        }
    };
    loop {
        let next_ready = ready.peek().map_or(f64::INFINITY, |r| (r.0).0 .0);
        let next_end = ends.peek().map_or(f64::INFINITY, |e| (e.0).0 .0);
        if next_ready.is_infinite() && next_end.is_infinite() {
            break;
        }
        if next_end <= next_ready {
            let Some(Reverse((Time(t), ending))) = ends.pop() else {
                break;
            };
            match ending {
                Ending::Comm { devices } => {
                    for d in devices {
                        change(&mut dev, &mut ends, d, t, -1);
                    }
                }
                Ending::Compute { op, version } => {
                    let d = at[op].0 as usize;
                    let r = &mut dev[d];
                    let Some(k) = r.ops.iter().position(|(g, _)| *g == op) else {
                        continue;
                    };
                    if r.version != version {
                        continue;
                    }
                    r.progress(t, slowdown);
                    r.ops.swap_remove(k);
                    clock.end[op] = t;
                    clock.release(deps, op, |s, t| ready.push(Reverse((Time(t), s))));
                }
            }
            continue;
        }
        let Some(Reverse((Time(now), g))) = ready.pop() else {
            break;
        };
        let (_, o) = ix.op(plan, g);
        let d = at[g].0;
        match o.act {
            Act::Collective { .. } | Act::Relayout { .. } => {
                let Some(group) = deps.arrive(&mut arrived, o.node) else {
                    continue;
                };
                let devs: Vec<u32> = group.iter().map(|&m| at[m].0).collect();
                let t = costs.collective(o, &devs);
                for &m in group {
                    clock.start[m] = now;
                    clock.end[m] = now + t;
                }
                if t > 0.0 {
                    for &m in &devs {
                        change(&mut dev, &mut ends, m, now, 1);
                    }
                    ends.push(Reverse((Time(now + t), Ending::Comm { devices: devs })));
                }
                for &m in group {
                    clock.release(deps, m, |s, t| ready.push(Reverse((Time(t), s))));
                }
                continue;
            }
            Act::Send { to, .. } => {
                let t = costs.p2p(o.bytes, d, to);
                clock.start[g] = now;
                clock.end[g] = now + t;
                if t > 0.0 {
                    let both = if to == d { vec![d] } else { vec![d, to] };
                    for &m in &both {
                        change(&mut dev, &mut ends, m, now, 1);
                    }
                    ends.push(Reverse((Time(now + t), Ending::Comm { devices: both })));
                }
            }
            Act::Recv { .. } => {
                clock.start[g] = now;
                clock.end[g] = now.max(clock.end[deps.send_of[g]]);
            }
            Act::Compute { .. } | Act::Update => {
                clock.start[g] = now;
                let work = costs.compute(o);
                if work > 0.0 {
                    let r = &mut dev[d as usize];
                    r.progress(now, slowdown);
                    r.ops.push((g, work));
                    let end = now + work / r.rate(slowdown);
                    let version = r.version;
                    ends.push(Reverse((Time(end), Ending::Compute { op: g, version })));
                    continue;
                }
                clock.end[g] = now;
            }
        }
        clock.release(deps, g, |s, t| ready.push(Reverse((Time(t), s))));
    }
}

/// Kahn's order without contention: every op starts when its dependencies
/// end; collectives when their whole group has arrived.
fn run_in_dependency_order(
    ix: &OpIndex,
    plan: &Plan,
    costs: &dyn CostModel,
    deps: &Deps,
    clock: &mut Clock,
) {
    let at = &ix.at;
    let mut arrived: HashMap<u32, usize> = HashMap::new();
    let mut queue: Vec<usize> = (0..at.len()).filter(|&g| clock.indeg[g] == 0).collect();
    while let Some(g) = queue.pop() {
        let (_, o) = ix.op(plan, g);
        let d = at[g].0;
        match o.act {
            Act::Collective { .. } | Act::Relayout { .. } => {
                let Some(group) = deps.arrive(&mut arrived, o.node) else {
                    continue;
                };
                let t0 = group.iter().map(|&m| clock.ready_at[m]).fold(0.0, f64::max);
                let devs: Vec<u32> = group.iter().map(|&m| at[m].0).collect();
                let t = costs.collective(o, &devs);
                for &m in group {
                    clock.start[m] = t0;
                    clock.end[m] = t0 + t;
                }
                for &m in group {
                    clock.release(deps, m, |s, _| queue.push(s));
                }
                continue;
            }
            Act::Send { to, .. } => {
                clock.start[g] = clock.ready_at[g];
                clock.end[g] = clock.start[g] + costs.p2p(o.bytes, d, to);
            }
            Act::Recv { .. } => {
                // The send was released before this recv: its end is the arrival.
                let s = deps.send_of[g];
                clock.start[g] = clock.ready_at[g];
                clock.end[g] = clock.start[g].max(clock.end[s]);
            }
            Act::Compute { .. } | Act::Update => {
                clock.start[g] = clock.ready_at[g];
                clock.end[g] = clock.start[g] + costs.compute(o);
            }
        }
        clock.release(deps, g, |s, _| queue.push(s));
    }
}

/// The timeline of (start, end) per op, with exchanges inside compute ops
/// counted as exposed communication.
fn finish(
    plan: &Plan,
    ix: &OpIndex,
    costs: &dyn CostModel,
    start: &[f64],
    end: &[f64],
) -> Result<Simulation, SimError> {
    let mut sim = assemble(plan, ix, start, end);
    // Exchanges inside compute ops are communication the device waits on.
    for (dp, summary) in plan.devices.iter().zip(&mut sim.devices) {
        for o in dp.streams.iter().flat_map(|s| &s.ops) {
            let context = costs.in_op_context(o);
            let waited = costs.in_op_exchange(o) - context;
            if context > 0.0 {
                *summary
                    .exposed_comm
                    .entry(IN_OP_CP.to_string())
                    .or_default() += context;
            }
            if waited > 0.0 {
                let key = match o.spread {
                    Some(Spread::Tensor) => IN_OP_TP_SUMS,
                    _ => IN_OP_EXCHANGE,
                };
                *summary.exposed_comm.entry(key.to_string()).or_default() += waited;
            }
        }
    }
    Ok(sim)
}

/// The exposed all-to-all time of the worst device: the streams that carry
/// the expert exchanges (`shard` on a stream of its own) and the exchanges
/// inside compute ops ([`IN_OP_EXCHANGE`]). `None` when the plan has none.
pub fn exposed_all_to_all(plan: &Plan, sim: &Simulation) -> Option<f64> {
    let mut any = false;
    let mut worst = 0.0f64;
    for (dp, d) in plan.devices.iter().zip(&sim.devices) {
        let mut t = d.exposed_comm.get(IN_OP_EXCHANGE).copied();
        for s in &dp.streams {
            if s.ops.iter().any(|o| o.kind() == OpKind::AllToAll) {
                let e = d.exposed_comm.get(&*s.stream).copied().unwrap_or(0.0);
                t = Some(t.unwrap_or(0.0) + e);
            }
        }
        if let Some(t) = t {
            any = true;
            worst = worst.max(t);
        }
    }
    any.then_some(worst)
}

/// The [`DeviceSummary::exposed_comm`] key of all-to-alls run inside expert
/// compute ops (`shard` on `compute`): all of it is exposed.
pub const IN_OP_EXCHANGE: &str = "all-to-all in op";
/// The [`DeviceSummary::exposed_comm`] key of tensor parallelism's sums,
/// run inside its compute ops (the next matmul needs them, as in Megatron):
/// all of it is exposed.
pub const IN_OP_TP_SUMS: &str = "tp sums in op";
/// The exposed-communication key of context parallelism's exchanges
/// inside attention (its q/k/v all-gathers and gradient reduce-scatters).
pub const IN_OP_CP: &str = "cp exchanges in op";

/// Spans and per-device figures from every op's (start, end), in
/// [`OpIndex`] order: the same for a simulated and a measured step.
pub(crate) fn assemble(plan: &Plan, ix: &OpIndex, start: &[f64], end: &[f64]) -> Simulation {
    let (at, local) = (&ix.at, &ix.local);
    let n = at.len();
    let op_of = |g: usize| {
        let (d, _, i) = at[g];
        let s = &plan.devices[d as usize].streams[local[g] as usize];
        (s, &s.ops[i as usize])
    };
    // Spans and per-device figures.
    let step_time = end.iter().cloned().fold(0.0, f64::max);
    let mut spans = Vec::with_capacity(n);
    for g in 0..n {
        let (_, o) = op_of(g);
        spans.push(Span {
            device: at[g].0,
            stream: at[g].1,
            kind: SpanKind::of(o.kind()),
            label: Label::of(o),
            start: start[g],
            end: end[g],
        });
    }
    let mut devices = Vec::with_capacity(plan.devices.len());
    let mut first = 0usize;
    for dp in &plan.devices {
        let count: usize = dp.streams.iter().map(|s| s.ops.len()).sum();
        let mine = &spans[first..first + count];
        let compute = union(
            mine.iter()
                .filter(|s| s.kind.is_compute())
                .map(|s| (s.start, s.end)),
        );
        let busy: f64 = compute.iter().map(|(a, b)| b - a).sum();
        let mut exposed = BTreeMap::new();
        for (si, name) in ix.streams.iter().enumerate() {
            let comm = union(
                mine.iter()
                    .filter(|s| s.stream as usize == si && !s.kind.is_compute())
                    .map(|s| (s.start, s.end)),
            );
            if !comm.is_empty() {
                exposed.insert(name.clone(), minus(&comm, &compute));
            }
        }
        let memory = memory_over_time(dp, &spans[first..first + count]);
        let peak_bytes = memory
            .iter()
            .map(|m| m.1)
            .max()
            .unwrap_or(dp.model_state_bytes);
        devices.push(DeviceSummary {
            busy,
            idle: step_time - busy,
            exposed_comm: exposed,
            peak_bytes,
            memory,
        });
        first += count;
    }
    let bubble = if step_time > 0.0 && !devices.is_empty() {
        devices.iter().map(|d| d.idle / step_time).sum::<f64>() / devices.len() as f64
    } else {
        0.0
    };
    Simulation {
        step_time,
        devices,
        spans,
        streams: ix.streams.clone(),
        bubble,
        ops: n,
    }
}

/// Model states plus live transient buffers over time: a buffer is taken
/// when its producer ends and given back when its last local reader ends.
fn memory_over_time(dp: &crate::compile::plan::DevicePlan, spans: &[Span]) -> Vec<(f64, u64)> {
    let ops: Vec<&crate::compile::plan::Op> =
        dp.streams.iter().flat_map(|s| s.ops.iter()).collect();
    let mut last_read: HashMap<u32, f64> = HashMap::new();
    for (o, s) in ops.iter().zip(spans) {
        for i in o.inputs.iter() {
            let e = last_read.entry(i.node).or_insert(s.end);
            *e = e.max(s.end);
        }
    }
    let mut events: Vec<(f64, i128)> = Vec::new();
    for (o, s) in ops.iter().zip(spans) {
        if o.out_bytes > 0 {
            events.push((s.end, o.out_bytes as i128));
            let free = last_read.get(&o.node).copied().unwrap_or(s.end).max(s.end);
            events.push((free, -(o.out_bytes as i128)));
        }
    }
    // Frees before takes at the same instant.
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut live: i128 = 0;
    let mut out = vec![(0.0, dp.model_state_bytes)];
    for (t, delta) in events {
        live += delta;
        let v = dp.model_state_bytes + live.max(0) as u64;
        match out.last_mut() {
            Some(last) if last.0 == t => last.1 = v,
            _ => out.push((t, v)),
        }
    }
    out
}

/// The union of intervals, sorted and disjoint.
fn union(it: impl Iterator<Item = (f64, f64)>) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = it.filter(|(a, b)| b > a).collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// Length of `a` not covered by `b` (both sorted and disjoint).
fn minus(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let mut total = 0.0;
    let mut j = 0;
    for &(s, e) in a {
        let mut cur = s;
        while j < b.len() && b[j].1 <= cur {
            j += 1;
        }
        let mut k = j;
        while cur < e {
            if k >= b.len() || b[k].0 >= e {
                total += e - cur;
                break;
            }
            if b[k].0 > cur {
                total += b[k].0 - cur;
            }
            cur = cur.max(b[k].1);
            k += 1;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    #[test]
    fn interval_algebra() {
        let u = super::union([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)].into_iter());
        assert_eq!(u, vec![(0.0, 2.0), (3.0, 4.0)]);
        assert_eq!(super::minus(&[(0.0, 4.0)], &u), 1.0);
        assert_eq!(super::minus(&[(5.0, 6.0)], &u), 1.0);
        assert_eq!(super::minus(&[(1.0, 3.5)], &u), 1.0);
    }
}
