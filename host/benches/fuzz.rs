//! The strategy fuzzer at length (the test command runs a few dozen cases):
//! `cargo bench -p piper --bench fuzz [-- CASES [SEED]]` runs CASES random
//! strategies (default 1000) from the generator of `host/tests/it/fuzz.rs`
//! and prints strategies per minute and the share refused by a directive,
//! refused at compile, trained at one device's numbers, and failing — with
//! each failure's reason and its strategy as Rust. Failing must be 0.

#[path = "../tests/it/fuzz.rs"]
#[allow(dead_code)]
mod fuzz;

use fuzz::{program, Outcome};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let cases: u32 = args.first().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let seed: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1);
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    );
    let gen = program();
    let (mut refused, mut not_compiled, mut ran, mut failed) = (0u32, 0u32, 0u32, 0u32);
    let mut over = 0u32;
    let start = Instant::now();
    for i in 0..cases {
        let p = gen
            .new_tree(&mut runner)
            .expect("the generator makes a case")
            .current();
        match p.run() {
            Outcome::Refused(_) => refused += 1,
            Outcome::NotCompiled(_) => not_compiled += 1,
            Outcome::Ran => ran += 1,
            Outcome::OverPeak(why) => {
                over += 1;
                println!("case {i} over its planned peak: {why}\n{p:?}");
            }
            Outcome::Failed(why) => {
                failed += 1;
                println!("case {i} FAILED: {why}\n{p:?}");
            }
        }
        if (i + 1) % 100 == 0 {
            eprintln!("{} cases, {:.0} s", i + 1, start.elapsed().as_secs_f64());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let share = |n: u32| 100.0 * f64::from(n) / f64::from(cases.max(1));
    println!(
        "fuzz: {cases} strategies (seed {seed}) in {secs:.0} s, {:.0} a minute: refused by a directive {:.1}%, refused at compile {:.1}%, trained at one device's numbers {:.1}% (of which over the planned peak {:.1}%), failing {failed} ({:.1}%)",
        f64::from(cases) / secs * 60.0,
        share(refused),
        share(not_compiled),
        share(ran + over),
        share(over),
        share(failed),
    );
    if failed > 0 {
        std::process::exit(1);
    }
}
