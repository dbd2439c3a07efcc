//! ZeRO on the runtime side: a device's gradient buckets (parameters laid
//! out flat in id order, of which it owns one contiguous shard), the
//! sharded AdamW step, the parameter gathers (ZeRO-3 before each use,
//! ZeRO-1/2 after the step), the shard's part of the global gradient norm,
//! and putting full tensors back together from every device's shards
//! (checkpoints, step-1 gradients). Shards are backend storage; the gathers
//! cross the host while communication does.

use super::backend::{Backend, BackendError, ParamId, ParamMap};
use super::buffers::Buf;
use super::comm::even_shards;
use super::device::{Device, Spreads};
use super::error::RuntimeError;
use super::ops::{comm_error, missing};
use super::step::StepCtx;
use crate::compile::plan::{CommPurpose, DevicePlan, Op, TensorKind};
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
    /// ZeRO-3: the parameter shard.
    pub(super) param: B::Tensor,
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
    fn pieces(&self) -> Vec<(ParamId, std::ops::Range<usize>, std::ops::Range<usize>)> {
        let s = &self.shard;
        self.offsets()
            .filter_map(|(n, at, len)| {
                let (lo, hi) = (at.max(s.start), (at + len).min(s.end));
                (lo < hi).then(|| (n, lo - at..hi - at, lo - s.start..hi - s.start))
            })
            .collect()
    }
    /// This device's shard of the full tensors in `t`, laid out flat.
    fn shard_of(&self, b: &B, t: &ParamMap<B::Tensor>) -> Result<B::Tensor, BackendError> {
        let mut out = b.zeros(self.shard.len())?;
        for (n, in_tensor, in_shard) in self.pieces() {
            let src = t.get(n).ok_or(BackendError::MissingParam(n))?;
            b.copy(&mut out, in_shard.start, src, in_tensor);
        }
        Ok(out)
    }
    /// Does an op over `segments` cover this bucket?
    fn within(&self, segments: &[u32]) -> bool {
        self.segments.iter().all(|s| segments.contains(s))
    }
}

/// The model states a device holds whole, before ZeRO takes its share.
pub(super) struct States<'a, T> {
    pub params: &'a mut ParamMap<T>,
    pub grads: &'a mut ParamMap<T>,
    pub m: &'a mut ParamMap<T>,
    pub v: &'a mut ParamMap<T>,
    pub norm_ids: &'a mut Vec<ParamId>,
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
                b.zeros(shard.len())?
            } else {
                Default::default()
            },
            param: Default::default(),
            shard,
            names,
        };
        if bucket.zero >= 3 {
            bucket.param = bucket.shard_of(b, states.params)?;
        }
        // Sharded states replace the full ones.
        for (id, _) in &bucket.names {
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

/// Device bytes of every bucket's shards (moments, gradient, parameters).
pub(super) fn shard_bytes<B: Backend>(buckets: &[Bucket<B>]) -> u64 {
    buckets
        .iter()
        .map(|b| B::bytes(&b.m) + B::bytes(&b.v) + B::bytes(&b.grad) + B::bytes(&b.param))
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
fn tensor_shards<B: Backend>(
    b: &Bucket<B>,
    values: &[f32],
    tp_pieces: &ParamMap<super::device::TpPiece>,
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

impl<B: Backend> Device<B> {
    /// One part of this device's ZeRO bucket shards: parameters (ZeRO-3),
    /// AdamW moments or the last step's reduced gradients (when captured).
    pub(crate) fn shards(&self, part: ShardPart) -> Result<Vec<Shard>, RuntimeError> {
        let buckets = self.buckets.lock().unwrap();
        let captured = self.captured_shards.lock().unwrap();
        let mut out = Vec::new();
        for (i, b) in buckets.iter().enumerate() {
            let t = match part {
                ShardPart::Param if b.zero >= 3 => &b.param,
                ShardPart::M => &b.m,
                ShardPart::V => &b.v,
                ShardPart::Grad => match captured.get(&i) {
                    Some(g) => g,
                    None => continue,
                },
                _ => continue,
            };
            let values = self
                .b
                .download(t)
                .map_err(|e| self.read_error("a ZeRO shard", e))?;
            out.extend(tensor_shards(b, &values, &self.tp_pieces));
        }
        Ok(out)
    }

    /// Take this device's slice of each bucket from a checkpoint's full
    /// tensors: AdamW moments for every stage, parameters for ZeRO-3.
    pub(super) fn restore_shards(&self, ck: &HostStates) -> Result<(), RuntimeError> {
        let mut buckets = self.buckets.lock().unwrap();
        for b in buckets.iter_mut() {
            let flat = |t: &ParamMap<Vec<f32>>, what: &str| -> Result<Vec<f32>, RuntimeError> {
                let mut v = Vec::with_capacity(b.total);
                for (n, len) in &b.names {
                    // A tensor-parallel slice is cut from the full tensor.
                    let total = self.tp_pieces.get(*n).map_or(*len, |p| p.total);
                    let x = t.get(*n).filter(|x| x.len() == total).ok_or_else(|| {
                        RuntimeError::Plan(format!(
                            "the checkpoint has no {what} `{}` of {total} values for device {}",
                            self.table.name(*n),
                            self.id
                        ))
                    })?;
                    match self.tp_pieces.get(*n) {
                        Some(p) => v.extend(p.take(x)),
                        None => v.extend_from_slice(x),
                    }
                }
                Ok(v[b.shard.clone()].to_vec())
            };
            let (m, v) = (flat(&ck.m, "first moment")?, flat(&ck.v, "second moment")?);
            self.b.write(&mut b.m, 0, &m);
            self.b.write(&mut b.v, 0, &v);
            if b.zero >= 3 {
                let p = flat(&ck.params, "parameter")?;
                self.b.write(&mut b.param, 0, &p);
            }
        }
        Ok(())
    }
}

/// Σ g² over the gradients this device counts in the global norm: the
/// whole ones (`norm_ids`, on DP replica 0), then its shard of every
/// bucket, piece by piece in layout order (the head's copy of the tied
/// `wte` is counted by the embedding's device only). One read of the
/// device.
pub(super) fn norm_sq<B: Backend>(
    dev: &Device<B>,
    grads: &ParamMap<B::Tensor>,
) -> Result<f64, BackendError> {
    let buckets = dev.buckets.lock().unwrap();
    // ZeRO-1 keeps whole gradients: its shard is cut from them.
    let cut = buckets
        .iter()
        .map(|b| match b.zero >= 2 {
            true => Ok(None),
            false => b.shard_of(&dev.b, grads).map(Some),
        })
        .collect::<Result<Vec<_>, BackendError>>()?;
    let mut pieces: Vec<(&B::Tensor, std::ops::Range<usize>)> = dev
        .norm_ids
        .iter()
        .filter_map(|id| grads.get(*id))
        .map(|g| (g, 0..B::len(g)))
        .collect();
    for (b, cut) in buckets.iter().zip(&cut) {
        // A second parameter copy's shard: its first copy counts it.
        if b.segments.iter().any(|s| dev.other_copy.contains(s)) {
            continue;
        }
        let flat = cut.as_ref().unwrap_or(&b.grad);
        // Of a tensor-parallel mesh, a tensor every rank holds whole is
        // counted by rank 0's data-parallel group only.
        // (So is what the ranks of a sequence split hold whole.)
        let tp_rank = b.segments.iter().find_map(|s| {
            (dev.spreads.tensor.get(s).map(|(_, r)| *r))
                .or_else(|| dev.spreads.sequences.get(s).map(|q| q.rank))
        });
        let whole_elsewhere = tp_rank.is_some_and(|r| r != 0);
        for (n, _, in_shard) in b.pieces() {
            if n == dev.table.wte && !dev.has_embedding {
                continue;
            }
            if whole_elsewhere && !dev.tp_pieces.contains(n) {
                continue;
            }
            pieces.push((flat, in_shard));
        }
    }
    dev.b.sum_squares(&pieces)
}

/// The bucket `op` reduces or gathers (the one over its segments), at
/// `index` in this device's buckets.
fn bucket_index<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    buckets: &[Bucket<B>],
) -> Result<usize, RuntimeError> {
    buckets
        .iter()
        .position(|b| *b.segments == *op.segments)
        .ok_or_else(|| missing(dev, op, "its ZeRO bucket"))
}

/// The bucket `op` reduces, checked to take a shard of `len` values.
fn shard_bucket<'a, B: Backend>(
    dev: &Device<B>,
    op: &Op,
    buckets: &'a mut [Bucket<B>],
    len: usize,
) -> Result<&'a mut Bucket<B>, RuntimeError> {
    let b = &mut buckets[bucket_index(dev, op, buckets)?];
    if len != b.shard.len() {
        let what = format!("a gradient shard of {} values", b.shard.len());
        return Err(missing(dev, op, &what));
    }
    Ok(b)
}

/// The chunk lengths of `op`'s bucket over `group` (one per member, in
/// group order), checked against this device's shard.
pub(super) fn member_lens<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    group: &[u32],
) -> Result<Vec<usize>, RuntimeError> {
    let buckets = dev.buckets.lock().unwrap();
    lens_of(dev, op, &buckets[bucket_index(dev, op, &buckets)?], group)
}

/// `b`'s chunks over `group`: the shards its layout gave each member.
fn lens_of<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    b: &Bucket<B>,
    group: &[u32],
) -> Result<Vec<usize>, RuntimeError> {
    let lens = even_shards(b.total, group.len());
    let pos = group.iter().position(|d| *d == dev.id);
    let start = pos.map(|p| lens[..p].iter().sum::<usize>());
    match (pos, start) {
        (Some(p), Some(at)) if at == b.shard.start && lens[p] == b.shard.len() => Ok(lens),
        _ => Err(RuntimeError::Plan(format!(
            "device {}: {}: its ZeRO shard {:?} of {} values is not its part of group {group:?}",
            dev.id,
            super::error::label(op),
            b.shard,
            b.total
        ))),
    }
}

/// ZeRO-2/3: add this device's shard of a reduced microbatch gradient to
/// its bucket.
pub(super) fn accumulate_shard<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    shard: &[f32],
) -> Result<(), RuntimeError> {
    let mut buckets = dev.buckets.lock().unwrap();
    let b = shard_bucket(dev, op, &mut buckets, shard.len())?;
    dev.b.add_host(&mut b.grad, 0, shard);
    Ok(())
}

/// ZeRO-1: put this device's shard of the reduced gradients into its whole
/// gradients. The rest of them stays this device's own, unreduced: only
/// the shard is read after this (the norm, the sharded step, a capture).
pub(super) fn write_grad_shard<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    shard: &[f32],
) -> Result<(), RuntimeError> {
    // Gradients before buckets, as the update locks them.
    let mut grads = dev.grads.lock().unwrap();
    let mut buckets = dev.buckets.lock().unwrap();
    let b = shard_bucket(dev, op, &mut buckets, shard.len())?;
    for (n, in_tensor, in_shard) in b.pieces() {
        let g = grads
            .get_mut(n)
            .ok_or_else(|| missing(dev, op, &format!("gradient {}", dev.table.name(n))))?;
        dev.b.write(g, in_tensor.start, &shard[in_shard]);
    }
    Ok(())
}

/// The sharded AdamW step of every bucket the update covers: this device's
/// shard only; ZeRO-1/2 write the updated shard back into the full
/// parameters (the refresh all-gather fills in the rest).
pub(super) fn update<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    params: &mut ParamMap<B::Tensor>,
    grads: &mut ParamMap<B::Tensor>,
    scale: f32,
) -> Result<(), BackendError> {
    let bk = &dev.b;
    let mut buckets = dev.buckets.lock().unwrap();
    if ctx.opts.capture_grads {
        let mut cap = dev.captured_shards.lock().unwrap();
        for (i, b) in buckets.iter().enumerate() {
            if b.within(&op.segments) {
                let reduced = match b.zero {
                    1 => b.shard_of(bk, grads)?,
                    _ => bk.duplicate(&b.grad)?,
                };
                cap.insert(i, reduced);
            }
        }
    }
    for b in buckets.iter_mut().filter(|b| b.within(&op.segments)) {
        let mut flat_p = if b.zero >= 3 {
            std::mem::take(&mut b.param)
        } else {
            b.shard_of(bk, params)?
        };
        let flat_g = if b.zero >= 2 {
            std::mem::take(&mut b.grad)
        } else {
            b.shard_of(bk, grads)?
        };
        // Per tensor piece inside the shard, for weight decay.
        let pieces = b.pieces();
        for (n, _, r) in &pieces {
            bk.adamw(
                &mut flat_p,
                &flat_g,
                &mut b.m,
                &mut b.v,
                r.clone(),
                &ctx.adamw,
                ctx.step,
                scale,
                dev.decay.contains(*n),
            );
        }
        if b.zero >= 3 {
            b.param = flat_p;
        } else {
            for (n, in_tensor, in_shard) in &pieces {
                let p = params.get_mut(*n).ok_or(BackendError::MissingParam(*n))?;
                bk.copy(p, in_tensor.start, &flat_p, in_shard.clone());
            }
        }
        if b.zero >= 2 {
            b.grad = bk.zeros(b.shard.len())?;
        } else {
            for (n, _) in &b.names {
                let g = grads.get_mut(*n).ok_or(BackendError::MissingParam(*n))?;
                bk.fill_zero(g);
            }
        }
    }
    Ok(())
}

/// This device's shard of a bucket's parameters: its own (ZeRO-3) or cut
/// from the full ones (ZeRO-1/2), on the host.
fn param_shard<B: Backend>(
    dev: &Device<B>,
    b: &Bucket<B>,
    params: &ParamMap<B::Tensor>,
) -> Result<Vec<f32>, BackendError> {
    match b.zero >= 3 {
        true => dev.b.download_range(&b.param, 0..b.shard.len()),
        false => dev.b.download_owned(b.shard_of(&dev.b, params)?),
    }
}

/// ZeRO-1/2, after the sharded step: gather every member's updated shard
/// into the full parameters.
pub(super) fn param_refresh<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    group: &[u32],
) -> Result<(), RuntimeError> {
    let fail = |e| dev.backend_error(op, e);
    // Locks in the update's order (parameters, then buckets): an update of
    // another bucket may run on the compute stream meanwhile.
    let (mine, lens) = {
        let params = dev.params.read().unwrap();
        let buckets = dev.buckets.lock().unwrap();
        let b = &buckets[bucket_index(dev, op, &buckets)?];
        let lens = lens_of(dev, op, b, group)?;
        (param_shard(dev, b, &params).map_err(fail)?, vec![lens])
    };
    let full = gather_shards(dev, op, ctx, group, mine, &lens)?;
    let mut params = dev.params.write().unwrap();
    let buckets = dev.buckets.lock().unwrap();
    let b = &buckets[bucket_index(dev, op, &buckets)?];
    for (n, at, len) in b.offsets() {
        let p = params
            .get_mut(n)
            .ok_or_else(|| fail(BackendError::MissingParam(n)))?;
        dev.b.write(p, 0, &full[0][at..at + len]);
    }
    Ok(())
}

/// ZeRO-3, before a use: gather the parameters a segment reads from the
/// buckets that own them, into a buffer its compute op takes.
pub(super) fn param_gather<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    group: &[u32],
) -> Result<(), RuntimeError> {
    let fail = |e| dev.backend_error(op, e);
    let seg = &ctx.segments[op.segments[0] as usize];
    let need: Vec<ParamId> = dev.table.segment(ctx.cfg, seg);
    // Parameters before buckets, as the update locks them.
    let params = dev.params.read().unwrap();
    let buckets = dev.buckets.lock().unwrap();
    let used: Vec<&Bucket<B>> = buckets
        .iter()
        .filter(|b| b.names.iter().any(|(n, _)| need.contains(n)))
        .collect();
    let mut mine = Vec::new();
    let mut lens = Vec::with_capacity(used.len());
    for b in &used {
        mine.extend(param_shard(dev, b, &params).map_err(fail)?);
        lens.push(lens_of(dev, op, b, group)?);
    }
    drop(params);
    let full = gather_shards(dev, op, ctx, group, mine, &lens)?;
    let mut out: ParamMap<B::Tensor> = ParamMap::new();
    for (b, full) in used.iter().zip(&full) {
        for (n, at, len) in b.offsets() {
            if need.contains(&n) {
                let t = dev.b.upload(full[at..at + len].to_vec()).map_err(fail)?;
                out.insert(n, t);
            }
        }
    }
    drop(buckets);
    let own = dev.params.read().unwrap();
    for n in &need {
        if !out.contains(*n) {
            if let Some(p) = own.get(*n) {
                out.insert(*n, dev.b.duplicate(p).map_err(fail)?);
            }
        }
    }
    drop(own);
    dev.put(op, TensorKind::Param, Buf::Params(out))
}

/// All-gather the shards of several buckets at once: `mine` is this
/// device's shard of each, one after the other, `lens[i]` bucket i's
/// shard lengths over the group; returns each bucket's full layout. The
/// contribution and the result count against the device's cap while it
/// runs.
fn gather_shards<B: Backend>(
    dev: &Device<B>,
    op: &Op,
    ctx: &StepCtx<B>,
    group: &[u32],
    mine: Vec<f32>,
    lens: &[Vec<usize>],
) -> Result<Vec<Vec<f32>>, RuntimeError> {
    let totals: Vec<usize> = lens.iter().map(|l| l.iter().sum()).collect();
    let whole: usize = totals.iter().sum();
    let _staging = dev.reserve(op, (mine.len() + whole) as u64 * 4)?;
    let got = ctx
        .comm
        .all_gather(op.kind().as_str(), op.node, group, dev.id, mine)
        .map_err(|cause| comm_error(dev, op, cause))?;
    if got.len() != whole {
        return Err(missing(
            dev,
            op,
            &format!("{whole} gathered parameter values (got {})", got.len()),
        ));
    }
    // Member r's block holds its shard of every bucket in turn.
    let mut full: Vec<Vec<f32>> = totals.iter().map(|t| Vec::with_capacity(*t)).collect();
    let mut at = 0;
    for r in 0..group.len() {
        for (f, l) in full.iter_mut().zip(lens) {
            f.extend_from_slice(&got[at..at + l[r]]);
            at += l[r];
        }
    }
    Ok(full)
}
