//! `dualpipe`: DeepSeek's bidirectional DualPipe (DeepSeek-V3 report, the
//! `dualpipe.py` reference). Two copies of the model run two pipelines in
//! opposite directions over the same `p` devices: copy A's stage `s` on
//! device `s`, copy B's stage `s` on device `p − 1 − s`. Half the
//! microbatches enter copy A at device 0, half enter copy B at device
//! `p − 1`; each device interleaves its two stages with DeepSeek's
//! eight-part schedule (overlapped F&B pairs, deferred weight passes), and
//! the two copies' gradients are all-reduced together before the update
//! (the DAG adds that reduction for any segment placed on two groups), so
//! both copies stay identical. Parameters: 2 copies per device.

use piper_sdk::dualpipe::{dual_groups, dual_schedule};
use piper_sdk::pipeline::{pipeline_options, Layout, Pipeline};
use piper_sdk::{export_strategy, Dag, Error, Filter, Options, PluginInfo, Strategy};

pub struct DualPipe;

impl Strategy for DualPipe {
    fn info() -> PluginInfo {
        pipeline_options(
            PluginInfo::new(
                "dualpipe",
                env!("CARGO_PKG_VERSION"),
                "DeepSeek's DualPipe: two model copies, microbatches fed from both ends",
            ),
            "pipeline stages = devices, even (default: devices ÷ data-parallel degree)",
            "microbatches per step, even and at least 2 × stages (default: 2 × stages)",
        )
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let who = "dualpipe";
        // 1. Copy A's stages, one per device; preconditions with the numbers.
        let pipe = Pipeline::new(dag, options, Layout::Plain, who)?;
        let (p, m) = (pipe.stages(), pipe.microbatches);
        if p % 2 == 1 {
            return Err(Error::msg(format!(
                "{who} needs an even number of stages: got {p}"
            )));
        }
        if m % 2 == 1 || m < 2 * p {
            return Err(Error::msg(format!(
                "{who} needs an even number of microbatches ≥ 2·stages: got {m} microbatches for {p} stages"
            )));
        }
        // 2. Microbatches; every stage on copy A's device.
        pipe.split_place(dag, options)?;
        // 3. Copy B: the second half of the microbatches runs stage s on
        //    device p − 1 − s (the same stage's nodes on a second group make
        //    it a second parameter copy).
        let stream = options.str("stream")?.unwrap_or("pp");
        let half = m / 2;
        for s in 0..p {
            let group = &pipe.groups[(p - 1 - s) as usize];
            for mb in half..m {
                for r in &pipe.regions[s as usize] {
                    dag.place(&Filter::tag("PP", *r).and("MB", mb), group, stream)?;
                }
            }
        }
        // 4. Per device: DeepSeek's schedule. In the first half of the
        //    devices phase 0 is copy A (the direction that reaches it first),
        //    in the second half copy B.
        let a: Vec<u32> = (0..half).collect();
        let b: Vec<u32> = (half..m).collect();
        let n = p / 2;
        for r in 0..p {
            let second = r >= n;
            let half_rank = r.min(p - 1 - r);
            let steps = dual_schedule(n, half_rank, half, half_rank == n - 1)?;
            let (stage_of, mbs) = if second {
                ([p - 1 - r, r], [b.as_slice(), a.as_slice()])
            } else {
                ([r, p - 1 - r], [a.as_slice(), b.as_slice()])
            };
            let groups = dual_groups(&pipe, &steps, stage_of, mbs)?;
            dag.order(&groups)?;
        }
        Ok(())
    }
}

export_strategy!(DualPipe);
