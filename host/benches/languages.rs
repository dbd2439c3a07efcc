//! `cargo bench -p piper --bench languages`: the same 1F1B strategy in Rust
//! (bundled), C, Python and JavaScript (`examples/plugins/`, built with
//! `piper plugin build`): component size, load time cold (compile) and from
//! the compile cache, and `apply` time and fuel at PP=8 × 64 and PP=16 × 256
//! microbatches, measured side by side in one run. Needs the guest
//! toolchains (`scripts/guest-toolchains.sh` and clang with wasi-libc; put
//! `target/guest-venv/bin` on PATH).

use piper::dag::{Cluster, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::author;
use piper::plugin::{PluginHost, SandboxLimits};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The `piper` binary's allocator, so the figures are the binary's.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn model() -> ModelConfig {
    ModelConfig::bench_128()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A copy of an example folder (never the checkout's own `build/`).
fn copy(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
        }
    }
    let modules = from.join("node_modules");
    if modules.is_dir() {
        std::os::unix::fs::symlink(modules.canonicalize().unwrap(), to.join("node_modules"))
            .unwrap();
    }
}

fn main() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let tmp = std::env::temp_dir().join(format!("piper-bench-lang-{}", std::process::id()));
    let cache = tmp.join("cache");
    let limits = SandboxLimits {
        fuel: 1_000_000_000_000,
        deadline_ms: 600_000,
        ..SandboxLimits::default()
    };
    // (language, bundled name or built component)
    let mut plugins: Vec<(&str, String, u64)> = vec![(
        "Rust",
        "1f1b".into(),
        piper::plugin::bundled::get("1f1b").unwrap().len() as u64,
    )];
    for (lang, dir) in [("C", "c"), ("Python", "python"), ("JavaScript", "js")] {
        let work = tmp.join(dir);
        copy(&repo.join("examples/plugins").join(dir), &work);
        let t = Instant::now();
        match author::build(&work, None) {
            Ok(b) => {
                let size = std::fs::metadata(&b.component).unwrap().len();
                println!(
                    "build {lang:<10} {:>8.0} ms ({})",
                    ms(t.elapsed()),
                    b.component.display()
                );
                plugins.push((lang, b.component.display().to_string(), size));
            }
            Err(e) => println!("build {lang:<10} NOT RUN: {e}"),
        }
    }
    println!();
    println!(
        "{:<10} {:>10} {:>11} {:>11} | {:>22} | {:>22}",
        "language",
        "size KiB",
        "cold ms",
        "cached ms",
        "PP=8 × 64: ms, fuel",
        "PP=16 × 256: ms, fuel"
    );
    let dags: Vec<(u32, u32, TrainingDag)> = [(8u32, 64u32), (16, 256)]
        .iter()
        .map(|(p, m)| {
            (
                *p,
                *m,
                TrainingDag::build(&model(), Cluster::new(*p)).unwrap(),
            )
        })
        .collect();
    for (lang, spec, size) in &plugins {
        let t = Instant::now();
        let cold = PluginHost::new(limits.clone(), Some(cache.clone())).unwrap();
        cold.load(spec).unwrap();
        let cold_t = t.elapsed();
        assert_eq!(cold.compiles(), 1);
        // From the cache: a fresh host, as a second `piper plan` (best of 3).
        let mut cached = Duration::MAX;
        let mut host = None;
        for _ in 0..3 {
            let t = Instant::now();
            let h = PluginHost::new(limits.clone(), Some(cache.clone())).unwrap();
            h.load(spec).unwrap();
            cached = cached.min(t.elapsed());
            assert_eq!(h.compiles(), 0);
            host = Some(h);
        }
        let host = host.unwrap();
        let plugin = host.load(spec).unwrap();
        let mut cells = Vec::new();
        for (p, m, base) in &dags {
            let args = vec![
                ("stages".to_string(), p.to_string()),
                ("microbatches".to_string(), m.to_string()),
            ];
            let mut best = Duration::MAX;
            let mut fuel = 0;
            for _ in 0..3 {
                let mut dag = base.clone();
                let t = Instant::now();
                let r = host.apply(&plugin, &mut dag, &args).unwrap();
                best = best.min(t.elapsed());
                fuel = r.fuel_used;
            }
            cells.push(format!("{:>9.1} ms, {:.2e}", ms(best), fuel as f64));
        }
        println!(
            "{lang:<10} {:>10.0} {:>11.0} {:>11.1} | {:>22} | {:>22}",
            *size as f64 / 1024.0,
            ms(cold_t),
            ms(cached),
            cells[0],
            cells[1]
        );
    }
    let d = SandboxLimits::default();
    println!(
        "\ndefaults: fuel {:.1e}, deadline {} ms (the run config's [sandbox] table raises them)",
        d.fuel as f64, d.deadline_ms
    );
    let _ = std::fs::remove_dir_all(PathBuf::from(&tmp));
}
