//! The ops of a plan, one file per family, dispatched on the op's [`Act`]
//! (every kind matched, none left to a catch-all): compute (`F`, its
//! recompute `R`, `B`, `BI`, `BW`), point-to-point (`send`, `recv`), the
//! phases of split expert passes and their all-to-alls (`experts`), gradient
//! collectives (norm, DP / tied / copy reductions), ZeRO gathers (in
//! `zero`), relayouts between two layouts (`relayout`), and the optimizer
//! `update`.
//! Generic over the device's backend: kernels run inside the backend's
//! [`Backend::enter`] on the op's stream; communication stays on the
//! stream's own thread.

mod collective;
pub(super) mod compute;
mod experts;
mod p2p;
mod relayout;
mod update;
mod zero;

use super::backend::{Backend, KernelSpan, ParamId};
use super::comm::{Comm, CommError};
use super::device::Device;
use super::error::{label, RuntimeError};
use crate::compile::plan::{Act, Collective as C, Op};
use crate::dag::Pass;
use crate::model::{ModelConfig, Segment};
use crate::runtime::data::Batch;
use crate::runtime::{AdamW, TrainOptions};
use std::sync::Mutex;

/// Everything an op needs besides its device.
pub(crate) struct StepCtx<'a, B: Backend> {
    pub cfg: &'a ModelConfig,
    pub segments: Vec<Segment>,
    pub batch: &'a Batch,
    pub loss_scale: f32,
    pub step: u32,
    /// AdamW at this step's learning rate.
    pub adamw: AdamW,
    pub opts: &'a TrainOptions,
    pub comm: &'a dyn Comm,
    /// Every device of this process (a receiver releases its sender's
    /// in-flight bytes).
    pub devices: &'a [Device<B>],
    pub epoch: std::time::Instant,
    /// Running the forward-only (evaluation) plan.
    pub eval: bool,
    /// Failures in the order they happened: the first is the cause, later
    /// ones (aborted waits, locks a panic left poisoned) are consequences.
    pub failures: Mutex<Vec<RuntimeError>>,
    /// Messages handed over between devices of one memory, by (pair,
    /// sender, receiver), until their receivers take them (see `p2p`).
    pub handed: Mutex<std::collections::HashMap<(u32, u32, u32), B::Tensor>>,
}

/// Run one op of `dev`'s plan on its stream `si`; when tracing, the
/// kernels it ran go to `kernels`.
pub(super) fn exec_op<B: Backend>(
    dev: &Device<B>,
    si: usize,
    op: &Op,
    ctx: &StepCtx<B>,
    kernels: &mut Vec<KernelSpan>,
) -> Result<(), RuntimeError> {
    let on = ctx.opts.trace;
    let stream = dev.sync.stream(si);
    let mut kernel = |f: &(dyn Fn() -> Result<(), RuntimeError> + Sync)| {
        let trace = on.then_some((ctx.epoch, &mut *kernels));
        dev.b.enter(stream, trace, f)
    };
    // Communication runs on the stream's own thread, its staging ordered
    // on the op's stream.
    let host = |f: &dyn Fn() -> Result<(), RuntimeError>| dev.b.with_stream(stream, f);
    match &op.act {
        Act::Compute { pass, .. } => match pass {
            Pass::F | Pass::B | Pass::BI if op.phase.is_some() => {
                kernel(&|| experts::phase(dev, op, *pass, ctx))
            }
            Pass::F => kernel(&|| compute::forward(dev, op, ctx)),
            Pass::R => kernel(&|| compute::recompute(dev, op, ctx)),
            Pass::B | Pass::BI => kernel(&|| compute::backward_input(dev, op, *pass, ctx)),
            Pass::BW => kernel(&|| compute::backward_weight(dev, op, ctx)),
        },
        &Act::Send { to, pair } => host(&|| p2p::send(dev, op, ctx, to, pair)),
        &Act::Recv { from, pair } => host(&|| p2p::recv(dev, op, ctx, from, pair)),
        Act::Collective { what, group } => match *what {
            C::GradNorm => host(&|| collective::grad_norm(dev, op, ctx, group)),
            C::GradSync { .. } | C::TiedGrad | C::CopyGrad => {
                host(&|| collective::reduce_grads(dev, op, ctx, group, *what))
            }
            C::ParamRefresh => host(&|| zero::param_refresh(dev, op, ctx, group)),
            C::ParamGather => host(&|| zero::param_gather(dev, op, ctx, group)),
            C::Experts => host(&|| experts::all_to_all(dev, op, ctx, group)),
        },
        Act::Relayout { group, spec } => host(&|| relayout::run(dev, op, ctx, group, spec)),
        Act::Update => kernel(&|| update::update(dev, op, ctx)),
    }
}

/// An input the plan promised is not there.
pub(super) fn missing<B: Backend>(dev: &Device<B>, op: &Op, what: &str) -> RuntimeError {
    RuntimeError::MissingInput {
        device: dev.id,
        op: label(op),
        input: what.into(),
    }
}

/// A comm failure of `op` on `dev`.
pub(super) fn comm_error<B: Backend>(dev: &Device<B>, op: &Op, cause: CommError) -> RuntimeError {
    RuntimeError::Comm {
        device: dev.id,
        op: label(op),
        cause,
    }
}

/// The parameters the given segments own on this device, sorted, each once.
fn owned<B: Backend>(dev: &Device<B>, segs: &[u32]) -> Vec<ParamId> {
    let mut ids: Vec<ParamId> = segs
        .iter()
        .flat_map(|s| dev.owned.get(s).into_iter().flatten().copied())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}
