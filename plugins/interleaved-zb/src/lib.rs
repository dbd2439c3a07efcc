//! `interleaved-zb`: the interleaved zero-bubble schedule (the ZB paper's
//! ZB1P over Megatron's interleaved placement; PyTorch's
//! `ScheduleInterleavedZeroBubble`). The model is cut into `p × v` stages;
//! device `r` of `p` holds the `v` model chunks `r, r + p, r + 2p, …`, as
//! `interleaved-1f1b`'s. Each backward is split into `BI` (the input's
//! gradient) and `BW` (the weights'); device `r` defers its first `r` weight
//! passes and then runs one after each input backward, the rest at the end,
//! so the weight passes fill the interleaved schedule's bubble.

use piper_sdk::pipeline::{pipeline_options, Layout, Pipeline};
use piper_sdk::{
    export_strategy, Dag, Error, Filter, OptionSpec, Options, Pass, PluginInfo, Strategy,
};

pub struct InterleavedZb;

/// The microbatches in each round of `p` devices' interleaving: PyTorch's
/// `microbatches_per_round` (`m` over `max(1, m ÷ p)` rounds), `None` when
/// the rounds do not divide `m`.
pub fn per_round(p: u32, m: u32) -> Option<u32> {
    let rounds = (m / p).max(1);
    m.is_multiple_of(rounds).then_some(m / rounds)
}

/// PyTorch's order for device `r` of `p` with `v` chunks and `m`
/// microbatches, as (pass, chunk, microbatch): `(v − 1)·k + p − 1 − r`
/// warm-up forwards (`k` microbatches a round), then each forward with an
/// input backward (and, after the first `r`, the oldest deferred weight
/// pass), the cool-down's input backwards likewise, the weight passes left
/// at the end. Forwards visit the chunks a round at a time, backwards the
/// chunks in reverse.
pub fn schedule(p: u32, v: u32, r: u32, m: u32) -> Vec<(Pass, u32, u32)> {
    let k = per_round(p, m).unwrap_or(m).max(1);
    let total = v * m;
    let warmup = ((v - 1) * k + (p - 1 - r)).min(total);
    let chunk_f = |op: u32| (op / k) % v;
    let chunk_b = |op: u32| v - 1 - ((op - warmup) / k) % v;
    let (mut next_f, mut next_b, mut next_w) = (
        vec![0u32; v as usize],
        vec![0u32; v as usize],
        vec![0u32; v as usize],
    );
    let take = |next: &mut Vec<u32>, c: u32| {
        let mb = next[c as usize];
        next[c as usize] += 1;
        mb
    };
    let mut out = Vec::with_capacity(3 * total as usize);
    let mut backwards: Vec<u32> = Vec::new();
    let mut weights = 0usize;
    for op in 0..total + warmup {
        if op < warmup || op < total {
            let c = chunk_f(op);
            out.push((Pass::F, c, take(&mut next_f, c)));
            if op < warmup {
                continue;
            }
        }
        let c = chunk_b(op);
        out.push((Pass::BI, c, take(&mut next_b, c)));
        backwards.push(c);
        if op - warmup >= r {
            let c = backwards[weights];
            weights += 1;
            out.push((Pass::BW, c, take(&mut next_w, c)));
        }
    }
    for &c in &backwards[weights..] {
        out.push((Pass::BW, c, take(&mut next_w, c)));
    }
    out
}

impl Strategy for InterleavedZb {
    fn info() -> PluginInfo {
        pipeline_options(
            PluginInfo::new(
                "interleaved-zb",
                env!("CARGO_PKG_VERSION"),
                "interleaved zero-bubble pipeline: `virtual` model chunks per device, BI/BW split, weight passes in the bubble",
            ),
            "pipeline devices p (default: devices ÷ data-parallel degree)",
            "microbatches per step m; max(1, m ÷ p) rounds must divide m (default: 2 × p)",
        )
        .option(OptionSpec::int(
            "virtual",
            Some("2"),
            "model chunks per device v (the model is cut into p × v stages)",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let who = "interleaved-zb";
        // 1. Stage s = k·p + r sits on device r: chunk k of device r.
        let v = options.u32("virtual")?.unwrap_or(2);
        let layout = Layout::Interleaved { virtual_stages: v };
        let pipe = Pipeline::new(dag, options, layout, who)?;
        let (p, m) = (pipe.positions(), pipe.microbatches);
        if per_round(p, m).is_none() {
            return Err(Error::msg(format!(
                "{who} needs max(1, microbatches ÷ devices) rounds to divide the microbatches (as PyTorch's schedule): got {m} microbatches for {p} devices"
            )));
        }
        // 2. Microbatches, and every stage on its device.
        pipe.split_place(dag, options)?;
        // 3. Per device: PyTorch's interleaved zero-bubble order.
        for r in 0..p {
            let groups: Vec<Vec<Filter>> = schedule(p, v, r, m)
                .into_iter()
                .map(|(pass, chunk, mb)| pipe.step(chunk * p + r, mb, pass))
                .collect();
            dag.order(&groups)?;
        }
        Ok(())
    }
}

export_strategy!(InterleavedZb);

#[cfg(test)]
mod tests {
    use super::*;

    /// Every chunk of every microbatch runs F, BI and BW once, in that
    /// order, wherever the rounds divide the microbatches.
    #[test]
    fn every_chunk_runs_f_then_bi_then_bw_once() {
        for p in 1..=5 {
            for v in 1..=3 {
                for m in 1..=3 * p {
                    if per_round(p, m).is_none() {
                        continue;
                    }
                    for r in 0..p {
                        let steps = schedule(p, v, r, m);
                        assert_eq!(steps.len() as u32, 3 * m * v, "p {p} v {v} m {m} r {r}");
                        let mut state = vec![vec![0u8; v as usize]; m as usize];
                        for (pass, c, mb) in steps {
                            let st = &mut state[mb as usize][c as usize];
                            let want = match pass {
                                Pass::F => 0,
                                Pass::BI => 1,
                                Pass::BW => 2,
                                _ => unreachable!(),
                            };
                            assert_eq!(*st, want, "p {p} v {v} m {m} r {r}: {pass:?} {c} {mb}");
                            *st += 1;
                        }
                    }
                }
            }
        }
    }
    /// Every device's order is PyTorch's `ScheduleInterleavedZeroBubble`'s
    /// (`host/tests/data/pytorch-schedule-orders.txt`, taken from torch
    /// 2.11.0's own code by `scripts/pytorch-schedule-orders.py`), action
    /// by action: stage, F/I/W, microbatch.
    #[test]
    fn every_device_runs_pytorchs_order() {
        let table = include_str!("../../../host/tests/data/pytorch-schedule-orders.txt");
        let mut rows = 0;
        for line in table.lines().filter(|l| l.starts_with("interleaved-zb ")) {
            let (head, want) = line.split_once(": ").unwrap();
            let num = |k: &str| -> u32 {
                let at = head.find(&format!(" {k}=")).unwrap() + k.len() + 2;
                head[at..].split(' ').next().unwrap().parse().unwrap()
            };
            let (p, v, m, r) = (num("p"), num("v"), num("m"), num("rank"));
            let got: Vec<String> = schedule(p, v, r, m)
                .into_iter()
                .map(|(pass, c, mb)| format!("{}{}{mb}", c * p + r, letter(pass)))
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
