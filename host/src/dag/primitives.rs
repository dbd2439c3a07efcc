//! Primitives: the small API for strategies no directive foresaw — query nodes
//! by filter, read a node and its neighbours, tag extents, the cluster, add a
//! temporal edge, set streams and priorities. Like directives, each checks its
//! arguments and leaves the DAG unchanged on error.

use super::error::{DagError, DagErrorKind};
use super::filter::{Filter, Label, TagMatch, PASS_VALUES};
use super::{EdgeKind, NodeId, NodeKind, TagKey, TrainingDag};
use foldhash::HashMap;
use serde::Serialize;
use std::collections::BTreeMap;

/// Cost hints of one node as one device runs it (its share of the batch).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct NodeCost {
    pub flops: f64,
    pub param_bytes: u64,
    pub act_in_bytes: u64,
    pub act_out_bytes: u64,
    pub saved_bytes: u64,
    /// Bytes a communication node moves per device.
    pub comm_bytes: u64,
    /// Bytes a context-parallel compute pass sends for its attention's
    /// exchanges (the all-gathers of q/k/v and the reduce-scatter of
    /// their gradients), per device.
    #[serde(skip_serializing_if = "is_zero")]
    pub cp_bytes: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// What a strategy can read about a node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeInfo {
    pub id: NodeId,
    /// `F`, `B`, `BI`, `BW`, `update`, `send`, … (the `PASS` value).
    pub op: String,
    pub tags: BTreeMap<String, u32>,
    pub devices: Vec<u32>,
    pub stream: String,
    pub priority: i32,
    /// Segments it computes or moves tensors of.
    pub segments: Vec<u32>,
    pub cost: NodeCost,
}

/// One edge seen from a node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Neighbour {
    pub node: NodeId,
    /// What the edge carries (a tensor, an order, a send to its receive).
    pub edge: EdgeKind,
}

/// Node lists by tag value and by op label, for fast filter evaluation.
///
/// Built at the first query, then kept: every added node, tag and label
/// change is added to it, and a sync of derived nodes drops the derived
/// nodes it removes ([`Index::forget`]) before adding the new ones. Nothing
/// else is removed: a removed or changed node may linger in a list, so
/// candidates are always re-checked against the filter (and deduplicated).
/// Debug builds check at each sync that it lists every node a fresh build
/// would. Keys are packed integers and a list of one node is held inline:
/// most keys name one node (`F`, PP=3, MB=7).
#[derive(Clone, Debug, Default)]
pub(crate) struct Index {
    /// Per label: every node.
    by_label: [Vec<NodeId>; PASS_VALUES.len()],
    /// (label, tag, index)
    by_label_tag: HashMap<u64, Ids>,
    /// Nodes by label and two exact tags (`F`, PP=3, MB=7): the usual
    /// strategy filter hits a list of one.
    by_label_pair: HashMap<u128, Ids>,
}

/// A node list, one id inline.
#[derive(Clone, Debug)]
enum Ids {
    One(NodeId),
    Many(Vec<NodeId>),
}

impl Ids {
    fn push(&mut self, id: NodeId) {
        match self {
            Ids::One(first) => *self = Ids::Many(vec![*first, id]),
            Ids::Many(v) => v.push(id),
        }
    }
    fn as_slice(&self) -> &[NodeId] {
        match self {
            Ids::One(id) => std::slice::from_ref(id),
            Ids::Many(v) => v,
        }
    }
}

fn add_to<K: std::hash::Hash + Eq>(map: &mut HashMap<K, Ids>, key: K, id: NodeId) {
    match map.entry(key) {
        std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().push(id),
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(Ids::One(id));
        }
    }
}

/// Bytes of one node id in a list a call makes.
pub(crate) const ID_BYTES: u64 = std::mem::size_of::<NodeId>() as u64;

/// Does the index list pairs with this key ([`super::budget::PAIR_KEYS`])?
fn paired(k: TagKey) -> bool {
    k.0 < super::budget::PAIR_KEYS
}

fn tag_key(k: TagKey, v: u32) -> u64 {
    (k.0 as u64) << 32 | v as u64
}

fn label_tag_key(label: u8, k: TagKey, v: u32) -> u64 {
    (label as u64) << 48 | tag_key(k, v)
}

fn pair_key(label: u8, (k, v): (TagKey, u32), (k2, v2): (TagKey, u32)) -> u128 {
    (label_tag_key(label, k, v) as u128) << 64 | tag_key(k2, v2) as u128
}

/// A node's label as its index in [`PASS_VALUES`], from its kind.
pub(crate) fn label_of(kind: &NodeKind) -> u8 {
    Label::of(kind) as u8
}

impl Index {
    pub(crate) fn build(dag: &TrainingDag) -> Self {
        let mut ix = Index::default();
        for id in dag.node_ids() {
            ix.add(id, &dag.graph[id.ix()]);
        }
        ix
    }
    pub(crate) fn add(&mut self, id: NodeId, n: &super::Node) {
        let label = label_of(&n.kind);
        for (i, &(k, v)) in n.tags.0.iter().enumerate() {
            add_to(&mut self.by_label_tag, label_tag_key(label, k, v), id);
            for &second in n.tags.0[i + 1..].iter().filter(|t| paired(t.0)) {
                if paired(k) {
                    add_to(&mut self.by_label_pair, pair_key(label, (k, v), second), id);
                }
            }
        }
        self.by_label[label as usize].push(id);
    }
    /// Drop the nodes `gone` marks (by node index) from every list.
    pub(crate) fn forget(&mut self, gone: &[bool]) {
        let keep = |id: &NodeId| !gone.get(id.ix().index()).copied().unwrap_or(false);
        for list in &mut self.by_label {
            list.retain(keep);
        }
        let kept = |ids: &mut Ids| match ids {
            Ids::One(id) => keep(id),
            Ids::Many(v) => {
                v.retain(keep);
                if let [one] = v[..] {
                    *ids = Ids::One(one);
                }
                !matches!(ids, Ids::Many(v) if v.is_empty())
            }
        };
        self.by_label_tag.retain(|_, ids| kept(ids));
        self.by_label_pair.retain(|_, ids| kept(ids));
    }

    /// The (key, node) entries of `fresh` this index lacks (debug checks:
    /// a kept index may list more, never less).
    #[cfg(debug_assertions)]
    pub(crate) fn missing_from(&self, fresh: &Index) -> Vec<String> {
        let mut out = Vec::new();
        // Entries of `want` not in `have`, each list sorted once.
        let mut lack = |what: String, have: &[NodeId], want: &[NodeId]| {
            let mut have = have.to_vec();
            have.sort_unstable();
            for id in want {
                if have.binary_search(id).is_err() {
                    out.push(format!("{what} node {}", id.0));
                }
            }
        };
        for (l, list) in fresh.by_label.iter().enumerate() {
            lack(format!("label {}", PASS_VALUES[l]), &self.by_label[l], list);
        }
        for (k, ids) in &fresh.by_label_tag {
            let have = self.by_label_tag.get(k).map_or(&[][..], Ids::as_slice);
            lack(format!("label-tag key {k:#x}"), have, ids.as_slice());
        }
        for (k, ids) in &fresh.by_label_pair {
            let have = self.by_label_pair.get(k).map_or(&[][..], Ids::as_slice);
            lack(format!("pair key {k:#x}"), have, ids.as_slice());
        }
        out
    }

    pub(crate) fn add_tag(&mut self, id: NodeId, n: &super::Node, k: TagKey, v: u32) {
        let label = label_of(&n.kind);
        add_to(&mut self.by_label_tag, label_tag_key(label, k, v), id);
        if !paired(k) {
            return;
        }
        for &(k2, v2) in n.tags.0.iter().filter(|t| paired(t.0)) {
            if k2 < k {
                add_to(
                    &mut self.by_label_pair,
                    pair_key(label, (k2, v2), (k, v)),
                    id,
                );
            } else if k2 > k {
                add_to(
                    &mut self.by_label_pair,
                    pair_key(label, (k, v), (k2, v2)),
                    id,
                );
            }
        }
    }
}

/// A filter with names resolved to keys.
pub(crate) struct Resolved {
    tags: Vec<(TagKey, TagMatch)>,
    /// The pass as its index in [`PASS_VALUES`].
    label: Option<u8>,
}

impl TrainingDag {
    /// Resolve a filter's names; unknown tags and passes are errors.
    pub(crate) fn resolve(&self, f: &Filter, call: &str) -> Result<Resolved, DagError> {
        // Each key is looked up among the interned names.
        self.charge(
            call,
            (f.tags.len() as u64).saturating_mul(self.tag_names.len() as u64 + 1),
        )?;
        let mut tags = Vec::new();
        for (k, m) in &f.tags {
            let key = self.find_tag(k);
            match key {
                Some(key) => tags.push((key, *m)),
                None => {
                    return Err(DagError::new(
                        call,
                        DagErrorKind::UnknownTag {
                            tag: super::error::short(k),
                            known: self.tag_names().into_iter().take(32).collect(),
                        },
                    ))
                }
            }
        }
        let label = f.pass.map(|l| l as u8);
        Ok(Resolved { tags, label })
    }

    pub(crate) fn matches(&self, id: NodeId, r: &Resolved) -> bool {
        let n = &self.graph[id.ix()];
        if r.label.is_some_and(|l| l != label_of(&n.kind)) {
            return false;
        }
        r.tags.iter().all(|(k, m)| match (n.tags.get(*k), m) {
            (None, _) => false,
            (Some(_), TagMatch::Any) => true,
            (Some(v), TagMatch::Index(i)) => v == *i,
        })
    }

    /// Ids of the nodes a resolved filter matches, in id order; the scan is
    /// charged to the host budget before it runs.
    pub(crate) fn select_resolved(
        &self,
        r: &Resolved,
        call: &str,
    ) -> Result<Vec<NodeId>, DagError> {
        let index = self.index.get_or_init(|| Index::build(self));
        // Scan the smallest candidate list among the exact constraints:
        // a label and two exact tags first (the usual strategy filter, a
        // list of one), then single tags, then the label alone.
        let mut best: Option<&[NodeId]> = None;
        fn consider<'a>(best: &mut Option<&'a [NodeId]>, list: Option<&'a [NodeId]>) {
            let list = list.unwrap_or(&[]);
            if best.is_none_or(|b| list.len() < b.len()) {
                *best = Some(list);
            }
        }
        let label = r.label;
        let unlabelled: Vec<NodeId>;
        let mut exact: Vec<(TagKey, u32)> = r
            .tags
            .iter()
            .filter_map(|(k, m)| match m {
                TagMatch::Index(i) => Some((*k, *i)),
                TagMatch::Any => None,
            })
            .collect();
        exact.sort_unstable();
        'pick: {
            if let Some(l) = label {
                // Pairs of keys the index lists pairs of.
                for (i, &first) in exact.iter().enumerate().filter(|(_, t)| paired(t.0)) {
                    for &second in exact[i + 1..].iter().filter(|t| paired(t.0)) {
                        let list = index.by_label_pair.get(&pair_key(l, first, second));
                        consider(&mut best, list.map(Ids::as_slice));
                        if best.is_some_and(|b| b.len() <= 1) {
                            break 'pick;
                        }
                    }
                }
            }
            match label {
                Some(l) => {
                    for &(k, i) in &exact {
                        let list = index.by_label_tag.get(&label_tag_key(l, k, i));
                        consider(&mut best, list.map(Ids::as_slice));
                    }
                    consider(&mut best, Some(&index.by_label[l as usize]));
                }
                // No label: a tag's nodes are its lists under every label
                // (the rarer query; every node added would pay for a list
                // without the label).
                None => {
                    let lists = |k, i| {
                        (0..PASS_VALUES.len() as u8)
                            .filter_map(move |l| index.by_label_tag.get(&label_tag_key(l, k, i)))
                            .map(Ids::as_slice)
                    };
                    let size =
                        |&&(k, i): &&(TagKey, u32)| lists(k, i).map(|l| l.len()).sum::<usize>();
                    if let Some(t) = exact.iter().min_by_key(size) {
                        let ids = size(&t) as u64;
                        self.charge_bytes(call, ids.saturating_mul(ID_BYTES))?;
                        unlabelled = lists(t.0, t.1).flatten().copied().collect();
                        best = Some(&unlabelled);
                    }
                }
            }
        }
        let scan = best.map_or(self.node_count(), |b| b.len()) as u64;
        self.charge(call, scan.saturating_mul(r.tags.len() as u64 + 1))?;
        // The matches: at most every candidate.
        self.charge_bytes(call, scan.saturating_mul(ID_BYTES))?;
        let mut ids: Vec<NodeId> = match best {
            Some(list) => list
                .iter()
                .copied()
                .filter(|id| self.node_ref(*id).is_some() && self.matches(*id, r))
                .collect(),
            None => self.node_ids().filter(|id| self.matches(*id, r)).collect(),
        };
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    /// Ids of the nodes a filter matches, in id order; an error if none.
    pub(crate) fn select(&self, f: &Filter, call: &str) -> Result<Vec<NodeId>, DagError> {
        let r = self.resolve(f, call)?;
        let ids = self.select_resolved(&r, call)?;
        if ids.is_empty() {
            return Err(DagError::new(
                call,
                DagErrorKind::NoMatch {
                    filter: f.to_string(),
                },
            ));
        }
        Ok(ids)
    }

    /// Nodes matching a filter (an error if the filter names an unknown tag
    /// or matches nothing).
    pub fn query(&mut self, f: &Filter) -> Result<Vec<NodeInfo>, DagError> {
        let ids = self.query_ids(f)?;
        self.charge_bytes(&format!("query({f})"), self.infos_bytes(&ids) / 2)?;
        Ok(self.infos(&ids))
    }

    /// Ids only (cheaper than [`query`](Self::query)).
    pub fn query_ids(&mut self, f: &Filter) -> Result<Vec<NodeId>, DagError> {
        let call = format!("query({f})");
        self.sync_for(&call)?;
        self.select(f, &call)
    }

    /// What a strategy reads about these nodes (ids from
    /// [`query_ids`](Self::query_ids)).
    pub fn infos(&self, ids: &[NodeId]) -> Vec<NodeInfo> {
        ids.iter().map(|id| self.info(*id)).collect()
    }

    /// One node.
    pub fn node(&mut self, id: NodeId) -> Result<NodeInfo, DagError> {
        let call = format!("node({})", id.0);
        self.sync_for(&call)?;
        self.check_id(id, &call)?;
        Ok(self.info(id))
    }

    pub(crate) fn check_id(&self, id: NodeId, call: &str) -> Result<(), DagError> {
        if self.node_ref(id).is_none() {
            return Err(DagError::new(call, DagErrorKind::UnknownNode { id: id.0 }));
        }
        Ok(())
    }

    /// Predecessors and successors of a node.
    pub fn neighbours(&mut self, id: NodeId) -> Result<(Vec<Neighbour>, Vec<Neighbour>), DagError> {
        let call = format!("neighbours({})", id.0);
        self.sync_for(&call)?;
        self.check_id(id, &call)?;
        let degree = self.preds(id).count() + self.succs(id).count();
        self.charge(&call, degree as u64)?;
        let mut preds: Vec<Neighbour> = self
            .preds(id)
            .map(|(n, edge)| Neighbour { node: n, edge })
            .collect();
        let mut succs: Vec<Neighbour> = self
            .succs(id)
            .map(|(n, edge)| Neighbour { node: n, edge })
            .collect();
        preds.sort_by_key(|n| n.node);
        succs.sort_by_key(|n| n.node);
        Ok((preds, succs))
    }

    /// For each tag, how many indices it spans (max index + 1).
    pub fn tag_extents(&self) -> BTreeMap<String, u32> {
        let mut max: Vec<Option<u32>> = vec![None; self.tag_names.len()];
        for n in self.graph.node_weights() {
            for (k, v) in &n.tags.0 {
                let e = &mut max[k.0 as usize];
                *e = Some(e.map_or(*v, |m| m.max(*v)));
            }
        }
        max.iter()
            .enumerate()
            .filter_map(|(k, m)| {
                m.map(|m| {
                    let key = self.tag_name(super::TagKey(k as u16)).to_string();
                    (key, m.saturating_add(1))
                })
            })
            .collect()
    }

    /// [`tag_extents`](Self::tag_extents), charged to the host budget.
    pub fn tag_extents_charged(&self) -> Result<BTreeMap<String, u32>, DagError> {
        self.charge("tag-extents()", self.node_count() as u64)?;
        Ok(self.tag_extents())
    }

    /// Add an ordering edge `from` → `to`. Both must share a device (or both
    /// be unplaced) and the edge must not close a cycle.
    pub fn add_temporal_edge(&mut self, from: NodeId, to: NodeId) -> Result<(), DagError> {
        let call = format!("add-temporal-edge({}, {})", from.0, to.0);
        self.sync_for(&call)?;
        self.check_id(from, &call)?;
        self.check_id(to, &call)?;
        let (a, b) = (self.devices_of(from), self.devices_of(to));
        let shares = a.iter().any(|d| b.contains(d)) || (a.is_empty() && b.is_empty());
        if !shares {
            return Err(DagError::new(
                &call,
                DagErrorKind::CrossDevice {
                    a: self.label(from),
                    a_devices: a.iter().map(|d| d.0).collect(),
                    b: self.label(to),
                    b_devices: b.iter().map(|d| d.0).collect(),
                },
            ));
        }
        // The proof may visit every node and edge (twice, when it takes a
        // new snapshot); it is charged what it visits. One more edge.
        self.fits(
            &call,
            2 * (self.node_count() + self.edge_count()) as u64 + 2,
        )?;
        self.check_growth(&call, 0, 1)?;
        // Against the kept topological order: only the region the edge
        // reorders is visited (a full pass when there is none yet).
        let edge = [(from.ix().index(), to.ix().index())];
        let pos = match self.prove_acyclic(&edge, 0) {
            Ok(pos) => pos,
            Err(cycle) => {
                // A refused edge is charged as a full search.
                self.charge(&call, (self.node_count() + self.edge_count()) as u64)?;
                return Err(DagError::new(
                    &call,
                    DagErrorKind::Cycle {
                        cycle: cycle
                            .into_iter()
                            .map(|n| self.label(NodeId(n as u32)))
                            .collect(),
                    },
                ));
            }
        };
        self.charge(&call, pos.work)?;
        self.graph.add_edge(from.ix(), to.ix(), EdgeKind::Temporal);
        self.keep_edges(&edge, &[], pos);
        for id in [from, to] {
            let n = &mut self.graph[id.ix()];
            n.tweaked |= n.derived.is_some();
        }
        Ok(())
    }

    /// Put the matched nodes on a logical stream. Returns how many changed.
    pub fn set_stream(&mut self, f: &Filter, stream: &str) -> Result<usize, DagError> {
        let call = format!("set-stream({f}, {})", super::error::quote(stream));
        if stream.trim().is_empty() {
            return Err(DagError::new(
                call,
                DagErrorKind::InvalidArgument("the stream name is empty".into()),
            ));
        }
        self.check_names(&call, &[], &[stream])?;
        self.sync_for(&call)?;
        let ids = self.select(f, &call)?;
        let s = self.stream_id(stream);
        for id in &ids {
            let n = &mut self.graph[id.ix()];
            n.stream = s;
            n.tweaked |= n.derived.is_some();
        }
        Ok(ids.len())
    }

    /// Set the scheduling priority of the matched nodes (higher runs first
    /// among nodes ready together). Returns how many changed.
    pub fn set_priority(&mut self, f: &Filter, priority: i32) -> Result<usize, DagError> {
        let call = format!("set-priority({f}, {priority})");
        self.sync_for(&call)?;
        let ids = self.select(f, &call)?;
        for id in &ids {
            let n = &mut self.graph[id.ix()];
            n.priority = priority;
            n.tweaked |= n.derived.is_some();
        }
        Ok(ids.len())
    }

    /// Bytes of the block norms' gradients a sequence-parallel weight pass
    /// sums over its group (0 otherwise).
    fn sp_norm_bytes(&self, n: &super::Node, seg: &crate::model::Segment) -> u64 {
        if !n.tensor_parallel.is_some_and(|t| t.sequence) {
            return 0;
        }
        let norms = block_halves(&seg.parts);
        let per_norm = match self.model.family {
            crate::model::Family::Gpt2 => 2,
            crate::model::Family::Llama => 1,
        };
        norms * per_norm * u64::from(self.model.d_model) * self.model.precision.grad_bytes()
    }

    /// A compute node's shapes as one of its devices runs it, for the
    /// simulator's shape-aware costs (`None` for other nodes).
    pub fn shape(&self, id: NodeId) -> Option<crate::model::cost::OpShape> {
        use crate::model::cost::{op_shape, Placement, Work};
        let n = &self.graph[id.ix()];
        let NodeKind::Compute {
            pass,
            segment,
            phase,
        } = &n.kind
        else {
            return None;
        };
        let seg = &self.segments()[*segment as usize];
        let work = match pass {
            super::Pass::F => Work::Forward,
            super::Pass::R if self.reads_kept(id) => Work::Core,
            super::Pass::R => Work::Forward,
            super::Pass::B => Work::Backward,
            super::Pass::BI => Work::InputGrads,
            super::Pass::BW => Work::WeightGrads,
        };
        let m = &self.model;
        let experts_spread = n
            .replica
            .is_some_and(|r| self.specs[r as usize].expert_parallel.is_some());
        let at = Placement {
            rows: m.batch_size as f64 * m.seq_len as f64 / self.batch_share_div(id) as f64,
            tp: f64::from(n.tp_degree()),
            sp: n.tensor_parallel.is_some_and(|t| t.sequence),
            ep: if experts_spread {
                n.devices.len() as f64
            } else {
                1.0
            },
        };
        let mut s = op_shape(m, &seg.parts, work, at);
        // Sequence parallelism's exchanges inside the blocks (the sums of
        // `comm_bytes`, one activation of the rows each) run beside the
        // products.
        if at.sp && at.tp > 1.0 && matches!(work, Work::Forward | Work::Backward | Work::InputGrads)
        {
            s.tp_overlap_bytes = block_halves(&seg.parts) as f64
                * at.rows
                * f64::from(m.d_model)
                * m.precision.act_bytes() as f64;
        }
        // A phase of a split expert pass runs its share of the segment.
        if let (Some(p), Some(x)) = (phase, self.expert_phases) {
            let share = x.flop_share[p.index() as usize];
            s.gemms.iter_mut().for_each(|g| g.count *= share);
            s.stream_bytes *= share;
            s.kernels *= share;
            s.eager_stream_bytes *= share;
            s.eager_kernels *= share;
        }
        Some(s)
    }

    /// Cost hints of a node as one of its devices runs it.
    pub fn cost(&self, id: NodeId) -> NodeCost {
        let n = &self.graph[id.ix()];
        let prec = self.model.precision;
        let div = self.batch_share_div(id);
        match &n.kind {
            NodeKind::Compute {
                pass,
                segment,
                phase,
            } => {
                let seg = &self.segments()[*segment as usize];
                let c = &seg.cost;
                let mut flops = match pass {
                    super::Pass::F => c.fwd_flops,
                    // A selective recompute (fed what its forward kept)
                    // reruns the attention core; a full one, the forward.
                    super::Pass::R if self.reads_kept(id) => c.recompute_flops,
                    super::Pass::R => c.fwd_flops,
                    super::Pass::B => c.bwd_flops,
                    super::Pass::BW => c.bwd_weight_flops,
                    super::Pass::BI => c.bwd_flops - c.bwd_weight_flops,
                };
                // A phase of a split expert pass does its share.
                if let (Some(p), Some(x)) = (phase, self.expert_phases) {
                    flops *= x.flop_share[p.index() as usize];
                }
                // Tensor parallelism splits a segment's FLOPs over its group
                // (layernorms and the embedding, replicated, are small).
                let tp = n.tp_degree() as f64;
                let experts_split = seg.expert_block.is_some() && tp > 1.0;
                // Context parallelism: each attention half sends its
                // rows' packed q/k/v `cp − 1` times in forward (round the
                // ring, or to each member of the all-gather); in backward
                // the all-gather again and the reduce-scatter of the
                // gradients (as much), or round the ring the block again
                // and its gradients once more (back to its holder).
                let cp = u64::from(n.cp_degree());
                let ring = n
                    .context_parallel
                    .is_some_and(|c| c.exchange == super::KvExchange::Ring);
                // (The gradients travel in fp32.)
                let (blocks, grad_blocks) = match pass {
                    _ if cp < 2 => (0, 0),
                    super::Pass::BW => (0, 0),
                    super::Pass::F | super::Pass::R => (cp - 1, 0),
                    super::Pass::B | super::Pass::BI if ring => (cp - 1, cp),
                    super::Pass::B | super::Pass::BI => (cp - 1, cp - 1),
                };
                let qkv_elems = {
                    let m = &self.model;
                    let attn = (seg.parts.iter())
                        .filter(|p| {
                            matches!(
                                p,
                                crate::model::Part::Block(_) | crate::model::Part::Attention(_)
                            )
                        })
                        .count() as u64;
                    // The packed q/k/v: every query head's (grouped keys
                    // and values repeated), this device's heads of them.
                    let width = 3 * u64::from(m.arch().q_width());
                    attn * m.batch_size as u64 * m.seq_len as u64 * width
                        / u64::from(n.tp_degree())
                        / div
                };
                // An expert layer's forward sums its sequences' balance
                // statistics over the group (an fp32 all-reduce of two
                // values per expert and sequence held; a selective
                // recompute keeps them).
                let routes = match pass {
                    super::Pass::F => true,
                    super::Pass::R => !self.reads_kept(id),
                    _ => false,
                };
                let stats = match (&self.model.moe, phase) {
                    (Some(moe), None | Some(super::ExpertPhase::Dispatch))
                        if routes && cp > 1 && seg.expert_block.is_some() =>
                    {
                        let seqs = self.model.batch_size as u64 * cp / div / tp as u64;
                        let values = seqs * 2 * u64::from(moe.experts);
                        values * crate::model::F32_BYTES * 2 * (cp - 1) / cp
                    }
                    _ => 0,
                };
                let cp_bytes = stats
                    + qkv_elems
                        * (blocks * prec.act_bytes() + grad_blocks * crate::model::F32_BYTES);
                NodeCost {
                    cp_bytes,
                    flops: flops / div as f64 / tp,
                    param_bytes: (seg.param_elems + seg.tied_elems) * prec.act_bytes(),
                    act_in_bytes: c.act_in_bytes / div,
                    act_out_bytes: c.act_out_bytes / div,
                    // Of the saved tensors about a quarter (the block's
                    // inputs, layernorm outputs, residual) stay whole under
                    // tensor parallelism; the rest is split (as compile
                    // counts its buffers).
                    // (Experts on a tensor-parallel mesh split the
                    // sequences instead: all of it.)
                    saved_bytes: (c.saved_bytes as f64 / div as f64
                        * if experts_split {
                            1.0 / tp
                        } else {
                            0.25 + 0.75 / tp
                        }) as u64,
                    // An expert pass that exchanges inside its op (`shard`
                    // on `compute`): the rows of each of its two all-to-alls.
                    // A tensor-parallel pass: what its sums move (one
                    // activation per sum: two per dense block, one per MoE
                    // attention half, in forward and in backward).
                    // Experts on a tensor-parallel mesh: their share of
                    // the rows, and the all-gather of the shares.
                    comm_bytes: match (phase, self.expert_phases, n.replica) {
                        // Sequence parallelism sums the block norms'
                        // gradients in the weight pass (an all-reduce).
                        _ if *pass == super::Pass::BW => self.sp_norm_bytes(n, seg),
                        (_, Some(x), _) if experts_split => {
                            // Counted as `(g − 1)/g` of two exchanges over
                            // the mesh's `g` members (how an in-op exchange
                            // is read): the rows, and the all-gather in
                            // which each rank sends its share to the
                            // `tp − 1` others of its group.
                            let m = &self.model;
                            let act = m.batch_size as f64 * m.seq_len as f64 * m.d_model as f64;
                            let g = (n.devices.len() as f64).max(2.0);
                            let gather = act * prec.act_bytes() as f64 * (tp - 1.0) / tp * g
                                / (2.0 * (g - 1.0));
                            (x.routed_bytes / tp as u64 + gather.round() as u64) / div
                        }
                        _ if n.tensor_parallel.is_some() => {
                            let sums = block_halves(&seg.parts);
                            let m = &self.model;
                            let act = m.batch_size as u64 * m.seq_len as u64 * m.d_model as u64;
                            // Sequence parallelism: each run of blocks
                            // all-gathers the residual where it ends (half
                            // a sum), once each way; a fused backward sums
                            // the norms' gradients too.
                            let sp = n.tensor_parallel.is_some_and(|t| t.sequence);
                            let edges = if sp { block_runs(&seg.parts) } else { 0 };
                            let norms = match pass {
                                super::Pass::B => self.sp_norm_bytes(n, seg),
                                _ => 0,
                            };
                            (2 * sums + edges) * act * prec.act_bytes() / 2 / div + norms
                        }
                        (None, Some(x), Some(r))
                            if self.specs[r as usize].expert_parallel.is_some() =>
                        {
                            x.routed_bytes / div
                        }
                        _ => 0,
                    },
                }
            }
            NodeKind::Comm(c) => NodeCost {
                comm_bytes: if c.tensor.scales_with_batch() {
                    c.bytes / div
                } else {
                    c.bytes
                },
                ..NodeCost::default()
            },
            NodeKind::Update { segments } => NodeCost {
                param_bytes: segments
                    .iter()
                    .map(|s| self.segments()[*s as usize].param_elems * prec.master.bytes())
                    .sum(),
                ..NodeCost::default()
            },
            NodeKind::Marker => NodeCost::default(),
        }
    }

    /// What reading `ids` back as [`NodeInfo`]s, and converting those for a
    /// plugin, takes: each record, its tag names, devices and segments,
    /// twice (the host's records and the converted ones).
    pub fn infos_bytes(&self, ids: &[NodeId]) -> u64 {
        const RECORD: u64 = std::mem::size_of::<NodeInfo>() as u64 + 64;
        const TAG: u64 = 64;
        ids.iter()
            .filter_map(|id| self.node_ref(*id))
            .map(|n| {
                let segments = match &n.kind {
                    NodeKind::Update { segments } => segments.len(),
                    NodeKind::Comm(c) => c.segments.len(),
                    _ => 1,
                } as u64;
                RECORD + TAG * n.tags.0.len() as u64 + 4 * (n.devices.len() as u64 + segments)
            })
            .fold(0u64, u64::saturating_add)
            .saturating_mul(2)
    }

    pub(crate) fn info(&self, id: NodeId) -> NodeInfo {
        let n = &self.graph[id.ix()];
        let segments = match &n.kind {
            NodeKind::Compute { segment, .. } => vec![*segment],
            NodeKind::Update { segments } => segments.clone(),
            NodeKind::Comm(c) => c.segments.clone(),
            NodeKind::Marker => vec![],
        };
        NodeInfo {
            id,
            op: n.kind.label().to_string(),
            tags: self.tag_map(&n.tags),
            devices: n.devices.iter().map(|d| d.0).collect(),
            stream: self.stream_name(n.stream).to_string(),
            priority: n.priority,
            segments,
            cost: self.cost(id),
        }
    }
}

/// Block halves among `parts` (a dense block has two, a MoE layer's
/// attention half one): each sums once per pass under tensor parallelism,
/// each has a norm.
fn block_halves(parts: &[crate::model::Part]) -> u64 {
    (parts.iter())
        .map(|p| match p {
            crate::model::Part::Block(_) => 2,
            crate::model::Part::Attention(_) => 1,
            _ => 0,
        })
        .sum()
}

/// Maximal runs of consecutive blocks (or attention halves) among `parts`:
/// where sequence parallelism gathers the residual back whole.
fn block_runs(parts: &[crate::model::Part]) -> u64 {
    let block = |p: &crate::model::Part| {
        matches!(
            p,
            crate::model::Part::Block(_) | crate::model::Part::Attention(_)
        )
    };
    (0..parts.len())
        .filter(|&i| block(&parts[i]) && (i + 1 == parts.len() || !block(&parts[i + 1])))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dag::{Comm, CommOp, CommPurpose, Pass, TensorKind};

    /// The index's label codes are the positions of the labels filters name.
    #[test]
    fn label_codes_are_the_pass_values_positions() {
        let comm = |op| {
            NodeKind::Comm(Comm {
                op,
                purpose: CommPurpose::Pipeline,
                tensor: TensorKind::Activation,
                bytes: 0,
                segments: Vec::new(),
                peers: Vec::new(),
                groups: Vec::new(),
                pair: None,
            })
        };
        let compute = |pass| NodeKind::Compute {
            pass,
            segment: 0,
            phase: None,
        };
        let kinds = [
            compute(Pass::F),
            compute(Pass::B),
            compute(Pass::BI),
            compute(Pass::BW),
            NodeKind::Update { segments: vec![0] },
            comm(CommOp::Send),
            comm(CommOp::Recv),
            comm(CommOp::AllReduce),
            comm(CommOp::ReduceScatter),
            comm(CommOp::AllGather),
            comm(CommOp::AllToAll),
            compute(Pass::R),
            NodeKind::Marker,
        ];
        assert_eq!(kinds.len(), PASS_VALUES.len());
        for k in &kinds {
            assert_eq!(PASS_VALUES[label_of(k) as usize], k.label());
            assert_eq!(k.label().parse::<Label>(), Ok(Label::of(k)));
        }
        for (i, v) in PASS_VALUES.iter().enumerate() {
            assert_eq!(v.parse::<Label>(), Ok(Label::ALL[i]));
        }
        assert!("G".parse::<Label>().unwrap_err().contains("is not one of"));
    }
}
