//! Layouts people train with, composed from the bundled plugins on one
//! device mesh (tensor parallelism contiguous, then pipeline positions,
//! then data-parallel replicas): each trains to one device's losses with
//! every device at work, or is refused naming what conflicts. No
//! composition leaves a device idle without an error.

use piper::compile::plan::{OpKind, Spread};
use piper::plugin::{PluginHost, SandboxLimits};
use piper::runtime::{Corpus, TrainOptions, Trainer};

use common::{
    assert_same_training, one_device, plan_with, small, small_llama, small_moe, train, Strategy,
};

use crate::common;

/// `small` with 4 heads, so tensor parallelism of 2 divides them.
fn four_heads() -> piper::model::ModelConfig {
    piper::model::ModelConfig {
        heads: 4,
        ..small()
    }
}

/// Every device of `plan` runs compute, each tensor-parallel pass meets a
/// group of `tp` devices, and gradients are reduced over groups of `dp`.
fn assert_mesh(name: &str, plan: &piper::compile::Plan, tp: usize, dp: usize) {
    for d in &plan.devices {
        let ops: Vec<_> = d.streams.iter().flat_map(|s| &s.ops).collect();
        assert!(
            ops.iter().any(|o| o.kind().is_compute()),
            "{name}: device {} runs no compute",
            d.device
        );
        for o in ops.iter().filter(|o| o.spread == Some(Spread::Tensor)) {
            assert_eq!(o.group().map(|g| g.len()), Some(tp), "{name}");
        }
        let syncs = ops.iter().filter(|o| {
            matches!(o.kind(), OpKind::AllReduce | OpKind::ReduceScatter)
                && o.purpose() == Some(piper::compile::plan::CommPurpose::GradSync)
        });
        for o in syncs {
            assert_eq!(o.group().map(|g| g.len()), Some(dp), "{name}");
        }
    }
}

#[test]
fn data_and_tensor_parallelism_compose_with_pipelines_at_one_devices_losses() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let steps = 10;
    let cfg = four_heads();
    let base = one_device(&host, &cfg, steps);
    let cases: [(&str, u32, usize, usize, Strategy); 7] = [
        (
            "dp×tp",
            4,
            2,
            2,
            &[("dp", &[("degree", "2")]), ("tp", &[("tp", "2")])],
        ),
        (
            "tp×dp",
            4,
            2,
            2,
            &[("tp", &[("tp", "2")]), ("dp", &[("degree", "2")])],
        ),
        (
            "zero2×tp",
            4,
            2,
            2,
            &[
                ("zero", &[("stage", "2"), ("dp", "2")]),
                ("tp", &[("tp", "2")]),
            ],
        ),
        (
            "zero3×tp",
            4,
            2,
            2,
            &[
                ("tp", &[("tp", "2")]),
                ("zero", &[("stage", "3"), ("dp", "2")]),
            ],
        ),
        // Megatron's 3D layout: dp 2 × tp 2 × pp 2.
        (
            "zero1×tp×1f1b",
            8,
            2,
            2,
            &[
                ("zero", &[("stage", "1"), ("dp", "2")]),
                ("tp", &[("tp", "2")]),
                ("1f1b", &[("microbatches", "4")]),
            ],
        ),
        (
            "zero1×tp×interleaved",
            8,
            2,
            2,
            &[
                ("tp", &[("tp", "2")]),
                ("zero", &[("stage", "1"), ("dp", "2")]),
                (
                    "interleaved-1f1b",
                    &[("virtual", "2"), ("microbatches", "4")],
                ),
            ],
        ),
        // ZeRO-1 over DualPipe's two parameter copies: the copies'
        // gradients summed, then each copy's states sharded over its group.
        (
            "zero1×dualpipe",
            8,
            1,
            2,
            &[
                ("zero", &[("stage", "1"), ("dp", "2")]),
                ("dualpipe", &[("microbatches", "8")]),
            ],
        ),
    ];
    for (name, devices, tp, dp, strategy) in cases {
        let plan = plan_with(&host, &cfg, devices, strategy).unwrap();
        assert_mesh(name, &plan, tp, dp);
        let run = train(&host, &cfg, devices, strategy, steps);
        assert_same_training(name, &run, &base);
    }
}

#[test]
fn the_llama_family_trains_on_a_3d_mesh_at_one_devices_losses() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let steps = 10;
    let cfg = small_llama();
    let base = one_device(&host, &cfg, steps);
    let strategy: Strategy = &[
        ("tp", &[("tp", "2")]),
        ("zero", &[("stage", "3"), ("dp", "2")]),
        ("1f1b", &[("microbatches", "4")]),
    ];
    let plan = plan_with(&host, &cfg, 8, strategy).unwrap();
    assert_mesh("llama zero3×tp×1f1b", &plan, 2, 2);
    let run = train(&host, &cfg, 8, strategy, steps);
    assert_same_training("llama zero3×tp×1f1b", &run, &base);
}

/// Step-1 gradients put back together from every device's ZeRO shards of
/// its tensor-parallel slices are one device's, every parameter present.
#[test]
fn step1_gradients_of_zero_over_tensor_parallel_groups_match_one_device() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let zero1_tp_1f1b: Strategy = &[
        ("zero", &[("stage", "1"), ("dp", "2")]),
        ("tp", &[("tp", "2")]),
        ("1f1b", &[("microbatches", "4")]),
    ];
    let zero3_tp: Strategy = &[("tp", &[("tp", "2")]), ("zero", &[("stage", "3")])];
    step1_grads_match_one_device(
        &host,
        &four_heads(),
        &[
            ("zero1×tp×1f1b", 8, zero1_tp_1f1b),
            ("zero3×tp", 4, zero3_tp),
        ],
    );
    // Tensor × expert parallelism: experts spread over the mesh, the
    // router's and layernorm's gradients summed over both axes.
    let zero1_tp_ep: Strategy = &[
        ("zero", &[("stage", "1"), ("dp", "2")]),
        ("tp", &[("tp", "2")]),
        ("ep", &[]),
    ];
    let tp_ep: Strategy = &[("tp", &[("tp", "2")]), ("ep", &[])];
    step1_grads_match_one_device(
        &host,
        &small_moe(),
        &[("zero1×tp×ep", 4, zero1_tp_ep), ("tp×ep", 2, tp_ep)],
    );
}

/// Each case's step-1 gradients and stepped parameters, put back together
/// from every device, against one device's.
fn step1_grads_match_one_device(
    host: &PluginHost,
    cfg: &piper::model::ModelConfig,
    cases: &[(&str, u32, Strategy)],
) {
    let batch = Corpus::builtin().batch(1, 32, 16, 256).unwrap();
    let grads = |devices: u32, strategy: Strategy| {
        let opts = TrainOptions {
            capture_grads: true,
            ..Default::default()
        };
        let plan = plan_with(host, cfg, devices, strategy).unwrap();
        let mut t = Trainer::new(cfg, plan, opts).unwrap();
        t.step(&batch).unwrap();
        (t.last_grads().unwrap(), t.params().unwrap())
    };
    let (base, params) = grads(1, &[("1f1b", &[("stages", "1"), ("microbatches", "1")])]);
    for &(name, devices, strategy) in cases {
        let (g, p) = grads(devices, strategy);
        assert_eq!(
            g.keys().collect::<Vec<_>>(),
            params.keys().collect::<Vec<_>>(),
            "{name}: every parameter has a gradient"
        );
        for (n, want) in &base {
            let (got, pw, pb) = (&g[n], &p[n], &params[n]);
            // The stepped parameters, put back together from slices and
            // shards: one device's up to Adam's normalised float noise.
            assert_eq!(
                pw.len(),
                pb.len(),
                "{name}: parameter {n} put back together"
            );
            let pscale = pb.iter().fold(0f32, |a, x| a.max(x.abs())).max(1e-3);
            let pworst = (pw.iter().zip(pb)).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(
                pworst / pscale < 1e-2,
                "{name}: parameter {n} differs by {pworst}"
            );
            let scale = want.iter().fold(0f32, |a, x| a.max(x.abs())).max(1e-12);
            let worst = (got.iter().zip(want)).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            // Another summation order (half batches, the group's sums):
            // ~1e-6 of the largest entry; a lost shard or slice is 1e-2.
            assert!(
                worst / scale < 1e-5,
                "{name}: gradient of {n} differs by {worst} (scale {scale})"
            );
        }
    }
}

#[test]
fn compositions_that_cannot_hold_are_refused_by_name() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let cfg = four_heads();
    let refused = |devices: u32, strategy: Strategy, expect: &str| {
        let err = plan_with(&host, &cfg, devices, strategy).unwrap_err();
        assert!(
            err.contains(expect),
            "{strategy:?}: `{err}` lacks `{expect}`"
        );
    };
    // Data or tensor parallelism after a pipeline would fold its stages
    // onto one group: named with the order that works.
    refused(
        4,
        &[("1f1b", &[("stages", "2")]), ("tp", &[("tp", "2")])],
        "apply tp before the pipeline strategy",
    );
    refused(
        4,
        &[("gpipe", &[("stages", "2")]), ("dp", &[("degree", "2")])],
        "apply dp before the pipeline strategy",
    );
    // tp 2 × dp 4 needs 8 devices.
    refused(
        4,
        &[("tp", &[("tp", "2")]), ("dp", &[("degree", "4")])],
        "dp × tp must fit the 4 devices",
    );
    // ZeRO-2/3 would reduce each microbatch before DualPipe's copies meet.
    refused(
        8,
        &[
            ("zero", &[("stage", "2"), ("dp", "2")]),
            ("dualpipe", &[("microbatches", "8")]),
        ],
        "ZeRO-2/3 over parameter copies is not supported (plain data parallelism and ZeRO-1 are)",
    );
    // A composition that leaves devices without work: refused, not run.
    refused(
        4,
        &[("tp", &[("tp", "2")])],
        "2 of the 4 devices run no compute: devices 2, 3",
    );
}

/// The first report: `tp:tp=2` then `dp:degree=2` on 4 devices ran
/// with devices 1 and 3 idle. Now every device trains, and each sends what
/// the plan says (the tensor-parallel sums inside the passes included).
#[test]
fn tp_then_dp_keeps_every_device_busy_and_sends_what_it_planned() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let cfg = four_heads();
    let strategy: Strategy = &[("tp", &[("tp", "2")]), ("dp", &[("degree", "2")])];
    let plan = plan_with(&host, &cfg, 4, strategy).unwrap();
    let planned = plan.predicted_sent_bytes();
    let mut trainer = Trainer::new(&cfg, plan, TrainOptions::default()).unwrap();
    let batch = Corpus::builtin().batch(1, 32, 16, 256).unwrap();
    let st = trainer.step(&batch).unwrap();
    for (d, planned) in planned.iter().enumerate() {
        assert!(st.peak_bytes[d] > 0, "device {d} idle");
        let (sent, plan) = (st.comm_bytes[d] as f64, *planned as f64);
        assert!(
            (sent / plan - 1.0).abs() < 0.05,
            "device {d}: sent {sent} bytes, planned {plan}"
        );
    }
}

/// The second report: tp 8 × ZeRO-1 dp 2 × 1F1B over 8 stages on
/// 128 simulated H100s planned 8 devices. Now all 128 work, in Megatron's
/// order: tensor-parallel groups of 8 consecutive devices, stage s of
/// replica i on devices 64·i + 8·s … + 7.
#[test]
fn a_128_device_3d_layout_plans_every_device() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let cfg = piper::model::ModelConfig {
        heads: 8,
        batch_size: 128,
        ..small()
    };
    let strategy: Strategy = &[
        ("tp", &[("tp", "8")]),
        ("zero", &[("stage", "1"), ("dp", "2")]),
        ("1f1b", &[("stages", "8"), ("microbatches", "64")]),
    ];
    let plan = plan_with(&host, &cfg, 128, strategy).unwrap();
    assert_mesh("tp8×zero1×1f1b", &plan, 8, 2);
    let dev = &plan.devices[64 + 8 * 3 + 5];
    let f = (dev.streams.iter().flat_map(|s| &s.ops))
        .find(|o| o.kind() == OpKind::F)
        .unwrap();
    assert_eq!(
        f.group().map(|g| &g[..]),
        Some(&(88..96).collect::<Vec<u32>>()[..])
    );
    assert_eq!(f.tags.get("PP"), Some(&3));
    let s = piper::sim::simulate(&plan, &piper::sim::Cluster::h100_cluster(16)).unwrap();
    assert!(s.devices.iter().all(|d| d.busy > 0.0));
}

/// The example run configs of the published layouts (Megatron's 3D as
/// NeMo trains Llama 3 70B, torchtitan's 2D and 3D, DeepSeek-V3's
/// DualPipe × EP × ZeRO-1) plan and simulate on their real shapes with
/// every device at work.
#[test]
fn the_published_layouts_plan_every_device_on_their_real_shapes() {
    let home = std::env::temp_dir().join(format!("piper-layouts-{}", std::process::id()));
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/layouts");
    for (config, devices) in [
        ("megatron-3d", "8 × 8 devices"),
        ("torchtitan-2d", "32 × 8 devices"),
        ("torchtitan-3d", "64 × 8 devices"),
        ("deepseek-v3-style", "8 × 8 devices"),
    ] {
        let path = format!("{examples}/{config}.toml");
        let args = [
            "plan",
            "--config",
            &path,
            "--simulate",
            "--cluster",
            "h100-cluster",
        ];
        // Planned at all means every device computes (the compiler
        // refuses a plan that leaves one idle); the summary says so too.
        let (ok, out, err) = common::piper(&home, &args);
        assert!(ok, "{config}: {err}");
        assert!(out.contains(devices), "{config}: {out}");
        assert!(!out.contains(" idle\n"), "{config}: {out}");
    }
    let _ = std::fs::remove_dir_all(&home);
}

/// Expert parallelism with ZeRO-2 and ZeRO-3: the experts' replicated rest
/// (norm, router) sharded over the data-parallel group, each expert whole
/// on its device; in one op, split into phases under 1F1B, and under
/// DualPipeV. On a dropless MoE model, at one device's losses (ZeRO-1 × EP ×
/// DualPipeV, DeepSeek-V3's, is in train.rs's MoE test).
#[test]
fn experts_compose_with_zero_2_and_3_at_one_devices_losses() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let cfg = small_moe();
    let base = one_device(&host, &cfg, 10);
    let cases: [(&str, u32, Strategy); 3] = [
        (
            "zero2×ep",
            2,
            &[
                ("zero", &[("stage", "2")]),
                ("ep", &[("stream", "compute")]),
            ],
        ),
        (
            "zero3×ep×1f1b",
            4,
            &[
                ("zero", &[("stage", "3"), ("dp", "2")]),
                ("ep", &[]),
                ("1f1b", &[("microbatches", "4")]),
            ],
        ),
        (
            "zero2×ep×dualpipev",
            4,
            &[
                ("zero", &[("stage", "2"), ("dp", "2")]),
                ("ep", &[]),
                ("dualpipev", &[("microbatches", "4")]),
            ],
        ),
    ];
    for (name, devices, strategy) in cases {
        let run = train(&host, &cfg, devices, strategy, 10);
        assert_same_training(name, &run, &base);
    }
}

/// Context parallelism on a MoE model: the expert segments hold each
/// member's chunks of its sequences as attention does, `ep` after `cp`
/// spreads the experts over the data- and context-parallel replicas
/// together (Megatron's expert-data-parallel group spans dp × cp), and the
/// sequence-wise balance loss sums each sequence's statistics over the
/// context-parallel group. Alone, with dp, tp, ZeRO-3 and 1F1B, split into
/// phases or exchanging inside the op: one device's losses, step-1
/// gradients equal, every device at work, sent bytes the plan's. `cp` after
/// `ep` is refused with the order that works.
#[test]
fn context_and_expert_parallelism_compose_at_one_devices_losses() {
    use piper::model::{Attention, ModelConfig};
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let cfg = ModelConfig {
        attention: Attention::Flash,
        ..small_moe()
    };
    let base = one_device(&host, &cfg, 10);
    let cp2: &[(&str, &str)] = &[("cp", "2")];
    let cases: [(&str, u32, usize, Strategy); 5] = [
        ("cp (experts replicated)", 2, 1, &[("cp", cp2)]),
        ("cp×ep", 2, 2, &[("cp", cp2), ("ep", &[])]),
        (
            "cp×dp×ep (in the op)",
            4,
            4,
            &[
                ("cp", cp2),
                ("dp", &[("degree", "2")]),
                ("ep", &[("stream", "compute")]),
            ],
        ),
        (
            "tp×cp×ep",
            4,
            4,
            &[("tp", &[("tp", "2")]), ("cp", cp2), ("ep", &[])],
        ),
        (
            "zero3×cp×ep×1f1b",
            8,
            4,
            &[
                ("zero", &[("stage", "3"), ("dp", "2")]),
                ("cp", cp2),
                ("ep", &[]),
                ("1f1b", &[("microbatches", "4")]),
            ],
        ),
    ];
    for (name, devices, ep, strategy) in cases {
        let plan = plan_with(&host, &cfg, devices, strategy).unwrap();
        let experts: Vec<_> = (plan.devices.iter())
            .flat_map(|d| d.streams.iter().flat_map(|s| &s.ops))
            .filter(|o| o.kind().is_compute() && o.tags.contains_key("EP"))
            .collect();
        assert!(!experts.is_empty(), "{name}: no expert pass");
        for o in experts {
            assert_eq!(o.cp, 2, "{name}: an expert pass holds whole sequences");
            let spread = (o.spread == Some(Spread::Experts)).then(|| o.group().map(|g| g.len()));
            assert_eq!(spread.flatten().unwrap_or(1), ep, "{name}: EP degree");
        }
        let run = train(&host, &cfg, devices, strategy, 10);
        assert!(run.peak_bytes.iter().all(|b| *b > 0), "{name}: idle device");
        assert_same_training(name, &run, &base);
        // The rows each device sends depend on where its tokens go: at
        // step 1, the router near its even start, they are what the plan
        // counts.
        let sent = train(&host, &cfg, devices, strategy, 1).sent_bytes;
        for (d, want) in plan.predicted_sent_bytes().iter().enumerate() {
            let got = sent[d] as f64;
            assert!(
                (got / *want as f64 - 1.0).abs() < 0.02,
                "{name}: device {d} sent {got} bytes, the plan says {want}"
            );
        }
    }
    step1_grads_match_one_device(
        &host,
        &cfg,
        &[
            (
                "cp×dp×ep",
                4,
                &[("cp", cp2), ("dp", &[("degree", "2")]), ("ep", &[])],
            ),
            (
                "tp×cp×ep",
                4,
                &[("tp", &[("tp", "2")]), ("cp", cp2), ("ep", &[])],
            ),
        ],
    );
    let err = plan_with(&host, &cfg, 4, &[("ep", &[("ep", "2")]), ("cp", cp2)]).unwrap_err();
    assert!(
        err.contains("apply context-parallel before shard (`cp` before `ep`)"),
        "{err}"
    );
}

/// Tensor parallelism × expert parallelism (Megatron with expert-tensor-
/// parallel size 1): attention tensor-parallel, each MoE layer's experts
/// spread over the whole dp × tp mesh, every tensor-parallel rank routing
/// its share of its replica's sequences. At one device's losses, every
/// device at work; `tp` on a MoE model without `ep` is refused by name.
#[test]
fn tensor_and_expert_parallelism_compose_at_one_devices_losses() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let cfg = small_moe();
    let base = one_device(&host, &cfg, 10);
    let cases: [(&str, u32, usize, Strategy); 5] = [
        ("tp×ep", 2, 2, &[("tp", &[("tp", "2")]), ("ep", &[])]),
        (
            "zero3×tp×ep",
            4,
            4,
            &[
                ("zero", &[("stage", "3"), ("dp", "2")]),
                ("tp", &[("tp", "2")]),
                ("ep", &[]),
            ],
        ),
        (
            "zero1×tp×ep×dualpipev",
            8,
            4,
            &[
                ("zero", &[("stage", "1"), ("dp", "2")]),
                ("tp", &[("tp", "2")]),
                ("ep", &[]),
                ("dualpipev", &[("microbatches", "4")]),
            ],
        ),
        (
            "dp×tp×ep",
            4,
            4,
            &[
                ("dp", &[("degree", "2")]),
                ("tp", &[("tp", "2")]),
                ("ep", &[]),
            ],
        ),
        (
            "zero1×tp×ep×1f1b",
            8,
            4,
            &[
                ("zero", &[("stage", "1"), ("dp", "2")]),
                ("tp", &[("tp", "2")]),
                ("ep", &[]),
                ("1f1b", &[("stages", "2"), ("microbatches", "4")]),
            ],
        ),
    ];
    for (name, devices, ep, strategy) in cases {
        let plan = plan_with(&host, &cfg, devices, strategy).unwrap();
        let experts: Vec<_> = (plan.devices.iter())
            .flat_map(|d| d.streams.iter().flat_map(|s| &s.ops))
            .filter(|o| o.spread == Some(Spread::Experts))
            .collect();
        assert!(!experts.is_empty(), "{name}: no expert-parallel pass");
        for o in experts {
            assert_eq!(o.group().map(|g| g.len()), Some(ep), "{name}");
            assert_eq!(o.tp, 2, "{name}");
        }
        let run = train(&host, &cfg, devices, strategy, 10);
        assert!(run.peak_bytes.iter().all(|b| *b > 0), "{name}: idle device");
        assert_same_training(name, &run, &base);
    }
    let err = plan_with(&host, &cfg, 2, &[("tp", &[("tp", "2")])]).unwrap_err();
    assert!(
        err.contains("need `shard` over the whole mesh (`tp`, then `ep`)"),
        "{err}"
    );
}

/// Megatron-SP: `tp` with `sequence-parallel=true` splits the norms and the
/// residual stream along the tokens, all-gathers before and reduce-scatters
/// after the tensor-parallel layers. GPT-2, Llama and MoE models train at
/// one device's losses in 2D and 3D layouts and with a selective recompute;
/// step-1 gradients (the norms' summed over the group) equal one device's;
/// the plan and the run hold fewer activation bytes than without it.
#[test]
fn sequence_parallelism_trains_at_one_devices_losses_and_holds_less() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let sp: &[(&str, &str)] = &[("tp", "2"), ("sequence-parallel", "true")];
    let llama = small_llama();
    let selective = [("policy", "selective")];
    let gpt2_cases: [(&str, u32, Strategy); 3] = [
        ("tp+sp", 2, &[("tp", sp)]),
        (
            "tp+sp×recompute",
            2,
            &[("tp", sp), ("recompute", &selective)],
        ),
        (
            "zero1×tp+sp×1f1b",
            8,
            &[
                ("zero", &[("stage", "1"), ("dp", "2")]),
                ("tp", sp),
                ("1f1b", &[("microbatches", "4")]),
            ],
        ),
    ];
    let llama_cases: [(&str, u32, Strategy); 1] = [(
        "llama zero3×tp+sp×1f1b",
        8,
        &[
            ("tp", sp),
            ("zero", &[("stage", "3"), ("dp", "2")]),
            ("1f1b", &[("microbatches", "4")]),
        ],
    )];
    let moe_cases: [(&str, u32, Strategy); 1] = [("moe tp+sp×ep", 2, &[("tp", sp), ("ep", &[])])];
    for (cfg, cases) in [
        (four_heads(), &gpt2_cases[..]),
        (llama.clone(), &llama_cases[..]),
        (small_moe(), &moe_cases[..]),
    ] {
        let base = one_device(&host, &cfg, 10);
        for &(name, devices, strategy) in cases {
            let plan = plan_with(&host, &cfg, devices, strategy).unwrap();
            let tensor: Vec<_> = (plan.devices.iter())
                .flat_map(|d| d.streams.iter().flat_map(|s| &s.ops))
                .filter(|o| o.spread == Some(Spread::Tensor))
                .collect();
            assert!(
                !tensor.is_empty() && tensor.iter().all(|o| o.sp),
                "{name}: every tensor-parallel pass is sequence-parallel"
            );
            let run = train(&host, &cfg, devices, strategy, 10);
            assert!(run.peak_bytes.iter().all(|b| *b > 0), "{name}: idle device");
            assert_same_training(name, &run, &base);
        }
    }
    step1_grads_match_one_device(&host, &four_heads(), &[("tp+sp", 2, &[("tp", sp)])]);
    step1_grads_match_one_device(&host, &llama, &[("llama tp+sp", 2, &[("tp", sp)])]);
    // What it saves, planned and measured, on a model whose residual
    // stream is a visible share of what a layer keeps.
    let wide = piper::model::ModelConfig {
        seq_len: 64,
        ..four_heads()
    };
    let tp: Strategy = &[("tp", &[("tp", "2")])];
    let with_sp: Strategy = &[("tp", sp)];
    let peak = |s: Strategy| {
        let plan = plan_with(&host, &wide, 2, s).unwrap();
        let run = train(&host, &wide, 2, s, 1);
        (plan.devices[0].peak_bytes, run.peak_bytes[0])
    };
    // Refused by name: tokens per microbatch replica that do not divide
    // (one sequence of 15 per microbatch over a group of 2).
    let odd = piper::model::ModelConfig {
        seq_len: 15,
        ..four_heads()
    };
    let mbs = odd.batch_size.to_string();
    let err = plan_with(
        &host,
        &odd,
        4,
        &[
            ("tp", sp),
            ("1f1b", &[("stages", "2"), ("microbatches", &mbs)]),
        ],
    )
    .unwrap_err();
    assert!(
        err.contains("is sequence-parallel over tensor-parallel groups of 2, but a microbatch replica holds 15 tokens"),
        "{err}"
    );
    // What it sends is what the plan says: the all-reduces' bytes, plus
    // the gathers where each segment's blocks end and the norms' gradient
    // sums; under a pipeline with a split backward (zb-h1) too, with or
    // without sequence parallelism (every tensor-parallel rank sends its
    // replica's whole activation to its peer: one batch share per group).
    let sent = |strategy: Strategy| {
        let plan = plan_with(&host, &four_heads(), 4, strategy).unwrap();
        let planned = plan.predicted_sent_bytes();
        let mut trainer = Trainer::new(&four_heads(), plan, TrainOptions::default()).unwrap();
        let batch = Corpus::builtin().batch(1, 32, 16, 256).unwrap();
        let st = trainer.step(&batch).unwrap();
        (st.comm_bytes, planned)
    };
    let dp: &[(&str, &str)] = &[("degree", "2")];
    let (got, want) = sent(&[("tp", sp), ("dp", dp)]);
    for d in 0..4 {
        let (got, want) = (got[d] as f64, want[d] as f64);
        assert!(
            (got / want - 1.0).abs() < 0.01,
            "tp+sp×dp: device {d} sent {got}, planned {want}"
        );
    }
    let zb: &[(&str, &str)] = &[("microbatches", "4")];
    let (got_sp, want_sp) = sent(&[("tp", sp), ("zb-h1", zb)]);
    let (got_tp, want_tp) = sent(&[("tp", &[("tp", "2")]), ("zb-h1", zb)]);
    for d in 0..4 {
        for (what, got, want) in [("tp", &got_tp, &want_tp), ("tp+sp", &got_sp, &want_sp)] {
            let (got, want) = (got[d] as f64, want[d] as f64);
            assert!(
                (got / want - 1.0).abs() < 0.001,
                "{what}×zb-h1: device {d} sent {got}, planned {want}"
            );
        }
        let more = got_sp[d] as f64 - got_tp[d] as f64;
        let planned_more = want_sp[d] as f64 - want_tp[d] as f64;
        assert!(
            more > 0.0 && (more / planned_more - 1.0).abs() < 0.01,
            "tp+sp×zb-h1: device {d} sent {more} bytes more than tp×zb-h1, planned {planned_more} more"
        );
    }
    let (plan_tp, run_tp) = peak(tp);
    let (plan_sp, run_sp) = peak(with_sp);
    println!("peak bytes, tp: planned {plan_tp} measured {run_tp}; tp+sp: planned {plan_sp} measured {run_sp}");
    assert!(
        plan_sp < plan_tp,
        "planned {plan_sp} with sp, {plan_tp} without"
    );
    assert!(
        run_sp < run_tp,
        "measured {run_sp} with sp, {run_tp} without"
    );
}
