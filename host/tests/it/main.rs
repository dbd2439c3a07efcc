//! The host's end-to-end tests, one module per suite, in one test binary: the crate
//! is linked once, and one harness keeps both cores busy to the last test instead of
//! waiting for each suite's slowest. Two suites stay binaries of their own:
//! `boundary.rs` counts allocations with its own global allocator, and
//! `host_memory.rs` measures its children's peak memory, which counts the parent's.
//!
//! `cargo test -p piper --test it cli::` runs one suite; `scripts/test.sh` runs all.

mod common;

mod calibrate;
mod cli;
mod compose;
#[cfg(feature = "cuda")]
mod cuda;
mod fuzz;
mod hf;
mod languages;
mod layouts;
mod library;
#[cfg(feature = "mpi")]
mod mpi;
mod plugins;
mod registry;
mod schedules;
mod sim;
mod train;
