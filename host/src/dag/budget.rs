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
//!
//! Memory is counted in *bytes* against `sandbox.max_host_bytes`: what the
//! DAG holds (estimated from its node and edge counts, its tag keys and the
//! widest device group named, [`TrainingDag::held_bytes`]) plus what the
//! current call has made for itself so far (filter matches, order plans,
//! query results: its *temporaries*). Growth and temporaries are charged
//! before they are made, so a call that would pass the budget is refused
//! with the DAG unchanged.

use super::error::{DagError, DagErrorKind};
use super::{EdgeKind, Node, TrainingDag};
use petgraph::visit::{EdgeIndexable, NodeIndexable};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Interned names (tag keys, streams) per kind can never exceed their `u16` ids.
pub const MAX_NAMES_HARD: u64 = u16::MAX as u64;

/// The longest name (split dimension, stream) a strategy may give, in bytes.
pub const MAX_NAME_BYTES: usize = 64;

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
    /// Bytes the DAG and one call's temporaries may take together
    /// (`sandbox.max_host_bytes`).
    pub max_bytes: u64,
}

/// The budget in force and the work spent against it. Interior mutability:
/// read-only primitives (`select`) charge too (an atomic, so a DAG can be
/// read from several threads, as the compiler does).
#[derive(Debug, Default)]
pub(crate) struct Meter {
    budget: Option<DagBudget>,
    used: AtomicU64,
    /// Temporaries charged since the current call began.
    temp: AtomicU64,
    /// The widest device group a directive named (node device lists, and
    /// a communication node's peers and groups, grow with it).
    widest: AtomicU32,
}

impl Clone for Meter {
    fn clone(&self) -> Self {
        Meter {
            budget: self.budget.clone(),
            used: AtomicU64::new(self.used.load(Ordering::Relaxed)),
            temp: AtomicU64::new(self.temp.load(Ordering::Relaxed)),
            widest: AtomicU32::new(self.widest.load(Ordering::Relaxed)),
        }
    }
}

/// The estimate's per-item costs, in bytes. Each is an upper bound of what
/// the item takes in the structures it lives in, measured with a counting
/// allocator on the bundled strategies' DAGs (`cargo bench -p piper-e2e
/// --bench plugin` prints estimate and measurement side by side).
mod cost {
    use super::{EdgeKind, Node};
    /// A node's slot in the graph: the node and its two edge-list heads.
    pub const NODE_SLOT: u64 = std::mem::size_of::<Option<Node>>() as u64 + 8;
    /// An edge's slot: its kind, its ends and its two next-edge links.
    pub const EDGE_SLOT: u64 = std::mem::size_of::<Option<EdgeKind>>() as u64 + 16;
    /// A node's heap besides tags and devices: allocation headers, a
    /// communication node's segment list.
    pub const NODE_FIXED: u64 = 96;
    /// One `(key, index)` tag of a node, with room to grow.
    pub const TAG: u64 = 16;
    /// One device of a node's group: its device list, and a communication
    /// node's peers and groups.
    pub const DEVICE: u64 = 16;
    /// One filter-index entry: a key in a hash map with its list, as the
    /// map grows.
    pub const INDEX_ENTRY: u64 = 64;
    /// The acyclicity snapshot `order` keeps, per node and per edge.
    pub const TOPO_NODE: u64 = 32;
    pub const TOPO_EDGE: u64 = 24;
}

/// Tag keys whose pairs the filter index lists (the first interned: the
/// model's annotations and the first split dimensions); a node's pairs
/// beyond them are found through its single-tag lists, so the index grows
/// linearly, not quadratically, with the tags a node carries.
pub(crate) const PAIR_KEYS: u16 = 8;

/// Temporaries of a derived-node rebuild per node and edge of the DAG.
pub(crate) const REBUILD_BYTES: u64 = 32;

/// `12.3 MiB`-style sizes for budget messages.
fn mib(b: u64) -> String {
    super::human_bytes(b)
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
            temp: AtomicU64::new(0),
            widest: AtomicU32::new(self.meter.widest.load(Ordering::Relaxed)),
        };
    }

    /// A plugin's next call begins: the last one's temporaries are gone.
    pub fn begin_call(&self) {
        self.meter.temp.store(0, Ordering::Relaxed);
    }

    /// Record that a directive names a group of `n` devices.
    pub(crate) fn note_group(&self, n: usize) {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.meter.widest.fetch_max(n, Ordering::Relaxed);
    }

    /// Estimated bytes the DAG holds (see the module docs).
    pub fn held_bytes(&self) -> u64 {
        self.bytes_with(0, 0, 0)
    }

    /// Estimated bytes with `add_nodes`, `add_edges` and `add_keys` (tag
    /// keys) more than now.
    fn bytes_with(&self, add_nodes: u64, add_edges: u64, add_keys: u64) -> u64 {
        use cost::*;
        let nodes = (self.graph.node_bound() as u64).saturating_add(add_nodes);
        let edges = (self.graph.edge_bound() as u64).saturating_add(add_edges);
        let keys = (self.tag_names.len() as u64).saturating_add(add_keys);
        let paired = keys.min(PAIR_KEYS as u64);
        let entries = 1 + keys + paired * paired.saturating_sub(1) / 2;
        let group = u64::from(self.meter.widest.load(Ordering::Relaxed).max(1));
        let per_node = NODE_SLOT
            + NODE_FIXED
            + TOPO_NODE
            + TAG.saturating_mul(keys)
            + DEVICE.saturating_mul(group)
            + INDEX_ENTRY.saturating_mul(entries);
        let per_edge = EDGE_SLOT + TOPO_EDGE;
        nodes
            .saturating_mul(per_node)
            .saturating_add(edges.saturating_mul(per_edge))
    }

    /// Refuse, before making them, `temp` bytes of temporaries for this
    /// call on top of a DAG grown by `add_nodes`, `add_edges` and
    /// `add_keys`; charge the temporaries when they fit.
    pub(crate) fn check_bytes(
        &self,
        call: &str,
        add_nodes: u64,
        add_edges: u64,
        add_keys: u64,
        temp: u64,
    ) -> Result<(), DagError> {
        let Some(b) = &self.meter.budget else {
            return Ok(());
        };
        let held = self.bytes_with(add_nodes, add_edges, add_keys);
        let temps = self.meter.temp.load(Ordering::Relaxed).saturating_add(temp);
        if held.saturating_add(temps) > b.max_bytes {
            let grown = if add_nodes + add_edges + add_keys > 0 {
                format!(
                    "the DAG would hold about {} ({} nodes, {} edges)",
                    mib(held),
                    fmt_big((self.graph.node_bound() as u64).saturating_add(add_nodes)),
                    fmt_big((self.graph.edge_bound() as u64).saturating_add(add_edges))
                )
            } else {
                format!("the DAG holds about {}", mib(held))
            };
            return Err(limit(
                call,
                "sandbox.max_host_bytes",
                b.max_bytes,
                format!("{grown} and the call's temporaries {}", mib(temps)),
            ));
        }
        self.meter.temp.store(temps, Ordering::Relaxed);
        Ok(())
    }

    /// Charge `bytes` of temporaries for this call, or refuse before
    /// making them.
    pub(crate) fn charge_bytes(&self, call: &str, bytes: u64) -> Result<(), DagError> {
        self.check_bytes(call, 0, 0, 0, bytes)
    }

    /// [`charge_bytes`](Self::charge_bytes) for the plugin host's own
    /// temporaries (query results it converts, arguments it copies).
    pub fn charge_bytes_public(&self, call: &str, bytes: u64) -> Result<(), DagError> {
        self.charge_bytes(call, bytes)
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

    /// Refuse a change that would leave more nodes or edges than allowed,
    /// or a DAG over `sandbox.max_host_bytes`.
    pub(crate) fn check_growth(
        &self,
        call: &str,
        add_nodes: u64,
        add_edges: u64,
    ) -> Result<(), DagError> {
        self.check_growth_keys(call, add_nodes, add_edges, 0)
    }

    /// [`check_growth`](Self::check_growth) for a change that also interns
    /// `add_keys` new tag keys carried by nodes.
    pub(crate) fn check_growth_keys(
        &self,
        call: &str,
        add_nodes: u64,
        add_edges: u64,
        add_keys: u64,
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
        self.check_bytes(call, add_nodes, add_edges, add_keys, 0)
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
        // A name is a label, not a payload: a plan print or an error
        // carrying it stays small.
        if let Some(n) = tags
            .iter()
            .chain(streams)
            .find(|n| n.len() > MAX_NAME_BYTES)
        {
            return Err(limit(
                call,
                "name length",
                MAX_NAME_BYTES as u64,
                format!("a name of {} bytes", n.len()),
            ));
        }
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
            let (nodes, edges) = (
                self.graph.node_bound() as u64,
                self.graph.edge_bound() as u64,
            );
            self.charge(call, nodes + edges)?;
            // The rebuild's maps and lists, over every node and edge.
            self.charge_bytes(call, (nodes + edges).saturating_mul(REBUILD_BYTES))?;
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
