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
use super::is_param_gather;
use super::plan::{self, Act, Collective, Input, Op, OpCommon, StreamIx, Wait};
use super::relayout::Relayout;
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
    /// Each segment's tensor-parallel degree (1: none).
    pub tp: &'a [u32],
    /// Each segment's parameter copies (group, replication).
    pub copies: &'a [Vec<(Vec<DeviceId>, Option<u32>)>],
    /// Each node's device group, interned.
    pub groups: &'a Groups<'a>,
    /// Split dimensions and their sizes, outermost first.
    pub split_sizes: &'a [(TagKey, u32)],
    pub microbatches: u32,
    /// Per segment, of what it saves, stashes and keeps, the shares tensor
    /// parallelism leaves whole on every rank (see [`tp_whole`]).
    pub tp_whole: &'a [[(f64, f64); 3]],
    /// The relayout nodes compile put in and what each moves (`layout.rs`).
    pub relayouts: &'a HashMap<NodeId, Arc<Relayout>>,
    /// Per segment: the bytes of its dense parts' norm outputs over the
    /// global batch, which a selective recompute keeps gathered under
    /// sequence parallelism (see [`sp_norms`]).
    pub sp_norms: &'a [u64],
}

/// Per segment, the norm outputs of its dense parts (two a block, one an
/// attention half) over the global batch: a selective recompute drops
/// them, except under sequence parallelism, where each rank keeps them
/// gathered over its group, whole (`runtime::model::SegmentCache::thin`).
pub(super) fn sp_norms(dag: &TrainingDag) -> Vec<u64> {
    use crate::model::Part;
    let cfg = dag.model();
    let one = u64::from(cfg.batch_size)
        * u64::from(cfg.seq_len)
        * u64::from(cfg.d_model)
        * cfg.precision.act_bytes();
    dag.segments()
        .iter()
        .map(|seg| {
            seg.parts
                .iter()
                .map(|p| match p {
                    Part::Block(_) => 2 * one,
                    Part::Attention(_) => one,
                    _ => 0,
                })
                .sum()
        })
        .collect()
}

/// Of each segment's saved, stashed and kept bytes, the shares tensor
/// parallelism does not split: `(always, unless sequence-parallel)`. All
/// of the embedding's and the head's (every rank runs them whole, on the
/// gathered residual), and a quarter of a block's (its inputs, norm
/// outputs and residual; heads and MLP units split), half of which
/// sequence parallelism splits by rows (the residual stream and the norm
/// statistics; the norm outputs are kept gathered).
pub(super) fn tp_whole(dag: &TrainingDag) -> Vec<[(f64, f64); 3]> {
    use crate::model::Part;
    let cfg = dag.model();
    dag.segments()
        .iter()
        .map(|seg| {
            let (mut all, mut ends, mut blocks) = ([0.0f64; 3], [0.0f64; 3], [0.0f64; 3]);
            for part in &seg.parts {
                let c = crate::model::part_cost(cfg, *part);
                let kinds = [c.saved_bytes, c.stash_bytes, c.kept_bytes];
                for (k, b) in kinds.iter().enumerate() {
                    all[k] += *b as f64;
                    match part {
                        Part::Embedding | Part::Head => ends[k] += *b as f64,
                        _ => blocks[k] += 0.25 * *b as f64,
                    }
                }
            }
            std::array::from_fn(|k| match all[k] > 0.0 {
                true => (ends[k] / all[k], blocks[k] / all[k]),
                false => (0.0, 0.25),
            })
        })
        .collect()
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
        | TensorKind::Routed
        | TensorKind::Kept => true,
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
    /// Per stream (in `counts` order): the order index of its last op so far.
    last_k: Vec<u32>,
    /// The last compute op so far: (stream id, op index).
    last_compute: Option<(u16, u32)>,
    live: u64,
    peak: u64,
    /// The bytes in use at each of the device's ops so far.
    marks: Marks,
}

/// A device's high-water mark at each op (by order index, ascending), and
/// the maximum of each block of [`Marks::BLOCK`] marks, so the highest
/// mark between two order indices is found without walking every op.
#[derive(Default)]
struct Marks {
    k: Vec<u32>,
    bytes: Vec<u64>,
    blocks: Vec<u64>,
    /// The maximum of each [`Marks::BLOCK`] blocks.
    supers: Vec<u64>,
}

impl Marks {
    const BLOCK: usize = 64;
    const SUPER: usize = Self::BLOCK * Self::BLOCK;

    fn push(&mut self, k: u32, bytes: u64) {
        let n = self.bytes.len();
        if n.is_multiple_of(Self::BLOCK) {
            self.blocks.push(bytes);
        } else if let Some(b) = self.blocks.last_mut() {
            *b = (*b).max(bytes);
        }
        if n.is_multiple_of(Self::SUPER) {
            self.supers.push(bytes);
        } else if let Some(b) = self.supers.last_mut() {
            *b = (*b).max(bytes);
        }
        self.k.push(k);
        self.bytes.push(bytes);
    }

    /// The highest mark at order indices in `(after, upto]` (from the
    /// first when `after` is `None`), 0 when none.
    fn high(&self, after: Option<u32>, upto: u32) -> u64 {
        let mut lo = after.map_or(0, |a| self.k.partition_point(|&k| k <= a));
        let hi = self.k.partition_point(|&k| k <= upto);
        let mut high = 0;
        while lo < hi {
            if lo.is_multiple_of(Self::SUPER) && lo + Self::SUPER <= hi {
                high = high.max(self.supers[lo / Self::SUPER]);
                lo += Self::SUPER;
            } else if lo.is_multiple_of(Self::BLOCK) && lo + Self::BLOCK <= hi {
                high = high.max(self.blocks[lo / Self::BLOCK]);
                lo += Self::BLOCK;
            } else {
                high = high.max(self.bytes[lo]);
                lo += 1;
            }
        }
        high
    }
}

impl Dev {
    /// Record `bytes` in use at order index `k`.
    fn mark(&mut self, k: u32, bytes: u64) {
        self.peak = self.peak.max(bytes);
        self.marks.push(k, bytes);
    }
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
    common: Arc<OpCommon>,
    /// The inputs every device reads (when `single_device_inputs`).
    inputs: Arc<[Input]>,
    /// Expert- or tensor-parallel compute: the groups its devices exchange
    /// in (one for experts; one per data-parallel replica for tensor
    /// parallelism), and the group size.
    spread_groups: Vec<Arc<[u32]>>,
    spread_size: u32,
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
    let inputs = shared_inputs(sh, preds, single_device_inputs);
    let cost = dag.cost(id);
    let div = dag.batch_share_div(id);
    let segments = match &n.kind {
        NodeKind::Compute { segment, .. } => sh.segments(std::slice::from_ref(segment)),
        NodeKind::Update { segments } => sh.segments(segments),
        NodeKind::Comm(c) => sh.segments(&c.segments),
        NodeKind::Marker => sh.no_segments.clone(),
    };
    let groups: Vec<Arc<[u32]>> = match &n.kind {
        NodeKind::Comm(c) if !c.op.is_p2p() => c.groups.iter().map(|grp| id_list(grp)).collect(),
        _ => Vec::new(),
    };
    let microbatch = cx.split_sizes.iter().fold(0u32, |acc, (key, size)| {
        acc * size + n.tags.get(*key).unwrap_or(0)
    });
    let zero = zero_stage(cx, n);
    let spread = spread_of(dag, n);
    let readers = readers(cx, id, n, div);
    let staging = staging(n, div);
    let tags = sh
        .tag_maps
        .entry(&n.tags)
        .or_insert_with(|| Arc::new(dag.tag_map(&n.tags)))
        .clone();
    Described {
        common: Arc::new(OpCommon {
            tags,
            segments,
            spread,
            phase: match n.kind {
                NodeKind::Compute { phase, .. } => phase,
                _ => None,
            },
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
            param_bytes: match &n.kind {
                NodeKind::Update { segments } => updated_bytes(cx, n, segments),
                _ => cost.param_bytes,
            },
            tp: match n.kind {
                NodeKind::Compute { .. } => n.tp_degree(),
                _ => 1,
            },
            sp: matches!(n.kind, NodeKind::Compute { .. })
                && n.tensor_parallel.is_some_and(|t| t.sequence),
            cp: match n.kind {
                NodeKind::Compute { .. } => n.cp_degree(),
                _ => 1,
            },
            cp_ring: matches!(n.kind, NodeKind::Compute { .. })
                && n.context_parallel
                    .is_some_and(|c| c.exchange == crate::dag::KvExchange::Ring),
            cp_bytes: cost.cp_bytes,
            shape: super::plan::Shapes(dag.shape(id).map(Arc::new)),
        }),
        inputs,
        spread_groups: match spread {
            Some(Spread::Tensor) => crate::dag::Node::tp_groups(&n.devices, n.tp_degree())
                .map(id_list)
                .collect(),
            Some(Spread::Experts) => vec![id_list(&n.devices)],
            None => Vec::new(),
        },
        spread_size: match spread {
            Some(Spread::Tensor) => n.tp_degree(),
            _ => n.devices.len() as u32,
        },
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

/// Master-weight bytes one device of update node `n` steps: its ZeRO shard of
/// each segment (whole experts of its own under expert parallelism, its
/// slices under tensor parallelism), as the memory plan holds moments.
fn updated_bytes(cx: &Ctx<'_>, n: &Node, segments: &[u32]) -> u64 {
    let elems: u64 = segments
        .iter()
        .map(|&s| {
            let rep = match &cx.placement[s as usize] {
                Some((_, rep)) => *rep,
                None => (cx.copies[s as usize].iter())
                    .find(|(devs, _)| *devs == n.devices)
                    .and_then(|(_, rep)| *rep),
            };
            let e = super::segment_states(cx.dag, cx.placement, cx.tp, s, n.devices.len(), rep);
            e.moments / 2
        })
        .sum();
    elems * cx.dag.model().precision.master.bytes()
}

/// The inputs every device of a node reads, when they are the same
/// everywhere (`single`; otherwise each device lists its own and this is
/// empty). Gathered in a kept buffer: the list's one allocation is its `Arc`.
fn shared_inputs(sh: &mut Shared<'_>, preds: &[(NodeId, EdgeKind)], single: bool) -> Arc<[Input]> {
    if !single {
        return sh.no_inputs.clone();
    }
    let inputs = &mut sh.inputs;
    inputs.clear();
    inputs.extend(preds.iter().filter_map(input_of));
    sort_inputs(inputs);
    if inputs.is_empty() {
        sh.no_inputs.clone()
    } else {
        Arc::from(&inputs[..])
    }
}

/// The ZeRO stage of the segments a node involves (from their replication
/// spec; 0 when none is replicated).
fn zero_stage(cx: &Ctx<'_>, n: &Node) -> u8 {
    let segs: &[u32] = match &n.kind {
        NodeKind::Compute { segment, .. } => std::slice::from_ref(segment),
        NodeKind::Update { segments } => segments,
        NodeKind::Comm(c) => &c.segments,
        NodeKind::Marker => &[],
    };
    // A segment on one group, or each of its parameter copies' groups.
    let groups = |s: &u32| -> Vec<&(Vec<DeviceId>, Option<u32>)> {
        match &cx.placement[*s as usize] {
            Some(one) => vec![one],
            None => cx.copies[*s as usize].iter().collect(),
        }
    };
    segs.iter()
        .flat_map(|s| groups(s).into_iter().map(move |g| (s, g)))
        .filter(|(s, (devs, _))| devs.len() as u32 / cx.tp[**s as usize] > 1)
        .filter_map(|(_, (_, rep))| rep.map(|r| cx.dag.specs[r as usize].zero))
        .max()
        .unwrap_or(0)
}

/// Expert- or tensor-parallel compute: its group exchanges inside the op,
/// so the op meets its group like a collective (a phase of a split expert
/// pass carries it too; its exchanges are ops).
/// Experts spread over a tensor-parallel mesh exchange over all of it.
fn spread_of(dag: &TrainingDag, n: &Node) -> Option<Spread> {
    match (&n.kind, n.replica) {
        (NodeKind::Compute { .. }, Some(r))
            if n.devices.len() > 1 && dag.specs[r as usize].expert_parallel.is_some() =>
        {
            Some(Spread::Experts)
        }
        (NodeKind::Compute { .. }, _) if n.devices.len() > 1 && n.tensor_parallel.is_some() => {
            Some(Spread::Tensor)
        }
        _ => None,
    }
}

/// What node `id`'s op leaves for local readers (`div`: its batch share):
/// one buffer per tensor kind, however many readers it has; readers on
/// exactly this node's devices read on each of them, others where they run.
fn readers<'a>(cx: &Ctx<'a>, id: NodeId, n: &Node, div: u64) -> Readers<'a> {
    let dag = cx.dag;
    let my_gid = cx.groups.gid[id.ix().index()];
    let mut by_kind = [0u64; TensorKind::COUNT];
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
        // Tensor parallelism splits what the segment's heads and MLP units
        // hold and leaves the rest whole (`Ctx::tp_whole`: the embedding's
        // and the head's, and a block's whole quarter, which sequence
        // parallelism halves).
        if let Some(tp) = n.tensor_parallel.filter(|_| {
            matches!(
                tensor,
                TensorKind::Saved | TensorKind::Stash | TensorKind::Kept
            )
        }) {
            let t = n.tp_degree() as u64;
            let kind = match tensor {
                TensorKind::Saved => 0,
                TensorKind::Stash => 1,
                _ => 2,
            };
            let (ends, blocks) = match &n.kind {
                NodeKind::Compute { segment, .. } => cx
                    .tp_whole
                    .get(*segment as usize)
                    .map_or((0.0, 0.25), |w| w[kind]),
                _ => (0.0, 0.25),
            };
            let (ends, blocks) = ((b as f64 * ends) as u64, (b as f64 * blocks) as u64);
            let split = b - ends - blocks;
            let blocks = if tp.sequence {
                blocks / 2 + (blocks - blocks / 2) / t
            } else {
                blocks
            };
            let whole = ends + blocks;
            b = whole + split / t;
            if tp.sequence && tensor == TensorKind::Kept {
                if let NodeKind::Compute { segment, .. } = &n.kind {
                    let norms = cx.sp_norms.get(*segment as usize).copied().unwrap_or(0);
                    b += norms / div;
                }
            }
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
}

/// What a collective stages on each device while it runs (the runtime
/// accounts both against the cap): the whole buffer twice for an
/// all-reduce; the whole and one member's chunk for a reduce-scatter (its
/// contribution, its chunk of the sum) or an all-gather (its shard, the
/// gathered whole). 0 for other nodes.
fn staging(n: &Node, div: u64) -> u64 {
    match &n.kind {
        // A relayout stages on the host (its pieces), not on the device.
        NodeKind::Comm(c)
            if !c.op.is_p2p()
                && !matches!(c.purpose, CommPurpose::GradNorm | CommPurpose::Relayout) =>
        {
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
    let mut b = ChunkBuild::new(cx, c);
    // 1. Positions: each node's (stream, index) on each of the chunk's
    //    devices, and each device's streams.
    let nodes = b.positions();
    // 2. Ops, hashes, memory and steps, node by node.
    let mut sh = Shared {
        no_segments: Arc::from(Vec::new()),
        one_segment: (0..cx.dag.segments().len() as u32)
            .map(|s| Arc::from(vec![s]))
            .collect(),
        // Room for a tag set per two nodes (a microbatch's F and B share
        // one): the map does not grow while the chunk is built.
        tag_maps: HashMap::with_capacity(nodes / 2),
        no_waits: Arc::from(Vec::new()),
        no_inputs: Arc::from(Vec::new()),
        inputs: Vec::new(),
    };
    b.last_waits.1 = sh.no_waits.clone();
    for (k, &id) in mine(cx, b.bit()) {
        b.node(&mut sh, k as u32, id);
    }
    b.finish()
}

/// The order's nodes with a device in the chunk of bit `bit`: (order index, node).
fn mine<'c>(cx: &'c Ctx<'_>, bit: u64) -> impl Iterator<Item = (usize, &'c NodeId)> + 'c {
    cx.order
        .iter()
        .enumerate()
        .filter(move |(k, _)| cx.chunks_of[*k] & bit != 0)
}

/// One device's waits (stream id, op index) and local inputs for a node.
type Acc = (Vec<(u16, u32)>, Vec<Input>);

/// A chunk's devices while they are built, and the buffers its per-node
/// steps reuse.
struct ChunkBuild<'c, 'a> {
    cx: &'c Ctx<'a>,
    c: usize,
    /// The chunk's ranks; a device's local index is its rank less the first.
    ranks: std::ops::Range<usize>,
    devs: Vec<Dev>,
    names: Names,
    /// Local slots: a node's i-th device at `base[node] + i`, for the nodes
    /// of this chunk; each slot's (stream, index), and for the memory walk
    /// the bytes it left and its readers still to come.
    base: Vec<u32>,
    slots: Vec<(u16, u32)>,
    bufs: Vec<(u64, u32)>,
    /// Messages sent from this chunk's devices, until their receive: (the
    /// receive's order index, local device, bytes).
    in_flight: BinaryHeap<Reverse<(u32, usize, u64)>>,
    /// The node's effective predecessors (markers passed through), each
    /// one's slot base and whether it runs on the node's device group.
    preds: Vec<(NodeId, EdgeKind)>,
    stack: Vec<(NodeId, EdgeKind)>,
    /// Per node index, the last [`ChunkBuild::effective_preds`] call that
    /// passed through it (a marker), so a lattice of markers is walked
    /// once per node, not once per path.
    marker_seen: Vec<u32>,
    walk: u32,
    pred_at: Vec<(u32, bool)>,
    /// The node's devices in this chunk: (index in the node, device); each
    /// device's place among them (`u32::MAX` for others); per place the
    /// waits (stream id, op index) and local inputs.
    here_ix: Vec<(u32, u32)>,
    slot_of: Vec<u32>,
    acc: Vec<Acc>,
    /// One op's waits as (the device's stream position, op index), and the
    /// last waits list, to share with the next op that waits on the same
    /// positions (a node's next device, mostly).
    wait_at: Vec<(u32, u32)>,
    last_waits: (Vec<(u32, u32)>, Arc<[Wait]>),
    ready: Vec<(usize, usize, Op)>,
}

impl<'c, 'a> ChunkBuild<'c, 'a> {
    fn new(cx: &'c Ctx<'a>, c: usize) -> Self {
        let ranks = cx.ranks(c);
        ChunkBuild {
            cx,
            c,
            devs: ranks
                .clone()
                .map(|_| Dev {
                    counts: Vec::new(),
                    own: Vec::new(),
                    first: Vec::new(),
                    lists: Vec::new(),
                    last_k: Vec::new(),
                    last_compute: None,
                    live: 0,
                    peak: 0,
                    marks: Marks::default(),
                })
                .collect(),
            ranks,
            names: Names::new(cx.dag),
            base: vec![u32::MAX; cx.order_ix.len()],
            slots: Vec::new(),
            bufs: Vec::new(),
            in_flight: BinaryHeap::new(),
            preds: Vec::new(),
            stack: Vec::new(),
            marker_seen: Vec::new(),
            walk: 0,
            pred_at: Vec::new(),
            here_ix: Vec::new(),
            slot_of: vec![u32::MAX; cx.rank.len()],
            acc: Vec::new(),
            wait_at: Vec::new(),
            last_waits: (Vec::new(), Arc::from(Vec::new())),
            ready: Vec::with_capacity(BURST + 64),
        }
    }

    /// The chunk's bit in `Ctx::chunks_of`.
    fn bit(&self) -> u64 {
        1u64 << self.c
    }

    /// Device `d`'s index among the chunk's devices.
    fn local(&self, d: usize) -> usize {
        self.cx.rank[d] as usize - self.ranks.start
    }

    fn here(&self, d: usize) -> bool {
        self.cx.chunk[d] as usize == self.c
    }

    /// Step 1: every node's slots, each device's streams in first-use order
    /// with their op counts, and the stream lists sized. Returns the number
    /// of nodes in the chunk.
    fn positions(&mut self) -> usize {
        let (cx, g) = (self.cx, &self.cx.dag.graph);
        let mut nodes = 0usize;
        for (_, &id) in mine(cx, self.bit()) {
            nodes += 1;
            let n = &g[id.ix()];
            self.base[id.ix().index()] = self.slots.len() as u32;
            for (i, dev) in n.devices.iter().enumerate() {
                let d = dev.0 as usize;
                if !self.here(d) {
                    self.slots.push((u16::MAX, u32::MAX));
                    continue;
                }
                let sid = self.names.of(n, i);
                let dl = self.local(d);
                let counts = &mut self.devs[dl].counts;
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
                self.slots.push((sid, idx));
            }
        }
        let names = &self.names.names;
        for dv in &mut self.devs {
            dv.own = vec![NO_STREAM; names.len()];
            dv.first = vec![NO_STREAM; names.len()];
            for (p, &(s, _)) in dv.counts.iter().enumerate() {
                dv.own[s as usize] = p as u32;
                let name = &names[s as usize];
                dv.first[s as usize] = dv
                    .counts
                    .iter()
                    .position(|(x, _)| names[*x as usize] == *name)
                    .map_or(p as u32, |f| f as u32);
            }
            dv.lists = dv
                .counts
                .iter()
                .map(|&(s, n)| {
                    (
                        Vec::with_capacity(n as usize),
                        plan::StreamHasher::new(&names[s as usize]),
                        StreamSteps {
                            steps: Vec::with_capacity(n as usize),
                            waits: Vec::new(),
                        },
                    )
                })
                .collect();
            dv.last_k = vec![u32::MAX; dv.counts.len()];
        }
        self.bufs = vec![(0, 0); self.slots.len()];
        nodes
    }

    /// Step 2 for node `id` (order index `k`): its ops on the chunk's
    /// devices, then the memory its inputs and messages free or hold.
    fn node(&mut self, sh: &mut Shared<'a>, k: u32, id: NodeId) {
        let cx = self.cx;
        let n = &cx.dag.graph[id.ix()];
        // Every device of the node is in this chunk.
        let whole = cx.chunks_of[k as usize] == self.bit();
        self.deliver(k);
        self.effective_preds(id);
        let single = self.pred_at.iter().all(|(_, same)| *same);
        let desc = describe(cx, sh, id, n, &self.preds, single);
        // The node's devices in this chunk.
        self.here_ix.clear();
        for (i, d) in n.devices.iter().enumerate() {
            if whole || self.here(d.0 as usize) {
                self.here_ix.push((i as u32, d.0));
            }
        }
        for (h, &(_, d)) in self.here_ix.iter().enumerate() {
            self.slot_of[d as usize] = h as u32;
        }
        self.gather_waits_and_inputs(id, &desc);
        // A selective recompute moves what its forward kept into the saved
        // tensors it makes: freed as it takes them (as the runtime counts
        // them), not after its outputs are counted.
        let moves_kept = self.preds.iter().any(|pe| {
            matches!(
                pe.1,
                EdgeKind::Data {
                    tensor: TensorKind::Kept,
                    ..
                }
            )
        });
        if moves_kept {
            self.release_inputs();
        }
        for h in 0..self.here_ix.len() {
            self.emit(sh, k, id, n, &desc, h);
        }
        if self.ready.len() >= BURST {
            for (dl, si, op) in self.ready.drain(..) {
                self.devs[dl].lists[si].0.push(op);
            }
        }
        if !moves_kept {
            self.release_inputs();
        }
        for &(_, d) in &self.here_ix {
            self.slot_of[d as usize] = u32::MAX;
        }
        self.hold_message(k, n, &desc, whole);
    }

    /// A message whose receive has come (order index ≤ `k`) is off its
    /// sender's account.
    fn deliver(&mut self, k: u32) {
        while let Some(&Reverse((rk, dl, b))) = self.in_flight.peek() {
            if rk > k {
                break;
            }
            self.in_flight.pop();
            self.devs[dl].live = self.devs[dl].live.saturating_sub(b);
        }
    }

    /// The node's effective predecessors (markers are pass-through), each
    /// with its slot base and whether it runs on the node's device group.
    fn effective_preds(&mut self, id: NodeId) {
        let cx = self.cx;
        self.preds.clear();
        self.stack.clear();
        let flat = |p: usize| cx.flat.preds(p).iter().map(|&(q, k)| (NodeId(q), k));
        self.walk = self.walk.wrapping_add(1);
        if self.walk == 0 {
            self.marker_seen.iter_mut().for_each(|s| *s = 0);
            self.walk = 1;
        }
        self.stack.extend(flat(id.ix().index()));
        while let Some((p, ek)) = self.stack.pop() {
            let pi = p.ix().index();
            if cx.groups.is_marker(pi) {
                if self.marker_seen.len() <= pi {
                    self.marker_seen.resize(pi + 1, 0);
                }
                if self.marker_seen[pi] != self.walk {
                    self.marker_seen[pi] = self.walk;
                    self.stack.extend(flat(pi));
                }
            } else {
                self.preds.push((p, ek));
            }
        }
        let my_gid = cx.groups.gid[id.ix().index()];
        let base = &self.base;
        self.pred_at.clear();
        self.pred_at.extend(self.preds.iter().map(|(p, _)| {
            let p = p.ix().index();
            (base[p], cx.groups.gid[p] == my_gid)
        }));
    }

    /// Cross-stream waits (latest op per stream) and local inputs of each
    /// of the node's devices here, from each predecessor's positions where
    /// it runs.
    fn gather_waits_and_inputs(&mut self, id: NodeId, desc: &Described<'a>) {
        let cx = self.cx;
        let kbase = self.base[id.ix().index()] as usize;
        let here_ix = &self.here_ix;
        if self.acc.len() < here_ix.len() {
            self.acc.resize_with(here_ix.len(), Default::default);
        }
        for a in &mut self.acc[..here_ix.len()] {
            a.0.clear();
            a.1.clear();
        }
        let (slots, acc) = (&self.slots, &mut self.acc);
        // A parameter gather has no inputs: left alone its stream would run
        // every gather of the step at once, each buffer held until its
        // reader. It waits for the compute op before it on its device, so
        // it runs at most one compute op ahead of its place in the order
        // and the memory walk's interleaving bounds what the device holds.
        if self.preds.is_empty() && is_param_gather(cx.dag, id.ix().index()) {
            for (h, &(_, d)) in here_ix.iter().enumerate() {
                let dl = cx.rank[d as usize] as usize - self.ranks.start;
                let own = slots[kbase + here_ix[h].0 as usize].0;
                match self.devs[dl].last_compute {
                    Some(w) if w.0 != own => acc[h].0.push(w),
                    _ => {}
                }
            }
        }
        for (pe, &(pbase, same)) in self.preds.iter().zip(&self.pred_at) {
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
                    let h = self.slot_of[pd.0 as usize];
                    if h != u32::MAX {
                        visit(h as usize, slots[pbase as usize + j]);
                    }
                }
            }
        }
    }

    /// The node's op on its `h`-th device here: the op, its stream hash,
    /// its deadlock step and its memory.
    fn emit(
        &mut self,
        sh: &Shared<'a>,
        k: u32,
        id: NodeId,
        n: &Node,
        desc: &Described<'a>,
        h: usize,
    ) {
        let cx = self.cx;
        let (i, d) = self.here_ix[h];
        let (i, dev, d) = (i as usize, DeviceId(d), d as usize);
        let dl = self.local(d);
        let kbase = self.base[id.ix().index()] as usize;
        let (sid, _) = self.slots[kbase + i];
        let on_dev = if desc.readers.other.is_empty() {
            desc.readers.same
        } else {
            desc.readers.on(dev)
        };
        let link = link(cx, id, n, desc, i, dev);
        // A relayout leaves each member what its consumer reads, and nothing
        // on a member that only sends.
        let out_bytes = match &link.act {
            Act::Relayout { spec, .. } => spec.held_bytes(dev.0),
            _ => desc.readers.out_bytes,
        };
        let (waits, local_inputs) = &mut self.acc[h];
        let inputs = if desc.single_device_inputs {
            desc.inputs.clone()
        } else {
            sort_inputs(local_inputs);
            Arc::from(&local_inputs[..])
        };
        if waits.len() > 1 {
            let keys = &self.names.keys;
            waits.sort_unstable_by_key(|&(s, i)| (keys[s as usize], i));
        }
        // Each wait as (the device's stream position, op index). The
        // devices of an SPMD node mostly wait on the same positions: one
        // list for them (no allocation per op).
        let first = &self.devs[dl].first;
        self.wait_at.clear();
        self.wait_at
            .extend(waits.iter().map(|&(s, i)| (first[s as usize], i)));
        let waits_list = if self.wait_at.is_empty() {
            sh.no_waits.clone()
        } else if self.last_waits.0 == self.wait_at {
            self.last_waits.1.clone()
        } else {
            let list: Arc<[Wait]> = self
                .wait_at
                .iter()
                .map(|&(s, i)| Wait {
                    stream: StreamIx(s),
                    op: i as usize,
                })
                .collect();
            self.last_waits.0.clone_from(&self.wait_at);
            self.last_waits.1 = list.clone();
            list
        };
        let op = Op {
            act: link.act,
            node: id.0,
            common: desc.common.clone(),
            waits: waits_list,
            inputs,
            // A tensor-parallel group runs one batch share: its replica's
            // (a context-parallel group of replicas, one share together).
            replica: i as u32 / desc.common.tp.max(1),
            out_bytes: if out_bytes > 0 && on_dev > 0 {
                out_bytes
            } else {
                0
            },
        };
        let dv = &mut self.devs[dl];
        let si = dv.own[sid as usize] as usize;
        let (_, hasher, steps) = &mut dv.lists[si];
        steps.waits.extend_from_slice(&self.wait_at);
        let waits_end = steps.waits.len() as u32;
        steps.steps.push(Step {
            key: link.key,
            need: link.need,
            waits_end,
            kind: link.kind,
        });
        hasher.op(
            &op,
            d as u32 == desc.first_device,
            self.wait_at.iter().copied(),
        );
        // Memory: the op's buffers (inputs are released later). A
        // collective's staging is held from when this device reaches it
        // (its stream's previous op and its inputs here done) until the
        // last member does (every input of the node done): whatever the
        // device held in between is held beside it.
        let prev = dv.last_k[si];
        let before = match (desc.staging > 0).then(|| self.reached(dev, prev)) {
            Some((here, meet)) if here.is_none_or(|h| meet > h) => {
                let dv = &self.devs[dl];
                dv.live.max(dv.marks.high(here, meet))
            }
            _ => self.devs[dl].live,
        };
        let dv = &mut self.devs[dl];
        dv.last_k[si] = k;
        if matches!(n.kind, NodeKind::Compute { .. }) {
            dv.last_compute = Some((sid, dv.lists[si].2.steps.len() as u32 - 1));
        }
        let staged = before.saturating_add(desc.staging);
        if on_dev > 0 {
            dv.live += out_bytes;
            self.bufs[kbase + i] = (out_bytes, on_dev);
        }
        let high = staged.max(dv.live);
        dv.mark(k, high);
        self.ready.push((dl, si, op));
    }

    /// The order index after which `dev` can start the current node (its
    /// stream's previous op there, `prev`, `u32::MAX` for none, and every
    /// effective predecessor running there; `None`: from the step's
    /// start), and the one after which every device can (the latest
    /// predecessor anywhere, or this device's own).
    fn reached(&self, dev: DeviceId, prev: u32) -> (Option<u32>, u32) {
        let cx = self.cx;
        let mut here = (prev != u32::MAX).then_some(prev);
        let mut last = 0;
        for (pe, &(_, same)) in self.preds.iter().zip(&self.pred_at) {
            let p = pe.0.ix().index();
            let pk = cx.order_ix[p];
            last = last.max(pk);
            if same || cx.devices(p).contains(&dev) {
                here = Some(here.map_or(pk, |a| a.max(pk)));
            }
        }
        (here, last.max(here.unwrap_or(0)))
    }

    /// Release inputs whose last local reader this node was. Data edges
    /// never pass through markers (they carry order only), so the data
    /// predecessors are the direct producers.
    fn release_inputs(&mut self) {
        let cx = self.cx;
        let lo = self.ranks.start;
        let (bufs, devs) = (&mut self.bufs, &mut self.devs);
        let mut release = |slot: usize, d: usize| {
            let entry = &mut bufs[slot];
            if entry.1 > 0 {
                entry.1 -= 1;
                if entry.1 == 0 {
                    devs[cx.rank[d] as usize - lo].live -= entry.0;
                }
            }
        };
        for (pe, &(pbase, same)) in self.preds.iter().zip(&self.pred_at) {
            if !matches!(pe.1, EdgeKind::Data { .. }) {
                continue;
            }
            if same {
                for &(i, d) in &self.here_ix {
                    release(pbase as usize + i as usize, d as usize);
                }
            } else {
                for (j, pd) in cx.devices(pe.0.ix().index()).iter().enumerate() {
                    if self.slot_of[pd.0 as usize] != u32::MAX {
                        release(pbase as usize + j, pd.0 as usize);
                    }
                }
            }
        }
    }

    /// A message stays on its sender's account from the send until its
    /// receiver holds it (as the runtime counts it).
    fn hold_message(&mut self, k: u32, n: &Node, desc: &Described<'a>, whole: bool) {
        let NodeKind::Comm(cm) = &n.kind else {
            return;
        };
        let (CommOp::Send, Some(pair)) = (cm.op, cm.pair) else {
            return;
        };
        let rk = self
            .cx
            .order_ix
            .get(pair.ix().index())
            .copied()
            .unwrap_or(u32::MAX);
        let b = comm_bytes(cm, desc.common.batch_div);
        for dev in &n.devices {
            let d = dev.0 as usize;
            if !whole && !self.here(d) {
                continue;
            }
            let dl = self.local(d);
            let dv = &mut self.devs[dl];
            dv.live += b;
            let live = dv.live;
            dv.mark(k, live);
            self.in_flight.push(Reverse((rk, dl, b)));
        }
    }

    /// The chunk's devices, built.
    fn finish(mut self) -> Vec<Built> {
        for (dl, si, op) in self.ready.drain(..) {
            self.devs[dl].lists[si].0.push(op);
        }
        let names = &self.names.names;
        self.devs
            .into_iter()
            .zip(self.ranks)
            .map(|(dv, r)| {
                let mut streams = Vec::with_capacity(dv.lists.len());
                let mut steps = Vec::with_capacity(dv.lists.len());
                for (&(sid, _), (ops, h, st)) in dv.counts.iter().zip(dv.lists) {
                    let hash = h.finish(ops.len());
                    streams.push((names[sid as usize].clone(), ops, hash));
                    steps.push(st);
                }
                Built {
                    device: self.cx.by_rank[r],
                    transient_peak: dv.peak,
                    streams,
                    steps,
                }
            })
            .collect()
    }
}

/// How an op meets other devices: its peer and pair (send/receive), its
/// group (collectives, spread compute), and the deadlock check's view.
struct Link {
    act: Act,
    kind: Kind,
    key: u32,
    need: u32,
}

/// The link of node `id`'s op on its `i`-th device `dev`.
fn link(cx: &Ctx<'_>, id: NodeId, n: &Node, desc: &Described<'_>, i: usize, dev: DeviceId) -> Link {
    let gbase = cx.pos_base[id.ix().index()];
    // A tensor-parallel mesh meets in one group per replica.
    let within = i / desc.spread_size.max(1) as usize;
    let cp = match n.kind {
        NodeKind::Compute { .. } => n.cp_degree(),
        _ => 1,
    };
    let (kind, key, need) = match desc.spread {
        // A context-parallel op meets its tensor- and context-parallel
        // groups: the check sees their whole block as one collective.
        _ if cp > 1 => {
            let block = n.tp_degree() * cp;
            let at = i as u32 / block;
            (Kind::Collective, gbase + at, block)
        }
        Some(_) => (Kind::Collective, gbase + within as u32, desc.spread_size),
        None => (Kind::Local, 0, 0),
    };
    let comm = match &n.kind {
        NodeKind::Compute { pass, .. } => {
            let group = desc.spread_groups.get(within).cloned();
            let context = (cp > 1).then(|| {
                let g = crate::dag::Node::cp_group(&n.devices, n.tp_degree(), cp, i);
                id_list(&g)
            });
            let act = Act::Compute {
                pass: *pass,
                group,
                context,
            };
            return Link {
                act,
                kind,
                key,
                need,
            };
        }
        // Markers never become ops (the build skips them before here).
        NodeKind::Update { .. } | NodeKind::Marker => {
            return Link {
                act: Act::Update,
                kind,
                key,
                need,
            }
        }
        NodeKind::Comm(cm) => cm,
    };
    // `validate` saw to a peer per device and a known collective; the
    // fallbacks below only keep a plan the checks refuse from panicking.
    if comm.op.is_p2p() {
        let peer = comm.peers.get(i).map_or(u32::MAX, |p| p.0);
        let (kind, key) = match (comm.op, comm.pair) {
            (CommOp::Send, _) => (Kind::Send, gbase + i as u32),
            (_, Some(pair)) if cx.dag.graph.contains_node(pair.ix()) => {
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
        let act = match comm.op {
            CommOp::Send => Act::Send {
                to: peer,
                pair: id.0,
            },
            _ => Act::Recv {
                from: peer,
                pair: comm.pair.map_or(u32::MAX, |p| p.0),
            },
        };
        return Link {
            act,
            kind,
            key,
            need: 0,
        };
    }
    let gi = comm.groups.iter().position(|grp| grp.contains(&dev));
    if let Some(spec) = cx.relayouts.get(&id) {
        let group = gi.map_or_else(|| Arc::from([dev.0]), |gi| desc.groups[gi].clone());
        let need = group.len() as u32;
        return Link {
            act: Act::Relayout {
                group,
                spec: spec.clone(),
            },
            kind: if need > 1 {
                Kind::Collective
            } else {
                Kind::Local
            },
            key: gbase + gi.unwrap_or(0) as u32,
            need,
        };
    }
    let (kind, key, need) = match gi {
        Some(gi) if comm.groups[gi].len() > 1 => (
            Kind::Collective,
            gbase + gi as u32,
            comm.groups[gi].len() as u32,
        ),
        _ => (Kind::Local, 0, 0),
    };
    let act = Act::Collective {
        what: Collective::of(comm.op, comm.purpose).unwrap_or(Collective::GradNorm),
        group: gi.map_or_else(|| Arc::from([dev.0]), |gi| desc.groups[gi].clone()),
    };
    Link {
        act,
        kind,
        key,
        need,
    }
}

#[cfg(test)]
mod tests {
    use super::Marks;

    #[test]
    fn the_highest_mark_between_two_order_indices_is_found_across_blocks() {
        let mut m = Marks::default();
        // Order indices 0, 3, 6, …; bytes from a hash, so blocks differ.
        let bytes = |i: u64| (i.wrapping_mul(2_654_435_761) >> 7) % 10_000;
        // 9,000 marks: whole super-blocks of 4,096, blocks and single marks.
        for i in 0..9_000u64 {
            m.push(3 * i as u32, bytes(i));
        }
        for (after, upto) in [
            (None, 0),
            (None, 899),
            (Some(0), 3),
            (Some(1), 190),
            (Some(5), 700),
            (Some(190), 194),
            (Some(800), 10_000),
            (Some(897), 900),
            (None, 26_999),
            (Some(100), 25_000),
            (Some(12_287), 24_576),
            (Some(12_290), 12_300),
        ] {
            let want = (0..9_000u64)
                .filter(|i| after.is_none_or(|a| 3 * *i as u32 > a) && 3 * *i as u32 <= upto)
                .map(bytes)
                .max()
                .unwrap_or(0);
            assert_eq!(m.high(after, upto), want, "({after:?}, {upto}]");
        }
    }
}
