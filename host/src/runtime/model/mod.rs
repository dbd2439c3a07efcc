//! Model families over the backend's kernels: a segment's parts (embedding,
//! blocks, MoE halves, head) forward and backward, each family in a file of
//! its own (`gpt2`, `llama`, `moe`) on what they share (`common`); a block's
//! halves behind one trait (`block`), so `segment`, which runs a segment part
//! by part, never asks which family it runs. The backend
//! (`runtime/backend/`) keeps the kernels.

pub mod block;
pub mod common;
pub mod gpt2;
pub mod llama;
pub mod moe;
pub mod segment;

pub use common::{Coll, ContextSum, Dims, Model, Peers, Reduce};
pub use segment::{Forward, SegmentCache, SegmentStash};
