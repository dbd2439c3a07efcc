//! Point-to-point ops: a `send` hands a tensor to the comm (it stays on the
//! sender's memory account until the receiver holds it); a `recv` takes the
//! matching message and releases the sender's account.

use super::StepCtx;
use super::{comm_error, missing};
use crate::compile::plan::{Op, TensorKind};
use crate::runtime::backend::Backend;
use crate::runtime::buffers::Buf;
use crate::runtime::comm::packed;
use crate::runtime::device::Device;
use crate::runtime::error::RuntimeError;

pub(super) fn send<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    peer: u32,
    pair: u32,
) -> Result<(), RuntimeError> {
    let kind = op.tensor.unwrap_or(TensorKind::Activation);
    let buf = dev.bufs.take(op, kind)?;
    let t = dev
        .tensor_of(op, buf)?
        .ok_or_else(|| missing(dev, op, &format!("{kind:?} to send")))?;
    // The message stays on this device's account until its receiver holds
    // it (in this process), or until the transport has it (another rank).
    let in_flight = dev.bufs.reserve(op, B::bytes(&t))?;
    if ctx.comm.is_local(peer) {
        in_flight.keep();
    }
    // On the wire in the tensor's dtype.
    let dtype = B::dtype(&t);
    let values = dev
        .b
        .download_owned(t)
        .map_err(|e| dev.backend_error(op, e))?;
    packed::send(ctx.comm, pair, (dev.id, peer), values, dtype).map_err(|e| comm_error(dev, op, e))
}

pub(super) fn recv<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    peer: u32,
    pair: u32,
) -> Result<(), RuntimeError> {
    let kind = op.tensor.unwrap_or(TensorKind::Activation);
    let what = format!("{kind:?}");
    // Sent and held in the activation dtype, as its sender held it.
    let v = packed::recv(ctx.comm, pair, (peer, dev.id), &what, dev.act)
        .map_err(|e| comm_error(dev, op, e))?;
    let t = dev
        .b
        .upload_as(v, dev.act)
        .map_err(|e| dev.backend_error(op, e))?;
    let bytes = B::bytes(&t);
    dev.bufs.put(op, kind, Buf::Tensor(t))?;
    if let Some(sender) = ctx.devices.iter().find(|d| d.id == peer) {
        sender.bufs.release(bytes);
    }
    Ok(())
}
