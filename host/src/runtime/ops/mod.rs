//! The ops of a plan, one file per family, dispatched on the plan's enums
//! (op kind and comm purpose): compute (`F`, its recompute `R`, `B`, `BI`,
//! `BW`), point-to-point
//! (`send`, `recv`), the phases of split expert passes and their
//! all-to-alls (`experts`), gradient collectives (norm, DP / tied / copy
//! reductions), ZeRO gathers (in `zero`), and the optimizer `update`.
//! Generic over the device's backend: kernels run inside the backend's
//! [`Backend::enter`] on the op's stream; communication stays on the
//! stream's own thread.

mod collective;
pub(super) mod compute;
mod experts;
mod p2p;
mod update;

use super::backend::{Backend, KernelSpan, ParamId};
use super::comm::CommError;
use super::device::Device;
use super::error::{label, RuntimeError};
use super::step::StepCtx;
use super::zero;
use crate::compile::plan::{CommPurpose, Op, OpKind};

/// Run one op of `dev`'s plan on its stream `si`; when tracing, the
/// kernels it ran go to `kernels`.
pub(super) fn exec_op<B: Backend>(
    dev: &Device<B>,
    si: usize,
    op: &Op,
    ctx: &StepCtx<B>,
    kernels: &mut Vec<KernelSpan>,
) -> Result<(), RuntimeError> {
    let group: Vec<u32> = op
        .group
        .as_deref()
        .map(|g| g.to_vec())
        .unwrap_or_else(|| vec![dev.id]);
    use CommPurpose as P;
    let on = ctx.opts.trace;
    let stream = &dev.streams[si];
    let mut kernel = |f: &(dyn Fn() -> Result<(), RuntimeError> + Sync)| {
        let trace = on.then_some((ctx.epoch, &mut *kernels));
        dev.b.enter(stream, trace, f)
    };
    // Communication runs on the stream's own thread, its staging ordered
    // on the op's stream.
    let host = |f: &dyn Fn() -> Result<(), RuntimeError>| dev.b.with_stream(stream, f);
    match (op.op, op.purpose) {
        (OpKind::F | OpKind::B | OpKind::BI, _) if op.phase.is_some() => {
            kernel(&|| experts::phase(dev, op, ctx))
        }
        (OpKind::AllToAll, Some(P::Experts)) => host(&|| experts::all_to_all(dev, op, ctx, &group)),
        (OpKind::F, _) => kernel(&|| compute::forward(dev, op, ctx)),
        (OpKind::R, _) => kernel(&|| compute::recompute(dev, op, ctx)),
        (OpKind::B | OpKind::BI, _) => kernel(&|| compute::backward_input(dev, op, ctx)),
        (OpKind::BW, _) => kernel(&|| compute::backward_weight(dev, op, ctx)),
        (OpKind::Send, _) => host(&|| p2p::send(dev, op, ctx)),
        (OpKind::Recv, _) => host(&|| p2p::recv(dev, op, ctx)),
        (OpKind::AllReduce, Some(P::GradNorm)) => {
            host(&|| collective::grad_norm(dev, op, ctx, &group))
        }
        (
            OpKind::AllReduce | OpKind::ReduceScatter,
            Some(purpose @ (P::GradSync | P::TiedGrad | P::CopyGrad)),
        ) => host(&|| collective::reduce_grads(dev, op, ctx, &group, purpose)),
        (OpKind::AllGather, Some(P::ParamRefresh)) => {
            host(&|| zero::param_refresh(dev, op, ctx, &group))
        }
        (OpKind::AllGather, Some(P::ParamGather)) => {
            host(&|| zero::param_gather(dev, op, ctx, &group))
        }
        (OpKind::Update, _) => kernel(&|| update::update(dev, op, ctx)),
        (kind, purpose) => Err(RuntimeError::Unsupported(format!(
            "device {}: {}: {} for {} is not supported by the runtime",
            dev.id,
            label(op),
            kind.as_str(),
            purpose.map_or("no purpose", |p| p.as_str())
        ))),
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
