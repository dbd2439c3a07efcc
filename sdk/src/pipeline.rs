//! Pipeline layout shared by the pipeline strategies: which devices each stage
//! runs on and which `PP` regions it holds.
//!
//! A pipeline has `positions` device groups (pipeline ranks) and `stages`
//! model stages; each stage sits on one position. Plain schedules (GPipe,
//! 1F1B, ZB-H1) put stage `s` on position `s`; Megatron's interleaved
//! schedule puts stage `s` on position `s mod p`; DualPipeV folds the stages
//! into a V (stage `s` and `2p − 1 − s` on position `s`).
//!
//! A pipeline composes with a data-parallel strategy applied before it: if
//! every forward already sits on one device group `G` (e.g. `dp:degree=2` put
//! the model on `[0, 4]` of 8 devices), position `q` runs on `G + q`
//! (`[q, 4 + q]`), so each stage keeps `|G|` data-parallel replicas. Otherwise
//! the pipeline starts from device 0.

use crate::{Dag, Error, Filter, Pass};

/// Stages, their device groups and their regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pipeline {
    /// Device group of each stage (stages sharing a position share a group).
    pub groups: Vec<Vec<u32>>,
    /// `PP` regions of each stage, contiguous and in order.
    pub regions: Vec<Vec<u32>>,
    /// Position (pipeline rank) of each stage.
    pub position: Vec<u32>,
}

impl Pipeline {
    /// One stage per position: `stages` stages (default: as many as the
    /// devices allow). `who` names the strategy in error messages.
    pub fn plan(dag: &mut dyn Dag, stages: Option<u32>, who: &str) -> Result<Self, Error> {
        Self::layout(dag, stages, 1, &|s, _| s, who)
    }

    /// `positions` pipeline ranks (default: devices ÷ data-parallel degree),
    /// each holding `per_position` stages; stage `s` of `positions ×
    /// per_position` sits on position `position_of(s, positions)`.
    pub fn layout(
        dag: &mut dyn Dag,
        positions: Option<u32>,
        per_position: u32,
        position_of: &dyn Fn(u32, u32) -> u32,
        who: &str,
    ) -> Result<Self, Error> {
        let devices = dag.cluster().devices;
        let n_regions = dag.tag_extents().get("PP").copied().unwrap_or(0);
        if n_regions == 0 {
            return Err(Error::msg(format!(
                "{who} needs a model annotated with PP regions"
            )));
        }
        // The group a previous strategy (dp, zero) put the model on, if any.
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
        let stages = positions * per_position;
        if stages > n_regions {
            return Err(Error::msg(format!(
                "{who} needs stages ≤ PP regions: got {stages} stages for {n_regions} regions"
            )));
        }
        if positions * dp > devices {
            return Err(Error::msg(format!(
                "{who} needs pipeline devices × data-parallel degree ≤ devices: {positions} × {dp} > {devices}"
            )));
        }
        let position_groups: Vec<Vec<u32>> = (0..positions)
            .map(|q| base.iter().map(|g| g + q).collect())
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        for g in position_groups.iter().flatten() {
            if *g >= devices || !seen.insert(*g) {
                return Err(Error::msg(format!(
                    "{who}: the data-parallel group {base:?} leaves no room for {positions} pipeline positions on {devices} devices (position q runs on the group shifted by q)"
                )));
            }
        }
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
        })
    }

    /// Cut the stages at the `boundaries` option when it is given (the
    /// first `PP` region of each stage, see [`parse_boundaries`]); the even
    /// cut of [`Pipeline::layout`] otherwise.
    pub fn with_boundaries(mut self, options: &crate::Options, who: &str) -> Result<Self, Error> {
        if let Some(text) = options.str("boundaries")? {
            let firsts = parse_boundaries(text, who)?;
            self.cut_at(&firsts, who)?;
        }
        Ok(self)
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

    /// The usual prologue of a pipeline strategy: lay out the stages from the
    /// `stages` option (cut at `boundaries` when given), read `microbatches`
    /// (default 2 × stages), split the batch into them and place the stages
    /// with transfers on the `stream` option (default `pp`). Returns the
    /// layout and the microbatch count.
    pub fn split_and_place(
        dag: &mut dyn Dag,
        options: &crate::Options,
        who: &str,
    ) -> Result<(Self, u32), Error> {
        let pipe =
            Pipeline::plan(dag, options.u32("stages")?, who)?.with_boundaries(options, who)?;
        let mbs = microbatches(options, 2 * pipe.stages(), who)?;
        pipe.split_place(dag, options, mbs)?;
        Ok((pipe, mbs))
    }

    /// Split the batch into `mbs` microbatches and place every stage on its
    /// group, transfers on the `stream` option (default `pp`).
    pub fn split_place(
        &self,
        dag: &mut dyn Dag,
        options: &crate::Options,
        mbs: u32,
    ) -> Result<(), Error> {
        dag.split(&Filter::all(), "MB", mbs)?;
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

/// A `boundaries` option's text: the first `PP` region of each stage,
/// separated by `/` (`0/4/8/11`, as a command line's `k=v,k=v` leaves
/// commas to the options) or commas inside brackets (`[0, 4, 8, 11]`, as a
/// TOML list arrives). Megatron's first/last-stage layer counts are the
/// common case: a lighter last stage for the LM head.
pub fn parse_boundaries(text: &str, who: &str) -> Result<Vec<u32>, Error> {
    let t = text.trim();
    let inner = t
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(t);
    let mut out = Vec::new();
    for item in inner.split(['/', ',']).map(str::trim) {
        if out.len() == MAX_BOUNDARIES {
            return Err(Error::msg(format!(
                "{who}: boundaries name more than {MAX_BOUNDARIES} stages"
            )));
        }
        let r = item.parse::<u32>().map_err(|_| {
            Error::msg(format!(
                "{who}: boundaries `{}`: `{}` is not a region index (give each stage's first PP region, e.g. `0/4/8/11`)",
                t.chars().take(80).collect::<String>(),
                item.chars().take(40).collect::<String>()
            ))
        })?;
        out.push(r);
    }
    Ok(out)
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

/// The `microbatches` option (default `default`), at least 1.
pub fn microbatches(options: &crate::Options, default: u32, who: &str) -> Result<u32, Error> {
    let mbs = options.u32("microbatches")?.unwrap_or(default);
    if mbs == 0 {
        return Err(Error::msg(format!(
            "{who} needs at least 1 microbatch, got 0"
        )));
    }
    Ok(mbs)
}

/// One step of DeepSeek's DualPipe / DualPipeV template, in terms of a rank's
/// two *phases* (its two stages; phase 0 is the one its microbatches reach
/// first). `W` runs the oldest deferred weight pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DualStep {
    /// Forward of the next microbatch of a phase.
    F(u8),
    /// Backward of the next microbatch of a phase; `zb`: input part only, the
    /// weight part deferred to a later `W`.
    B { phase: u8, zb: bool },
    /// The oldest deferred weight pass.
    W,
    /// A forward of one phase overlapped with a (full) backward of the other.
    FB { f: u8, b: u8 },
}

/// The eight-part DualPipe schedule of one rank, as in DeepSeek's reference
/// (`dualpipe.py`, `dualpipev.py`): `ranks` ranks per half (DualPipe: half the
/// ranks; DualPipeV: all of them), `rank` this rank's index in its half, and
/// `chunks` microbatches per phase. `last` marks the rank where the two
/// phases meet (DualPipe's middle ranks, DualPipeV's last rank), whose first
/// steady-state pair is not overlapped. Needs `rank < ranks` and
/// `chunks ≥ 2 · ranks`.
pub fn dual_schedule(
    ranks: u32,
    rank: u32,
    chunks: u32,
    last: bool,
) -> Result<Vec<DualStep>, Error> {
    use DualStep::*;
    if rank >= ranks || chunks < 2 * ranks {
        return Err(Error::msg(format!(
            "the DualPipe schedule needs rank < ranks and chunks ≥ 2·ranks: got rank {rank}, {ranks} ranks, {chunks} chunks"
        )));
    }
    let (n, r) = (ranks, rank);
    let mut out = Vec::new();
    // 1. nF0: warm-up forwards of phase 0.
    out.extend((0..(n - r - 1) * 2).map(|_| F(0)));
    // 2. nF0F1: forwards alternate between the phases.
    for _ in 0..r + 1 {
        out.extend([F(0), F(1)]);
    }
    // 3. nB1W1F1: first backwards, weight passes deferred and run at once.
    for _ in 0..n - r - 1 {
        out.extend([B { phase: 1, zb: true }, W, F(1)]);
    }
    // 4. nF0B1F1B0: the steady state of overlapped forward/backward pairs.
    for i in 0..chunks - 2 * n + r + 1 {
        if i == 0 && last {
            // Not overlapped, to shrink the bubble where the phases meet.
            out.extend([
                F(0),
                B {
                    phase: 1,
                    zb: false,
                },
            ]);
        } else {
            out.push(FB { f: 0, b: 1 });
        }
        out.push(FB { f: 1, b: 0 });
    }
    // 5. nB1F1B0: phase 0 runs out of forwards.
    for _ in 0..n - r - 1 {
        out.extend([
            B {
                phase: 1,
                zb: false,
            },
            FB { f: 1, b: 0 },
        ]);
    }
    // 6. nB1B0: backwards only; the second half defers its weight passes.
    let mut zb = false;
    let step6 = r + 1;
    for i in 0..step6 {
        if i == step6 / 2 && r % 2 == 1 {
            zb = true;
        }
        out.push(B { phase: 1, zb });
        if i == step6 / 2 && r % 2 == 0 {
            zb = true;
        }
        out.push(B { phase: 0, zb });
    }
    // 7. nWB0: a deferred weight pass before each remaining backward.
    for _ in 0..n - r - 1 {
        out.extend([W, B { phase: 0, zb: true }]);
    }
    // 8. nW: flush the deferred weight passes.
    out.extend((0..r + 1).map(|_| W));
    Ok(out)
}

/// A rank's dual schedule resolved to order groups: `stage_of[phase]` is the
/// phase's stage and `mbs[phase]` its microbatches in feeding order.
/// Overlapped pairs become one group (their members may interleave).
pub fn dual_groups(
    pipe: &Pipeline,
    steps: &[DualStep],
    stage_of: [u32; 2],
    mbs: [&[u32]; 2],
) -> Result<Vec<Vec<Filter>>, Error> {
    dual_groups_and_pairs(pipe, steps, stage_of, mbs).map(|(g, _)| g)
}

/// A forward and a backward the schedule overlaps: `(stage, microbatch)` each.
pub type FbPair = ((u32, u32), (u32, u32));

/// [`dual_groups`], and the overlapped F&B pairs in schedule order (for
/// [`interleave_pair`]).
pub fn dual_groups_and_pairs(
    pipe: &Pipeline,
    steps: &[DualStep],
    stage_of: [u32; 2],
    mbs: [&[u32]; 2],
) -> Result<(Vec<Vec<Filter>>, Vec<FbPair>), Error> {
    let mut pairs = Vec::new();
    let mut next_f = [0usize; 2];
    let mut next_b = [0usize; 2];
    let mut deferred: std::collections::VecDeque<(u32, u32)> = Default::default();
    let mut groups = Vec::new();
    let take = |next: &mut [usize; 2], p: u8| -> Result<u32, Error> {
        let list = mbs[p as usize];
        let m = *list.get(next[p as usize]).ok_or_else(|| {
            Error::msg(format!(
                "dual schedule ran past phase {p}'s {} microbatches",
                list.len()
            ))
        })?;
        next[p as usize] += 1;
        Ok(m)
    };
    for step in steps {
        match *step {
            DualStep::F(p) => {
                let m = take(&mut next_f, p)?;
                groups.push(pipe.step(stage_of[p as usize], m, Pass::F));
            }
            DualStep::B { phase, zb } => {
                let m = take(&mut next_b, phase)?;
                let s = stage_of[phase as usize];
                if zb {
                    groups.push(pipe.step(s, m, Pass::BI));
                    deferred.push_back((s, m));
                } else {
                    groups.push(pipe.step(s, m, Pass::B));
                }
            }
            DualStep::W => {
                let (s, m) = deferred
                    .pop_front()
                    .ok_or_else(|| Error::msg("dual schedule: a W with no deferred weight pass"))?;
                groups.push(pipe.step(s, m, Pass::BW));
            }
            DualStep::FB { f, b } => {
                let mf = take(&mut next_f, f)?;
                let mb = take(&mut next_b, b)?;
                let mut g = pipe.step(stage_of[f as usize], mf, Pass::F);
                g.extend(pipe.step(stage_of[b as usize], mb, Pass::B));
                groups.push(g);
                pairs.push(((stage_of[f as usize], mf), (stage_of[b as usize], mb)));
            }
        }
    }
    Ok((groups, pairs))
}

/// DualPipe's overlap of an F&B pair on a model whose expert passes are
/// split into phases (`shard` on a stream of its own, tag `PART`: 0
/// dispatch, 1 experts, 2 combine): the forward's and the backward's compute
/// nodes are merged into one order on the device (each keeps its own: the
/// forward by segment and phase, the backward the reverse) so that every
/// node that starts an all-to-all is followed by a large compute node of the
/// other pass (attention, the experts) while the exchange runs, as in the
/// DeepSeek-V3 report's overlapped chunk: per layer pair, backward combine,
/// forward attention, forward dispatch, backward experts, forward experts,
/// backward dispatch, backward attention, forward combine. Returns whether
/// the pair had expert phases (nothing is added otherwise).
pub fn interleave_pair(dag: &mut dyn Dag, pipe: &Pipeline, pair: FbPair) -> Result<bool, Error> {
    let ((fs, fm), (bs, bm)) = pair;
    let mut nodes = |s: u32, m: u32, pass: Pass| -> Result<Vec<crate::NodeInfo>, Error> {
        let mut v = Vec::new();
        for f in pipe.step(s, m, pass) {
            v.extend(dag.query(&f)?);
        }
        Ok(v)
    };
    let mut f = nodes(fs, fm, Pass::F)?;
    let mut b = nodes(bs, bm, Pass::B)?;
    if !f.iter().chain(&b).any(|n| n.tags.contains_key("PART")) {
        return Ok(false);
    }
    let key = |n: &crate::NodeInfo| {
        (
            n.segments.first().copied().unwrap_or(0),
            n.tags.get("PART").copied().unwrap_or(0),
        )
    };
    f.sort_by_key(key);
    b.sort_by_key(|n| std::cmp::Reverse(key(n)));
    let seq = merge_for_overlap(
        &f.iter()
            .map(|n| n.tags.get("PART").copied())
            .collect::<Vec<_>>(),
        &b.iter()
            .map(|n| n.tags.get("PART").copied())
            .collect::<Vec<_>>(),
    );
    let ids: Vec<u32> = seq
        .into_iter()
        .map(|(q, i)| if q == 0 { f[i].id } else { b[i].id })
        .collect();
    for w in ids.windows(2) {
        dag.add_temporal_edge(w[0], w[1])?;
    }
    Ok(true)
}

/// The merge of [`interleave_pair`] on the nodes' `PART` tags (`None`: a
/// whole segment): `(0, i)` is the forward's node `i`, `(1, i)` the
/// backward's. A node is *large* when it is a whole segment or an experts
/// phase; it *starts an exchange* when a phase follows it in its pass
/// (forward: dispatch, experts; backward: combine, experts). A pass whose
/// next node waits on an exchange not yet covered by a large node of the
/// other pass waits; among the rest, a node that starts an exchange goes
/// first when the other pass can cover it with a large node, then a large
/// node that covers the other's exchange, then the backward.
pub fn merge_for_overlap(f: &[Option<u32>], b: &[Option<u32>]) -> Vec<(u8, usize)> {
    let q = [f, b];
    let large = |p: Option<u32>| p.is_none_or(|p| p == 1);
    let starts = |pass: usize, p: Option<u32>| match (pass, p) {
        (0, Some(p)) => p < 2,
        (1, Some(p)) => p > 0,
        _ => false,
    };
    let mut next = [0usize; 2];
    let mut waits = [false; 2];
    let mut out = Vec::with_capacity(f.len() + b.len());
    while next[0] < f.len() || next[1] < b.len() {
        let head = |p: usize| q[p].get(next[p]).copied();
        let open = |p: usize| head(p).is_some() && !waits[p];
        let score = |p: usize| -> u8 {
            let h = head(p).flatten();
            let other = 1 - p;
            let other_large = head(other).is_some_and(large);
            match () {
                _ if !open(p) => 0,
                _ if starts(p, h) && other_large && !waits[other] => 4,
                _ if waits[other] && large(h) => 3,
                _ => 1 + p as u8,
            }
        };
        // Both passes waiting: the exchange is exposed; go on with the
        // backward (or whichever is left).
        let pick = match (score(0), score(1)) {
            (0, 0) => usize::from(head(1).is_some()),
            (a, b) if a > b => 0,
            _ => 1,
        };
        if head(pick).is_none() {
            break;
        }
        let h = head(pick).flatten();
        out.push((pick as u8, next[pick]));
        next[pick] += 1;
        if large(h) {
            waits[1 - pick] = false;
        }
        waits[pick] = starts(pick, h);
    }
    out
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

    #[test]
    fn dual_schedule_runs_every_pass_of_both_phases_once() {
        for n in 1..=4 {
            for r in 0..n {
                for chunks in 2 * n..2 * n + 5 {
                    for last in [false, true] {
                        let steps = dual_schedule(n, r, chunks, last).unwrap();
                        let (mut f, mut b, mut deferred) = ([0; 2], [0; 2], 0i64);
                        for s in &steps {
                            match *s {
                                DualStep::F(p) => f[p as usize] += 1,
                                DualStep::B { phase, zb } => {
                                    b[phase as usize] += 1;
                                    // A backward never overtakes its forward.
                                    assert!(b[phase as usize] <= f[phase as usize]);
                                    deferred += i64::from(zb);
                                }
                                DualStep::W => {
                                    deferred -= 1;
                                    assert!(deferred >= 0, "W with nothing deferred");
                                }
                                DualStep::FB { f: pf, b: pb } => {
                                    f[pf as usize] += 1;
                                    b[pb as usize] += 1;
                                    assert!(b[pb as usize] <= f[pb as usize]);
                                }
                            }
                        }
                        let c = chunks as i32;
                        assert_eq!(
                            (f, b, deferred),
                            ([c, c], [c, c], 0),
                            "n {n} r {r} chunks {chunks}"
                        );
                    }
                }
            }
        }
        assert!(dual_schedule(4, 0, 7, false).is_err());
        assert!(dual_schedule(2, 2, 8, false).is_err());
    }

    #[test]
    fn overlap_merge_follows_the_deepseek_chunk_order() {
        // One layer pair: forward attention, dispatch, experts, combine;
        // backward the reverse. DeepSeek-V3's overlapped chunk: B combine,
        // F attention, F dispatch, B experts, F experts, B dispatch,
        // B attention, F combine: each all-to-all (after F dispatch, F
        // experts, B combine, B experts) runs under the other's compute.
        let f = [None, Some(0), Some(1), Some(2)];
        let b = [Some(2), Some(1), Some(0), None];
        let got = merge_for_overlap(&f, &b);
        let want = [
            (1, 0),
            (0, 0),
            (0, 1),
            (1, 1),
            (0, 2),
            (1, 2),
            (1, 3),
            (0, 3),
        ];
        assert_eq!(got, want);
        // Two layers each: every node once, each pass in its own order.
        let f2 = [f, f].concat();
        let b2 = [b, b].concat();
        let got = merge_for_overlap(&f2, &b2);
        assert_eq!(got.len(), 16);
        for pass in 0..2u8 {
            let idx: Vec<usize> = got.iter().filter(|x| x.0 == pass).map(|x| x.1).collect();
            assert_eq!(idx, (0..8).collect::<Vec<_>>());
        }
        // Whole segments only (no phases): the backward first, then in turn.
        let got = merge_for_overlap(&[None, None], &[None]);
        assert_eq!(got.len(), 3);
    }
}
