//! `cargo bench -p piper --bench schedules`: pipeline schedules side by side
//! on 2 virtual devices, one per core (virtual devices sharing cores would
//! hide bubbles: an idle device frees its core for another). For each of
//! `gpipe`, `1f1b`, `interleaved-1f1b`, `zb-h1` (2 stages) and `dualpipev`
//! (4 stages folded on the 2 devices), with 8 and 16 microbatches, on a
//! model where compute dominates (8 layers, d_model 256): the best step
//! time of the run, its ratio to `1f1b`, and each device's idle fraction
//! (share of the step its compute stream did not run), from the trace.

use piper::compile::compile;
use piper::dag::{Cluster, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::{PluginHost, SandboxLimits};
use piper::runtime::{Corpus, TrainOptions, Trainer};

fn model() -> ModelConfig {
    ModelConfig {
        name: "bench-8x256".into(),
        layers: 8,
        d_model: 256,
        heads: 4,
        seq_len: 64,
        vocab: 256,
        batch_size: 32,
        layers_per_region: 1,
        regions: None,
        moe: None,
    }
}

/// (label, plugin, options)
type Case<'a> = (&'a str, &'a str, Vec<(&'a str, String)>);

struct Measured {
    step_s: f64,
    idle: Vec<f64>,
}

fn measure(host: &PluginHost, name: &str, opts: &[(&str, String)], steps: u32) -> Measured {
    let cfg = model();
    let mut dag = TrainingDag::build(&cfg, Cluster::new(2)).unwrap();
    let p = host.load(name).unwrap();
    let o: Vec<(String, String)> = opts
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    host.apply(&p, &mut dag, &o).unwrap();
    let plan = compile(&dag).unwrap();
    let compute_tid: Vec<usize> = plan
        .devices
        .iter()
        .map(|d| {
            d.streams
                .iter()
                .position(|s| s.stream == "compute")
                .unwrap()
        })
        .collect();
    let opts = TrainOptions {
        trace: true,
        ..Default::default()
    };
    let mut t = Trainer::new(&cfg, plan, opts).unwrap();
    let corpus = Corpus::builtin();
    let mut best = (f64::MAX, 0u32);
    for s in 1..=steps {
        let st = t.step(&corpus.batch(s, 32, 64)).unwrap();
        // Step 1 warms caches and allocators; it never counts.
        if s > 1 && st.elapsed.as_secs_f64() < best.0 {
            best = (st.elapsed.as_secs_f64(), s);
        }
    }
    // Busy compute time per device in the best step, from the trace.
    let trace = t.trace_json();
    let mut busy = [0.0f64; 2];
    let mut span = [(f64::MAX, 0.0f64); 2];
    for e in trace["traceEvents"].as_array().unwrap() {
        if e["ph"] != "X" || e["args"]["step"].as_u64() != Some(best.1 as u64) {
            continue;
        }
        let d = e["pid"].as_u64().unwrap() as usize;
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        span[d] = (span[d].0.min(ts), span[d].1.max(ts + dur));
        if e["tid"].as_u64() == Some(compute_tid[d] as u64) {
            busy[d] += dur;
        }
    }
    // The step's span: first op on any device to last op on any device.
    let start = span.iter().map(|s| s.0).fold(f64::MAX, f64::min);
    let end = span.iter().map(|s| s.1).fold(0.0, f64::max);
    Measured {
        step_s: best.0,
        idle: busy.iter().map(|b| 1.0 - b / (end - start)).collect(),
    }
}

fn main() {
    let steps: u32 = std::env::var("PIPER_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    println!(
        "pipeline schedules on 2 virtual devices (one thread each), model 8 layers × d_model 256, \
         batch 32 × 64 tokens; best of {} steps",
        steps - 1
    );
    for m in [8u32, 16] {
        let ms = m.to_string();
        let cases: Vec<Case> = vec![
            ("gpipe", "gpipe", vec![("microbatches", ms.clone())]),
            ("1f1b", "1f1b", vec![("microbatches", ms.clone())]),
            (
                "interleaved-1f1b (v=2)",
                "interleaved-1f1b",
                vec![("microbatches", ms.clone()), ("virtual", "2".into())],
            ),
            ("zb-h1", "zb-h1", vec![("microbatches", ms.clone())]),
            (
                "dualpipev (4 stages)",
                "dualpipev",
                vec![("microbatches", ms.clone())],
            ),
        ];
        let results: Vec<(&str, Measured)> = cases
            .iter()
            .map(|(label, name, o)| (*label, measure(&host, name, o, steps)))
            .collect();
        let base = results
            .iter()
            .find(|(l, _)| *l == "1f1b")
            .map(|(_, r)| r.step_s)
            .unwrap();
        println!("\n{m} microbatches:");
        println!(
            "  {:<24} {:>10} {:>9} {:>16}",
            "schedule", "step (ms)", "vs 1f1b", "idle dev0 / dev1"
        );
        for (label, r) in &results {
            println!(
                "  {:<24} {:>10.1} {:>8.3}× {:>7.1}% / {:>5.1}%",
                label,
                r.step_s * 1e3,
                r.step_s / base,
                100.0 * r.idle[0],
                100.0 * r.idle[1]
            );
        }
    }
}
