//! `cargo bench -p piper --bench published`: the simulator against
//! published GPU training runs (`benches/published/runs.toml`). Each row's
//! layout is planned with the bundled strategies on the row's model shape,
//! sequence, global batch and precision policy, simulated on the row's
//! cluster preset, and printed beside what the run published: tokens/s per
//! GPU (or model TFLOP/s per GPU) and peak memory per GPU, with the ratio
//! predicted ÷ published.

use piper::model::{ModelConfig, Precision};
use piper::plugin::{PluginHost, SandboxLimits};
use piper::search::space::{Candidate, Step};
use piper::search::{self, Outcome, Query};
use piper::session::StrategySpec;
use piper::sim::Cluster;
use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Deserialize)]
struct Runs {
    run: Vec<Run>,
}

#[derive(Deserialize)]
struct Run {
    name: String,
    source: String,
    model: Option<String>,
    shape: Option<BTreeMap<String, toml::Value>>,
    seq_len: u32,
    global_batch: u32,
    strategies: Vec<String>,
    cluster: String,
    devices: u32,
    precision: String,
    /// `eager`: the run's framework launches each elementwise op on its
    /// own (PyTorch without `torch.compile`); default `fused`.
    kernels: Option<String>,
    tokens_per_s_per_gpu: Option<f64>,
    tflops_per_gpu: Option<f64>,
    memory_gib: Option<f64>,
}

/// The row's model at its sequence and global batch.
fn model(root: &str, r: &Run) -> ModelConfig {
    let base = match (&r.model, &r.shape) {
        (Some(file), None) => ModelConfig::from_name_or_file(&format!("{root}/{file}")).unwrap(),
        (None, Some(shape)) => {
            let text = toml::to_string(shape).unwrap();
            let text = format!(
                "{text}seq_len = {}\nbatch_size = {}\n",
                r.seq_len, r.global_batch
            );
            ModelConfig::from_toml_str(&text, &r.name).unwrap()
        }
        _ => panic!("{}: give `model` or `shape`", r.name),
    };
    let m = ModelConfig {
        seq_len: r.seq_len,
        batch_size: r.global_batch,
        precision: Precision::named(&r.precision).unwrap(),
        ..base
    };
    m.validate().unwrap();
    m
}

/// `zero:stage=3,dp=8` as a candidate step (the command line's parser).
fn step(text: &str) -> Step {
    let spec = StrategySpec::parse(text).unwrap();
    Step {
        plugin: spec.name,
        options: spec.options,
    }
}

fn main() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let text = std::fs::read_to_string(format!("{root}/benches/published/runs.toml")).unwrap();
    let runs: Runs = toml::from_str(&text).unwrap();
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    println!(
        "{:<44} {:>6} {:>12} {:>12} {:>7} {:>10} {:>10} {:>7}",
        "run", "prec.", "published", "predicted", "ratio", "mem pub.", "mem pred.", "ratio"
    );
    for r in &runs.run {
        let m = model(root, r);
        // A cluster file is named from the repository's root.
        let spec = match r.cluster.ends_with(".toml") {
            true => format!("{root}/{}", r.cluster),
            false => r.cluster.clone(),
        };
        let cluster = Cluster {
            eager: match r.kernels.as_deref() {
                None | Some("fused") => false,
                Some("eager") => true,
                Some(k) => panic!("{}: kernels = {k:?} is `fused` or `eager`", r.name),
            },
            ..Cluster::resolve(&spec, r.devices).unwrap()
        };
        let candidate = Candidate {
            steps: r.strategies.iter().map(|s| step(s)).collect(),
            shape: None,
        };
        let plugins = search::load_all(std::slice::from_ref(&candidate), |name| {
            host.load(name).map_err(|e| format!("{e:#}"))
        });
        let result = search::search(
            &host,
            Query {
                model: &m,
                cluster: &cluster,
                devices: r.devices,
                // Every row is simulated, fitting or not: the memory column says.
                cap: u64::MAX,
                candidates: vec![candidate],
                plugins,
                budget: None,
                keep: 0,
            },
        );
        let s = match &result.outcomes[0] {
            Outcome::Simulated(s) => s,
            other => panic!("{}: {other:?}", r.name),
        };
        let gpus = f64::from(r.devices);
        let (unit, published, predicted) = match (r.tokens_per_s_per_gpu, r.tflops_per_gpu) {
            (Some(t), _) => ("tok/s", t, s.tokens_per_s / gpus),
            (None, Some(f)) => ("TFLOP/s", f, s.mfu * cluster.peak_flops / 1e12),
            (None, None) => panic!("{}: give tokens_per_s_per_gpu or tflops_per_gpu", r.name),
        };
        let gib = s.peak() as f64 / (1u64 << 30) as f64;
        let (mem_pub, mem_ratio) = match r.memory_gib {
            Some(g) => (format!("{g:.1} GiB"), format!("{:.2}", gib / g)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:<44} {:>6} {:>12} {:>12} {:>7.2} {:>10} {:>10} {:>7}",
            r.name,
            r.precision,
            format!("{published:.1} {unit}"),
            format!("{predicted:.1}"),
            predicted / published,
            mem_pub,
            format!("{gib:.1} GiB"),
            mem_ratio
        );
        let kernels = r.kernels.as_deref().unwrap_or("fused");
        println!(
            "  {} · {} · {kernels} kernels",
            r.source,
            r.strategies.join(" ")
        );
    }
}
