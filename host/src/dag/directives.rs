//! Directives: the host-implemented transformations strategies call —
//! `split`, `place`, `replicate`, `shard`, `shard-tensor` and `order`. Each
//! checks all its arguments before it changes anything, so a failed directive
//! leaves the DAG exactly as it was (`order`, the one directive whose failure
//! is only known after the change — a cycle — rolls its edges back).

use super::error::{list, quote, DagError, DagErrorKind};
use super::filter::{Filter, Label};
use super::{
    Comm, CommOp, CommPurpose, ContextParallel, DeviceId, EdgeKind, ExpertPhase, KvExchange, Node,
    NodeId, NodeKind, Pass, ReplicaSpec, StreamId, TensorKind, TensorParallel, TrainingDag,
};
use foldhash::{HashSet, HashSetExt};
use petgraph::visit::{EdgeIndexable, EdgeRef, IntoEdgeReferences, NodeIndexable};
use petgraph::Direction;

/// The most nodes or edges a directive reserves room for at once (it grows
/// past that as usual).
const RESERVE_MAX: usize = 1 << 24;

/// Temporaries of an acyclicity proof, per node or edge it passes over
/// (positions, degrees, stamps, adjacency).
const PROOF_BYTES: u64 = 24;

/// Temporaries of `split`: per node of the region (its set entry, its
/// position, its copy) and per edge it may copy (the edge and its ends).
const SPLIT_NODE_BYTES: u64 = 48;
const SPLIT_EDGE_BYTES: u64 = 48;

/// Options of `replicate` (data parallelism and ZeRO).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicateOptions {
    /// ZeRO-1: optimizer states sharded over the group.
    pub shard_optimizer: bool,
    /// ZeRO-2: gradients reduce-scattered and sharded too.
    pub shard_grads: bool,
    /// ZeRO-3: parameters sharded too, all-gathered before every use.
    pub shard_params: bool,
    /// Gradient bucket size for the reduction collectives (0 = one per segment).
    pub bucket_bytes: u64,
    /// Stream of the gradient reductions.
    pub reduce_stream: String,
    /// Stream of the parameter all-gathers.
    pub gather_stream: String,
    /// ZeRO-3: free gathered parameters after each use (true) or keep them
    /// from the first forward to the last backward (false).
    pub reshard_after_forward: bool,
}

impl Default for ReplicateOptions {
    fn default() -> Self {
        ReplicateOptions {
            shard_optimizer: false,
            shard_grads: false,
            shard_params: false,
            bucket_bytes: 25 << 20, // PyTorch DDP's default bucket
            reduce_stream: "dp".into(),
            gather_stream: "dp".into(),
            reshard_after_forward: true,
        }
    }
}

impl ReplicateOptions {
    /// Plain data parallelism (stage 0) or ZeRO stage 1, 2 or 3.
    pub fn zero(stage: u8) -> Self {
        ReplicateOptions {
            shard_optimizer: stage >= 1,
            shard_grads: stage >= 2,
            shard_params: stage >= 3,
            ..Self::default()
        }
    }
    /// The ZeRO stage; stages are cumulative (sharding parameters implies
    /// sharding gradients and optimizer states).
    pub fn stage(&self) -> u8 {
        if self.shard_params {
            3
        } else if self.shard_grads {
            2
        } else if self.shard_optimizer {
            1
        } else {
            0
        }
    }
}

fn devices_str(d: &[u32]) -> String {
    list(d)
}

impl TrainingDag {
    pub(crate) fn check_devices(
        &self,
        devices: &[u32],
        call: &str,
    ) -> Result<Vec<DeviceId>, DagError> {
        if devices.is_empty() {
            return Err(DagError::new(call, DagErrorKind::EmptyDevices));
        }
        // Sorting a copy finds duplicates in O(n log n) with no hashing.
        self.charge(call, devices.len() as u64)?;
        let mut seen = HashSet::with_capacity(devices.len().min(1 << 16));
        for &d in devices {
            if d >= self.cluster_info().devices {
                return Err(DagError::new(
                    call,
                    DagErrorKind::DeviceOutOfRange {
                        device: d,
                        cluster: self.cluster_info().devices,
                    },
                ));
            }
            if !seen.insert(d) {
                return Err(DagError::new(
                    call,
                    DagErrorKind::DuplicateDevice { device: d },
                ));
            }
        }
        self.note_group(devices.len());
        Ok(devices.iter().map(|d| DeviceId(*d)).collect())
    }

    /// Predict and charge re-placing `compute` on a group of `group` devices:
    /// each node's edges are visited, and each crossing data edge may become
    /// a send/recv pair (two nodes, three edges).
    fn charge_rewire(&self, call: &str, compute: &[NodeId], group: usize) -> Result<(), DagError> {
        let degree: u64 = compute
            .iter()
            .map(|id| {
                self.graph
                    .edges_directed(id.ix(), Direction::Incoming)
                    .count()
                    + self
                        .graph
                        .edges_directed(id.ix(), Direction::Outgoing)
                        .count()
            })
            .sum::<usize>() as u64;
        self.check_growth(call, degree.saturating_mul(2), degree.saturating_mul(3))?;
        // Each node's device list is written once.
        let writes = (compute.len() as u64).saturating_mul(group as u64);
        self.charge(call, degree.saturating_mul(4).saturating_add(writes))
    }

    fn check_stream(stream: &str, what: &str, call: &str) -> Result<(), DagError> {
        if stream.trim().is_empty() {
            return Err(DagError::new(
                call,
                DagErrorKind::InvalidArgument(format!("the {what} name is empty")),
            ));
        }
        Ok(())
    }

    /// Core compute nodes among `ids`; an error naming what matched if none.
    fn compute_only(
        &self,
        f: &Filter,
        ids: Vec<NodeId>,
        call: &str,
    ) -> Result<Vec<NodeId>, DagError> {
        let compute: Vec<NodeId> = ids
            .iter()
            .copied()
            .filter(|id| matches!(self.graph[id.ix()].kind, NodeKind::Compute { .. }))
            .collect();
        if compute.is_empty() {
            return Err(DagError::new(
                call,
                DagErrorKind::WrongKind {
                    filter: f.to_string(),
                    what: "compute",
                    matched: ids.iter().take(8).map(|i| self.label(*i)).collect(),
                },
            ));
        }
        Ok(compute)
    }

    /// Mark derived nodes stale (rebuilt before the next read or `order`).
    pub(crate) fn touch(&mut self) {
        self.dirty = true;
        self.topo = None;
    }

    /// What `place`, `shard` and `shard_tensor` check first: no recompute
    /// node yet, the devices, the stream's name, and the filter's compute
    /// nodes (nothing else may be matched).
    fn devices_and_compute(
        &mut self,
        f: &Filter,
        devices: &[u32],
        stream: &str,
        call: &str,
    ) -> Result<(Vec<DeviceId>, Vec<NodeId>), DagError> {
        self.check_not_recomputed(call)?;
        let devs = self.check_devices(devices, call)?;
        Self::check_stream(stream, "stream", call)?;
        self.check_names(call, &[], &[stream])?;
        let ids = self.select(f, call)?;
        let compute = self.compute_only(f, ids, call)?;
        Ok((devs, compute))
    }

    /// **split**: copy the matched sub-DAG `n` times along dimension `dim`
    /// (microbatches: `split(all, "MB", 8)`), tagging copy `i` with `dim = i`.
    /// Each copy runs `1/n` of the batch; parameter gradients of the copies
    /// accumulate before the update. The region must be closed: no data edge may
    /// leave it for a node it does not contain.
    pub fn split(&mut self, f: &Filter, dim: &str, n: u32) -> Result<(), DagError> {
        let call = format!("split({f}, {}, {n})", quote(dim));
        self.check_not_recomputed(&call)?;
        self.check_split_args(&call, dim, n)?;
        let ids = self.split_region(f, dim, n, &call)?;
        // The region as a set, the edges it copies (at most every edge) and
        // their ends.
        self.charge_bytes(
            &call,
            (ids.len() as u64)
                .saturating_mul(SPLIT_NODE_BYTES)
                .saturating_add((self.graph.edge_bound() as u64).saturating_mul(SPLIT_EDGE_BYTES)),
        )?;
        let set: HashSet<NodeId> = ids.iter().copied().collect();
        // The closure scan and the edge scan below visit every edge.
        self.charge(&call, (self.edge_count() as u64).saturating_mul(2))?;
        self.check_closed(&call, &ids, &set)?;
        let edges = self.region_edges(&set);
        // n − 1 copies of the region; each copied core node may bring a
        // derived node (a ZeRO gather or reduce-scatter) at the next rebuild.
        let copies = u64::from(n - 1);
        let add_nodes = copies.saturating_mul(ids.len() as u64).saturating_mul(2);
        let add_edges = copies.saturating_mul(edges.len() as u64).saturating_mul(2);
        let new_key = u64::from(self.find_tag(dim).is_none());
        self.check_growth_keys(&call, add_nodes, add_edges, new_key)?;
        self.charge(&call, add_nodes.saturating_add(add_edges))?;
        // Validated: from here on nothing fails. Room up front for the
        // copies and the derived nodes they may bring (the growth charged),
        // bounded: no growth by doubling, each step copying the graph (the
        // next rebuild's nodes then go into room already there; pages never
        // written cost nothing).
        let room = |x: u64| usize::try_from(x).unwrap_or(usize::MAX).min(RESERVE_MAX);
        self.graph.reserve_nodes(room(add_nodes));
        self.graph.reserve_edges(room(add_edges));
        let key = self.tag_key(dim);
        self.copy_region(&ids, &edges, key, n);
        self.split_dims.push(key);
        self.touch();
        Ok(())
    }

    /// A split needs at least one copy and a dimension of its own.
    fn check_split_args(&self, call: &str, dim: &str, n: u32) -> Result<(), DagError> {
        if n == 0 {
            return Err(DagError::new(
                call.to_string(),
                DagErrorKind::InvalidArgument("n must be at least 1, got 0".into()),
            ));
        }
        if dim.is_empty() || dim == "PASS" || dim == "PP" || dim == "EP" {
            return Err(DagError::new(
                call.to_string(),
                DagErrorKind::InvalidArgument(format!(
                    "{} cannot be a split dimension (use a new name such as MB)",
                    quote(dim)
                )),
            ));
        }
        self.check_names(call, &[dim], &[])
    }

    /// The region a split copies: the matched core nodes (sorted), which
    /// must be the whole model, not split along `dim` yet, and each able to
    /// run `1/n` of its share.
    fn split_region(
        &self,
        f: &Filter,
        dim: &str,
        n: u32,
        call: &str,
    ) -> Result<Vec<NodeId>, DagError> {
        let err = |kind| Err(DagError::new(call.to_string(), kind));
        let ids: Vec<NodeId> = self
            .select(f, call)?
            .into_iter()
            .filter(|id| self.graph[id.ix()].derived.is_none())
            .collect();
        let ids = self.compute_only(f, ids.clone(), call).map(|_| ids)?;
        // The whole model, or its pieces would run other shares of the batch
        // than the rest: a split of one microbatch would give its copies
        // rows that the other microbatches also train, and leave others out.
        let computes = |list: &mut dyn Iterator<Item = NodeId>| {
            list.filter(|id| {
                let n = &self.graph[id.ix()];
                n.derived.is_none() && matches!(n.kind, NodeKind::Compute { .. })
            })
            .count()
        };
        let (matched, all) = (
            computes(&mut ids.iter().copied()),
            computes(&mut self.node_ids()),
        );
        if matched < all {
            return err(DagErrorKind::InvalidArgument(format!(
                "a split takes the whole model: the filter matches {matched} of its {all} compute \
                 nodes, and a part split alone would train other rows of the batch than the rest"
            )));
        }
        // Every node's batch share must stay representable.
        for &id in &ids {
            let div = self.graph[id.ix()].batch_div;
            if div.checked_mul(n).is_none() {
                return err(DagErrorKind::InvalidArgument(format!(
                    "{} already runs 1/{div} of the batch; splitting it {n} ways more overflows",
                    self.label(id)
                )));
            }
        }
        if let Some(key) = self.find_tag(dim) {
            if ids
                .iter()
                .any(|id| self.graph[id.ix()].tags.get(key).is_some())
            {
                return err(DagErrorKind::AlreadySplit { dim: dim.into() });
            }
        }
        Ok(ids)
    }

    /// The region must be closed: no data or peer edge between it and a
    /// core node outside it.
    fn check_closed(
        &self,
        call: &str,
        ids: &[NodeId],
        set: &HashSet<NodeId>,
    ) -> Result<(), DagError> {
        for &id in ids {
            let outs = self
                .graph
                .edges_directed(id.ix(), Direction::Outgoing)
                .map(|e| (NodeId::of(e.target()), *e.weight()));
            let ins = self
                .graph
                .edges_directed(id.ix(), Direction::Incoming)
                .map(|e| (NodeId::of(e.source()), *e.weight()));
            for (other, kind) in outs.chain(ins) {
                if !set.contains(&other)
                    && self.graph[other.ix()].derived.is_none()
                    && !matches!(kind, EdgeKind::Temporal)
                {
                    return Err(DagError::new(
                        call.to_string(),
                        DagErrorKind::NonContiguous {
                            inside: self.label(id),
                            outside: self.label(other),
                        },
                    ));
                }
            }
        }
        Ok(())
    }

    /// The edges a split copies: those inside the region, and those between
    /// it and core nodes outside (temporal ones: the closure allows no other).
    fn region_edges(&self, set: &HashSet<NodeId>) -> Vec<(NodeId, NodeId, EdgeKind)> {
        self.graph
            .edge_references()
            .filter(|e| {
                let (s, t) = (NodeId::of(e.source()), NodeId::of(e.target()));
                let (ins, int) = (set.contains(&s), set.contains(&t));
                let core = |x: NodeId| self.graph[x.ix()].derived.is_none();
                (ins && int) || ((ins || int) && core(s) && core(t))
            })
            .map(|e| (NodeId::of(e.source()), NodeId::of(e.target()), *e.weight()))
            .collect()
    }

    /// Tag the region (`ids`, sorted) copy 0 along `key` and add copies 1 to
    /// `n − 1` with their `edges`, each running `1/n` of its share. Checked
    /// and charged before: nothing here fails.
    fn copy_region(
        &mut self,
        ids: &[NodeId],
        edges: &[(NodeId, NodeId, EdgeKind)],
        key: super::TagKey,
        n: u32,
    ) {
        for &id in ids {
            let node = &mut self.graph[id.ix()];
            node.tags.set(key, 0);
            node.batch_div *= n; // checked by split_region
            self.index_tag(id, key, 0);
        }
        // Each edge's ends as positions in `ids` (sorted), once: a copy's
        // node is then found by position, not by a map per copy.
        debug_assert!(ids.windows(2).all(|w| w[0] < w[1]));
        let at = |x: NodeId| ids.binary_search(&x).ok();
        let ends: Vec<(Option<usize>, Option<usize>)> =
            edges.iter().map(|&(s, t, _)| (at(s), at(t))).collect();
        let pairs: Vec<(usize, Option<usize>)> = ids
            .iter()
            .enumerate()
            .filter_map(|(p, id)| match &self.graph[id.ix()].kind {
                NodeKind::Comm(c) => Some((p, c.pair.and_then(at))),
                _ => None,
            })
            .collect();
        let mut copy: Vec<NodeId> = Vec::with_capacity(ids.len());
        for i in 1..n {
            copy.clear();
            for &id in ids {
                let mut node = self.graph[id.ix()].clone();
                node.tags.set(key, i);
                copy.push(NodeId::of(self.add_node(node)));
            }
            for &(p, pair) in &pairs {
                if let NodeKind::Comm(c) = &mut self.graph[copy[p].ix()].kind {
                    if let Some(q) = pair {
                        c.pair = Some(copy[q]);
                    }
                }
            }
            for (&(s, t, k), &(ps, pt)) in edges.iter().zip(&ends) {
                let s2 = ps.map_or(s, |p| copy[p]);
                let t2 = pt.map_or(t, |p| copy[p]);
                self.graph.add_edge(s2.ix(), t2.ix(), k);
            }
        }
    }

    /// **place**: put the matched compute nodes on `devices` (several devices =
    /// SPMD). Every data edge that then crosses device groups of equal size gets
    /// a `send`/`recv` pair on `stream`, pairing the groups element-wise. When
    /// the tied embedding and LM head end up on different groups, their
    /// gradients get an all-reduce (on the same stream) before the update.
    pub fn place(&mut self, f: &Filter, devices: &[u32], stream: &str) -> Result<(), DagError> {
        let call = format!(
            "place({f}, devices {}, stream {})",
            devices_str(devices),
            quote(stream)
        );
        let (devs, compute) = self.devices_and_compute(f, devices, stream, &call)?;
        self.charge_rewire(&call, &compute, devs.len())?;
        // A tensor- or context-parallel mesh moves whole, device for device.
        if let Some(id) = compute.iter().find(|id| {
            let n = &self.graph[id.ix()];
            (n.tensor_parallel.is_some() || n.context_parallel.is_some())
                && n.devices.len() != devs.len()
        }) {
            let n = &self.graph[id.ix()];
            let what = match (n.tensor_parallel.is_some(), n.context_parallel.is_some()) {
                (true, true) => "tensor- and context-parallel",
                (true, false) => "tensor-parallel",
                _ => "context-parallel",
            };
            return Err(DagError::new(
                call,
                DagErrorKind::InvalidArgument(format!(
                    "{} is {what} on {} devices {}: place moves its groups whole, so give {} devices (got {})",
                    self.label(*id),
                    n.devices.len(),
                    self.devices_label(*id),
                    n.devices.len(),
                    devs.len()
                )),
            ));
        }
        let s = self.stream_id(stream);
        for &id in &compute {
            self.graph[id.ix()].devices = devs.clone();
        }
        // An expert pass's all-to-alls move with its phases (only a model
        // with experts has them).
        let experts = if self.expert_phases.is_some() {
            &compute[..]
        } else {
            &[]
        };
        for &id in experts {
            let a2a: Vec<NodeId> = self
                .succs(id)
                .map(|(n, _)| n)
                .filter(|n| {
                    matches!(&self.graph[n.ix()].kind,
                        NodeKind::Comm(c) if c.purpose == CommPurpose::Experts)
                })
                .collect();
            for n in a2a {
                let node = &mut self.graph[n.ix()];
                node.devices = devs.clone();
                if let NodeKind::Comm(c) = &mut node.kind {
                    c.groups = vec![devs.clone()];
                }
            }
        }
        for &id in &compute {
            self.rewire_p2p(id, s);
        }
        self.tied_stream = s;
        self.touch();
        Ok(())
    }

    /// **replicate**: data parallelism of the matched compute nodes over
    /// `devices`. Gradients are all-reduced after the last microbatch's backward
    /// on `reduce_stream`, in buckets of `bucket_bytes`; ZeRO-1 shards the
    /// optimizer (reduce-scatter, sharded update, all-gather of parameters),
    /// ZeRO-2 reduce-scatters every microbatch's gradients, ZeRO-3 also shards
    /// the parameters and all-gathers them on `gather_stream` before every
    /// forward and backward use. A segment's forward and backward must be
    /// matched together. On tensor-parallel nodes, `devices` gives one
    /// device per replica: replica i's group has the node's group's shape
    /// from `devices[i]` (see [`shard_tensor`](Self::shard_tensor)).
    pub fn replicate(
        &mut self,
        f: &Filter,
        devices: &[u32],
        opts: &ReplicateOptions,
    ) -> Result<(), DagError> {
        let call = format!(
            "replicate({f}, devices {}, zero {}, bucket-bytes {})",
            devices_str(devices),
            opts.stage(),
            opts.bucket_bytes
        );
        self.check_not_recomputed(&call)?;
        let devs = self.check_devices(devices, &call)?;
        Self::check_stream(&opts.reduce_stream, "reduce-stream", &call)?;
        Self::check_stream(&opts.gather_stream, "gather-stream", &call)?;
        self.check_names(&call, &[], &[&opts.reduce_stream, &opts.gather_stream])?;
        let ids = self.select(f, &call)?;
        let compute = self.compute_only(f, ids, &call)?;
        self.charge_rewire(&call, &compute, devs.len())?;
        self.check_paired(&call, &compute)?;
        if let Some(id) = compute.iter().find(|id| {
            self.graph[id.ix()]
                .replica
                .is_some_and(|r| self.specs[r as usize].expert_parallel.is_some())
        }) {
            return Err(DagError::new(
                call,
                DagErrorKind::InvalidArgument(format!(
                    "{} is already sharded by expert parallelism: replicate before shard (data parallelism first, then `ep`)",
                    self.label(*id)
                )),
            ));
        }
        let spec = ReplicaSpec {
            zero: opts.stage(),
            bucket_bytes: opts.bucket_bytes,
            reduce_stream: self.stream_id(&opts.reduce_stream),
            gather_stream: self.stream_id(&opts.gather_stream),
            reshard_after_forward: opts.reshard_after_forward,
            expert_parallel: None,
        };
        let rep = match self.specs.iter().position(|s| *s == spec) {
            Some(i) => i as u32,
            None => {
                self.specs.push(spec);
                (self.specs.len() - 1) as u32
            }
        };
        // A tensor-parallel node keeps its group's shape on every replica:
        // replica i's group starts at `devices[i]`.
        // (A context-parallel node: its whole tp × cp block.)
        let meshes = compute
            .iter()
            .map(|&id| {
                let n = &self.graph[id.ix()];
                let block = (n.tp_degree() * n.cp_degree()) as usize;
                match block > 1 {
                    true => {
                        let first = &n.devices[..block.min(n.devices.len())];
                        self.lay_mesh(id, &devs, first, &call)
                    }
                    false => Ok(devs.clone()),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Pipeline transfers keep the stream they were placed with.
        let p2p_stream = self.tied_stream;
        for (&id, mesh) in compute.iter().zip(meshes) {
            let n = &mut self.graph[id.ix()];
            n.devices = mesh;
            n.replica = Some(rep);
        }
        for &id in &compute {
            self.rewire_p2p(id, p2p_stream);
        }
        self.touch();
        Ok(())
    }

    /// The devices of node `id` as a message shows them.
    fn devices_label(&self, id: NodeId) -> String {
        let d: Vec<u32> = self.graph[id.ix()].devices.iter().map(|d| d.0).collect();
        devices_str(&d)
    }

    /// A device mesh for node `id`: the shape of `group` (each device's
    /// distance from its first) laid on every device of `bases`, base by
    /// base (`bases` [0, 4] × `group` [0, 1] = [0, 1, 4, 5]). Every device
    /// must exist and appear once.
    fn lay_mesh(
        &self,
        id: NodeId,
        bases: &[DeviceId],
        group: &[DeviceId],
        call: &str,
    ) -> Result<Vec<DeviceId>, DagError> {
        let cluster = self.cluster_info().devices;
        let first = group.first().map_or(0, |d| i64::from(d.0));
        let size = bases.len().saturating_mul(group.len());
        self.charge(call, size as u64)?;
        let mut mesh = Vec::with_capacity(size);
        let mut seen = HashSet::with_capacity(size);
        let b: Vec<u32> = bases.iter().map(|d| d.0).collect();
        let g: Vec<u32> = group.iter().map(|d| d.0).collect();
        for base in bases {
            for d in group {
                let at = i64::from(base.0) + i64::from(d.0) - first;
                let fits = u32::try_from(at).ok().filter(|a| *a < cluster);
                let Some(at) = fits.filter(|a| seen.insert(*a)) else {
                    let why = match fits {
                        None => format!("device {at} does not exist, the cluster has {cluster}"),
                        Some(_) => format!("device {at} twice"),
                    };
                    return Err(DagError::new(
                        call.to_string(),
                        DagErrorKind::InvalidArgument(format!(
                            "{}: the tensor-parallel group {} laid on each data-parallel replica {} gives {why}: the replicas need {} devices apart (dp × tp must fit the {cluster} devices)",
                            self.label(id),
                            devices_str(&g),
                            devices_str(&b),
                            g.len()
                        )),
                    ));
                };
                mesh.push(DeviceId(at));
            }
        }
        Ok(mesh)
    }

    /// Forward and backward of one segment and microbatch go together: a
    /// node's saved-tensor partner (and a `BI`'s `BW`) must be among `compute`.
    fn check_paired(&self, call: &str, compute: &[NodeId]) -> Result<(), DagError> {
        let set: HashSet<NodeId> = compute.iter().copied().collect();
        for &id in compute {
            for (other, k) in self.preds(id).chain(self.succs(id)) {
                let partner = matches!(
                    k,
                    EdgeKind::Data {
                        tensor: TensorKind::Saved,
                        ..
                    }
                ) || (matches!(
                    self.graph[id.ix()].kind,
                    NodeKind::Compute { pass: Pass::BI, .. }
                ) && matches!(
                    self.graph[other.ix()].kind,
                    NodeKind::Compute { pass: Pass::BW, .. }
                ));
                if partner && !set.contains(&other) {
                    return Err(DagError::new(
                        call.to_string(),
                        DagErrorKind::Unpaired {
                            node: self.label(id),
                            partner: self.label(other),
                        },
                    ));
                }
            }
        }
        Ok(())
    }

    /// **shard** (expert parallelism): the experts of the matched expert
    /// segments (tag `EP`) are spread evenly over `devices`, device `i` of the
    /// group holding experts `i·E/n … (i+1)·E/n − 1`; each device routes its
    /// own tokens and the rows each expert runs travel to its owner and back
    /// by all-to-all, in forward and in backward. The segments must already
    /// be data-parallel over exactly `devices` (EP degree = their DP degree:
    /// `dp` or `replicate` first); their expert parameters then leave the
    /// data-parallel gradient sync (each lives on one device, its states
    /// whole there), their router and layernorm stay in it (ZeRO shards
    /// those over the group). Context-parallel segments (`context-parallel`
    /// first) count their context-parallel replicas among the data-parallel
    /// ones: the experts spread over the whole dp × cp mesh.
    ///
    /// On `stream` `compute` the exchanges run inside the expert segment's
    /// compute op. On any other stream each `F`, `B` or `BI` of the matched
    /// segments is split into its phases ([`ExpertPhase`], tag `PART`: 0
    /// dispatch, 1 experts, 2 combine) with an `all-to-all` node on `stream`
    /// between consecutive phases, so that `order` can interleave another
    /// microbatch's compute with the exchange (DualPipe's overlap).
    ///
    /// Segments `shard-tensor` put on a tensor-parallel mesh (`devices` =
    /// the whole mesh): experts spread over every device of it (EP = DP ×
    /// TP), each tensor-parallel rank routing its share of its replica's
    /// sequences; the exchanges run inside the compute op on any stream.
    pub fn shard(&mut self, f: &Filter, devices: &[u32], stream: &str) -> Result<(), DagError> {
        let call = format!(
            "shard({f}, devices {}, stream {})",
            devices_str(devices),
            quote(stream)
        );
        let (devs, compute) = self.devices_and_compute(f, devices, stream, &call)?;
        self.charge(&call, compute.len() as u64)?;
        let invalid = |m: String| {
            Err(DagError::new(
                call.clone(),
                DagErrorKind::InvalidArgument(m),
            ))
        };
        let Some(experts) = self.model.moe.as_ref().map(|m| m.experts) else {
            return invalid(format!(
                "the model `{}` has no experts (no [moe] table): nothing to shard",
                self.model.name
            ));
        };
        let ep = self.find_tag("EP");
        if let Some(id) = compute
            .iter()
            .find(|id| ep.is_none_or(|t| self.graph[id.ix()].tags.get(t).is_none()))
        {
            return invalid(format!(
                "shard spreads experts: {} is not an expert segment (no EP tag); filter on EP",
                self.label(*id)
            ));
        }
        self.check_paired(&call, &compute)?;
        let n = devs.len() as u32;
        if !experts.is_multiple_of(n) {
            return invalid(format!(
                "{experts} experts do not spread evenly over {n} devices: give a device count that divides the experts"
            ));
        }
        for &id in &compute {
            let node = &self.graph[id.ix()];
            // ZeRO shards what stays replicated (router, norms, attention)
            // over the group; each expert lives on one device, its states
            // whole there (its expert-data-parallel group is itself). A
            // tensor-parallel mesh counts as its replicas × its groups.
            let spread = node.replica.is_some() || node.tensor_parallel.is_some();
            if !spread || node.devices != devs {
                return invalid(format!(
                    "{} is on devices {}{}; shard its experts over the devices it is data-parallel over (EP degree = DP degree: `dp` or `replicate` over {} first)",
                    self.label(id),
                    devices_str(&node.devices.iter().map(|d| d.0).collect::<Vec<_>>()),
                    if node.replica.is_some() { "" } else { " and not replicated" },
                    devices_str(devices)
                ));
            }
        }
        // On a tensor-parallel mesh the exchanges run inside the compute op
        // (as the group's sums do), whatever the stream.
        let tensor_parallel = compute
            .iter()
            .any(|id| self.graph[id.ix()].tensor_parallel.is_some());
        let split = stream != self.stream_name(super::COMPUTE) && !tensor_parallel;
        if split {
            if let Some(id) = compute.iter().find(|id| {
                matches!(
                    self.graph[id.ix()].kind,
                    NodeKind::Compute { phase: Some(_), .. }
                )
            }) {
                return Err(DagError::new(
                    call.clone(),
                    DagErrorKind::AlreadySplit {
                        dim: format!("{} into expert phases", self.label(*id)),
                    },
                ));
            }
            let passes = compute.len() as u64;
            self.check_growth(&call, passes * 4, passes * 12)?;
            self.charge(&call, passes * 16)?;
        }
        let s = self.stream_id(stream);
        for &id in &compute {
            // A tensor-parallel node not replicated yet gets a spec of one
            // replica (no data-parallel sync).
            let base = match self.graph[id.ix()].replica {
                Some(r) => self.specs[r as usize].clone(),
                None => ReplicaSpec::alone(),
            };
            let spec = ReplicaSpec {
                expert_parallel: Some(s),
                ..base
            };
            let rep = match self.specs.iter().position(|x| *x == spec) {
                Some(i) => i as u32,
                None => {
                    self.specs.push(spec);
                    (self.specs.len() - 1) as u32
                }
            };
            self.graph[id.ix()].replica = Some(rep);
        }
        if split {
            for &id in &compute {
                self.split_expert_pass(id, s);
            }
        }
        self.touch();
        Ok(())
    }

    /// Split an expert segment's `F`, `B` or `BI` into its three phases with
    /// an all-to-all on `stream` between consecutive ones (see [`shard`]).
    /// The node becomes the first phase (keeping its inputs); its outputs
    /// move to the last.
    ///
    /// [`shard`]: TrainingDag::shard
    fn split_expert_pass(&mut self, id: NodeId, stream: StreamId) {
        let node = self.graph[id.ix()].clone();
        let NodeKind::Compute {
            pass,
            segment,
            phase: None,
        } = node.kind
        else {
            return;
        };
        let Some(x) = self.expert_phases else {
            return;
        };
        if pass == Pass::BW {
            return;
        }
        let part = self.tag_key("PART");
        let order = ExpertPhase::order(pass);
        let mut phases = Vec::with_capacity(3);
        for (i, p) in order.into_iter().enumerate() {
            let mut n = node.clone();
            n.kind = NodeKind::Compute {
                pass,
                segment,
                phase: Some(p),
            };
            n.tags.set(part, p.index());
            if i == 0 {
                self.graph[id.ix()] = n;
                self.index_tag(id, part, p.index());
                phases.push(id.ix());
            } else {
                phases.push(self.add_node(n));
            }
        }
        let last = phases[2];
        let outgoing: Vec<_> = self
            .graph
            .edges_directed(id.ix(), Direction::Outgoing)
            .map(|e| (e.id(), e.target(), *e.weight()))
            .collect();
        for (e, t, k) in outgoing {
            self.graph.remove_edge(e);
            self.graph.add_edge(last, t, k);
        }
        let data = |tensor, bytes| EdgeKind::Data { tensor, bytes };
        let routed = data(TensorKind::Routed, x.routed_bytes);
        for (i, w) in phases.windows(2).enumerate() {
            let mut tags = node.tags.clone();
            tags.set(part, order[i].index());
            let kind = NodeKind::Comm(Comm {
                op: CommOp::AllToAll,
                purpose: CommPurpose::Experts,
                tensor: TensorKind::Routed,
                bytes: x.routed_bytes,
                segments: vec![segment],
                peers: Vec::new(),
                groups: vec![node.devices.clone()],
                pair: None,
            });
            let a2a = self.add_node(Node {
                priority: node.priority,
                ..Node::new(kind, tags, node.devices.clone(), stream, node.batch_div)
            });
            self.graph.add_edge(w[0], a2a, routed);
            self.graph.add_edge(a2a, w[1], routed);
        }
        if pass == Pass::F {
            // The combine reads the routing (dispatch) and the experts'
            // tensors; it hands backward the whole cache.
            let (d, e) = (x.dispatch_saved, x.experts_saved);
            self.graph
                .add_edge(phases[0], last, data(TensorKind::Saved, d));
            self.graph
                .add_edge(phases[1], last, data(TensorKind::Saved, e));
        } else {
            // Every backward phase reads the forward's cache; the combine
            // hands the dispatch phase its output gradient and the weights'
            // gradients.
            let saved: Vec<_> = self
                .graph
                .edges_directed(id.ix(), Direction::Incoming)
                .filter(|e| {
                    matches!(
                        e.weight(),
                        EdgeKind::Data {
                            tensor: TensorKind::Saved,
                            ..
                        }
                    )
                })
                .map(|e| (e.source(), *e.weight()))
                .collect();
            for (f, k) in saved {
                self.graph.add_edge(f, phases[1], k);
                self.graph.add_edge(f, last, k);
            }
            let hidden = self.segments()[segment as usize].cost.act_out_bytes;
            self.graph
                .add_edge(phases[0], last, data(TensorKind::Stash, hidden));
            if pass == Pass::BI {
                self.stash_expert_grads(NodeId::of(phases[1]), NodeId::of(last));
            }
        }
    }

    /// `BI` split into phases: the experts phase hands its output and hidden
    /// gradients to the dispatch phase, which passes them on to `BW`.
    fn stash_expert_grads(&mut self, experts: NodeId, dispatch: NodeId) {
        let Some(x) = self.expert_phases else {
            return;
        };
        let bytes = x.routed_bytes + x.experts_saved / 2;
        self.graph.add_edge(
            experts.ix(),
            dispatch.ix(),
            EdgeKind::Data {
                tensor: TensorKind::Stash,
                bytes,
            },
        );
    }

    /// The expert phase after `id` in its pass (through the all-to-all).
    fn next_phase(&self, id: NodeId) -> Option<NodeId> {
        let a2a = self.succs(id).map(|(n, _)| n).find(|n| {
            matches!(&self.graph[n.ix()].kind,
                NodeKind::Comm(c) if c.purpose == CommPurpose::Experts)
        })?;
        self.succs(a2a)
            .map(|(n, _)| n)
            .find(|n| matches!(self.graph[n.ix()].kind, NodeKind::Compute { .. }))
    }

    /// **shard-tensor** (tensor parallelism, Megatron): the matched
    /// segments run on `devices` together, each device on the whole batch
    /// share with `1/n` of the attention heads (`c_attn` split by output
    /// rows, `c_proj` by input columns) and of the MLP's hidden units (`c_fc`
    /// by rows, `c_proj` by columns); the partial outputs of the row-parallel
    /// layers are summed over the group (Megatron's `g`) and, in backward,
    /// the gradients of the layernorm outputs that feed the column-parallel
    /// layers (`f`'s backward). Layernorms, the row-parallel biases, the
    /// embedding and the head run replicated. The heads and `4·d_model`
    /// must divide by the degree.
    ///
    /// Composes with data parallelism in either order, as a device mesh:
    /// on nodes `replicate` already spread over `R`, the group's shape is
    /// laid on every replica (`R` = [0, 4], `devices` = [0, 1]: groups
    /// [0, 1] and [4, 5]); `replicate` after `shard-tensor` does the same
    /// with the node's group. Gradients are then reduced (or ZeRO-sharded)
    /// over the data-parallel group of each tensor-parallel rank ([0, 4]
    /// and [1, 5]). `stream` names where the reductions belong (today they
    /// run inside the compute op; see docs/internals/runtime.md). A pipeline
    /// applied after moves the groups as `place` does.
    ///
    /// Expert segments (a MoE layer's expert half) on a tensor-parallel
    /// mesh split each replica's sequences over the group instead (Megatron
    /// with expert-tensor-parallel size 1): `shard` must then spread their
    /// experts over the whole mesh (EP = DP × TP), and the group all-gathers
    /// the outputs (forward) and input gradients (backward) and sums the
    /// router's and layernorm's gradients.
    pub fn shard_tensor(
        &mut self,
        f: &Filter,
        devices: &[u32],
        stream: &str,
    ) -> Result<(), DagError> {
        let call = format!(
            "shard-tensor({f}, devices {}, stream {})",
            devices_str(devices),
            quote(stream)
        );
        let (devs, compute) = self.devices_and_compute(f, devices, stream, &call)?;
        self.charge_rewire(&call, &compute, devs.len())?;
        let invalid = |m: String| {
            Err(DagError::new(
                call.clone(),
                DagErrorKind::InvalidArgument(m),
            ))
        };
        let n = devs.len() as u32;
        if let Err(m) = self.model.tensor_split(n) {
            return invalid(m);
        }
        if let Some(id) = compute.iter().find(|id| {
            self.graph[id.ix()]
                .replica
                .is_some_and(|r| self.specs[r as usize].expert_parallel.is_some())
        }) {
            return invalid(format!(
                "{} is already sharded by expert parallelism: shard-tensor before shard (`tp` first, then `ep`, which spreads the experts over the dp × tp mesh)",
                self.label(*id)
            ));
        }
        if let Some(id) = compute
            .iter()
            .find(|id| self.graph[id.ix()].context_parallel.is_some())
        {
            return invalid(format!(
                "{} is already context-parallel: shard-tensor before context-parallel (`tp` first, then `cp`: tensor-parallel groups are the mesh's innermost axis)",
                self.label(*id)
            ));
        }
        if let Some(id) = compute.iter().find(|id| {
            let node = &self.graph[id.ix()];
            node.replica.is_some() && node.tensor_parallel.is_some()
        }) {
            return invalid(format!(
                "{} is already tensor-parallel over its replicas' groups {}: shard-tensor it once",
                self.label(*id),
                self.devices_label(*id)
            ));
        }
        self.check_paired(&call, &compute)?;
        // A replicated node gets the group's shape on every replica: its
        // replica on device r runs on `r + (d − devices[0])` for each d.
        let meshes = compute
            .iter()
            .map(|&id| {
                let node = &self.graph[id.ix()];
                match node.replica {
                    Some(_) => self.lay_mesh(id, &node.devices, &devs, &call),
                    None => Ok(devs.clone()),
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let s = self.stream_id(stream);
        let p2p_stream = self.tied_stream;
        for (&id, mesh) in compute.iter().zip(meshes) {
            let node = &mut self.graph[id.ix()];
            node.devices = mesh;
            node.tensor_parallel = (n > 1).then_some(TensorParallel {
                stream: s,
                degree: n,
                sequence: false,
            });
        }
        for &id in &compute {
            self.rewire_p2p(id, p2p_stream);
        }
        self.touch();
        Ok(())
    }

    /// **context-parallel** (Megatron's and torchtitan's context
    /// parallelism): each replica of the matched compute nodes (its
    /// tensor-parallel group, or its device) becomes `degree` replicas that
    /// run one batch share together, each holding two of `2·degree` chunks
    /// of every sequence (chunks `r` and `2·degree − 1 − r`: the causal
    /// triangle's work evenly spread). Attention meets the group's keys and
    /// values by `exchange`: around a ring (each block passed on while the
    /// one in hand is attended to, partial outputs merged by their
    /// log-sum-exp; in backward the key and value gradients travel with
    /// their block back to its holder) or all-gathered (the packed q/k/v
    /// gathered in forward and again in backward, the gradients
    /// reduce-scattered back). Everything else is per token. Positions
    /// (learned or rotary) are the chunks' own; the loss sums every
    /// member's tokens.
    ///
    /// Replica `r`'s new replicas sit `tp` devices apart after it (the
    /// mesh's axes from the fastest: tp, cp, then pipeline and data
    /// parallelism: tp 2 × cp 2 on [0, 1] gives [0, 1, 2, 3]). Gradients
    /// are reduced, or ZeRO-sharded, over the data- and context-parallel
    /// replicas together (Megatron's dp × cp group); on a node not yet
    /// replicated, `context-parallel` adds that reduction (bucketed at 25
    /// MiB on `stream`), and `replicate` afterwards (`dp`, `zero`) lays the
    /// whole tp × cp block on each of its replicas and sets its own.
    /// Expert segments hold the same chunks (routing is per token; their
    /// balance loss sums each sequence's statistics over the group), and
    /// `shard` afterwards spreads their experts over the whole mesh.
    /// Apply after `shard-tensor` and before `shard` and `recompute`;
    /// `stream` names where the exchanges belong (they run inside the
    /// attention, as tensor parallelism's do). Returns how many nodes it
    /// changed. The sequence must split into `2·degree` chunks and the
    /// model must run the memory-efficient attention (checked when the plan
    /// is compiled).
    pub fn context_parallel(
        &mut self,
        f: &Filter,
        degree: u32,
        exchange: KvExchange,
        stream: &str,
    ) -> Result<u32, DagError> {
        let how = match exchange {
            KvExchange::Ring => "ring",
            KvExchange::AllGather => "all-gather",
        };
        let call = format!(
            "context-parallel({f}, {degree}, {how}, stream {})",
            quote(stream)
        );
        self.check_not_recomputed(&call)?;
        Self::check_stream(stream, "stream", &call)?;
        self.check_names(&call, &[], &[stream])?;
        let ids = self.select(f, &call)?;
        let compute = self.compute_only(f, ids, &call)?;
        let invalid = |m: String| {
            Err(DagError::new(
                call.clone(),
                DagErrorKind::InvalidArgument(m),
            ))
        };
        let cluster = self.cluster_info().devices;
        if degree == 0 || degree > cluster {
            return invalid(format!(
                "a context-parallel degree of {degree} on {cluster} devices: give 1 to {cluster}"
            ));
        }
        let seq = self.model.seq_len;
        if !seq.is_multiple_of(2 * degree) {
            return invalid(format!(
                "sequences of {seq} tokens do not split into 2 × {degree} equal chunks: give a sequence length divisible by {}",
                2 * degree
            ));
        }
        let widest = compute
            .iter()
            .map(|id| self.graph[id.ix()].devices.len().max(1))
            .max()
            .unwrap_or(1);
        self.charge_rewire(&call, &compute, widest.saturating_mul(degree as usize))?;
        self.check_paired(&call, &compute)?;
        for id in &compute {
            let node = &self.graph[id.ix()];
            if node.context_parallel.is_some() {
                return invalid(format!(
                    "{} is already context-parallel over {} replicas: apply context-parallel once",
                    self.label(*id),
                    node.cp_degree()
                ));
            }
            let sharded = node
                .replica
                .is_some_and(|r| self.specs[r as usize].expert_parallel.is_some());
            if sharded {
                return invalid(format!(
                    "{}'s experts are already sharded over {}: apply context-parallel before shard (`cp` before `ep`), so that the experts spread over the data- and context-parallel replicas together",
                    self.label(*id),
                    self.devices_label(*id)
                ));
            }
        }
        if degree == 1 {
            return Ok(0);
        }
        // Each replica (tensor-parallel group) gets `degree − 1` copies of
        // its shape, `tp` devices apart.
        // A node not placed yet starts from device 0.
        let mut meshes = Vec::with_capacity(compute.len());
        for &id in &compute {
            let node = &self.graph[id.ix()];
            let tp = node.tp_degree() as usize;
            let mut seen = HashSet::new();
            let mut mesh = Vec::with_capacity(node.devices.len() * degree as usize);
            let unplaced = [DeviceId(0)];
            let units = match node.devices.is_empty() {
                true => &unplaced[..],
                false => &node.devices[..],
            };
            for unit in units.chunks(tp) {
                for k in 0..degree as usize {
                    for d in unit {
                        let at = d.0 as usize + k * tp;
                        if at >= cluster as usize || !seen.insert(at) {
                            let why = match at >= cluster as usize {
                                true => {
                                    format!("device {at} does not exist, the cluster has {cluster}")
                                }
                                false => format!("device {at} twice"),
                            };
                            return invalid(format!(
                                "{}: {degree} context-parallel replicas of each of its groups {} ({tp} devices apart) give {why}: tp × cp must fit between its data-parallel replicas (apply cp before a pipeline, and give dp a stride of tp × cp or leave room)",
                                self.label(id),
                                self.devices_label(id)
                            ));
                        }
                        mesh.push(DeviceId(at as u32));
                    }
                }
            }
            meshes.push(mesh);
        }
        let s = self.stream_id(stream);
        let spec = ReplicaSpec {
            zero: 0,
            bucket_bytes: 25 << 20,
            reduce_stream: s,
            gather_stream: s,
            reshard_after_forward: false,
            expert_parallel: None,
        };
        let p2p_stream = self.tied_stream;
        for (&id, mesh) in compute.iter().zip(meshes) {
            if self.graph[id.ix()].replica.is_none() {
                let rep = match self.specs.iter().position(|x| *x == spec) {
                    Some(i) => i as u32,
                    None => {
                        self.specs.push(spec.clone());
                        (self.specs.len() - 1) as u32
                    }
                };
                self.graph[id.ix()].replica = Some(rep);
            }
            let node = &mut self.graph[id.ix()];
            node.devices = mesh;
            node.context_parallel = Some(ContextParallel {
                stream: s,
                degree,
                exchange,
            });
        }
        for &id in &compute {
            self.rewire_p2p(id, p2p_stream);
        }
        self.touch();
        Ok(compute.len() as u32)
    }

    /// **sequence-parallel** (Megatron-SP): inside the segments of the
    /// matched compute nodes, every tensor-parallel rank keeps `1/tp` of
    /// the residual stream's rows (contiguous rows of the batch's tokens)
    /// and runs the layernorms on them; the group all-gathers a norm's
    /// output before the column-parallel layers and reduce-scatters the
    /// row-parallel outputs onto the residual shard, in place of
    /// `shard-tensor`'s all-reduce (backward mirrors it). A segment's input
    /// and output stay whole, as the embedding and the head run whole, so
    /// pipeline messages are unchanged. It covers every node of those
    /// segments (each pass and microbatch, and later copies); expert
    /// segments, which split sequences on their own, are left as they are.
    /// Returns how many segments it turned on. Apply it after
    /// `shard-tensor`; the tokens of a microbatch replica must divide by
    /// the degree (checked when the plan is compiled).
    pub fn sequence_parallel(&mut self, f: &Filter) -> Result<u32, DagError> {
        let call = format!("sequence-parallel({f})");
        self.check_not_recomputed(&call)?;
        let ids = self.select(f, &call)?;
        let compute = self.compute_only(f, ids, &call)?;
        // Every node is visited once more to cover the matched segments.
        self.charge(&call, self.node_count() as u64)?;
        let is_experts = |dag: &Self, s: u32| {
            dag.segments
                .get(s as usize)
                .is_some_and(|seg| seg.expert_block.is_some())
        };
        let mut segs: Vec<u32> = compute
            .iter()
            .filter_map(|id| match self.graph[id.ix()].kind {
                NodeKind::Compute { segment, .. } => Some(segment),
                _ => None,
            })
            .filter(|s| !is_experts(self, *s))
            .collect();
        segs.sort_unstable();
        segs.dedup();
        if segs.is_empty() {
            return Err(DagError::new(
                call,
                DagErrorKind::InvalidArgument(format!(
                    "{} holds only expert halves, which split sequences over a tensor-parallel group on their own",
                    self.label(compute[0])
                )),
            ));
        }
        let members: Vec<NodeId> = self
            .node_ids()
            .filter(|id| {
                matches!(self.graph[id.ix()].kind,
                    NodeKind::Compute { segment, .. } if segs.binary_search(&segment).is_ok())
            })
            .collect();
        if let Some(id) = members
            .iter()
            .find(|id| self.graph[id.ix()].tp_degree() < 2)
        {
            return Err(DagError::new(
                call,
                DagErrorKind::InvalidArgument(format!(
                    "{} is not tensor-parallel: shard-tensor its segment first (sequence parallelism splits a tensor-parallel group's norms and residual)",
                    self.label(*id)
                )),
            ));
        }
        let mut changed = 0u32;
        for id in members {
            if let Some(t) = self.graph[id.ix()].tensor_parallel.as_mut() {
                changed += u32::from(!t.sequence);
                t.sequence = true;
            }
        }
        if changed > 0 {
            self.touch();
        }
        Ok(segs.len() as u32)
    }

    /// **order**: on one device (group), run the nodes of `groups[i]` before
    /// those of `groups[i+1]`: temporal edges from the sinks of group i to the
    /// sources of group i+1 (through an order marker when that is fewer edges).
    /// A group of several filters is one set whose members may interleave. A
    /// filter on `PASS: BI` or `PASS: BW` splits the matching fused `B` nodes
    /// into backward-for-input and backward-for-weight first.
    pub fn order(&mut self, groups: &[Vec<Filter>]) -> Result<(), DagError> {
        let call = order_call(groups);
        if groups.len() < 2 {
            return Err(DagError::new(
                call,
                DagErrorKind::InvalidArgument(format!(
                    "order needs at least 2 groups, got {}",
                    groups.len()
                )),
            ));
        }
        if let Some(i) = groups.iter().position(|g| g.is_empty()) {
            return Err(DagError::new(
                call,
                DagErrorKind::InvalidArgument(format!("group {i} has no filter")),
            ));
        }
        self.sync_for(&call)?;
        let mut resolved = Vec::new();
        for g in groups {
            let mut rg = Vec::new();
            for f in g {
                rg.push((f, self.resolve(f, &call)?));
            }
            resolved.push(rg);
        }
        // Backward splits asked for by BI/BW filters.
        let mut to_split: Vec<NodeId> = Vec::new();
        for g in groups {
            for f in g {
                if matches!(f.pass, Some(Label::BI | Label::BW)) {
                    let fb = f.clone().pass(Label::B);
                    let r = self.resolve(&fb, &call)?;
                    to_split.extend(self.select_resolved(&r, &call)?);
                }
            }
        }
        to_split.sort_unstable();
        to_split.dedup();
        // A failure after the backward splits restores this copy (the
        // clone visits every node and edge; each split adds a node and a
        // few edges).
        let snapshot = if to_split.is_empty() {
            None
        } else {
            let n = to_split.len() as u64;
            self.check_growth(&call, n, n.saturating_mul(8))?;
            self.charge(
                &call,
                (self.node_count() + self.edge_count()) as u64 + n.saturating_mul(8),
            )?;
            self.charge_bytes(&call, self.held_bytes())?;
            Some(self.clone())
        };
        let restore = |dag: &mut TrainingDag, snapshot: Option<TrainingDag>| {
            if let Some(mut s) = snapshot {
                // Keep the work spent: the budget is not part of the DAG.
                s.meter = std::mem::take(&mut dag.meter);
                *dag = s;
            }
        };
        for &b in &to_split {
            self.split_backward(b);
        }
        match self.order_edges(&call, &resolved) {
            Ok(()) => Ok(()),
            Err(e) => {
                restore(self, snapshot);
                Err(e)
            }
        }
    }

    /// The second half of `order`: select the groups, check they share one
    /// device group, plan the temporal edges (and markers), prove the result
    /// acyclic with the planned edges as virtual ones, then add them. Nothing
    /// is changed when this fails.
    fn order_edges(
        &mut self,
        call: &str,
        resolved: &[Vec<(&Filter, super::primitives::Resolved)>],
    ) -> Result<(), DagError> {
        let sets = self.order_sets(call, resolved)?;
        let devs = self.one_device_group(call, &sets)?;
        // Boundaries visit each member's edges (at most every edge twice),
        // and the sinks' out-edges are read once more for the edges they
        // have: at most every edge three times.
        let members: u64 = sets.iter().map(|s| s.len() as u64).sum();
        self.charge(call, members.saturating_add(3 * self.edge_count() as u64))?;
        let bound = self.graph.node_bound();
        let (planned, markers) = self.plan_order_edges(call, &sets, bound)?;
        self.check_growth(call, markers as u64, planned.len() as u64)?;
        self.charge(
            call,
            (self.node_count() + self.edge_count() + markers + planned.len()) as u64,
        )?;
        // The proof's passes: arrays over nodes and edges, and the plan.
        let proof = (self.graph.node_bound() + self.graph.edge_bound() + markers) as u64;
        self.charge_bytes(
            call,
            proof
                .saturating_mul(PROOF_BYTES)
                .saturating_add((planned.len() as u64).saturating_mul(PROOF_BYTES * 2)),
        )?;
        let pos = match self.prove_acyclic(&planned, markers) {
            Ok(pos) => pos,
            Err(cycle) => {
                let cycle = cycle
                    .iter()
                    .map(|&n| {
                        if n >= bound {
                            "marker".to_string()
                        } else {
                            self.label(NodeId(n as u32))
                        }
                    })
                    .collect();
                return Err(DagError::new(call, DagErrorKind::Cycle { cycle }));
            }
        };
        // Proven acyclic: add the markers and edges.
        let mut ids = Vec::with_capacity(markers);
        for _ in 0..markers {
            ids.push(self.add_node(Node::new(
                NodeKind::Marker,
                Default::default(),
                devs.clone(),
                super::COMPUTE,
                1,
            )));
        }
        let at = |i: usize| {
            if i >= bound {
                ids[i - bound]
            } else {
                petgraph::stable_graph::NodeIndex::new(i)
            }
        };
        for &(a, b) in &planned {
            self.graph.add_edge(at(a), at(b), EdgeKind::Temporal);
        }
        self.keep_edges(&planned, &ids, pos);
        Ok(())
    }

    /// Each order group's nodes, sorted and each once; a filter that
    /// matches nothing is an error naming it.
    fn order_sets(
        &self,
        call: &str,
        resolved: &[Vec<(&Filter, super::primitives::Resolved)>],
    ) -> Result<Vec<Vec<NodeId>>, DagError> {
        let mut sets: Vec<Vec<NodeId>> = Vec::new();
        for rg in resolved {
            let mut set = Vec::new();
            // Deduplicated whenever it doubles: a group of many filters
            // matching the same nodes holds about its union, not every match.
            let mut unique = 0;
            for (f, r) in rg {
                let m = self.select_resolved(r, call)?;
                if m.is_empty() {
                    return Err(DagError::new(
                        call,
                        DagErrorKind::NoMatch {
                            filter: f.to_string(),
                        },
                    ));
                }
                set.extend(m);
                if set.len() > 2 * unique.max(1024) {
                    set.sort_unstable();
                    set.dedup();
                    unique = set.len();
                }
            }
            set.sort_unstable();
            set.dedup();
            sets.push(set);
        }
        Ok(sets)
    }

    /// The one device group every ordered node runs on (an order is per
    /// device group); an unplaced node or another group is an error.
    fn one_device_group(
        &self,
        call: &str,
        sets: &[Vec<NodeId>],
    ) -> Result<Vec<super::DeviceId>, DagError> {
        let first = sets[0][0];
        let devs = self.graph[first.ix()].devices.clone();
        for &id in sets.iter().flatten() {
            let d = &self.graph[id.ix()].devices;
            if d.is_empty() {
                return Err(DagError::new(
                    call,
                    DagErrorKind::Unplaced {
                        node: self.label(id),
                    },
                ));
            }
            if *d != devs {
                return Err(DagError::new(
                    call,
                    DagErrorKind::CrossDevice {
                        a: self.label(first),
                        a_devices: devs.iter().map(|d| d.0).collect(),
                        b: self.label(id),
                        b_devices: d.iter().map(|d| d.0).collect(),
                    },
                ));
            }
        }
        Ok(devs)
    }

    /// The temporal edges between consecutive groups: from each group's
    /// sinks to the next one's sources, directly, or through a marker
    /// (virtual node ids from `bound` up) where that is fewer edges. Returns
    /// the edges as node indices and the markers needed. A node that is both
    /// a sink and the next group's source would order itself after itself.
    fn plan_order_edges(
        &self,
        call: &str,
        sets: &[Vec<NodeId>],
        bound: usize,
    ) -> Result<(Vec<(usize, usize)>, usize), DagError> {
        let mut markers = 0usize;
        let mut planned: Vec<(usize, usize)> = Vec::new();
        for w in sets.windows(2) {
            let sinks = self.boundary(&w[0], Direction::Outgoing);
            let sources = self.boundary(&w[1], Direction::Incoming);
            // Both sorted (their sets are): a node in both is found by
            // bisection, not by a scan per sink.
            if let Some(&n) = sinks.iter().find(|s| sources.binary_search(s).is_ok()) {
                let cycle = vec![self.label(n), self.label(n)];
                return Err(DagError::new(call, DagErrorKind::Cycle { cycle }));
            }
            if sinks.len() * sources.len() > sinks.len() + sources.len() {
                let m = bound + markers;
                markers += 1;
                planned.extend(sinks.iter().map(|s| (s.ix().index(), m)));
                planned.extend(sources.iter().map(|t| (m, t.ix().index())));
            } else {
                // The edges a sink has already, looked up by bisection: a
                // scan of them per source would cost its degree each time
                // (a hub ordered before 10^5 nodes, then before 10^5 more,
                // scanned its 10^5 edges 10^5 times). Each sink's edges are
                // read once: within the charge for visiting every edge.
                for &s in &sinks {
                    let mut has: Vec<u32> = self
                        .graph
                        .edges_directed(s.ix(), Direction::Outgoing)
                        .map(|e| e.target().index() as u32)
                        .collect();
                    has.sort_unstable();
                    for &t in &sources {
                        if has.binary_search(&(t.ix().index() as u32)).is_err() {
                            planned.push((s.ix().index(), t.ix().index()));
                        }
                    }
                }
            }
        }
        Ok((planned, markers))
    }

    /// Nodes of `set` (sorted) with no successor (Outgoing) / predecessor
    /// (Incoming) inside the set.
    fn boundary(&self, set: &[NodeId], dir: Direction) -> Vec<NodeId> {
        debug_assert!(set.windows(2).all(|w| w[0] < w[1]));
        set.iter()
            .copied()
            .filter(|id| {
                !self.graph.edges_directed(id.ix(), dir).any(|e| {
                    let other = if dir == Direction::Outgoing {
                        e.target()
                    } else {
                        e.source()
                    };
                    set.binary_search(&NodeId::of(other)).is_ok()
                })
            })
            .collect()
    }

    /// Split a fused backward node into `BI` (this node) and a new `BW`.
    fn split_backward(&mut self, b: NodeId) {
        let node = &mut self.graph[b.ix()];
        let NodeKind::Compute {
            pass,
            segment,
            phase,
        } = &mut node.kind
        else {
            return;
        };
        if *pass != Pass::B {
            return;
        }
        *pass = Pass::BI;
        let segment = *segment;
        // Of an expert backward split into phases, only the last (dispatch)
        // gets the `BW`; the experts phase stashes for it.
        match *phase {
            Some(ExpertPhase::Combine) => {
                self.index_label(b);
                return;
            }
            Some(ExpertPhase::Experts) => {
                self.index_label(b);
                if let Some(d) = self.next_phase(b) {
                    self.stash_expert_grads(b, d);
                }
                return;
            }
            _ => {}
        }
        let mut bw = node.clone();
        bw.kind = NodeKind::Compute {
            pass: Pass::BW,
            segment,
            phase: None,
        };
        if let Some(part) = self.find_tag("PART") {
            bw.tags.remove(part);
        }
        self.index_label(b);
        let bw = self.add_node(bw);
        // BW needs the inputs of the segment's matmuls and layernorms and the
        // output gradients: BI (the saved tensors' last reader) hands both on.
        let seg = &self.segments()[segment as usize];
        let stash_bytes = seg.cost.stash_bytes;
        self.graph.add_edge(
            b.ix(),
            bw,
            EdgeKind::Data {
                tensor: TensorKind::Stash,
                bytes: stash_bytes,
            },
        );
        // The backward is complete when BW is: temporal successors move to BW.
        let temporal_out: Vec<_> = self
            .graph
            .edges_directed(b.ix(), Direction::Outgoing)
            .filter(|e| matches!(e.weight(), EdgeKind::Temporal))
            .map(|e| (e.id(), e.target()))
            .collect();
        for (e, t) in temporal_out {
            self.graph.remove_edge(e);
            self.graph.add_edge(bw, t, EdgeKind::Temporal);
        }
        // Weight gradients now come from BW: move them (derived nodes stay valid;
        // ZeRO-3 gathers keep feeding BI, which reads the weights).
        let grads: Vec<_> = self
            .graph
            .edges_directed(b.ix(), Direction::Outgoing)
            .filter(|e| {
                matches!(
                    e.weight(),
                    EdgeKind::Data {
                        tensor: TensorKind::ParamGrad | TensorKind::MicroGrad,
                        ..
                    }
                )
            })
            .map(|e| (e.id(), e.target(), *e.weight()))
            .collect();
        for (e, t, k) in grads {
            self.graph.remove_edge(e);
            self.graph.add_edge(bw, t, k);
        }
    }

    /// Replace the send/recv pairs around `id` and insert the ones its data
    /// edges now need.
    pub(crate) fn rewire_p2p(&mut self, id: NodeId, stream: StreamId) {
        // One pass over the edges: pipeline pairs adjacent to `id` and the
        // data edges that cross groups of equal size; the pairs are
        // collapsed first (and the edges then read again).
        type Crossing = Vec<(petgraph::stable_graph::EdgeIndex, NodeId, NodeId, EdgeKind)>;
        let scan = |dag: &TrainingDag| -> (Vec<NodeId>, Crossing) {
            let (mut adjacent, mut crossing) = (Vec::new(), Vec::new());
            let edges = dag
                .graph
                .edges_directed(id.ix(), Direction::Incoming)
                .chain(dag.graph.edges_directed(id.ix(), Direction::Outgoing));
            for e in edges {
                let (u, v) = (e.source(), e.target());
                let (a, b) = (&dag.graph[u], &dag.graph[v]);
                let other = if u == id.ix() { (v, b) } else { (u, a) };
                if matches!(&other.1.kind, NodeKind::Comm(c) if c.purpose == CommPurpose::Pipeline)
                {
                    adjacent.push(NodeId::of(other.0));
                }
                if matches!(e.weight(), EdgeKind::Data { .. })
                    && matches!(a.kind, NodeKind::Compute { .. })
                    && matches!(b.kind, NodeKind::Compute { .. })
                    && !a.devices.is_empty()
                    && !b.devices.is_empty()
                    && a.devices != b.devices
                    && a.devices.len() == b.devices.len()
                {
                    crossing.push((e.id(), NodeId::of(u), NodeId::of(v), *e.weight()));
                }
            }
            (adjacent, crossing)
        };
        let (adjacent, mut cross) = scan(self);
        for &c in &adjacent {
            if self.graph.node_weight(c.ix()).is_none() {
                continue;
            }
            let NodeKind::Comm(comm) = &self.graph[c.ix()].kind else {
                continue;
            };
            let (send, recv) = match comm.op {
                CommOp::Send => (c, comm.pair.expect("send has a pair")),
                _ => (comm.pair.expect("recv has a pair"), c),
            };
            let from: Vec<(NodeId, EdgeKind)> = self
                .preds(send)
                .filter(|(_, k)| matches!(k, EdgeKind::Data { .. }))
                .collect();
            let to: Vec<(NodeId, EdgeKind)> = self
                .succs(recv)
                .filter(|(_, k)| matches!(k, EdgeKind::Data { .. }))
                .collect();
            for (u, k) in &from {
                for (v, _) in &to {
                    self.graph.add_edge(u.ix(), v.ix(), *k);
                }
            }
            self.graph.remove_node(send.ix());
            self.graph.remove_node(recv.ix());
        }
        if !adjacent.is_empty() {
            cross = scan(self).1;
        }
        // Insert pairs for the crossing data edges.
        for (e, u, v, k) in cross {
            let EdgeKind::Data { tensor, bytes } = k else {
                continue;
            };
            self.graph.remove_edge(e);
            let (un, vn) = (&self.graph[u.ix()], &self.graph[v.ix()]);
            let seg = |n: &Node| match n.kind {
                NodeKind::Compute { segment, .. } => vec![segment],
                _ => vec![],
            };
            let mk = |op, base: &Node, peers: &[DeviceId], segments| {
                let kind = NodeKind::Comm(Comm {
                    op,
                    purpose: CommPurpose::Pipeline,
                    tensor,
                    bytes,
                    segments,
                    peers: peers.to_vec(),
                    groups: Vec::new(),
                    pair: None,
                });
                let (tags, devices) = (base.tags.clone(), base.devices.clone());
                let mut node = Node::new(kind, tags, devices, stream, base.batch_div);
                // Every rank of a tensor-parallel group sends (receives) its
                // replica's whole activation: one batch share per group.
                node.tensor_parallel = base.tensor_parallel;
                node.context_parallel = base.context_parallel;
                node
            };
            let (send, recv) = (
                mk(CommOp::Send, un, &vn.devices, seg(un)),
                mk(CommOp::Recv, vn, &un.devices, seg(vn)),
            );
            let (send, recv) = (self.add_node(send), self.add_node(recv));
            if let NodeKind::Comm(c) = &mut self.graph[send].kind {
                c.pair = Some(NodeId::of(recv));
            }
            if let NodeKind::Comm(c) = &mut self.graph[recv].kind {
                c.pair = Some(NodeId::of(send));
            }
            self.graph.add_edge(u.ix(), send, k);
            self.graph.add_edge(send, recv, EdgeKind::Peer);
            self.graph.add_edge(recv, v.ix(), k);
        }
    }
}

/// `order([{..} | {..}, {..}, …])`, shortened for long schedules.
fn order_call(groups: &[Vec<Filter>]) -> String {
    // At most 16 filters of a group, then their count.
    let show: Vec<String> = groups
        .iter()
        .take(6)
        .map(|g| {
            let mut s = g
                .iter()
                .take(16)
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join(" | ");
            if g.len() > 16 {
                s.push_str(&format!(" | … ({} filters)", g.len()));
            }
            s
        })
        .collect();
    let more = if groups.len() > 6 {
        format!(", … ({} groups)", groups.len())
    } else {
        String::new()
    };
    format!("order([{}{more}])", show.join(", "))
}
