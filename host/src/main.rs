//! The `piper` command.

/// mimalloc: the planner's many small allocations (docs/performance/plans-at-scale.md); the benches use it too.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    piper::cli::main()
}
