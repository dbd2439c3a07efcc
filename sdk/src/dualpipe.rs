//! DeepSeek's DualPipe template, for the DualPipe family of strategies
//! (`dualpipe`, `dualpipev`, and a variant you write): the eight-part
//! schedule of one rank over its two phases ([`dual_schedule`]), resolved to
//! `order` groups on a [`Pipeline`] ([`dual_groups`]), and the phase-by-phase
//! overlap of a forward and a backward on a model whose expert passes are
//! split ([`interleave_pair`]). Other pipeline strategies need only
//! [`crate::pipeline`].

use crate::pipeline::Pipeline;
use crate::{Dag, Error, Filter, Pass};

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
