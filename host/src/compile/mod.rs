//! Compile: global training DAG → per-device [`Plan`]s. After the strategies
//! (`plugin/`) and before the runtime and simulator.
//!
//! 1. **Validate**: every node placed; a segment's nodes on one device group;
//!    SPMD groups only where replicated; no data edge crossing devices
//!    without a send/recv; the tied embedding/head reconciled; the global batch
//!    divisible by each node's microbatches × DP degree; no cycle.
//! 2. **Order**: one global list schedule (Kahn's algorithm; among ready
//!    nodes the lowest depth first, then the higher priority, then the lower
//!    id; a node with no predecessor is keyed just before its first consumer,
//!    so prefetches run late, not all at once). Each device's per-stream order
//!    is this order restricted to it, so every edge is respected.
//! 3. **Events**: a cross-stream dependency on one device becomes a `wait` on
//!    the producer's position in its stream; send/recv carry peer and pair,
//!    collectives their group.
//! 4. **Memory**: walking the device's ops in order, transient buffers live
//!    from their producer to their last local consumer; model states
//!    (fp32 Adam: 4 B params + 4 B grads + 8 B moments per parameter, divided
//!    over the group as the ZeRO stage says) are resident. Peak = states +
//!    transient peak.
//! 5. **Deadlock check** ([`check_deadlock`]) and a stable hash.

mod deadlock;
pub mod plan;

pub use deadlock::{check_deadlock, DeadlockError};
pub use plan::{human_bytes, DevicePlan, Input, Op, OpKind, Plan, StreamPlan, Wait};

use crate::dag::{
    CommPurpose, DeviceId, EdgeKind, NodeId, NodeKind, Spread, TensorKind, TrainingDag,
};
use crate::model::DTYPE_BYTES;
use foldhash::{HashMap, HashMapExt};
use petgraph::visit::NodeIndexable;
use rayon::prelude::*;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

/// Why a DAG cannot be compiled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CompileError {
    #[error("{node} is not placed on any device: a strategy must place every compute node (e.g. `place({{}}, [0], \"pp\")`)")]
    Unplaced { node: String },
    #[error("segment {segment} ({name}) is split over device groups: {a} on {a_devices:?}, {b} on {b_devices:?}; a segment's F and B nodes of one microbatch must share their devices, and different microbatches may use different groups only as parameter copies of equal size with no device in common")]
    SplitSegment {
        segment: u32,
        name: String,
        a: String,
        a_devices: Vec<u32>,
        b: String,
        b_devices: Vec<u32>,
    },
    #[error("segment {segment} ({name}) has parameter copies on {groups:?} and is sharded with ZeRO-{zero}: ZeRO-1/2/3 over parameter copies is not supported (plain data parallelism is)")]
    ShardedCopies {
        segment: u32,
        name: String,
        groups: Vec<Vec<u32>>,
        zero: u8,
    },
    #[error("{node} runs on devices {devices:?} but is not replicated: use `replicate` for data parallelism")]
    NotReplicated { node: String, devices: Vec<u32> },
    #[error("data edge {from} -> {to} crosses from devices {from_devices:?} to {to_devices:?} with no send/recv (place pairs groups of equal size only)")]
    CrossingEdge {
        from: String,
        from_devices: Vec<u32>,
        to: String,
        to_devices: Vec<u32>,
    },
    #[error("temporal edge {from} -> {to} joins devices {from_devices:?} and {to_devices:?} that share none")]
    CrossingOrder {
        from: String,
        from_devices: Vec<u32>,
        to: String,
        to_devices: Vec<u32>,
    },
    #[error("the tied embedding (devices {emb:?}) and LM head (devices {head:?}) are on groups that cannot be paired for their gradient all-reduce (they must have equal size and no device in common)")]
    TiedUnpaired { emb: Vec<u32>, head: Vec<u32> },
    #[error("{node}: global batch {batch} is not divisible by microbatches × data-parallel degree = {div}")]
    Indivisible { node: String, batch: u32, div: u64 },
    #[error("{node} sends to its own device {device}: the groups it joins overlap")]
    SelfSend { node: String, device: u32 },
    #[error("the DAG has a cycle: {}", .0.join(" -> "))]
    Cycle(Vec<String>),
    #[error(transparent)]
    Deadlock(#[from] DeadlockError),
}

/// Compile a DAG into per-device plans (the DAG is synced first if a
/// directive left derived nodes stale).
pub fn compile(dag: &TrainingDag) -> Result<Plan, CompileError> {
    if dag.dirty {
        let mut d = dag.clone();
        d.sync();
        return compile_synced(&d);
    }
    compile_synced(dag)
}

fn ids(devs: &[DeviceId]) -> Vec<u32> {
    devs.iter().map(|d| d.0).collect()
}

fn validate(dag: &TrainingDag) -> Result<(), CompileError> {
    let g = &dag.graph;
    // Compute nodes first: derived nodes follow their placement.
    for ix in g.node_indices() {
        if matches!(g[ix].kind, NodeKind::Compute { .. }) && g[ix].devices.is_empty() {
            return Err(CompileError::Unplaced {
                node: dag.label(NodeId(ix.index() as u32)),
            });
        }
    }
    validate_segments(dag)?;
    for ix in g.node_indices() {
        let id = NodeId(ix.index() as u32);
        let n = &g[ix];
        if matches!(n.kind, NodeKind::Marker) {
            continue;
        }
        if n.devices.is_empty() {
            return Err(CompileError::Unplaced {
                node: dag.label(id),
            });
        }
        if let NodeKind::Compute { .. } = n.kind {
            if n.devices.len() > 1 && n.replica.is_none() && n.tensor_parallel.is_none() {
                return Err(CompileError::NotReplicated {
                    node: dag.label(id),
                    devices: ids(&n.devices),
                });
            }
            let div = dag.batch_share_div(id);
            if !(dag.model().batch_size as u64).is_multiple_of(div) {
                return Err(CompileError::Indivisible {
                    node: dag.label(id),
                    batch: dag.model().batch_size,
                    div,
                });
            }
        }
        if let NodeKind::Comm(c) = &n.kind {
            if c.op.is_p2p() {
                if let Some(i) = n.devices.iter().zip(&c.peers).position(|(a, b)| a == b) {
                    return Err(CompileError::SelfSend {
                        node: dag.label(id),
                        device: n.devices[i].0,
                    });
                }
            }
        }
    }
    validate_edges(dag)
}

/// A segment's compute nodes of one microbatch share one group; different
/// microbatches may run on different groups only as paired parameter copies
/// (equal sizes, no device in common).
fn validate_segments(dag: &TrainingDag) -> Result<(), CompileError> {
    let g = &dag.graph;
    let split = |segment: u32, a: NodeId, b: NodeId| {
        let (na, nb) = (&g[a.ix()], &g[b.ix()]);
        CompileError::SplitSegment {
            segment,
            name: dag.segments()[segment as usize].name(),
            a: dag.label(a),
            a_devices: ids(&na.devices),
            b: dag.label(b),
            b_devices: ids(&nb.devices),
        }
    };
    let mut first: HashMap<(u32, Vec<u32>), NodeId> = HashMap::new();
    let mut any: std::collections::BTreeMap<u32, Vec<NodeId>> = Default::default();
    for ix in g.node_indices() {
        if let NodeKind::Compute { segment, .. } = g[ix].kind {
            let id = NodeId(ix.index() as u32);
            let key = (segment, dag.split_key(&g[ix]));
            let f = *first.entry(key).or_insert(id);
            let (a, b) = (&g[f.ix()], &g[ix]);
            if a.devices != b.devices || a.replica != b.replica {
                return Err(split(segment, f, id));
            }
            let seen = any.entry(segment).or_default();
            if !seen
                .iter()
                .any(|x| g[x.ix()].devices == b.devices && g[x.ix()].replica == b.replica)
            {
                seen.push(id);
            }
        }
    }
    let copies = dag.segment_copies();
    for (segment, nodes) in any {
        let list = &copies[segment as usize];
        if nodes.len() > 1 && TrainingDag::paired_copies(list).is_none() {
            return Err(split(segment, nodes[0], nodes[1]));
        }
        // Sharded states would need a bucket per copy group; not built.
        let zero = |(devs, rep): &(Vec<DeviceId>, Option<u32>)| match rep {
            Some(r) if devs.len() > 1 => dag.specs[*r as usize].zero,
            _ => 0,
        };
        if let Some(z) = list
            .iter()
            .map(zero)
            .max()
            .filter(|z| nodes.len() > 1 && *z > 0)
        {
            return Err(CompileError::ShardedCopies {
                segment,
                name: dag.segments()[segment as usize].name(),
                groups: list.iter().map(|c| ids(&c.0)).collect(),
                zero: z,
            });
        }
    }
    Ok(())
}

/// Data edges within nested groups, temporal edges on a shared device, the
/// tied embedding reconciled.
fn validate_edges(dag: &TrainingDag) -> Result<(), CompileError> {
    let g = &dag.graph;
    for e in g.edge_indices() {
        let (s, t) = g.edge_endpoints(e).unwrap();
        let (a, b) = (&g[s], &g[t]);
        if matches!(a.kind, NodeKind::Marker) || matches!(b.kind, NodeKind::Marker) {
            continue;
        }
        let subset = |x: &[DeviceId], y: &[DeviceId]| x.iter().all(|d| y.contains(d));
        match g[e] {
            EdgeKind::Data { .. }
                if !subset(&a.devices, &b.devices) && !subset(&b.devices, &a.devices) =>
            {
                return Err(CompileError::CrossingEdge {
                    from: dag.label(NodeId(s.index() as u32)),
                    from_devices: ids(&a.devices),
                    to: dag.label(NodeId(t.index() as u32)),
                    to_devices: ids(&b.devices),
                })
            }
            EdgeKind::Temporal if !a.devices.iter().any(|d| b.devices.contains(d)) => {
                return Err(CompileError::CrossingOrder {
                    from: dag.label(NodeId(s.index() as u32)),
                    from_devices: ids(&a.devices),
                    to: dag.label(NodeId(t.index() as u32)),
                    to_devices: ids(&b.devices),
                })
            }
            _ => {}
        }
    }
    // Tied embedding / head on different groups need their all-reduce.
    let placement = dag.segment_placement();
    let segs = dag.segments();
    if let (Some(e), Some(h)) = (
        segs.iter().position(|s| s.has_embedding()),
        segs.iter().position(|s| s.has_head()),
    ) {
        if let (Some(pe), Some(ph)) = (&placement[e], &placement[h]) {
            let tied = g.node_weights().any(
                |n| matches!(&n.kind, NodeKind::Comm(c) if c.purpose == CommPurpose::TiedGrad),
            );
            if pe.0 != ph.0 && !tied {
                return Err(CompileError::TiedUnpaired {
                    emb: ids(&pe.0),
                    head: ids(&ph.0),
                });
            }
        }
    }
    // No cycle: proven by the schedule's own pass (`compile_synced`).
    Ok(())
}

/// The cycle that kept nodes out of the schedule, named.
fn cycle_error(dag: &TrainingDag) -> CompileError {
    match dag.check_acyclic() {
        Err(c) => CompileError::Cycle(c.iter().map(|n| dag.label(*n)).collect()),
        // Not reached: both are Kahn's passes over the same edges.
        Ok(()) => CompileError::Cycle(vec!["(a node the schedule could not order)".into()]),
    }
}

/// Is the tensor on this edge a transient buffer (vs. a resident model state)?
fn transient(dag: &TrainingDag, producer: NodeId, tensor: TensorKind) -> bool {
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

fn compile_synced(dag: &TrainingDag) -> Result<Plan, CompileError> {
    validate(dag)?;
    let g = &dag.graph;
    let bound = g.node_bound();
    let order = schedule(dag);
    if order.len() != g.node_count() {
        return Err(cycle_error(dag));
    }

    // Markers are pass-through: each node's effective local predecessors.
    let real_preds = |id: NodeId| -> Vec<(NodeId, EdgeKind)> {
        let mut out = Vec::new();
        let mut stack: Vec<(NodeId, EdgeKind)> = dag.preds(id).collect();
        while let Some((p, k)) = stack.pop() {
            if matches!(g[p.ix()].kind, NodeKind::Marker) {
                stack.extend(dag.preds(p));
            } else {
                out.push((p, k));
            }
        }
        out
    };

    // Streams per device, in first-use order; positions of each node
    // (flat: `pos[pos_base[node] + i]` for the node's i-th device).
    let ndev = dag.cluster_info().devices as usize;
    let mut stream_names: Vec<Arc<str>> = (0..=u16::MAX as usize)
        .map_while(|i| dag.stream_name_opt(crate::dag::StreamId(i as u16)))
        .map(Arc::from)
        .collect();
    // A p2p stream is split per direction and peer (`pp→2`, `pp←0`): each
    // keeps its peer's order, and a send never waits behind the receive of a
    // later microbatch from another peer (one F+B of bubble per stage that
    // the simulator showed in 1F1B).
    let mut derived: HashMap<(u16, bool, u32), u16> = HashMap::new();
    let mut op_stream = |names: &mut Vec<Arc<str>>, n: &crate::dag::Node, i: usize| -> u16 {
        let NodeKind::Comm(c) = &n.kind else {
            return n.stream.0;
        };
        let (true, Some(peer)) = (c.op.is_p2p(), c.peers.get(i)) else {
            return n.stream.0;
        };
        let send = matches!(c.op, crate::dag::CommOp::Send);
        if let Some(&s) = derived.get(&(n.stream.0, send, peer.0)) {
            return s;
        }
        if names.len() > u16::MAX as usize {
            return n.stream.0;
        }
        let name = format!(
            "{}{}{}",
            names[n.stream.0 as usize],
            if send { '→' } else { '←' },
            peer.0
        );
        names.push(Arc::from(name));
        let s = (names.len() - 1) as u16;
        derived.insert((n.stream.0, send, peer.0), s);
        s
    };
    // Positions first, in one pass over the order: each (node, device)'s
    // (stream, index), each device's nodes and its streams in first-use
    // order (`pos[pos_base[node] + i]` for the node's i-th device).
    let mut pos_base = vec![u32::MAX; bound];
    let mut pos: Vec<(u16, u32)> =
        Vec::with_capacity(order.iter().map(|id| g[id.ix()].devices.len()).sum());
    // The device of each position, and each node's positions by its index in
    // the order (`spans[k]` = (first, count)): the op loop reads these in
    // sequence instead of each node's device list.
    let mut pos_dev: Vec<u32> = Vec::with_capacity(pos.capacity());
    let mut spans: Vec<(u32, u32)> = vec![(0, 0); order.len()];
    // Per device: its streams with their op counts.
    let mut counts: Vec<Vec<(u16, u32)>> = vec![Vec::new(); ndev];
    // Devices are built in contiguous chunks, node by node within a chunk
    // (a node's ops on its devices one after another, while what they share
    // is in cache); `chunks_of[k]`: which chunks the k-th node in order has
    // devices in (a bit per chunk).
    let nchunks = (rayon::current_num_threads() * 4)
        .clamp(1, 64)
        .min(ndev.max(1));
    let chunk_of = |d: usize| d * nchunks / ndev.max(1);
    let mut chunks_of: Vec<u64> = vec![0; order.len()];
    for (k, &id) in order.iter().enumerate() {
        let n = &g[id.ix()];
        if matches!(n.kind, NodeKind::Marker) {
            continue;
        }
        pos_base[id.ix().index()] = pos.len() as u32;
        spans[k] = (pos.len() as u32, n.devices.len() as u32);
        for (i, dev) in n.devices.iter().enumerate() {
            let d = dev.0 as usize;
            let sid = op_stream(&mut stream_names, n, i);
            let c = &mut counts[d];
            let idx = match c.iter_mut().find(|(s, _)| *s == sid) {
                Some(e) => {
                    e.1 += 1;
                    e.1 - 1
                }
                None => {
                    c.push((sid, 1));
                    0
                }
            };
            pos.push((sid, idx));
            pos_dev.push(dev.0);
            chunks_of[k] |= 1 << chunk_of(d);
        }
    }
    let no_segments: Arc<[u32]> = Arc::from(Vec::new());
    // One-segment lists, built once each.
    let one_segment: Vec<Arc<[u32]>> = (0..dag.segments().len() as u32)
        .map(|s| Arc::from(vec![s]))
        .collect();
    let placement = dag.segment_placement();
    // Split dimensions and their sizes, outermost first.
    let extents = dag.tag_extents();
    let split_sizes: Vec<(crate::dag::TagKey, u32)> = dag
        .split_dims
        .iter()
        .map(|k| (*k, extents.get(dag.tag_name(*k)).copied().unwrap_or(1)))
        .collect();
    let microbatches: u32 = split_sizes.iter().map(|(_, s)| *s).product();
    // What every device's op of a node shares, once per node, in parallel.
    let input_of = |(p, k): &(NodeId, EdgeKind)| match k {
        EdgeKind::Data { tensor, .. } => Some(Input {
            node: p.0,
            tensor: *tensor,
        }),
        _ => None,
    };
    // Tag maps are built once per distinct tag set and rayon task (the F
    // and B of a stage's microbatch carry the same tags).
    type TagMaps<'a> = HashMap<&'a crate::dag::Tags, Arc<std::collections::BTreeMap<String, u32>>>;
    let shared: Vec<Option<Shared>> = order
        .par_iter()
        // Long runs per task: each task's tag maps are its own.
        .with_min_len(4096)
        .map_init(TagMaps::new, |tag_maps, &id| {
            let n = &g[id.ix()];
            if matches!(n.kind, NodeKind::Marker) {
                return None;
            }
            let preds = real_preds(id);
            let cost = dag.cost(id);
            let (segments, purpose): (Arc<[u32]>, Option<CommPurpose>) = match &n.kind {
                NodeKind::Compute { segment, .. } => (
                    one_segment
                        .get(*segment as usize)
                        .cloned()
                        .unwrap_or_else(|| Arc::from(vec![*segment])),
                    None,
                ),
                NodeKind::Update { segments } => (Arc::from(segments.clone()), None),
                NodeKind::Comm(c) => (Arc::from(c.segments.clone()), Some(c.purpose)),
                NodeKind::Marker => (no_segments.clone(), None),
            };
            let groups: Vec<Arc<[u32]>> = match &n.kind {
                NodeKind::Comm(c) if !c.op.is_p2p() => {
                    c.groups.iter().map(|grp| Arc::from(ids(grp))).collect()
                }
                _ => Vec::new(),
            };
            let mut inputs: Vec<Input> = preds.iter().filter_map(input_of).collect();
            inputs.sort_unstable_by_key(|i| (i.node, i.tensor as u8));
            inputs.dedup();
            let microbatch = split_sizes.iter().fold(0u32, |acc, (k, size)| {
                acc * size + n.tags.get(*k).unwrap_or(0)
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
                    .filter_map(|s| placement[*s as usize].as_ref())
                    .filter(|(devs, _)| devs.len() > 1)
                    .filter_map(|(_, rep)| rep.map(|r| dag.specs[r as usize].zero))
                    .max()
                    .unwrap_or(0)
            };
            // Each predecessor's first position, and whether it runs on
            // exactly this node's devices (then its op on this node's i-th
            // device is its i-th: no search of its device list per device).
            let pred_pos: Vec<(u32, bool)> = preds
                .iter()
                .map(|(p, _)| (pos_base[p.ix().index()], g[p.ix()].devices == n.devices))
                .collect();
            let single_device_inputs = pred_pos.iter().all(|(_, same)| *same);
            // Expert- or tensor-parallel compute: its group exchanges inside
            // the op, so the op meets its group like a collective (a phase of
            // a split expert pass carries it too; its exchanges are ops).
            let spread = match (&n.kind, n.replica) {
                (NodeKind::Compute { .. }, _)
                    if n.devices.len() > 1 && n.tensor_parallel.is_some() =>
                {
                    Some(Spread::Tensor)
                }
                (NodeKind::Compute { .. }, Some(r))
                    if n.devices.len() > 1 && dag.specs[r as usize].expert_parallel.is_some() =>
                {
                    Some(Spread::Experts)
                }
                _ => None,
            };
            // What the op leaves for local readers: one buffer per tensor
            // kind, however many readers it has; readers on exactly this
            // node's devices read on each of them, others where they run.
            let mut by_kind = [0u64; 8];
            let mut other_readers: Vec<&[DeviceId]> = Vec::new();
            let mut same_readers = 0u32;
            for (c, k) in dag.succs(id) {
                if let EdgeKind::Data { tensor, bytes } = k {
                    if transient(dag, id, tensor) {
                        let mut b = if tensor.scales_with_batch() {
                            bytes / dag.batch_share_div(id)
                        } else {
                            bytes
                        };
                        // Tensor parallelism splits about three quarters of
                        // what a segment saves and stashes (heads, MLP units).
                        if n.tensor_parallel.is_some()
                            && matches!(tensor, TensorKind::Saved | TensorKind::Stash)
                        {
                            let t = n.devices.len().max(1) as u64;
                            b = b / 4 + (b - b / 4) / t;
                        }
                        let slot = &mut by_kind[tensor as usize];
                        *slot = (*slot).max(b);
                        let rd = &g[c.ix()].devices;
                        if *rd == n.devices {
                            same_readers += 1;
                        } else {
                            other_readers.push(rd);
                        }
                    }
                }
            }
            Some(Shared {
                out_bytes: by_kind.iter().sum(),
                same_readers,
                other_readers,
                op: OpKind::from_label(n.kind.label()).expect("markers are skipped"),
                preds,
                pred_pos,
                tags: tag_maps
                    .entry(&n.tags)
                    .or_insert_with(|| Arc::new(dag.tag_map(&n.tags)))
                    .clone(),
                segments,
                purpose,
                groups,
                inputs: Arc::from(inputs),
                microbatch,
                tensor: match &n.kind {
                    NodeKind::Comm(c) => Some(c.tensor),
                    _ => None,
                },
                zero,
                single_device_inputs,
                spread,
                spread_group: spread.map(|_| n.devices.iter().map(|d| d.0).collect()),
                phase: match n.kind {
                    NodeKind::Compute { phase, .. } => phase,
                    _ => None,
                },
                div: dag.batch_share_div(id),
                flops: cost.flops,
                comm_bytes: cost.comm_bytes,
                param_bytes: cost.param_bytes,
                first_device: n.devices.iter().map(|d| d.0).min().unwrap_or(0),
            })
        })
        .collect();
    // Each chunk of devices' ops, in parallel: the same ops in the same order
    // as one pass would give.
    let stream_names = &stream_names;
    let (pos, pos_base) = (&pos, &pos_base);
    type Streams = Vec<(u16, Vec<Op>, plan::StreamHasher)>;
    let built: Vec<Vec<Streams>> = (0..nchunks)
        .into_par_iter()
        .map(|c| {
            let lo = (0..ndev).find(|&d| chunk_of(d) == c).unwrap_or(ndev);
            let hi = (lo..ndev).find(|&d| chunk_of(d) != c).unwrap_or(ndev);
            // Each stream hashed as it is built (`Plan::compute_hash`'s
            // definition), while its ops are in cache.
            let mut lists: Vec<Streams> = counts[lo..hi]
                .iter()
                .map(|counts| {
                    counts
                        .iter()
                        .map(|&(s, n)| {
                            let h = plan::StreamHasher::new(&stream_names[s as usize]);
                            (s, Vec::with_capacity(n as usize), h)
                        })
                        .collect()
                })
                .collect();
            // This chunk's own copies of the stream names its waits point
            // at: one shared `Arc` cloned by every op on both threads was a
            // contended counter.
            let names: Vec<Arc<str>> = stream_names.iter().map(|s| Arc::from(&**s)).collect();
            let bit = 1u64 << c;
            let no_waits: Arc<[Wait]> = Arc::from(Vec::new());
            let mut waits: Vec<(u16, u32)> = Vec::new();
            // The last node's waits list, to share with its next device.
            let mut last_waits: (NodeId, Vec<(u16, u32)>, Arc<[Wait]>) =
                (NodeId(u32::MAX), Vec::new(), no_waits.clone());
            for (k, &id) in order.iter().enumerate() {
                if chunks_of[k] & bit == 0 {
                    continue;
                }
                let sh = shared[k].as_ref().expect("markers have no position");
                let (first, count) = spans[k];
                for i in 0..count as usize {
                    let d = pos_dev[first as usize + i] as usize;
                    if chunk_of(d) != c {
                        continue;
                    }
                    let dev = DeviceId(d as u32);
                    let list = &mut lists[d - lo];
                    let (sid, _) = pos[first as usize + i];
                    let mut op = Op {
                        op: sh.op,
                        node: id.0,
                        tags: sh.tags.clone(),
                        segments: sh.segments.clone(),
                        peer: None,
                        pair: None,
                        group: sh.spread_group.clone(),
                        spread: sh.spread,
                        phase: sh.phase,
                        purpose: sh.purpose,
                        batch_div: sh.div,
                        flops: sh.flops,
                        bytes: sh.comm_bytes,
                        waits: no_waits.clone(),
                        inputs: sh.inputs.clone(),
                        // A tensor-parallel group runs one batch share.
                        replica: if sh.spread == Some(Spread::Tensor) {
                            0
                        } else {
                            i as u32
                        },
                        microbatch: sh.microbatch,
                        microbatches,
                        tensor: sh.tensor,
                        zero: sh.zero,
                        param_bytes: sh.param_bytes,
                        out_bytes: if sh.out_bytes > 0 && sh.readers_on(dev) > 0 {
                            sh.out_bytes
                        } else {
                            0
                        },
                    };
                    // Peers, pair and groups are read from the node.
                    let kind = sh.op.is_comm().then(|| &g[id.ix()].kind);
                    if let Some(NodeKind::Comm(c)) = kind {
                        if c.op.is_p2p() {
                            op.peer = c.peers.get(i).map(|p| p.0);
                            op.pair = Some(match c.op {
                                crate::dag::CommOp::Send => id.0,
                                _ => c.pair.map(|p| p.0).unwrap_or(u32::MAX),
                            });
                        } else {
                            op.group = c
                                .groups
                                .iter()
                                .position(|grp| grp.contains(&dev))
                                .map(|gi| sh.groups[gi].clone());
                        }
                    }
                    // Cross-stream waits (latest op per stream) and local inputs.
                    waits.clear();
                    let mut local_inputs: Vec<Input> = Vec::new();
                    for ((p, k), &(base, same)) in sh.preds.iter().zip(&sh.pred_pos) {
                        let pi = if same {
                            i
                        } else {
                            match g[p.ix()].devices.iter().position(|x| *x == dev) {
                                Some(pi) => pi,
                                None => continue,
                            }
                        };
                        let (ps, pidx) = pos[base as usize + pi];
                        if ps != sid {
                            match waits.iter_mut().find(|(s, _)| *s == ps) {
                                Some(w) => w.1 = w.1.max(pidx),
                                None => waits.push((ps, pidx)),
                            }
                        }
                        if !sh.single_device_inputs {
                            if let Some(inp) = input_of(&(*p, *k)) {
                                local_inputs.push(inp);
                            }
                        }
                    }
                    if !sh.single_device_inputs {
                        local_inputs.sort_unstable_by_key(|i| (i.node, i.tensor as u8));
                        local_inputs.dedup();
                        op.inputs = Arc::from(local_inputs);
                    }
                    waits.sort_unstable();
                    // The devices of an SPMD node mostly wait on the same
                    // positions: one list for them (no allocation per op).
                    op.waits = if waits.is_empty() {
                        no_waits.clone()
                    } else if last_waits.0 == id && last_waits.1 == waits {
                        last_waits.2.clone()
                    } else {
                        let list: Arc<[Wait]> = waits
                            .iter()
                            .map(|&(s, i)| Wait {
                                stream: names[s as usize].clone(),
                                op: i as usize,
                            })
                            .collect();
                        last_waits = (id, waits.clone(), list.clone());
                        list
                    };
                    let si = list
                        .iter()
                        .position(|(s, _, _)| *s == sid)
                        .expect("counted above");
                    list[si].2.op(&op, d as u32 == sh.first_device);
                    list[si].1.push(op);
                }
            }
            lists
        })
        .collect();
    let streams: Vec<Streams> = built.into_iter().flatten().collect();
    // Memory per device, walking the global order. Buffers are per
    // (producer, device): `bufs[pos_base[producer] + i]` = (bytes, readers left).
    let mut devices = Vec::with_capacity(ndev);
    let mut transient_peak = vec![0u64; ndev];
    {
        let mut live = vec![0u64; ndev];
        let mut in_flight: HashMap<NodeId, (Vec<DeviceId>, u64)> = HashMap::new();
        let mut bufs: Vec<(u64, u32)> = vec![(0, 0); pos.len()];
        for (k, &id) in order.iter().enumerate() {
            let n = &g[id.ix()];
            if matches!(n.kind, NodeKind::Marker) {
                continue;
            }
            let sh = shared[k].as_ref().expect("markers are skipped");
            let out_bytes = sh.out_bytes;
            // A collective stages this device's contribution and the result
            // while it runs (the runtime accounts both against the cap).
            let staging = match &n.kind {
                NodeKind::Comm(c) if !c.op.is_p2p() && c.purpose != CommPurpose::GradNorm => {
                    let b = if c.tensor.scales_with_batch() {
                        c.bytes / dag.batch_share_div(id)
                    } else {
                        c.bytes
                    };
                    b.saturating_mul(2)
                }
                _ => 0,
            };
            // A message stays on its sender's account from the send until
            // its receiver holds it (as the runtime counts it).
            if let NodeKind::Comm(c) = &n.kind {
                let b = if c.tensor.scales_with_batch() {
                    c.bytes / dag.batch_share_div(id)
                } else {
                    c.bytes
                };
                match (c.op, c.pair) {
                    (crate::dag::CommOp::Send, Some(pair)) => {
                        // Added after the send's input is released, below.
                        in_flight.insert(pair, (n.devices.clone(), b));
                    }
                    (crate::dag::CommOp::Recv, _) => {
                        if let Some((senders, b)) = in_flight.remove(&id) {
                            for dev in senders {
                                live[dev.0 as usize] = live[dev.0 as usize].saturating_sub(b);
                            }
                        }
                    }
                    _ => {}
                }
            }
            let base = pos_base[id.ix().index()] as usize;
            for (i, dev) in n.devices.iter().enumerate() {
                let d = dev.0 as usize;
                transient_peak[d] = transient_peak[d].max(live[d] + staging);
                let readers = sh.readers_on(*dev);
                if readers > 0 {
                    live[d] += out_bytes;
                    bufs[base + i] = (out_bytes, readers);
                }
                transient_peak[d] = transient_peak[d].max(live[d]);
            }
            // Release inputs whose last local reader this was.
            // Data edges never pass through markers (they carry order
            // only), so the data predecessors are the direct producers.
            let data_preds = sh.preds.iter().zip(&sh.pred_pos);
            for ((p, _), &(pbase, same)) in
                data_preds.filter(|((_, k), _)| matches!(k, EdgeKind::Data { .. }))
            {
                let pbase = pbase as usize;
                for (i, dev) in n.devices.iter().enumerate() {
                    let pi = if same {
                        i
                    } else {
                        match g[p.ix()].devices.iter().position(|x| x == dev) {
                            Some(pi) => pi,
                            None => continue,
                        }
                    };
                    let entry = &mut bufs[pbase + pi];
                    if entry.1 > 0 {
                        entry.1 -= 1;
                        if entry.1 == 0 {
                            live[dev.0 as usize] -= entry.0;
                        }
                    }
                }
            }
            if let NodeKind::Comm(c) = &n.kind {
                if let (crate::dag::CommOp::Send, Some(pair)) = (c.op, c.pair) {
                    if let Some((_, b)) = in_flight.get(&pair) {
                        for dev in &n.devices {
                            let d = dev.0 as usize;
                            live[d] += b;
                            transient_peak[d] = transient_peak[d].max(live[d]);
                        }
                    }
                }
            }
        }
    }
    let mut states = vec![0u64; ndev];
    let copies = dag.segment_copies();
    for (s, p) in placement.iter().enumerate() {
        // A segment held once, or once per parameter copy.
        let held_on: Vec<(Vec<crate::dag::DeviceId>, Option<u32>)> = match p {
            Some(one) => vec![one.clone()],
            None if TrainingDag::paired_copies(&copies[s]).is_some() => copies[s].clone(),
            None => continue,
        };
        for (devs, rep) in &held_on {
            let held = dag.held_elems(s as u32, &placement);
            let n = devs.len() as u64;
            let zero = match rep {
                Some(r) if n > 1 => dag.specs[*r as usize].zero,
                _ => 0,
            };
            let shard = held.div_ceil(n);
            let params = if zero >= 3 { shard } else { held };
            let grads = if zero >= 2 { shard } else { held };
            // ZeRO-1 with expert parallelism: this device's experts keep
            // whole moments, the replicated rest is sharded.
            let moments = 2 * match dag.expert_elems(s as u32, &placement) {
                (all, spread) if zero >= 1 && spread > 1 => {
                    all / spread + (held - all / spread).div_ceil(n)
                }
                _ if zero >= 1 => shard,
                _ => held,
            };
            for d in devs {
                states[d.0 as usize] += (params + grads + moments) * DTYPE_BYTES;
            }
        }
    }
    let mut parts: Vec<Vec<[u64; 2]>> = Vec::with_capacity(ndev);
    for (d, list) in streams.into_iter().enumerate() {
        let mut hashes = Vec::with_capacity(list.len());
        let streams = list
            .into_iter()
            .map(|(s, ops, h)| {
                hashes.push(h.finish(ops.len()));
                StreamPlan {
                    stream: stream_names[s as usize].to_string(),
                    ops,
                }
            })
            .collect();
        parts.push(hashes);
        devices.push(DevicePlan {
            device: d as u32,
            peak_bytes: states[d] + transient_peak[d],
            model_state_bytes: states[d],
            transient_peak_bytes: transient_peak[d],
            streams,
        });
    }
    check_deadlock(&devices)?;
    let mut plan = Plan {
        hash: String::new(),
        model: dag.model().name.clone(),
        batch_size: dag.model().batch_size,
        devices,
    };
    plan.hash = plan.hash_of(&parts);
    Ok(plan)
}

/// What every device's op of one node shares.
struct Shared<'a> {
    /// Bytes of the transient buffers the op leaves for local readers.
    out_bytes: u64,
    /// Transient readers on exactly this node's devices, and the device
    /// lists of the others.
    same_readers: u32,
    other_readers: Vec<&'a [DeviceId]>,
    op: OpKind,
    preds: Vec<(NodeId, EdgeKind)>,
    /// Per predecessor: its first position and whether it runs on exactly
    /// this node's devices.
    pred_pos: Vec<(u32, bool)>,
    tags: Arc<std::collections::BTreeMap<String, u32>>,
    segments: Arc<[u32]>,
    purpose: Option<CommPurpose>,
    groups: Vec<Arc<[u32]>>,
    inputs: Arc<[Input]>,
    microbatch: u32,
    tensor: Option<TensorKind>,
    zero: u8,
    single_device_inputs: bool,
    spread: Option<Spread>,
    spread_group: Option<Arc<[u32]>>,
    phase: Option<crate::dag::ExpertPhase>,
    div: u64,
    flops: f64,
    comm_bytes: u64,
    param_bytes: u64,
    /// The lowest device running the node: its op there is the node's
    /// first in plan order (the plan hash covers the shared fields there).
    first_device: u32,
}

impl Shared<'_> {
    /// Local readers of the op's transient buffers on `dev`.
    fn readers_on(&self, dev: DeviceId) -> u32 {
        self.same_readers
            + self
                .other_readers
                .iter()
                .filter(|r| r.contains(&dev))
                .count() as u32
    }
}

/// The global list schedule (see the module docs).
fn schedule(dag: &TrainingDag) -> Vec<NodeId> {
    let g = &dag.graph;
    let bound = g.node_bound();
    let mut indeg = vec![0u32; bound];
    for e in g.edge_indices() {
        let (_, t) = g.edge_endpoints(e).unwrap();
        indeg[t.index()] += 1;
    }
    // Depth: longest path from a source, in topological order.
    let mut depth = vec![0u32; bound];
    let mut topo = Vec::with_capacity(g.node_count());
    {
        let mut deg = indeg.clone();
        let mut stack: Vec<_> = g.node_indices().filter(|i| deg[i.index()] == 0).collect();
        while let Some(n) = stack.pop() {
            topo.push(n);
            for t in g.neighbors_directed(n, petgraph::Direction::Outgoing) {
                depth[t.index()] = depth[t.index()].max(depth[n.index()] + 1);
                deg[t.index()] -= 1;
                if deg[t.index()] == 0 {
                    stack.push(t);
                }
            }
        }
    }
    // Sources are keyed just before their first consumer (prefetch late).
    let mut key = depth.clone();
    for ix in g.node_indices() {
        if indeg[ix.index()] == 0 {
            if let Some(m) = g
                .neighbors_directed(ix, petgraph::Direction::Outgoing)
                .map(|t| depth[t.index()])
                .min()
            {
                key[ix.index()] = m.saturating_sub(1);
            }
        }
    }
    // Higher priority first: `Reverse` on the priority itself, never its
    // negation (`-i32::MIN` overflows).
    let mut heap: BinaryHeap<Reverse<(u32, Reverse<i32>, u32)>> = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<_>, ix: petgraph::stable_graph::NodeIndex| {
        heap.push(Reverse((
            key[ix.index()],
            Reverse(g[ix].priority),
            ix.index() as u32,
        )));
    };
    let mut deg = indeg;
    for ix in g.node_indices() {
        if deg[ix.index()] == 0 {
            push(&mut heap, ix);
        }
    }
    let mut out = Vec::with_capacity(g.node_count());
    while let Some(Reverse((_, _, i))) = heap.pop() {
        let ix = petgraph::stable_graph::NodeIndex::new(i as usize);
        out.push(NodeId(i));
        for t in g.neighbors_directed(ix, petgraph::Direction::Outgoing) {
            deg[t.index()] -= 1;
            if deg[t.index()] == 0 {
                push(&mut heap, t);
            }
        }
    }
    out
}
