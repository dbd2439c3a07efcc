//! `cargo bench -p piper --bench search`: `piper plan --search` on 64
//! simulated H100s (`h100-cluster:8`) for a Llama-3-8B-shaped and a
//! Qwen3-30B-A3B-shaped model (GPT-2-family stand-ins with those sizes until
//! the Llama family lands): candidates considered, candidates/s, the time to
//! the answer (goal: ≥ 500 candidates, under 120 s on 2 cores), and the best
//! found against a hand baseline simulated on the same cluster — Megatron's
//! usual recipe, TP 8 inside a node and 1F1B across nodes with 4 × PP
//! microbatches (for the MoE model, its experts spread over 8 inside a
//! node by `ep`, 1F1B across nodes) — goal ≥ 1.2× its
//! tokens/s, both fitting in 80 GB. Then for Llama-3-8B- and 70B-shaped
//! models (the Llama family, 2 048-token sequences; 8B on 64 H100s, 70B on
//! 256) the best candidate
//! beside the best of the compositions that existed before data
//! parallelism composed with tensor parallelism (no `dp`/`zero` with `tp`),
//! with the ratio of their tokens/s. Every model in bf16 (bf16 parameters,
//! activations and messages, fp32 reductions), as GPU runs train.

use piper::compile::compile;
use piper::dag::{Cluster as DagCluster, TrainingDag};
use piper::model::{ModelConfig, MoeConfig, Precision};
use piper::plugin::{PluginHost, SandboxLimits};
use piper::search::space::{self, Candidate, Step};
use piper::search::{self, Outcome, Query};
use piper::sim::{self, Cluster};

/// The `piper` binary's allocator, so the figures are the binary's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Llama 3 8B's sizes in the GPT-2 family: 32 layers, d 4096, 32 heads,
/// 128 256-token vocabulary; 2 048-token sequences (the family keeps every
/// head's attention probabilities, ~4× Llama's activations at 8 192) and a
/// quarter-million-token batch (so the hand baseline's 4 × PP microbatches
/// of 4 rows fit in 80 GB).
fn llama3_8b_like() -> ModelConfig {
    ModelConfig {
        name: "llama3-8b-shape".into(),
        layers: 32,
        d_model: 4096,
        heads: 32,
        seq_len: 2048,
        vocab: 128_256,
        batch_size: 128,
        layers_per_region: 1,
        regions: None,
        moe: None,
        precision: Precision::BF16,
        ..Default::default()
    }
}

/// Qwen3-30B-A3B's sizes: 48 layers, d 2048, 32 heads, 128 experts of
/// width 768 of which each token uses 8, 151 936-token vocabulary; 2 048-token
/// sequences.
fn qwen3_30b_a3b_like() -> ModelConfig {
    let mut moe = MoeConfig::new(128, 8);
    moe.hidden = Some(768);
    ModelConfig {
        name: "qwen3-30b-a3b-shape".into(),
        layers: 48,
        d_model: 2048,
        heads: 32,
        seq_len: 2048,
        vocab: 151_936,
        batch_size: 256,
        layers_per_region: 1,
        regions: None,
        moe: Some(moe),
        precision: Precision::BF16,
        ..Default::default()
    }
}

/// A Llama-family model of the example TOML's shape at 2 048-token
/// sequences (attention still keeps each head's probabilities).
fn llama(file: &str) -> ModelConfig {
    let path = format!("{}/../examples/models/{file}", env!("CARGO_MANIFEST_DIR"));
    ModelConfig {
        seq_len: 2048,
        precision: Precision::BF16,
        ..ModelConfig::from_name_or_file(&path).unwrap()
    }
}

/// Does a candidate compose data and tensor parallelism (new with the
/// device mesh)?
fn composes_dp_and_tp(c: &Candidate) -> bool {
    let has = |names: &[&str]| c.steps.iter().any(|s| names.contains(&s.plugin.as_str()));
    has(&["dp", "zero"]) && has(&["tp"])
}

/// The best candidate on `devices` H100s against the best one without
/// dp/zero × tp.
fn mesh_against_before(host: &PluginHost, devices: u32, model: &ModelConfig) {
    let cluster = Cluster::h100_cluster(devices / 8);
    let cluster = &cluster;
    let cap = cluster.memory_bytes as u64;
    let candidates: Vec<Candidate> = space::enumerate(model, devices, 8, None);
    let plugins = search::load_all(&candidates, |n| host.load(n).map_err(|e| e.to_string()));
    let r = search::search(
        host,
        Query {
            model,
            cluster,
            devices,
            cap,
            candidates,
            plugins,
            budget: None,
            keep: 0,
        },
    );
    let n = r.candidates.len();
    let secs = r.elapsed.as_secs_f64();
    let ranked = r.ranked();
    let best = ranked.first();
    let before = ranked
        .iter()
        .find(|(i, _)| !composes_dp_and_tp(&r.candidates[*i]));
    let show = |x: Option<&(usize, &search::Scored)>| match x {
        Some((i, s)) => format!(
            "{} at {:.0} tokens/s (MFU {:.1}%, peak {:.1} GB)",
            r.candidates[*i].label(),
            s.tokens_per_s,
            s.mfu * 100.0,
            s.peak() as f64 / 1e9
        ),
        None => "nothing fits".into(),
    };
    println!(
        "{} on {devices} devices: {n} candidates in {secs:.1} s = {:.1} candidates/s",
        model.name,
        n as f64 / secs
    );
    println!("  best: {}", show(best));
    println!("  best without dp/zero × tp: {}", show(before));
    if let (Some((_, b)), Some((_, o))) = (best, before) {
        println!("  ratio {:.2}×", b.tokens_per_s / o.tokens_per_s);
    }
}

fn step(plugin: &str, options: &[(&str, &str)]) -> Step {
    Step {
        plugin: plugin.into(),
        options: options
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// Tokens/s of a hand-written candidate on the cluster, and its peak.
fn baseline(
    host: &PluginHost,
    model: &ModelConfig,
    cluster: &Cluster,
    steps: &[Step],
) -> (f64, u64) {
    let mut dag = TrainingDag::build(model, DagCluster::new(64)).unwrap();
    for s in steps {
        let p = host.load(&s.plugin).unwrap();
        host.apply(&p, &mut dag, &s.options).unwrap();
    }
    let plan = compile(&dag).unwrap();
    let peak = plan.devices.iter().map(|d| d.peak_bytes).max().unwrap();
    let s = sim::simulate(&plan, cluster).unwrap();
    (
        f64::from(model.batch_size) * f64::from(model.seq_len) / s.step_time,
        peak,
    )
}

fn main() {
    let cluster = Cluster::h100_cluster(8);
    let cap = cluster.memory_bytes as u64;
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    println!(
        "strategy search on {} (64 devices, {:.0} GB each), 2-core machine",
        cluster.name,
        cluster.memory_bytes / 1e9
    );
    for (model, hand) in [
        (
            llama3_8b_like(),
            vec![
                step("tp", &[("tp", "8")]),
                step("1f1b", &[("microbatches", "32")]),
            ],
        ),
        (
            qwen3_30b_a3b_like(),
            vec![
                step("dp", &[("degree", "8")]),
                step("ep", &[]),
                step("1f1b", &[("microbatches", "32")]),
            ],
        ),
    ] {
        let candidates: Vec<Candidate> = space::enumerate(&model, 64, 8, None);
        let plugins = search::load_all(&candidates, |n| host.load(n).map_err(|e| e.to_string()));
        let r = search::search(
            &host,
            Query {
                model: &model,
                cluster: &cluster,
                devices: 64,
                cap,
                candidates,
                plugins,
                budget: None,
                keep: 0,
            },
        );
        let n = r.candidates.len();
        let secs = r.elapsed.as_secs_f64();
        let simulated = r.count(|o| matches!(o, Outcome::Simulated(_)));
        let cut = r.count(|o| matches!(o, Outcome::CutByEstimate { .. } | Outcome::OverCap { .. }));
        let failed = r.count(|o| matches!(o, Outcome::Failed { .. }));
        println!(
            "{}: {n} candidates in {secs:.1} s = {:.1} candidates/s (goal ≥ 500 in < 120 s: {}); {cut} out of memory, {failed} failed, {simulated} simulated",
            model.name,
            n as f64 / secs,
            if n >= 500 && secs < 120.0 { "met" } else { "NOT met" }
        );
        let ranked = r.ranked();
        let Some((best_ix, best)) = ranked.first() else {
            println!("  nothing fits");
            continue;
        };
        let (hand_tps, hand_peak) = baseline(&host, &model, &cluster, &hand);
        let hand_label = Candidate {
            steps: hand.clone(),
            shape: None,
        }
        .label();
        let ratio = best.tokens_per_s / hand_tps;
        println!(
            "  best {}: {:.0} tokens/s, MFU {:.1}%, peak {:.1} GB; hand baseline {hand_label}: {hand_tps:.0} tokens/s, peak {:.1} GB{}; ratio {ratio:.2}× (goal ≥ 1.2×: {})",
            r.candidates[*best_ix].label(),
            best.tokens_per_s,
            best.mfu * 100.0,
            best.peak() as f64 / 1e9,
            hand_peak as f64 / 1e9,
            if hand_peak > cap { " (does not fit)" } else { "" },
            if ratio >= 1.2 && hand_peak <= cap { "met" } else { "NOT met" }
        );
    }
    // Llama 3 8B on 64 H100s, 70B on 256 (torchtitan's count).
    for (file, devices) in [("llama3-8b.toml", 64), ("llama3-70b.toml", 256)] {
        mesh_against_before(&host, devices, &llama(file));
    }
}
