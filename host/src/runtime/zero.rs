//! ZeRO's layout of a device's states: its gradient buckets (parameters
//! laid out flat in id order, of which it owns one contiguous shard), their
//! bytes, and putting full tensors back together from every device's
//! shards (checkpoints, step-1 gradients). Shards are backend storage. The
//! ops that move them (the sharded AdamW step, the parameter gathers, the
//! gradient shards' writes, the shard's part of the norm) are in
//! `ops/zero.rs`; a device reads and restores its shards in `device.rs`.

use super::backend::{Backend, BackendError, ParamId, ParamMap};
use super::comm::even_shards;
use super::spread::{Spreads, TpPiece};
use crate::compile::plan::{CommPurpose, DevicePlan};
use crate::model::params::ParamTable;
use std::collections::{BTreeMap, HashMap};

/// Full host tensors of the three kinds of state, by id (a checkpoint's).
pub(crate) struct HostStates {
    pub params: ParamMap<Vec<f32>>,
    pub m: ParamMap<Vec<f32>>,
    pub v: ParamMap<Vec<f32>>,
}

/// A ZeRO gradient bucket on this device: its parameters laid out flat (in
/// id order), of which this device owns the slice `shard`.
pub(crate) struct Bucket<B: Backend> {
    pub(super) segments: Vec<u32>,
    pub(super) names: Vec<(ParamId, usize)>,
    pub(super) total: usize,
    pub(super) shard: std::ops::Range<usize>,
    pub(super) zero: u8,
    /// AdamW moments of the shard.
    pub(super) m: B::Tensor,
    pub(super) v: B::Tensor,
    /// ZeRO-2/3: the reduced gradient of the shard, accumulated over microbatches.
    pub(super) grad: B::Tensor,
    /// ZeRO-3: the parameter shard (in the parameters' dtype).
    pub(super) param: B::Tensor,
    /// bf16 parameters: the fp32 master weights of the shard, which the
    /// sharded step updates (sharded with the moments, as Megatron's
    /// distributed optimizer does), then rounds into the parameters.
    pub(super) master: Option<B::Tensor>,
}

impl<B: Backend> Bucket<B> {
    /// `(id, offset in the flat layout, length)`.
    pub(super) fn offsets(&self) -> impl Iterator<Item = (ParamId, usize, usize)> + '_ {
        let mut at = 0;
        self.names.iter().map(move |(n, len)| {
            let o = at;
            at += len;
            (*n, o, *len)
        })
    }
    /// The pieces of the layout inside this device's shard: `(id, its
    /// range in the tensor, its range in the shard)`.
    pub(super) fn pieces(&self) -> Vec<(ParamId, std::ops::Range<usize>, std::ops::Range<usize>)> {
        let s = &self.shard;
        self.offsets()
            .filter_map(|(n, at, len)| {
                let (lo, hi) = (at.max(s.start), (at + len).min(s.end));
                (lo < hi).then(|| (n, lo - at..hi - at, lo - s.start..hi - s.start))
            })
            .collect()
    }
    /// This device's shard of the full tensors in `t`, laid out flat (fp32).
    pub(super) fn shard_of(
        &self,
        b: &B,
        t: &ParamMap<B::Tensor>,
    ) -> Result<B::Tensor, BackendError> {
        self.shard_as(b, t, crate::model::Dtype::F32)
    }
    /// This device's shard of the full tensors in `t`, laid out flat, held
    /// in `dtype`.
    pub(super) fn shard_as(
        &self,
        b: &B,
        t: &ParamMap<B::Tensor>,
        dtype: crate::model::Dtype,
    ) -> Result<B::Tensor, BackendError> {
        let mut out = b.zeros_as(self.shard.len(), dtype)?;
        for (n, in_tensor, in_shard) in self.pieces() {
            let src = t.get(n).ok_or(BackendError::MissingParam(n))?;
            b.copy(&mut out, in_shard.start, src, in_tensor);
        }
        Ok(out)
    }
    /// Does an op over `segments` cover this bucket?
    pub(super) fn within(&self, segments: &[u32]) -> bool {
        self.segments.iter().all(|s| segments.contains(s))
    }
}

/// The model states a device holds whole, before ZeRO takes its share.
pub(super) struct States<'a, T> {
    pub params: &'a mut ParamMap<T>,
    /// fp32 master weights of bf16 parameters (empty under fp32).
    pub master: &'a mut ParamMap<T>,
    pub grads: &'a mut ParamMap<T>,
    pub m: &'a mut ParamMap<T>,
    pub v: &'a mut ParamMap<T>,
    pub norm_ids: &'a mut Vec<ParamId>,
    /// The parameters' dtype (what ZeRO-3's parameter shard holds).
    pub act: crate::model::Dtype,
    /// The gradients' dtype (what ZeRO-2/3's gradient shard holds).
    pub grad: crate::model::Dtype,
}

/// The buckets of a device, from its gradient reductions; sharded states
/// replace the whole ones in `states`.
pub(super) fn layout<B: Backend>(
    table: &ParamTable,
    b: &B,
    plan: &DevicePlan,
    owned: &BTreeMap<u32, Vec<ParamId>>,
    spreads: &Spreads,
    states: States<B::Tensor>,
) -> Result<Vec<Bucket<B>>, BackendError> {
    let mut buckets: Vec<Bucket<B>> = Vec::new();
    let ops = plan.streams.iter().flat_map(|s| s.ops.iter());
    for op in ops.filter(|o| o.purpose() == Some(CommPurpose::GradSync) && o.zero >= 1) {
        let segs: Vec<u32> = op.segments.to_vec();
        if buckets.iter().any(|b| b.segments == segs) {
            continue;
        }
        let group = op.group().map(|g| &g[..]).unwrap_or(&[]);
        let n = group.len().max(1);
        let rank = group.iter().position(|d| *d == plan.device).unwrap_or(0);
        // Experts spread by `shard` live on one device each: not replicated,
        // so not sharded (ZeRO-1 with expert parallelism); their states
        // stay whole.
        let mut ids: Vec<ParamId> = segs
            .iter()
            .flat_map(|s| {
                let spread = spreads.experts.contains_key(s);
                owned
                    .get(s)
                    .into_iter()
                    .flatten()
                    .copied()
                    .filter(move |id| !spread || table.expert_of(*id).is_none())
            })
            .collect();
        ids.sort();
        ids.dedup();
        let names = ids
            .into_iter()
            .map(|id| {
                let t = states
                    .params
                    .get(id)
                    .ok_or(BackendError::MissingParam(id))?;
                Ok((id, B::len(t)))
            })
            .collect::<Result<Vec<_>, BackendError>>()?;
        let total: usize = names.iter().map(|(_, l)| l).sum();
        let lens = even_shards(total, n);
        let at: usize = lens[..rank].iter().sum();
        let shard = at..at + lens[rank];
        let mut bucket = Bucket {
            segments: segs,
            total,
            zero: op.zero,
            m: b.zeros(shard.len())?,
            v: b.zeros(shard.len())?,
            grad: if op.zero >= 2 {
                b.zeros_as(shard.len(), states.grad)?
            } else {
                Default::default()
            },
            param: Default::default(),
            master: None,
            shard,
            names,
        };
        if bucket.zero >= 3 {
            bucket.param = bucket.shard_as(b, states.params, states.act)?;
        }
        if !states.master.is_empty() {
            bucket.master = Some(bucket.shard_of(b, states.master)?);
        }
        // Sharded states replace the full ones.
        for (id, _) in &bucket.names {
            states.master.remove(*id);
            states.m.remove(*id);
            states.v.remove(*id);
            states.norm_ids.retain(|x| x != id);
            if bucket.zero >= 2 {
                states.grads.remove(*id);
            }
            if bucket.zero >= 3 {
                states.params.remove(*id);
            }
        }
        buckets.push(bucket);
    }
    Ok(buckets)
}

/// Device bytes of every bucket's shards (moments, gradient, parameters,
/// master weights).
pub(super) fn shard_bytes<B: Backend>(buckets: &[Bucket<B>]) -> u64 {
    buckets
        .iter()
        .map(|b| {
            B::bytes(&b.m)
                + B::bytes(&b.v)
                + B::bytes(&b.grad)
                + B::bytes(&b.param)
                + b.master.as_ref().map_or(0, |w| B::bytes(w))
        })
        .sum()
}

/// What [`Device::shards`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShardPart {
    Param,
    M,
    V,
    Grad,
}

/// A device's slice of a ZeRO bucket's flat layout, on the host.
#[derive(Debug)]
pub(crate) struct Shard {
    /// Tensors and lengths in the flat layout.
    pub names: Vec<(ParamId, usize)>,
    pub total: usize,
    /// This device's range of the layout.
    pub range: std::ops::Range<usize>,
    pub values: Vec<f32>,
}

/// A bucket's shard (`values`, its layout's `b.shard`) as pieces of the
/// full tensors it covers, one shard per tensor: the part of a
/// tensor-parallel slice maps onto the ranges of the full tensor the slice
/// holds, so the pieces of every rank's buckets fit together.
pub(super) fn tensor_shards<B: Backend>(
    b: &Bucket<B>,
    values: &[f32],
    tp_pieces: &ParamMap<TpPiece>,
) -> Vec<Shard> {
    let mut out = Vec::new();
    let lens: HashMap<ParamId, usize> = b.names.iter().copied().collect();
    for (n, in_tensor, in_shard) in b.pieces() {
        let vals = &values[in_shard];
        let Some(piece) = tp_pieces.get(n) else {
            let len = lens.get(&n).copied().unwrap_or(in_tensor.end);
            out.push(Shard {
                names: vec![(n, len)],
                total: len,
                range: in_tensor,
                values: vals.to_vec(),
            });
            continue;
        };
        // The slice's values run through `piece.ranges` in order.
        let mut at = 0;
        for r in &piece.ranges {
            let (lo, hi) = (in_tensor.start.max(at), in_tensor.end.min(at + r.len()));
            if lo < hi {
                let from = lo - in_tensor.start;
                out.push(Shard {
                    names: vec![(n, piece.total)],
                    total: piece.total,
                    range: r.start + (lo - at)..r.start + (hi - at),
                    values: vals[from..from + (hi - lo)].to_vec(),
                });
            }
            at += r.len();
        }
    }
    out
}

/// Put full tensors back together from the shards of every device (the
/// first device holding a range wins; the union of a group's ranges is the
/// whole layout).
pub(crate) fn assemble(shards: impl IntoIterator<Item = Shard>, out: &mut ParamMap<Vec<f32>>) {
    let mut flat: HashMap<Vec<(ParamId, usize)>, Vec<f32>> = HashMap::new();
    for s in shards {
        let full = flat.entry(s.names).or_insert_with(|| vec![0.0; s.total]);
        full[s.range.clone()].copy_from_slice(&s.values[..s.range.len()]);
    }
    for (names, full) in flat {
        let mut at = 0;
        for (n, len) in names {
            if !out.contains(n) {
                out.insert(n, full[at..at + len].to_vec());
            }
            at += len;
        }
    }
}
