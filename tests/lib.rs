//! End-to-end tests and benchmarks that span crates. The library part is
//! empty; see `benches/`.
