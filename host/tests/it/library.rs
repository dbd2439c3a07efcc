//! The strategy library (the bundled plugins `dp`, `zero`, `gpipe`, `1f1b`,
//! `interleaved-1f1b`, `zb-h1`, `zbv`, `interleaved-zb`, `dualpipev`,
//! `dualpipe`) and its
//! compositions: each trains `tiny` to the losses of one device on the CPU
//! runtime, each schedule matches the published order written out by hand,
//! memory follows the papers, and every precondition fails with its numbers.

use piper::compile::Plan;
use piper::model::ModelConfig;
use piper::plugin::{PluginHost, SandboxLimits};

use common::{assert_same_training, one_device, plan_with, train, Run, Strategy};

use crate::common;

fn host() -> PluginHost {
    PluginHost::new(SandboxLimits::default(), None).unwrap()
}

fn plan(devices: u32, strategy: Strategy) -> Result<Plan, String> {
    let plan = plan_with(&host(), &ModelConfig::tiny(), devices, strategy)?;
    // Schedules are checked on the plan as its JSON says it (what a runtime reads).
    let json = serde_json::to_string(&plan).unwrap();
    Ok(serde_json::from_str(&json).unwrap())
}

const STEPS: u32 = 10;

#[test]
fn every_library_plugin_trains_tiny_to_the_losses_of_one_device() {
    let host = host();
    let base = one_device(&host, &ModelConfig::tiny(), STEPS);
    assert!(
        base.losses[STEPS as usize - 1] < base.losses[0] - 0.3,
        "one device learns: {:?}",
        base.losses
    );
    let cases: [(&str, u32, Strategy); 10] = [
        ("dp", 2, &[("dp", &[])]),
        ("zero(2)", 2, &[("zero", &[("stage", "2")])]),
        ("gpipe", 4, &[("gpipe", &[("microbatches", "8")])]),
        ("1f1b", 4, &[("1f1b", &[("microbatches", "8")])]),
        (
            "interleaved-1f1b",
            4,
            &[(
                "interleaved-1f1b",
                &[("virtual", "2"), ("microbatches", "8")],
            )],
        ),
        ("zb-h1", 4, &[("zb-h1", &[("microbatches", "8")])]),
        ("zbv", 4, &[("zbv", &[("microbatches", "8")])]),
        (
            "interleaved-zb",
            4,
            &[("interleaved-zb", &[("virtual", "2"), ("microbatches", "8")])],
        ),
        ("dualpipev", 4, &[("dualpipev", &[("microbatches", "8")])]),
        ("dualpipe", 4, &[("dualpipe", &[("microbatches", "8")])]),
    ];
    for (name, devices, strategy) in cases {
        let run = train(&host, &ModelConfig::tiny(), devices, strategy, STEPS);
        assert_same_training(name, &run, &base);
    }
}

#[test]
fn compositions_train_tiny_to_the_losses_of_one_device() {
    let host = host();
    let base = one_device(&host, &ModelConfig::tiny(), STEPS);
    let mut zero_states = Vec::new();
    let mut zero_peaks = Vec::new();
    for stage in ["1", "2", "3"] {
        let name = format!("zero({stage})+1f1b");
        let run = train(
            &host,
            &ModelConfig::tiny(),
            4,
            &[
                ("zero", &[("stage", stage), ("dp", "2")]),
                ("1f1b", &[("microbatches", "4")]),
            ],
            STEPS,
        );
        assert_same_training(&name, &run, &base);
        zero_states.push(run.state_bytes[0]);
        zero_peaks.push(run.peak_bytes[0]);
    }
    // Inside the pipeline too, each ZeRO stage shards one more kind of state.
    assert!(
        zero_states[0] > zero_states[1] && zero_states[1] > zero_states[2],
        "model-state bytes on device 0 for ZeRO-1/2/3 + 1F1B: {zero_states:?}"
    );
    // ZeRO-3 keeping gathered parameters from the first forward to the last
    // backward (reshard-after-forward=false) trains the same, with more memory.
    let kept = train(
        &host,
        &ModelConfig::tiny(),
        4,
        &[
            (
                "zero",
                &[
                    ("stage", "3"),
                    ("dp", "2"),
                    ("reshard-after-forward", "false"),
                ],
            ),
            ("1f1b", &[("microbatches", "4")]),
        ],
        STEPS,
    );
    assert_same_training("zero(3, kept)+1f1b", &kept, &base);
    assert!(
        kept.peak_bytes[0] > zero_peaks[2],
        "gathered parameters kept: peak {} vs resharded {}",
        kept.peak_bytes[0],
        zero_peaks[2]
    );
    let cases: [(&str, u32, Strategy); 8] = [
        (
            "tp+sp+zbv",
            4,
            &[
                ("tp", &[("tp", "2"), ("sequence-parallel", "true")]),
                ("zbv", &[("microbatches", "4")]),
            ],
        ),
        (
            "zero(1)+zbv",
            4,
            &[
                ("zero", &[("stage", "1"), ("dp", "2")]),
                ("zbv", &[("microbatches", "4")]),
            ],
        ),
        (
            "zero(3)+interleaved-zb",
            4,
            &[
                ("zero", &[("stage", "3"), ("dp", "2")]),
                ("interleaved-zb", &[("microbatches", "4")]),
            ],
        ),
        (
            "zbv+recompute",
            2,
            &[
                ("zbv", &[("microbatches", "4")]),
                ("recompute", &[("policy", "full")]),
            ],
        ),
        (
            "dp+interleaved-1f1b",
            4,
            &[
                ("dp", &[("degree", "2")]),
                (
                    "interleaved-1f1b",
                    &[("virtual", "2"), ("microbatches", "4")],
                ),
            ],
        ),
        (
            "zero(2)+dualpipev",
            4,
            &[
                ("zero", &[("stage", "2"), ("dp", "2")]),
                ("dualpipev", &[("microbatches", "4")]),
            ],
        ),
        (
            "dp+zb-h1",
            4,
            &[
                ("dp", &[("degree", "2")]),
                ("zb-h1", &[("microbatches", "4")]),
            ],
        ),
        // Parameter copies and data parallelism: copy-grad pairs, then DP.
        (
            "dp+dualpipe",
            4,
            &[
                ("dp", &[("degree", "2")]),
                ("dualpipe", &[("microbatches", "4")]),
            ],
        ),
    ];
    for (name, devices, strategy) in cases {
        let run = train(&host, &ModelConfig::tiny(), devices, strategy, STEPS);
        assert_same_training(name, &run, &base);
    }
}

#[test]
fn dualpipe_holds_two_parameter_copies_and_dualpipev_one() {
    // DeepSeek-V3 report, Table 2: parameters 2× for DualPipe, 1× for
    // DualPipeV; measured from the runtime's allocation over 4 devices.
    let host = host();
    let tiny = ModelConfig::tiny();
    let one = train(&host, &tiny, 1, &[("1f1b", &[("stages", "1")])], 1);
    let dual = train(&host, &tiny, 4, &[("dualpipe", &[])], 1);
    let v = train(&host, &tiny, 4, &[("dualpipev", &[])], 1);
    let total = |r: &Run| r.state_bytes.iter().sum::<u64>();
    assert_eq!(
        total(&dual),
        2 * total(&one),
        "dualpipe: {:?}",
        dual.state_bytes
    );
    assert_eq!(total(&v), total(&one), "dualpipev: {:?}", v.state_bytes);
    // Per device: every DualPipe device holds two stages of one model copy
    // each, a DualPipeV device two stages of half the size.
    for d in 0..4 {
        assert!(
            dual.state_bytes[d] as f64 > 1.6 * v.state_bytes[d] as f64,
            "device {d}: dualpipe {} vs dualpipev {}",
            dual.state_bytes[d],
            v.state_bytes[d]
        );
    }
}

/// Each device's compute ops as `F3s1` (pass, microbatch, stage), with
/// `stage_of` mapping a PP region to its stage.
fn labels(plan: &Plan, device: usize, stage_of: &dyn Fn(u32) -> u32) -> Vec<String> {
    plan.devices[device]
        .streams
        .iter()
        .filter(|s| s.stream == "compute")
        .flat_map(|s| s.ops.iter())
        .filter(|o| o.kind().is_compute())
        .map(|o| {
            format!(
                "{}{}s{}",
                o.kind(),
                o.tags.get("MB").copied().unwrap_or(0),
                stage_of(o.tags["PP"])
            )
        })
        .collect()
}

/// Match a device's ops against a hand-written order: steps separated by
/// spaces, an overlapped pair written `F3s0+B1s3` (its ops may interleave).
fn assert_order(plan: &Plan, device: usize, stage_of: &dyn Fn(u32) -> u32, expected: &str) {
    let ops = labels(plan, device, stage_of);
    let mut i = 0;
    for step in expected.split_whitespace() {
        let set: Vec<&str> = step.split('+').collect();
        let start = i;
        while i < ops.len() && set.contains(&ops[i].as_str()) {
            i += 1;
        }
        for want in &set {
            assert!(
                ops[start..i].iter().any(|o| o == want),
                "device {device}: expected step {step} at op {start}, found {:?}\nwhole order: {}",
                ops.get(start),
                ops.join(" ")
            );
        }
    }
    assert_eq!(i, ops.len(), "device {device}: extra ops {:?}", &ops[i..]);
}

#[test]
fn interleaved_1f1b_matches_megatrons_schedule() {
    // Narayanan et al. 2021, Fig. 4: 4 devices, 2 model chunks each, 8
    // microbatches. Device r holds stages r (chunk 0) and 4 + r (chunk 1);
    // tiny's 8 regions make one region per stage.
    let plan = plan(
        4,
        &[(
            "interleaved-1f1b",
            &[("virtual", "2"), ("microbatches", "8")],
        )],
    )
    .unwrap();
    let stage = |r: u32| r;
    // Device 0: (4−0−1)·2 + (2−1)·4 = 10 warm-up forwards, chunks switch
    // every 4 microbatches.
    assert_order(
        &plan,
        0,
        &stage,
        "F0s0 F1s0 F2s0 F3s0 F0s4 F1s4 F2s4 F3s4 F4s0 F5s0 \
         F6s0 B0s4 F7s0 B1s4 F4s4 B2s4 F5s4 B3s4 F6s4 B0s0 F7s4 B1s0 \
         B2s0 B3s0 B4s4 B5s4 B6s4 B7s4 B4s0 B5s0 B6s0 B7s0",
    );
    // Device 3: 4 warm-up forwards, then strict alternation.
    assert_order(
        &plan,
        3,
        &stage,
        "F0s3 F1s3 F2s3 F3s3 \
         F0s7 B0s7 F1s7 B1s7 F2s7 B2s7 F3s7 B3s7 \
         F4s3 B0s3 F5s3 B1s3 F6s3 B2s3 F7s3 B3s3 \
         F4s7 B4s7 F5s7 B5s7 F6s7 B6s7 F7s7 B7s7 \
         B4s3 B5s3 B6s3 B7s3",
    );
}

#[test]
fn zb_h1_matches_the_zero_bubble_papers_schedule() {
    // Qi et al. 2024, Fig. 3 (ZB-H1), 4 stages, 8 microbatches: stage s
    // defers s weight passes (W = BW) to the end; stage 0 is plain 1F1B.
    let plan = plan(4, &[("zb-h1", &[("microbatches", "8")])]).unwrap();
    let stage = |r: u32| r / 2;
    assert_order(
        &plan,
        0,
        &stage,
        "F0s0 F1s0 F2s0 F3s0 B0s0 F4s0 B1s0 F5s0 B2s0 F6s0 B3s0 F7s0 B4s0 B5s0 B6s0 B7s0",
    );
    assert_order(
        &plan,
        1,
        &stage,
        "F0s1 F1s1 F2s1 BI0s1 F3s1 BI1s1 BW0s1 F4s1 BI2s1 BW1s1 F5s1 BI3s1 BW2s1 \
         F6s1 BI4s1 BW3s1 F7s1 BI5s1 BW4s1 BI6s1 BW5s1 BI7s1 BW6s1 BW7s1",
    );
    assert_order(
        &plan,
        3,
        &stage,
        "F0s3 BI0s3 F1s3 BI1s3 F2s3 BI2s3 \
         F3s3 BI3s3 BW0s3 F4s3 BI4s3 BW1s3 F5s3 BI5s3 BW2s3 F6s3 BI6s3 BW3s3 F7s3 BI7s3 BW4s3 \
         BW5s3 BW6s3 BW7s3",
    );
}

/// `zbv` and `interleaved-zb` run PyTorch's own orders
/// (`ScheduleZBVZeroBubble`, `ScheduleInterleavedZeroBubble`), read from
/// `tests/data/pytorch-schedule-orders.txt` (taken from torch 2.11.0's code
/// by `scripts/pytorch-schedule-orders.py`): every device of the compiled
/// plan, action by action, where tiny's 8 regions cut evenly into the stages
/// and its 32 rows into the microbatches.
#[test]
fn zbv_and_interleaved_zb_run_pytorchs_orders() {
    let table = include_str!("../data/pytorch-schedule-orders.txt");
    let mut checked = 0;
    for line in table.lines().filter(|l| !l.starts_with('#')) {
        let (head, want) = line.split_once(": ").unwrap();
        let mut words = head.split(' ');
        let name = words.next().unwrap();
        let num = |k: &str| -> Option<u32> {
            head.split(' ')
                .find_map(|w| w.strip_prefix(k)?.strip_prefix('='))
                .map(|v| v.parse().unwrap())
        };
        let (p, m, rank) = (num("p").unwrap(), num("m").unwrap(), num("rank").unwrap());
        let v = num("v").unwrap_or(2);
        let stages = p * v;
        if p < 2 || 8 % stages != 0 || 32 % m != 0 {
            continue;
        }
        let (ms, vs) = (m.to_string(), v.to_string());
        let plan = match name {
            "zbv" => plan(p, &[("zbv", &[("microbatches", &ms)])]),
            _ => plan(
                p,
                &[("interleaved-zb", &[("virtual", &vs), ("microbatches", &ms)])],
            ),
        }
        .unwrap();
        let per = 8 / stages;
        let stage = move |r: u32| r / per;
        let expected: Vec<String> = want
            .split(' ')
            .map(|a| {
                let at = a.find(['F', 'I', 'W']).unwrap();
                let pass = match &a[at..at + 1] {
                    "F" => "F",
                    "I" => "BI",
                    _ => "BW",
                };
                format!("{pass}{}s{}", &a[at + 1..], &a[..at])
            })
            .collect();
        assert_order(&plan, rank as usize, &stage, &expected.join(" "));
        checked += 1;
    }
    assert!(checked >= 20, "{checked} device orders checked");
}

#[test]
fn dualpipev_matches_deepseeks_reference_schedule() {
    // DeepSeek's dualpipev.py, 2 devices, 4 microbatches: device 0 holds
    // stages 0 and 3, device 1 stages 1 and 2 (two regions per stage).
    // Steps: nF0, nF0F1, nB1W1F1, nF0B1F1B0 (overlapped pairs), nB1F1B0,
    // nB1B0, nWB0, nW.
    let plan = plan(2, &[("dualpipev", &[("microbatches", "4")])]).unwrap();
    let stage = |r: u32| r / 2;
    assert_order(
        &plan,
        0,
        &stage,
        "F0s0 F1s0 \
         F2s0 F0s3 \
         BI0s3 BW0s3 F1s3 \
         F3s0+B1s3 F2s3+B0s0 \
         B2s3 F3s3+B1s0 \
         B3s3 BI2s0 \
         BW2s0 BI3s0 \
         BW3s0",
    );
    // The last device, where the V turns: its first steady pair is not
    // overlapped, and the second half of its cool-down defers weight passes.
    assert_order(
        &plan,
        1,
        &stage,
        "F0s1 F0s2 F1s1 F1s2 \
         F2s1 B0s2 F2s2+B0s1 F3s1+B1s2 F3s2+B1s1 \
         B2s2 B2s1 BI3s2 BI3s1 \
         BW3s2 BW3s1",
    );
}

#[test]
fn dualpipe_feeds_both_ends_with_deepseeks_schedule() {
    // DeepSeek's dualpipe.py, 2 devices, 4 microbatches: copy A (microbatches
    // 0–1) runs stage 0 on device 0 and stage 1 on device 1, copy B
    // (microbatches 2–3) the other way round. Each device is a "middle" rank.
    let plan = plan(2, &[("dualpipe", &[("microbatches", "4")])]).unwrap();
    let stage = |r: u32| r / 4;
    // Device 0: phase 0 is copy A's stage 0, phase 1 copy B's stage 1.
    assert_order(
        &plan,
        0,
        &stage,
        "F0s0 F2s1 \
         F1s0 B2s1 F3s1+B0s0 \
         B3s1 BI1s0 \
         BW1s0",
    );
    // Device 1: phase 0 is copy B's stage 0, phase 1 copy A's stage 1.
    assert_order(
        &plan,
        1,
        &stage,
        "F2s0 F0s1 \
         F3s0 B0s1 F1s1+B2s0 \
         B1s1 BI3s0 \
         BW3s0",
    );
    // The two copies' gradients meet in one all-reduce per segment.
    let copy: Vec<_> = plan.devices[0]
        .streams
        .iter()
        .flat_map(|s| s.ops.iter())
        .filter(|o| o.purpose() == Some(piper::compile::plan::CommPurpose::CopyGrad))
        .collect();
    assert_eq!(copy.len(), 8, "one copy-grad all-reduce per region");
    assert!(copy
        .iter()
        .all(|o| o.group().map(|g| &g[..]) == Some(&[0, 1][..])));
}

fn refused(devices: u32, strategy: Strategy) -> String {
    plan(devices, strategy).expect_err("a precondition should fail")
}

#[test]
fn every_precondition_fails_with_the_numbers() {
    let cases: [(u32, Strategy, &str); 11] = [
        (
            4,
            &[("interleaved-zb", &[("microbatches", "9")])],
            "interleaved-zb needs max(1, microbatches ÷ devices) rounds to divide the microbatches (as PyTorch's schedule): got 9 microbatches for 4 devices",
        ),
        (
            4,
            &[("zbv", &[("stages", "3")])],
            "zbv needs an even number of stages (2 per device): got 3",
        ),
        (
            4,
            &[("dualpipev", &[("microbatches", "6")])],
            "dualpipev needs microbatches ≥ 2·devices: got 6 microbatches for 4 devices",
        ),
        (
            4,
            &[("dualpipev", &[("stages", "3")])],
            "dualpipev needs an even number of stages (2 per device): got 3",
        ),
        (
            3,
            &[("dualpipe", &[])],
            "dualpipe needs an even number of stages: got 3",
        ),
        (
            4,
            &[("dualpipe", &[("microbatches", "6")])],
            "dualpipe needs an even number of microbatches ≥ 2·stages: got 6 microbatches for 4 stages",
        ),
        (
            4,
            &[("dualpipe", &[("microbatches", "9")])],
            "dualpipe needs an even number of microbatches ≥ 2·stages: got 9 microbatches for 4 stages",
        ),
        (
            4,
            &[("interleaved-1f1b", &[("microbatches", "6")])],
            "interleaved-1f1b needs microbatches to be a multiple of the pipeline devices: got 6 microbatches for 4 devices",
        ),
        (
            4,
            &[("interleaved-1f1b", &[("virtual", "4")])],
            "interleaved-1f1b needs stages ≤ PP regions: got 16 stages for 8 regions",
        ),
        (
            4,
            &[("zb-h1", &[("microbatches", "2")])],
            "zb-h1 needs microbatches ≥ stages: got 2 microbatches for 4 stages",
        ),
        (
            4,
            &[("zero", &[("stage", "4")])],
            "zero needs stage 0, 1, 2 or 3: got 4",
        ),
    ];
    for (devices, strategy, want) in cases {
        let err = refused(devices, strategy);
        assert!(err.contains(want), "expected {want:?} in: {err}");
    }
    // ZeRO-2/3 over DualPipe's parameter copies is refused at compile, not
    // left to fail mid-step (ZeRO-1 trains: host/tests/it/compose.rs).
    for stage in ["2", "3"] {
        let err = refused(
            4,
            &[
                ("zero", &[("stage", stage), ("dp", "2")]),
                ("dualpipe", &[("microbatches", "4")]),
            ],
        );
        assert!(
            err.contains(&format!("sharded with ZeRO-{stage}"))
                && err.contains("parameter copies on [[0, 2], [1, 3]]"),
            "{err}"
        );
    }
}

/// What a program sees of a loop it runs: each step's loss.
#[derive(Default)]
struct Losses(Vec<f64>);

impl piper::runtime::Observer for Losses {
    fn step(&mut self, s: &piper::runtime::StepStats, _: f64) {
        self.0.push(s.loss);
    }
}

/// The flow as library calls, without the CLI: a run config read with
/// overrides → the session's DAG with its strategies applied → the plan (the
/// one the plugins give applied by hand) → the training loop, at one
/// device's losses; each stage's refusal is its own error, naming what.
#[test]
fn a_program_runs_the_flow_from_a_run_config_to_trained_steps() {
    use piper::runtime::{train_loop, Corpus, LoopConfig, TrainOptions, Trainer};
    use piper::session::{prepare, Overrides, RunConfig, SessionError, Sources};
    let dir = std::env::temp_dir().join(format!("piper-session-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("run.toml");
    std::fs::write(
        &path,
        "model = \"tiny\"\ndevices = 4\n[[strategy]]\nname = \"1f1b\"\noptions = { microbatches = 4 }\n",
    )
    .unwrap();
    // The flag-like overrides win over the file: 2 devices.
    let overrides = Overrides {
        config: Some(path),
        devices: Some(2),
        ..Default::default()
    };
    let config = RunConfig::resolve(&overrides).unwrap();
    let prepared = prepare(&config, &Sources::offline(), 8).unwrap();
    assert_eq!(prepared.strategies(), "1f1b:microbatches=4");
    assert_eq!(prepared.applied.len(), 1);
    let plan = prepared.compile().unwrap();
    let strategy: Strategy = &[("1f1b", &[("microbatches", "4")])];
    let by_hand = plan_with(&host(), &ModelConfig::tiny(), 2, strategy).unwrap();
    assert_eq!((plan.devices.len(), &plan.hash), (2, &by_hand.hash));
    let cfg = config.model_config().unwrap();
    // The learning rate `common::train` runs one device at.
    let opts = TrainOptions {
        adamw: piper::runtime::AdamW {
            lr: 3e-3,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut trainer = Trainer::new(&cfg, plan, opts).unwrap();
    let run = LoopConfig {
        steps: 3,
        ..LoopConfig::default()
    };
    let mut seen = Losses::default();
    let sum = train_loop(
        &mut trainer,
        &cfg,
        &Corpus::builtin(),
        None,
        &run,
        &mut seen,
    )
    .unwrap();
    let base = one_device(&host(), &cfg, 3);
    assert_eq!(sum.ran, 3);
    for (a, b) in seen.0.iter().zip(&base.losses) {
        assert!((a - b).abs() < 1e-5, "{:?} vs {:?}", seen.0, base.losses);
    }
    // Refusals, by stage.
    let with = |o: Overrides| prepare(&RunConfig::resolve(&o).unwrap(), &Sources::offline(), 2);
    let e = with(Overrides {
        devices: Some(0),
        ..Default::default()
    });
    assert!(matches!(e, Err(SessionError::NoDevices)));
    let e = with(Overrides {
        strategies: vec!["no-such-strategy".into()],
        ..Default::default()
    });
    let msg = format!("{}", e.as_ref().err().unwrap());
    assert!(matches!(e, Err(SessionError::Plugin(_))), "{msg}");
    assert!(msg.contains("no-such-strategy"), "{msg}");
    let three = with(Overrides {
        devices: Some(3),
        strategies: vec!["dp".into()],
        ..Default::default()
    })
    .unwrap();
    let e = three.compile().unwrap_err();
    let chain = format!("{e}: {}", std::error::Error::source(&e).unwrap());
    assert!(matches!(e, SessionError::Compile { .. }), "{chain}");
    assert!(
        chain.contains("compiling the plan of `dp`") && chain.contains("not divisible"),
        "{chain}"
    );
    let e = RunConfig::resolve(&Overrides {
        config: Some(dir.join("missing.toml")),
        ..Default::default()
    })
    .unwrap_err();
    assert!(e.to_string().contains("missing.toml"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
