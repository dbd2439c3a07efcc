//! Native (plain Rust) strategies used by tests and benchmarks: the same
//! directive programs the bundled plugins run, called directly on the DAG;
//! and the `piper` binary run as a user runs it.
#![allow(dead_code)]

use piper::compile::compile;
use piper::dag::{Cluster, DagError, Filter, Label, ReplicateOptions, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::PluginHost;
use piper::runtime::{Corpus, TrainOptions, Trainer};

/// Regions per stage when `regions` PP regions are spread over `stages` stages.
pub fn stage_regions(regions: u32, stages: u32, stage: u32) -> Vec<u32> {
    let per = regions / stages;
    (stage * per..(stage + 1) * per).collect()
}

/// One group of an `order`: pass `pass` of microbatch `mb` over the stage's regions.
pub fn group(regions: &[u32], mb: u32, pass: Label) -> Vec<Filter> {
    regions
        .iter()
        .map(|r| Filter::tag("PP", *r).and("MB", mb).pass(pass))
        .collect()
}

/// The 1F1B order of one stage: warm-up forwards, one-forward-one-backward,
/// cool-down backwards.
pub fn one_f_one_b_order(stages: u32, stage: u32, mbs: u32, regions: &[u32]) -> Vec<Vec<Filter>> {
    let warmup = (stages - stage - 1).min(mbs);
    let mut groups = Vec::new();
    for i in 0..warmup {
        groups.push(group(regions, i, Label::F));
    }
    for i in 0..mbs - warmup {
        groups.push(group(regions, warmup + i, Label::F));
        groups.push(group(regions, i, Label::B));
    }
    for i in mbs - warmup..mbs {
        groups.push(group(regions, i, Label::B));
    }
    groups
}

/// Split into microbatches and place stage `s` on the `s`-th device group.
/// `groups[s]` is the device group of stage `s`.
pub fn pipeline_place(
    dag: &mut TrainingDag,
    groups: &[Vec<u32>],
    mbs: u32,
) -> Result<(), DagError> {
    let regions = dag.tag_extents()["PP"];
    let stages = groups.len() as u32;
    dag.split(&Filter::all(), "MB", mbs)?;
    for s in 0..stages {
        for r in stage_regions(regions, stages, s) {
            dag.place(&Filter::tag("PP", r), &groups[s as usize], "pp")?;
        }
    }
    Ok(())
}

/// 1F1B over `stages` single devices (or DP groups when `dp > 1`:
/// stage `s` on devices `s, s + stages, …`), `mbs` microbatches.
pub fn one_f_one_b(
    dag: &mut TrainingDag,
    stages: u32,
    mbs: u32,
    dp: u32,
    zero: Option<u8>,
) -> Result<(), DagError> {
    let groups = stage_groups(stages, dp);
    replicate_stages(dag, &groups, zero)?;
    pipeline_place(dag, &groups, mbs)?;
    one_f_one_b_orders(dag, stages, mbs)
}

/// Device groups of `stages` stages with `dp` replicas each: stage `s` on
/// devices `s, s + stages, …`.
pub fn stage_groups(stages: u32, dp: u32) -> Vec<Vec<u32>> {
    (0..stages)
        .map(|s| (0..dp).map(|r| s + r * stages).collect())
        .collect()
}

/// Replicate each stage's regions over its group with ZeRO stage `zero`.
pub fn replicate_stages(
    dag: &mut TrainingDag,
    groups: &[Vec<u32>],
    zero: Option<u8>,
) -> Result<(), DagError> {
    let stages = groups.len() as u32;
    if let Some(z) = zero {
        for s in 0..stages {
            // replicate before the split: the DP directive of a `dp`/`zero` plugin.
            let regions = dag.tag_extents()["PP"];
            for r in stage_regions(regions, stages, s) {
                dag.replicate(
                    &Filter::tag("PP", r),
                    &groups[s as usize],
                    &ReplicateOptions::zero(z),
                )?;
            }
        }
    }
    Ok(())
}

/// The `order` directives of 1F1B, one per stage.
pub fn one_f_one_b_orders(dag: &mut TrainingDag, stages: u32, mbs: u32) -> Result<(), DagError> {
    let regions = dag.tag_extents()["PP"];
    for s in 0..stages {
        let order = one_f_one_b_order(stages, s, mbs, &stage_regions(regions, stages, s));
        dag.order(&order)?;
    }
    Ok(())
}

/// Collapse a device's compute labels into `F3`/`B0` steps: consecutive ops of
/// one pass and microbatch over several regions read as one.
pub fn steps(plan: &piper::compile::Plan, device: u32) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut last = None;
    for s in plan.devices[device as usize]
        .streams
        .iter()
        .filter(|s| s.stream == "compute")
    {
        for op in &s.ops {
            if !op.kind().is_compute() {
                continue;
            }
            let key = (
                op.kind().to_string(),
                op.tags.get("MB").copied().unwrap_or(0),
            );
            if last.as_ref() != Some(&key) {
                out.push(format!("{}{}", key.0, key.1));
                last = Some(key);
            }
        }
    }
    out
}

/// 8 single-layer PP regions (pipelines of 2, 4, 8 stages fit), small enough
/// for debug-build tests.
pub fn small() -> ModelConfig {
    ModelConfig {
        name: "small".into(),
        layers: 8,
        d_model: 32,
        heads: 2,
        seq_len: 16,
        vocab: 256,
        batch_size: 32,
        layers_per_region: 1,
        regions: None,
        moe: None,
        ..Default::default()
    }
}

/// The small model in the Llama family: RMSNorm, rotary positions, SwiGLU,
/// 4 query heads over 2 key/value heads, Qwen3's q/k norms, an untied head.
pub fn small_llama() -> ModelConfig {
    ModelConfig {
        name: "small-llama".into(),
        heads: 4,
        family: piper::model::Family::Llama,
        kv_heads: Some(2),
        intermediate: Some(88),
        qk_norm: true,
        norm_eps: Some(1e-6),
        ..small()
    }
}

/// `small` with a MoE MLP in every layer: 4 experts, top-2, dropless (no
/// capacity), so every strategy routes every token the same way.
pub fn small_moe() -> ModelConfig {
    let mut moe = piper::model::MoeConfig::new(4, 2);
    moe.hidden = Some(48);
    moe.aux_loss_coef = 0.05;
    ModelConfig {
        name: "small-moe".into(),
        layers: 4,
        moe: Some(moe),
        ..small()
    }
}

pub type Strategy<'a> = &'a [(&'a str, &'a [(&'a str, &'a str)])];

/// Apply a list of bundled strategies, with their options, to `cfg` on
/// `devices` devices and compile; the first error as text.
pub fn plan_with(
    host: &PluginHost,
    cfg: &ModelConfig,
    devices: u32,
    strategy: Strategy,
) -> Result<piper::compile::Plan, String> {
    let mut dag = TrainingDag::build(cfg, Cluster::new(devices)).unwrap();
    for (name, opts) in strategy {
        let o: Vec<(String, String)> = opts
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let p = host.load(name).map_err(|e| format!("{e:#}"))?;
        host.apply(&p, &mut dag, &o).map_err(|e| format!("{e:#}"))?;
    }
    compile(&dag).map_err(|e| e.to_string())
}

/// What a training run left behind.
#[derive(Clone)]
pub struct Run {
    pub losses: Vec<f64>,
    pub params: piper::runtime::NamedTensors,
    /// Measured peak bytes per device (runtime accounting), over the run.
    pub peak_bytes: Vec<u64>,
    /// Model-state bytes per device as the runtime allocated them.
    pub state_bytes: Vec<u64>,
    /// Bytes each device sent in the last step.
    pub sent_bytes: Vec<u64>,
}

/// Train `steps` steps under a strategy.
pub fn train(
    host: &PluginHost,
    cfg: &ModelConfig,
    devices: u32,
    strategy: Strategy,
    steps: u32,
) -> Run {
    let plan = plan_with(host, cfg, devices, strategy).unwrap();
    let opts = TrainOptions {
        adamw: piper::runtime::AdamW {
            lr: 3e-3,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut trainer = Trainer::new(cfg, plan, opts).unwrap();
    let corpus = Corpus::builtin();
    let mut losses = Vec::new();
    let mut peak_bytes = vec![0; devices as usize];
    let (mut state_bytes, mut sent_bytes) = (Vec::new(), Vec::new());
    for s in 1..=steps {
        let batch = corpus
            .batch(s, cfg.batch_size as usize, cfg.seq_len as usize, 256)
            .unwrap();
        let st = trainer.step(&batch).unwrap();
        losses.push(st.loss);
        for (p, x) in peak_bytes.iter_mut().zip(&st.peak_bytes) {
            *p = (*p).max(*x);
        }
        state_bytes = st.state_bytes;
        sent_bytes = st.comm_bytes;
    }
    Run {
        losses,
        params: trainer.params().unwrap(),
        peak_bytes,
        state_bytes,
        sent_bytes,
    }
}

/// The baseline every strategy is held to: the whole model on one device,
/// one microbatch.
pub fn one_device(host: &PluginHost, cfg: &ModelConfig, steps: u32) -> Run {
    train(
        host,
        cfg,
        1,
        &[("1f1b", &[("stages", "1"), ("microbatches", "1")])],
        steps,
    )
}

/// Losses within 1e-5 relative of the baseline's at every step; final
/// weights within 1e-2 of each tensor's scale (Adam normalises updates, so
/// float-order differences in near-zero gradients — attention biases — move
/// a weight by up to the learning rate per step; a wrong gradient moves
/// whole tensors and the losses).
pub fn assert_same_training(name: &str, run: &Run, base: &Run) {
    for (s, (a, b)) in run.losses.iter().zip(&base.losses).enumerate() {
        let rel = (a - b).abs() / b.abs();
        assert!(
            rel < 1e-5,
            "{name}: step {} loss {a} vs one device {b} (relative {rel:.2e})",
            s + 1
        );
    }
    for (k, v) in &base.params {
        let o = &run.params[k];
        let scale = v.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-3);
        let diff = v.iter().zip(o).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff / scale < 1e-2,
            "{name}: {k} differs by {diff} (scale {scale})"
        );
    }
}

/// Run the `piper` binary with `PIPER_HOME` at `home`: (success, stdout, stderr).
pub fn piper(home: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_piper"))
        .args(args)
        .env("PIPER_HOME", home)
        .output()
        .expect("run piper");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
