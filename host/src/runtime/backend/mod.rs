//! Compute backends. `cpu` is the embedded default.

pub mod cpu;
