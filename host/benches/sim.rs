//! `cargo bench -p piper --bench sim`: simulator throughput (ops per second)
//! and the scale case — zero(stage=1) over 128 + 1F1B over 16 stages
//! on `h100-cluster` with 2048 GPUs, a 64-layer model, 64 microbatches —
//! timed end to end (DAG, plugins, compile, simulation; goal < 5 s).

use piper::compile::compile;
use piper::dag::{Cluster as Devices, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::{PluginHost, SandboxLimits};
use piper::sim::{simulate, Cluster};
use std::time::Instant;

/// The `piper` binary's allocator, so the figures are the binary's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let model = ModelConfig {
        layers: 64,
        batch_size: 128 * 64,
        ..ModelConfig::tiny()
    };
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let zero = host.load("zero").unwrap();
    let pipe = host.load("1f1b").unwrap();
    for round in 0..3 {
        let t0 = Instant::now();
        let mut dag = TrainingDag::build(&model, Devices::new(2048)).unwrap();
        host.apply(
            &zero,
            &mut dag,
            &[("stage".into(), "1".into()), ("dp".into(), "128".into())],
        )
        .unwrap();
        host.apply(&pipe, &mut dag, &[("microbatches".into(), "64".into())])
            .unwrap();
        let t1 = Instant::now();
        let plan = compile(&dag).unwrap();
        let t2 = Instant::now();
        let s = simulate(&plan, &Cluster::h100_cluster(256)).unwrap();
        let t3 = Instant::now();
        let total = t3 - t0;
        println!(
            "round {round}: 2048 GPUs (PP 16 × DP 128), {} ops: build+apply {:.0} ms, compile {:.0} ms, simulate {:.0} ms ({:.2} M ops/s); total {:.2} s (goal < 5 s); step {:.2} ms, bubble {:.1}%",
            s.ops,
            (t1 - t0).as_secs_f64() * 1e3,
            (t2 - t1).as_secs_f64() * 1e3,
            (t3 - t2).as_secs_f64() * 1e3,
            s.ops as f64 / (t3 - t2).as_secs_f64() / 1e6,
            total.as_secs_f64(),
            s.step_time * 1e3,
            s.bubble * 100.0
        );
    }
}
