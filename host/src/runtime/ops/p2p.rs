//! Point-to-point ops: a `send` hands a tensor to the comm (it stays on the
//! sender's memory account until the receiver holds it); a `recv` takes the
//! matching message and releases the sender's account. Between two devices
//! of one memory (this process's CPU threads, virtual devices on one GPU:
//! [`Backend::shares_memory_with`]) the tensor itself is handed over, and
//! the comm carries an empty message that orders the two and bounds the
//! wait; otherwise the values travel through the host in the tensor's
//! dtype.

use super::StepCtx;
use super::{comm_error, missing};
use crate::compile::plan::{Op, TensorKind};
use crate::runtime::backend::{Backend, BackendError};
use crate::runtime::buffers::Buf;
use crate::runtime::comm::packed;
use crate::runtime::device::Device;
use crate::runtime::error::RuntimeError;
use std::sync::Arc;

/// Whether `PIPER_HOST_MESSAGES=1` sends every message through the host
/// (to tell a hand-over problem from another on a new device).
fn through_host() -> bool {
    static HOST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HOST.get_or_init(|| std::env::var("PIPER_HOST_MESSAGES").is_ok_and(|v| v == "1"))
}

/// Whether a message from device `from` to device `to` is handed over in
/// memory: both in this process (`ctx.devices` holds only those), on
/// backends that share their memory.
fn handed_over<B: Backend>(ctx: &StepCtx<B>, from: u32, to: u32) -> bool {
    if through_host() {
        return false;
    }
    let find = |id: u32| ctx.devices.iter().find(|d| d.id == id);
    match (find(from), find(to)) {
        (Some(a), Some(b)) => b.b.shares_memory_with(&a.b),
        _ => false,
    }
}

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
    let bytes = B::bytes(&t);
    let in_flight = dev.bufs.reserve(op, bytes)?;
    if ctx.comm.is_local(peer) {
        in_flight.keep();
    }
    if handed_over(ctx, dev.id, peer) {
        // A second message before the first was taken is refused, as the
        // comm refuses it, and the first stays.
        let mut handed = ctx.handed.lock().unwrap_or_else(|p| p.into_inner());
        match handed.entry((pair, dev.id, peer)) {
            std::collections::hash_map::Entry::Occupied(_) => {
                let twice = crate::runtime::comm::CommError::Duplicate {
                    node: pair,
                    from: dev.id,
                    to: peer,
                };
                return Err(comm_error(dev, op, twice));
            }
            std::collections::hash_map::Entry::Vacant(slot) => slot.insert(t),
        };
        drop(handed);
        ctx.comm.count_sent(dev.id, bytes);
        return ctx
            .comm
            .send(pair, dev.id, peer, Arc::new(Vec::new()))
            .map_err(|e| comm_error(dev, op, e));
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
    let t = match handed_over(ctx, peer, dev.id) {
        true => {
            // The comm's message says the tensor is there (or the wait
            // ends with the comm's error).
            let signal = ctx
                .comm
                .recv(pair, peer, dev.id, &what)
                .map_err(|e| comm_error(dev, op, e))?;
            let handed = (ctx.handed.lock().unwrap_or_else(|p| p.into_inner()))
                .remove(&(pair, peer, dev.id));
            let t = match (signal.is_empty(), handed) {
                (true, Some(t)) => t,
                _ => {
                    return Err(dev.backend_error(
                        op,
                        BackendError::Exchange(format!(
                            "{what} #{pair} from device {peer}: its message came without the tensor it hands over"
                        )),
                    ))
                }
            };
            // Held in the activation dtype, as its sender held it.
            if B::dtype(&t) != dev.act {
                return Err(dev.backend_error(
                    op,
                    BackendError::Exchange(format!(
                        "{what} #{pair} from device {peer} is {:?}, this device holds {:?}",
                        B::dtype(&t),
                        dev.act
                    )),
                ));
            }
            t
        }
        false => {
            // Sent and held in the activation dtype, as its sender held it.
            let v = packed::recv(ctx.comm, pair, (peer, dev.id), &what, dev.act)
                .map_err(|e| comm_error(dev, op, e))?;
            dev.b
                .upload_as(v, dev.act)
                .map_err(|e| dev.backend_error(op, e))?
        }
    };
    let bytes = B::bytes(&t);
    dev.bufs.put(op, kind, Buf::Tensor(t))?;
    if let Some(sender) = ctx.devices.iter().find(|d| d.id == peer) {
        sender.bufs.release(bytes);
    }
    Ok(())
}
