//! Where a device's segments are spread (experts by `shard`, tensors by
//! `shard-tensor`, sequences over a tensor-parallel mesh) and so which
//! parameters, and which parts of them, it holds: what its states, its ZeRO
//! layout and its ops all read.

use super::backend::ParamId;
use crate::model::params::{tp_ranges, ParamTable, TpSplit};
use crate::model::{ModelConfig, Segment};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub(super) use crate::runtime::model::moe::ExpertGroup;

/// Expert segments whose experts `shard` spread, with this device's place
/// in each one's group.
pub(super) type ExpertGroups = BTreeMap<u32, ExpertGroup>;

/// Segments `shard-tensor` split, with (group size, this device's rank).
pub(super) type TensorGroups = BTreeMap<u32, (usize, usize)>;

/// Expert segments on a tensor-parallel mesh: each rank of a
/// tensor-parallel group runs the `rank`-th of `tp` shares of its replica's
/// sequences, the group gathering outputs and summing replicated gradients.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct SequenceSplit {
    pub(super) tp: usize,
    pub(super) rank: usize,
    /// The tensor-parallel group, in rank order.
    pub(super) members: Arc<[u32]>,
}

impl SequenceSplit {
    /// This rank's rows of `n` rows (whole sequences, as `n` divides).
    pub(super) fn share(&self, n: usize) -> std::ops::Range<usize> {
        let per = n / self.tp.max(1);
        self.rank * per..(self.rank + 1) * per
    }
}

/// How a segment's parameters are spread over this device's groups.
#[derive(Default)]
pub(super) struct Spreads {
    pub(super) experts: ExpertGroups,
    pub(super) tensor: TensorGroups,
    pub(super) sequences: BTreeMap<u32, SequenceSplit>,
    /// Segments of `tensor` under sequence parallelism (`sequence-parallel`).
    pub(super) sequence_parallel: BTreeSet<u32>,
}

/// This device's part of a tensor split by tensor parallelism: the ranges
/// of the full (row-major) tensor it holds, in order.
#[derive(Clone, Debug)]
pub(crate) struct TpPiece {
    pub(crate) total: usize,
    pub(crate) ranges: Vec<std::ops::Range<usize>>,
}

impl TpPiece {
    /// This device's values of the full tensor `full`.
    pub(crate) fn take(&self, full: &[f32]) -> Vec<f32> {
        self.ranges
            .iter()
            .flat_map(|r| full[r.clone()].iter().copied())
            .collect()
    }
}

/// A parameter as this device holds it: id, full shape, and for a
/// tensor-parallel split its part of the full tensor.
pub(super) struct ParamHere {
    pub(super) id: ParamId,
    pub(super) piece: Option<TpPiece>,
}

/// A segment's parameters on this device: of experts spread by `shard`,
/// only this device's; of a segment split by `shard-tensor`, this device's
/// slices.
pub(super) fn params_here(
    cfg: &ModelConfig,
    table: &ParamTable,
    seg: &Segment,
    spreads: &Spreads,
) -> Vec<ParamHere> {
    let mut all = table.segment(cfg, seg);
    if let (Some(g), Some(moe)) = (spreads.experts.get(&seg.index), &cfg.moe) {
        let local = g.local(moe.experts as usize);
        all.retain(|id| {
            table
                .expert_of(*id)
                .is_none_or(|e| local.contains(&(e as usize)))
        });
    }
    let tp = spreads.tensor.get(&seg.index).copied();
    all.into_iter()
        .map(|id| {
            let entry = table.entry(id);
            let split = tp.map(|_| entry.tp_split()).unwrap_or(TpSplit::Replicated);
            let piece = match (tp, split) {
                (Some((t, r)), split) if split != TpSplit::Replicated => {
                    let (ranges, _) = tp_ranges(&entry.shape, split, t, r);
                    Some(TpPiece {
                        total: entry.numel(),
                        ranges,
                    })
                }
                _ => None,
            };
            ParamHere { id, piece }
        })
        .collect()
}

/// The parameters segment `s` owns on a device holding `held`: the tied
/// `wte` belongs to the embedding when both ends are here; of spread
/// experts, only this device's.
pub(super) fn owned_ids(
    cfg: &ModelConfig,
    table: &ParamTable,
    segments: &[Segment],
    held: &BTreeSet<u32>,
    spreads: &Spreads,
    s: u32,
) -> Vec<ParamId> {
    let seg = &segments[s as usize];
    let emb_here = held.iter().any(|h| segments[*h as usize].has_embedding());
    params_here(cfg, table, seg, spreads)
        .into_iter()
        .map(|p| p.id)
        .filter(|id| !(*id == table.wte && !seg.has_embedding() && emb_here))
        .collect()
}
