//! `zbv`: the ZB-V zero-bubble schedule (Qi et al., "Zero Bubble Pipeline
//! Parallelism", 2024, section 6; PyTorch's `ScheduleZBVZeroBubble`). The
//! model is cut into `2p` stages folded into a V, as DualPipeV's: device `r`
//! of `p` holds stage `r` on the way down and stage `2p − 1 − r` on the way
//! back, so the first device also computes the loss. Every backward is split
//! into `BI` (the input's gradient, on the critical path) and `BW` (the
//! weights'), and the weight passes fill what would be the bubble: with
//! F = BI = BW the pipeline has none, at 1F1B's activation memory.

use piper_sdk::pipeline::{pipeline_options, Layout, Pipeline};
use piper_sdk::{export_strategy, Dag, Error, Filter, Options, Pass, PluginInfo, Strategy};

pub struct Zbv;

/// PyTorch's ZB-V order of device `r` of `p` over `m` microbatches, as (pass,
/// chunk, microbatch): chunk 0 is the stage on the way down (`r`), chunk 1
/// the one on the way back (`2p − 1 − r`). Warm-up forwards of chunk 0, then
/// of both chunks, then chunk 1's forwards each with its input and weight
/// backward; the steady state pairs each chunk's forward with a backward of
/// the same chunk; the cool-down runs input backwards first and the weight
/// passes last. The order is computed for at least `2p − 1` microbatches and
/// the steps of those past `m` dropped, as PyTorch does.
pub fn schedule(p: u32, r: u32, m: u32) -> Vec<(Pass, u32, u32)> {
    let n = m.max(2 * p - 1);
    let mut out = Vec::new();
    let (mut f0, mut f1, mut b0, mut b1) = (0u32, 0u32, 0u32, 0u32);
    for _ in 0..2 * (p - r) - 1 {
        out.push((Pass::F, 0, f0));
        f0 += 1;
    }
    for _ in 0..r {
        out.push((Pass::F, 1, f1));
        f1 += 1;
        out.push((Pass::F, 0, f0));
        f0 += 1;
    }
    for _ in 0..p - r {
        out.push((Pass::F, 1, f1));
        f1 += 1;
        out.push((Pass::BI, 1, b1));
        out.push((Pass::BW, 1, b1));
        b1 += 1;
    }
    while f1 < f0 || f0 < n {
        if f0 < n {
            out.push((Pass::F, 0, f0));
            f0 += 1;
        }
        out.push((Pass::BI, 0, b0));
        out.push((Pass::BW, 0, b0));
        b0 += 1;
        out.push((Pass::F, 1, f1));
        f1 += 1;
        out.push((Pass::BI, 1, b1));
        out.push((Pass::BW, 1, b1));
        b1 += 1;
    }
    let (mut w0, mut w1) = (b0, b1);
    for _ in 0..r {
        out.push((Pass::BI, 0, b0));
        b0 += 1;
        out.push((Pass::BI, 1, b1));
        b1 += 1;
    }
    for _ in 0..p - r {
        out.push((Pass::BI, 0, b0));
        b0 += 1;
        out.push((Pass::BW, 0, w0));
        w0 += 1;
    }
    out.extend((w1..b1).map(|w| (Pass::BW, 1, w)));
    w1 = b1;
    out.extend((w0..b0).map(|w| (Pass::BW, 0, w)));
    debug_assert!(w1 == f1 && b0 == f0);
    out.retain(|&(_, _, mb)| mb < m);
    out
}

impl Strategy for Zbv {
    fn info() -> PluginInfo {
        pipeline_options(
            PluginInfo::new(
                "zbv",
                env!("CARGO_PKG_VERSION"),
                "ZB-V zero-bubble pipeline: V-shaped placement, 2 stages per device, BI/BW split, weight passes in the bubble",
            ),
            "model stages, 2 per device (default: 2 × devices ÷ data-parallel degree)",
            "microbatches per step (default: 2 × stages)",
        )
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        // 1. The V, two stages per device: stage s < p on device s, stage
        //    s ≥ p on device 2p − 1 − s.
        let pipe = Pipeline::new(dag, options, Layout::V, "zbv")?;
        let p = pipe.positions();
        let m = pipe.microbatches;
        // 2. Microbatches; both stages of each device placed on it.
        pipe.split_place(dag, options)?;
        // 3. Per device: PyTorch's ZB-V order (BI/BW filters split the
        //    backwards).
        for r in 0..p {
            let stage = [r, 2 * p - 1 - r];
            let groups: Vec<Vec<Filter>> = schedule(p, r, m)
                .into_iter()
                .map(|(pass, chunk, mb)| pipe.step(stage[chunk as usize], mb, pass))
                .collect();
            dag.order(&groups)?;
        }
        Ok(())
    }
}

export_strategy!(Zbv);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every chunk of every microbatch runs F, BI and BW once, in that
    /// order, for any microbatch count (those below 2p − 1 too).
    #[test]
    fn every_chunk_runs_f_then_bi_then_bw_once() {
        for p in 1..=6 {
            for r in 0..p {
                for m in 1..4 * p {
                    let steps = schedule(p, r, m);
                    assert_eq!(steps.len() as u32, 6 * m, "p {p} r {r} m {m}");
                    let mut state = vec![[0u8; 2]; m as usize];
                    for (pass, chunk, mb) in steps {
                        let st = &mut state[mb as usize][chunk as usize];
                        let want = match pass {
                            Pass::F => 0,
                            Pass::BI => 1,
                            Pass::BW => 2,
                            _ => unreachable!(),
                        };
                        assert_eq!(*st, want, "p {p} r {r} m {m}: {pass:?} {chunk} {mb}");
                        *st += 1;
                    }
                    assert!(state.iter().all(|s| *s == [3, 3]), "p {p} r {r} m {m}");
                }
            }
        }
    }
    /// Every device's order is PyTorch's `ScheduleZBVZeroBubble`'s
    /// (`host/tests/data/pytorch-schedule-orders.txt`, taken from torch
    /// 2.11.0's own code by `scripts/pytorch-schedule-orders.py`), action
    /// by action: stage, F/I/W, microbatch.
    #[test]
    fn every_device_runs_pytorchs_order() {
        let table = include_str!("../../../host/tests/data/pytorch-schedule-orders.txt");
        let mut rows = 0;
        for line in table.lines().filter(|l| l.starts_with("zbv ")) {
            let (head, want) = line.split_once(": ").unwrap();
            let num = |k: &str| -> u32 {
                let at = head.find(&format!(" {k}=")).unwrap() + k.len() + 2;
                head[at..].split(' ').next().unwrap().parse().unwrap()
            };
            let (p, m, r) = (num("p"), num("m"), num("rank"));
            let stage = [r, 2 * p - 1 - r];
            let got: Vec<String> = schedule(p, r, m)
                .into_iter()
                .map(|(pass, c, mb)| format!("{}{}{mb}", stage[c as usize], letter(pass)))
                .collect();
            assert_eq!(got.join(" "), want, "{head}");
            rows += 1;
        }
        assert!(rows >= 20, "{rows} rows");
    }

    fn letter(pass: Pass) -> &'static str {
        match pass {
            Pass::F => "F",
            Pass::BI => "I",
            Pass::BW => "W",
            _ => "B",
        }
    }
}
