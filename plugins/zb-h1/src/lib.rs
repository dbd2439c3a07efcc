//! `zb-h1`: the ZB-H1 zero-bubble schedule (Qi et al., "Zero Bubble Pipeline
//! Parallelism", 2024). Each backward is split into `BI` (gradient of the
//! input, on the critical path) and `BW` (gradient of the weights, needed
//! only by the optimizer); stage `s` defers `s` weight passes into the
//! cool-down bubble. Activation memory stays that of 1F1B (at most `p − s`
//! microbatches in flight); the bubble shrinks to about a third.

use piper_sdk::pipeline::{pipeline_options, Layout, Pipeline};
use piper_sdk::{export_strategy, Dag, Error, Filter, Options, Pass, PluginInfo, Strategy};

pub struct ZbH1;

/// The ZB-H1 order of stage `s` of `p` over `m` microbatches, as (pass,
/// microbatch): warm-up forwards; `s` pairs of F and BI (their weight passes
/// deferred); then F, BI and the oldest deferred BW while forwards remain;
/// BI and BW while backwards remain; the last deferred BWs. The first stage
/// defers nothing, so its BI + BW pairs are fused backwards.
pub fn schedule(p: u32, s: u32, m: u32) -> Vec<(Pass, u32)> {
    let mut out = Vec::new();
    let (mut f, mut b) = (0u32, 0u32);
    let mut deferred = std::collections::VecDeque::new();
    let mut backward = |out: &mut Vec<(Pass, u32)>, b: &mut u32, w: bool| {
        if s == 0 {
            out.push((Pass::B, *b));
        } else {
            out.push((Pass::BI, *b));
            deferred.push_back(*b);
            if w {
                if let Some(oldest) = deferred.pop_front() {
                    out.push((Pass::BW, oldest));
                }
            }
        }
        *b += 1;
    };
    // Warm-up: p − s − 1 forwards.
    while f < (p - s - 1).min(m) {
        out.push((Pass::F, f));
        f += 1;
    }
    // s pairs of forward and input-backward, weight passes deferred.
    for _ in 0..s {
        if f == m {
            break;
        }
        out.push((Pass::F, f));
        f += 1;
        backward(&mut out, &mut b, false);
    }
    // Steady state: F, BI, BW.
    while f < m {
        out.push((Pass::F, f));
        f += 1;
        backward(&mut out, &mut b, true);
    }
    // Cool-down: BI, BW.
    while b < m {
        backward(&mut out, &mut b, true);
    }
    // The deferred weight passes fill the tail.
    out.extend(deferred.into_iter().map(|w| (Pass::BW, w)));
    out
}

impl Strategy for ZbH1 {
    fn info() -> PluginInfo {
        pipeline_options(
            PluginInfo::new(
            "zb-h1",
            env!("CARGO_PKG_VERSION"),
            "ZB-H1 zero-bubble pipeline: backward split into BI/BW, BW deferred into the bubble",
        ),
            "pipeline stages (default: devices ÷ data-parallel degree)",
            "microbatches per step, at least the stages (default: 2 × stages)",
        )
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        // 1. Stages on device groups; the schedule needs m ≥ p to reach its
        //    steady state.
        let pipe = Pipeline::new(dag, options, Layout::Plain, "zb-h1")?;
        let (p, m) = (pipe.stages(), pipe.microbatches);
        if m < p {
            return Err(Error::msg(format!(
                "zb-h1 needs microbatches ≥ stages: got {m} microbatches for {p} stages"
            )));
        }
        // 2. Microbatches, stages placed.
        pipe.split_place(dag, options)?;
        // 3. Per stage: the ZB-H1 order (BI/BW filters split the backwards).
        for s in 0..p {
            let groups: Vec<Vec<Filter>> = schedule(p, s, m)
                .into_iter()
                .map(|(pass, mb)| pipe.step(s, mb, pass))
                .collect();
            dag.order(&groups)?;
        }
        Ok(())
    }
}

export_strategy!(ZbH1);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_microbatch_runs_f_then_bi_then_bw_once_with_1f1b_activation_counts() {
        for p in 1..=6 {
            for s in 0..p {
                for m in p..p + 6 {
                    let steps = schedule(p, s, m);
                    let mut state = vec![0u8; m as usize]; // 1 F, 2 BI (or B), 3 BW
                    let mut in_flight = 0i32;
                    let mut peak = 0;
                    for (pass, mb) in steps {
                        let st = &mut state[mb as usize];
                        match pass {
                            Pass::F => {
                                assert_eq!(*st, 0);
                                *st = 1;
                                in_flight += 1;
                                peak = peak.max(in_flight);
                            }
                            Pass::BI => {
                                assert_eq!(*st, 1);
                                *st = 2;
                                in_flight -= 1;
                            }
                            Pass::B => {
                                assert_eq!(*st, 1);
                                *st = 3;
                                in_flight -= 1;
                            }
                            Pass::BW => {
                                assert_eq!(*st, 2);
                                *st = 3;
                            }
                            _ => unreachable!(),
                        }
                    }
                    assert!(state.iter().all(|x| *x == 3), "p {p} s {s} m {m}");
                    // Forward activations in flight: 1F1B's p − s, no more.
                    assert_eq!(peak, (p - s).min(m) as i32, "p {p} s {s} m {m}");
                }
            }
        }
    }
}
