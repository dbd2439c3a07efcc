//! ZeRO on the runtime side: a device's gradient buckets (parameters laid
//! out flat, names sorted, of which it owns one contiguous shard), the
//! sharded AdamW step, the parameter gathers (ZeRO-3 before each use,
//! ZeRO-1/2 after the step), the shard's part of the global gradient norm,
//! and putting full tensors back together from every device's shards
//! (checkpoints, step-1 gradients).

use super::backend::cpu::adamw::adamw_update;
use super::backend::cpu::gpt::{segment_params, Tensors};
use super::buffers::Buf;
use super::device::{owned_names, Device};
use super::error::RuntimeError;
use super::ops::{comm_error, missing};
use super::step::StepCtx;
use crate::compile::plan::{CommPurpose, DevicePlan, Op, TensorKind};
use crate::model::params::expert_of;
use crate::model::{ModelConfig, Segment};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// A ZeRO gradient bucket on this device: its parameters laid out flat (names
/// sorted), of which this device owns the slice `shard`.
pub(crate) struct Bucket {
    pub(super) segments: Vec<u32>,
    pub(super) names: Vec<(String, usize)>,
    pub(super) total: usize,
    pub(super) shard: std::ops::Range<usize>,
    pub(super) zero: u8,
    /// AdamW moments of the shard.
    pub(super) m: Vec<f32>,
    pub(super) v: Vec<f32>,
    /// ZeRO-2/3: the reduced gradient of the shard, accumulated over microbatches.
    pub(super) grad: Vec<f32>,
    /// ZeRO-3: the parameter shard.
    pub(super) param: Vec<f32>,
}

impl Bucket {
    /// `(name, offset in the flat layout, length)`.
    pub(super) fn offsets(&self) -> impl Iterator<Item = (&str, usize, usize)> {
        let mut at = 0;
        self.names.iter().map(move |(n, len)| {
            let o = at;
            at += len;
            (n.as_str(), o, *len)
        })
    }
    /// Scatter `shard_data` (this device's slice) into a full-length padded vector.
    fn padded(&self, shard_data: &[f32]) -> Vec<f32> {
        let mut v = vec![0.0; self.total];
        v[self.shard.clone()].copy_from_slice(&shard_data[..self.shard.len()]);
        v
    }
    /// This device's shard of the full tensors in `t`, laid out flat.
    fn shard_of(&self, t: &Tensors) -> Vec<f32> {
        let full: Vec<f32> = self
            .names
            .iter()
            .flat_map(|(n, _)| t[n].iter().copied())
            .collect();
        full[self.shard.clone()].to_vec()
    }
    /// Does an op over `segments` cover this bucket?
    fn within(&self, segments: &[u32]) -> bool {
        self.segments.iter().all(|s| segments.contains(s))
    }
}

/// The model states a device holds whole, before ZeRO takes its share.
pub(super) struct States<'a> {
    pub params: &'a mut Tensors,
    pub grads: &'a mut Tensors,
    pub m: &'a mut Tensors,
    pub v: &'a mut Tensors,
    pub norm_names: &'a mut Vec<String>,
}

/// The buckets of a device, from its gradient reductions; sharded states
/// replace the whole ones in `states`.
pub(super) fn layout(
    cfg: &ModelConfig,
    segments: &[Segment],
    plan: &DevicePlan,
    held: &BTreeSet<u32>,
    spreads: &super::device::Spreads,
    states: States,
) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let ops = plan.streams.iter().flat_map(|s| s.ops.iter());
    for op in ops.filter(|o| o.purpose == Some(CommPurpose::GradSync) && o.zero >= 1) {
        let segs: Vec<u32> = op.segments.to_vec();
        if buckets.iter().any(|b| b.segments == segs) {
            continue;
        }
        let group = op.group.as_deref().unwrap_or(&[]);
        let n = group.len().max(1);
        let rank = group.iter().position(|d| *d == plan.device).unwrap_or(0);
        // Experts spread by `shard` live on one device each: not replicated,
        // so not sharded (ZeRO-1 with expert parallelism); their states
        // stay whole.
        let mut names: Vec<String> = segs
            .iter()
            .flat_map(|s| {
                let spread = spreads.experts.contains_key(s);
                owned_names(cfg, segments, held, spreads, *s)
                    .into_iter()
                    .filter(move |n| !spread || expert_of(n).is_none())
            })
            .collect();
        names.sort();
        names.dedup();
        let names: Vec<(String, usize)> = names
            .into_iter()
            .map(|n| {
                let l = states.params[&n].len();
                (n, l)
            })
            .collect();
        let total: usize = names.iter().map(|(_, l)| l).sum();
        let per = total.div_ceil(n);
        let shard = (rank * per).min(total)..((rank + 1) * per).min(total);
        let mut b = Bucket {
            segments: segs,
            total,
            zero: op.zero,
            m: vec![0.0; shard.len()],
            v: vec![0.0; shard.len()],
            grad: if op.zero >= 2 {
                vec![0.0; shard.len()]
            } else {
                Vec::new()
            },
            param: Vec::new(),
            shard,
            names,
        };
        // Sharded states replace the full ones.
        for (name, _) in &b.names {
            states.m.remove(name);
            states.v.remove(name);
            states.norm_names.retain(|x| x != name);
            if b.zero >= 2 {
                states.grads.remove(name);
            }
        }
        if b.zero >= 3 {
            let mut flat = Vec::with_capacity(b.total);
            for (name, _) in &b.names {
                flat.extend_from_slice(&states.params.remove(name).expect("held"));
            }
            b.param = flat[b.shard.clone()].to_vec();
        }
        buckets.push(b);
    }
    buckets
}

/// Elements of every bucket's shards (moments, gradient, parameters).
pub(super) fn shard_elems(buckets: &[Bucket]) -> u64 {
    buckets
        .iter()
        .map(|b| (b.m.len() + b.v.len() + b.grad.len() + b.param.len()) as u64)
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

/// A device's slice of a ZeRO bucket's flat layout.
#[derive(Debug)]
pub(crate) struct Shard {
    /// Tensor names and lengths in the flat layout.
    pub names: Vec<(String, usize)>,
    pub total: usize,
    /// This device's range of the layout.
    pub range: std::ops::Range<usize>,
    pub values: Vec<f32>,
}

/// Put full tensors back together from the shards of every device (the
/// first device holding a range wins; the union of a group's ranges is the
/// whole layout).
pub(crate) fn assemble(shards: impl IntoIterator<Item = Shard>, out: &mut Tensors) {
    let mut flat: HashMap<Vec<(String, usize)>, Vec<f32>> = HashMap::new();
    for s in shards {
        let full = flat.entry(s.names).or_insert_with(|| vec![0.0; s.total]);
        full[s.range.clone()].copy_from_slice(&s.values[..s.range.len()]);
    }
    for (names, full) in flat {
        let mut at = 0;
        for (n, len) in names {
            out.entry(n).or_insert_with(|| full[at..at + len].to_vec());
            at += len;
        }
    }
}

impl Device {
    /// One part of this device's ZeRO bucket shards: parameters (ZeRO-3),
    /// AdamW moments (ZeRO-1/2/3) or the last step's reduced gradients
    /// (ZeRO-2/3, when captured).
    pub(crate) fn shards(&self, part: ShardPart) -> Vec<Shard> {
        let buckets = self.buckets.lock().unwrap();
        let captured = self.captured_shards.lock().unwrap();
        buckets
            .iter()
            .enumerate()
            .filter_map(|(i, b)| {
                let values = match part {
                    ShardPart::Param if b.zero >= 3 => b.param.clone(),
                    ShardPart::M => b.m.clone(),
                    ShardPart::V => b.v.clone(),
                    ShardPart::Grad => captured.get(&i)?.clone(),
                    _ => return None,
                };
                Some(Shard {
                    names: b.names.clone(),
                    total: b.total,
                    range: b.shard.clone(),
                    values,
                })
            })
            .collect()
    }

    /// Take this device's slice of each bucket from a checkpoint's full
    /// tensors: AdamW moments for every stage, parameters for ZeRO-3.
    pub(super) fn restore_shards(
        &self,
        ck: &super::checkpoint::Checkpoint,
    ) -> Result<(), RuntimeError> {
        let mut buckets = self.buckets.lock().unwrap();
        for b in buckets.iter_mut() {
            let flat = |t: &Tensors, what: &str| -> Result<Vec<f32>, RuntimeError> {
                let mut v = Vec::with_capacity(b.total);
                for (n, len) in &b.names {
                    let x = t.get(n).filter(|x| x.len() == *len).ok_or_else(|| {
                        RuntimeError::Plan(format!(
                            "the checkpoint has no {what} `{n}` of {len} values for device {}",
                            self.id
                        ))
                    })?;
                    v.extend_from_slice(x);
                }
                Ok(v[b.shard.clone()].to_vec())
            };
            b.m = flat(&ck.m, "first moment")?;
            b.v = flat(&ck.v, "second moment")?;
            if b.zero >= 3 {
                b.param = flat(&ck.params, "parameter")?;
            }
        }
        Ok(())
    }
}

/// `total` plus Σ g² over this device's shard of every bucket, piece by
/// piece in layout order; the head's copy of the tied `wte` is counted by
/// the embedding's device only.
pub(super) fn add_shard_sq(dev: &Device, grads: &Tensors, mut total: f64) -> f64 {
    let sq = |g: &[f32]| g.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>();
    for b in dev.buckets.lock().unwrap().iter() {
        let flat: Vec<f32> = if b.zero >= 2 {
            b.grad.clone()
        } else {
            b.shard_of(grads)
        };
        for (n, at, len) in b.offsets() {
            if n == "wte" && !dev.has_embedding {
                continue;
            }
            let lo = at.max(b.shard.start);
            let hi = (at + len).min(b.shard.end);
            if lo < hi {
                total += sq(&flat[lo - b.shard.start..hi - b.shard.start]);
            }
        }
    }
    total
}

/// ZeRO-2/3: add this device's shard of a reduced microbatch gradient to
/// its bucket.
pub(super) fn accumulate_shard(dev: &Device, op: &Op, sum: &[f32]) -> Result<(), RuntimeError> {
    let mut buckets = dev.buckets.lock().unwrap();
    let b = buckets
        .iter_mut()
        .find(|b| *b.segments == *op.segments)
        .ok_or_else(|| missing(dev, op, "its ZeRO bucket"))?;
    for (acc, x) in b.grad.iter_mut().zip(&sum[b.shard.clone()]) {
        *acc += x;
    }
    Ok(())
}

/// The sharded AdamW step of every bucket the update covers: this device's
/// shard only; ZeRO-1/2 write the updated shard back into the full
/// parameters (the refresh all-gather fills in the rest).
pub(super) fn update(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    params: &mut Tensors,
    grads: &mut Tensors,
    scale: f32,
) {
    let mut buckets = dev.buckets.lock().unwrap();
    if ctx.opts.capture_grads {
        let mut cap = dev.captured_shards.lock().unwrap();
        for (i, b) in buckets.iter().enumerate() {
            if b.zero >= 2 && b.within(&op.segments) {
                cap.insert(i, b.grad.clone());
            }
        }
    }
    for b in buckets.iter_mut().filter(|b| b.within(&op.segments)) {
        let shard = b.shard.clone();
        let mut flat_p: Vec<f32> = if b.zero >= 3 {
            std::mem::take(&mut b.param)
        } else {
            b.shard_of(params)
        };
        let flat_g: Vec<f32> = if b.zero >= 2 {
            std::mem::take(&mut b.grad)
        } else {
            b.shard_of(grads)
        };
        // Per tensor piece inside the shard, for weight decay.
        let pieces: Vec<(String, usize, usize)> = b
            .offsets()
            .map(|(n, at, len)| (n.to_string(), at, len))
            .collect();
        for (n, at, len) in pieces {
            let lo = at.max(shard.start);
            let hi = (at + len).min(shard.end);
            if lo >= hi {
                continue;
            }
            let r = lo - shard.start..hi - shard.start;
            adamw_update(
                &mut flat_p[r.clone()],
                &flat_g[r.clone()],
                &mut b.m[r.clone()],
                &mut b.v[r.clone()],
                &ctx.opts.adamw,
                ctx.step,
                scale,
                dev.decay.contains(&n),
            );
        }
        if b.zero >= 3 {
            b.param = flat_p;
        } else {
            for (n, at, len) in b.offsets() {
                let lo = at.max(shard.start);
                let hi = (at + len).min(shard.end);
                if lo < hi {
                    params.get_mut(n).expect("held")[lo - at..hi - at]
                        .copy_from_slice(&flat_p[lo - shard.start..hi - shard.start]);
                }
            }
        }
        if b.zero >= 2 {
            b.grad = vec![0.0; shard.len()];
        } else {
            for (n, _) in &b.names {
                grads
                    .get_mut(n)
                    .expect("held")
                    .iter_mut()
                    .for_each(|x| *x = 0.0);
            }
        }
    }
}

/// A bucket's parameters padded to its full layout: this device's shard in
/// place, zeros elsewhere (summed over the group, that is an all-gather).
fn params_padded(b: &Bucket, params: &Tensors) -> Vec<f32> {
    if b.zero >= 3 {
        return b.padded(&b.param);
    }
    b.padded(&b.shard_of(params))
}

/// ZeRO-1/2, after the sharded step: gather every member's updated shard
/// into the full parameters.
pub(super) fn param_refresh(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    group: &[u32],
) -> Result<(), RuntimeError> {
    // Locks in the update's order (parameters, then buckets): an update of
    // another bucket may run on the compute stream meanwhile.
    let padded = {
        let params = dev.params.read().unwrap();
        let buckets = dev.buckets.lock().unwrap();
        let b = buckets
            .iter()
            .find(|b| *b.segments == *op.segments)
            .ok_or_else(|| missing(dev, op, "its ZeRO bucket"))?;
        params_padded(b, &params)
    };
    let full = all_gather_padded(dev, op, ctx, group, padded)?;
    let mut params = dev.params.write().unwrap();
    let buckets = dev.buckets.lock().unwrap();
    let b = buckets
        .iter()
        .find(|b| *b.segments == *op.segments)
        .expect("found above");
    for (n, at, len) in b.offsets() {
        params
            .get_mut(n)
            .expect("held")
            .copy_from_slice(&full[at..at + len]);
    }
    Ok(())
}

/// ZeRO-3, before a use: gather the parameters a segment reads from the
/// buckets that own them, into a buffer its compute op takes.
pub(super) fn param_gather(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    group: &[u32],
) -> Result<(), RuntimeError> {
    let seg = &ctx.segments[op.segments[0] as usize];
    let need: Vec<String> = segment_params(ctx.cfg, seg)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    // Parameters before buckets, as the update locks them.
    let params = dev.params.read().unwrap();
    let buckets = dev.buckets.lock().unwrap();
    let used: Vec<&Bucket> = buckets
        .iter()
        .filter(|b| b.names.iter().any(|(n, _)| need.contains(n)))
        .collect();
    let mut padded = Vec::new();
    for b in &used {
        padded.extend(params_padded(b, &params));
    }
    drop(params);
    let full = all_gather_padded(dev, op, ctx, group, padded)?;
    let mut out = Tensors::new();
    let mut base = 0;
    for b in &used {
        for (n, at, len) in b.offsets() {
            if need.iter().any(|x| x == n) {
                out.insert(n.to_string(), full[base + at..base + at + len].to_vec());
            }
        }
        base += b.total;
    }
    drop(buckets);
    let own = dev.params.read().unwrap();
    for n in &need {
        if !out.contains_key(n) {
            if let Some(p) = own.get(n) {
                out.insert(n.clone(), p.clone());
            }
        }
    }
    drop(own);
    dev.put(op, TensorKind::Param, Buf::Params(out))
}

/// Sum every member's zero-padded shards (an all-gather on the all-reduce
/// fabric); the contribution and the result count against the device's cap
/// while it runs.
fn all_gather_padded(
    dev: &Device,
    op: &Op,
    ctx: &StepCtx,
    group: &[u32],
    padded: Vec<f32>,
) -> Result<Arc<Vec<f32>>, RuntimeError> {
    let _staging = dev.reserve(op, padded.len() as u64 * 8)?;
    ctx.comm
        .all_reduce("all-gather", op.node, group, dev.id, padded)
        .map_err(|cause| comm_error(dev, op, cause))
}
