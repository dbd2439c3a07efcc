//! Compile's validation of DAGs the directives cannot produce (a strategy
//! only reaches the graph through them): edges between device groups
//! written straight into the graph, refused with the edge named. And the
//! deadlock check's steps the builder makes beside the ops, against the
//! steps read back from the plan.

use super::*;
use crate::dag::{Cluster, Filter, TensorKind};
use crate::model::ModelConfig;
use petgraph::visit::{EdgeRef, IntoEdgeReferences};

fn tiny_on_0() -> TrainingDag {
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(2)).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag
}

fn ids_of(dag: &mut TrainingDag, filter: &str) -> Vec<NodeId> {
    dag.query_ids(&filter.parse().unwrap()).unwrap()
}

#[test]
fn a_data_edge_between_disjoint_groups_is_refused_naming_the_first_in_edge_order() {
    // Activations and their gradients get a relayout between the groups
    // (`layout.rs`); a weight's edges (its gradient to an update on another
    // device) have none and are refused.
    let mut dag = tiny_on_0();
    // Segments 3 and 5 moved to device 1 without send/recv: every data
    // edge into and out of them crosses.
    for id in ids_of(&mut dag, "{PP:3}")
        .into_iter()
        .chain(ids_of(&mut dag, "{PP:5}"))
    {
        dag.graph[id.ix()].devices = vec![DeviceId(1)];
    }
    let g = &dag.graph;
    let disjoint = |a: NodeIndex, b: NodeIndex| {
        let (a, b) = (&g[a], &g[b]);
        !matches!(a.kind, NodeKind::Marker)
            && !matches!(b.kind, NodeKind::Marker)
            && !a.devices.iter().any(|d| b.devices.contains(d))
    };
    let first = g
        .edge_references()
        .find(|e| {
            matches!(e.weight(), EdgeKind::Data { tensor, .. }
                if !matches!(tensor, TensorKind::Activation | TensorKind::ActGrad))
                && disjoint(e.source(), e.target())
        })
        .expect("the moved segments have crossing data edges");
    let (from, to) = (
        dag.label(NodeId::of(first.source())),
        dag.label(NodeId::of(first.target())),
    );
    match compile(&dag) {
        Err(CompileError::CrossingEdge {
            from: f,
            to: t,
            from_devices,
            to_devices,
        }) => {
            assert_eq!((f, t), (from, to));
            let mut pair = [from_devices, to_devices];
            pair.sort();
            assert_eq!(pair, [vec![0], vec![1]]);
        }
        other => panic!("expected a crossing data edge, got {other:?}"),
    }
}

#[test]
fn a_temporal_edge_between_disjoint_groups_is_refused_naming_it() {
    let mut dag = tiny_on_0();
    // A valid plan first: segment 3 on device 1 with its send/recv.
    dag.place(&"{PP:3}".parse().unwrap(), &[1], "pp").unwrap();
    assert!(compile(&dag).is_ok());
    // An order edge from device 0's first forward to device 1's: a
    // temporal edge needs a device both ends run on.
    let a = ids_of(&mut dag, "{PP:0,PASS:F}")[0];
    let b = ids_of(&mut dag, "{PP:3,PASS:F}")[0];
    dag.graph.add_edge(a.ix(), b.ix(), EdgeKind::Temporal);
    match compile(&dag) {
        Err(CompileError::CrossingOrder {
            from,
            to,
            from_devices,
            to_devices,
        }) => {
            assert_eq!((from, to), (dag.label(a), dag.label(b)));
            assert_eq!((from_devices, to_devices), (vec![0], vec![1]));
        }
        other => panic!("expected a crossing order edge, got {other:?}"),
    }
}

/// Tiny on four devices: two pipeline stages of two-way ZeRO-3 (parameter
/// gathers on their own stream, reduce-scatters, sends and receives per
/// peer), eight microbatches.
fn zero3_pipeline() -> TrainingDag {
    use crate::dag::ReplicateOptions;
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(4)).unwrap();
    let regions = dag.tag_extents()["PP"];
    let stage = |r: u32| if r < regions / 2 { [0, 1] } else { [2, 3] };
    for r in 0..regions {
        dag.replicate(&Filter::tag("PP", r), &stage(r), &ReplicateOptions::zero(3))
            .unwrap();
    }
    dag.split(&Filter::all(), "MB", 8).unwrap();
    for r in 0..regions {
        dag.place(&Filter::tag("PP", r), &stage(r), "pp").unwrap();
    }
    dag
}

/// The deadlock check's steps, built beside the ops (which move to their
/// streams in bursts), are the steps read back from the plan they were
/// built with, as for a plan given from a file: per device and stream the
/// same kinds, group sizes and waits, and keys that name the same messages
/// and meetings one to one.
#[test]
fn the_built_deadlock_steps_are_the_plans_own() {
    let mut dag = zero3_pipeline();
    dag.sync();
    let lowered = lower(&dag, &HashMap::new()).unwrap();
    let (read, _) = deadlock::steps_of(&lowered.devices);
    assert_eq!(read.len(), lowered.steps.len());
    let (mut to_read, mut to_built) = (HashMap::new(), HashMap::new());
    let mut kinds = HashMap::new();
    let mut waits = 0;
    for (d, (built, read)) in lowered.steps.iter().zip(&read).enumerate() {
        assert_eq!(built.len(), read.len(), "device {d}: streams");
        for (s, (b, r)) in built.iter().zip(read).enumerate() {
            assert_eq!(b.waits, r.waits, "device {d} stream {s}: waits");
            assert_eq!(b.steps.len(), r.steps.len(), "device {d} stream {s}");
            waits += b.waits.len();
            for (i, (x, y)) in b.steps.iter().zip(&r.steps).enumerate() {
                let at = format!("device {d} stream {s} op {i}");
                assert_eq!(
                    (x.kind, x.need, x.waits_end),
                    (y.kind, y.need, y.waits_end),
                    "{at}"
                );
                *kinds.entry(format!("{:?}", x.kind)).or_insert(0) += 1;
                if matches!(x.kind, deadlock::Kind::Local | deadlock::Kind::Never) {
                    continue;
                }
                assert_eq!(*to_read.entry(x.key).or_insert(y.key), y.key, "{at}: key");
                assert_eq!(*to_built.entry(y.key).or_insert(x.key), x.key, "{at}: key");
            }
        }
    }
    // The plan has every kind of step, and more ops per device than two
    // bursts.
    for k in ["Send", "Recv", "Collective", "Local"] {
        assert!(
            kinds.get(k).copied().unwrap_or(0) > 0,
            "no {k} step: {kinds:?}"
        );
    }
    assert!(waits > 0);
    let most = lowered
        .devices
        .iter()
        .map(|d| d.streams.iter().map(|s| s.ops.len()).sum::<usize>())
        .max();
    assert!(most > Some(2 * build::BURST), "{most:?} ops");
}

/// Order markers chained by temporal edges into a lattice (two markers a
/// level, each level's two joined to both of the next) have 2^levels paths
/// from the last back to the first. The compiler passes through each
/// marker once per node it plans, so 30 levels compile at once (every
/// path walked: 2^30 steps for each node after the last level).
#[test]
fn a_lattice_of_order_markers_compiles_in_time_linear_in_its_markers() {
    let model = ModelConfig {
        batch_size: 192,
        ..ModelConfig::tiny()
    };
    let mut dag = TrainingDag::build(&model, Cluster::new(1)).unwrap();
    dag.split(&Filter::all(), "MB", 192).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    let levels = 30u32;
    // Two chains of `order` groups of three independent forwards (region 0
    // and region 7 of three microbatches each): one marker between groups.
    let group = |region: u32, g: u32| -> Vec<Filter> {
        (0..3)
            .map(|k| {
                format!("{{PP:{region},MB:{},PASS:F}}", 3 * g + k)
                    .parse()
                    .unwrap()
            })
            .collect()
    };
    let mut chains: Vec<Vec<NodeId>> = Vec::new();
    for region in [0, 7] {
        let mut markers = Vec::new();
        for g in 0..=levels {
            let markers_now = |dag: &mut TrainingDag| {
                dag.query_ids(&"{PASS:marker}".parse().unwrap())
                    .unwrap_or_default()
            };
            let before = markers_now(&mut dag);
            dag.order(&[group(region, g), group(region, g + 1)])
                .unwrap();
            let after = markers_now(&mut dag);
            markers.extend(after.into_iter().filter(|m| !before.contains(m)));
        }
        chains.push(markers);
    }
    let (a, b) = (&chains[0], &chains[1]);
    assert_eq!(
        (a.len(), b.len()),
        (levels as usize + 1, levels as usize + 1)
    );
    for i in 1..a.len() {
        for (from, to) in [
            (a[i - 1], b[i]),
            (b[i - 1], a[i]),
            (a[i - 1], a[i]),
            (b[i - 1], b[i]),
        ] {
            dag.add_temporal_edge(from, to).unwrap();
        }
    }
    let t = std::time::Instant::now();
    let plan = compile(&dag).unwrap();
    assert_eq!(plan.devices.len(), 1);
    // Seconds at most in a debug build; the walk of every path is 2^30
    // steps for each of hundreds of nodes.
    assert!(
        t.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn communication_nodes_that_cannot_become_ops_are_refused_by_name() {
    // Written straight into the graph, as no directive writes them: a send
    // missing its peer, a recv without its send, a send of gradients, a
    // collective of an op and purpose no plan runs.
    let pipeline = || {
        let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(2)).unwrap();
        dag.place(&Filter::all(), &[0], "pp").unwrap();
        dag.place(&"{PP:3}".parse().unwrap(), &[1], "pp").unwrap();
        dag
    };
    let data_parallel = || {
        let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(2)).unwrap();
        let zero = crate::dag::ReplicateOptions::default();
        dag.replicate(&Filter::all(), &[0, 1], &zero).unwrap();
        dag.rebuild_derived();
        dag
    };
    type Build = fn() -> TrainingDag;
    type Edit = fn(&mut crate::dag::Comm);
    let edits: [(Build, CommOp, Edit, &str); 4] = [
        (
            pipeline,
            CommOp::Send,
            |c| c.peers.clear(),
            "a send on 1 device(s) names 0 peer(s)",
        ),
        (
            pipeline,
            CommOp::Recv,
            |c| c.pair = None,
            "a recv without its send",
        ),
        (
            pipeline,
            CommOp::Send,
            |c| c.purpose = CommPurpose::GradSync,
            "a send for grad-sync: point-to-point ops move pipeline tensors only",
        ),
        (
            data_parallel,
            CommOp::AllReduce,
            |c| c.purpose = CommPurpose::ParamGather,
            "`all-reduce` for `param-gather` is no collective a plan runs",
        ),
    ];
    for (build, op, edit, says) in edits {
        let mut dag = build();
        compile(&dag).expect("the DAG compiles before the edit");
        let at = (dag.graph.node_indices())
            .find(|i| matches!(&dag.graph[*i].kind, NodeKind::Comm(c) if c.op == op))
            .expect("the DAG has the op");
        let NodeKind::Comm(c) = &mut dag.graph[at].kind else {
            unreachable!()
        };
        edit(c);
        let err = compile(&dag).unwrap_err();
        assert!(matches!(err, CompileError::Comm { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(says) && msg.contains("cannot run"), "{msg}");
    }
}

/// A ZeRO-3 parameter gather has no inputs, so it waits for the compute op
/// before it on its device (FSDP's rate limit): every gather waits for a
/// compute op before its reader, but those ordered before the device's
/// first compute op, which open their stream. Without the wait a gather
/// stream ran every gather of the step at once, each buffer held until its
/// reader, past what the memory walk counts.
#[test]
fn a_parameter_gather_waits_for_the_compute_op_before_it() {
    let mut dag = zero3_pipeline();
    dag.sync();
    let plan = compile(&dag).unwrap();
    let (mut waiting, mut free) = (0, 0);
    for dp in &plan.devices {
        let d = dp.device;
        let compute = dp
            .streams
            .iter()
            .position(|s| s.ops.iter().any(|o| matches!(o.act, Act::Compute { .. })))
            .unwrap();
        for s in &dp.streams {
            let mut opening = true;
            for op in &s.ops {
                let gather = op.kind() == OpKind::AllGather
                    && op.tensor == Some(crate::dag::TensorKind::Param);
                if !gather {
                    opening = false;
                    continue;
                }
                let reader = dp.streams[compute]
                    .ops
                    .iter()
                    .position(|o| o.inputs.iter().any(|i| i.node == op.node))
                    .unwrap_or_else(|| panic!("device {d}: gather {} has no reader", op.node));
                match op.waits.iter().find(|w| w.stream.0 as usize == compute) {
                    Some(w) => {
                        waiting += 1;
                        opening = false;
                        assert!(
                            w.op < reader,
                            "device {d}: gather {} waits for compute op {}, its reader is op {reader}",
                            op.node,
                            w.op
                        );
                    }
                    None => {
                        free += 1;
                        assert!(
                            opening,
                            "device {d}: gather {} (reader op {reader}) waits for nothing",
                            op.node
                        );
                    }
                }
            }
        }
    }
    assert!(
        waiting > free && free > 0,
        "{waiting} gathers wait, {free} do not"
    );
}
