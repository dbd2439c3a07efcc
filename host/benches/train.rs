//! `cargo bench -p piper --bench train`: training throughput on one CPU
//! device — tokens/s and achieved GFLOP/s for `tiny` and a mid-size model
//! (6 layers, d_model 384) — beside the single-thread GEMM throughput of this
//! machine and its theoretical fp32 peak, measured side by side in one run.

use piper::compile::compile;
use piper::dag::{Cluster, Filter, TrainingDag};
use piper::model::ModelConfig;
use piper::runtime::backend::cpu::matmul::matmul_forward;
use piper::runtime::{Corpus, TrainOptions, Trainer};
use std::time::Instant;

fn gemm_gflops(n: usize, c: usize, oc: usize) -> f64 {
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

fn train_rate(cfg: &ModelConfig, steps: u32) -> (f64, f64) {
    let mut dag = TrainingDag::build(cfg, Cluster::new(1)).unwrap();
    dag.place(&Filter::all(), &[0], "pp").unwrap();
    let plan = compile(&dag).unwrap();
    let mut t = Trainer::new(cfg, plan, TrainOptions::default()).unwrap();
    let corpus = Corpus::builtin();
    let (b, s) = (cfg.batch_size as usize, cfg.seq_len as usize);
    t.step(&corpus.batch(1, b, s)).unwrap(); // warm-up
                                             // Best step of the run (the machine is shared and noisy).
    let mut secs = f64::MAX;
    for i in 0..steps {
        let start = Instant::now();
        t.step(&corpus.batch(i + 2, b, s)).unwrap();
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

fn main() {
    let (peak, how) = peak_gflops();
    // GEMM measured before and after the training runs; the better figure is the bar.
    let gemm_before = gemm_gflops(2048, 384, 1536);
    println!("fp32 peak per core ≈ {peak:.1} GFLOP/s ({how})");
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
    };
    let runs: Vec<(ModelConfig, f64, f64)> = [(ModelConfig::tiny(), 5), (mid, 3)]
        .into_iter()
        .map(|(cfg, steps)| {
            let (tps, gflops) = train_rate(&cfg, steps);
            (cfg, tps, gflops)
        })
        .collect();
    let gemm = gemm_before.max(gemm_gflops(2048, 384, 1536));
    println!(
        "GEMM 2048×384·384×1536, one thread: {gemm:.1} GFLOP/s = {:.0}% of peak",
        100.0 * gemm / peak
    );
    for (cfg, tps, gflops) in runs {
        println!(
            "train {} ({} params, batch {}×{}), one device: {tps:.0} tokens/s, {gflops:.1} GFLOP/s = {:.0}% of GEMM (goal for the mid-size model: ≥ 50%)",
            cfg.name,
            cfg.param_count(),
            cfg.batch_size,
            cfg.seq_len,
            100.0 * gflops / gemm
        );
    }
}
