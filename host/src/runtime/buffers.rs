//! Transient buffers of a device: activations, saved tensors, stashes,
//! gathered parameters and per-microbatch gradients, reference-counted by
//! the plan's readers and freed at their last use. One accounting path
//! ([`Device::admit`]) counts every byte (buffers, messages in flight,
//! collective staging) against the device's cap, with sizes read from the
//! backend.

use super::backend::{Backend, BackendError, ParamMap};
use super::device::Device;
use super::error::{label, RuntimeError};
use super::model::moe::{MoeCombined, MoeExpertGrads, MoeExperts, MoeRouted};
use super::model::{SegmentCache, SegmentStash};
use crate::compile::human_bytes;
use crate::compile::plan::{Op, TensorKind};
use std::collections::HashMap;
use std::sync::Arc;

/// A buffer's contents.
pub(super) enum Buf<B: Backend> {
    Tensor(B::Tensor),
    Saved(SegmentCache<B>),
    Stash(SegmentStash<B>),
    /// ZeRO-3: a segment's gathered parameters; ZeRO-2/3: one microbatch's
    /// weight gradients.
    Params(ParamMap<B::Tensor>),
    /// ZeRO-2/3: one microbatch's tied `wte` gradient, already all-reduced
    /// across the embedding's and the head's stages; it replaces the local
    /// `wte` gradients of that microbatch.
    Tied(ParamMap<B::Tensor>),
    /// What one phase of a split expert pass hands the next.
    Moe(MoePart<B>),
}

/// The state between the phases of a split expert pass.
pub(super) enum MoePart<B: Backend> {
    /// Rows for (or from) each member of the EP group.
    Chunks(Vec<B::Tensor>),
    Routed(Box<MoeRouted<B>>),
    Experts(MoeExperts<B>),
    Combined(MoeCombined<B>),
    Grads(MoeExpertGrads<B>),
}

impl<B: Backend> Buf<B> {
    pub(super) fn bytes(&self) -> u64 {
        let each = |ts: &[B::Tensor]| ts.iter().map(|t| B::bytes(t)).sum::<u64>();
        match self {
            Buf::Tensor(t) => B::bytes(t),
            Buf::Params(t) | Buf::Tied(t) => t.iter().map(|(_, v)| B::bytes(v)).sum(),
            Buf::Saved(c) => c.bytes(),
            Buf::Stash(s) => s.bytes(),
            Buf::Moe(m) => match m {
                MoePart::Chunks(c) => each(c),
                MoePart::Routed(r) => r.bytes(),
                MoePart::Experts(e) => e.bytes(),
                MoePart::Combined(c) => c.bytes(),
                MoePart::Grads(g) => g.bytes(),
            },
        }
    }
}

/// A live buffer and how many readers it has left.
type Live<B> = (Arc<Buf<B>>, u32);

/// A device's live buffers: `(producer node, kind) → (buffer, readers left)`.
pub(super) struct Buffers<B: Backend> {
    pub(super) map: HashMap<(u32, TensorKind), Live<B>>,
    pub(super) readers: HashMap<(u32, TensorKind), u32>,
    pub(super) live: u64,
    pub(super) peak: u64,
}

impl<B: Backend> Default for Buffers<B> {
    fn default() -> Self {
        Buffers {
            map: HashMap::new(),
            readers: HashMap::new(),
            live: 0,
            peak: 0,
        }
    }
}

/// Bytes reserved on a device until dropped.
pub(crate) struct Reserved<'a, B: Backend> {
    pub(super) dev: &'a Device<B>,
    pub(super) bytes: u64,
}

impl<B: Backend> Reserved<'_, B> {
    /// Keep the bytes reserved past this guard (a message in flight, which
    /// its receiver releases).
    pub(super) fn keep(self) {
        std::mem::forget(self);
    }
}

impl<B: Backend> Drop for Reserved<'_, B> {
    fn drop(&mut self) {
        self.dev.release(self.bytes);
    }
}

impl<B: Backend> Device<B> {
    /// Account `bytes` of communication staging or an in-flight message
    /// against this device's cap before they are allocated; released when
    /// the guard drops (or by the receiver, for a message: [`Device::release`]).
    pub(super) fn reserve(&self, op: &Op, bytes: u64) -> Result<Reserved<'_, B>, RuntimeError> {
        self.admit(&mut self.bufs.lock().unwrap(), op, bytes)?;
        Ok(Reserved { dev: self, bytes })
    }

    /// The one accounting path: add `bytes` to the live total, or refuse them
    /// over the cap with the device, op and sizes named.
    pub(super) fn admit(
        &self,
        b: &mut Buffers<B>,
        op: &Op,
        bytes: u64,
    ) -> Result<(), RuntimeError> {
        if let Some(cap) = self.cap {
            if self.state_bytes + b.live + bytes > cap {
                return Err(RuntimeError::OutOfMemory {
                    device: self.id,
                    op: label(op),
                    need: human_bytes(bytes),
                    live: human_bytes(b.live),
                    cap: human_bytes(cap),
                    states: human_bytes(self.state_bytes),
                });
            }
        }
        b.live += bytes;
        b.peak = b.peak.max(b.live);
        Ok(())
    }

    /// Give back bytes reserved for a message once its receiver holds it.
    pub(super) fn release(&self, bytes: u64) {
        let mut b = self.bufs.lock().unwrap();
        b.live = b.live.saturating_sub(bytes);
    }

    /// Does anyone on this device read `op`'s output of this kind?
    pub(super) fn reads(&self, op: &Op, kind: TensorKind) -> bool {
        self.bufs
            .lock()
            .unwrap()
            .readers
            .contains_key(&(op.node, kind))
    }

    /// Store an op's output if anyone on this device reads it.
    pub(super) fn put(&self, op: &Op, kind: TensorKind, buf: Buf<B>) -> Result<(), RuntimeError> {
        let mut b = self.bufs.lock().unwrap();
        let Some(&readers) = b.readers.get(&(op.node, kind)) else {
            return Ok(());
        };
        self.admit(&mut b, op, buf.bytes())?;
        b.map.insert((op.node, kind), (Arc::new(buf), readers));
        Ok(())
    }

    /// Read every input of `op` of one kind, in input order; each buffer is
    /// freed after its last reader.
    pub(super) fn take_all(
        &self,
        op: &Op,
        kind: TensorKind,
    ) -> Result<Vec<Arc<Buf<B>>>, RuntimeError> {
        let mut b = self.bufs.lock().unwrap();
        let mut out = Vec::new();
        for input in op.inputs.iter().filter(|i| i.tensor == kind) {
            let key = (input.node, kind);
            let Some(entry) = b.map.get_mut(&key) else {
                return Err(RuntimeError::MissingInput {
                    device: self.id,
                    op: label(op),
                    input: format!("{kind:?} of #{}", input.node),
                });
            };
            entry.1 -= 1;
            let buf = entry.0.clone();
            if entry.1 == 0 {
                let bytes = buf.bytes();
                b.map.remove(&key);
                b.live -= bytes;
            }
            out.push(buf);
        }
        Ok(out)
    }

    /// Read the (first) input of `op` of one kind, if it has one.
    pub(super) fn take(
        &self,
        op: &Op,
        kind: TensorKind,
    ) -> Result<Option<Arc<Buf<B>>>, RuntimeError> {
        Ok(self.take_all(op, kind)?.into_iter().next())
    }

    /// The tensor of a taken buffer: moved out when this was its last
    /// holder, a device copy otherwise.
    pub(super) fn tensor_of(
        &self,
        op: &Op,
        buf: Option<Arc<Buf<B>>>,
    ) -> Result<Option<B::Tensor>, RuntimeError> {
        let Some(buf) = buf else { return Ok(None) };
        let t = match Arc::try_unwrap(buf) {
            Ok(Buf::Tensor(t)) => t,
            Ok(_) => return Err(self.not_a_tensor(op)),
            Err(shared) => match &*shared {
                Buf::Tensor(t) => self.b.duplicate(t).map_err(|e| self.backend_error(op, e))?,
                _ => return Err(self.not_a_tensor(op)),
            },
        };
        Ok(Some(t))
    }

    fn not_a_tensor(&self, op: &Op) -> RuntimeError {
        RuntimeError::Plan(format!(
            "device {}: {}: an input the plan says is a tensor is not one",
            self.id,
            label(op)
        ))
    }

    /// A backend failure inside `op`, with the device, the op and (for a
    /// missing parameter) its name.
    pub(super) fn backend_error(&self, op: &Op, e: BackendError) -> RuntimeError {
        match e {
            BackendError::Exchange(cause) => RuntimeError::Exchange {
                device: self.id,
                op: label(op),
                cause,
            },
            BackendError::MissingParam(id) => RuntimeError::MissingInput {
                device: self.id,
                op: label(op),
                input: format!("parameter {}", self.table.name(id)),
            },
            other => RuntimeError::Backend {
                device: self.id,
                op: label(op),
                backend: self.b.name(),
                cause: other.to_string(),
            },
        }
    }
}
