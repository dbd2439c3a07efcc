//! `cargo bench -p piper --bench train`: training throughput on one CPU
//! device — tokens/s and achieved GFLOP/s for `tiny`, a mid-size GPT-2 (6
//! layers, d_model 384), `llama-tiny` and a mid-size Llama (8 layers, d_model
//! 512, 8 heads over 2 kv heads, SwiGLU 1536) on 1 thread and on every core,
//! and the mid GPT again in bf16 (its ratio to fp32 printed), alternating —
//! beside the GEMM throughput of this machine on the same
//! thread counts, its theoretical fp32 peak, and PyTorch eager on the same
//! models and steps (`benches/reference/torch_gpt.py`), measured side by
//! side in one run.

use piper::compile::compile;
use piper::dag::{Cluster, Filter, TrainingDag};
use piper::model::ModelConfig;
use piper::runtime::backend::cpu::matmul::matmul_forward;
use piper::runtime::{Corpus, TrainOptions, Trainer};
use std::time::Instant;

/// The `piper` binary's allocator, so the figures are the binary's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

fn gemm_gflops(n: usize, c: usize, oc: usize, threads: usize) -> f64 {
    pool(threads).install(|| gemm_gflops_here(n, c, oc))
}

fn gemm_gflops_here(n: usize, c: usize, oc: usize) -> f64 {
    let inp: Vec<f32> = (0..n * c).map(|i| (i % 17) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..oc * c).map(|i| (i % 13) as f32 * 0.01).collect();
    let mut out = vec![0.0; n * oc];
    matmul_forward(&mut out, &inp, &w, None, n, c, oc);
    // Best of 7: the machine is shared and noisy.
    let mut best = f64::MAX;
    for _ in 0..7 {
        let t = Instant::now();
        matmul_forward(&mut out, &inp, &w, None, n, c, oc);
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n * c * oc) as f64 / best / 1e9
}

/// Clock (MHz, from /proc/cpuinfo) × fp32 FLOPs per cycle per core (2 FMA units).
fn peak_gflops() -> (f64, String) {
    let mhz = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
        .unwrap_or(2000.0);
    #[cfg(target_arch = "x86_64")]
    let (lanes, isa) = if std::arch::is_x86_feature_detected!("avx512f") {
        (16.0, "AVX-512")
    } else if std::arch::is_x86_feature_detected!("fma") {
        (8.0, "AVX2+FMA")
    } else {
        (4.0, "SSE")
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (lanes, isa) = (4.0, "NEON");
    let per_cycle = lanes * 2.0 * 2.0; // 2 FMA units × (mul + add)
    (
        mhz * per_cycle / 1e3,
        format!("{mhz:.0} MHz × {per_cycle} FLOP/cycle ({isa})"),
    )
}

fn train_rate(cfg: &ModelConfig, steps: u32, threads: usize) -> (f64, f64) {
    let mut dag = TrainingDag::build(cfg, Cluster::new(1)).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    let plan = compile(&dag).unwrap();
    let opts = TrainOptions {
        threads: Some(threads),
        ..TrainOptions::default()
    };
    let mut t = Trainer::new(cfg, plan, opts).unwrap();
    let corpus = Corpus::builtin();
    let (b, s) = (cfg.batch_size as usize, cfg.seq_len as usize);
    t.step(&corpus.batch(1, b, s, 256).unwrap()).unwrap(); // warm-up
                                                           // Best step of the run (the machine is shared and noisy).
    let mut secs = f64::MAX;
    for i in 0..steps {
        let start = Instant::now();
        t.step(&corpus.batch(i + 2, b, s, 256).unwrap()).unwrap();
        secs = secs.min(start.elapsed().as_secs_f64());
    }
    // FLOPs of a step from the model's cost hints: forward + backward (2×).
    let flops: f64 = cfg
        .segments()
        .iter()
        .map(|s| s.cost.fwd_flops + s.cost.bwd_flops)
        .sum();
    ((b * s) as f64 / secs, flops / secs / 1e9)
}

/// PyTorch eager on the same model and step (`benches/reference/torch_gpt.py`),
/// through `$PIPER_TORCH_PYTHON` (default `python3`): tokens/s and the torch
/// version, or why it did not run.
fn torch_rate(cfg: &ModelConfig, steps: u32, threads: usize) -> Result<(f64, String), String> {
    let python = std::env::var("PIPER_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../benches/reference/torch_gpt.py"
    );
    let a = cfg.arch();
    let llama = if a.family == piper::model::Family::Llama {
        let mut v = vec![
            "--family".to_string(),
            "llama".into(),
            "--kv-heads".into(),
            a.kv_heads.to_string(),
            "--intermediate".into(),
            a.hidden.to_string(),
        ];
        if a.qk_norm {
            v.push("--qk-norm".into());
        }
        v
    } else {
        Vec::new()
    };
    let out = std::process::Command::new(&python)
        .arg(script)
        .args(llama)
        .args([
            "--layers",
            &cfg.layers.to_string(),
            "--d-model",
            &cfg.d_model.to_string(),
            "--heads",
            &cfg.heads.to_string(),
            "--seq",
            &cfg.seq_len.to_string(),
            "--batch",
            &cfg.batch_size.to_string(),
            "--vocab",
            &cfg.vocab.to_string(),
            "--steps",
            &steps.to_string(),
            "--threads",
            &threads.to_string(),
        ])
        .output()
        .map_err(|e| format!("{python}: {e}"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().last().unwrap_or("failed").to_string());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    match (v["tokens_per_s"].as_f64(), v["threads"].as_u64()) {
        (Some(tps), Some(t)) if t as usize == threads => {
            Ok((tps, v["torch"].as_str().unwrap_or("?").to_string()))
        }
        _ => Err(format!("unexpected output: {v}")),
    }
}

fn main() {
    let (peak, how) = peak_gflops();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let counts: Vec<usize> = if cores > 1 { vec![1, cores] } else { vec![1] };
    println!(
        "fp32 peak per core at the clock /proc/cpuinfo reports ≈ {peak:.1} GFLOP/s ({how}); {cores} core(s); cores that turbo above that clock can exceed it"
    );
    let mid = ModelConfig {
        name: "mid".into(),
        layers: 6,
        d_model: 384,
        heads: 6,
        seq_len: 256,
        vocab: 256,
        batch_size: 8,
        layers_per_region: 1,
        regions: None,
        moe: None,
        ..Default::default()
    };
    let mid_llama = ModelConfig {
        name: "mid-llama".into(),
        layers: 8,
        d_model: 512,
        heads: 8,
        seq_len: 256,
        vocab: 256,
        batch_size: 8,
        family: piper::model::Family::Llama,
        kv_heads: Some(2),
        intermediate: Some(1536),
        norm_eps: Some(1e-6),
        ..Default::default()
    };
    // The mid GPT in bf16 mixed precision (bf16 storage, fp32 arithmetic).
    let mid_bf16 = ModelConfig {
        name: "mid-bf16".into(),
        precision: piper::model::Precision::BF16,
        ..mid.clone()
    };
    // Alternating rounds, best of each (the machine is shared and noisy).
    let mut gemm = vec![0.0f64; counts.len()];
    let models = [
        (ModelConfig::tiny(), 5u32),
        (mid, 3),
        (ModelConfig::llama_tiny(), 5),
        (mid_llama, 3),
        (mid_bf16, 3),
    ];
    // PyTorch runs the models it is compared on: the mid GPT and both Llamas.
    let compared = [1usize, 2, 3];
    let mut best = vec![vec![(0.0f64, 0.0f64); counts.len()]; models.len()];
    let mut torch: Vec<Vec<Result<(f64, String), String>>> =
        vec![vec![Ok((0.0, String::new())); counts.len()]; models.len()];
    for _round in 0..2 {
        for (k, &th) in counts.iter().enumerate() {
            gemm[k] = gemm[k].max(gemm_gflops(2048, 384, 1536, th));
            for (m, (cfg, steps)) in models.iter().enumerate() {
                let r = train_rate(cfg, *steps, th);
                if r.0 > best[m][k].0 {
                    best[m][k] = r;
                }
                // The reference right after Piper on the same thread count.
                if !compared.contains(&m) {
                    continue;
                }
                if let Ok((prev, _)) = &torch[m][k] {
                    let prev = *prev;
                    torch[m][k] = match torch_rate(cfg, *steps, th) {
                        Ok((tps, v)) => Ok((tps.max(prev), v)),
                        Err(e) => Err(e),
                    };
                }
            }
        }
    }
    for (k, &th) in counts.iter().enumerate() {
        println!(
            "GEMM 2048×384·384×1536, {th} thread(s): {:.1} GFLOP/s = {:.0}% of {th} core(s)' peak at that clock",
            gemm[k],
            100.0 * gemm[k] / (peak * th as f64)
        );
    }
    for (m, (cfg, _)) in models.iter().enumerate() {
        for (k, &th) in counts.iter().enumerate() {
            let (tps, gflops) = best[m][k];
            println!(
                "train {} ({} params, batch {}×{}), one device × {th} thread(s): {tps:.0} tokens/s, {gflops:.1} GFLOP/s = {:.0}% of GEMM on {th} thread(s){}",
                cfg.name,
                cfg.param_count(),
                cfg.batch_size,
                cfg.seq_len,
                100.0 * gflops / gemm[k],
                if k > 0 {
                    format!(", {:.2}× one thread", tps / best[m][0].0)
                } else {
                    String::new()
                }
            );
        }
    }
    for (k, &th) in counts.iter().enumerate() {
        println!(
            "mid in bf16 against fp32, {th} thread(s): {:.2}×",
            best[4][k].0 / best[1][k].0
        );
    }
    for &m in &compared {
        for (k, &th) in counts.iter().enumerate() {
            match &torch[m][k] {
                Ok((tps, version)) => println!(
                    "{} vs PyTorch {version} eager, {th} thread(s): Piper {:.0} tokens/s, PyTorch {tps:.0} tokens/s, ratio {:.2}× (goal with every core: ≥ 1.0×)",
                    models[m].0.name,
                    best[m][k].0,
                    best[m][k].0 / tps
                ),
                Err(why) => println!(
                    "PyTorch reference not run ({why}): install torch for python3, or set PIPER_TORCH_PYTHON to a Python that has it (scripts/hf-python.sh installs one into target/hf-venv)"
                ),
            }
        }
    }
}
