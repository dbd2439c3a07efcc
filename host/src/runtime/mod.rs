//! Runtime: executes per-device plans with real numerics. Strategy-agnostic:
//! it reads plans and nothing else.

pub mod backend;
