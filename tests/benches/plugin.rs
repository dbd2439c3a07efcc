//! `cargo bench -p piper-e2e --bench plugin`: plugin load time cold and from
//! the compile cache; `apply` of the 1F1B plugin at PP=16, 256 microbatches in
//! the sandbox and natively (the same strategy source built for the host via
//! `piper-sdk`'s `native` feature); host-call throughput.

use piper::dag::{Cluster, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::{PluginHost, SandboxLimits};
use piper_sdk::{OptionValue, Options, Strategy};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Counts live heap bytes and their peak: what the host holds for a plugin,
/// beside what `sandbox.max_host_bytes` estimates.
struct Counting;
static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);

fn account(delta: i64) {
    let now = LIVE.fetch_add(delta, Relaxed) + delta;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every call forwards to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        account(l.size() as i64);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        account(-(l.size() as i64));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        account(new as i64);
        let q = unsafe { System.realloc(p, l, new) };
        account(-(l.size() as i64));
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn mib(b: i64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn model() -> ModelConfig {
    ModelConfig::bench_128()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn best<T>(n: usize, mut f: impl FnMut() -> (Duration, T)) -> (Duration, T) {
    let mut out = f();
    for _ in 1..n {
        let r = f();
        if r.0 < out.0 {
            out = r;
        }
    }
    out
}

fn main() {
    let cache = std::env::temp_dir().join(format!("piper-bench-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let limits = SandboxLimits {
        max_host_calls: 10_000_000,
        ..SandboxLimits::default()
    };

    // Load: cold (compile) and from the cache (a fresh host, as a second `piper plan`).
    let t = Instant::now();
    let cold = PluginHost::new(limits.clone(), Some(cache.clone())).unwrap();
    cold.load("1f1b").unwrap();
    let cold_t = t.elapsed();
    let (warm_t, _) = best(5, || {
        let t = Instant::now();
        let h = PluginHost::new(limits.clone(), Some(cache.clone())).unwrap();
        h.load("1f1b").unwrap();
        assert_eq!(h.compiles(), 0);
        (t.elapsed(), ())
    });
    println!(
        "plugin load (1f1b, {} KiB): cold {:.1} ms, from cache {:.1} ms",
        include_bytes_len(),
        ms(cold_t),
        ms(warm_t)
    );

    // apply at PP=16, 256 microbatches: sandbox vs native, same strategy source.
    let host = PluginHost::new(limits.clone(), Some(cache.clone())).unwrap();
    let plugin = host.load("1f1b").unwrap();
    let base = TrainingDag::build(&model(), Cluster::new(16)).unwrap();
    let args = vec![("microbatches".to_string(), "256".to_string())];
    let (sandbox_t, report) = best(3, || {
        let mut dag = base.clone();
        let t = Instant::now();
        let r = host.apply(&plugin, &mut dag, &args).unwrap();
        (t.elapsed(), r)
    });
    let opts = Options::new(vec![
        ("microbatches".into(), OptionValue::Int(256)),
        ("stream".into(), OptionValue::Str("pp".into())),
    ]);
    let (native_t, _) = best(3, || {
        let mut dag = base.clone();
        let t = Instant::now();
        piper_plugin_1f1b::OneFOneB::apply(&mut dag, &opts).unwrap();
        (t.elapsed(), ())
    });
    println!(
        "apply 1f1b (PP=16, 128 segments, 256 microbatches): sandbox {:.1} ms, native {:.1} ms, ratio {:.2}x (goal ≤ 1.5x); {} host calls, {:.2e} fuel of {:.1e}",
        ms(sandbox_t),
        ms(native_t),
        sandbox_t.as_secs_f64() / native_t.as_secs_f64(),
        report.host_calls,
        report.fuel_used as f64,
        limits.fuel as f64
    );

    // The host budget: what every bundled pipeline uses at PP=16 × 256
    // microbatches after ZeRO-3 over 8 (128 devices), against the defaults.
    let d = SandboxLimits::default();
    println!(
        "host budget at PP=16 × 256 microbatches, ZeRO-3 × 8 (128 devices); defaults: {:.1e} work units, {} nodes, {} edges, {:.1e} fuel, {:.0} MiB host bytes",
        d.max_host_work as f64, d.max_nodes, d.max_edges, d.fuel as f64, mib(d.max_host_bytes as i64)
    );
    let bhost = PluginHost::new(d.clone(), Some(cache.clone())).unwrap();
    let zero = bhost.load("zero").unwrap();
    for name in [
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "zb-h1",
        "dualpipev",
        "dualpipe",
    ] {
        let plugin = bhost.load(name).unwrap();
        let mut dag = TrainingDag::build(&model(), Cluster::new(128)).unwrap();
        let z = bhost
            .apply(
                &zero,
                &mut dag,
                &[("stage".into(), "3".into()), ("dp".into(), "8".into())],
            )
            .unwrap();
        let before = LIVE.load(Relaxed);
        PEAK.store(before, Relaxed);
        let t = Instant::now();
        let r = bhost.apply(&plugin, &mut dag, &args).unwrap();
        let el = t.elapsed();
        let (peak, held) = (PEAK.load(Relaxed) - before, LIVE.load(Relaxed) - before);
        let work = r.host_work + z.host_work;
        println!(
            "  zero+{name:<16} {:>7.1} ms  work {:.2e} ({:>5.0}× margin)  nodes {:>7} ({:>4.0}×)  edges {:>8} ({:>4.0}×)  fuel {:.1e} ({:.0}×)  calls {}",
            ms(el),
            work as f64,
            d.max_host_work as f64 / work as f64,
            dag.node_count(),
            d.max_nodes as f64 / dag.node_count() as f64,
            dag.edge_count(),
            d.max_edges as f64 / dag.edge_count() as f64,
            r.fuel_used as f64,
            d.fuel as f64 / r.fuel_used as f64,
            r.host_calls
        );
        println!(
            "  {:<22} host bytes: DAG {:.1} MiB measured, {:.1} MiB estimated ({:.0} B per node, {:.0} B per node or edge); apply peak {:.1} MiB ({:.1}× margin)",
            "",
            mib(held),
            mib(dag.held_bytes() as i64),
            held as f64 / dag.node_count() as f64,
            held as f64 / (dag.node_count() + dag.edge_count()) as f64,
            mib(peak),
            d.max_host_bytes as f64 / peak as f64
        );
    }

    // Host-call throughput: a plugin calling `cluster()` in a loop.
    let hostile =
        std::path::PathBuf::from(env!("PIPER_E2E_WASM_DIR")).join("piper_testing_hostile.wasm");
    let hostile = host.load_file(&hostile).unwrap();
    let n = 1_000_000u64;
    let calls = vec![
        ("mode".to_string(), "flood".to_string()),
        ("calls".to_string(), n.to_string()),
    ];
    let (t1, r) = best(3, || {
        let mut dag = TrainingDag::build(&ModelConfig::tiny(), Cluster::new(1)).unwrap();
        let t = Instant::now();
        let r = host.apply(&hostile, &mut dag, &calls).unwrap();
        (t.elapsed(), r)
    });
    println!(
        "host calls: {} in {:.1} ms = {:.2} M calls/s ({:.0} ns per call, guest loop included)",
        r.host_calls,
        ms(t1),
        r.host_calls as f64 / t1.as_secs_f64() / 1e6,
        t1.as_secs_f64() * 1e9 / r.host_calls as f64
    );
    let _ = std::fs::remove_dir_all(&cache);
}

fn include_bytes_len() -> usize {
    piper::plugin::bundled::get("1f1b")
        .map(|b| b.len() / 1024)
        .unwrap_or(0)
}
