//! The host budget of the DAG stage: bounds on what one plugin call may make
//! the host do. A directive or primitive *predicts* its work (nodes and edges
//! it will visit or create, path searches, derived-node rebuilds) and is
//! refused with a [`DagErrorKind::Limit`] **before** doing it when the
//! prediction exceeds what is left, so a hostile `split(all, "MB", 4e9)` fails
//! in microseconds instead of filling memory.
//!
//! The plugin host sets a budget on the DAG copy a plugin rewrites
//! ([`TrainingDag::set_budget`]) from its `[sandbox]` limits; a DAG used
//! directly from Rust has none, and only the hard bounds (interned names fit
//! their `u16` ids) apply.
//!
//! Work is counted in *units*: one unit per node or edge visited, created or
//! copied. Predictions are upper bounds (for example, a split of `n` copies is
//! assumed to bring one derived node per copied core node).

use super::error::{DagError, DagErrorKind};
use super::TrainingDag;
use std::sync::atomic::{AtomicU64, Ordering};

/// Interned names (tag keys, streams) per kind can never exceed their `u16` ids.
pub const MAX_NAMES_HARD: u64 = u16::MAX as u64;

/// Bounds on the DAG and on the host's work, set per plugin call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DagBudget {
    /// Nodes the DAG may hold after any directive (`sandbox.max_nodes`).
    pub max_nodes: u64,
    /// Edges the DAG may hold after any directive (`sandbox.max_edges`).
    pub max_edges: u64,
    /// Distinct names, tag keys and streams together (`sandbox.max_names`).
    pub max_names: u64,
    /// Host work units for the whole call (`sandbox.max_host_work`).
    pub max_work: u64,
}

/// The budget in force and the work spent against it. Interior mutability:
/// read-only primitives (`select`) charge too (an atomic, so a DAG can be
/// read from several threads, as the compiler does).
#[derive(Debug, Default)]
pub(crate) struct Meter {
    budget: Option<DagBudget>,
    used: AtomicU64,
}

impl Clone for Meter {
    fn clone(&self) -> Self {
        Meter {
            budget: self.budget.clone(),
            used: AtomicU64::new(self.used.load(Ordering::Relaxed)),
        }
    }
}

fn limit(call: &str, budget: &'static str, limit: u64, request: String) -> DagError {
    DagError::new(
        call,
        DagErrorKind::Limit {
            budget,
            limit,
            request,
        },
    )
}

impl TrainingDag {
    /// Set (or clear, with `None`) the host budget; resets the work counter.
    pub fn set_budget(&mut self, budget: Option<DagBudget>) {
        self.meter = Meter {
            budget,
            used: AtomicU64::new(0),
        };
    }

    /// The budget in force, if any.
    pub fn budget(&self) -> Option<&DagBudget> {
        self.meter.budget.as_ref()
    }

    /// Host work units spent since the budget was set.
    pub fn work_used(&self) -> u64 {
        self.meter.used.load(Ordering::Relaxed)
    }

    /// Spend `work` units, or refuse before doing the work.
    pub(crate) fn charge(&self, call: &str, work: u64) -> Result<(), DagError> {
        let used = self.within(call, work, "needs about")?;
        self.meter
            .used
            .store(used.saturating_add(work), Ordering::Relaxed);
        Ok(())
    }

    /// The units used so far, or the refusal when `work` more do not fit
    /// what is left (`needs`: how the message words the call's need).
    fn within(&self, call: &str, work: u64, needs: &str) -> Result<u64, DagError> {
        let used = self.meter.used.load(Ordering::Relaxed);
        if let Some(b) = &self.meter.budget {
            let left = b.max_work.saturating_sub(used);
            if work > left {
                return Err(limit(
                    call,
                    "sandbox.max_host_work",
                    b.max_work,
                    format!("the call {needs} {work} units of host work, {left} are left"),
                ));
            }
        }
        Ok(used)
    }

    /// Refuse, before doing it, work that may take up to `bound` units;
    /// charge what it took afterwards ([`charge`](Self::charge)).
    pub(crate) fn fits(&self, call: &str, bound: u64) -> Result<(), DagError> {
        self.within(call, bound, "may need up to").map(|_| ())
    }

    /// [`charge`](Self::charge) for the plugin host's own reads of the DAG.
    pub fn charge_public(&self, call: &str, work: u64) -> Result<(), DagError> {
        self.charge(call, work)
    }

    /// Refuse a change that would leave more nodes or edges than allowed.
    pub(crate) fn check_growth(
        &self,
        call: &str,
        add_nodes: u64,
        add_edges: u64,
    ) -> Result<(), DagError> {
        let Some(b) = &self.meter.budget else {
            return Ok(());
        };
        let nodes = (self.node_count() as u64).saturating_add(add_nodes);
        if nodes > b.max_nodes {
            return Err(limit(
                call,
                "sandbox.max_nodes",
                b.max_nodes,
                format!(
                    "the DAG would grow from {} to {} nodes",
                    self.node_count(),
                    fmt_big(nodes)
                ),
            ));
        }
        let edges = (self.edge_count() as u64).saturating_add(add_edges);
        if edges > b.max_edges {
            return Err(limit(
                call,
                "sandbox.max_edges",
                b.max_edges,
                format!(
                    "the DAG would grow from {} to {} edges",
                    self.edge_count(),
                    fmt_big(edges)
                ),
            ));
        }
        Ok(())
    }

    /// Refuse names that would take the tag keys and streams past the budget
    /// (or a kind past its `u16` ids). `tags` and `streams` may repeat or
    /// name already-interned names; only new distinct ones count.
    pub(crate) fn check_names(
        &self,
        call: &str,
        tags: &[&str],
        streams: &[&str],
    ) -> Result<(), DagError> {
        let new = |list: &[&str], have: &dyn Fn(&str) -> bool| -> u64 {
            let mut seen: Vec<&str> = Vec::new();
            for n in list {
                if !have(n) && !seen.contains(n) {
                    seen.push(n);
                }
            }
            seen.len() as u64
        };
        let new_tags = new(tags, &|n| self.find_tag(n).is_some());
        let new_streams = new(streams, &|n| self.streams.iter().any(|s| s == n));
        let tag_total = self.tag_names.len() as u64 + new_tags;
        let stream_total = self.streams.len() as u64 + new_streams;
        if tag_total > MAX_NAMES_HARD || stream_total > MAX_NAMES_HARD {
            return Err(limit(
                call,
                "names per kind",
                MAX_NAMES_HARD,
                format!("{tag_total} tag keys and {stream_total} streams"),
            ));
        }
        if let Some(b) = &self.meter.budget {
            if tag_total + stream_total > b.max_names {
                return Err(limit(
                    call,
                    "sandbox.max_names",
                    b.max_names,
                    format!(
                        "the call would make {} distinct names ({tag_total} tag keys, {stream_total} streams)",
                        tag_total + stream_total
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Bring derived nodes up to date, charging the rebuild (every node and
    /// edge is visited) first.
    pub(crate) fn sync_for(&mut self, call: &str) -> Result<(), DagError> {
        if self.dirty {
            self.charge(call, (self.node_count() + self.edge_count()) as u64)?;
            self.sync();
        }
        Ok(())
    }
}

/// `4000000000` → `4.0e9` for very large predictions, else the number.
fn fmt_big(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.1e}", n as f64)
    } else {
        n.to_string()
    }
}
