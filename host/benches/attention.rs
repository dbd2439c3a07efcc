//! `cargo bench -p piper --bench attention`: the long-sequence issue's
//! kernel benchmark. Causal attention forward + backward on one device (every
//! core of this machine), batch 1, 4 heads of 64, at T = 256, 1024 and
//! 4096: the kernel that keeps each head's T×T probabilities for the
//! backward (`cpu::attention`) against the memory-efficient one that keeps
//! the output and a log-sum-exp per row and recomputes the probabilities
//! (`cpu::flash`), side by side in one run, alternating. Prints tokens/s of
//! the best of a few steps, their ratio, and the bytes each keeps between forward and
//! backward (what the plan's memory counts) beside its scratch.

use piper::runtime::backend::cpu::{attention, flash};
use std::time::Instant;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32 - 0.5) * 2.0
        })
        .collect()
}

/// Seconds `f` takes.
fn time(f: impl FnOnce()) -> f64 {
    let s = Instant::now();
    f();
    s.elapsed().as_secs_f64()
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn main() {
    let (b, nh, hs) = (1, 4, 64);
    let c = nh * hs;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    println!(
        "causal attention, batch {b}, {nh} heads of {hs}, {threads} threads: forward + backward"
    );
    println!(
        "{:>6} {:>14} {:>14} {:>7} {:>16} {:>16}",
        "T", "keep P tok/s", "flash tok/s", "ratio", "keep P saved MiB", "flash saved MiB"
    );
    for t in [256, 1024, 4096] {
        let qkv = values(b * t * 3 * c, 1);
        let dout = values(b * t * c, 2);
        let (mut out, mut att) = (vec![0.0; b * t * c], vec![0.0; b * nh * t * t]);
        let (mut fout, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * nh * t]);
        let mut dqkv = vec![0.0; b * t * 3 * c];
        // Alternating, so both see the same moments of a noisy machine; the
        // best of each.
        let rounds = if t >= 4096 { 3 } else { 6 };
        let (mut old, mut new) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..rounds {
            old = old.min(pool.install(|| {
                time(|| {
                    attention::attention_forward(&mut out, &mut att, &qkv, b, t, c, nh);
                    attention::attention_backward(&mut dqkv, &dout, &qkv, &att, b, t, c, nh);
                })
            }));
            new = new.min(pool.install(|| {
                time(|| {
                    flash::flash_forward(&mut fout, &mut lse, &qkv, b, t, c, nh, &[(0, t)]);
                    flash::flash_backward(
                        &mut dqkv,
                        &dout,
                        &qkv,
                        &fout,
                        &lse,
                        b,
                        t,
                        c,
                        nh,
                        &[(0, t)],
                    );
                })
            }));
        }
        let max_diff = out
            .iter()
            .zip(&fout)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(max_diff < 1e-4, "T {t}: outputs differ by {max_diff}");
        let tokens = (b * t) as f64;
        // Between forward and backward: the output and the probabilities,
        // or the output and one log-sum-exp a row and head.
        let keep = 4 * (out.len() + att.len());
        let flash_keep = 4 * (fout.len() + lse.len());
        println!(
            "{t:>6} {:>14.0} {:>14.0} {:>7.2} {:>16.1} {:>16.2}",
            tokens / old,
            tokens / new,
            old / new,
            mib(keep),
            mib(flash_keep)
        );
    }
}
