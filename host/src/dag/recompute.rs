//! The `recompute` directive: activation recomputation as a rewrite of the
//! DAG, applied by a strategy after it placed the model. For each matched
//! forward `F` a recompute node `R` (pass `R`) takes over the saved tensors
//! and hands them to the backward. `full`: `F` keeps none, `R` reads `F`'s
//! inputs (alive until it runs) and runs the forward again. `selective`:
//! `F` hands `R` what it keeps (a `Kept` edge), `R` computes the rest.
//! Compile schedules `R` right before its backward (`compile/flat.rs`) unless
//! a strategy ordered it itself; the memory walk, the runtime and the
//! simulator count it like any compute node.

use super::{DagError, DagErrorKind, EdgeKind, Filter, NodeId, NodeKind, Pass, TensorKind};
use super::{Node, TrainingDag};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::fmt;

/// What a recompute keeps from the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecomputePolicy {
    /// Keep only the segment's input; the backward reruns the whole forward
    /// (Megatron's `--recompute-granularity full`).
    Full,
    /// Keep the matmul outputs (q/k/v, attention output, the MLP's
    /// pre-activation), the layer inputs and norm statistics; recompute the
    /// norm outputs, the attention probabilities (QKᵀ, softmax, AV) and the
    /// activation (Megatron's selective recompute). Expert parts, the head
    /// and the embedding keep everything.
    Selective,
}

impl RecomputePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            RecomputePolicy::Full => "full",
            RecomputePolicy::Selective => "selective",
        }
    }
}

impl fmt::Display for RecomputePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl TrainingDag {
    /// **recompute**: drop the saved tensors of the matched forwards after
    /// `F` and rebuild them with a recompute node `R` (same devices, stream,
    /// tags and batch share) that runs right before the backward. Returns
    /// how many forwards got one. A forward already recomputed, and the
    /// phases of an expert pass split by `shard` (their all-to-alls would
    /// run again), are left as they are. Apply it after every `split`,
    /// `place`, `replicate`, `shard` and `shard-tensor`: those refuse a DAG
    /// with recompute nodes.
    pub fn recompute(&mut self, f: &Filter, policy: RecomputePolicy) -> Result<u32, DagError> {
        let call = format!("recompute({f}, {policy})");
        let ids = self.select(f, &call)?;
        let forwards: Vec<NodeId> = ids
            .iter()
            .copied()
            .filter(|id| {
                matches!(
                    self.graph[id.ix()].kind,
                    NodeKind::Compute { pass: Pass::F, .. }
                )
            })
            .collect();
        if forwards.is_empty() {
            return Err(DagError::new(
                call,
                DagErrorKind::WrongKind {
                    filter: f.to_string(),
                    what: "forward (F)",
                    matched: ids.iter().take(8).map(|i| self.label(*i)).collect(),
                },
            ));
        }
        if let Some(&id) = forwards
            .iter()
            .find(|id| self.graph[id.ix()].devices.is_empty())
        {
            return Err(DagError::new(
                call,
                DagErrorKind::Unplaced {
                    node: self.label(id),
                },
            ));
        }
        let phased = |dag: &Self, id: &NodeId| {
            matches!(
                dag.graph[id.ix()].kind,
                NodeKind::Compute { phase: Some(_), .. }
            )
        };
        if forwards.iter().all(|id| phased(self, id)) {
            return Err(DagError::new(
                call,
                DagErrorKind::Unsupported {
                    what: format!(
                        "recomputing the phases of a split expert pass ({}; its all-to-alls would run again)",
                        self.label(forwards[0])
                    ),
                },
            ));
        }
        // Each forward's edges are read; each recompute adds a node, a copy
        // of the forward's data inputs and takes over its saved edges.
        let degree: u64 = forwards
            .iter()
            .map(|id| {
                self.graph
                    .edges_directed(id.ix(), Direction::Incoming)
                    .count() as u64
                    + 2
            })
            .sum();
        // A recompute reads its segment's weights: under ZeRO-3 that
        // resharded after each use, the rebuild gives it a gather of its own.
        let gathers = forwards
            .iter()
            .filter(|id| {
                let n = &self.graph[id.ix()];
                n.replica.is_some_and(|r| {
                    let s = &self.specs[r as usize];
                    s.zero == 3 && s.reshard_after_forward && n.replicas() > 1
                })
            })
            .count() as u64;
        let (nodes, edges) = (forwards.len() as u64 + gathers, degree + 2 * gathers);
        self.check_growth(&call, nodes, edges)?;
        self.charge(&call, degree.saturating_mul(2))?;
        // The derived nodes are rebuilt inside this call, against its
        // budget, not later by the compiler outside every budget.
        let rebuild =
            (self.node_count() as u64 + nodes).saturating_add(self.edge_count() as u64 + edges);
        self.charge(&call, rebuild)?;
        self.charge_bytes(&call, rebuild.saturating_mul(super::budget::REBUILD_BYTES))?;
        let mut made = 0u32;
        for id in forwards {
            if !phased(self, &id) && self.add_recompute(id, policy) {
                made += 1;
            }
        }
        if made > 0 {
            self.recomputes = self.recomputes.saturating_add(made);
            self.touch();
            self.sync();
        }
        Ok(made)
    }

    /// Give forward `f` a recompute node: its saved edges move to the new
    /// node, which reads what `f` reads from core nodes (`full`; derived
    /// inputs, ZeRO-3's gathers, are rebuilt for it) or what `f` keeps
    /// (`selective`). False when `f` saves nothing (already recomputed).
    fn add_recompute(&mut self, f: NodeId, policy: RecomputePolicy) -> bool {
        let saved: Vec<_> = self
            .graph
            .edges_directed(f.ix(), Direction::Outgoing)
            .filter(|e| {
                matches!(
                    e.weight(),
                    EdgeKind::Data {
                        tensor: TensorKind::Saved,
                        ..
                    }
                )
            })
            .map(|e| (e.id(), e.target(), *e.weight()))
            .collect();
        if saved.is_empty() {
            return false;
        }
        let inputs: Vec<_> = self
            .graph
            .edges_directed(f.ix(), Direction::Incoming)
            .filter(|e| {
                matches!(e.weight(), EdgeKind::Data { .. })
                    && self.graph[e.source()].derived.is_none()
            })
            .map(|e| (e.source(), *e.weight()))
            .collect();
        let fwd = &self.graph[f.ix()];
        let NodeKind::Compute { segment, .. } = fwd.kind else {
            return false;
        };
        let mut r = Node::new(
            NodeKind::Compute {
                pass: Pass::R,
                segment,
                phase: None,
            },
            fwd.tags.clone(),
            fwd.devices.clone(),
            fwd.stream,
            fwd.batch_div,
        );
        r.priority = fwd.priority;
        r.replica = fwd.replica;
        r.tensor_parallel = fwd.tensor_parallel;
        r.context_parallel = fwd.context_parallel;
        let kept = self.segments()[segment as usize].cost.kept_bytes;
        let r = self.add_node(r);
        match policy {
            RecomputePolicy::Full => {
                for (src, w) in inputs {
                    self.graph.add_edge(src, r, w);
                }
                // The forward no longer feeds its backward: this edge keeps
                // it first, so no order can move a forward (a head's, whose
                // loss the run reports) after its own backward or update.
                self.graph.add_edge(f.ix(), r, EdgeKind::Temporal);
            }
            RecomputePolicy::Selective => {
                let w = EdgeKind::Data {
                    tensor: TensorKind::Kept,
                    bytes: kept,
                };
                self.graph.add_edge(f.ix(), r, w);
            }
        }
        for (e, b, w) in saved {
            self.graph.remove_edge(e);
            self.graph.add_edge(r, b, w);
        }
        true
    }

    /// Does this (recompute) node read what a selective forward kept?
    pub(crate) fn reads_kept(&self, id: NodeId) -> bool {
        self.graph
            .edges_directed(id.ix(), Direction::Incoming)
            .any(|e| {
                matches!(
                    e.weight(),
                    EdgeKind::Data {
                        tensor: TensorKind::Kept,
                        ..
                    }
                )
            })
    }

    /// What `split`, `place`, `replicate`, `shard` and `shard-tensor` check
    /// first: no recompute node exists yet (they would move a forward
    /// without its recompute, or send its inputs twice).
    pub(crate) fn check_not_recomputed(&self, call: &str) -> Result<(), DagError> {
        if self.recomputes == 0 {
            return Ok(());
        }
        Err(DagError::new(
            call,
            DagErrorKind::InvalidArgument(format!(
                "the DAG already has {} recompute (R) nodes: split, place, replicate, shard and shard-tensor must come before `recompute` (list the recompute strategy after the ones that place the model)",
                self.recomputes
            )),
        ))
    }
}
