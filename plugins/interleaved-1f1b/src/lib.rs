//! `interleaved-1f1b`: Megatron-LM's interleaved 1F1B schedule (Narayanan et
//! al., 2021). The model is cut into `stages × virtual` stages; device `r` of
//! `p` holds the `virtual` model chunks `r, r + p, r + 2p, …`, so a
//! microbatch visits every device `virtual` times and the pipeline bubble
//! shrinks by that factor, at the price of `virtual ×` more transfers.

use piper_sdk::pipeline::{pipeline_options, Layout, Pipeline};
use piper_sdk::{
    export_strategy, Dag, Error, Filter, OptionSpec, Options, Pass, PluginInfo, Strategy,
};

pub struct Interleaved;

/// Megatron's order for rank `r` of `p` with `v` chunks and `m` microbatches
/// (`m` a multiple of `p`), as (pass, model chunk, microbatch): warm-up
/// forwards, 1F1B steady state over virtual microbatches, cool-down backwards.
pub fn schedule(p: u32, v: u32, r: u32, m: u32) -> Vec<(Pass, u32, u32)> {
    let total = m * v;
    // Forward k visits chunk (k mod pv) ÷ p of microbatch (k ÷ pv)·p + k mod p;
    // backward k the chunks in reverse.
    let mb = |k: u32| (k / (p * v)) * p + k % p;
    let chunk_f = |k: u32| (k % (p * v)) / p;
    let warmup = if v == 1 {
        (p - r - 1).min(m)
    } else if m == p {
        total
    } else {
        ((p - r - 1) * 2 + (v - 1) * p).min(total)
    };
    let mut out: Vec<(Pass, u32, u32)> =
        (0..warmup).map(|k| (Pass::F, chunk_f(k), mb(k))).collect();
    for k in 0..total - warmup {
        let f = warmup + k;
        out.push((Pass::F, chunk_f(f), mb(f)));
        out.push((Pass::B, v - 1 - chunk_f(k), mb(k)));
    }
    out.extend((total - warmup..total).map(|k| (Pass::B, v - 1 - chunk_f(k), mb(k))));
    out
}

impl Strategy for Interleaved {
    fn info() -> PluginInfo {
        pipeline_options(
            PluginInfo::new(
                "interleaved-1f1b",
                env!("CARGO_PKG_VERSION"),
                "Megatron's interleaved 1F1B: `virtual` model chunks per device",
            ),
            "pipeline devices p, Megatron's pipeline size (default: devices ÷ data-parallel degree)",
            "microbatches per step, a multiple of p (default: 2 × p)",
        )
        .option(OptionSpec::int(
            "virtual",
            Some("2"),
            "model chunks per device v (the model is cut into p × v stages)",
        ))
        .option(piper_sdk::recompute::recompute_option())
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let who = "interleaved-1f1b";
        // 1. Stage s = k·p + r sits on device r: chunk k of device r.
        let v = options.u32("virtual")?.unwrap_or(2);
        let layout = Layout::Interleaved { virtual_stages: v };
        let pipe = Pipeline::new(dag, options, layout, who)?;
        let (p, m) = (pipe.positions(), pipe.microbatches);
        if !m.is_multiple_of(p) {
            return Err(Error::msg(format!(
                "{who} needs microbatches to be a multiple of the pipeline devices: got {m} microbatches for {p} devices"
            )));
        }
        // 2. Microbatches, and every stage on its device.
        pipe.split_place(dag, options)?;
        // 3. Per device: Megatron's interleaved order over its chunks.
        for r in 0..p {
            let groups: Vec<Vec<Filter>> = schedule(p, v, r, m)
                .into_iter()
                .map(|(pass, chunk, mb)| pipe.step(chunk * p + r, mb, pass))
                .collect();
            dag.order(&groups)?;
        }
        // 4. Megatron's `--recompute-granularity`, if asked for.
        piper_sdk::recompute::apply_option(dag, options, who)?;
        Ok(())
    }
}

export_strategy!(Interleaved);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_of_every_microbatch_runs_forward_then_backward_once() {
        for p in 1..=4 {
            for v in 1..=3 {
                for m in [p, 2 * p, 3 * p] {
                    for r in 0..p {
                        let steps = schedule(p, v, r, m);
                        assert_eq!(steps.len() as u32, 2 * m * v);
                        let mut seen = std::collections::HashMap::new();
                        for (i, (pass, chunk, mb)) in steps.iter().enumerate() {
                            assert!(*chunk < v && *mb < m);
                            seen.entry((*chunk, *mb, *pass == Pass::F)).or_insert(i);
                        }
                        assert_eq!(seen.len() as u32, 2 * m * v, "p {p} v {v} m {m} r {r}");
                        for c in 0..v {
                            for mb in 0..m {
                                assert!(seen[&(c, mb, true)] < seen[&(c, mb, false)]);
                            }
                        }
                    }
                }
            }
        }
    }
}
