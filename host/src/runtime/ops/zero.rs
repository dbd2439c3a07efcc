//! ZeRO's ops: the sharded AdamW step, the parameter gathers (ZeRO-3
//! before each use, ZeRO-1/2 after the step), each member's share of a
//! gradient reduce-scatter written into its bucket, and the shard's part of
//! the global gradient norm. The gathers cross the host while communication
//! does. The layout they work on is `runtime/zero.rs`.

use super::{comm_error, missing, StepCtx};
use crate::compile::plan::{Op, TensorKind};
use crate::runtime::backend::{Backend, BackendError, ParamId, ParamMap};
use crate::runtime::buffers::Buf;
use crate::runtime::comm::{even_shards, packed};
use crate::runtime::device::Device;
use crate::runtime::error::RuntimeError;
use crate::runtime::zero::Bucket;

/// Σ g² over the gradients this device counts in the global norm: the
/// whole ones (`norm_ids`, on DP replica 0), then its shard of every
/// bucket, piece by piece in layout order (the head's copy of the tied
/// `wte` is counted by the embedding's device only). One read of the
/// device.
pub(super) fn norm_sq<B: Backend>(
    dev: &Device<B>,
    grads: &ParamMap<B::Tensor>,
) -> Result<f64, BackendError> {
    let buckets = dev.states.buckets();
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
    let buckets = dev.states.buckets();
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
            crate::runtime::error::label(op),
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
    let mut buckets = dev.states.buckets();
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
    let mut grads = dev.states.grads();
    let mut buckets = dev.states.buckets();
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
    let mut buckets = dev.states.buckets();
    if ctx.opts.capture_grads {
        let mut cap = dev.states.captured_shards();
        for (i, b) in buckets.iter().enumerate() {
            if b.within(&op.segments) {
                let reduced = match b.zero {
                    1 => b.shard_as(bk, grads, dev.grad)?,
                    _ => bk.duplicate(&b.grad)?,
                };
                cap.insert(i, reduced);
            }
        }
    }
    for b in buckets.iter_mut().filter(|b| b.within(&op.segments)) {
        // The values the step updates: the fp32 master shard of bf16
        // parameters, else the parameters' own shard.
        let master = b.master.is_some();
        let mut flat_p = match (b.master.take(), b.zero >= 3) {
            (Some(w), _) => w,
            (None, true) => std::mem::take(&mut b.param),
            (None, false) => b.shard_of(bk, params)?,
        };
        let flat_g = if b.zero >= 2 {
            std::mem::take(&mut b.grad)
        } else {
            b.shard_as(bk, grads, dev.grad)?
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
        // The parameters the kernels read take the step (rounded into bf16
        // from a master shard).
        if b.zero >= 3 {
            match master {
                false => b.param = flat_p,
                true => {
                    bk.copy(&mut b.param, 0, &flat_p, 0..b.shard.len());
                    b.master = Some(flat_p);
                }
            }
        } else {
            for (n, in_tensor, in_shard) in &pieces {
                let p = params.get_mut(*n).ok_or(BackendError::MissingParam(*n))?;
                bk.copy(p, in_tensor.start, &flat_p, in_shard.clone());
            }
            if master {
                b.master = Some(flat_p);
            }
        }
        if b.zero >= 2 {
            b.grad = bk.zeros_as(b.shard.len(), dev.grad)?;
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
        let params = dev.states.params();
        let buckets = dev.states.buckets();
        let b = &buckets[bucket_index(dev, op, &buckets)?];
        let lens = lens_of(dev, op, b, group)?;
        (param_shard(dev, b, &params).map_err(fail)?, vec![lens])
    };
    let full = gather_shards(dev, op, ctx, group, mine, &lens)?;
    let mut params = dev.states.params_mut();
    let buckets = dev.states.buckets();
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
    let params = dev.states.params();
    let buckets = dev.states.buckets();
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
                let values = full[at..at + len].to_vec();
                let t = dev.b.upload_as(values, dev.act).map_err(fail)?;
                out.insert(n, t);
            }
        }
    }
    drop(buckets);
    let own = dev.states.params();
    for n in &need {
        if !out.contains(*n) {
            if let Some(p) = own.get(*n) {
                out.insert(*n, dev.b.duplicate(p).map_err(fail)?);
            }
        }
    }
    drop(own);
    dev.bufs.put(op, TensorKind::Param, Buf::Params(out))
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
    let _staging = dev
        .bufs
        .reserve(op, (mine.len() + whole) as u64 * dev.act.bytes())?;
    // Member r's part: its shard of every bucket, in the parameter dtype.
    let member_lens: Vec<usize> = (0..group.len())
        .map(|r| lens.iter().map(|l| l[r]).sum())
        .collect();
    let got = packed::all_gather(
        ctx.comm,
        (op.kind().as_str(), op.node),
        group,
        dev.id,
        mine,
        &member_lens,
        dev.act,
    )
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
