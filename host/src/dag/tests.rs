//! Directive and primitive unit tests: each directive's effect, its error
//! cases, and that a failed directive leaves the DAG unchanged.

use super::*;
use crate::model::ModelConfig;

fn tiny(devices: u32) -> TrainingDag {
    TrainingDag::build(&ModelConfig::tiny(), Cluster::new(devices)).unwrap()
}

/// Run `f`, expect an error containing `needle`, and check the DAG is unchanged.
fn fails_unchanged(
    dag: &mut TrainingDag,
    needle: &str,
    f: impl FnOnce(&mut TrainingDag) -> Result<(), DagError>,
) -> DagError {
    let before = dag.clone();
    let err = f(dag).expect_err("the directive should fail");
    let msg = err.to_string();
    assert!(
        msg.contains(needle),
        "error `{msg}` should contain `{needle}`"
    );
    // Full state (node and edge slots, names, specs), derived nodes brought
    // up to date on both sides.
    let (mut a, mut b) = (dag.clone(), before);
    a.sync();
    b.sync();
    assert!(
        a.same_state(&b),
        "a failed directive changed the DAG: {msg}"
    );
    err
}

/// How many nodes match `f`: 0 only when the DAG says the filter matches no
/// node; any other error (an unknown tag, a bad pass) fails the test.
fn count(dag: &mut TrainingDag, f: &str) -> usize {
    match dag.query(&f.parse().unwrap()) {
        Ok(v) => v.len(),
        Err(e) if matches!(e.kind, crate::dag::DagErrorKind::NoMatch { .. }) => 0,
        Err(e) => panic!("count({f}): {e}"),
    }
}

#[test]
fn split_copies_the_region_and_tags_microbatches() {
    let mut dag = tiny(1);
    dag.split(&Filter::all(), "MB", 4).unwrap();
    assert_eq!(count(&mut dag, "{PASS:F}"), 32);
    assert_eq!(count(&mut dag, "{MB:3,PASS:B}"), 8);
    assert_eq!(dag.tag_extents()["MB"], 4);
    // Gradients of all 4 copies of all 8 segments meet in the one update.
    let upd = dag.query(&"{PASS:update}".parse().unwrap()).unwrap();
    assert_eq!(upd.len(), 1);
    let (preds, _) = dag.neighbours(upd[0].id).unwrap();
    assert_eq!(preds.len(), 32);
    // Each copy runs a quarter of the batch.
    let f0 = &dag.query(&"{PP:0,MB:0,PASS:F}".parse().unwrap()).unwrap()[0];
    let whole = tiny(1).query(&"{PP:0,PASS:F}".parse().unwrap()).unwrap()[0]
        .cost
        .flops;
    assert!((f0.cost.flops * 4.0 - whole).abs() < 1e-6 * whole);
}

#[test]
fn split_errors_leave_the_dag_unchanged() {
    let mut dag = tiny(1);
    fails_unchanged(
        &mut dag,
        "the filter matches 8 of its 16 compute nodes",
        |d| d.split(&"{PASS:F}".parse().unwrap(), "MB", 2),
    );
    fails_unchanged(&mut dag, "a split takes the whole model", |d| {
        d.split(&Filter::tag("PP", 2), "MB", 2)
    });
    fails_unchanged(&mut dag, "unknown tag `XX`", |d| {
        d.split(&Filter::tag("XX", 0), "MB", 2)
    });
    fails_unchanged(&mut dag, "matches no node", |d| {
        d.split(&Filter::tag("PP", 99), "MB", 2)
    });
    fails_unchanged(&mut dag, "at least 1", |d| d.split(&Filter::all(), "MB", 0));
    dag.split(&Filter::all(), "MB", 2).unwrap();
    fails_unchanged(&mut dag, "already split along `MB`", |d| {
        d.split(&Filter::all(), "MB", 2)
    });
    // One microbatch split again would train rows another microbatch
    // trains too: refused.
    fails_unchanged(
        &mut dag,
        "the filter matches 16 of its 32 compute nodes",
        |d| d.split(&Filter::tag("MB", 0), "X", 2),
    );
    // A second, nested dimension over the whole model is fine.
    dag.split(&Filter::all(), "SUB", 2).unwrap();
    assert_eq!(count(&mut dag, "{PASS:F}"), 32);
}

#[test]
fn place_inserts_send_recv_pairs_and_undoes_them() {
    let mut dag = tiny(2);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    assert_eq!(count(&mut dag, "{PASS:send}"), 0);
    for r in 4..8 {
        dag.place(&Filter::tag("PP", r), &[1], "pp").unwrap();
    }
    // Activations 3→4 and gradients 4→3, per microbatch.
    assert_eq!(count(&mut dag, "{PASS:send}"), 4);
    assert_eq!(count(&mut dag, "{PASS:recv}"), 4);
    let sends = dag.query(&"{PASS:send}".parse().unwrap()).unwrap();
    assert!(sends.iter().all(|s| s.stream == "pp"));
    let act = sends.iter().find(|s| s.tags["PP"] == 3).unwrap();
    assert_eq!(act.devices, vec![0]);
    // Embedding and head on different devices: tied gradient all-reduce.
    let reduces = dag.query(&"{PASS:all-reduce}".parse().unwrap()).unwrap();
    let tied: Vec<_> = reduces.iter().filter(|n| n.stream == "pp").collect();
    assert_eq!(tied.len(), 1);
    assert_eq!(tied[0].devices, vec![0, 1]);
    // And the global gradient-norm reduction over both devices.
    assert_eq!(reduces.iter().filter(|n| n.stream == "compute").count(), 1);
    // Moving everything back removes the pairs and the tied reduction.
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    assert_eq!(count(&mut dag, "{PASS:send}"), 0);
    assert_eq!(count(&mut dag, "{PASS:all-reduce}"), 0);
    assert_eq!(count(&mut dag, "{PASS:update}"), 1);
}

#[test]
fn place_errors_leave_the_dag_unchanged() {
    let mut dag = tiny(8);
    let e = fails_unchanged(
        &mut dag,
        "device 9 does not exist, the cluster has 8",
        |d| d.place(&Filter::tag("PP", 1), &[0, 9], "pp"),
    );
    assert!(
        e.call.contains("place({PP:1}, devices [0, 9]"),
        "{}",
        e.call
    );
    fails_unchanged(&mut dag, "unknown tag `STAGE`", |d| {
        d.place(&Filter::tag("STAGE", 1), &[0], "pp")
    });
    fails_unchanged(&mut dag, "filter {PP:42} matches no node", |d| {
        d.place(&Filter::tag("PP", 42), &[0], "pp")
    });
    fails_unchanged(&mut dag, "device list is empty", |d| {
        d.place(&Filter::all(), &[], "pp")
    });
    fails_unchanged(&mut dag, "appears twice", |d| {
        d.place(&Filter::all(), &[1, 1], "pp")
    });
    fails_unchanged(&mut dag, "no compute node", |d| {
        d.place(&"{PASS:update}".parse().unwrap(), &[0], "pp")
    });
}

#[test]
fn replicate_inserts_gradient_all_reduce_in_buckets() {
    let mut dag = tiny(2);
    let opts = ReplicateOptions {
        bucket_bytes: 0,
        ..ReplicateOptions::default()
    };
    dag.replicate(&Filter::all(), &[0, 1], &opts).unwrap();
    // One all-reduce per segment with bucket-bytes 0, on the dp stream.
    let ar: Vec<_> = dag
        .query(&"{PASS:all-reduce}".parse().unwrap())
        .unwrap()
        .into_iter()
        .filter(|a| a.stream == "dp")
        .collect();
    assert_eq!(ar.len(), 8);
    assert!(ar.iter().all(|a| a.devices == vec![0, 1]));
    // One big bucket covers the whole model.
    let mut dag = tiny(2);
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::default())
        .unwrap();
    // One bucket, plus the gradient-norm reduction.
    assert_eq!(count(&mut dag, "{PASS:all-reduce}"), 2);
    // Microbatches accumulate before the one reduction.
    dag.split(&Filter::all(), "MB", 4).unwrap();
    assert_eq!(count(&mut dag, "{PASS:all-reduce}"), 2);
    // ZeRO-2 reduce-scatters every microbatch instead, and gathers updated params.
    let mut dag = tiny(2);
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(2))
        .unwrap();
    dag.split(&Filter::all(), "MB", 4).unwrap();
    assert_eq!(count(&mut dag, "{PASS:reduce-scatter}"), 4);
    assert_eq!(count(&mut dag, "{PASS:all-gather}"), 1);
    // ZeRO-3 keeping gathered parameters: one gather per segment.
    let mut dag = tiny(2);
    let keep = ReplicateOptions {
        reshard_after_forward: false,
        ..ReplicateOptions::zero(3)
    };
    dag.replicate(&Filter::all(), &[0, 1], &keep).unwrap();
    dag.split(&Filter::all(), "MB", 4).unwrap();
    assert_eq!(count(&mut dag, "{PASS:all-gather}"), 8);
}

#[test]
fn replicate_errors_leave_the_dag_unchanged() {
    let mut dag = tiny(4);
    fails_unchanged(&mut dag, "partner", |d| {
        d.replicate(
            &"{PASS:F}".parse().unwrap(),
            &[0, 1],
            &ReplicateOptions::default(),
        )
    });
    fails_unchanged(&mut dag, "device 4 does not exist", |d| {
        d.replicate(&Filter::all(), &[3, 4], &ReplicateOptions::default())
    });
    fails_unchanged(&mut dag, "reduce-stream name is empty", |d| {
        d.replicate(
            &Filter::all(),
            &[0, 1],
            &ReplicateOptions {
                reduce_stream: String::new(),
                ..Default::default()
            },
        )
    });
}

fn tiny_moe(devices: u32, experts: u32) -> TrainingDag {
    let mut cfg = ModelConfig::tiny();
    cfg.moe = Some(crate::model::MoeConfig::new(experts, 2));
    TrainingDag::build(&cfg, Cluster::new(devices)).unwrap()
}

#[test]
fn shard_spreads_experts_and_drops_them_from_the_gradient_sync() {
    let mut dag = tiny_moe(2, 4);
    let dense_sync = |dag: &mut TrainingDag| -> u64 {
        dag.query(&"{PASS:all-reduce}".parse().unwrap())
            .unwrap()
            .iter()
            .map(|n| n.cost.comm_bytes)
            .sum()
    };
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::default())
        .unwrap();
    let before = dense_sync(&mut dag);
    dag.shard(&"{EP:*}".parse().unwrap(), &[0, 1], "ep")
        .unwrap();
    let after = dense_sync(&mut dag);
    // 8 layers × 4 experts × (2·64·256 + 256 + 64) fp32 leave the sync.
    assert_eq!(before - after, 8 * 4 * (2 * 64 * 256 + 256 + 64) * 4);
    let plan = crate::compile::compile(&dag).unwrap();
    // Each device holds half of the experts: the states show it.
    let dp_only = {
        let mut d = tiny_moe(2, 4);
        d.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::default())
            .unwrap();
        crate::compile::compile(&d).unwrap()
    };
    let half_experts = 8 * 2 * (2 * 64 * 256 + 256 + 64) * 4 * 4;
    assert_eq!(
        dp_only.devices[0].model_state_bytes - plan.devices[0].model_state_bytes,
        half_experts
    );
}

#[test]
fn shard_on_its_own_stream_splits_expert_passes_into_phases_around_all_to_alls() {
    let mut dag = tiny_moe(4, 4);
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::default())
        .unwrap();
    let ep: Filter = "{EP:*}".parse().unwrap();
    let count =
        |dag: &mut TrainingDag, f: &str| dag.query(&f.parse().unwrap()).map_or(0, |v| v.len());
    // On `compute` the passes stay whole.
    let mut whole = dag.clone();
    whole.shard(&ep, &[0, 1], "compute").unwrap();
    assert_eq!(count(&mut whole, "{PASS:all-to-all}"), 0);
    assert_eq!(count(&mut whole, "{PART:*}"), 0);
    dag.shard(&ep, &[0, 1], "ep").unwrap();
    // 8 expert segments × (F, B) × 3 phases, two all-to-alls per pass on `ep`.
    assert_eq!(count(&mut dag, "{EP:*, PASS:F}"), 8 * 3);
    assert_eq!(count(&mut dag, "{EP:*, PASS:B}"), 8 * 3);
    let a2a = dag.query(&"{PASS:all-to-all}".parse().unwrap()).unwrap();
    assert_eq!(a2a.len(), 8 * 2 * 2);
    assert!(a2a.iter().all(|n| n.stream == "ep" && n.devices == [0, 1]));
    // Forward: dispatch → all-to-all → experts → all-to-all → combine.
    let f = dag.query(&"{EP:0, PASS:F}".parse().unwrap()).unwrap();
    let part = |n: &NodeInfo| n.tags["PART"];
    let by_part = |p: u32| f.iter().find(|n| part(n) == p).unwrap().id;
    let next = |dag: &mut TrainingDag, id: NodeId| -> Vec<NodeId> {
        dag.neighbours(id)
            .unwrap()
            .1
            .into_iter()
            .map(|n| n.node)
            .collect()
    };
    let after_dispatch = next(&mut dag, by_part(0));
    let x = *after_dispatch
        .iter()
        .find(|n| dag.node(**n).unwrap().op == "all-to-all")
        .unwrap();
    assert!(next(&mut dag, x).contains(&by_part(1)));
    // A second shard of split passes is refused.
    fails_unchanged(&mut dag, "expert phases", |d| d.shard(&ep, &[0, 1], "ep"));
    // Splitting the backward: every phase becomes BI, one BW per segment.
    dag.order(&[
        vec!["{EP:0, PASS:BI}".parse().unwrap()],
        vec!["{EP:0, PASS:BW}".parse().unwrap()],
    ])
    .unwrap();
    assert_eq!(count(&mut dag, "{EP:0, PASS:BI}"), 3);
    assert_eq!(count(&mut dag, "{EP:0, PASS:BW}"), 1);
    assert_eq!(count(&mut dag, "{EP:0, PASS:BW, PART:*}"), 0);
    // A pipeline moves the all-to-alls with their phases, and it compiles.
    dag.place(&"{PP:0}".parse().unwrap(), &[2, 3], "pp")
        .unwrap();
    let moved = dag
        .query(&"{PP:0, PASS:all-to-all}".parse().unwrap())
        .unwrap();
    assert!(moved.iter().all(|n| n.devices == [2, 3]));
    crate::compile::compile(&dag).unwrap();
}

#[test]
fn shard_errors_name_the_numbers_and_leave_the_dag_unchanged() {
    // A dense model has nothing to shard.
    let mut dag = tiny(2);
    fails_unchanged(&mut dag, "has no experts", |d| {
        d.shard(&Filter::all(), &[0, 1], "ep")
    });
    let mut dag = tiny_moe(4, 4);
    dag.replicate(&Filter::all(), &[0, 1, 2], &ReplicateOptions::default())
        .unwrap();
    fails_unchanged(&mut dag, "not an expert segment", |d| {
        d.shard(&Filter::all(), &[0, 1, 2], "ep")
    });
    fails_unchanged(
        &mut dag,
        "4 experts do not spread evenly over 3 devices",
        |d| d.shard(&"{EP:*}".parse().unwrap(), &[0, 1, 2], "ep"),
    );
    fails_unchanged(&mut dag, "data-parallel over", |d| {
        d.shard(&"{EP:*}".parse().unwrap(), &[0, 1], "ep")
    });
    // Forward without its backward.
    fails_unchanged(&mut dag, "its partner B{PP:0,EP:0}#3 is not matched", |d| {
        d.shard(&"{EP:*,PASS:F}".parse().unwrap(), &[0, 1, 2], "ep")
    });
    // Not replicated at all.
    let mut dag = tiny_moe(2, 4);
    fails_unchanged(&mut dag, "not replicated", |d| {
        d.shard(&"{EP:*}".parse().unwrap(), &[0, 1], "ep")
    });
    // ZeRO-2 on the experts' replicated rest: sharded, the experts whole.
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(2))
        .unwrap();
    dag.shard(&"{EP:*}".parse().unwrap(), &[0, 1], "ep")
        .unwrap();
    // Replicating after sharding.
    let mut dag = tiny_moe(2, 4);
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::default())
        .unwrap();
    dag.shard(&"{EP:*}".parse().unwrap(), &[0, 1], "ep")
        .unwrap();
    fails_unchanged(&mut dag, "already sharded by expert parallelism", |d| {
        d.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(1))
    });
}

#[test]
fn shard_tensor_splits_the_group_and_names_bad_degrees() {
    let mut dag = tiny(2);
    dag.shard_tensor(&Filter::all(), &[0, 1], "tp").unwrap();
    // One batch share per group: the forward runs the whole batch on each
    // member, half of its FLOPs.
    let f = &dag.query(&"{PP:1,PASS:F}".parse().unwrap()).unwrap()[0];
    let alone = tiny(1).query(&"{PP:1,PASS:F}".parse().unwrap()).unwrap()[0].clone();
    assert_eq!(f.devices, vec![0, 1]);
    assert_eq!(f.cost.act_in_bytes, alone.cost.act_in_bytes);
    assert!((f.cost.flops - alone.cost.flops / 2.0).abs() < 1e-6 * alone.cost.flops);
    let plan = crate::compile::compile(&dag).unwrap();
    assert!(plan.devices[0]
        .streams
        .iter()
        .flat_map(|s| &s.ops)
        .filter(|o| o.kind().is_compute())
        .all(|o| o.spread == Some(Spread::Tensor) && o.replica == 0));
    let mut dag = tiny(4);
    fails_unchanged(
        &mut dag,
        "needs the heads (4) and the MLP width 4·d_model (256) to divide by 3",
        |d| d.shard_tensor(&Filter::all(), &[0, 1, 2], "tp"),
    );
    // Replicas two devices apart have no room for a group of three.
    dag.replicate(&Filter::all(), &[0, 2], &ReplicateOptions::default())
        .unwrap();
    fails_unchanged(&mut dag, "gives device 2 twice", |d| {
        d.shard_tensor(&Filter::all(), &[0, 1, 2, 3], "tp")
    });
    // Experts already spread over the replicas: tp must come first.
    let mut dag = tiny_moe(2, 4);
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::default())
        .unwrap();
    dag.shard(&"{EP:*}".parse().unwrap(), &[0, 1], "compute")
        .unwrap();
    fails_unchanged(&mut dag, "shard-tensor before shard (`tp` first", |d| {
        d.shard_tensor(&Filter::all(), &[0, 1], "tp")
    });
}

#[test]
fn data_and_tensor_parallelism_make_one_mesh_in_either_order() {
    // dp over [0, 2] then tp over [0, 1], and the other way round: each
    // replica's group is the tensor-parallel shape from its device.
    let meshes: Vec<TrainingDag> = [true, false]
        .into_iter()
        .map(|dp_first| {
            let mut dag = tiny(4);
            let rep = ReplicateOptions::zero(1);
            if dp_first {
                dag.replicate(&Filter::all(), &[0, 2], &rep).unwrap();
                dag.shard_tensor(&Filter::all(), &[0, 1], "tp").unwrap();
            } else {
                dag.shard_tensor(&Filter::all(), &[0, 1], "tp").unwrap();
                dag.replicate(&Filter::all(), &[0, 2], &rep).unwrap();
            }
            dag
        })
        .collect();
    for mut dag in meshes {
        let f = &dag.query(&"{PP:1,PASS:F}".parse().unwrap()).unwrap()[0];
        assert_eq!(f.devices, vec![0, 1, 2, 3]);
        // Each device runs half the batch (two replicas) on half the heads.
        let alone = tiny(1).query(&"{PP:1,PASS:F}".parse().unwrap()).unwrap()[0].clone();
        assert!((f.cost.flops - alone.cost.flops / 4.0).abs() < 1e-6 * alone.cost.flops);
        dag.snapshot();
        let plan = crate::compile::compile(&dag).unwrap();
        for d in &plan.devices {
            let ops: Vec<_> = d.streams.iter().flat_map(|s| &s.ops).collect();
            // The tensor-parallel pass meets its replica's group; the
            // ZeRO reduction the same rank of the other replica.
            let tp_group: Vec<u32> = if d.device < 2 { vec![0, 1] } else { vec![2, 3] };
            let dp_group = [d.device % 2, d.device % 2 + 2];
            let f = ops
                .iter()
                .find(|o| o.kind() == crate::compile::OpKind::F)
                .unwrap();
            assert_eq!(
                f.group().map(|g| &g[..]),
                Some(&tp_group[..]),
                "device {}",
                d.device
            );
            assert_eq!(f.replica, d.device / 2);
            let rs = ops
                .iter()
                .find(|o| o.kind() == crate::compile::OpKind::ReduceScatter)
                .unwrap();
            assert_eq!(
                rs.group().map(|g| &g[..]),
                Some(&dp_group[..]),
                "device {}",
                d.device
            );
        }
    }
    // A pipeline after the mesh keeps its groups, shifted whole.
    let mut dag = tiny(8);
    dag.shard_tensor(&Filter::all(), &[0, 1], "tp").unwrap();
    dag.replicate(&Filter::all(), &[0, 4], &ReplicateOptions::default())
        .unwrap();
    fails_unchanged(
        &mut dag,
        "place moves its groups whole, so give 4 devices",
        |d| d.place(&Filter::tag("PP", 7), &[2, 3], "pp"),
    );
    dag.place(&Filter::tag("PP", 7), &[2, 3, 6, 7], "pp")
        .unwrap();
    dag.snapshot();
    crate::compile::compile(&dag).unwrap();
}

#[test]
fn order_adds_temporal_edges_and_rejects_cycles_and_crossings() {
    let mut dag = tiny(2);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.snapshot(); // brings derived nodes up to date
    let edges = dag.edge_count();
    // F of microbatch 1 before F of microbatch 0: one edge, sink → source.
    dag.order(&[
        vec!["{PP:7,MB:1,PASS:F}".parse().unwrap()],
        vec!["{PP:0,MB:0,PASS:F}".parse().unwrap()],
    ])
    .unwrap();
    assert_eq!(dag.edge_count(), edges + 1);
    // Backward before its own forward closes a cycle.
    let e = fails_unchanged(&mut dag, "cycle", |d| {
        d.order(&[
            vec!["{PP:0,MB:0,PASS:B}".parse().unwrap()],
            vec!["{PP:0,MB:0,PASS:F}".parse().unwrap()],
        ])
    });
    assert!(matches!(e.kind, DagErrorKind::Cycle { .. }));
    fails_unchanged(&mut dag, "matches no node", |d| {
        d.order(&[
            vec!["{PP:0,MB:5,PASS:F}".parse().unwrap()],
            vec!["{PP:0,MB:0,PASS:B}".parse().unwrap()],
        ])
    });
    fails_unchanged(&mut dag, "at least 2 groups", |d| {
        d.order(&[vec![Filter::all()]])
    });
    // Nodes on different devices cannot be ordered.
    dag.place(&Filter::tag("PP", 7), &[1], "pp").unwrap();
    fails_unchanged(&mut dag, "crosses devices", |d| {
        d.order(&[
            vec!["{PP:0,MB:0,PASS:F}".parse().unwrap()],
            vec!["{PP:7,MB:0,PASS:F}".parse().unwrap()],
        ])
    });
}

#[test]
fn order_on_bi_bw_splits_the_backward() {
    let mut dag = tiny(1);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    // Zero-bubble style: BI of microbatch 0, then the F of microbatch 1, then BW of 0.
    let f = |s: &str| -> Vec<Filter> { vec![s.parse().unwrap()] };
    dag.order(&[
        f("{PP:3,MB:0,PASS:BI}"),
        f("{PP:3,MB:1,PASS:F}"),
        f("{PP:3,MB:0,PASS:BW}"),
    ])
    .unwrap();
    assert_eq!(count(&mut dag, "{PASS:BI}"), 1);
    assert_eq!(count(&mut dag, "{PASS:BW}"), 1);
    assert_eq!(count(&mut dag, "{PASS:B}"), 15);
    // BW, not BI, feeds the update.
    let bw = &dag.query(&"{PASS:BW}".parse().unwrap()).unwrap()[0];
    let (_, succs) = dag.neighbours(bw.id).unwrap();
    assert!(succs
        .iter()
        .any(|s| dag.node(s.node).unwrap().op == "update"));
    let bi = &dag.query(&"{PASS:BI}".parse().unwrap()).unwrap()[0];
    let (_, succs) = dag.neighbours(bi.id).unwrap();
    assert!(!succs
        .iter()
        .any(|s| dag.node(s.node).unwrap().op == "update"));
    // A failing order that would have split backwards restores the fused B.
    fails_unchanged(&mut dag, "cycle", |d| {
        d.order(&[f("{PP:2,MB:0,PASS:BW}"), f("{PP:2,MB:0,PASS:F}")])
    });
    assert_eq!(count(&mut dag, "{PASS:BW}"), 1);
}

#[test]
fn interleavable_groups_go_through_a_marker() {
    let mut dag = tiny(1);
    dag.split(&Filter::all(), "MB", 4).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    let g = |mb: u32| -> Vec<Filter> {
        (0..4)
            .map(|m| Filter::tag("PP", 0).and("MB", (mb + m) % 4).pass(Label::F))
            .collect()
    };
    // Group 0: four independent forwards (4 sinks); group 1: four more sources.
    let b: Vec<Filter> = (0..4)
        .map(|m| Filter::tag("PP", 7).and("MB", m).pass(Label::B))
        .collect();
    dag.order(&[g(0), b]).unwrap();
    assert_eq!(count(&mut dag, "{PASS:marker}"), 1);
}

#[test]
fn primitives_read_and_tweak_the_dag() {
    let mut dag = tiny(2);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    let ext = dag.tag_extents();
    assert_eq!((ext["PP"], ext["MB"]), (8, 2));
    assert_eq!(dag.cluster_info().devices, 2);
    let f = dag
        .query_ids(&"{PP:0,MB:1,PASS:F}".parse().unwrap())
        .unwrap()[0];
    let (preds, succs) = dag.neighbours(f).unwrap();
    assert!(preds.is_empty());
    assert_eq!(succs.len(), 2); // next forward, own backward
    assert_eq!(
        dag.set_stream(&"{PASS:update}".parse().unwrap(), "opt")
            .unwrap(),
        1
    );
    assert_eq!(dag.set_priority(&"{MB:1}".parse().unwrap(), 5).unwrap(), 16);
    // The tweak survives derived nodes being rebuilt by a later directive.
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    assert_eq!(
        dag.query(&"{PASS:update}".parse().unwrap()).unwrap()[0].stream,
        "opt"
    );
    let b = dag
        .query_ids(&"{PP:0,MB:1,PASS:B}".parse().unwrap())
        .unwrap()[0];
    let err = dag.add_temporal_edge(b, f).unwrap_err().to_string();
    assert!(err.contains("cycle"), "{err}");
    dag.add_temporal_edge(f, b).unwrap();
    dag.place(&Filter::tag("PP", 7), &[1], "pp").unwrap();
    let last = dag
        .query_ids(&"{PP:7,MB:0,PASS:F}".parse().unwrap())
        .unwrap()[0];
    let err = dag.add_temporal_edge(f, last).unwrap_err().to_string();
    assert!(err.contains("crosses devices"), "{err}");
    assert!(dag
        .node(NodeId(99_999))
        .unwrap_err()
        .to_string()
        .contains("no node has id 99999"));
    let json = dag.snapshot();
    assert!(json["nodes"].as_array().unwrap().len() > 30);
}

/// The tiny model on one device with a temporal edge from its first stage's
/// B back to its F, added behind the directives' back (no directive makes a
/// cycle); and that B.
fn tiny_with_a_cycle() -> (TrainingDag, NodeId) {
    let mut dag = tiny(1);
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.sync();
    let f = dag.query(&"{PP:0, PASS:F}".parse().unwrap()).unwrap()[0].id;
    let b = dag.query(&"{PP:0, PASS:B}".parse().unwrap()).unwrap()[0].id;
    dag.graph.add_edge(b.ix(), f.ix(), EdgeKind::Temporal);
    (dag, b)
}

/// A cycle that reaches the compiler is an error naming the nodes on it,
/// found by the schedule's own pass.
#[test]
fn compile_names_a_cycle_it_is_given() {
    let (dag, _) = tiny_with_a_cycle();
    let e = crate::compile::compile(&dag).unwrap_err().to_string();
    assert!(e.starts_with("the DAG has a cycle: "), "{e}");
    assert!(e.contains("B{PP:0}#1 -> F{PP:0}#0"), "{e}");
}

/// Validation and the schedule run side by side in compile; a DAG that is
/// both invalid and cyclic still gets the validation error (as when they ran
/// in turn), and the cycle once the node is placed again.
#[test]
fn compile_reports_an_invalid_node_before_a_cycle() {
    let (mut dag, b) = tiny_with_a_cycle();
    let devices = std::mem::take(&mut dag.graph[b.ix()].devices);
    let e = crate::compile::compile(&dag).unwrap_err().to_string();
    assert!(
        e.starts_with("B{PP:0}#1 is not placed on any device"),
        "{e}"
    );
    dag.graph[b.ix()].devices = devices;
    let e = crate::compile::compile(&dag).unwrap_err().to_string();
    assert!(e.starts_with("the DAG has a cycle: "), "{e}");
}

/// `recompute` gives each matched forward an `R` that reads the forward's
/// inputs and hands its saved tensors to the backward; the forward keeps
/// none. A second call changes nothing; bad calls fail with the DAG as it
/// was; placement directives after it are refused, naming the fix.
#[test]
fn recompute_moves_the_saved_tensors_to_a_recompute_node() {
    let mut dag = tiny(2);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    let f = |s: &str| s.parse::<Filter>().unwrap();
    // Not placed yet: refused, nothing changed.
    fails_unchanged(&mut dag, "is not placed on any device yet", |d| {
        d.recompute(&Filter::all(), RecomputePolicy::Full)
            .map(|_| ())
    });
    for r in 0..8 {
        dag.place(&Filter::tag("PP", r), &[r / 4], "pp").unwrap();
    }
    fails_unchanged(&mut dag, "matches no forward (F) node", |d| {
        d.recompute(&f("{PASS:B}"), RecomputePolicy::Full)
            .map(|_| ())
    });
    assert_eq!(
        dag.recompute(&f("{PP:2}"), RecomputePolicy::Full).unwrap(),
        2
    );
    assert_eq!(count(&mut dag, "{PASS:R}"), 2);
    let r = dag.query(&f("{PP:2,MB:1,PASS:R}")).unwrap().remove(0);
    let fwd = dag.query(&f("{PP:2,MB:1,PASS:F}")).unwrap().remove(0);
    let b = dag.query(&f("{PP:2,MB:1,PASS:B}")).unwrap().remove(0);
    assert_eq!(
        (r.devices.clone(), r.stream.clone()),
        (fwd.devices, fwd.stream)
    );
    let saved = |dag: &TrainingDag, from: NodeId| {
        dag.succs(from)
            .filter(|(_, e)| {
                matches!(
                    e,
                    EdgeKind::Data {
                        tensor: TensorKind::Saved,
                        ..
                    }
                )
            })
            .map(|(n, _)| n)
            .collect::<Vec<_>>()
    };
    assert_eq!(saved(&dag, r.id), [b.id]);
    assert!(saved(&dag, fwd.id).is_empty());
    // R reads what F reads (the previous region's activation).
    let inputs = |id: NodeId| {
        let mut v: Vec<NodeId> = dag
            .preds(id)
            .filter(|(_, e)| matches!(e, EdgeKind::Data { .. }))
            .map(|(n, _)| n)
            .collect();
        v.sort();
        v
    };
    assert_eq!(inputs(r.id), inputs(fwd.id));
    // Again: nothing left to recompute there.
    assert_eq!(
        dag.recompute(&f("{PP:2}"), RecomputePolicy::Full).unwrap(),
        0
    );
    // Selective: R reads what F keeps (less than it saves), not F's inputs,
    // and reruns only the attention core.
    assert_eq!(
        dag.recompute(&f("{PP:3}"), RecomputePolicy::Selective)
            .unwrap(),
        2
    );
    let rs = dag.query(&f("{PP:3,MB:0,PASS:R}")).unwrap().remove(0);
    let fs = dag.query(&f("{PP:3,MB:0,PASS:F}")).unwrap().remove(0);
    let kept: Vec<(NodeId, u64)> = dag
        .preds(rs.id)
        .filter_map(|(n, e)| match e {
            EdgeKind::Data {
                tensor: TensorKind::Kept,
                bytes,
            } => Some((n, bytes)),
            _ => None,
        })
        .collect();
    let seg = &dag.segments()[fs.segments[0] as usize];
    assert_eq!(kept, [(fs.id, seg.cost.kept_bytes)]);
    assert!(0 < seg.cost.kept_bytes && seg.cost.kept_bytes < seg.cost.saved_bytes);
    assert!(rs.cost.flops < fs.cost.flops / 4.0);
    fails_unchanged(
        &mut dag,
        "split, place, replicate, shard and shard-tensor must come before `recompute`",
        |d| d.place(&Filter::tag("PP", 2), &[1], "pp"),
    );
    fails_unchanged(&mut dag, "must come before `recompute`", |d| {
        d.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(0))
    });
    fails_unchanged(&mut dag, "must come before `recompute`", |d| {
        d.split(&Filter::all(), "X", 2)
    });
    let plan = crate::compile::compile(&dag).unwrap();
    let ops: usize = plan
        .devices
        .iter()
        .flat_map(|d| &d.streams)
        .flat_map(|s| &s.ops)
        .filter(|o| o.kind() == crate::compile::OpKind::R)
        .count();
    assert_eq!(ops, 4);
}

/// After a full recompute the head's forward feeds nothing (its backward
/// reads the recompute), yet it must stay before its own backward and the
/// update: an edge that would run it later, reporting the loss of
/// updated weights, is refused as a cycle, the DAG unchanged.
#[test]
fn a_forward_cannot_be_ordered_after_its_backward_or_update() {
    let mut dag = tiny(1);
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.recompute(&Filter::all(), RecomputePolicy::Full)
        .unwrap();
    dag.snapshot();
    let one = |dag: &mut TrainingDag, s: &str| dag.query(&s.parse().unwrap()).unwrap()[0].id;
    let head_f = one(&mut dag, "{PP:7,PASS:F}");
    for later in ["{PP:7,PASS:B}", "{PP:3,PASS:B}", "{PASS:update}"] {
        let from = one(&mut dag, later);
        let e = fails_unchanged(&mut dag, "cycle", |d| d.add_temporal_edge(from, head_f));
        assert!(e.to_string().contains("R{PP:7}"), "{later}: {e}");
    }
    // A forward before them still orders freely.
    let other_f = one(&mut dag, "{PP:3,PASS:F}");
    dag.add_temporal_edge(other_f, head_f).unwrap();
}

/// Under ZeRO-3 that reshards after each use, every recompute gets a
/// gather of its own when the derived nodes are rebuilt: `recompute`
/// predicts them against the node budget and rebuilds inside the call, so
/// the compiler never grows the DAG past what the plugin was charged for.
#[test]
fn recompute_under_zero3_is_charged_for_the_gathers_it_brings() {
    let model = ModelConfig {
        batch_size: 256,
        ..ModelConfig::tiny()
    };
    let mut dag = TrainingDag::build(&model, Cluster::new(2)).unwrap();
    dag.replicate(&Filter::all(), &[0, 1], &ReplicateOptions::zero(3))
        .unwrap();
    dag.split(&Filter::all(), "MB", 64).unwrap();
    dag.snapshot();
    let (start, forwards) = (dag.node_count() as u64, 8 * 64);
    // Room for the recompute nodes, not for their gathers as well.
    dag.set_budget(Some(DagBudget {
        max_nodes: start + forwards + forwards / 2,
        max_edges: u64::MAX / 4,
        max_names: 64,
        max_work: u64::MAX / 4,
        max_bytes: u64::MAX / 4,
    }));
    fails_unchanged(&mut dag, "sandbox.max_nodes", |d| {
        d.recompute(&Filter::all(), RecomputePolicy::Full)
            .map(|_| ())
    });
    // With room: the rebuilt DAG is what the call left, charged.
    dag.set_budget(None);
    assert_eq!(
        dag.recompute(&Filter::all(), RecomputePolicy::Full)
            .unwrap(),
        512
    );
    assert!(!dag.dirty, "derived nodes left for the compiler to rebuild");
    assert_eq!(dag.node_count() as u64, start + 2 * forwards);
}

/// An `R` a strategy ordered keeps that order (compile adds its own
/// placement only to unordered ones): here right after its forward.
#[test]
fn a_recompute_the_strategy_orders_keeps_its_order() {
    let mut dag = tiny(1);
    dag.split(&Filter::all(), "MB", 2).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    let f = |s: &str| s.parse::<Filter>().unwrap();
    dag.recompute(&f("{PP:0}"), RecomputePolicy::Full).unwrap();
    dag.order(&[vec![f("{PP:0,MB:0,PASS:R}")], vec![f("{PP:1,MB:0,PASS:F}")]])
        .unwrap();
    let plan = crate::compile::compile(&dag).unwrap();
    let ops: Vec<String> = plan.devices[0].streams[0]
        .ops
        .iter()
        .map(|o| format!("{}{}/{}", o.kind(), o.segments[0], o.microbatch))
        .collect();
    let at = |s: &str| ops.iter().position(|o| o == s).unwrap();
    assert!(at("R0/0") < at("F1/0"), "{ops:?}");
    assert!(at("F0/0") < at("R0/0"), "{ops:?}");
}

/// `order` over groups of ~10⁵ nodes (every forward, then every backward, of
/// 64 layers × 1024 microbatches on one device), under the budget a plugin
/// gets by default: one host call that fits it (the membership look-ups
/// were quadratic, minutes of one call; now a bisection per node).
#[test]
fn order_over_groups_of_a_hundred_thousand_nodes_fits_a_plugins_budget() {
    let cfg = ModelConfig {
        layers: 64,
        batch_size: 1024,
        ..ModelConfig::tiny()
    };
    let mut dag = TrainingDag::build(&cfg, Cluster::new(1)).unwrap();
    dag.split(&Filter::all(), "MB", 1024).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.snapshot();
    let forwards = dag.query(&"{PASS:F}".parse().unwrap()).unwrap().len();
    assert_eq!(forwards, 64 * 1024);
    dag.set_budget(Some(crate::plugin::SandboxLimits::default().dag_budget()));
    let edges = dag.edge_count();
    dag.order(&[
        vec!["{PASS:F}".parse().unwrap()],
        vec!["{PASS:B}".parse().unwrap()],
    ])
    .unwrap();
    // The forwards' sinks (each microbatch's last layer) before the
    // backwards' sources (each microbatch's head backward).
    assert!(dag.edge_count() > edges);
    assert!(dag.work_used() > 0);
}

/// A hub ordered before every backward, twice: the second `order` finds
/// every edge there already without scanning the hub's edges once per
/// backward (2^15 × 2^15 edge visits), within a plugin's budget.
#[test]
fn a_hub_ordered_before_many_nodes_twice_reads_its_edges_once() {
    let n = 1u32 << 15;
    let cfg = ModelConfig {
        layers: 1,
        batch_size: n,
        ..ModelConfig::tiny()
    };
    let mut dag = TrainingDag::build(&cfg, Cluster::new(1)).unwrap();
    dag.split(&Filter::all(), "MB", n).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    dag.set_budget(Some(crate::plugin::SandboxLimits::default().dag_budget()));
    let hub = vec![Filter::tag("MB", 0).pass(Label::F)];
    let all_b = vec![Filter::all().pass(Label::B)];
    dag.order(&[hub.clone(), all_b.clone()]).unwrap();
    let edges = dag.edge_count();
    assert!(edges > n as usize, "the hub's edges: {edges}");
    dag.order(&[hub, all_b]).unwrap();
    assert_eq!(dag.edge_count(), edges, "the second order adds no edge");
}

#[test]
fn sequence_parallelism_needs_tensor_parallel_segments_and_covers_each_of_their_nodes() {
    let mut dag = tiny(2);
    let err = dag
        .sequence_parallel(&Filter::all())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is not tensor-parallel: shard-tensor its segment first"),
        "{err}"
    );
    dag.shard_tensor(&Filter::all(), &[0, 1], "tp").unwrap();
    // One forward matched covers its segment's every node.
    let first = Filter::tag("PP", 0).pass(Label::F);
    assert_eq!(dag.sequence_parallel(&first).unwrap(), 1);
    let covered = |dag: &mut TrainingDag, pass: Label| {
        let nodes = dag.query(&Filter::tag("PP", 0).pass(pass)).unwrap();
        nodes.iter().all(|n| {
            dag.node_ref(n.id)
                .unwrap()
                .tensor_parallel
                .unwrap()
                .sequence
        })
    };
    assert!(covered(&mut dag, Label::F) && covered(&mut dag, Label::B));
    let other = dag.query(&Filter::tag("PP", 1).pass(Label::F)).unwrap();
    assert!(other.iter().all(|n| !dag
        .node_ref(n.id)
        .unwrap()
        .tensor_parallel
        .unwrap()
        .sequence));
}
