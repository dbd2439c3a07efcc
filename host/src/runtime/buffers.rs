//! Transient buffers of a device: activations, saved tensors, stashes,
//! gathered parameters and per-microbatch gradients, reference-counted by
//! the plan's readers and freed at their last use. One accounting path
//! ([`Device::admit`]) counts every byte (buffers, messages in flight,
//! collective staging) against the device's cap.

use super::backend::cpu::gpt::{SegmentCache, SegmentStash, Tensors};
use super::backend::cpu::moe::{MoeCombined, MoeExpertGrads, MoeExperts, MoeRouted};
use super::device::Device;
use super::error::{label, RuntimeError};
use crate::compile::human_bytes;
use crate::compile::plan::{Op, TensorKind};
use std::collections::HashMap;
use std::sync::Arc;

/// A buffer's contents.
pub(super) enum Buf {
    Vec(Arc<Vec<f32>>),
    Saved(SegmentCache),
    Stash(SegmentStash),
    /// ZeRO-3: a segment's gathered parameters; ZeRO-2/3: one microbatch's
    /// weight gradients.
    Params(Tensors),
    /// ZeRO-2/3: one microbatch's tied `wte` gradient, already all-reduced
    /// across the embedding's and the head's stages; it replaces the local
    /// `wte` gradients of that microbatch.
    Tied(Tensors),
    /// What one phase of a split expert pass hands the next.
    Moe(MoePart),
}

/// The state between the phases of a split expert pass.
pub(super) enum MoePart {
    /// Rows for (or from) each member of the EP group.
    Chunks(Vec<Arc<Vec<f32>>>),
    Routed(Box<MoeRouted>),
    Experts(MoeExperts),
    Combined(MoeCombined),
    Grads(MoeExpertGrads),
}

impl Buf {
    pub(super) fn bytes(&self) -> u64 {
        match self {
            Buf::Vec(v) => v.len() as u64 * 4,
            Buf::Params(t) | Buf::Tied(t) => t.values().map(|v| v.len() as u64 * 4).sum(),
            Buf::Saved(c) => c.bytes(),
            Buf::Stash(s) => s.bytes(),
            Buf::Moe(m) => match m {
                MoePart::Chunks(c) => c.iter().map(|v| v.len() as u64 * 4).sum(),
                MoePart::Routed(r) => r.bytes(),
                MoePart::Experts(e) => e.bytes(),
                MoePart::Combined(c) => c.bytes(),
                MoePart::Grads(g) => g.bytes(),
            },
        }
    }
}

/// A device's live buffers: `(producer node, kind) → (buffer, readers left)`.
#[derive(Default)]
pub(super) struct Buffers {
    pub(super) map: HashMap<(u32, TensorKind), (Arc<Buf>, u32)>,
    pub(super) readers: HashMap<(u32, TensorKind), u32>,
    pub(super) live: u64,
    pub(super) peak: u64,
}

/// Bytes reserved on a device until dropped.
pub(crate) struct Reserved<'a> {
    pub(super) dev: &'a Device,
    pub(super) bytes: u64,
}

impl Reserved<'_> {
    /// Keep the bytes reserved past this guard (a message in flight, which
    /// its receiver releases).
    pub(super) fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.dev.release(self.bytes);
    }
}

impl Device {
    /// Account `bytes` of communication staging or an in-flight message
    /// against this device's cap before they are allocated; released when
    /// the guard drops (or by the receiver, for a message: [`Device::release`]).
    pub(super) fn reserve(&self, op: &Op, bytes: u64) -> Result<Reserved<'_>, RuntimeError> {
        self.admit(&mut self.bufs.lock().unwrap(), op, bytes)?;
        Ok(Reserved { dev: self, bytes })
    }

    /// The one accounting path: add `bytes` to the live total, or refuse them
    /// over the cap with the device, op and sizes named.
    pub(super) fn admit(&self, b: &mut Buffers, op: &Op, bytes: u64) -> Result<(), RuntimeError> {
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

    /// Store an op's output if anyone on this device reads it.
    pub(super) fn put(&self, op: &Op, kind: TensorKind, buf: Buf) -> Result<(), RuntimeError> {
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
    ) -> Result<Vec<Arc<Buf>>, RuntimeError> {
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
    pub(super) fn take(&self, op: &Op, kind: TensorKind) -> Result<Option<Arc<Buf>>, RuntimeError> {
        Ok(self.take_all(op, kind)?.into_iter().next())
    }
}

/// The tensor of a buffer (a copy), if any.
pub(super) fn vec_of(buf: Option<Arc<Buf>>) -> Option<Vec<f32>> {
    buf.map(|b| match &*b {
        Buf::Vec(v) => (**v).clone(),
        _ => panic!("expected a tensor buffer"),
    })
}
