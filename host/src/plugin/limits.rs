//! Sandbox limits (configurable in the run config's `[sandbox]` table) and the
//! pieces that enforce them: the memory limiter and the fixed clock.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Limits for every plugin call, guest side (memory, fuel, deadline, stack,
/// host calls, resources) and host side (the *host budget*: what the host
/// may spend on the plugin's behalf — DAG size, names, argument sizes, log
/// and error bytes, and predicted host work). Defaults are generous for every
/// bundled strategy at PP=16 × 256 microbatches with ZeRO-3 × 8 (measured
/// margins in `docs/internals/plugins.md`, "Host budget"); override them in the run
/// config's `[sandbox]` table. `piper plugin info` prints the ones in force.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SandboxLimits {
    /// Linear memory cap per instance, MiB: all memories and tables together.
    pub memory_mib: u64,
    /// Fuel (≈ wasm instructions) per call.
    pub fuel: u64,
    /// Wall-clock deadline per call, ms.
    pub deadline_ms: u64,
    /// Wasm stack cap, KiB (engine-wide).
    pub max_wasm_stack_kib: u64,
    /// Calls from the plugin into the host per call.
    pub max_host_calls: u64,
    /// Resource-table entries (WASI streams, pollables and the DAG handle).
    pub max_table_entries: usize,
    /// Captured stdout / stderr per call, bytes; also the bytes of
    /// `log` messages kept per call (past it, lines are dropped and counted).
    pub max_log_bytes: usize,
    /// DAG nodes after any directive.
    pub max_nodes: u64,
    /// DAG edges after any directive.
    pub max_edges: u64,
    /// Distinct names (tag keys and streams together).
    pub max_names: u64,
    /// Bytes per string argument (filter keys, passes, dimensions, streams).
    pub max_string_bytes: usize,
    /// Elements per list argument (devices, filter tags, order filters,
    /// and results returned by a query).
    pub max_list_len: usize,
    /// Bytes of an error message returned to the plugin or the user.
    pub max_error_bytes: usize,
    /// Host work per call in units (a node or edge visited, copied or
    /// created): each directive predicts its work and is refused before
    /// doing it when that exceeds what is left.
    pub max_host_work: u64,
    /// Bytes the host may hold on the plugin's behalf: the DAG it rewrites
    /// (nodes, edges, tags, index) and each call's temporaries (filter
    /// matches, order plans, query results, copied arguments), estimated
    /// before they are made; a call that would pass it is refused.
    pub max_host_bytes: u64,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            memory_mib: 512,
            fuel: 60_000_000_000,
            deadline_ms: 20_000,
            max_wasm_stack_kib: 1024,
            max_host_calls: 1_000_000,
            max_table_entries: 4096,
            max_log_bytes: 1 << 20,
            max_nodes: 4_000_000,
            max_edges: 16_000_000,
            max_names: 1024,
            max_string_bytes: 4096,
            max_list_len: 1 << 20,
            max_error_bytes: 4096,
            max_host_work: 2_000_000_000,
            max_host_bytes: 3 << 29,
        }
    }
}

/// A `[sandbox]` value out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("sandbox.{key} = {value}: {why}")]
pub struct LimitsError {
    pub key: &'static str,
    pub value: u64,
    pub why: String,
}

impl SandboxLimits {
    /// Check every limit is usable: positive, and small enough that the
    /// host's own arithmetic on it (MiB → bytes, ms → epoch ticks) cannot
    /// overflow.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let range = |key: &'static str, value: u64, lo: u64, hi: u64| {
            if value < lo || value > hi {
                Err(LimitsError {
                    key,
                    value,
                    why: format!("must be between {lo} and {hi}"),
                })
            } else {
                Ok(())
            }
        };
        // 4 GiB is wasm32's whole address space (per memory); 64 GiB in all.
        range("memory_mib", self.memory_mib, 1, 64 << 10)?;
        range("fuel", self.fuel, 1, u64::MAX / 2)?;
        range("deadline_ms", self.deadline_ms, 1, 24 * 3600 * 1000)?;
        range("max_wasm_stack_kib", self.max_wasm_stack_kib, 16, 1 << 20)?;
        range("max_host_calls", self.max_host_calls, 1, u64::MAX / 2)?;
        range(
            "max_table_entries",
            self.max_table_entries as u64,
            4,
            1 << 24,
        )?;
        range("max_log_bytes", self.max_log_bytes as u64, 0, 1 << 30)?;
        range("max_nodes", self.max_nodes, 16, u32::MAX as u64)?;
        range("max_edges", self.max_edges, 16, u32::MAX as u64)?;
        range(
            "max_names",
            self.max_names,
            2,
            2 * crate::dag::MAX_NAMES_HARD,
        )?;
        range("max_string_bytes", self.max_string_bytes as u64, 8, 1 << 30)?;
        range("max_list_len", self.max_list_len as u64, 1, u32::MAX as u64)?;
        range("max_error_bytes", self.max_error_bytes as u64, 64, 1 << 30)?;
        range("max_host_work", self.max_host_work, 1, u64::MAX / 2)?;
        range("max_host_bytes", self.max_host_bytes, 16 << 20, 1 << 40)?;
        Ok(())
    }

    /// The DAG-side part of the host budget.
    pub fn dag_budget(&self) -> crate::dag::DagBudget {
        crate::dag::DagBudget {
            max_nodes: self.max_nodes,
            max_edges: self.max_edges,
            max_names: self.max_names,
            max_work: self.max_host_work,
            max_bytes: self.max_host_bytes,
        }
    }

    /// Bytes wasmtime may copy out of the guest's memory for one host call
    /// (its "hostcall fuel", which counts what lifting the arguments
    /// allocates): an eighth of `max_host_bytes`, at most wasmtime's own
    /// default of 128 MiB. A guest can point many list elements at one
    /// string; without this cap one call could make the host copy far more
    /// than the guest holds.
    pub fn argument_bytes(&self) -> u64 {
        (self.max_host_bytes / 8).min(128 << 20)
    }

    /// `(key, value)` pairs in the order of the `[sandbox]` table, for
    /// `piper plugin info`.
    pub fn describe(&self) -> Vec<(&'static str, String)> {
        vec![
            ("memory_mib", self.memory_mib.to_string()),
            ("fuel", self.fuel.to_string()),
            ("deadline_ms", self.deadline_ms.to_string()),
            ("max_wasm_stack_kib", self.max_wasm_stack_kib.to_string()),
            ("max_host_calls", self.max_host_calls.to_string()),
            ("max_table_entries", self.max_table_entries.to_string()),
            ("max_log_bytes", self.max_log_bytes.to_string()),
            ("max_nodes", self.max_nodes.to_string()),
            ("max_edges", self.max_edges.to_string()),
            ("max_names", self.max_names.to_string()),
            ("max_string_bytes", self.max_string_bytes.to_string()),
            ("max_list_len", self.max_list_len.to_string()),
            ("max_error_bytes", self.max_error_bytes.to_string()),
            ("max_host_work", self.max_host_work.to_string()),
            ("max_host_bytes", self.max_host_bytes.to_string()),
        ]
    }
}

/// Bytes one table element is counted as against the memory cap (a
/// function reference: a pointer plus its type).
const TABLE_ELEM_BYTES: usize = 16;

/// Caps the linear memories and tables of one instance *together* (a
/// component may have several core instances, each with its own memory) and
/// remembers that it refused growth, so the trap that follows (Rust aborts on
/// allocation failure) is reported as the cap.
pub(crate) struct Limiter {
    cap: usize,
    used: usize,
    pub(crate) refused: bool,
}

impl Limiter {
    pub(crate) fn new(cap: usize) -> Self {
        Limiter {
            cap,
            used: 0,
            refused: false,
        }
    }

    fn grow(&mut self, current: usize, desired: usize) -> bool {
        let more = desired.saturating_sub(current);
        match self.used.checked_add(more) {
            Some(total) if total <= self.cap => {
                self.used = total;
                true
            }
            _ => {
                self.refused = true;
                false
            }
        }
    }
}

impl wasmtime::ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(self.grow(current, desired))
    }
    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(self.grow(
            current.saturating_mul(TABLE_ELEM_BYTES),
            desired.saturating_mul(TABLE_ELEM_BYTES),
        ))
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

#[cfg(test)]
mod tests {
    #[test]
    fn describe_lists_every_sandbox_key_with_its_value() {
        let l = super::SandboxLimits::default();
        let json = serde_json::to_value(&l).unwrap();
        let keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        let mut described: Vec<&str> = l.describe().iter().map(|(k, _)| *k).collect();
        described.sort();
        assert_eq!(described, keys);
        for (k, v) in l.describe() {
            assert_eq!(json[k].to_string(), v, "{k}");
        }
    }
}
