//! Transient buffers of a device: activations, saved tensors, stashes,
//! gathered parameters and per-microbatch gradients, reference-counted by
//! the plan's readers and freed at their last use. One accounting path
//! (`Buffers::admit`) counts every byte (buffers, messages in flight,
//! collective staging) against the device's cap, with sizes read from the
//! backend.

use super::backend::{Backend, ParamMap};
use super::error::{label, RuntimeError};
use super::model::moe::{MoeCombined, MoeExpertGrads, MoeExperts, MoeRouted};
use super::model::{SegmentCache, SegmentStash};
use crate::compile::human_bytes;
use crate::compile::plan::{DevicePlan, Op, TensorKind};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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
type Entry<B> = (Arc<Buf<B>>, u32);

/// What is live now: `(producer node, kind) → (buffer, readers left)`, the
/// readers each output has on this device, and the bytes held.
struct Live<B: Backend> {
    map: HashMap<(u32, TensorKind), Entry<B>>,
    readers: HashMap<(u32, TensorKind), u32>,
    bytes: u64,
    peak: u64,
}

/// A device's transient buffers and the one accounting path for every
/// byte beside its model states.
pub(super) struct Buffers<B: Backend> {
    device: u32,
    /// The device's memory cap, if any.
    cap: Option<u64>,
    /// Model-state bytes resident beside the buffers (under the cap too).
    states: u64,
    live: Mutex<Live<B>>,
}

/// Bytes reserved on a device until dropped.
pub(crate) struct Reserved<'a, B: Backend> {
    bufs: &'a Buffers<B>,
    bytes: u64,
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
        self.bufs.release(self.bytes);
    }
}

impl<B: Backend> Buffers<B> {
    pub(super) fn new(device: u32, cap: Option<u64>, states: u64) -> Self {
        Buffers {
            device,
            cap,
            states,
            live: Mutex::new(Live {
                map: HashMap::new(),
                readers: HashMap::new(),
                bytes: 0,
                peak: 0,
            }),
        }
    }

    /// Model-state bytes beside the buffers.
    pub(super) fn states(&self) -> u64 {
        self.states
    }

    /// The most bytes held at once since the step began.
    pub(super) fn peak(&self) -> u64 {
        self.live.lock().unwrap().peak
    }

    /// Before a step: nothing held, each output's readers counted from
    /// `plan`.
    pub(super) fn reset(&self, plan: &DevicePlan) {
        let mut b = self.live.lock().unwrap();
        b.map.clear();
        b.readers.clear();
        b.bytes = 0;
        b.peak = 0;
        for op in plan.streams.iter().flat_map(|s| s.ops.iter()) {
            for i in op.inputs.iter() {
                *b.readers.entry((i.node, i.tensor)).or_insert(0) += 1;
            }
        }
    }

    /// Account `bytes` of communication staging or an in-flight message
    /// against the cap before they are allocated; released when the guard
    /// drops (or by the receiver, for a message: [`Buffers::release`]).
    pub(super) fn reserve(&self, op: &Op, bytes: u64) -> Result<Reserved<'_, B>, RuntimeError> {
        self.admit(&mut self.live.lock().unwrap(), op, bytes)?;
        Ok(Reserved { bufs: self, bytes })
    }

    /// The one accounting path: add `bytes` to the live total, or refuse them
    /// over the cap with the device, op and sizes named.
    fn admit(&self, b: &mut Live<B>, op: &Op, bytes: u64) -> Result<(), RuntimeError> {
        if let Some(cap) = self.cap {
            if self.states + b.bytes + bytes > cap {
                return Err(RuntimeError::OutOfMemory {
                    device: self.device,
                    op: label(op),
                    need: human_bytes(bytes),
                    live: human_bytes(b.bytes),
                    cap: human_bytes(cap),
                    states: human_bytes(self.states),
                });
            }
        }
        b.bytes += bytes;
        b.peak = b.peak.max(b.bytes);
        Ok(())
    }

    /// Give back bytes reserved for a message once its receiver holds it.
    pub(super) fn release(&self, bytes: u64) {
        let mut b = self.live.lock().unwrap();
        b.bytes = b.bytes.saturating_sub(bytes);
    }

    /// Does anyone on this device read `op`'s output of this kind?
    pub(super) fn reads(&self, op: &Op, kind: TensorKind) -> bool {
        (self.live.lock().unwrap().readers).contains_key(&(op.node, kind))
    }

    /// Store an op's output if anyone on this device reads it.
    pub(super) fn put(&self, op: &Op, kind: TensorKind, buf: Buf<B>) -> Result<(), RuntimeError> {
        let mut b = self.live.lock().unwrap();
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
        let mut b = self.live.lock().unwrap();
        let mut out = Vec::new();
        for input in op.inputs.iter().filter(|i| i.tensor == kind) {
            let key = (input.node, kind);
            let Some(entry) = b.map.get_mut(&key) else {
                return Err(RuntimeError::MissingInput {
                    device: self.device,
                    op: label(op),
                    input: format!("{kind:?} of #{}", input.node),
                });
            };
            entry.1 -= 1;
            let buf = entry.0.clone();
            if entry.1 == 0 {
                let bytes = buf.bytes();
                b.map.remove(&key);
                b.bytes -= bytes;
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
}
