//! Derived nodes: the optimizer `update` nodes, the data-parallel / ZeRO
//! collectives and the tied-embedding gradient all-reduce. They follow from
//! the core nodes' placement and replication, so they are rebuilt (lazily,
//! before the next read or directive) after every `split`, `place` and
//! `replicate`.
//!
//! For each device group (and replication spec) there is one `update` node,
//! the optimizer step for the parameter bucket of the segments on that group.
//! Gradient collectives per ZeRO stage (`N` = group size):
//! - 0: all-reduce after the last microbatch, in buckets of `bucket-bytes`;
//! - 1: reduce-scatter after the last microbatch, sharded update, all-gather
//!   of the updated parameters;
//! - 2: reduce-scatter after every microbatch (gradients stay sharded),
//!   sharded update, all-gather of the updated parameters;
//! - 3: as 2, but no gather after the update: parameters stay sharded and are
//!   all-gathered before every `F` and `B`/`BI` use instead.
//!
//! A segment whose nodes run on several groups (DualPipe's second model
//! copy: the same stage on another device for half the microbatches) keeps a
//! parameter copy on each group; the copies' gradients are all-reduced
//! element-wise across the groups (`copy-grad`) and every copy applies the
//! same update, so the copies stay identical.
//!
//! When the embedding and the LM head (which share `wte`) sit on different
//! groups of equal size, each keeps a copy of `wte` and their gradients are
//! all-reduced pairwise (device `i` of one group with device `i` of the
//! other) before the data-parallel reduction, as Megatron does.

use super::{
    Comm, CommOp, CommPurpose, DeviceId, EdgeKind, Node, NodeId, NodeKind, ReplicaSpec, StreamId,
    Tags, TensorKind, TrainingDag, COMPUTE,
};
use crate::model::params::{Role, TpSplit};
use foldhash::{HashMap, HashMapExt};
use petgraph::visit::EdgeRef;
use petgraph::Direction;
use std::collections::BTreeMap;
use std::hash::Hash;

/// A strategy's changes to a derived node, carried over a rebuild.
struct Tweak {
    stream: StreamId,
    priority: i32,
    before: Vec<NodeId>,
    after: Vec<NodeId>,
}

/// A derived node's identity across rebuilds (within one process: a fixed
/// seed, so equal parts give equal keys).
fn key_of(parts: impl Hash) -> u64 {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x9e37_79b9_7f4a_7c15).hash_one(parts)
}

/// Where a segment's gradient comes from: the node and its split key (the
/// microbatch indices), `None` for a source that covers every microbatch.
type Sources = Vec<(Option<Vec<u32>>, NodeId)>;

/// What the rebuild's steps share: the strategy's tweaks of the dropped
/// derived nodes, each segment's placement and parameter copies, its
/// gradient sources (grown by the copy and tied all-reduces) and the nodes
/// that read its weights.
struct Rebuild {
    tweaks: HashMap<u64, Tweak>,
    placement: Vec<Placement>,
    /// Each segment's tensor-parallel degree (1: none).
    tp: Vec<u32>,
    copies: Vec<Vec<(Vec<DeviceId>, Option<u32>)>>,
    sources: Vec<Sources>,
    readers: Vec<Vec<NodeId>>,
}

/// A segment's device group and replication spec, when all its nodes agree.
pub(crate) type Placement = Option<(Vec<DeviceId>, Option<u32>)>;

impl TrainingDag {
    /// Rebuild derived nodes if a directive made them stale.
    pub(crate) fn sync(&mut self) {
        if self.dirty {
            self.rebuild_derived();
        }
    }

    /// Group and replication of each segment when all its compute nodes agree.
    pub(crate) fn segment_placement(&self) -> Vec<Placement> {
        // Per segment: unseen, the group all its nodes agree on so far
        // (`None`: unplaced), or disagreement. Borrowed until the end.
        type Agreed<'a> = Option<(&'a [DeviceId], Option<u32>)>;
        let mut out: Vec<Option<Agreed>> = vec![None; self.segments().len()];
        for n in self.graph.node_weights() {
            if let NodeKind::Compute { segment, .. } = n.kind {
                let this = (!n.devices.is_empty()).then_some((&n.devices[..], n.replica));
                let slot = &mut out[segment as usize];
                match slot {
                    None => *slot = Some(this),
                    Some(prev) if *prev != this => *prev = None,
                    _ => {}
                }
            }
        }
        out.into_iter()
            .map(|s| s.flatten().map(|(d, r)| (d.to_vec(), r)))
            .collect()
    }

    /// Per segment, the tensor-parallel degree of its compute nodes (1
    /// when none is split): its devices are meshes of groups that size.
    pub(crate) fn segment_tp(&self) -> Vec<u32> {
        let mut out = vec![1u32; self.segments().len()];
        for n in self.graph.node_weights() {
            if let NodeKind::Compute { segment, .. } = n.kind {
                let t = &mut out[segment as usize];
                *t = (*t).max(n.tp_degree());
            }
        }
        out
    }

    /// Every distinct (group, replication) a segment's compute nodes run on,
    /// sorted: one entry normally, one per parameter copy when duplicated.
    pub(crate) fn segment_copies(&self) -> Vec<Vec<(Vec<DeviceId>, Option<u32>)>> {
        let mut out: Vec<Vec<(&[DeviceId], Option<u32>)>> = vec![Vec::new(); self.segments().len()];
        for n in self.graph.node_weights() {
            if let NodeKind::Compute { segment, .. } = n.kind {
                if n.devices.is_empty() {
                    continue;
                }
                let this = (&n.devices[..], n.replica);
                let list = &mut out[segment as usize];
                if !list.contains(&this) {
                    list.push(this);
                }
            }
        }
        out.into_iter()
            .map(|l| {
                let mut l: Vec<(Vec<DeviceId>, Option<u32>)> =
                    l.into_iter().map(|(d, r)| (d.to_vec(), r)).collect();
                l.sort();
                l
            })
            .collect()
    }

    /// Copies of a segment that can be paired element-wise (equal group
    /// sizes, no device in common), or `None` when there is only one.
    pub(crate) fn paired_copies(
        copies: &[(Vec<DeviceId>, Option<u32>)],
    ) -> Option<Vec<Vec<DeviceId>>> {
        if copies.len() < 2 {
            return None;
        }
        let n = copies[0].0.len();
        let mut all: Vec<DeviceId> = copies.iter().flat_map(|c| c.0.clone()).collect();
        let total = all.len();
        all.sort_unstable();
        all.dedup();
        if copies.iter().any(|c| c.0.len() != n) || all.len() != total {
            return None;
        }
        Some(
            (0..n)
                .map(|i| copies.iter().map(|c| c.0[i]).collect())
                .collect(),
        )
    }

    /// Expert parameter elements of a segment (all its experts), and how
    /// many devices `shard` spread them over (1: not sharded).
    pub(crate) fn expert_elems(
        &self,
        seg: u32,
        placement: &[Option<(Vec<DeviceId>, Option<u32>)>],
    ) -> (u64, u64) {
        let all = self.expert_param_elems[seg as usize];
        if all == 0 {
            return (0, 1);
        }
        let spread = match &placement[seg as usize] {
            Some((devs, Some(r))) if self.specs[*r as usize].expert_parallel.is_some() => {
                devs.len().max(1) as u64
            }
            _ => 1,
        };
        (all, spread)
    }

    /// Parameter elements whose gradients the data-parallel sync reduces:
    /// those held, less this device's experts when `shard` spread them.
    pub(crate) fn synced_elems(
        &self,
        seg: u32,
        placement: &[Option<(Vec<DeviceId>, Option<u32>)>],
        tp: &[u32],
    ) -> u64 {
        match self.expert_elems(seg, placement) {
            (all, spread) if spread > 1 => self.held_elems(seg, placement, tp) - all / spread,
            _ => self.held_elems(seg, placement, tp),
        }
    }

    /// Parameter elements a segment holds on each of its devices: its own
    /// (of spread experts, this device's share; of a tensor-parallel
    /// segment, this device's slices, `tp` giving each segment's degree),
    /// plus a copy of the tied `wte` when it has the head but not the
    /// embedding's group.
    pub(crate) fn held_elems(
        &self,
        seg: u32,
        placement: &[Option<(Vec<DeviceId>, Option<u32>)>],
        tp: &[u32],
    ) -> u64 {
        let s = &self.segments()[seg as usize];
        let (all, spread) = self.expert_elems(seg, placement);
        if spread > 1 {
            return s.param_elems - all + all / spread;
        }
        {
            let t = u64::from(tp.get(seg as usize).copied().unwrap_or(1));
            if t > 1 {
                let held: u64 = crate::model::params::segment_entries(&self.model, s)
                    .iter()
                    .filter(|e| e.role != Role::TokenEmbedding || s.has_embedding())
                    .map(|e| {
                        let elems = e.numel() as u64;
                        match e.tp_split() {
                            TpSplit::Replicated => elems,
                            _ => elems / t,
                        }
                    })
                    .sum();
                return held + self.held_elems_tied_extra(seg, placement);
            }
        }
        s.param_elems + self.held_elems_tied_extra(seg, placement)
    }

    /// The head's copy of the tied `wte` when the embedding is on another group.
    fn held_elems_tied_extra(
        &self,
        seg: u32,
        placement: &[Option<(Vec<DeviceId>, Option<u32>)>],
    ) -> u64 {
        let s = &self.segments()[seg as usize];
        if s.tied_elems == 0 || s.has_embedding() {
            return 0;
        }
        let emb = self
            .segments()
            .iter()
            .position(|x| x.has_embedding())
            .unwrap_or(0);
        let same = match (&placement[emb], &placement[seg as usize]) {
            (Some(a), Some(b)) => a.0 == b.0,
            _ => true,
        };
        if same {
            0
        } else {
            s.tied_elems
        }
    }

    pub(crate) fn split_key(&self, n: &Node) -> Vec<u32> {
        let mut key = Vec::new();
        self.split_key_into(&n.tags, &mut key);
        key
    }

    /// [`split_key`](Self::split_key) of these tags into a kept buffer.
    fn split_key_into(&self, tags: &Tags, key: &mut Vec<u32>) {
        key.clear();
        key.extend(self.split_dims.iter().map(|k| tags.get(*k).unwrap_or(0)));
    }

    #[allow(clippy::too_many_arguments)]
    fn add_derived(
        &mut self,
        key: u64,
        kind: NodeKind,
        tags: Tags,
        devices: Vec<DeviceId>,
        stream: StreamId,
        batch_div: u32,
        tweaks: &HashMap<u64, Tweak>,
    ) -> NodeId {
        let mut node = Node {
            derived: Some(key),
            ..Node::new(kind, tags, devices, stream, batch_div)
        };
        if let Some(t) = tweaks.get(&key) {
            node.stream = t.stream;
            node.priority = t.priority;
            node.tweaked = true;
        }
        NodeId::of(self.add_node(node))
    }

    fn data(&mut self, from: NodeId, to: NodeId, tensor: TensorKind, bytes: u64) {
        self.graph
            .add_edge(from.ix(), to.ix(), EdgeKind::Data { tensor, bytes });
    }

    /// Remove and recreate every derived node (debug builds then check the
    /// kept filter index against a fresh one).
    pub(crate) fn rebuild_derived(&mut self) {
        self.rebuild_derived_nodes();
        #[cfg(debug_assertions)]
        if let Some(index) = self.index.get() {
            let missing = index.missing_from(&super::primitives::Index::build(self));
            assert!(
                missing.is_empty(),
                "the kept filter index lacks {} entries: {:?}",
                missing.len(),
                &missing[..missing.len().min(8)]
            );
        }
    }

    /// Remove and recreate every derived node, in the steps below: the
    /// strategy's tweaks kept and the derived nodes dropped; where gradients
    /// come from; the parameter-copy and tied-embedding all-reduces; one
    /// update per (group, spec) with its gradient collectives; the global
    /// gradient norm; the tweaks' temporal edges re-attached.
    fn rebuild_derived_nodes(&mut self) {
        self.dirty = false;
        self.topo = None;
        let tweaks = self.drop_derived();
        let mut r = self.gradient_flow(tweaks);
        self.add_copy_all_reduces(&mut r);
        self.add_tied_all_reduces(&mut r);
        self.add_updates(&r);
        self.add_grad_norm(&r.tweaks);
        self.reattach_tweaks(&r.tweaks);
    }

    /// Remember the strategy's tweaks of derived nodes (stream, priority,
    /// temporal edges to core nodes), then remove every derived node (and
    /// it from the filter index).
    fn drop_derived(&mut self) -> HashMap<u64, Tweak> {
        let mut tweaks: HashMap<u64, Tweak> = HashMap::new();
        let derived: Vec<NodeId> = self
            .node_ids()
            .filter(|id| self.graph[id.ix()].derived.is_some())
            .collect();
        for &id in &derived {
            let n = &self.graph[id.ix()];
            if n.tweaked {
                let core = |x: &NodeId| self.graph[x.ix()].derived.is_none();
                let temporal = |dir| -> Vec<NodeId> {
                    self.graph
                        .edges_directed(id.ix(), dir)
                        .filter(|e| matches!(e.weight(), EdgeKind::Temporal))
                        .map(|e| {
                            NodeId::of(if dir == Direction::Incoming {
                                e.source()
                            } else {
                                e.target()
                            })
                        })
                        .filter(core)
                        .collect()
                };
                tweaks.insert(
                    n.derived.unwrap(),
                    Tweak {
                        stream: n.stream,
                        priority: n.priority,
                        before: temporal(Direction::Incoming),
                        after: temporal(Direction::Outgoing),
                    },
                );
            }
        }
        // The filter index keeps its lists, less the nodes removed here.
        if let Some(index) = self.index.get_mut() {
            let mut gone = vec![false; petgraph::visit::NodeIndexable::node_bound(&self.graph)];
            for id in &derived {
                gone[id.ix().index()] = true;
            }
            index.forget(&gone);
        }
        for id in derived {
            self.graph.remove_node(id.ix());
        }
        tweaks
    }

    /// Per segment: its placement and parameter copies, the nodes that
    /// produce its weight gradients (with their split keys) and the nodes
    /// that read its weights. When the embedding and a tied head share a
    /// group (or the same set of copy groups), the head's backward also
    /// produces gradients of the embedding's bucket.
    fn gradient_flow(&self, tweaks: HashMap<u64, Tweak>) -> Rebuild {
        let placement = self.segment_placement();
        let tp = self.segment_tp();
        let nseg = self.segments().len();
        let mut sources: Vec<Sources> = vec![Vec::new(); nseg];
        let mut readers: Vec<Vec<NodeId>> = vec![Vec::new(); nseg];
        for id in self.node_ids() {
            let n = &self.graph[id.ix()];
            if let NodeKind::Compute { pass, segment, .. } = n.kind {
                if n.kind.makes_weight_grads() {
                    sources[segment as usize].push((Some(self.split_key(n)), id));
                }
                if pass.reads_weights() {
                    readers[segment as usize].push(id);
                }
            }
        }
        let copies = self.segment_copies();
        if let (Some(e), Some(h)) = (
            self.segments().iter().position(|s| s.has_embedding()),
            self.segments()
                .iter()
                .position(|s| s.has_head() && s.tied_elems > 0),
        ) {
            let same_copies = copies[e].len() > 1 && copies[e] == copies[h];
            if e != h && ((placement[e].is_some() && placement[e] == placement[h]) || same_copies) {
                let extra: Sources = sources[h].clone();
                sources[e].extend(extra);
            }
        }
        Rebuild {
            tweaks,
            placement,
            tp,
            copies,
            sources,
            readers,
        }
    }

    /// The tags of segment `seg`'s derived nodes: its `PP` region.
    fn region_tags(&self, seg: u32) -> Tags {
        let mut t = Tags::default();
        if let Some(pp) = self.find_tag("PP") {
            t.set(pp, self.segments()[seg as usize].region);
        }
        t
    }

    /// Bytes of segment `seg`'s gradients that its group synchronizes (in
    /// the policy's reduce dtype).
    fn grad_bytes(&self, seg: u32, r: &Rebuild) -> u64 {
        self.synced_elems(seg, &r.placement, &r.tp) * self.model.precision.grad_bytes()
    }

    /// Bytes of the same elements as parameters (ZeRO's gathers, in the
    /// policy's parameter dtype).
    fn param_bytes(&self, seg: u32, r: &Rebuild) -> u64 {
        self.synced_elems(seg, &r.placement, &r.tp) * self.model.precision.act_bytes()
    }

    /// Parameter copies: all-reduce each duplicated segment's gradients
    /// across its groups; every copy's update reads the sum.
    fn add_copy_all_reduces(&mut self, r: &mut Rebuild) {
        for seg in 0..r.copies.len() {
            let Some(groups) = Self::paired_copies(&r.copies[seg]) else {
                continue;
            };
            let devices: Vec<DeviceId> = r.copies[seg].iter().flat_map(|c| c.0.clone()).collect();
            let bytes = self.grad_bytes(seg as u32, r);
            let node = self.add_derived(
                key_of(("copy", seg)),
                NodeKind::Comm(Comm {
                    op: CommOp::AllReduce,
                    purpose: CommPurpose::CopyGrad,
                    tensor: TensorKind::ParamGrad,
                    bytes,
                    segments: vec![seg as u32],
                    peers: Vec::new(),
                    groups,
                    pair: None,
                }),
                self.region_tags(seg as u32),
                devices,
                self.tied_stream,
                1,
                &r.tweaks,
            );
            for (_, src) in r.sources[seg].clone() {
                self.data(src, node, TensorKind::ParamGrad, bytes);
            }
            r.sources[seg] = vec![(None, node)];
        }
    }

    /// Tied embedding / head gradients across groups of equal size, device
    /// `i` with device `i` (a head of its own, as an untied Llama's, needs
    /// none); per microbatch under ZeRO-2/3.
    fn add_tied_all_reduces(&mut self, r: &mut Rebuild) {
        let emb = self.segments().iter().position(|s| s.has_embedding());
        let head = self
            .segments()
            .iter()
            .position(|s| s.has_head() && s.tied_elems > 0);
        let (Some(e), Some(h)) = (emb, head) else {
            return;
        };
        let (Some((ge, re)), Some((gh, rh))) = (r.placement[e].clone(), r.placement[h].clone())
        else {
            return;
        };
        let disjoint = ge.iter().all(|d| !gh.contains(d));
        if e == h || ge == gh || ge.len() != gh.len() || !disjoint {
            return;
        }
        // Per microbatch where a side reduces its gradients per microbatch:
        // ZeRO-2/3 over more than one replica (one replica has no ZeRO).
        let per_mb = |x: Option<u32>, g: &[DeviceId], seg: usize| {
            x.is_some_and(|x| self.specs[x as usize].zero >= 2)
                && g.len() as u32 / r.tp.get(seg).copied().unwrap_or(1).max(1) > 1
        };
        let per_mb = per_mb(re, &ge, e) || per_mb(rh, &gh, h);
        let wte = self.segments()[h].tied_elems * self.model.precision.grad_bytes();
        let mut devices = ge.clone();
        devices.extend(gh.iter().copied());
        let groups: Vec<Vec<DeviceId>> = ge.iter().zip(&gh).map(|(a, b)| vec![*a, *b]).collect();
        let keys: Vec<Option<Vec<u32>>> = if per_mb {
            let mut k: Vec<Option<Vec<u32>>> =
                r.sources[e].iter().map(|(k, _)| k.clone()).collect();
            k.sort();
            k.dedup();
            k
        } else {
            vec![None]
        };
        let stream = self.tied_stream;
        for k in keys {
            let node = self.add_derived(
                key_of(("tied", &k)),
                NodeKind::Comm(Comm {
                    op: CommOp::AllReduce,
                    purpose: CommPurpose::TiedGrad,
                    tensor: TensorKind::ParamGrad,
                    bytes: wte,
                    segments: vec![e as u32, h as u32],
                    peers: Vec::new(),
                    groups: groups.clone(),
                    pair: None,
                }),
                Tags::default(),
                devices.clone(),
                stream,
                1,
                &r.tweaks,
            );
            for s in [e, h] {
                let srcs: Vec<NodeId> = r.sources[s]
                    .iter()
                    .filter(|(sk, _)| k.is_none() || *sk == k)
                    .map(|(_, id)| *id)
                    .collect();
                for src in srcs {
                    let t = if k.is_some() {
                        TensorKind::MicroGrad
                    } else {
                        TensorKind::ParamGrad
                    };
                    self.data(src, node, t, wte);
                }
            }
            r.sources[e].push((k.clone(), node));
            r.sources[h].push((k.clone(), node));
        }
    }

    /// One update per (group, spec), in the order of each one's first
    /// segment, with the gradient collectives its spec asks for.
    fn add_updates(&mut self, r: &Rebuild) {
        let mut keys: BTreeMap<(Vec<DeviceId>, Option<u32>), Vec<u32>> = BTreeMap::new();
        for (s, p) in r.placement.iter().enumerate() {
            if Self::paired_copies(&r.copies[s]).is_some() {
                for c in &r.copies[s] {
                    keys.entry(c.clone()).or_default().push(s as u32);
                }
                continue;
            }
            let k = p.clone().unwrap_or((Vec::new(), None));
            keys.entry(k).or_default().push(s as u32);
        }
        let mut keys: Vec<_> = keys.into_iter().collect();
        keys.sort_by_key(|(_, segs)| segs[0]);
        for ((devs, rep), segs) in keys {
            self.add_update(r, devs, rep, segs);
        }
    }

    /// The update of segments `segs` on group `devs` (replicated by spec
    /// `rep`): fed by the gradient sources directly on one device, else
    /// through the spec's bucketed reductions; ZeRO-3's gathers before
    /// every use.
    fn add_update(&mut self, r: &Rebuild, devs: Vec<DeviceId>, rep: Option<u32>, segs: Vec<u32>) {
        // Parameter copies give several updates over the same segments:
        // their keys add the group (others keep theirs across re-placing).
        let copied = segs.iter().any(|s| r.copies[*s as usize].len() > 1);
        let key = if copied {
            key_of(("update", &segs, &devs))
        } else {
            key_of(("update", &segs))
        };
        let update = self.add_derived(
            key,
            NodeKind::Update {
                segments: segs.clone(),
            },
            Tags::default(),
            devs.clone(),
            COMPUTE,
            1,
            &r.tweaks,
        );
        let spec = rep.map(|x| self.specs[x as usize].clone());
        // The data-parallel replicas: the mesh's tensor-parallel groups.
        let t = segs.iter().map(|s| r.tp[*s as usize]).max().unwrap_or(1);
        let Some(spec) = spec.filter(|_| devs.len() as u32 / t > 1) else {
            for &s in &segs {
                let b = self.grad_bytes(s, r);
                for &(_, src) in &r.sources[s as usize] {
                    self.data(src, update, TensorKind::ParamGrad, b);
                }
            }
            return;
        };
        // Buckets in backward order (last segment first). ZeRO-3 reduces
        // and gathers per segment (the FSDP unit), whatever bucket-bytes says.
        let mut buckets: Vec<Vec<u32>> = Vec::new();
        let mut acc = u64::MAX;
        for &s in segs.iter().rev() {
            if acc >= spec.bucket_bytes.max(1) || spec.bucket_bytes == 0 || spec.zero == 3 {
                buckets.push(Vec::new());
                acc = 0;
            }
            buckets.last_mut().unwrap().push(s);
            acc += self.grad_bytes(s, r);
        }
        for bucket in buckets {
            self.add_bucket_sync(r, &spec, (&devs, t), update, bucket);
        }
        if spec.zero == 3 {
            self.add_param_gathers(r, &spec, (&devs, t), &segs);
        }
    }

    /// One bucket's gradient reduction into `update` (an all-reduce, or a
    /// reduce-scatter under ZeRO: once after the last microbatch at stage 1,
    /// per microbatch from stage 2), and at stages 1 and 2 the all-gather
    /// of the updated shards. `mesh` is the update's devices and their
    /// tensor-parallel degree: each tensor-parallel rank reduces over its
    /// own data-parallel group.
    fn add_bucket_sync(
        &mut self,
        r: &Rebuild,
        spec: &ReplicaSpec,
        (devs, t): (&[DeviceId], u32),
        update: NodeId,
        bucket: Vec<u32>,
    ) {
        let n = (devs.len() as u32 / t).max(1) as u64;
        let groups = Node::dp_groups(devs, t);
        let bytes: u64 = bucket.iter().map(|s| self.grad_bytes(*s, r)).sum();
        let tags = self.region_tags(bucket[0]);
        let op = if spec.zero == 0 {
            CommOp::AllReduce
        } else {
            CommOp::ReduceScatter
        };
        let sync_kind = |segs: &Vec<u32>| {
            NodeKind::Comm(Comm {
                op,
                purpose: CommPurpose::GradSync,
                tensor: TensorKind::ParamGrad,
                bytes,
                segments: segs.clone(),
                peers: Vec::new(),
                groups: groups.clone(),
                pair: None,
            })
        };
        let out_bytes = if spec.zero == 0 {
            bytes
        } else {
            bytes.div_ceil(n)
        };
        if spec.zero <= 1 {
            // Accumulate every microbatch, then reduce once.
            let sync = self.add_derived(
                key_of(("sync", &bucket)),
                sync_kind(&bucket),
                tags.clone(),
                devs.to_vec(),
                spec.reduce_stream,
                1,
                &r.tweaks,
            );
            for &s in &bucket {
                let b = self.grad_bytes(s, r);
                for &(_, src) in &r.sources[s as usize] {
                    self.data(src, sync, TensorKind::ParamGrad, b);
                }
            }
            self.data(sync, update, TensorKind::ParamGrad, out_bytes);
        } else {
            // Reduce-scatter every microbatch's gradients: the sources by
            // split key (a stable sort keeps the bucket's order within a
            // key), one reduce-scatter per key.
            let mut by_key: Vec<(&Option<Vec<u32>>, u32, NodeId)> = bucket
                .iter()
                .flat_map(|&s| r.sources[s as usize].iter().map(move |(k, id)| (k, s, *id)))
                .collect();
            by_key.sort_by(|a, b| a.0.cmp(b.0));
            for srcs in by_key.chunk_by(|a, b| a.0 == b.0) {
                let k = srcs[0].0;
                let mut t = tags.clone();
                for (dim, v) in self.split_dims.iter().zip(k.iter().flatten()) {
                    t.set(*dim, *v);
                }
                let div = srcs
                    .iter()
                    .map(|(_, _, id)| self.graph[id.ix()].batch_div)
                    .max()
                    .unwrap_or(1);
                let sync = self.add_derived(
                    key_of(("sync", &bucket, k)),
                    sync_kind(&bucket),
                    t,
                    devs.to_vec(),
                    spec.reduce_stream,
                    div,
                    &r.tweaks,
                );
                for &(_, s, src) in srcs {
                    let b = self.grad_bytes(s, r);
                    self.data(src, sync, TensorKind::MicroGrad, b);
                }
                self.data(sync, update, TensorKind::ParamGrad, out_bytes);
            }
        }
        if spec.zero == 1 || spec.zero == 2 {
            // Updated parameter shards are gathered back.
            let bytes: u64 = bucket.iter().map(|s| self.param_bytes(*s, r)).sum();
            let ag = self.add_derived(
                key_of(("refresh", &bucket)),
                NodeKind::Comm(Comm {
                    op: CommOp::AllGather,
                    purpose: CommPurpose::ParamRefresh,
                    tensor: TensorKind::Param,
                    bytes,
                    segments: bucket.clone(),
                    peers: Vec::new(),
                    groups,
                    pair: None,
                }),
                tags,
                devs.to_vec(),
                spec.gather_stream,
                1,
                &r.tweaks,
            );
            self.data(update, ag, TensorKind::Param, bytes.div_ceil(n));
        }
    }

    /// ZeRO-3: full parameters gathered before every use (each reader's own
    /// gather when `reshard_after_forward`, else one per segment).
    fn add_param_gathers(
        &mut self,
        r: &Rebuild,
        spec: &ReplicaSpec,
        (devs, t): (&[DeviceId], u32),
        segs: &[u32],
    ) {
        let groups = Node::dp_groups(devs, t);
        let mut split_key: Vec<u32> = Vec::new();
        for &s in segs {
            let bytes = self.param_bytes(s, r);
            let gather = || {
                NodeKind::Comm(Comm {
                    op: CommOp::AllGather,
                    purpose: CommPurpose::ParamGather,
                    tensor: TensorKind::Param,
                    bytes,
                    segments: vec![s],
                    peers: Vec::new(),
                    groups: groups.clone(),
                    pair: None,
                })
            };
            let rs = r.readers[s as usize].clone();
            if spec.reshard_after_forward {
                for reader in rs {
                    let rn = &self.graph[reader.ix()];
                    let (tags, div, label) = (rn.tags.clone(), rn.batch_div, rn.kind.label());
                    self.split_key_into(&tags, &mut split_key);
                    let ag = self.add_derived(
                        key_of(("gather", s, label, &split_key[..])),
                        gather(),
                        tags,
                        devs.to_vec(),
                        spec.gather_stream,
                        div,
                        &r.tweaks,
                    );
                    self.data(ag, reader, TensorKind::Param, bytes);
                }
            } else {
                let ag = self.add_derived(
                    key_of(("gather", s)),
                    gather(),
                    self.region_tags(s),
                    devs.to_vec(),
                    spec.gather_stream,
                    1,
                    &r.tweaks,
                );
                for reader in rs {
                    self.data(ag, reader, TensorKind::Param, bytes);
                }
            }
        }
    }

    /// The global gradient norm: one all-reduce over every device that holds
    /// parameters, after all gradient reductions, before any update.
    fn add_grad_norm(&mut self, tweaks: &HashMap<u64, Tweak>) {
        let updates: Vec<NodeId> = self
            .node_ids()
            .filter(|id| matches!(self.graph[id.ix()].kind, NodeKind::Update { .. }))
            .collect();
        let mut all: Vec<DeviceId> = updates
            .iter()
            .flat_map(|u| self.graph[u.ix()].devices.iter().copied())
            .collect();
        all.sort_unstable();
        all.dedup();
        let placed = updates
            .iter()
            .all(|u| !self.graph[u.ix()].devices.is_empty());
        if all.len() <= 1 || !placed {
            return;
        }
        let norm = self.add_derived(
            key_of("grad-norm"),
            NodeKind::Comm(Comm {
                op: CommOp::AllReduce,
                purpose: CommPurpose::GradNorm,
                tensor: TensorKind::ParamGrad,
                bytes: 8,
                segments: Vec::new(),
                peers: Vec::new(),
                groups: vec![all.clone()],
                pair: None,
            }),
            Tags::default(),
            all,
            COMPUTE,
            1,
            tweaks,
        );
        for &u in &updates {
            let preds: Vec<NodeId> = self
                .preds(u)
                .filter(|(_, k)| matches!(k, EdgeKind::Data { .. }))
                .map(|(p, _)| p)
                .collect();
            for p in preds {
                self.data(p, norm, TensorKind::ParamGrad, 8);
            }
            self.data(norm, u, TensorKind::ParamGrad, 8);
        }
    }

    /// Re-attach tweaked derived nodes' temporal edges to the rebuilt nodes
    /// of the same key (to core nodes that still exist).
    fn reattach_tweaks(&mut self, tweaks: &HashMap<u64, Tweak>) {
        if tweaks.is_empty() {
            return;
        }
        let new: Vec<(NodeId, u64)> = self
            .node_ids()
            .filter_map(|id| self.graph[id.ix()].derived.map(|k| (id, k)))
            .collect();
        for (id, k) in new {
            if let Some(t) = tweaks.get(&k) {
                for &b in &t.before {
                    if self.graph.node_weight(b.ix()).is_some() {
                        self.graph.add_edge(b.ix(), id.ix(), EdgeKind::Temporal);
                    }
                }
                for &a in &t.after {
                    if self.graph.node_weight(a.ix()).is_some() {
                        self.graph.add_edge(id.ix(), a.ix(), EdgeKind::Temporal);
                    }
                }
            }
        }
    }
}
