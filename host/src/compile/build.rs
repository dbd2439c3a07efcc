//! The per-device builder: from the global list schedule to each device's
//! streams of ops, their hashes, the transient-memory walk and the steps of
//! the deadlock check, in one pass per chunk of devices.
//!
//! Devices are ranked by their first appearance in the order and cut into
//! contiguous chunks of ranks, so the devices of one SPMD node (a DP group,
//! a ZeRO shard group) fall into one chunk. Each chunk (in parallel) walks
//! the order once to give its nodes their positions (stream, index) and once
//! to build: per node, what its devices' ops share (inputs, tags, costs) is
//! described where it is used, then the node's op on each of the chunk's
//! devices, the stream hash, the memory walk and the deadlock steps. Nothing
//! a chunk writes is read by another, so no state is shared or locked; a
//! node whose devices span chunks is described once per chunk.

use super::deadlock::{Kind, Step, StreamSteps, NO_STREAM};
use super::flat::Flat;
use super::groups::Groups;
use super::plan::{self, Input, Op, OpCommon, OpKind, StreamIx, Wait};
use crate::dag::{
    CommOp, CommPurpose, DeviceId, EdgeKind, Node, NodeId, NodeKind, Spread, TagKey, Tags,
    TensorKind, TrainingDag,
};
use foldhash::{HashMap, HashMapExt};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;

/// What every chunk reads: the DAG, its flat edges and the schedule.
pub(super) struct Ctx<'a> {
    pub dag: &'a TrainingDag,
    pub flat: &'a Flat,
    /// The global list schedule.
    pub order: &'a [NodeId],
    /// Each node's index in `order` (`u32::MAX`: not in it).
    pub order_ix: &'a [u32],
    /// Each node's first global position (the deadlock check's dense keys:
    /// a node on n devices owns n of them).
    pub pos_base: &'a [u32],
    /// Per order index: which chunks the node has devices in (a bit each).
    pub chunks_of: &'a [u64],
    /// Each device's rank, and the devices by rank.
    pub rank: &'a [u32],
    pub by_rank: &'a [u32],
    /// Each device's chunk.
    pub chunk: &'a [u8],
    pub nchunks: usize,
    pub placement: &'a [Option<(Vec<DeviceId>, Option<u32>)>],
    /// Each node's device group, interned.
    pub groups: &'a Groups<'a>,
    /// Split dimensions and their sizes, outermost first.
    pub split_sizes: &'a [(TagKey, u32)],
    pub microbatches: u32,
}

/// Ops wait in a small buffer and move to their streams in bursts: an `Arc`
/// clone is a locked instruction, which waits until every store before it
/// (an op written to fresh memory) is done.
pub(super) const BURST: usize = 64;

impl<'a> Ctx<'a> {
    /// The devices of node index `n`.
    fn devices(&self, n: usize) -> &'a [DeviceId] {
        self.groups.devices(n)
    }
    /// The ranks of chunk `c`.
    fn ranks(&self, c: usize) -> std::ops::Range<usize> {
        let n = self.rank.len();
        let lo = (0..n).find(|&r| r * self.nchunks / n == c).unwrap_or(n);
        let hi = (lo..n).find(|&r| r * self.nchunks / n != c).unwrap_or(n);
        lo..hi
    }
}

/// One device as its chunk built it.
pub(super) struct Built {
    pub device: u32,
    /// Its streams in first-use order: name, ops, hash.
    pub streams: Vec<(Arc<str>, Vec<Op>, [u64; 2])>,
    pub transient_peak: u64,
    pub steps: Vec<StreamSteps>,
}

/// Is the tensor on this edge a transient buffer (vs. a resident model state)?
pub(super) fn transient(dag: &TrainingDag, producer: NodeId, tensor: TensorKind) -> bool {
    match tensor {
        TensorKind::Activation
        | TensorKind::ActGrad
        | TensorKind::Saved
        | TensorKind::MicroGrad
        | TensorKind::Stash
        | TensorKind::Routed => true,
        TensorKind::ParamGrad => false,
        TensorKind::Param => matches!(
            &dag.graph[producer.ix()].kind,
            NodeKind::Comm(c) if c.purpose == CommPurpose::ParamGather
        ),
    }
}

/// A device list as a shared list of ids (one allocation).
fn id_list(devs: &[DeviceId]) -> Arc<[u32]> {
    devs.iter().map(|d| d.0).collect()
}

/// A chunk's stream names: the DAG's, then the per-direction-and-peer p2p
/// streams (`pp→2`, `pp←0`) as first used. Each keeps its peer's order, and a
/// send never waits behind the receive of a later microbatch from another
/// peer (one F+B of bubble per stage that the simulator showed in 1F1B).
struct Names {
    names: Vec<Arc<str>>,
    /// Each stream's place in a wait list: the DAG's streams by id, then
    /// the derived ones by (stream, direction, peer), so a wait list's
    /// order does not depend on which chunk built it.
    keys: Vec<(u16, u8, u32)>,
    derived: HashMap<(u16, bool, u32), u16>,
}

impl Names {
    fn new(dag: &TrainingDag) -> Self {
        let names: Vec<Arc<str>> = (0..=u16::MAX as usize)
            .map_while(|i| dag.stream_name_opt(crate::dag::StreamId(i as u16)))
            .map(Arc::from)
            .collect();
        Names {
            keys: (0..names.len()).map(|i| (i as u16, 0, 0)).collect(),
            names,
            derived: HashMap::new(),
        }
    }
    /// The stream of the node's op on its `i`-th device.
    fn of(&mut self, n: &Node, i: usize) -> u16 {
        let NodeKind::Comm(c) = &n.kind else {
            return n.stream.0;
        };
        let (true, Some(peer)) = (c.op.is_p2p(), c.peers.get(i)) else {
            return n.stream.0;
        };
        let send = matches!(c.op, CommOp::Send);
        if let Some(&s) = self.derived.get(&(n.stream.0, send, peer.0)) {
            return s;
        }
        if self.names.len() > u16::MAX as usize {
            return n.stream.0;
        }
        let name = format!(
            "{}{}{}",
            self.names[n.stream.0 as usize],
            if send { '→' } else { '←' },
            peer.0
        );
        self.names.push(Arc::from(name));
        self.keys
            .push((n.stream.0, if send { 2 } else { 1 }, peer.0));
        let s = (self.names.len() - 1) as u16;
        self.derived.insert((n.stream.0, send, peer.0), s);
        s
    }
}

/// A device of the chunk while it is built.
struct Dev {
    /// Streams in first-use order: (stream id, op count).
    counts: Vec<(u16, u32)>,
    /// Per stream id: its position in `counts`, and the position of the
    /// first stream of its name (what a wait on it means).
    own: Vec<u32>,
    first: Vec<u32>,
    /// Ops, hash and steps per stream (in `counts` order).
    lists: Vec<(Vec<Op>, plan::StreamHasher, StreamSteps)>,
    live: u64,
    peak: u64,
}

/// What the op leaves for local readers, and who reads it.
struct Readers<'a> {
    /// Bytes of the transient buffers the op leaves for local readers.
    out_bytes: u64,
    /// Transient readers on exactly this node's devices, and the device
    /// lists of the others.
    same: u32,
    other: Vec<&'a [DeviceId]>,
}

impl Readers<'_> {
    /// Local readers of the op's transient buffers on `dev`.
    fn on(&self, dev: DeviceId) -> u32 {
        self.same + self.other.iter().filter(|r| r.contains(&dev)).count() as u32
    }
}

/// What every device's op of one node shares. Each op is put together
/// field by field from these (not cloned from a template and then
/// overwritten): every `Arc` an op holds is counted once, and a count is a
/// locked instruction that waits for the stores before it.
struct Described<'a> {
    kind: OpKind,
    common: Arc<OpCommon>,
    /// The inputs every device reads (when `single_device_inputs`).
    inputs: Arc<[Input]>,
    /// Expert- or tensor-parallel compute: the node's devices.
    spread_group: Option<Arc<[u32]>>,
    /// Every effective predecessor (markers passed through) runs on exactly
    /// this node's devices, so each device reads the same `inputs`
    /// (otherwise each lists its own).
    single_device_inputs: bool,
    readers: Readers<'a>,
    /// Collectives: each group as a list.
    groups: Vec<Arc<[u32]>>,
    staging: u64,
    first_device: u32,
    spread: Option<Spread>,
}

/// The per-chunk caches of shared values.
struct Shared<'a> {
    no_segments: Arc<[u32]>,
    one_segment: Vec<Arc<[u32]>>,
    /// Tag maps once per distinct tag set (the F and B of a stage's
    /// microbatch carry the same tags).
    tag_maps: HashMap<&'a Tags, Arc<BTreeMap<String, u32>>>,
    no_waits: Arc<[Wait]>,
    no_inputs: Arc<[Input]>,
    /// A node's inputs while they are gathered.
    inputs: Vec<Input>,
}

impl Shared<'_> {
    /// A node's segments: a one-segment list is shared.
    fn segments(&self, segments: &[u32]) -> Arc<[u32]> {
        match segments {
            [s] => self.one_segment.get(*s as usize).cloned(),
            _ => None,
        }
        .unwrap_or_else(|| Arc::from(segments))
    }
}

fn input_of((p, ek): &(NodeId, EdgeKind)) -> Option<Input> {
    match ek {
        EdgeKind::Data { tensor, .. } => Some(Input {
            node: p.0,
            tensor: *tensor,
        }),
        _ => None,
    }
}

/// An op's inputs in their canonical order (by node, then tensor), each
/// once. Sorted only when out of order: an update's thousands of gradients
/// mostly come in order.
fn sort_inputs(inputs: &mut Vec<Input>) {
    let key = |i: &Input| (i.node, i.tensor as u8);
    if !inputs.is_sorted_by_key(key) {
        inputs.sort_unstable_by_key(key);
    }
    inputs.dedup();
}

/// Describe node `id` (what its ops share) from its effective predecessors.
fn describe<'a>(
    cx: &Ctx<'a>,
    sh: &mut Shared<'a>,
    id: NodeId,
    n: &'a Node,
    preds: &[(NodeId, EdgeKind)],
    single_device_inputs: bool,
) -> Described<'a> {
    let dag = cx.dag;
    let my_gid = cx.groups.gid[id.ix().index()];
    // The inputs every device reads, when they are the same everywhere
    // (otherwise each device lists its own).
    let inputs: Arc<[Input]> = if single_device_inputs {
        // Gathered in a kept buffer: the list's one allocation is its `Arc`.
        let inputs = &mut sh.inputs;
        inputs.clear();
        inputs.extend(preds.iter().filter_map(input_of));
        sort_inputs(inputs);
        if inputs.is_empty() {
            sh.no_inputs.clone()
        } else {
            Arc::from(&inputs[..])
        }
    } else {
        sh.no_inputs.clone()
    };
    let cost = dag.cost(id);
    let div = dag.batch_share_div(id);
    let (segments, purpose): (Arc<[u32]>, Option<CommPurpose>) = match &n.kind {
        NodeKind::Compute { segment, .. } => (sh.segments(std::slice::from_ref(segment)), None),
        NodeKind::Update { segments } => (sh.segments(segments), None),
        NodeKind::Comm(c) => (sh.segments(&c.segments), Some(c.purpose)),
        NodeKind::Marker => (sh.no_segments.clone(), None),
    };
    let groups: Vec<Arc<[u32]>> = match &n.kind {
        NodeKind::Comm(c) if !c.op.is_p2p() => c.groups.iter().map(|grp| id_list(grp)).collect(),
        _ => Vec::new(),
    };
    let microbatch = cx.split_sizes.iter().fold(0u32, |acc, (key, size)| {
        acc * size + n.tags.get(*key).unwrap_or(0)
    });
    // ZeRO stage of the segments involved (from their replication spec).
    let zero = {
        let segs: &[u32] = match &n.kind {
            NodeKind::Compute { segment, .. } => std::slice::from_ref(segment),
            NodeKind::Update { segments } => segments,
            NodeKind::Comm(c) => &c.segments,
            NodeKind::Marker => &[],
        };
        segs.iter()
            .filter_map(|s| cx.placement[*s as usize].as_ref())
            .filter(|(devs, _)| devs.len() > 1)
            .filter_map(|(_, rep)| rep.map(|r| dag.specs[r as usize].zero))
            .max()
            .unwrap_or(0)
    };
    // Expert- or tensor-parallel compute: its group exchanges inside the op,
    // so the op meets its group like a collective (a phase of a split expert
    // pass carries it too; its exchanges are ops).
    let spread = match (&n.kind, n.replica) {
        (NodeKind::Compute { .. }, _) if n.devices.len() > 1 && n.tensor_parallel.is_some() => {
            Some(Spread::Tensor)
        }
        (NodeKind::Compute { .. }, Some(r))
            if n.devices.len() > 1 && dag.specs[r as usize].expert_parallel.is_some() =>
        {
            Some(Spread::Experts)
        }
        _ => None,
    };
    // What the op leaves for local readers: one buffer per tensor kind,
    // however many readers it has; readers on exactly this node's devices
    // read on each of them, others where they run.
    let readers = {
        let mut by_kind = [0u64; 8];
        let mut other: Vec<&[DeviceId]> = Vec::new();
        let mut same = 0u32;
        for &(s, ek) in cx.flat.succs(id.ix().index()) {
            let EdgeKind::Data { tensor, bytes } = ek else {
                continue;
            };
            if !transient(dag, id, tensor) {
                continue;
            }
            let mut b = if tensor.scales_with_batch() {
                bytes / div
            } else {
                bytes
            };
            // Tensor parallelism splits about three quarters of what a
            // segment saves and stashes (heads, MLP units).
            if n.tensor_parallel.is_some()
                && matches!(tensor, TensorKind::Saved | TensorKind::Stash)
            {
                let t = n.devices.len().max(1) as u64;
                b = b / 4 + (b - b / 4) / t;
            }
            let slot = &mut by_kind[tensor as usize];
            *slot = (*slot).max(b);
            if cx.groups.gid[s as usize] == my_gid {
                same += 1;
            } else {
                other.push(cx.devices(s as usize));
            }
        }
        Readers {
            out_bytes: by_kind.iter().sum(),
            same,
            other,
        }
    };
    // A collective stages this device's contribution and the result while
    // it runs (the runtime accounts both against the cap): the whole buffer
    // twice for an all-reduce; the whole and one member's chunk for a
    // reduce-scatter (its contribution, its chunk of the sum) or an
    // all-gather (its shard, the gathered whole).
    let staging = match &n.kind {
        NodeKind::Comm(c) if !c.op.is_p2p() && c.purpose != CommPurpose::GradNorm => {
            let whole = comm_bytes(c, div);
            match c.op {
                CommOp::ReduceScatter | CommOp::AllGather => {
                    let members = c.groups.iter().map(|g| g.len()).max().unwrap_or(1);
                    whole.saturating_add(whole.div_ceil(members.max(1) as u64))
                }
                _ => whole.saturating_mul(2),
            }
        }
        _ => 0,
    };
    let tags = sh
        .tag_maps
        .entry(&n.tags)
        .or_insert_with(|| Arc::new(dag.tag_map(&n.tags)))
        .clone();
    Described {
        kind: OpKind::of(&n.kind).expect("markers are skipped"),
        common: Arc::new(OpCommon {
            tags,
            segments,
            spread,
            phase: match n.kind {
                NodeKind::Compute { phase, .. } => phase,
                _ => None,
            },
            purpose,
            batch_div: div,
            flops: cost.flops,
            bytes: cost.comm_bytes,
            microbatch,
            microbatches: cx.microbatches,
            tensor: match &n.kind {
                NodeKind::Comm(c) => Some(c.tensor),
                _ => None,
            },
            zero,
            param_bytes: cost.param_bytes,
        }),
        inputs,
        spread_group: spread.map(|_| id_list(&n.devices)),
        single_device_inputs,
        readers,
        groups,
        staging,
        // The lowest device running the node: its op there is the node's
        // first in plan order (the plan hash covers the shared fields there).
        first_device: n.devices.iter().map(|d| d.0).min().unwrap_or(0),
        spread,
    }
}

/// Bytes a communication node moves per device.
fn comm_bytes(c: &crate::dag::Comm, div: u64) -> u64 {
    if c.tensor.scales_with_batch() {
        c.bytes / div
    } else {
        c.bytes
    }
}

/// Build the devices of chunk `c`.
pub(super) fn chunk<'a>(cx: &Ctx<'a>, c: usize) -> Vec<Built> {
    let dag = cx.dag;
    let g = &dag.graph;
    let bit = 1u64 << c;
    let ranks = cx.ranks(c);
    let lo = ranks.start;
    let mut devs: Vec<Dev> = ranks
        .clone()
        .map(|_| Dev {
            counts: Vec::new(),
            own: Vec::new(),
            first: Vec::new(),
            lists: Vec::new(),
            live: 0,
            peak: 0,
        })
        .collect();
    let local = |d: usize| cx.rank[d] as usize - lo;
    let here = |d: usize| cx.chunk[d] as usize == c;
    let mut names = Names::new(dag);
    // Local slots: a node's i-th device at `base[node] + i`, for the nodes
    // of this chunk; each slot's (stream, index), and for the memory walk
    // the bytes it left and its readers still to come.
    let mut base = vec![u32::MAX; cx.order_ix.len()];
    let mut slots: Vec<(u16, u32)> = Vec::new();
    let mine = || {
        cx.order
            .iter()
            .enumerate()
            .filter(move |(k, _)| cx.chunks_of[*k] & bit != 0)
    };
    // 1. Positions.
    let mut nodes = 0usize;
    for (_, &id) in mine() {
        nodes += 1;
        let n = &g[id.ix()];
        base[id.ix().index()] = slots.len() as u32;
        for (i, dev) in n.devices.iter().enumerate() {
            let d = dev.0 as usize;
            if !here(d) {
                slots.push((u16::MAX, u32::MAX));
                continue;
            }
            let sid = names.of(n, i);
            let counts = &mut devs[local(d)].counts;
            let idx = match counts.iter_mut().find(|(s, _)| *s == sid) {
                Some(e) => {
                    e.1 += 1;
                    e.1 - 1
                }
                None => {
                    counts.push((sid, 1));
                    0
                }
            };
            slots.push((sid, idx));
        }
    }
    for dv in &mut devs {
        dv.own = vec![NO_STREAM; names.names.len()];
        dv.first = vec![NO_STREAM; names.names.len()];
        for (p, &(s, _)) in dv.counts.iter().enumerate() {
            dv.own[s as usize] = p as u32;
            let name = &names.names[s as usize];
            dv.first[s as usize] = dv
                .counts
                .iter()
                .position(|(x, _)| names.names[*x as usize] == *name)
                .map_or(p as u32, |f| f as u32);
        }
        dv.lists = dv
            .counts
            .iter()
            .map(|&(s, n)| {
                (
                    Vec::with_capacity(n as usize),
                    plan::StreamHasher::new(&names.names[s as usize]),
                    StreamSteps {
                        steps: Vec::with_capacity(n as usize),
                        waits: Vec::new(),
                    },
                )
            })
            .collect();
    }
    let mut bufs: Vec<(u64, u32)> = vec![(0, 0); slots.len()];

    // 2. Ops, hashes, memory and steps, node by node.
    let mut sh = Shared {
        no_segments: Arc::from(Vec::new()),
        one_segment: (0..dag.segments().len() as u32)
            .map(|s| Arc::from(vec![s]))
            .collect(),
        // Room for a tag set per two nodes (a microbatch's F and B share
        // one): the map does not grow while the chunk is built.
        tag_maps: HashMap::with_capacity(nodes / 2),
        no_waits: Arc::from(Vec::new()),
        no_inputs: Arc::from(Vec::new()),
        inputs: Vec::new(),
    };
    // The last waits list, to share with the next op that waits on the
    // same positions (a node's next device, mostly).
    let mut last_waits: (Vec<(u32, u32)>, Arc<[Wait]>) = (Vec::new(), sh.no_waits.clone());
    let mut wait_at: Vec<(u32, u32)> = Vec::new();
    // Messages sent from this chunk's devices, until their receive: (the
    // receive's order index, local device, bytes).
    let mut in_flight: BinaryHeap<Reverse<(u32, usize, u64)>> = BinaryHeap::new();
    let mut preds: Vec<(NodeId, EdgeKind)> = Vec::new();
    let mut stack: Vec<(NodeId, EdgeKind)> = Vec::new();
    let mut pred_at: Vec<(u32, bool)> = Vec::new();
    let mut ready: Vec<(usize, usize, Op)> = Vec::with_capacity(BURST + 64);
    // Per node: its devices in this chunk, each device's place among them
    // (`u32::MAX` for others), and per place the waits and local inputs.
    let mut here_ix: Vec<(u32, u32)> = Vec::new();
    let mut slot_of = vec![u32::MAX; cx.rank.len()];
    type Acc = (Vec<(u16, u32)>, Vec<Input>);
    let mut acc: Vec<Acc> = Vec::new();
    for (k, &id) in mine() {
        let n = &g[id.ix()];
        let k = k as u32;
        // Every device of the node is in this chunk.
        let whole = cx.chunks_of[k as usize] == bit;
        // A message whose receive has come is off its sender's account.
        while let Some(&Reverse((rk, dl, b))) = in_flight.peek() {
            if rk > k {
                break;
            }
            in_flight.pop();
            devs[dl].live = devs[dl].live.saturating_sub(b);
        }
        let my_gid = cx.groups.gid[id.ix().index()];
        // Markers are pass-through: the node's effective predecessors.
        preds.clear();
        stack.clear();
        stack.extend(
            cx.flat
                .preds(id.ix().index())
                .iter()
                .map(|&(p, k)| (NodeId(p), k)),
        );
        while let Some((p, ek)) = stack.pop() {
            if cx.groups.is_marker(p.ix().index()) {
                stack.extend(
                    cx.flat
                        .preds(p.ix().index())
                        .iter()
                        .map(|&(q, k)| (NodeId(q), k)),
                );
            } else {
                preds.push((p, ek));
            }
        }
        pred_at.clear();
        pred_at.extend(preds.iter().map(|(p, _)| {
            (
                base[p.ix().index()],
                cx.groups.gid[p.ix().index()] == my_gid,
            )
        }));
        let single = pred_at.iter().all(|(_, same)| *same);
        let desc = describe(cx, &mut sh, id, n, &preds, single);
        let uniform_readers = desc.readers.other.is_empty();
        let kbase = base[id.ix().index()] as usize;
        let gbase = cx.pos_base[id.ix().index()];
        let comm = match &n.kind {
            NodeKind::Comm(cm) => Some(cm),
            _ => None,
        };
        // The node's devices in this chunk: (index in the node, device).
        here_ix.clear();
        here_ix.extend(
            n.devices
                .iter()
                .enumerate()
                .filter(|(_, d)| whole || here(d.0 as usize))
                .map(|(i, d)| (i as u32, d.0)),
        );
        for (h, &(_, d)) in here_ix.iter().enumerate() {
            slot_of[d as usize] = h as u32;
        }
        // Cross-stream waits (latest op per stream) and local inputs of
        // each device, from each predecessor's positions where it runs.
        if acc.len() < here_ix.len() {
            acc.resize_with(here_ix.len(), Default::default);
        }
        for a in &mut acc[..here_ix.len()] {
            a.0.clear();
            a.1.clear();
        }
        for (pe, &(pbase, same)) in preds.iter().zip(&pred_at) {
            let input = (!desc.single_device_inputs).then(|| input_of(pe)).flatten();
            let mut visit = |h: usize, (ps, pidx): (u16, u32)| {
                let (waits, inputs) = &mut acc[h];
                let sid = slots[kbase + here_ix[h].0 as usize].0;
                if ps != sid {
                    match waits.iter_mut().find(|(s, _)| *s == ps) {
                        Some(w) => w.1 = w.1.max(pidx),
                        None => waits.push((ps, pidx)),
                    }
                }
                if let Some(inp) = input {
                    inputs.push(inp);
                }
            };
            if same {
                for h in 0..here_ix.len() {
                    visit(h, slots[pbase as usize + here_ix[h].0 as usize]);
                }
            } else {
                for (j, pd) in cx.devices(pe.0.ix().index()).iter().enumerate() {
                    let h = slot_of[pd.0 as usize];
                    if h != u32::MAX {
                        visit(h as usize, slots[pbase as usize + j]);
                    }
                }
            }
        }
        for (h, &(i, d)) in here_ix.iter().enumerate() {
            let (i, dev) = (i as usize, DeviceId(d));
            let d = d as usize;
            let dl = local(d);
            let (sid, _) = slots[kbase + i];
            let on_dev = if uniform_readers {
                desc.readers.same
            } else {
                desc.readers.on(dev)
            };
            // Peers, pair and groups; the deadlock check's view of the op.
            let (mut kind, mut key, mut need) = match desc.spread {
                Some(_) => (Kind::Collective, gbase, n.devices.len() as u32),
                None => (Kind::Local, 0, 0),
            };
            let (mut peer, mut pair) = (None, None);
            let mut group = None;
            if let Some(cm) = comm {
                if cm.op.is_p2p() {
                    peer = cm.peers.get(i).map(|p| p.0);
                    pair = Some(match cm.op {
                        CommOp::Send => id.0,
                        _ => cm.pair.map(|p| p.0).unwrap_or(u32::MAX),
                    });
                    (kind, key) = match (cm.op, cm.pair, peer) {
                        (CommOp::Send, _, _) => (Kind::Send, gbase + i as u32),
                        (_, Some(pair), Some(peer)) if g.contains_node(pair.ix()) => {
                            let at = cx
                                .devices(pair.ix().index())
                                .iter()
                                .position(|x| x.0 == peer);
                            match (at, cx.pos_base[pair.ix().index()]) {
                                (Some(at), pb) if pb != u32::MAX => (Kind::Recv, pb + at as u32),
                                _ => (Kind::Never, 0),
                            }
                        }
                        _ => (Kind::Never, 0),
                    };
                } else {
                    let gi = cm.groups.iter().position(|grp| grp.contains(&dev));
                    group = gi.map(|gi| desc.groups[gi].clone());
                    (kind, key, need) = match gi {
                        Some(gi) if cm.groups[gi].len() > 1 => (
                            Kind::Collective,
                            gbase + gi as u32,
                            cm.groups[gi].len() as u32,
                        ),
                        _ => (Kind::Local, 0, 0),
                    };
                }
            } else {
                group = desc.spread_group.clone();
            }
            let (waits, local_inputs) = &mut acc[h];
            let inputs = if desc.single_device_inputs {
                desc.inputs.clone()
            } else {
                sort_inputs(local_inputs);
                Arc::from(&local_inputs[..])
            };
            if waits.len() > 1 {
                waits.sort_unstable_by_key(|&(s, i)| (names.keys[s as usize], i));
            }
            // Each wait as (the device's stream position, op index). The
            // devices of an SPMD node mostly wait on the same positions: one
            // list for them (no allocation per op).
            let dv = &devs[dl];
            wait_at.clear();
            wait_at.extend(waits.iter().map(|&(s, i)| (dv.first[s as usize], i)));
            let waits_list = if wait_at.is_empty() {
                sh.no_waits.clone()
            } else if last_waits.0 == wait_at {
                last_waits.1.clone()
            } else {
                let list: Arc<[Wait]> = wait_at
                    .iter()
                    .map(|&(s, i)| Wait {
                        stream: StreamIx(s),
                        op: i as usize,
                    })
                    .collect();
                last_waits.0.clone_from(&wait_at);
                last_waits.1 = list.clone();
                list
            };
            let op = Op {
                op: desc.kind,
                node: id.0,
                common: desc.common.clone(),
                peer,
                pair,
                group,
                waits: waits_list,
                inputs,
                // A tensor-parallel group runs one batch share.
                replica: if desc.spread == Some(Spread::Tensor) {
                    0
                } else {
                    i as u32
                },
                out_bytes: if desc.readers.out_bytes > 0 && on_dev > 0 {
                    desc.readers.out_bytes
                } else {
                    0
                },
            };
            let dv = &mut devs[dl];
            let si = dv.own[sid as usize] as usize;
            let (_, hasher, steps) = &mut dv.lists[si];
            steps.waits.extend_from_slice(&wait_at);
            let waits_end = steps.waits.len() as u32;
            steps.steps.push(Step {
                key,
                need,
                waits_end,
                kind,
            });
            hasher.op(&op, d as u32 == desc.first_device, wait_at.iter().copied());
            // Memory: the op's buffers (inputs are released below).
            dv.peak = dv.peak.max(dv.live + desc.staging);
            if on_dev > 0 {
                dv.live += desc.readers.out_bytes;
                bufs[kbase + i] = (desc.readers.out_bytes, on_dev);
            }
            dv.peak = dv.peak.max(dv.live);
            ready.push((dl, si, op));
        }
        if ready.len() >= BURST {
            for (dl, si, op) in ready.drain(..) {
                devs[dl].lists[si].0.push(op);
            }
        }
        // Release inputs whose last local reader this was. Data edges never
        // pass through markers (they carry order only), so the data
        // predecessors are the direct producers.
        let mut release = |slot: usize, d: usize| {
            let entry = &mut bufs[slot];
            if entry.1 > 0 {
                entry.1 -= 1;
                if entry.1 == 0 {
                    devs[local(d)].live -= entry.0;
                }
            }
        };
        for (pe, &(pbase, same)) in preds.iter().zip(&pred_at) {
            if !matches!(pe.1, EdgeKind::Data { .. }) {
                continue;
            }
            if same {
                for &(i, d) in &here_ix {
                    release(pbase as usize + i as usize, d as usize);
                }
            } else {
                for (j, pd) in cx.devices(pe.0.ix().index()).iter().enumerate() {
                    if slot_of[pd.0 as usize] != u32::MAX {
                        release(pbase as usize + j, pd.0 as usize);
                    }
                }
            }
        }
        for &(_, d) in &here_ix {
            slot_of[d as usize] = u32::MAX;
        }
        // A message stays on its sender's account from the send until its
        // receiver holds it (as the runtime counts it).
        if let Some(cm) = comm {
            if let (CommOp::Send, Some(pair)) = (cm.op, cm.pair) {
                let rk = cx
                    .order_ix
                    .get(pair.ix().index())
                    .copied()
                    .unwrap_or(u32::MAX);
                let b = comm_bytes(cm, desc.common.batch_div);
                for dev in &n.devices {
                    let d = dev.0 as usize;
                    if !whole && !here(d) {
                        continue;
                    }
                    let dv = &mut devs[local(d)];
                    dv.live += b;
                    dv.peak = dv.peak.max(dv.live);
                    in_flight.push(Reverse((rk, local(d), b)));
                }
            }
        }
    }
    for (dl, si, op) in ready.drain(..) {
        devs[dl].lists[si].0.push(op);
    }
    devs.into_iter()
        .zip(ranks)
        .map(|(dv, r)| {
            let mut streams = Vec::with_capacity(dv.lists.len());
            let mut steps = Vec::with_capacity(dv.lists.len());
            for (&(sid, _), (ops, h, st)) in dv.counts.iter().zip(dv.lists) {
                let hash = h.finish(ops.len());
                streams.push((names.names[sid as usize].clone(), ops, hash));
                steps.push(st);
            }
            Built {
                device: cx.by_rank[r],
                transient_peak: dv.peak,
                streams,
                steps,
            }
        })
        .collect()
}
