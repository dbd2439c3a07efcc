//! The host side of the WIT interfaces: each `training-dag` method checks the
//! plugin's call budget, converts WIT values to the DAG's types, runs the
//! directive or primitive, and converts the result back.

use super::bindings::piper::strategy::{dag as wdag, log as wlog, types as wit};
use super::{Cause, DagHandle, PluginState};
use crate::dag::{self, DagError, DagErrorKind, Filter, NodeId, ReplicateOptions, TagMatch};
use wasmtime::component::Resource;

type R<T> = wasmtime::Result<Result<T, wit::DagError>>;

/// The DAG's filter from the WIT's. `PASS` is a string at the edge: a
/// name outside [`dag::PASS_VALUES`] is the plugin's error, named with the
/// call it came with.
fn filter(f: wit::Filter, call: &str) -> Result<Filter, DagError> {
    let pass = match f.pass {
        Some(p) => Some(
            p.parse::<dag::Label>()
                .map_err(|m| DagError::new(call, DagErrorKind::InvalidArgument(m)))?,
        ),
        None => None,
    };
    Ok(Filter {
        tags: f
            .tags
            .into_iter()
            .map(|t| {
                (
                    t.key,
                    match t.value {
                        wit::TagMatch::Any => TagMatch::Any,
                        wit::TagMatch::Index(i) => TagMatch::Index(i),
                    },
                )
            })
            .collect(),
        pass,
    })
}

fn wit_error(e: &DagError, m: String) -> wit::DagError {
    match e.kind {
        DagErrorKind::UnknownTag { .. } => wit::DagError::UnknownTag(m),
        DagErrorKind::NoMatch { .. } => wit::DagError::NoMatch(m),
        DagErrorKind::WrongKind { .. } => wit::DagError::WrongKind(m),
        DagErrorKind::DeviceOutOfRange { .. } => wit::DagError::DeviceOutOfRange(m),
        DagErrorKind::EmptyDevices => wit::DagError::EmptyDevices(m),
        DagErrorKind::DuplicateDevice { .. } => wit::DagError::DuplicateDevice(m),
        DagErrorKind::Cycle { .. } => wit::DagError::Cycle(m),
        DagErrorKind::CrossDevice { .. } => wit::DagError::CrossDevice(m),
        DagErrorKind::Unplaced { .. } => wit::DagError::Unplaced(m),
        DagErrorKind::NonContiguous { .. } => wit::DagError::NonContiguous(m),
        DagErrorKind::AlreadySplit { .. } => wit::DagError::AlreadySplit(m),
        DagErrorKind::Unpaired { .. } => wit::DagError::Unpaired(m),
        DagErrorKind::UnknownNode { .. } => wit::DagError::UnknownNode(m),
        DagErrorKind::InvalidArgument(_) => wit::DagError::InvalidArgument(m),
        DagErrorKind::Unsupported { .. } => wit::DagError::Unsupported(m),
        DagErrorKind::Limit { .. } => wit::DagError::Limit(m),
    }
}

fn info(n: dag::NodeInfo) -> wit::NodeInfo {
    wit::NodeInfo {
        id: n.id.0,
        op: n.op,
        tags: n
            .tags
            .into_iter()
            .map(|(key, index)| wit::Tag { key, index })
            .collect(),
        devices: n.devices,
        stream: n.stream,
        priority: n.priority,
        segments: n.segments,
        cost: wit::NodeCost {
            flops: n.cost.flops,
            param_bytes: n.cost.param_bytes,
            act_in_bytes: n.cost.act_in_bytes,
            act_out_bytes: n.cost.act_out_bytes,
            saved_bytes: n.cost.saved_bytes,
            comm_bytes: n.cost.comm_bytes,
        },
    }
}

fn neighbour(n: dag::Neighbour) -> wit::Neighbour {
    wit::Neighbour {
        node: n.node.0,
        edge: match n.edge {
            dag::EdgeKind::Data { .. } => wit::EdgeKind::Data,
            dag::EdgeKind::Temporal => wit::EdgeKind::Temporal,
            dag::EdgeKind::Peer => wit::EdgeKind::Peer,
        },
    }
}

/// Bytes of arguments copied into the host that cost one unit of host work.
const BYTES_PER_UNIT: usize = 16;

/// A string argument's own bytes besides its text (its header and
/// allocation, and a filter tag's match beside it).
const STRING_BYTES: u64 = 48;

/// What a call's arguments weigh: strings and list lengths, checked against
/// the host budget before anything else is done with them.
#[derive(Default)]
struct Args<'a> {
    strings: Vec<&'a str>,
    lists: Vec<(&'static str, usize)>,
}

impl<'a> Args<'a> {
    fn filter(mut self, f: &'a wit::Filter) -> Self {
        self.lists.push(("filter tags", f.tags.len()));
        self.strings.extend(f.tags.iter().map(|t| t.key.as_str()));
        self.strings.extend(f.pass.as_deref());
        self
    }
    fn string(mut self, s: &'a str) -> Self {
        self.strings.push(s);
        self
    }
    fn list(mut self, what: &'static str, len: usize) -> Self {
        self.lists.push((what, len));
        self
    }
}

impl PluginState {
    /// Count a host call; stop the plugin (trap) past the budget.
    fn count_call(&mut self) -> wasmtime::Result<()> {
        self.calls += 1;
        if self.calls > self.max_calls {
            self.stop = Some(Cause::HostCalls(self.max_calls));
            wasmtime::bail!("host-call budget of {} spent", self.max_calls);
        }
        Ok(())
    }

    /// Count the call, check the handle and the arguments' sizes. The outer
    /// error traps (call budget, a forged handle); the inner one is a
    /// `limit` error returned to the plugin.
    fn enter(&mut self, handle: &Resource<DagHandle>, args: Args) -> R<()> {
        self.count_call()?;
        self.table.get(handle)?;
        let l = &self.limits;
        let refuse = |what: String| {
            let m = format!("over the host budget {what}");
            Ok(Err(m))
        };
        let r: wasmtime::Result<Result<(), String>> = (|| {
            for (what, len) in &args.lists {
                if *len > l.max_list_len {
                    return refuse(format!(
                        "`sandbox.max_list_len` = {}: a list of {len} {what}",
                        l.max_list_len
                    ));
                }
            }
            if args.strings.len() > l.max_list_len {
                return refuse(format!(
                    "`sandbox.max_list_len` = {}: {} names in one call",
                    l.max_list_len,
                    args.strings.len()
                ));
            }
            if let Some(s) = args.strings.iter().find(|s| s.len() > l.max_string_bytes) {
                return refuse(format!(
                    "`sandbox.max_string_bytes` = {}: a string of {} bytes",
                    l.max_string_bytes,
                    s.len()
                ));
            }
            Ok(Ok(()))
        })();
        let r = match r? {
            // Lifting the arguments copied them: charge their bytes, as work
            // and as memory (the lifted copy and the host's own).
            Ok(()) => {
                let bytes: usize = args.strings.iter().map(|s| s.len()).sum::<usize>()
                    + args.lists.iter().map(|(_, n)| n * 4).sum::<usize>();
                let held = (bytes as u64)
                    .saturating_add((args.strings.len() as u64).saturating_mul(STRING_BYTES))
                    .saturating_mul(2);
                let dag = self.dag();
                dag.begin_call();
                dag.charge_public("reading the arguments", (bytes / BYTES_PER_UNIT) as u64)
                    .and_then(|()| dag.charge_bytes_public("reading the arguments", held))
                    .map_err(|e| e.to_string())
            }
            Err(m) => Err(m),
        };
        Ok(r.map_err(|m| {
            self.last_directive_error = Some((m.clone(), true));
            wit::DagError::Limit(super::clip(m, self.limits.max_error_bytes))
        }))
    }

    fn dag(&mut self) -> &mut dag::TrainingDag {
        self.dag.as_mut().expect("apply has a DAG")
    }

    /// Convert a directive result, remembering errors for the final report;
    /// messages are cut to `sandbox.max_error_bytes`.
    fn done<T>(&mut self, r: Result<T, DagError>) -> R<T> {
        let max = self.limits.max_error_bytes;
        Ok(r.map_err(|e| {
            let limit = matches!(e.kind, DagErrorKind::Limit { .. });
            let m = super::clip(e.to_string(), max);
            self.last_directive_error = Some((m.clone(), limit));
            wit_error(&e, m)
        }))
    }

    /// Refuse a result list longer than `sandbox.max_list_len`.
    fn bound_result(&mut self, call: &str, len: usize) -> R<()> {
        let max = self.limits.max_list_len;
        if len <= max {
            return Ok(Ok(()));
        }
        self.done(Err(DagError::new(
            call,
            DagErrorKind::Limit {
                budget: "sandbox.max_list_len",
                limit: max as u64,
                request: format!("the result would list {len} items"),
            },
        )))
    }
}

/// `?` for the nested result: return the inner error to the plugin.
macro_rules! check {
    ($e:expr) => {
        match $e? {
            Ok(v) => v,
            Err(err) => return Ok(Err(err)),
        }
    };
}

impl wit::Host for PluginState {}
impl wdag::Host for PluginState {}

impl wdag::HostTrainingDag for PluginState {
    fn split(&mut self, h: Resource<DagHandle>, f: wit::Filter, dim: String, n: u32) -> R<()> {
        check!(self.enter(&h, Args::default().filter(&f).string(&dim)));
        let f = check!(self.done(filter(f, "split")));
        let r = self.dag().split(&f, &dim, n);
        self.done(r)
    }
    fn place(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R<()> {
        let args = Args::default()
            .filter(&f)
            .string(&stream)
            .list("devices", devices.len());
        check!(self.enter(&h, args));
        let f = check!(self.done(filter(f, "place")));
        let r = self.dag().place(&f, &devices, &stream);
        self.done(r)
    }
    fn replicate(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        devices: Vec<u32>,
        o: wit::ReplicateOptions,
    ) -> R<()> {
        let args = Args::default()
            .filter(&f)
            .string(&o.reduce_stream)
            .string(&o.gather_stream)
            .list("devices", devices.len());
        check!(self.enter(&h, args));
        let o = ReplicateOptions {
            shard_optimizer: o.shard_optimizer,
            shard_grads: o.shard_grads,
            shard_params: o.shard_params,
            bucket_bytes: o.bucket_bytes,
            reduce_stream: o.reduce_stream,
            gather_stream: o.gather_stream,
            reshard_after_forward: o.reshard_after_forward,
        };
        let f = check!(self.done(filter(f, "replicate")));
        let r = self.dag().replicate(&f, &devices, &o);
        self.done(r)
    }
    fn shard(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R<()> {
        let args = Args::default()
            .filter(&f)
            .string(&stream)
            .list("devices", devices.len());
        check!(self.enter(&h, args));
        let f = check!(self.done(filter(f, "shard")));
        let r = self.dag().shard(&f, &devices, &stream);
        self.done(r)
    }
    fn shard_tensor(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        devices: Vec<u32>,
        stream: String,
    ) -> R<()> {
        let args = Args::default()
            .filter(&f)
            .string(&stream)
            .list("devices", devices.len());
        check!(self.enter(&h, args));
        let f = check!(self.done(filter(f, "shard-tensor")));
        let r = self.dag().shard_tensor(&f, &devices, &stream);
        self.done(r)
    }
    fn order(&mut self, h: Resource<DagHandle>, groups: Vec<Vec<wit::Filter>>) -> R<()> {
        let filters: usize = groups.iter().map(|g| g.len()).sum();
        let mut args = Args::default()
            .list("order groups", groups.len())
            .list("filters in an order", filters);
        if filters <= self.limits.max_list_len {
            for f in groups.iter().flatten() {
                args = args.filter(f);
            }
        }
        check!(self.enter(&h, args));
        let groups: Result<Vec<Vec<Filter>>, DagError> = groups
            .into_iter()
            .map(|g| g.into_iter().map(|f| filter(f, "order")).collect())
            .collect();
        let groups = check!(self.done(groups));
        let r = self.dag().order(&groups);
        self.done(r)
    }
    fn query(&mut self, h: Resource<DagHandle>, f: wit::Filter) -> R<Vec<wit::NodeInfo>> {
        check!(self.enter(&h, Args::default().filter(&f)));
        let f = check!(self.done(filter(f, "query")));
        let ids = check!(self.query_bounded(&f));
        // Building each record reads the node's tags and cost; the records
        // and their conversion are charged before they are made.
        let bytes = self.dag().infos_bytes(&ids);
        let charge = self
            .dag()
            .charge_bytes_public(&format!("query({f})"), bytes);
        check!(self.done(charge));
        let infos = self.dag().infos(&ids);
        Ok(Ok(infos.into_iter().map(info).collect()))
    }
    fn query_ids(&mut self, h: Resource<DagHandle>, f: wit::Filter) -> R<Vec<u32>> {
        check!(self.enter(&h, Args::default().filter(&f)));
        let f = check!(self.done(filter(f, "query-ids")));
        let ids = check!(self.query_bounded(&f));
        Ok(Ok(ids.into_iter().map(|i| i.0).collect()))
    }
    fn node(&mut self, h: Resource<DagHandle>, id: u32) -> R<wit::NodeInfo> {
        check!(self.enter(&h, Args::default()));
        let r = self.dag().node(NodeId(id));
        self.done(r.map(info))
    }
    fn neighbours(&mut self, h: Resource<DagHandle>, id: u32) -> R<wit::Neighbours> {
        check!(self.enter(&h, Args::default()));
        let r = self.dag().neighbours(NodeId(id));
        let (p, s) = check!(self.done(r));
        check!(self.bound_result(&format!("neighbours({id})"), p.len() + s.len()));
        Ok(Ok(wit::Neighbours {
            preds: p.into_iter().map(neighbour).collect(),
            succs: s.into_iter().map(neighbour).collect(),
        }))
    }
    fn tag_extents(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<Vec<wit::Tag>> {
        self.count_call()?;
        self.table.get(&h)?;
        // No error channel in the WIT: a refused charge stops the plugin.
        let ext = match self.dag().tag_extents_charged() {
            Ok(e) => e,
            Err(e) => {
                let m = super::clip(e.to_string(), self.limits.max_error_bytes);
                self.stop = Some(Cause::Limit(m.clone()));
                wasmtime::bail!("{m}");
            }
        };
        Ok(ext
            .into_iter()
            .map(|(key, index)| wit::Tag { key, index })
            .collect())
    }
    fn cluster(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<wit::ClusterInfo> {
        self.count_call()?;
        self.table.get(&h)?;
        let c = self.dag().cluster_info().clone();
        Ok(wit::ClusterInfo {
            devices: c.devices,
            memory_bytes: c.memory_bytes,
            link_bytes_per_s: c.link_bytes_per_s,
        })
    }
    fn add_temporal_edge(&mut self, h: Resource<DagHandle>, from: u32, to: u32) -> R<()> {
        check!(self.enter(&h, Args::default()));
        let r = self.dag().add_temporal_edge(NodeId(from), NodeId(to));
        self.done(r)
    }
    fn set_stream(&mut self, h: Resource<DagHandle>, f: wit::Filter, stream: String) -> R<u32> {
        check!(self.enter(&h, Args::default().filter(&f).string(&stream)));
        let f = check!(self.done(filter(f, "set-stream")));
        let r = self.dag().set_stream(&f, &stream);
        self.done(r.map(|n| n as u32))
    }
    fn recompute(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        policy: wdag::RecomputePolicy,
    ) -> R<u32> {
        check!(self.enter(&h, Args::default().filter(&f)));
        let f = check!(self.done(filter(f, "recompute")));
        let policy = match policy {
            wdag::RecomputePolicy::Full => dag::RecomputePolicy::Full,
            wdag::RecomputePolicy::Selective => dag::RecomputePolicy::Selective,
        };
        let r = self.dag().recompute(&f, policy);
        self.done(r)
    }
    fn sequence_parallel(&mut self, h: Resource<DagHandle>, f: wit::Filter) -> R<u32> {
        check!(self.enter(&h, Args::default().filter(&f)));
        let f = check!(self.done(filter(f, "sequence-parallel")));
        let r = self.dag().sequence_parallel(&f);
        self.done(r)
    }
    fn context_parallel(
        &mut self,
        h: Resource<DagHandle>,
        f: wit::Filter,
        degree: u32,
        exchange: wdag::KvExchange,
        stream: String,
    ) -> R<u32> {
        check!(self.enter(&h, Args::default().filter(&f).string(&stream)));
        let f = check!(self.done(filter(f, "context-parallel")));
        let exchange = match exchange {
            wdag::KvExchange::Ring => dag::KvExchange::Ring,
            wdag::KvExchange::AllGather => dag::KvExchange::AllGather,
        };
        let r = self.dag().context_parallel(&f, degree, exchange, &stream);
        self.done(r)
    }
    fn set_priority(&mut self, h: Resource<DagHandle>, f: wit::Filter, priority: i32) -> R<u32> {
        check!(self.enter(&h, Args::default().filter(&f)));
        let f = check!(self.done(filter(f, "set-priority")));
        let r = self.dag().set_priority(&f, priority);
        self.done(r.map(|n| n as u32))
    }
    fn drop(&mut self, h: Resource<DagHandle>) -> wasmtime::Result<()> {
        self.table.delete(h)?;
        Ok(())
    }
}

impl PluginState {
    /// `query-ids` with its result bounded by `sandbox.max_list_len`.
    fn query_bounded(&mut self, f: &Filter) -> R<Vec<NodeId>> {
        let r = self.dag().query_ids(f);
        let ids = check!(self.done(r));
        check!(self.bound_result(&format!("query({f})"), ids.len()));
        // Reading the result back costs a unit per node.
        let charge = self
            .dag()
            .charge_public(&format!("query({f})"), ids.len() as u64);
        check!(self.done(charge));
        Ok(Ok(ids))
    }
}

impl wlog::Host for PluginState {
    fn log(&mut self, level: wlog::Level, message: String) -> wasmtime::Result<()> {
        self.count_call()?;
        let level = match level {
            wlog::Level::Trace => "trace",
            wlog::Level::Debug => "debug",
            wlog::Level::Info => "info",
            wlog::Level::Warn => "warn",
            wlog::Level::Error => "error",
        };
        // The message was copied into the host: charge it, and stop a
        // plugin that floods the log past its host work.
        if let Some(dag) = self.dag.as_ref() {
            if let Err(e) = dag.charge_public("log", (message.len() / BYTES_PER_UNIT) as u64) {
                let m = super::clip(e.to_string(), self.limits.max_error_bytes);
                self.stop = Some(Cause::Limit(m.clone()));
                wasmtime::bail!("{m}");
            }
        }
        // Keep lines while they fit `sandbox.max_log_bytes`; count the rest.
        let fits = self
            .log_bytes
            .checked_add(message.len())
            .is_some_and(|b| b <= self.limits.max_log_bytes);
        if fits {
            self.log_bytes += message.len();
            self.logs
                .push(format!("plugin {} [{level}]: {message}", self.plugin));
        } else {
            self.dropped_lines += 1;
            self.dropped_bytes = self.dropped_bytes.saturating_add(message.len() as u64);
        }
        Ok(())
    }
}
