//! Compile: global training DAG → per-device [`Plan`]s. After the strategies
//! (`plugin/`) and before the runtime and simulator.
//!
//! The DAG's edges are read once into flat arrays (`flat.rs`) and its device
//! groups interned (`groups.rs`); every pass below walks those.
//!
//! 0. **Relayouts** (`layout.rs`, `relayout.rs`): where a data edge joins
//!    two layouts, a relayout op between its ends moves each consumer what
//!    it needs; compile lowers its own copy of the DAG with them in it.
//! 1. **Validate**: every node placed; a segment's nodes on one device group;
//!    SPMD groups only where replicated; no data edge crossing devices
//!    without a send/recv, nor joining two layouts no relayout joins; the
//!    tied embedding/head reconciled; the global batch divisible by each
//!    node's microbatches × DP degree; no cycle.
//! 2. **Order**: one global list schedule (among ready nodes the lowest
//!    depth first, then the higher priority, then the lower id; a node with
//!    no predecessor is keyed just before its first consumer, so prefetches
//!    run late, not all at once, a parameter gather one op earlier; an
//!    unordered recompute `R` waits for every other input of its backward,
//!    `flat.rs`). Each device's per-stream
//!    order is this order restricted to it, so every edge is respected.
//! 3. **Build** (`build.rs`, per chunk of devices in parallel): each op with
//!    its events (a cross-stream dependency on one device becomes a `wait`
//!    on the producer's position in its stream; send/recv carry peer and
//!    pair, collectives their group), each stream's hash, the memory walk
//!    (transient buffers live from their producer to their last local
//!    consumer; model states — fp32 Adam: 4 B params + 4 B grads + 8 B
//!    moments per parameter, divided over the group as the ZeRO stage says —
//!    are resident; peak = states + transient peak) and the deadlock check's
//!    steps.
//! 4. **Deadlock check** (`deadlock.rs`, the same one [`check_deadlock`]
//!    runs on a plan read from a file) and the plan's stable hash.

mod build;
mod deadlock;
mod flat;
mod forward;
mod groups;
mod layout;
pub mod plan;
mod relayout;
#[cfg(test)]
mod tests;

pub use deadlock::{check_deadlock, DeadlockError};
pub use forward::forward_only;
pub use plan::{
    human_bytes, Act, Collective, DevicePlan, Input, Op, OpCommon, OpKind, Plan, StreamIx,
    StreamPlan, Wait,
};

use crate::dag::{CommOp, CommPurpose, DeviceId, EdgeKind, NodeId, NodeKind, TrainingDag};
use foldhash::{HashMap, HashMapExt};
use petgraph::stable_graph::NodeIndex;
use petgraph::visit::NodeIndexable;
use rayon::prelude::*;
use relayout::Relayout;
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
    #[error("segment {segment} ({name}) has parameter copies on {groups:?} and is sharded with ZeRO-{zero}: ZeRO-2/3 over parameter copies is not supported (plain data parallelism and ZeRO-1 are)")]
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
    #[error("{node} cannot run: {why}")]
    Comm { node: String, why: String },
    #[error("the DAG has a cycle: {}", .0.join(" -> "))]
    Cycle(Vec<String>),
    #[error("{} of the {cluster} devices run no compute: {} (the strategies use {busy}; a composition must place every device, or run with --devices {busy})", .idle.len(), idle_list(.idle))]
    Idle {
        idle: Vec<u32>,
        busy: u32,
        cluster: u32,
    },
    #[error("{node} is an expert segment on tensor-parallel groups of {tp} but its experts are not spread: tensor-parallel experts split their sequences over the group and need `shard` over the whole mesh (`tp`, then `ep`)")]
    ExpertsNotSpread { node: String, tp: u32 },
    #[error("{node} splits its {sequences} sequences per microbatch and replica over its tensor-parallel group of {tp}: give a batch whose share divides by tp (or fewer microbatches)")]
    ExpertSequences {
        node: String,
        sequences: u64,
        tp: u32,
    },
    #[error("{node} is sequence-parallel over tensor-parallel groups of {tp}, but a microbatch replica holds {tokens} tokens, which do not divide by {tp}: give a batch or sequence length whose tokens per replica divide by tp")]
    SequenceTokens { node: String, tokens: u64, tp: u32 },
    #[error("{node} is context-parallel over {cp} replicas, but its sequences of {seq} tokens do not split into 2 × {cp} equal chunks: give a sequence length divisible by {}", 2 * .cp)]
    ContextChunks { node: String, seq: u32, cp: u32 },
    #[error("{node} is context-parallel, which runs the memory-efficient attention kernel: set `attention = \"flash\"` in the model config (`auto` chooses it above {} tokens)", crate::model::Attention::AUTO_FLASH_ABOVE)]
    ContextAttention { node: String },
    #[error("data edge {from} -> {to}{} joins two layouts no relayout moves between: {from_layout}; {to_layout}. A relayout moves a residual or its gradient between layouts that each hold whole rows of the batch in pieces the runtime cuts (a split into the model's microbatch count, shares that divide the batch); other tensors move between equal layouts only: give both regions the same split, replication, tensor and context parallelism", through.as_deref().map_or(String::new(), |(a, b)| format!(" (sent from devices {a:?} to {b:?})")))]
    Layouts {
        from: String,
        to: String,
        from_layout: String,
        to_layout: String,
        /// The pipeline pair's device groups, when the edge crosses one.
        through: Option<Box<(Vec<u32>, Vec<u32>)>>,
    },
    #[error("the tied embedding/head weight `wte` is held two ways: {first}; {other}. Its gradient sums the embedding's and the head's rows once each only when both regions share one layout: give the regions with the embedding and the LM head the same replication, tensor and context parallelism and ZeRO stage (or untie them)")]
    TiedLayouts { first: String, other: String },
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

/// `devices 1, 3` or `devices 1, 3, 5, … (120 in all)`.
fn idle_list(idle: &[u32]) -> String {
    let shown: Vec<String> = idle.iter().take(8).map(|d| d.to_string()).collect();
    match idle.len() {
        1 => format!("device {}", shown[0]),
        n if n <= 8 => format!("devices {}", shown.join(", ")),
        n => format!("devices {}, … ({n} in all)", shown.join(", ")),
    }
}

/// Every device of the cluster must run compute: a composition that
/// leaves one idle dropped a strategy's effect or asked for more devices
/// than it uses.
fn check_busy(dag: &TrainingDag, groups: &groups::Groups) -> Result<(), CompileError> {
    let cluster = dag.cluster_info().devices;
    let mut busy = vec![false; cluster as usize];
    // Each distinct group of compute nodes once.
    let mut seen = vec![false; groups.lists.len()];
    for i in dag.graph.node_indices() {
        let gid = groups.of_node(i.index()) as usize;
        if seen[gid] || !matches!(dag.graph[i].kind, NodeKind::Compute { .. }) {
            continue;
        }
        seen[gid] = true;
        for d in groups.lists[gid] {
            if let Some(b) = busy.get_mut(d.0 as usize) {
                *b = true;
            }
        }
    }
    let idle: Vec<u32> = (0..cluster).filter(|d| !busy[*d as usize]).collect();
    if idle.is_empty() {
        return Ok(());
    }
    Err(CompileError::Idle {
        busy: cluster - idle.len() as u32,
        idle,
        cluster,
    })
}

fn ids(devs: &[DeviceId]) -> Vec<u32> {
    devs.iter().map(|d| d.0).collect()
}

/// Each segment's group when its nodes agree, and every group it runs on.
struct Segments {
    placement: Vec<Option<(Vec<DeviceId>, Option<u32>)>>,
    copies: Vec<Vec<(Vec<DeviceId>, Option<u32>)>>,
    /// Each segment's tensor-parallel degree (1: none).
    tp: Vec<u32>,
}

fn validate(
    dag: &TrainingDag,
    flat: &flat::Flat,
    groups: &groups::Groups,
    segs: &Segments,
) -> Result<(), CompileError> {
    let g = &dag.graph;
    let nodes = || {
        (0..g.node_bound())
            .into_par_iter()
            .with_min_len(4096)
            .filter_map(|i| {
                g.node_weight(NodeIndex::new(i))
                    .map(|n| (NodeId(i as u32), n))
            })
    };
    // Compute nodes first: derived nodes follow their placement.
    if let Some(id) = nodes()
        .find_first(|(_, n)| matches!(n.kind, NodeKind::Compute { .. }) && n.devices.is_empty())
        .map(|(id, _)| id)
    {
        return Err(CompileError::Unplaced {
            node: dag.label(id),
        });
    }
    validate_segments(dag, groups, &segs.copies)?;
    let batch = dag.model().batch_size as u64;
    let check = |(id, n): (NodeId, &crate::dag::Node)| -> Option<CompileError> {
        if matches!(n.kind, NodeKind::Marker) {
            return None;
        }
        if n.devices.is_empty() {
            return Some(CompileError::Unplaced {
                node: dag.label(id),
            });
        }
        if let NodeKind::Compute { .. } = n.kind {
            if n.devices.len() > 1 && n.replica.is_none() && n.tensor_parallel.is_none() {
                return Some(CompileError::NotReplicated {
                    node: dag.label(id),
                    devices: ids(&n.devices),
                });
            }
            // A context-parallel group of replicas shares one batch piece.
            let cp = u64::from(n.cp_degree());
            let div = dag.batch_share_div(id) / cp;
            let seq = dag.model().seq_len;
            if cp > 1 && !u64::from(seq).is_multiple_of(2 * cp) {
                return Some(CompileError::ContextChunks {
                    node: dag.label(id),
                    seq,
                    cp: cp as u32,
                });
            }
            if cp > 1 && !dag.model().flash_attention() {
                return Some(CompileError::ContextAttention {
                    node: dag.label(id),
                });
            }
            if !batch.is_multiple_of(div) {
                return Some(CompileError::Indivisible {
                    node: dag.label(id),
                    batch: dag.model().batch_size,
                    div,
                });
            }
            if let Some(e) = tensor_parallel_experts(dag, id, n, batch / div) {
                return Some(e);
            }
            let tokens = batch / div * u64::from(seq) / cp;
            let tp = n.tp_degree();
            if n.tensor_parallel.is_some_and(|t| t.sequence)
                && !tokens.is_multiple_of(u64::from(tp))
            {
                return Some(CompileError::SequenceTokens {
                    node: dag.label(id),
                    tokens,
                    tp,
                });
            }
        }
        if let NodeKind::Comm(c) = &n.kind {
            if let Some(why) = comm_fault(c, n.devices.len()) {
                return Some(CompileError::Comm {
                    node: dag.label(id),
                    why,
                });
            }
            if c.op.is_p2p() {
                if let Some(i) = n.devices.iter().zip(&c.peers).position(|(a, b)| a == b) {
                    return Some(CompileError::SelfSend {
                        node: dag.label(id),
                        device: n.devices[i].0,
                    });
                }
            }
        }
        None
    };
    // The first failing node found in parallel, its error built once.
    if let Some(e) = nodes().find_first(|n| check(*n).is_some()).and_then(check) {
        return Err(e);
    }
    validate_edges(dag, flat, groups, &segs.placement)?;
    layout::check(dag, flat, groups)?;
    layout::check_tied(dag)?;
    check_busy(dag, groups)
}

/// What a communication node lacks to become ops: a peer per device and
/// its send (point to point), or a collective Piper runs.
fn comm_fault(c: &crate::dag::Comm, devices: usize) -> Option<String> {
    let op = c.op.as_str();
    let purpose = c.purpose.as_str();
    if !c.op.is_p2p() {
        // A relayout is compile's own (`layout.rs`), its spec beside the DAG.
        let relayout = c.op == CommOp::AllToAll && c.purpose == CommPurpose::Relayout;
        return (plan::Collective::of(c.op, c.purpose).is_none() && !relayout)
            .then(|| format!("`{op}` for `{purpose}` is no collective a plan runs"));
    }
    if c.purpose != CommPurpose::Pipeline {
        return Some(format!(
            "a {op} for {purpose}: point-to-point ops move pipeline tensors only"
        ));
    }
    if c.peers.len() != devices {
        return Some(format!(
            "a {op} on {devices} device(s) names {} peer(s)",
            c.peers.len()
        ));
    }
    (c.op == CommOp::Recv && c.pair.is_none()).then(|| "a recv without its send".to_string())
}

/// An expert segment on a tensor-parallel mesh runs `1/tp` of its
/// replica's `sequences` on each rank, its experts spread over the mesh.
fn tensor_parallel_experts(
    dag: &TrainingDag,
    id: NodeId,
    n: &crate::dag::Node,
    sequences: u64,
) -> Option<CompileError> {
    let NodeKind::Compute { segment, .. } = n.kind else {
        return None;
    };
    let tp = n.tp_degree();
    if tp <= 1 || dag.segments()[segment as usize].expert_block.is_none() {
        return None;
    }
    let spread = n
        .replica
        .is_some_and(|r| dag.specs[r as usize].expert_parallel.is_some());
    if !spread {
        return Some(CompileError::ExpertsNotSpread {
            node: dag.label(id),
            tp,
        });
    }
    (!sequences.is_multiple_of(u64::from(tp))).then(|| CompileError::ExpertSequences {
        node: dag.label(id),
        sequences,
        tp,
    })
}

/// A segment's compute nodes of one microbatch share one group; different
/// microbatches may run on different groups only as paired parameter copies
/// (equal sizes, no device in common).
fn validate_segments(
    dag: &TrainingDag,
    groups: &groups::Groups,
    copies: &[Vec<(Vec<DeviceId>, Option<u32>)>],
) -> Result<(), CompileError> {
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
    // (node, device group, replication)
    type Seen = (NodeId, u32, Option<u32>);
    // A node's microbatch as one key with its segment: up to two split
    // dimensions packed in a word (the usual case), more as a list.
    let dims = &dag.split_dims;
    let mut packed: HashMap<u128, Seen> = HashMap::new();
    let mut listed: HashMap<(u32, Vec<u32>), Seen> = HashMap::new();
    if dims.len() <= 2 {
        packed.reserve(g.node_count());
    }
    let mut first = |segment: u32, n: &crate::dag::Node, me: Seen| -> Seen {
        let v = |k: &crate::dag::TagKey| n.tags.get(*k).unwrap_or(0);
        if dims.len() <= 2 {
            let at = |i: usize| dims.get(i).map_or(0, v) as u128;
            *packed
                .entry(segment as u128 | at(0) << 32 | at(1) << 64)
                .or_insert(me)
        } else {
            *listed
                .entry((segment, dims.iter().map(v).collect()))
                .or_insert(me)
        }
    };
    // Per segment: one node of each distinct (group, replication).
    let mut any: Vec<Vec<Seen>> = vec![Vec::new(); dag.segments().len()];
    for ix in g.node_indices() {
        let n = &g[ix];
        if let NodeKind::Compute { segment, .. } = n.kind {
            let id = NodeId(ix.index() as u32);
            let me = (id, groups.of_node(ix.index()), n.replica);
            let f = first(segment, n, me);
            if (f.1, f.2) != (me.1, me.2) {
                return Err(split(segment, f.0, id));
            }
            let seen = &mut any[segment as usize];
            if !seen.iter().any(|x| (x.1, x.2) == (me.1, me.2)) {
                seen.push(me);
            }
        }
    }
    for (segment, nodes) in any.into_iter().enumerate() {
        let segment = segment as u32;
        let list = &copies[segment as usize];
        if nodes.len() > 1 && TrainingDag::paired_copies(list).is_none() {
            return Err(split(segment, nodes[0].0, nodes[1].0));
        }
        // ZeRO-1 shards each copy's optimizer states over its own group
        // after the copies' gradients are summed; ZeRO-2/3 would reduce
        // each microbatch before the copies meet: not built.
        let zero = |(devs, rep): &(Vec<DeviceId>, Option<u32>)| match rep {
            Some(r) if devs.len() > 1 => dag.specs[*r as usize].zero,
            _ => 0,
        };
        if let Some(z) = list
            .iter()
            .map(zero)
            .max()
            .filter(|z| nodes.len() > 1 && *z > 1)
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
fn validate_edges(
    dag: &TrainingDag,
    flat: &flat::Flat,
    groups: &groups::Groups,
    placement: &[Option<(Vec<DeviceId>, Option<u32>)>],
) -> Result<(), CompileError> {
    let g = &dag.graph;
    // A data edge joins nested groups; a temporal edge, groups that share a
    // device. That depends only on the two groups and the edge's kind: each
    // distinct (groups, kind) is decided once, and the first failing edge in
    // edge order is reported.
    let subset = |x: &[DeviceId], y: &[DeviceId]| x.iter().all(|d| y.contains(d));
    let passes = |a: &[DeviceId], b: &[DeviceId], temporal: bool| {
        if temporal {
            a.iter().any(|d| b.contains(d))
        } else {
            subset(a, b) || subset(b, a)
        }
    };
    let mut decided: HashMap<(u32, u32, bool), bool> = HashMap::new();
    for &(s, t, kind) in &flat.edges {
        let (s, t) = (s as usize, t as usize);
        let temporal = match kind {
            EdgeKind::Data { .. } => false,
            EdgeKind::Temporal => true,
            EdgeKind::Peer => continue,
        };
        // Markers carry order only; a group agrees with itself.
        if groups.is_marker(s) || groups.is_marker(t) || groups.gid[s] == groups.gid[t] {
            continue;
        }
        let (a, b) = (groups.devices(s), groups.devices(t));
        if *decided
            .entry((groups.gid[s], groups.gid[t], temporal))
            .or_insert_with(|| passes(a, b, temporal))
        {
            continue;
        }
        let (from, to) = (dag.label(NodeId(s as u32)), dag.label(NodeId(t as u32)));
        let (from_devices, to_devices) = (ids(a), ids(b));
        return Err(if temporal {
            CompileError::CrossingOrder {
                from,
                from_devices,
                to,
                to_devices,
            }
        } else {
            CompileError::CrossingEdge {
                from,
                from_devices,
                to,
                to_devices,
            }
        });
    }
    // Tied embedding / head on different groups need their all-reduce.
    let segs = dag.segments();
    if let (Some(e), Some(h)) = (
        segs.iter().position(|s| s.has_embedding()),
        segs.iter().position(|s| s.has_head() && s.tied_elems > 0),
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

fn compile_synced(dag: &TrainingDag) -> Result<Plan, CompileError> {
    let Lowered {
        devices,
        parts,
        steps,
        keys,
    } = lower(dag, &HashMap::new())?;
    // The deadlock check on the steps built with the ops (the messages
    // and meetings keyed by global positions).
    let pc = deadlock::simulate(&steps, keys);
    drop(steps);
    deadlock::explain(&devices, &pc)?;
    let mut plan = Plan {
        hash: String::new(),
        model: dag.model().name.clone(),
        batch_size: dag.model().batch_size,
        precision: dag.model().precision,
        devices,
    };
    plan.hash = plan.hash_of(&parts);
    Ok(plan)
}

/// The per-device plans before the deadlock check: each device's streams,
/// their hashes, the deadlock check's steps (per device, per stream) and
/// the number of its keys.
struct Lowered {
    devices: Vec<DevicePlan>,
    parts: Vec<Vec<[u64; 2]>>,
    steps: Vec<Vec<deadlock::StreamSteps>>,
    keys: usize,
}

/// Each node's index in the order and its first global position (a node
/// on n devices owns n positions; markers none), and the positions in all.
fn positions(dag: &TrainingDag, order: &[NodeId]) -> (Vec<u32>, Vec<u32>, u32) {
    let g = &dag.graph;
    let bound = g.node_bound();
    let mut order_ix = vec![u32::MAX; bound];
    let mut pos_base = vec![u32::MAX; bound];
    let mut total = 0u32;
    for (k, id) in order.iter().enumerate() {
        order_ix[id.ix().index()] = k as u32;
        let n = &g[id.ix()];
        if !matches!(n.kind, NodeKind::Marker) {
            pos_base[id.ix().index()] = total;
            total += n.devices.len() as u32;
        }
    }
    (order_ix, pos_base, total)
}

/// Devices ranked by first appearance in the order (those never in it
/// last): each device's rank, and the devices by rank.
fn rank_devices(dag: &TrainingDag, order: &[NodeId], ndev: usize) -> (Vec<u32>, Vec<u32>) {
    let g = &dag.graph;
    let mut rank = vec![u32::MAX; ndev];
    let mut by_rank: Vec<u32> = Vec::with_capacity(ndev);
    for id in order {
        for dev in &g[id.ix()].devices {
            let r = &mut rank[dev.0 as usize];
            if *r == u32::MAX {
                *r = by_rank.len() as u32;
                by_rank.push(dev.0);
            }
        }
        if by_rank.len() == ndev {
            break;
        }
    }
    for (d, r) in rank.iter_mut().enumerate() {
        if *r == u32::MAX {
            *r = by_rank.len() as u32;
            by_rank.push(d as u32);
        }
    }
    (rank, by_rank)
}

/// The ranks cut into chunks of contiguous ranks (`build.rs`): how many,
/// each device's chunk, and per order index the chunks the node has
/// devices in (a bit each).
fn chunk_devices(
    groups: &groups::Groups,
    order: &[NodeId],
    rank: &[u32],
) -> (usize, Vec<u8>, Vec<u64>) {
    let ndev = rank.len();
    let nchunks = (rayon::current_num_threads() * 4)
        .clamp(1, 64)
        .min(ndev.max(1));
    let chunk: Vec<u8> = rank
        .iter()
        .map(|&r| (r as usize * nchunks / ndev.max(1)) as u8)
        .collect();
    let group_chunks: Vec<u64> = groups
        .lists
        .iter()
        .map(|devs| {
            devs.iter()
                .fold(0u64, |bits, d| bits | 1 << chunk[d.0 as usize])
        })
        .collect();
    let chunks_of: Vec<u64> = order
        .iter()
        .map(|id| match id.ix().index() {
            i if groups.is_marker(i) => 0,
            i => group_chunks[groups.of_node(i) as usize],
        })
        .collect();
    (nchunks, chunk, chunks_of)
}

/// `relayouts`: the relayout nodes compile put into its own copy of the
/// DAG (`layout.rs`) and what each moves; empty for the DAG as given, where
/// they are planned first.
fn lower(
    dag: &TrainingDag,
    relayouts: &HashMap<NodeId, Arc<Relayout>>,
) -> Result<Lowered, CompileError> {
    // The passes that only read the DAG run side by side (each is mostly
    // serial): the snapshots first, then validation and the schedule. A
    // validation error is reported before a cycle, as when they ran in turn.
    let ((flat, groups), segs) = rayon::join(
        || rayon::join(|| flat::Flat::of(dag), || groups::Groups::of(dag)),
        || Segments {
            placement: dag.segment_placement(),
            copies: dag.segment_copies(),
            tp: dag.segment_tp(),
        },
    );
    // Where a data edge joins two layouts a relayout can join, compile
    // lowers its own copy of the DAG with the relayouts in it.
    if relayouts.is_empty() {
        let planned = layout::plan(dag, &flat, &groups);
        if !planned.is_empty() {
            let mut copy = dag.clone();
            let relayouts = layout::insert(&mut copy, planned);
            return lower(&copy, &relayouts);
        }
    }
    let (valid, order) = rayon::join(
        || validate(dag, &flat, &groups, &segs),
        || schedule(dag, &flat),
    );
    valid?;
    let g = &dag.graph;
    if order.len() != g.node_count() {
        return Err(cycle_error(dag));
    }
    let ndev = dag.cluster_info().devices as usize;
    let (order_ix, pos_base, total) = positions(dag, &order);
    let (rank, by_rank) = rank_devices(dag, &order, ndev);
    let (nchunks, chunk, chunks_of) = chunk_devices(&groups, &order, &rank);
    let placement = &segs.placement;
    // Split dimensions and their sizes, outermost first.
    let extents = dag.tag_extents();
    let split_sizes: Vec<(crate::dag::TagKey, u32)> = dag
        .split_dims
        .iter()
        .map(|k| (*k, extents.get(dag.tag_name(*k)).copied().unwrap_or(1)))
        .collect();
    let tp_whole = build::tp_whole(dag);
    let sp_norms = build::sp_norms(dag);
    let cx = build::Ctx {
        dag,
        flat: &flat,
        order: &order,
        order_ix: &order_ix,
        pos_base: &pos_base,
        chunks_of: &chunks_of,
        rank: &rank,
        by_rank: &by_rank,
        chunk: &chunk,
        nchunks,
        placement,
        tp: &segs.tp,
        copies: &segs.copies,
        groups: &groups,
        split_sizes: &split_sizes,
        microbatches: split_sizes.iter().map(|(_, s)| *s).product(),
        tp_whole: &tp_whole,
        relayouts,
        sp_norms: &sp_norms,
    };
    let mut built: Vec<Option<build::Built>> = (0..nchunks)
        .into_par_iter()
        .map(|c| build::chunk(&cx, c))
        .collect::<Vec<_>>()
        .into_iter()
        .flatten()
        .map(Some)
        .collect();
    // Back to device order.
    let mut by_device: Vec<Option<build::Built>> = (0..ndev).map(|_| None).collect();
    for b in built.iter_mut() {
        let b = b.take().expect("each chunk's devices once");
        let d = b.device as usize;
        by_device[d] = Some(b);
    }
    let states = model_states(dag, &segs, ndev);
    let mut devices = Vec::with_capacity(ndev);
    let mut parts: Vec<Vec<[u64; 2]>> = Vec::with_capacity(ndev);
    let mut steps = Vec::with_capacity(ndev);
    for (d, b) in by_device.into_iter().enumerate() {
        let b = b.expect("every device built");
        let mut hashes = Vec::with_capacity(b.streams.len());
        let streams = b
            .streams
            .into_iter()
            .map(|(name, ops, h)| {
                hashes.push(h);
                StreamPlan {
                    stream: name.to_string(),
                    ops,
                }
            })
            .collect();
        parts.push(hashes);
        steps.push(b.steps);
        devices.push(DevicePlan {
            device: d as u32,
            peak_bytes: states[d] + b.transient_peak,
            model_state_bytes: states[d],
            transient_peak_bytes: b.transient_peak,
            streams,
        });
    }
    Ok(Lowered {
        devices,
        parts,
        steps,
        keys: total as usize,
    })
}

/// Resident model states per device: parameters, gradients, master weights
/// and AdamW's moments in the precision policy's bytes (fp32: 4 + 4 + 0 +
/// 8 per parameter; bf16: 2 + 4 + 4 + 8), sharded as the ZeRO stage says.
fn model_states(dag: &TrainingDag, segs: &Segments, ndev: usize) -> Vec<u64> {
    let (placement, copies) = (&segs.placement[..], &segs.copies);
    let mut states = vec![0u64; ndev];
    let b = dag.model().precision.state_bytes();
    for (s, p) in placement.iter().enumerate() {
        // A segment held once, or once per parameter copy.
        let held_on: Vec<(Vec<crate::dag::DeviceId>, Option<u32>)> = match p {
            Some(one) => vec![one.clone()],
            None if TrainingDag::paired_copies(&copies[s]).is_some() => copies[s].clone(),
            None => continue,
        };
        for (devs, rep) in &held_on {
            let e = segment_states(dag, placement, &segs.tp, s as u32, devs.len(), *rep);
            for d in devs {
                states[d.0 as usize] += e.params * b.params
                    + e.grads * b.grads
                    + e.moments / 2 * (b.master + b.moments);
            }
        }
    }
    states
}

/// Elements of one segment's states on each of the `devices` devices of a
/// group holding it under replication spec `rep`.
pub(crate) struct SegmentStates {
    pub params: u64,
    pub grads: u64,
    /// AdamW's two moments: twice the parameters this device's optimizer
    /// step updates.
    pub moments: u64,
}

pub(crate) fn segment_states(
    dag: &TrainingDag,
    placement: &[Option<(Vec<DeviceId>, Option<u32>)>],
    tp: &[u32],
    s: u32,
    devices: usize,
    rep: Option<u32>,
) -> SegmentStates {
    let held = dag.held_elems(s, placement, tp);
    // Sharded over the replicas: the mesh's tensor-parallel groups.
    let n = (devices as u64 / u64::from(tp[s as usize])).max(1);
    let zero = match rep {
        Some(r) if n > 1 => dag.specs[r as usize].zero,
        _ => 0,
    };
    // Experts spread by expert parallelism live on one device each: ZeRO
    // does not shard them (they are not replicated), only the rest.
    let sharded = |on: bool| match dag.expert_elems(s, placement) {
        (all, spread) if on && spread > 1 => all / spread + (held - all / spread).div_ceil(n),
        _ if on => held.div_ceil(n),
        _ => held,
    };
    SegmentStates {
        params: sharded(zero >= 3),
        grads: sharded(zero >= 2),
        moments: 2 * sharded(zero >= 1),
    }
}

/// A ZeRO-3 parameter gather (a node whose only edges go to its readers).
pub(super) fn is_param_gather(dag: &TrainingDag, i: usize) -> bool {
    matches!(
        &dag.graph[NodeIndex::new(i)].kind,
        NodeKind::Comm(c) if c.purpose == CommPurpose::ParamGather
    )
}

/// The global list schedule (see the module docs): among ready nodes the
/// lowest key first (depth; a source just before its first consumer, a
/// parameter gather one earlier), then
/// the higher priority, then the lower id. Every edge goes from a lower key
/// to a higher one (a node's depth exceeds each predecessor's, a source's key
/// is below its consumers' depths), so all of a node's predecessors come
/// before it in (key, priority, id) order: that order *is* the list
/// schedule, and a sort gives it without a heap. A node left unvisited by
/// the depth pass is on a cycle: the order then has fewer nodes than the DAG.
fn schedule(dag: &TrainingDag, flat: &flat::Flat) -> Vec<NodeId> {
    let g = &dag.graph;
    let bound = g.node_bound();
    let live = |i: usize| g.contains_node(NodeIndex::new(i));
    // Depth: longest path from a source, in topological order (the nodes
    // reached, in the order reached).
    let mut depth = vec![0u32; bound];
    let mut deg: Vec<u32> = (0..bound).map(|i| flat.in_degree(i)).collect();
    let sources: Vec<usize> = (0..bound).filter(|&i| deg[i] == 0 && live(i)).collect();
    let mut reached = Vec::with_capacity(g.node_count());
    let mut stack = sources.clone();
    while let Some(n) = stack.pop() {
        reached.push(n as u32);
        let dn = depth[n] + 1;
        for &(t, _) in flat.succs(n) {
            let t = t as usize;
            depth[t] = depth[t].max(dn);
            deg[t] -= 1;
            if deg[t] == 0 {
                stack.push(t);
            }
        }
    }
    // Sources are keyed just before their first consumer (prefetch late); a
    // parameter gather one op earlier, so the op it waits for (`build.rs`,
    // the op before it on its device) is the one before its reader's
    // predecessor, and it overlaps that predecessor (FSDP's one gather
    // ahead).
    let mut key = depth;
    for &i in &sources {
        if let Some(m) = flat.succs(i).iter().map(|&(t, _)| key[t as usize]).min() {
            key[i] = m.saturating_sub(1 + u32::from(is_param_gather(dag, i)));
        }
    }
    // Higher priority first: `Reverse` on the priority itself, never its
    // negation (`-i32::MIN` overflows).
    let keyed: Vec<(u32, std::cmp::Reverse<i32>, u32)> = reached
        .par_iter()
        .with_min_len(4096)
        .map(|&i| {
            let priority = g[NodeIndex::new(i as usize)].priority;
            (key[i as usize], std::cmp::Reverse(priority), i)
        })
        .collect();
    // Keys are depths (below the node count): a counting sort by key, then
    // each key's few nodes by priority and id.
    let width = keyed.iter().map(|k| k.0 as usize + 1).max().unwrap_or(0);
    let mut at = vec![0u32; width + 1];
    for k in &keyed {
        at[k.0 as usize + 1] += 1;
    }
    for i in 1..at.len() {
        at[i] += at[i - 1];
    }
    let mut sorted = vec![(0u32, std::cmp::Reverse(0i32), 0u32); keyed.len()];
    let mut next = at.clone();
    for k in keyed {
        let slot = &mut next[k.0 as usize];
        sorted[*slot as usize] = k;
        *slot += 1;
    }
    for w in at.windows(2) {
        sorted[w[0] as usize..w[1] as usize].sort_unstable();
    }
    sorted.into_iter().map(|(_, _, i)| NodeId(i)).collect()
}
