//! Why a step could not run: the runtime's typed errors, each naming the
//! device and the op (as `label#node`).

use super::comm::CommError;
use crate::compile::plan::Op;

/// Why a step could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RuntimeError {
    #[error("the plan cannot run: {0}")]
    Plan(String),
    #[error("device {device}: setup: out of memory: the plan's predicted peak is {peak}, over its cap of {cap} (--device-memory): use a strategy that holds less per device (ZeRO, more pipeline stages, more microbatches) or raise the cap")]
    PlanOverCap {
        device: u32,
        peak: String,
        cap: String,
    },
    #[error("device {device}: {op}: out of memory: it needs {need} more with {live} in use, over its cap of {cap} (model states take {states})")]
    OutOfMemory {
        device: u32,
        op: String,
        need: String,
        live: String,
        cap: String,
        states: String,
    },
    /// The comm error is part of the message (not a `source`), so a
    /// `{:#}` chain prints it once.
    #[error("device {device}: {op}: {cause}")]
    Comm {
        device: u32,
        op: String,
        cause: CommError,
    },
    /// An exchange inside a spread op failed (expert all-to-all, tensor-
    /// parallel sum: a peer, a timeout, a chunk of the wrong size).
    #[error("device {device}: {op}: group exchange: {cause}")]
    Exchange {
        device: u32,
        op: String,
        cause: String,
    },
    #[error("device {device}: {op}: input {input} is missing (the plan does not produce it on this device)")]
    MissingInput {
        device: u32,
        op: String,
        input: String,
    },
    /// The device's backend failed inside an op (an allocation, a launch).
    #[error("device {device}: {op}: {backend} backend: {cause}")]
    Backend {
        device: u32,
        op: String,
        backend: &'static str,
        cause: String,
    },
    /// The devices could not start (a backend this machine cannot run).
    #[error("cannot start the devices: {0}")]
    Setup(String),
    /// The kernel threads asked for cannot be given.
    #[error("kernel threads: {0}")]
    Threads(String),
    /// The step's loss or gradient norm is not a number (NaN or
    /// infinite): the run stops at it, as Megatron's NaN check does; the
    /// update of that step was skipped on every device.
    #[error("step {step}: the {what} is {value}; first non-finite value: {at}. The run stops here and no checkpoint of this state is written (resume from the last checkpoint, perhaps with a lower --lr)")]
    NonFinite {
        step: u32,
        what: &'static str,
        value: f64,
        at: String,
    },
    #[error("device {device}, stream `{stream}`: {op}: panicked: {message}")]
    Panic {
        device: u32,
        stream: String,
        op: String,
        message: String,
    },
}

/// An op as errors and traces name it: `F[MB=0,PP=1]#12`.
pub(crate) fn label(op: &Op) -> String {
    format!("{}#{}", op.label(), op.node)
}
