//! Sandbox limits (configurable in the run config's `[sandbox]` table) and the
//! pieces that enforce them: the memory limiter and the fixed clock.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Limits for every plugin call. Defaults are generous for real strategies
/// (the 1F1B plugin at 16 stages × 256 microbatches uses a small fraction of
/// each; see `cargo bench --bench plugin`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxLimits {
    /// Linear memory cap per instance, MiB.
    pub memory_mib: u64,
    /// Fuel (≈ wasm instructions) per call.
    pub fuel: u64,
    /// Wall-clock deadline per call, ms.
    pub deadline_ms: u64,
    /// Wasm stack cap, KiB (engine-wide).
    pub max_wasm_stack_kib: u64,
    /// Calls from the plugin into the host per call.
    pub max_host_calls: u64,
    /// Resource-table entries (WASI streams and the DAG handle).
    pub max_table_entries: usize,
    /// Captured stdout / stderr per call, bytes.
    pub max_log_bytes: usize,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            memory_mib: 512,
            fuel: 20_000_000_000,
            deadline_ms: 60_000,
            max_wasm_stack_kib: 1024,
            max_host_calls: 1_000_000,
            max_table_entries: 4096,
            max_log_bytes: 1 << 20,
        }
    }
}

/// Caps linear memory and remembers that it refused growth, so the trap that
/// follows (Rust aborts on allocation failure) is reported as the cap.
pub(crate) struct Limiter {
    cap: usize,
    pub(crate) refused: bool,
}

impl Limiter {
    pub(crate) fn new(cap: usize) -> Self {
        Limiter {
            cap,
            refused: false,
        }
    }
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.cap {
            self.refused = true;
            return Ok(false);
        }
        Ok(true)
    }
    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }
    fn instances(&self) -> usize {
        64
    }
    fn tables(&self) -> usize {
        64
    }
    fn memories(&self) -> usize {
        16
    }
}

/// Clocks stopped at the Unix epoch: a plugin is a deterministic function of
/// the DAG and its options.
pub(crate) struct FixedClock;

impl wasmtime_wasi::HostWallClock for FixedClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl wasmtime_wasi::HostMonotonicClock for FixedClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}
