//! Pipeline layout shared by the pipeline strategies: which devices each stage
//! runs on and which `PP` regions it holds.
//!
//! A pipeline has `positions` device groups (pipeline ranks) and `stages`
//! model stages; each stage sits on one position. Plain schedules (GPipe,
//! 1F1B, ZB-H1) put stage `s` on position `s`; Megatron's interleaved
//! schedule puts stage `s` on position `s mod p`; DualPipeV folds the stages
//! into a V (stage `s` and `2p − 1 − s` on position `s`).
//!
//! A pipeline composes with data and tensor parallelism applied before it:
//! if every forward already sits on one device group `G`, position `q` runs
//! on `G + q·k`, `k` the smallest shift that keeps the positions apart
//! (`dp:degree=2` on 8 devices put the model on `[0, 4]`: position q on
//! `[q, 4 + q]`; `tp:tp=2` then `dp:degree=2` on `[0, 1, 4, 5]`: position q
//! on `[2q, 2q + 1, 4 + 2q, 5 + 2q]`), so each stage keeps `G`'s replicas and
//! tensor-parallel groups (the mesh of [`crate::mesh`]). Otherwise the
//! pipeline starts from device 0.

use crate::{Dag, Error, Filter, Pass};

/// How a pipeline's stages sit on its positions (pipeline ranks), and what
/// its `stages` option counts.
#[derive(Clone, Copy, Debug)]
pub enum Layout {
    /// Stage `s` on position `s` (GPipe, 1F1B, ZB-H1, DualPipe). `stages`
    /// counts positions; microbatches default to 2 × stages.
    Plain,
    /// Megatron's interleaved schedule: `virtual` stages per position, stage
    /// `s` on position `s mod p`. `stages` counts positions (Megatron's
    /// pipeline size); microbatches default to 2 × positions.
    Interleaved { virtual_stages: u32 },
    /// DualPipeV's V: two stages per position, stage `s < p` on position
    /// `s`, stage `s ≥ p` on `2p − 1 − s`. `stages` counts stages (even);
    /// microbatches default to 2 × stages.
    V,
    /// Any other fold: `per_position` stages on each position, stage `s` on
    /// `position_of(s, positions)`. `stages` counts positions; microbatches
    /// default to 2 × stages.
    Fold {
        per_position: u32,
        position_of: fn(u32, u32) -> u32,
    },
}

/// Stages, their device groups and their regions, and the microbatches the
/// batch is split into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// Device group of each stage (stages sharing a position share a group).
    pub groups: Vec<Vec<u32>>,
    /// `PP` regions of each stage, contiguous and in order.
    pub regions: Vec<Vec<u32>>,
    /// Position (pipeline rank) of each stage.
    pub position: Vec<u32>,
    /// Microbatches per step (the `microbatches` option, at least 1).
    pub microbatches: u32,
}

/// The smallest shift `k ≥ 1` for which `positions` copies of `base`, the
/// `q`-th shifted by `q·k`, stay on `devices` and share no device.
fn position_step(base: &[u32], positions: u32, devices: u32) -> Option<u32> {
    let mut taken = vec![false; devices as usize];
    for k in 1..=devices {
        taken.iter_mut().for_each(|t| *t = false);
        let fits = (0..positions).all(|q| {
            base.iter().all(|&g| {
                let d = u64::from(g) + u64::from(q) * u64::from(k);
                match usize::try_from(d).ok().filter(|d| *d < taken.len()) {
                    Some(d) if !taken[d] => {
                        taken[d] = true;
                        true
                    }
                    _ => false,
                }
            })
        });
        if fits {
            return Some(k);
        }
        if positions <= 1 {
            return None;
        }
    }
    None
}

impl Pipeline {
    /// A pipeline strategy's layout, from its options: `layout`'s stages over
    /// the positions the `stages` option asks for (default: devices ÷
    /// data-parallel degree), regions cut evenly or at the `boundaries`
    /// option, and the `microbatches` option (default as `layout` says).
    /// Changes nothing in the DAG; [`Pipeline::split_place`] does. `who`
    /// names the strategy in error messages.
    pub fn new(
        dag: &mut dyn Dag,
        options: &crate::Options,
        layout: Layout,
        who: &str,
    ) -> Result<Self, Error> {
        let stages = options.u32("stages")?;
        let (positions, per_position, position_of): (_, _, fn(u32, u32) -> u32) = match layout {
            Layout::Plain => (stages, 1, |s, _| s),
            Layout::Interleaved { virtual_stages: 0 } => {
                return Err(Error::msg(format!(
                    "{who} needs virtual ≥ 1 model chunk per device, got 0"
                )))
            }
            Layout::Interleaved { virtual_stages } => (stages, virtual_stages, |s, p| s % p),
            Layout::V => {
                if let Some(s) = stages.filter(|s| *s == 0 || s % 2 == 1) {
                    return Err(Error::msg(format!(
                        "{who} needs an even number of stages (2 per device): got {s}"
                    )));
                }
                let v = |s, p| if s < p { s } else { 2 * p - 1 - s };
                (stages.map(|s| s / 2), 2, v)
            }
            Layout::Fold {
                per_position: 0, ..
            } => {
                return Err(Error::msg(format!(
                    "{who} needs at least 1 stage per pipeline position, got 0"
                )))
            }
            Layout::Fold {
                per_position,
                position_of,
            } => (stages, per_position, position_of),
        };
        let mut pipe = Self::lay_out(dag, positions, per_position, position_of, who)?;
        if let Some(text) = options.str("boundaries")? {
            let firsts = parse_boundaries(text, who)?;
            pipe.cut_at(&firsts, who)?;
        }
        let default = match layout {
            Layout::Interleaved { .. } => 2 * pipe.positions(),
            _ => 2 * pipe.stages(),
        };
        pipe.microbatches = options.u32("microbatches")?.unwrap_or(default);
        if pipe.microbatches == 0 {
            return Err(Error::msg(format!(
                "{who} needs at least 1 microbatch, got 0"
            )));
        }
        Ok(pipe)
    }

    /// `positions` pipeline ranks (default: devices ÷ data-parallel degree),
    /// each holding `per_position` stages; stage `s` of `positions ×
    /// per_position` sits on position `position_of(s, positions)`.
    fn lay_out(
        dag: &mut dyn Dag,
        positions: Option<u32>,
        per_position: u32,
        position_of: fn(u32, u32) -> u32,
        who: &str,
    ) -> Result<Self, Error> {
        let devices = dag.cluster().devices;
        let n_regions = dag.tag_extents().get("PP").copied().unwrap_or(0);
        if n_regions == 0 {
            return Err(Error::msg(format!(
                "{who} needs a model annotated with PP regions"
            )));
        }
        // The group a previous strategy (dp, zero, tp) put the model on, if any.
        let forwards = dag.query(&Filter::all().pass(Pass::F))?;
        let first = forwards[0].devices.clone();
        if let Some(other) = forwards.iter().find(|n| n.devices != first) {
            return Err(Error::msg(format!(
                "{who} needs the whole model on one device group before it runs: found forwards on {:?} and {:?}",
                first, other.devices
            )));
        }
        let base: Vec<u32> = if first.is_empty() { vec![0] } else { first };
        let dp = base.len() as u32;
        let positions = positions.unwrap_or(devices / dp);
        if positions == 0 {
            return Err(Error::msg(format!(
                "{who} needs at least 1 pipeline position, got 0"
            )));
        }
        let Some(stages) = positions.checked_mul(per_position) else {
            return Err(Error::msg(format!(
                "{who} needs stages ≤ PP regions: got {positions} positions × {per_position} stages each for {n_regions} regions"
            )));
        };
        if stages > n_regions {
            return Err(Error::msg(format!(
                "{who} needs stages ≤ PP regions: got {stages} stages for {n_regions} regions"
            )));
        }
        if u64::from(positions) * u64::from(dp) > u64::from(devices) {
            return Err(Error::msg(format!(
                "{who} needs pipeline devices × the group before it ≤ devices: {positions} × {dp} > {devices}"
            )));
        }
        let Some(step) = position_step(&base, positions, devices) else {
            return Err(Error::msg(format!(
                "{who}: the group {base:?} the model is on leaves no room for {positions} pipeline positions on {devices} devices (position q runs on the group shifted by q·k, no k keeps them apart)"
            )));
        };
        let position_groups: Vec<Vec<u32>> = (0..positions)
            .map(|q| base.iter().map(|g| g + q * step).collect())
            .collect();
        let position: Vec<u32> = (0..stages).map(|s| position_of(s, positions)).collect();
        if let Some((s, q)) = position.iter().enumerate().find(|(_, q)| **q >= positions) {
            return Err(Error::msg(format!(
                "{who}: stage {s} is laid out on pipeline position {q}, but there are only {positions} positions"
            )));
        }
        let groups = position
            .iter()
            .map(|q| position_groups[*q as usize].clone())
            .collect();
        // Regions as evenly as possible, earlier stages taking the remainder.
        let (per, extra) = (n_regions / stages, n_regions % stages);
        let mut regions = Vec::new();
        let mut next = 0;
        for s in 0..stages {
            let take = per + u32::from(s < extra);
            regions.push((next..next + take).collect());
            next += take;
        }
        Ok(Pipeline {
            groups,
            regions,
            position,
            microbatches: 1,
        })
    }

    /// Cut the stages so stage `s` starts at region `firsts[s]` and runs to
    /// the next stage's first (the last stage to the last region): one
    /// first region per stage, the first 0, strictly increasing.
    pub fn cut_at(&mut self, firsts: &[u32], who: &str) -> Result<(), Error> {
        let stages = self.regions.len();
        let n_regions = self.regions.iter().flatten().max().map_or(0, |r| r + 1);
        if firsts.len() != stages {
            return Err(Error::msg(format!(
                "{who}: boundaries name {} stages' first regions, the pipeline has {stages} stages",
                firsts.len()
            )));
        }
        if firsts.first() != Some(&0) {
            return Err(Error::msg(format!(
                "{who}: boundaries must start at region 0 (the first stage's first region), got {firsts:?}"
            )));
        }
        if let Some(w) = firsts.windows(2).find(|w| w[1] <= w[0]) {
            return Err(Error::msg(format!(
                "{who}: boundaries must increase (every stage holds at least one region): {} follows {} in {firsts:?}",
                w[1], w[0]
            )));
        }
        if let Some(last) = firsts.last().filter(|l| **l >= n_regions) {
            return Err(Error::msg(format!(
                "{who}: boundary {last} is past the model's last PP region ({} regions, 0 to {})",
                n_regions,
                n_regions.saturating_sub(1)
            )));
        }
        self.regions = (0..stages)
            .map(|s| {
                let end = firsts.get(s + 1).copied().unwrap_or(n_regions);
                (firsts[s]..end).collect()
            })
            .collect();
        Ok(())
    }

    /// Split the batch into the pipeline's microbatches and place every
    /// stage on its group, transfers on the `stream` option (default `pp`).
    pub fn split_place(&self, dag: &mut dyn Dag, options: &crate::Options) -> Result<(), Error> {
        dag.split(&Filter::all(), "MB", self.microbatches)?;
        self.place(dag, options.str("stream")?.unwrap_or("pp"))
    }

    pub fn stages(&self) -> u32 {
        self.groups.len() as u32
    }

    /// Number of pipeline positions (device groups).
    pub fn positions(&self) -> u32 {
        self.position.iter().max().map_or(0, |m| m + 1)
    }

    /// Place every stage's regions on its group, transfers on `stream`.
    pub fn place(&self, dag: &mut dyn Dag, stream: &str) -> Result<(), Error> {
        for (group, regions) in self.groups.iter().zip(&self.regions) {
            for r in regions {
                dag.place(&Filter::tag("PP", *r), group, stream)?;
            }
        }
        Ok(())
    }

    /// One order group: `pass` of microbatch `mb` over stage `s`'s regions
    /// (forward regions in order; backward ones too — the DAG's edges fix
    /// the direction within a group).
    pub fn step(&self, s: u32, mb: u32, pass: Pass) -> Vec<Filter> {
        self.regions[s as usize]
            .iter()
            .map(|r| Filter::tag("PP", *r).and("MB", mb).pass(pass))
            .collect()
    }
}

/// The most stages a `boundaries` option may name.
const MAX_BOUNDARIES: usize = 4096;

/// Why a list of region indices was refused.
#[derive(Debug, PartialEq)]
pub enum RegionListError {
    /// An item that is not an index (trimmed, at most 40 characters).
    NotAnIndex(String),
    /// More than the caller's limit of items.
    TooMany,
}

/// A list of PP region indices separated by `/` (`0/4/8`, as a command
/// line's `k=v,k=v` leaves commas to the options) or by commas inside
/// brackets (`[0, 4, 8]`, as a TOML list arrives), at most `max` of them.
pub fn parse_region_list(text: &str, max: usize) -> Result<Vec<u32>, RegionListError> {
    let t = text.trim();
    let inner = t
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(t);
    let mut out = Vec::new();
    for item in inner.split(['/', ',']).map(str::trim) {
        if out.len() == max {
            return Err(RegionListError::TooMany);
        }
        let r = item
            .parse::<u32>()
            .map_err(|_| RegionListError::NotAnIndex(item.chars().take(40).collect()))?;
        out.push(r);
    }
    Ok(out)
}

/// An option's text as it is echoed in an error: trimmed, at most 80
/// characters.
pub fn echo(text: &str) -> String {
    text.trim().chars().take(80).collect()
}

/// A `boundaries` option's text: the first `PP` region of each stage
/// ([`parse_region_list`]: `0/4/8/11` or `[0, 4, 8, 11]`). Megatron's
/// first/last-stage layer counts are the common case: a lighter last stage
/// for the LM head.
pub fn parse_boundaries(text: &str, who: &str) -> Result<Vec<u32>, Error> {
    parse_region_list(text, MAX_BOUNDARIES).map_err(|e| match e {
        RegionListError::TooMany => Error::msg(format!(
            "{who}: boundaries name more than {MAX_BOUNDARIES} stages"
        )),
        RegionListError::NotAnIndex(item) => Error::msg(format!(
            "{who}: boundaries `{}`: `{item}` is not a region index (give each stage's first PP region, e.g. `0/4/8/11`)",
            echo(text)
        )),
    })
}

/// The options every pipeline plugin takes: `stages` and `microbatches`
/// (no default: the plugin derives them; `stages_help` and
/// `microbatches_help` say how), `boundaries` (default: an even cut) and
/// the transfer `stream` (default `pp`).
pub fn pipeline_options(
    info: crate::PluginInfo,
    stages_help: &str,
    microbatches_help: &str,
) -> crate::PluginInfo {
    use crate::OptionSpec;
    info.option(OptionSpec::int("stages", None, stages_help))
        .option(OptionSpec::int("microbatches", None, microbatches_help))
        .option(OptionSpec::str(
            "boundaries",
            None,
            "first PP region of each stage, e.g. 0/4/8/11 (default: regions cut evenly, earlier stages taking the remainder)",
        ))
        .option(OptionSpec::str(
            "stream",
            Some("pp"),
            "stream of the activation/gradient transfers",
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_cut_the_stages_where_told_and_name_what_is_wrong() {
        assert_eq!(parse_boundaries("0/4/8/11", "1f1b").unwrap(), [0, 4, 8, 11]);
        assert_eq!(
            parse_boundaries(" [0, 4, 8, 11] ", "1f1b").unwrap(),
            [0, 4, 8, 11]
        );
        let e = parse_boundaries("0/four", "1f1b").unwrap_err().to_string();
        assert!(e.contains("`four` is not a region index"), "{e}");
        let even = Pipeline {
            groups: vec![vec![0], vec![1], vec![2], vec![3]],
            regions: (0..4).map(|s| (3 * s..3 * s + 3).collect()).collect(),
            position: vec![0, 1, 2, 3],
            microbatches: 8,
        };
        let mut p = even.clone();
        p.cut_at(&[0, 4, 8, 11], "1f1b").unwrap();
        assert_eq!(
            p.regions,
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9, 10], vec![11]]
        );
        assert_eq!(p.groups, even.groups);
        for (firsts, want) in [
            (
                &[0, 4, 8][..],
                "boundaries name 3 stages' first regions, the pipeline has 4",
            ),
            (&[1, 4, 8, 11][..], "must start at region 0"),
            (&[0, 4, 4, 11][..], "4 follows 4"),
            (
                &[0, 4, 8, 12][..],
                "boundary 12 is past the model's last PP region (12 regions, 0 to 11)",
            ),
        ] {
            let e = even.clone().cut_at(firsts, "1f1b").unwrap_err().to_string();
            assert!(e.contains(want), "{firsts:?}: {e}");
        }
    }
}
