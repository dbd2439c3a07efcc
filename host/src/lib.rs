//! Piper: a programmable distributed-training system. A strategy is a
//! sandboxed WebAssembly component that rewrites the host-owned global
//! training DAG through directives; the host compiles the DAG into per-device
//! plans and runs them.
//!
//! The modules follow the flow: [`model`] → [`dag`] → [`plugin`] → [`compile`]
//! → [`runtime`] | [`sim`]; [`registry`] brings plugins from OCI registries to [`plugin`].
//! [`session`] runs the flow up to a plan from a run config (what the CLI
//! and a program using Piper call); [`verify`] trains a plan beside one
//! device and holds it to its numbers; [`cli`] parses arguments and prints.

pub mod cli;
pub mod compile;
pub mod dag;
pub mod home;
pub mod model;
pub mod plugin;
pub mod registry;
pub mod runtime;
pub mod search;
pub mod session;
pub mod sim;
#[doc(hidden)]
pub mod test_support;
pub mod verify;
