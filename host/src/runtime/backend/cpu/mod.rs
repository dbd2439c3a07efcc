//! The CPU backend's kernels, llm.c style: one file per op family, each op a
//! forward plus a backward-for-input and a backward-for-weights with explicit
//! shapes and caches; `gpt` composes them into segments. fp32; each kernel
//! spreads over its device's thread pool ([`par`]) and gives the same bits
//! for every thread count.

// Kernels carry their shapes as arguments, as llm.c does: readable at the call.
#![allow(clippy::too_many_arguments)]

pub mod adamw;
pub mod attention;
pub mod elementwise;
pub mod embedding;
pub mod gpt;
pub mod layernorm;
pub mod loss;
pub mod matmul;
pub mod moe;
pub mod par;
pub mod profile;

#[cfg(test)]
mod tests;
