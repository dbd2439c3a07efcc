//! `cargo bench -p piper --bench schedules`: pipeline schedules side by side
//! on 2 virtual devices, one per core (virtual devices sharing cores would
//! hide bubbles: an idle device frees its core for another). For each of
//! `gpipe`, `1f1b`, `interleaved-1f1b`, `zb-h1` (2 stages) and `dualpipev`
//! (4 stages folded on the 2 devices), with 8 and 16 microbatches, on a
//! model where compute dominates (8 layers, d_model 256): the median step
//! time over interleaved rounds, its ratio to `1f1b`, and each device's idle fraction
//! (share of the step its compute stream did not run), from the trace.

use piper::compile::compile;
use piper::dag::{Cluster, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::{PluginHost, SandboxLimits};
use piper::runtime::{Corpus, TrainOptions, Trainer};

/// The `piper` binary's allocator, so the figures are the binary's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// (label, plugin, options)
type Case<'a> = (&'a str, &'a str, Vec<(&'a str, String)>);

fn model() -> ModelConfig {
    ModelConfig {
        name: "bench-8x256".into(),
        d_model: 256,
        ..ModelConfig::tiny()
    }
}

/// One schedule's trainer and what its steps measured.
struct Bench {
    label: String,
    trainer: Trainer,
    compute_tid: Vec<usize>,
    times: Vec<f64>,
    idle: Vec<[f64; 2]>,
}

fn setup(host: &PluginHost, label: &str, name: &str, opts: &[(&str, String)]) -> Bench {
    let cfg = model();
    let mut dag = TrainingDag::build(&cfg, Cluster::new(2)).unwrap();
    let p = host.load(name).unwrap();
    let o: Vec<(String, String)> = opts
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    host.apply(&p, &mut dag, &o).unwrap();
    let plan = compile(&dag).unwrap();
    let compute_tid = plan
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
    Bench {
        label: label.to_string(),
        trainer: Trainer::new(&cfg, plan, opts).unwrap(),
        compute_tid,
        times: Vec::new(),
        idle: Vec::new(),
    }
}

impl Bench {
    /// Run step `s`; record its time and each device's idle fraction (the
    /// share of the step's span its compute stream did not run).
    fn step(&mut self, corpus: &Corpus, s: u32, record: bool) {
        let st = self
            .trainer
            .step(&corpus.batch(s, 32, 64, 256).unwrap())
            .unwrap();
        if !record {
            return;
        }
        self.times.push(st.elapsed.as_secs_f64());
        let trace = self.trainer.trace_json();
        let mut busy = [0.0f64; 2];
        let (mut start, mut end) = (f64::MAX, 0.0f64);
        for e in trace["traceEvents"].as_array().unwrap() {
            if e["ph"] != "X" || e["args"]["step"].as_u64() != Some(s as u64) {
                continue;
            }
            let d = e["pid"].as_u64().unwrap() as usize;
            let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
            start = start.min(ts);
            end = end.max(ts + dur);
            if e["tid"].as_u64() == Some(self.compute_tid[d] as u64) {
                busy[d] += dur;
            }
        }
        self.idle
            .push([1.0 - busy[0] / (end - start), 1.0 - busy[1] / (end - start)]);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let rounds: u32 = std::env::var("PIPER_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    println!(
        "pipeline schedules on 2 virtual devices (one thread each), model 8 layers × d_model 256, \
         batch 32 × 64 tokens; median of {rounds} rounds, each round one step of every schedule \
         in turn (so the machine's drift hits all alike), after a warm-up round"
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
                "interleaved-zb (v=2)",
                "interleaved-zb",
                vec![("microbatches", ms.clone()), ("virtual", "2".into())],
            ),
            ("zbv (4 stages)", "zbv", vec![("microbatches", ms.clone())]),
            (
                "dualpipev (4 stages)",
                "dualpipev",
                vec![("microbatches", ms.clone())],
            ),
        ];
        let mut benches: Vec<Bench> = cases
            .iter()
            .map(|(label, name, o)| setup(&host, label, name, o))
            .collect();
        let corpus = Corpus::builtin();
        for round in 0..=rounds {
            for b in benches.iter_mut() {
                b.step(&corpus, round + 1, round > 0);
            }
        }
        let base = median(
            benches
                .iter()
                .find(|b| b.label == "1f1b")
                .unwrap()
                .times
                .clone(),
        );
        println!("\n{m} microbatches:");
        println!(
            "  {:<24} {:>10} {:>9} {:>18}",
            "schedule", "step (ms)", "vs 1f1b", "idle dev0 / dev1"
        );
        for b in &benches {
            let t = median(b.times.clone());
            let idle0 = median(b.idle.iter().map(|i| i[0]).collect());
            let idle1 = median(b.idle.iter().map(|i| i[1]).collect());
            println!(
                "  {:<24} {:>10.1} {:>8.3}× {:>8.1}% / {:>5.1}%",
                b.label,
                t * 1e3,
                t / base,
                100.0 * idle0,
                100.0 * idle1
            );
        }
    }
}
