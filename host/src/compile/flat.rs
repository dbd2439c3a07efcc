//! A flat snapshot of the DAG's edges, taken once when compile starts: every
//! edge in index order, and each node's in- and out-edges as compressed rows.
//! The compile's passes (validation, the list schedule, the per-device
//! builder) walk these arrays instead of petgraph's per-node linked lists.

use crate::dag::{EdgeKind, TrainingDag};
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};

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
        let edges: Vec<(u32, u32, EdgeKind)> = g
            .edge_references()
            .map(|e| {
                (
                    e.source().index() as u32,
                    e.target().index() as u32,
                    *e.weight(),
                )
            })
            .collect();
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
