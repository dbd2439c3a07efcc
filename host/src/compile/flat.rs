//! A flat snapshot of the DAG's edges, taken once when compile starts: every
//! edge in index order, and each node's in- and out-edges as compressed rows.
//! The compile's passes (validation, the list schedule, the per-device
//! builder) walk these arrays instead of petgraph's per-node linked lists.
//!
//! The snapshot adds one kind of edge the DAG lacks: a recompute node `R`
//! (`dag/recompute.rs`) that no strategy ordered gets a temporal edge from
//! every other predecessor of its backward, so it runs right before that
//! backward (when its output gradient has arrived), not right after its
//! forward, where it would keep the saved tensors it exists to drop.

use crate::dag::{EdgeKind, NodeKind, Pass, TensorKind, TrainingDag};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use petgraph::Direction;

pub(super) struct Flat {
    /// Every edge in edge-index order: (source, target, kind).
    pub edges: Vec<(u32, u32, EdgeKind)>,
    in_head: Vec<u32>,
    ins: Vec<(u32, EdgeKind)>,
    out_head: Vec<u32>,
    outs: Vec<(u32, EdgeKind)>,
}

impl Flat {
    pub fn of(dag: &TrainingDag) -> Self {
        let g = &dag.graph;
        let bound = g.node_bound();
        let mut edges: Vec<(u32, u32, EdgeKind)> = g
            .edge_references()
            .map(|e| {
                (
                    e.source().index() as u32,
                    e.target().index() as u32,
                    *e.weight(),
                )
            })
            .collect();
        if dag.recomputes > 0 {
            recompute_edges(dag, &mut edges);
        }
        let rows = |key: fn(&(u32, u32, EdgeKind)) -> (u32, u32)| {
            let mut head = vec![0u32; bound + 1];
            for e in &edges {
                head[key(e).0 as usize + 1] += 1;
            }
            for i in 0..bound {
                head[i + 1] += head[i];
            }
            let mut fill = head.clone();
            let mut list = vec![(0u32, EdgeKind::Temporal); edges.len()];
            for e in &edges {
                let (at, other) = key(e);
                list[fill[at as usize] as usize] = (other, e.2);
                fill[at as usize] += 1;
            }
            (head, list)
        };
        let ((in_head, ins), (out_head, outs)) =
            rayon::join(|| rows(|e| (e.1, e.0)), || rows(|e| (e.0, e.1)));
        Flat {
            edges,
            in_head,
            ins,
            out_head,
            outs,
        }
    }

    /// Predecessors of node index `n` with the edge kinds, in edge order.
    pub fn preds(&self, n: usize) -> &[(u32, EdgeKind)] {
        &self.ins[self.in_head[n] as usize..self.in_head[n + 1] as usize]
    }

    /// Successors of node index `n` with the edge kinds, in edge order.
    pub fn succs(&self, n: usize) -> &[(u32, EdgeKind)] {
        &self.outs[self.out_head[n] as usize..self.out_head[n + 1] as usize]
    }

    pub fn in_degree(&self, n: usize) -> u32 {
        self.in_head[n + 1] - self.in_head[n]
    }
}

/// The temporal edges that hold each unordered recompute node until its
/// backward's other inputs are ready. Only for an `R` whose every
/// successor is a backward reading its saved tensors: then no
/// predecessor of that backward can depend on `R`, so no cycle is made. An
/// `R` a strategy ordered (`order`, `add-temporal-edge`) keeps its order.
fn recompute_edges(dag: &TrainingDag, edges: &mut Vec<(u32, u32, EdgeKind)>) {
    let g = &dag.graph;
    for r in g.node_indices() {
        if !matches!(g[r].kind, NodeKind::Compute { pass: Pass::R, .. }) {
            continue;
        }
        let outs = g.edges_directed(r, Direction::Outgoing);
        let saved_only = outs.clone().all(|e| {
            matches!(
                e.weight(),
                EdgeKind::Data {
                    tensor: TensorKind::Saved,
                    ..
                }
            )
        });
        if !saved_only {
            continue;
        }
        let mut before: Vec<u32> = outs
            .flat_map(|b| g.edges_directed(b.target(), Direction::Incoming))
            .filter(|e| e.source() != r && !matches!(e.weight(), EdgeKind::Peer))
            .map(|e| e.source().index() as u32)
            .collect();
        before.sort_unstable();
        before.dedup();
        let ri = r.index() as u32;
        edges.extend(before.into_iter().map(|p| (p, ri, EdgeKind::Temporal)));
    }
}
