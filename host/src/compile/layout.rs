//! Layouts at data edges (part of validation): where a batch-sized tensor
//! flows from one compute node to another, both must hold it the same way.
//!
//! A compute node's layout follows from its devices and the directives that
//! spread it: `split` (which microbatch of how many), `replicate` (data-
//! parallel replicas, each holding a share of the microbatch's rows),
//! `shard-tensor` (tensor-parallel groups, each rank holding its replica's
//! share whole) and `context-parallel` (groups of replicas sharing one share,
//! each holding its chunks of every sequence). Device `i` of a node holds
//! what its `(i, tp, cp, replicas, split)` say, so two ends agree when those
//! agree and the devices do: the same list for an edge on one group, the
//! same length for a pipeline's send and receive (they pair their groups
//! device for device).
//!
//! Where the ends disagree, compile plans a relayout (`relayout.rs`)
//! between them, or in place of the pipeline send and receive that would
//! pair their groups device for device: an op over both ends' devices that
//! moves each consumer the rows and positions it needs from whoever holds
//! them ([`plan`], [`insert`]). What no relayout can bring (a layout the
//! runtime does not hold that way, a consumer whose rows no producer holds)
//! is refused naming the edge and both layouts (and the directives that
//! made them) before anything runs ([`check`]): the runtime would read a
//! tensor of another shape (a panic), train on the wrong rows or chunks (a
//! wrong loss), or wait for a device that sends nothing.

use super::relayout::{Holding, Relayout};
use super::{flat::Flat, groups::Groups, CompileError};
use crate::dag::{
    Comm, CommOp, CommPurpose, DeviceId, EdgeKind, Node, NodeId, NodeKind, TensorKind, TrainingDag,
};
use foldhash::{HashMap, HashMapExt};
use petgraph::visit::EdgeRef;
use std::sync::Arc;

/// Whether `a` and `b` hold a batch-sized tensor the same way, device for
/// device, their devices left out (compared by the caller: the same list
/// for an edge on one group, the same length across a pipeline pair): the
/// same tensor and context parallelism, the same split and the same piece
/// of it.
fn same_shape(dag: &TrainingDag, a: &Node, b: &Node) -> bool {
    a.devices.len() == b.devices.len()
        && a.tp_degree() == b.tp_degree()
        && a.cp_degree() == b.cp_degree()
        && a.batch_div == b.batch_div
        && dag
            .split_dims
            .iter()
            .all(|k| a.tags.get(*k).unwrap_or(0) == b.tags.get(*k).unwrap_or(0))
}

/// `n`'s layout in words: its devices, then each directive's share.
pub(super) fn describe(dag: &TrainingDag, id: NodeId) -> String {
    let n = &dag.graph[id.ix()];
    let devices: Vec<u32> = n.devices.iter().map(|d| d.0).collect();
    let (tp, cp) = (n.tp_degree(), n.cp_degree());
    let replicas = n.replicas();
    let mut parts = Vec::new();
    if n.batch_div > 1 {
        let piece: Vec<String> = dag
            .split_dims
            .iter()
            .filter_map(|k| n.tags.get(*k).map(|v| format!("{} {v}", dag.tag_name(*k))))
            .collect();
        parts.push(format!(
            "microbatch {} of {} (split)",
            piece.join(", "),
            n.batch_div
        ));
    } else {
        parts.push("the whole batch (no split)".to_string());
    }
    let shares = replicas / cp.max(1);
    if shares > 1 {
        parts.push(format!(
            "its rows in {shares} data-parallel shares (replicate)"
        ));
    }
    let zero = n
        .replica
        .and_then(|r| dag.specs.get(r as usize))
        .map_or(0, |s| s.zero);
    if zero > 0 && replicas > 1 {
        parts.push(format!("its states under ZeRO-{zero} (replicate)"));
    }
    if tp > 1 {
        parts.push(format!(
            "each share whole on a tensor-parallel group of {tp} (shard-tensor)"
        ));
    }
    if cp > 1 {
        parts.push(format!(
            "its sequences in {} chunks over {cp} context-parallel replicas (context-parallel)",
            2 * cp
        ));
    }
    format!(
        "{} on devices {devices:?}: {}",
        dag.label(id),
        parts.join(", ")
    )
}

/// Every data edge between compute nodes, directly or through a pipeline's
/// send and receive, joins ends of one layout (run after [`insert`] put
/// relayouts where they can go: what is left cannot move).
pub(super) fn check(dag: &TrainingDag, flat: &Flat, groups: &Groups) -> Result<(), CompileError> {
    let g = &dag.graph;
    let compute = |i: usize| {
        g.node_weight(NodeId(i as u32).ix())
            .filter(|n| matches!(n.kind, NodeKind::Compute { .. }) && !n.devices.is_empty())
    };
    let refuse = |s: usize, t: usize, paired: bool| -> Result<(), CompileError> {
        let (Some(a), Some(b)) = (compute(s), compute(t)) else {
            return Ok(());
        };
        // A pipeline pair moves device `i`'s tensor to the receiver's `i`-th
        // device: equal shapes suffice; on one group, the devices must agree too.
        if same_shape(dag, a, b) && (paired || groups.of_node(s) == groups.of_node(t)) {
            return Ok(());
        }
        let (from, to) = (NodeId(s as u32), NodeId(t as u32));
        Err(CompileError::Layouts {
            from: dag.label(from),
            to: dag.label(to),
            from_layout: describe(dag, from),
            to_layout: describe(dag, to),
            through: paired.then(|| {
                let devs = |d: &[DeviceId]| d.iter().map(|x| x.0).collect::<Vec<_>>();
                Box::new((devs(&a.devices), devs(&b.devices)))
            }),
        })
    };
    for &(s, t, kind) in &flat.edges {
        let EdgeKind::Data { tensor, .. } = kind else {
            continue;
        };
        if !tensor.scales_with_batch() {
            continue;
        }
        let (s, t) = (s as usize, t as usize);
        match &g[NodeId(t as u32).ix()].kind {
            NodeKind::Compute { .. } => refuse(s, t, false)?,
            // A pipeline send: the compute nodes its receive feeds.
            NodeKind::Comm(c) if c.purpose == CommPurpose::Pipeline && c.op == CommOp::Send => {
                let Some(recv) = c.pair.filter(|_| compute(s).is_some()) else {
                    continue;
                };
                if !g.contains_node(recv.ix()) {
                    continue;
                }
                for &(v, k) in flat.succs(recv.ix().index()) {
                    if matches!(k, EdgeKind::Data { .. }) {
                        refuse(s, v as usize, true)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The tied `wte` is one weight with one gradient: the embedding's and the
/// head's regions must hold it the same way (the same tensor and sequence
/// parallelism, context parallelism, replicas and ZeRO stage), so that the
/// sum their group makes of it (and the tied all-reduce between two equal
/// groups) counts each row's contribution once. A region that holds the
/// whole batch on every rank and one that holds a share of it would sum to
/// another gradient.
pub(super) fn check_tied(dag: &TrainingDag) -> Result<(), CompileError> {
    let segs = dag.segments();
    let (Some(e), Some(h)) = (
        segs.iter().position(|s| s.has_embedding()),
        segs.iter().position(|s| s.has_head() && s.tied_elems > 0),
    ) else {
        return Ok(());
    };
    if e == h {
        return Ok(());
    }
    // ZeRO shards nothing on one replica (the gradients go to the update
    // as without it).
    let key = |n: &Node| {
        let zero = n
            .replica
            .and_then(|r| dag.specs.get(r as usize))
            .filter(|_| n.replicas() > 1)
            .map_or(0, |s| s.zero);
        (
            n.tp_degree(),
            n.tensor_parallel.is_some_and(|t| t.sequence),
            n.cp_degree(),
            n.replicas(),
            zero,
        )
    };
    let mut first: Option<(NodeId, _)> = None;
    for ix in dag.graph.node_indices() {
        let n = &dag.graph[ix];
        let NodeKind::Compute { segment, .. } = n.kind else {
            continue;
        };
        if (segment as usize != e && segment as usize != h) || n.devices.is_empty() {
            continue;
        }
        let id = NodeId::of(ix);
        match &first {
            None => first = Some((id, key(n))),
            Some((f, k)) if *k != key(n) => {
                return Err(CompileError::TiedLayouts {
                    first: describe(dag, *f),
                    other: describe(dag, id),
                });
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The split dimensions with their sizes, outermost first, and their
/// product: how compile numbers microbatches (`build.rs`).
pub(super) struct Splits {
    pub dims: Vec<(crate::dag::TagKey, u32)>,
    pub microbatches: u32,
}

impl Splits {
    pub fn of(dag: &TrainingDag) -> Self {
        let extents = dag.tag_extents();
        let dims: Vec<_> = dag
            .split_dims
            .iter()
            .map(|k| (*k, extents.get(dag.tag_name(*k)).copied().unwrap_or(1)))
            .collect();
        let microbatches = dims.iter().map(|(_, s)| *s).product();
        Splits { dims, microbatches }
    }
}

/// What device `i` of compute node `n` holds of a batch-sized tensor, as
/// the runtime lays it out (`runtime::ops::compute::rows_of` and
/// `SeqRows::balanced`): piece `microbatch × shares + replica ÷ cp` of the
/// global batch cut in `batch_div × shares` pieces, and a context-parallel
/// rank's two chunks of `2·cp` (else every position). `None` for a layout
/// the runtime does not hold that way (a split into another count than the
/// model's, a batch or sequence that does not divide).
pub(super) fn holding(dag: &TrainingDag, splits: &Splits, n: &Node, i: usize) -> Option<Holding> {
    let cfg = dag.model();
    let (b, seq) = (u64::from(cfg.batch_size), cfg.seq_len);
    if n.batch_div != 1 && n.batch_div != splits.microbatches {
        return None;
    }
    let microbatch = splits.dims.iter().fold(0u64, |acc, (k, size)| {
        acc * u64::from(*size) + u64::from(n.tags.get(*k).unwrap_or(0))
    });
    let (tp, cp) = (n.tp_degree() as usize, n.cp_degree() as usize);
    let replica = i / tp;
    let div = u64::from(n.batch_div) * n.replicas() as u64 / cp as u64;
    if div == 0 || !b.is_multiple_of(div) || !seq.is_multiple_of(2 * cp as u32) {
        return None;
    }
    let rows = b / div;
    let shares = div / u64::from(n.batch_div);
    let piece = microbatch * shares + (replica / cp) as u64;
    let spans = if cp > 1 {
        let chunk = seq / (2 * cp as u32);
        let rank = (replica % cp) as u32;
        vec![
            [rank * chunk, (rank + 1) * chunk],
            [
                (2 * cp as u32 - 1 - rank) * chunk,
                (2 * cp as u32 - rank) * chunk,
            ],
        ]
    } else {
        vec![[0, seq]]
    };
    let first = u32::try_from(piece * rows).ok()?;
    Some(Holding {
        rows: [first, first.checked_add(u32::try_from(rows).ok()?)?],
        spans,
    })
}

/// The relayout that moves `tensor` (`bytes` for the whole batch) from
/// compute node `u`'s layout to `v`'s; `None` when one end's layout is not
/// one the runtime holds or a consumer needs what no producer holds.
fn relayout_between(
    dag: &TrainingDag,
    splits: &Splits,
    u: &Node,
    v: &Node,
    bytes: u64,
) -> Option<Relayout> {
    let mut members: Vec<u32> = u.devices.iter().chain(&v.devices).map(|d| d.0).collect();
    members.sort_unstable();
    members.dedup();
    let of = |n: &Node| -> Option<Vec<Option<Holding>>> {
        members
            .iter()
            .map(|m| match n.devices.iter().position(|d| d.0 == *m) {
                Some(i) => holding(dag, splits, n, i).map(Some),
                None => Some(None),
            })
            .collect()
    };
    let cfg = dag.model();
    let cells = u64::from(cfg.batch_size) * u64::from(cfg.seq_len);
    let r = Relayout {
        members: Arc::from(members.clone()),
        from: of(u)?,
        to: of(v)?,
        position_bytes: bytes / cells.max(1),
        batch_rows: cfg.batch_size,
        seq: cfg.seq_len,
    };
    r.pieces().ok().map(|_| r)
}

/// Where a planned relayout goes: between the ends of a data edge, or in
/// place of a pipeline's send and receive between them.
pub(super) enum At {
    Edge {
        from: u32,
        to: u32,
    },
    Pair {
        from: u32,
        send: u32,
        recv: u32,
        to: u32,
    },
}

/// A relayout to put in: where, the data edge's kind, and what it moves.
pub(super) type Planned = (At, EdgeKind, Relayout);

/// The data edges between compute nodes whose ends disagree and a relayout
/// can join: direct ones, and ones through a pipeline's send and receive
/// (one producer, one consumer) that pair their groups device for device
/// where the layouts do not.
pub(super) fn plan(dag: &TrainingDag, flat: &Flat, groups: &Groups) -> Vec<Planned> {
    let g = &dag.graph;
    let compute = |i: u32| {
        g.node_weight(NodeId(i).ix())
            .filter(|n| matches!(n.kind, NodeKind::Compute { .. }) && !n.devices.is_empty())
    };
    let data = |list: &[(u32, EdgeKind)]| -> Vec<u32> {
        list.iter()
            .filter(|(_, k)| matches!(k, EdgeKind::Data { .. }))
            .map(|(n, _)| *n)
            .collect()
    };
    let mut out = Vec::new();
    let mut splits = None;
    for &(s, t, kind) in &flat.edges {
        let EdgeKind::Data { tensor, bytes } = kind else {
            continue;
        };
        // The residual stream and its gradient: what segments hand each other.
        if !matches!(tensor, TensorKind::Activation | TensorKind::ActGrad) {
            continue;
        }
        let Some(u) = compute(s) else { continue };
        // The consumer: `t` itself, or what the pipeline receive paired
        // with `t` (a send) feeds.
        let (at, v) = match &g[NodeId(t).ix()].kind {
            NodeKind::Compute { .. } => {
                if groups.of_node(s as usize) == groups.of_node(t as usize)
                    && same_shape(dag, u, &g[NodeId(t).ix()])
                {
                    continue;
                }
                (At::Edge { from: s, to: t }, t)
            }
            NodeKind::Comm(c) if c.purpose == CommPurpose::Pipeline && c.op == CommOp::Send => {
                let Some(recv) = c.pair.filter(|r| g.contains_node(r.ix())) else {
                    continue;
                };
                let (ins, outs) = (
                    data(flat.preds(t as usize)),
                    data(flat.succs(recv.ix().index())),
                );
                let ([_], [v]) = (&ins[..], &outs[..]) else {
                    continue;
                };
                match compute(*v) {
                    Some(vn) if !same_shape(dag, u, vn) => {}
                    _ => continue,
                }
                let pair = At::Pair {
                    from: s,
                    send: t,
                    recv: recv.0,
                    to: *v,
                };
                (pair, *v)
            }
            _ => continue,
        };
        let Some(v) = compute(v) else { continue };
        let splits = splits.get_or_insert_with(|| Splits::of(dag));
        if let Some(r) = relayout_between(dag, splits, u, v, bytes) {
            out.push((at, kind, r));
        }
    }
    out
}

/// Put each planned relayout between its edge's ends (in place of the
/// pipeline pair it replaces, whose ordering edges it takes over): a node
/// over both ends' devices on the consumer's stream, with the consumer's
/// tags; the map gives each one's relayout. The DAG is compile's own copy.
pub(super) fn insert(
    dag: &mut TrainingDag,
    planned: Vec<Planned>,
) -> HashMap<NodeId, Arc<Relayout>> {
    let mut specs = HashMap::with_capacity(planned.len());
    for (at, kind, r) in planned {
        let EdgeKind::Data { tensor, bytes } = kind else {
            continue;
        };
        let (u, v) = match at {
            At::Edge { from, to } => (NodeId(from).ix(), NodeId(to).ix()),
            At::Pair { from, to, .. } => (NodeId(from).ix(), NodeId(to).ix()),
        };
        // The orderings the pair's ops took part in, kept on the relayout.
        let mut before = Vec::new();
        let mut after = Vec::new();
        match at {
            At::Edge { .. } => {
                let Some(edge) = dag
                    .graph
                    .edges_connecting(u, v)
                    .find(|e| *e.weight() == kind)
                    .map(|e| e.id())
                else {
                    continue;
                };
                dag.graph.remove_edge(edge);
            }
            At::Pair { send, recv, .. } => {
                let (send, recv) = (NodeId(send).ix(), NodeId(recv).ix());
                for n in [send, recv] {
                    for e in dag.graph.edges_directed(n, petgraph::Direction::Incoming) {
                        if *e.weight() == EdgeKind::Temporal {
                            before.push(e.source());
                        }
                    }
                    for e in dag.graph.edges_directed(n, petgraph::Direction::Outgoing) {
                        if *e.weight() == EdgeKind::Temporal {
                            after.push(e.target());
                        }
                    }
                }
                dag.graph.remove_node(send);
                dag.graph.remove_node(recv);
            }
        }
        let seg = |n: &Node| match n.kind {
            NodeKind::Compute { segment, .. } => Some(segment),
            _ => None,
        };
        let (from, to) = (&dag.graph[u], &dag.graph[v]);
        let mut segments: Vec<u32> = seg(from).into_iter().chain(seg(to)).collect();
        segments.dedup();
        let devices: Vec<DeviceId> = r.members.iter().map(|&d| DeviceId(d)).collect();
        let node = Node::new(
            NodeKind::Comm(Comm {
                op: CommOp::AllToAll,
                purpose: CommPurpose::Relayout,
                tensor,
                bytes,
                segments,
                peers: Vec::new(),
                groups: vec![devices.clone()],
                pair: None,
            }),
            to.tags.clone(),
            devices,
            to.stream,
            to.batch_div,
        );
        let x = dag.add_node(node);
        dag.graph.add_edge(u, x, kind);
        dag.graph.add_edge(x, v, kind);
        for b in before {
            dag.graph.add_edge(b, x, EdgeKind::Temporal);
        }
        for a in after {
            dag.graph.add_edge(x, a, EdgeKind::Temporal);
        }
        specs.insert(NodeId::of(x), Arc::new(r));
    }
    specs
}
