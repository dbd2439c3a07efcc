//! Native 1F1B, GPipe and ZeRO programs compiled to per-device plans: the
//! textbook orders, matched send/recv pairs, ZeRO model-state proportions,
//! deadlock detection and plan-hash stability.

use crate::common;

use common::*;
use piper::compile::{
    check_deadlock, compile, Act, CompileError, DevicePlan, Op, OpCommon, OpKind, StreamPlan,
};
use piper::dag::{Cluster, Filter, Label, ReplicateOptions, TrainingDag};
use piper::model::ModelConfig;

fn tiny(devices: u32) -> TrainingDag {
    TrainingDag::build(&ModelConfig::tiny(), Cluster::new(devices)).unwrap()
}

#[test]
fn one_f_one_b_4_stages_8_microbatches_gives_textbook_orders() {
    let mut dag = tiny(4);
    one_f_one_b(&mut dag, 4, 8, 1, None).unwrap();
    let plan = compile(&dag).unwrap();
    let expect0 = "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7";
    let expect3 = "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7";
    assert_eq!(steps(&plan, 0).join(" "), expect0);
    assert_eq!(
        steps(&plan, 1).join(" "),
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    );
    assert_eq!(
        steps(&plan, 2).join(" "),
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    );
    assert_eq!(steps(&plan, 3).join(" "), expect3);
    // Each F/B step covers the stage's two regions, in order.
    let d0: Vec<String> = plan.compute_labels(0);
    assert_eq!(&d0[..3], ["F[MB0 PP0]", "F[MB0 PP1]", "F[MB1 PP0]"]);
    assert_eq!(d0.last().unwrap(), "update");

    // Send/recv between neighbours only, 8 per direction, pairs matched.
    for d in 0..4u32 {
        let pp: Vec<&Op> = plan.devices[d as usize]
            .streams
            .iter()
            .filter(|s| s.stream.starts_with("pp"))
            .flat_map(|s| s.ops.iter())
            .filter(|o| o.kind() == OpKind::Send || o.kind() == OpKind::Recv)
            .collect();
        let count = |op: OpKind, peer: u32| {
            pp.iter()
                .filter(|o| o.kind() == op && o.peer() == Some(peer))
                .count()
        };
        if d + 1 < 4 {
            assert_eq!(
                count(OpKind::Send, d + 1),
                8,
                "device {d} sends activations to {}",
                d + 1
            );
            assert_eq!(
                count(OpKind::Recv, d + 1),
                8,
                "device {d} receives gradients from {}",
                d + 1
            );
        }
        if d > 0 {
            assert_eq!(
                count(OpKind::Recv, d - 1),
                8,
                "device {d} receives activations from {}",
                d - 1
            );
            assert_eq!(
                count(OpKind::Send, d - 1),
                8,
                "device {d} sends gradients to {}",
                d - 1
            );
        }
        assert_eq!(pp.len(), if d == 0 || d == 3 { 16 } else { 32 });
        for o in pp.iter().filter(|o| o.kind() == OpKind::Recv) {
            let peer = &plan.devices[o.peer().unwrap() as usize];
            let matched = peer
                .streams
                .iter()
                .flat_map(|s| s.ops.iter())
                .any(|s| s.act.sends_to(d) && Some(s.node) == o.pair());
            assert!(matched, "recv {} on device {d} has its send", o.label());
        }
    }
    // The tied embedding (device 0) and head (device 3) reduce their gradients.
    let tied: Vec<&Op> = plan.devices[0]
        .streams
        .iter()
        .flat_map(|s| s.ops.iter())
        .filter(|o| {
            o.kind() == OpKind::AllReduce
                && o.purpose() == Some(piper::compile::plan::CommPurpose::TiedGrad)
        })
        .collect();
    assert_eq!(tied.len(), 1);
    assert_eq!(tied[0].group().map(|g| &g[..]), Some(&[0, 3][..]));
}

#[test]
fn gpipe_runs_all_forwards_then_all_backwards() {
    let mut dag = tiny(2);
    pipeline_place(&mut dag, &[vec![0], vec![1]], 4).unwrap();
    for s in 0..2 {
        let regions = stage_regions(8, 2, s);
        let mut groups: Vec<Vec<Filter>> = (0..4).map(|m| group(&regions, m, Label::F)).collect();
        groups.extend((0..4).map(|m| group(&regions, m, Label::B)));
        dag.order(&groups).unwrap();
    }
    let plan = compile(&dag).unwrap();
    assert_eq!(steps(&plan, 0).join(" "), "F0 F1 F2 F3 B0 B1 B2 B3");
    assert_eq!(steps(&plan, 1).join(" "), "F0 F1 F2 F3 B0 B1 B2 B3");
    // 1F1B keeps fewer activations alive than GPipe on the first stage.
    let mut dag2 = tiny(2);
    one_f_one_b(&mut dag2, 2, 4, 1, None).unwrap();
    let plan2 = compile(&dag2).unwrap();
    assert!(plan2.devices[1].transient_peak_bytes < plan.devices[1].transient_peak_bytes);
}

#[test]
fn dp_times_pp_puts_all_reduce_on_the_dp_stream() {
    let mut dag = tiny(8);
    one_f_one_b(&mut dag, 4, 8, 2, Some(0)).unwrap();
    let plan = compile(&dag).unwrap();
    assert_eq!(
        steps(&plan, 0).join(" "),
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    );
    assert_eq!(
        steps(&plan, 4),
        steps(&plan, 0),
        "DP replicas run the same order"
    );
    for d in 0..8u32 {
        let dp: Vec<&Op> = plan.devices[d as usize]
            .streams
            .iter()
            .filter(|s| s.stream == "dp")
            .flat_map(|s| s.ops.iter())
            .collect();
        assert!(
            !dp.is_empty() && dp.iter().all(|o| o.kind() == OpKind::AllReduce),
            "device {d}"
        );
        let partner = if d < 4 { d + 4 } else { d - 4 };
        let group = [d.min(partner), d.max(partner)];
        assert!(dp
            .iter()
            .all(|o| o.group().map(|g| &g[..]) == Some(&group[..])));
    }
    // Pipeline sends pair the replicas element-wise: 0→1 and 4→5.
    let sends4: Vec<u32> = plan.devices[4]
        .streams
        .iter()
        .flat_map(|s| s.ops.iter())
        .filter(|o| o.kind() == OpKind::Send)
        .map(|o| o.peer().unwrap())
        .collect();
    assert!(sends4.iter().all(|p| *p == 5));
}

#[test]
fn zero_stages_shrink_model_states_in_the_papers_proportions() {
    let mut psi = 0u64;
    let mut states = Vec::new();
    let mut peaks = Vec::new();
    for stage in 0..=3u8 {
        let mut dag = tiny(2);
        dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(stage))
            .unwrap();
        dag.split(&Filter::all(), "MB", 2).unwrap();
        let plan = compile(&dag).unwrap();
        psi = dag.model().param_count();
        assert_eq!(
            plan.devices[0].model_state_bytes,
            plan.devices[1].model_state_bytes
        );
        states.push(plan.devices[0].model_state_bytes as f64);
        peaks.push(plan.devices[0].peak_bytes);
        if stage == 3 {
            let f = dag.query(&Filter::all().pass(Label::F)).unwrap().len();
            let b = dag.query(&Filter::all().pass(Label::B)).unwrap().len();
            let ag = dag.query(&Filter::all().pass(Label::AllGather)).unwrap();
            assert_eq!(ag.len(), f + b, "one all-gather before every F and B use");
            // Each all-gather feeds exactly the use it precedes.
            for a in &ag {
                let (_, succs) = dag.neighbours(a.id).unwrap();
                assert_eq!(succs.len(), 1);
                let user = dag.node(succs[0].node).unwrap();
                assert!(user.op == "F" || user.op == "B");
                assert_eq!(user.tags, a.tags);
            }
            let rs = dag
                .query(&Filter::all().pass(Label::ReduceScatter))
                .unwrap();
            assert!(!rs.is_empty());
            // Every B's gradients are reduce-scattered for its microbatch.
            for b in dag.query(&Filter::all().pass(Label::B)).unwrap() {
                let (_, succs) = dag.neighbours(b.id).unwrap();
                assert!(succs
                    .iter()
                    .any(|s| dag.node(s.node).unwrap().op == "reduce-scatter"));
            }
            // The compiled plan gathers before each use on the gather stream.
            let ops: Vec<OpKind> = plan.devices[0]
                .streams
                .iter()
                .filter(|s| s.stream == "dp")
                .flat_map(|s| s.ops.iter().map(|o| o.kind()))
                .collect();
            assert_eq!(
                ops.iter().filter(|o| **o == OpKind::AllGather).count(),
                f + b
            );
        }
    }
    let psi = psi as f64;
    let n = 2.0;
    let expect = [
        16.0 * psi,
        8.0 * psi + 8.0 * psi / n,
        4.0 * psi + 12.0 * psi / n,
        16.0 * psi / n,
    ];
    for (stage, (got, want)) in states.iter().zip(expect).enumerate() {
        let rel = (got - want).abs() / want;
        assert!(
            rel < 1e-4,
            "ZeRO-{stage}: model states {got} B, paper says {want} B"
        );
    }
    assert!(
        peaks[0] > peaks[1] && peaks[1] > peaks[2] && peaks[2] > peaks[3],
        "peaks {peaks:?}"
    );
}

/// A send of node `node` to `peer`, or a recv of it from `peer`.
fn op(op: OpKind, node: u32, peer: u32) -> Op {
    let act = match op {
        OpKind::Send => Act::Send {
            to: peer,
            pair: node,
        },
        _ => Act::Recv {
            from: peer,
            pair: node,
        },
    };
    Op {
        act,
        node,
        common: std::sync::Arc::new(OpCommon {
            tags: Default::default(),
            segments: Default::default(),
            spread: None,
            phase: None,
            batch_div: 1,
            flops: 0.0,
            bytes: 0,
            microbatch: 0,
            microbatches: 1,
            tensor: None,
            zero: 0,
            param_bytes: 0,
            tp: 1,
            sp: false,
            cp: 1,
            cp_ring: false,
            cp_bytes: 0,
            shape: Default::default(),
        }),
        waits: Default::default(),
        inputs: Default::default(),
        replica: 0,
        out_bytes: 0,
    }
}

#[test]
fn receive_before_send_on_both_devices_is_a_deadlock() {
    // Device 0 receives (node 11 from device 1) before it sends node 10;
    // device 1 receives node 10 before it sends node 11.
    let dev = |d: u32, recv: u32, send: u32| DevicePlan {
        device: d,
        peak_bytes: 0,
        model_state_bytes: 0,
        transient_peak_bytes: 0,
        streams: vec![StreamPlan {
            stream: "pp".into(),
            ops: vec![op(OpKind::Recv, recv, 1 - d), op(OpKind::Send, send, 1 - d)],
        }],
    };
    let err = check_deadlock(&[dev(0, 11, 10), dev(1, 10, 11)]).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("device 0") && msg.contains("device 1"),
        "{msg}"
    );
    assert!(
        msg.contains("recv←1#11") && msg.contains("recv←0#10"),
        "{msg}"
    );
    // The consistent order (send first) passes.
    let ok = |d: u32, recv: u32, send: u32| DevicePlan {
        device: d,
        peak_bytes: 0,
        model_state_bytes: 0,
        transient_peak_bytes: 0,
        streams: vec![StreamPlan {
            stream: "pp".into(),
            ops: vec![op(OpKind::Send, send, 1 - d), op(OpKind::Recv, recv, 1 - d)],
        }],
    };
    check_deadlock(&[ok(0, 11, 10), ok(1, 10, 11)]).unwrap();
}

#[test]
fn a_reordered_compiled_plan_is_rejected_not_hung() {
    let mut dag = tiny(2);
    one_f_one_b(&mut dag, 2, 4, 1, None).unwrap();
    let plan = compile(&dag).unwrap();
    check_deadlock(&plan.devices).unwrap();
    // Device 0 waits for the first gradient before sending the first
    // activation: the gradient's recv moved to the head of the send stream
    // (the compiler gives sends and receives a stream per peer: `pp→1`, `pp←1`).
    let mut bad = plan.devices.clone();
    let streams = &mut bad[0].streams;
    let recvs = streams.iter().position(|s| &*s.stream == "pp←1").unwrap();
    let r = streams[recvs].ops.remove(0);
    assert_eq!(r.kind(), OpKind::Recv);
    let sends = streams.iter().position(|s| &*s.stream == "pp→1").unwrap();
    streams[sends].ops.insert(0, r);
    // Re-point the compute stream's waits at the moved ops is unnecessary: the
    // check must fail on the communication order alone.
    let err = check_deadlock(&bad).unwrap_err().to_string();
    assert!(err.contains("device 0 stream pp→1 waits at recv"), "{err}");
    // Two collectives issued in opposite orders on a DP pair deadlock too.
    let mut bad = dp_pair_plan();
    let dp = dp_stream(&mut bad[1]);
    assert!(dp.ops.len() >= 2);
    dp.ops.swap(0, 1);
    let err = check_deadlock(&bad).unwrap_err().to_string();
    assert!(err.contains("all-reduce"), "{err}");
}

/// A DP pair's compiled plan, one gradient all-reduce per segment.
fn dp_pair_plan() -> Vec<DevicePlan> {
    let mut dag = tiny(2);
    dag.replicate(
        &Filter::all(),
        &[0, 1],
        &ReplicateOptions {
            bucket_bytes: 0,
            ..ReplicateOptions::zero(0)
        },
    )
    .unwrap();
    compile(&dag).unwrap().devices
}

fn dp_stream(d: &mut DevicePlan) -> &mut StreamPlan {
    d.streams.iter_mut().find(|s| s.stream == "dp").unwrap()
}

#[test]
fn a_collective_whose_devices_disagree_on_its_group_is_rejected() {
    // A DP pair's gradient all-reduce: device 1's copy of the op names a
    // group that is not device 0's. Each device reaching the op is not
    // enough: the runtime would hang in a collective nobody else joins.
    let mut bad = dp_pair_plan();
    check_deadlock(&bad).unwrap();
    let op = dp_stream(&mut bad[1])
        .ops
        .iter_mut()
        .find(|o| o.group().is_some())
        .unwrap();
    assert_eq!(op.group().map(|g| &g[..]), Some(&[0, 1][..]));
    let Act::Collective { group, .. } = &mut op.act else {
        panic!("a gradient all-reduce is a collective");
    };
    *group = std::sync::Arc::from(vec![1, 2]);
    let err = check_deadlock(&bad).unwrap_err().to_string();
    assert!(err.contains("all-reduce"), "{err}");
    assert!(
        err.contains("with group [0, 1], but device 1 runs it with group [1, 2]"),
        "{err}"
    );
}

#[test]
fn plan_hash_is_stable_and_tracks_directive_arguments() {
    let build = |mbs: u32| {
        let mut dag = tiny(4);
        one_f_one_b(&mut dag, 4, mbs, 1, None).unwrap();
        compile(&dag).unwrap()
    };
    let (a, b) = (build(8), build(8));
    assert_eq!(a.hash, b.hash);
    assert_eq!(a.hash.len(), 16);
    assert_ne!(a.hash, build(4).hash);
    // One changed argument of one directive changes the hash.
    let mut dag = tiny(2);
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(0))
        .unwrap();
    let h1 = compile(&dag).unwrap().hash;
    let mut dag = tiny(2);
    dag.replicate(
        &Filter::all(),
        &[0, 1],
        &ReplicateOptions {
            bucket_bytes: 1 << 10,
            ..ReplicateOptions::zero(0)
        },
    )
    .unwrap();
    assert_ne!(h1, compile(&dag).unwrap().hash);
    // The JSON round-trips and keeps the hash; the hash the compiler
    // builds stream by stream is the finished plan's, SPMD nodes (ZeRO-3
    // gathers, reduce-scatters on several devices) included.
    let mut zero3 = tiny(4);
    let groups = stage_groups(2, 2);
    replicate_stages(&mut zero3, &groups, Some(3)).unwrap();
    pipeline_place(&mut zero3, &groups, 4).unwrap();
    let zero3 = compile(&zero3).unwrap();
    let zero3_json = zero3.to_json();
    assert!(zero3.devices[0].streams.iter().any(|s| s
        .ops
        .iter()
        .any(|o| o.group().is_some_and(|g| g.len() == 2))));
    let mut dp = tiny(2);
    dp.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(0))
        .unwrap();
    for plan in [a, compile(&dp).unwrap(), zero3] {
        assert_eq!(plan.compute_hash(), plan.hash);
        let back = piper::compile::Plan::from_json(&plan.to_json()).unwrap();
        assert_eq!(back.compute_hash(), plan.hash);
        assert_eq!(back, plan);
    }
    // In JSON a wait names its stream: a name the device lacks is refused
    // on reading, naming the device and both streams.
    let mut json: serde_json::Value = serde_json::from_str(&zero3_json).unwrap();
    let (d, stream, wait) = json["devices"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find_map(|d| {
            let dev = d["device"].as_u64().unwrap();
            d["streams"]
                .as_array_mut()
                .unwrap()
                .iter_mut()
                .find_map(|s| {
                    let name = s["stream"].as_str().unwrap().to_string();
                    s["ops"].as_array_mut().unwrap().iter_mut().find_map(|o| {
                        let w = o.get_mut("waits")?.get_mut(0)?;
                        Some((dev, name.clone(), w))
                    })
                })
        })
        .expect("a ZeRO-3 pipeline plan has cross-stream waits");
    wait["stream"] = "nowhere".into();
    let err = piper::compile::Plan::from_json(&json.to_string()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&format!("device {d}: op ")), "{msg}");
    assert!(
        msg.contains(&format!(
            "of stream `{stream}`: it waits on stream `nowhere`, which this device lacks"
        )),
        "{msg}"
    );
    // An op reads back only with what its kind needs: a send without its
    // peer, a gradient gather no plan runs, a collective without its group.
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit, &str); 3] = [
        (
            "send",
            |o| drop(o.as_object_mut().unwrap().remove("peer")),
            "a `send` op without its `peer`",
        ),
        (
            "all-gather",
            |o| o["purpose"] = "tied-grad".into(),
            "`all-gather` for `tied-grad` is no op of a plan",
        ),
        (
            "reduce-scatter",
            |o| drop(o.as_object_mut().unwrap().remove("group")),
            "a `reduce-scatter` op without its `group`",
        ),
    ];
    for (kind, edit, says) in edits {
        let mut json: serde_json::Value = serde_json::from_str(&zero3_json).unwrap();
        let op = json["devices"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .flat_map(|d| d["streams"].as_array_mut().unwrap().iter_mut())
            .flat_map(|s| s["ops"].as_array_mut().unwrap().iter_mut())
            .find(|o| o["op"] == kind)
            .unwrap_or_else(|| panic!("a ZeRO-3 pipeline plan has a {kind}"));
        edit(op);
        let err = piper::compile::Plan::from_json(&json.to_string()).unwrap_err();
        assert!(err.to_string().contains(says), "{kind}: {err}");
    }
}

#[test]
fn editing_one_devices_op_leaves_the_nodes_other_ops_alone() {
    // The ops of one node share their common part; an edit through one op
    // copies it for that op, and the plan hash sees the edit.
    let mut dp = tiny(2);
    dp.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(0))
        .unwrap();
    let mut plan = compile(&dp).unwrap();
    let op = plan.devices[0].streams[0].ops[0].clone();
    plan.devices[1].streams[0].ops[0] = op.clone();
    let hash = plan.compute_hash();
    let (a, b) = (
        &plan.devices[0].streams[0].ops[0],
        &plan.devices[1].streams[0].ops[0],
    );
    assert!(std::sync::Arc::ptr_eq(&a.common, &b.common));
    let mut edited = plan.clone();
    edited.devices[0].streams[0].ops[0].flops *= 2.0;
    assert_eq!(edited.devices[0].streams[0].ops[0].flops, 2.0 * op.flops);
    assert_eq!(edited.devices[1].streams[0].ops[0].flops, op.flops);
    assert_eq!(plan.devices[0].streams[0].ops[0].flops, op.flops);
    // (What a node's ops share is hashed at its first device's op.)
    assert_ne!(edited.compute_hash(), hash);
}

#[test]
fn plan_json_has_the_documented_shape() {
    let mut dag = tiny(4);
    one_f_one_b(&mut dag, 4, 8, 1, None).unwrap();
    let plan = compile(&dag).unwrap();
    let v: serde_json::Value = serde_json::from_str(&plan.to_json()).unwrap();
    assert!(v["hash"].is_string());
    let d0 = &v["devices"][0];
    assert_eq!(d0["device"], 0);
    assert!(d0["peak_bytes"].as_u64().unwrap() > 0);
    let compute = d0["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stream"] == "compute")
        .unwrap();
    assert_eq!(compute["ops"][0]["op"], "F");
    assert_eq!(compute["ops"][0]["tags"]["PP"], 0);
    assert_eq!(compute["ops"][0]["tags"]["MB"], 0);
    let table = plan.render_table();
    assert!(
        table.contains("device 3: peak") && table.contains("compute | F[MB0 PP6]"),
        "{table}"
    );
}

#[test]
fn unplaced_and_inconsistent_dags_do_not_compile() {
    let dag = tiny(2);
    assert!(matches!(compile(&dag), Err(CompileError::Unplaced { .. })));
    let mut dag = tiny(2);
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.place(&Filter::tag("PP", 3).pass(Label::B), &[1], "pp")
        .unwrap();
    let err = compile(&dag).unwrap_err().to_string();
    assert!(
        err.contains("segment 3") && err.contains("must share"),
        "{err}"
    );
    let mut dag = tiny(2);
    dag.place(&Filter::all(), &[0, 1], "pp").unwrap();
    let err = compile(&dag).unwrap_err().to_string();
    assert!(err.contains("not replicated"), "{err}");
    // 3-way DP of a batch of 32 does not divide.
    let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(3)).unwrap();
    dag.replicate(&Filter::all(), &[0, 1, 2], &ReplicateOptions::default())
        .unwrap();
    let err = compile(&dag).unwrap_err().to_string();
    assert!(err.contains("global batch 32 is not divisible"), "{err}");
}

#[test]
fn microbatches_of_a_segment_on_two_groups_are_parameter_copies_only_when_they_pair() {
    // Microbatch 1 of every segment on device 1: two paired copies, one
    // copy-grad all-reduce per segment, both copies' states counted.
    let mut dag = tiny(2);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.place(&Filter::all().and("MB", 1), &[1], "pp").unwrap();
    let plan = compile(&dag).unwrap();
    let copies = plan.devices[1]
        .streams
        .iter()
        .flat_map(|s| s.ops.iter())
        .filter(|o| o.purpose() == Some(piper::compile::plan::CommPurpose::CopyGrad))
        .count();
    assert_eq!(copies, 8);
    assert_eq!(
        plan.devices[0].model_state_bytes,
        plan.devices[1].model_state_bytes
    );
    // Copies on groups that overlap cannot pair: refused, naming the segment.
    let mut dag = tiny(3);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::default())
        .unwrap();
    dag.place(&Filter::all().and("MB", 1), &[1, 2], "pp")
        .unwrap();
    let err = compile(&dag).unwrap_err().to_string();
    assert!(
        err.contains("segment 0") && err.contains("parameter copies"),
        "{err}"
    );
    // One microbatch's forward and backward on different devices: refused.
    let mut dag = tiny(2);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.place(
        &Filter::tag("PP", 2).and("MB", 1).pass(Label::B),
        &[1],
        "pp",
    )
    .unwrap();
    let err = compile(&dag).unwrap_err().to_string();
    assert!(
        err.contains("segment 2") && err.contains("must share"),
        "{err}"
    );
}
