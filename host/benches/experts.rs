//! `cargo bench -p piper --bench experts`: issue 15's benchmark. The
//! Qwen3-style MoE (`examples/models/qwen3-moe.toml`: 24 layers, hidden 2048,
//! 8 experts, top-2, sequence 512) simulated on H100s at PP 2 × DP 2 × EP 2
//! (EP = DP: each stage's experts spread over its data-parallel pair),
//! `1f1b` and `dualpipev`, each with the expert all-to-alls inside the
//! compute ops (`ep:stream=compute`, no split) and split into phases on
//! their own stream (`ep`); DualPipeV also split without its phase-by-phase
//! overlap (`overlap=false`). Prints step time, exposed all-to-all time and
//! each candidate's step against 1F1B without the split, on two layouts: one
//! node (`h100-cluster`, all on NVLink) and the EP pairs across nodes (2 GPUs
//! a node, so every all-to-all crosses InfiniBand).

use piper::compile::compile;
use piper::dag::{Cluster as Devices, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::{PluginHost, SandboxLimits};
use piper::sim::{exposed_all_to_all, simulate, Cluster};

/// The `piper` binary's allocator, so the figures are the binary's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Strategy<'a> = &'a [(&'a str, &'a [(&'a str, &'a str)])];

fn main() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/models/qwen3-moe.toml"
    );
    let model = ModelConfig::from_name_or_file(path).expect("the qwen3-moe example loads");
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let mb = "8";
    let candidates: [(&str, Strategy); 5] = [
        (
            "1f1b, all-to-all in op",
            &[
                ("dp", &[("degree", "2")]),
                ("ep", &[("stream", "compute")]),
                ("1f1b", &[("microbatches", mb)]),
            ],
        ),
        (
            "1f1b, split",
            &[
                ("dp", &[("degree", "2")]),
                ("ep", &[]),
                ("1f1b", &[("microbatches", mb)]),
            ],
        ),
        (
            "dualpipev, all-to-all in op",
            &[
                ("dp", &[("degree", "2")]),
                ("ep", &[("stream", "compute")]),
                ("dualpipev", &[("microbatches", mb)]),
            ],
        ),
        (
            "dualpipev, split, no overlap",
            &[
                ("dp", &[("degree", "2")]),
                ("ep", &[]),
                ("dualpipev", &[("microbatches", mb), ("overlap", "false")]),
            ],
        ),
        (
            "dualpipev, split + overlap",
            &[
                ("dp", &[("degree", "2")]),
                ("ep", &[]),
                ("dualpipev", &[("microbatches", mb)]),
            ],
        ),
    ];
    let plans: Vec<_> = candidates
        .iter()
        .map(|(name, strategy)| {
            let mut dag = TrainingDag::build(&model, Devices::new(4)).unwrap();
            for (plugin, opts) in *strategy {
                let p = host.load(plugin).unwrap();
                let o: Vec<(String, String)> = opts
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                host.apply(&p, &mut dag, &o)
                    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
            }
            compile(&dag).unwrap_or_else(|e| panic!("{name}: {e}"))
        })
        .collect();
    let one_node = Cluster::resolve("h100-cluster", 4).unwrap();
    let across = Cluster {
        name: "h100-cluster, 2 GPUs a node".into(),
        nodes: 2,
        devices_per_node: 2,
        ..Cluster::h100_cluster(2)
    };
    println!(
        "{} (PP 2 x DP 2 x EP 2, {mb} microbatches, batch {} x {} tokens)",
        model.name, model.batch_size, model.seq_len
    );
    for cluster in [&one_node, &across] {
        println!("\n{}:", cluster.name);
        println!(
            "  {:<30} {:>10} {:>18} {:>16}",
            "candidate", "step", "exposed all-to-all", "vs 1f1b in op"
        );
        let mut base = None;
        for ((name, _), plan) in candidates.iter().zip(&plans) {
            let s = simulate(plan, cluster).unwrap();
            let a2a = exposed_all_to_all(plan, &s).unwrap_or(0.0);
            let b = *base.get_or_insert(s.step_time);
            println!(
                "  {:<30} {:>7.1} ms {:>15.2} ms {:>+15.1}%",
                name,
                s.step_time * 1e3,
                a2a * 1e3,
                (b / s.step_time - 1.0) * 100.0
            );
        }
    }
    println!(
        "\n(vs 1f1b in op: throughput gain, step of 1F1B without the split over the candidate's)"
    );
}
