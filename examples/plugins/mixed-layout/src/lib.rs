//! `mixed-layout`: a layout per region. The transformer blocks (every
//! region but the first and the last) split their heads and MLP units over
//! a tensor-parallel group of all the devices; the embedding's and the
//! head's regions, which tensor parallelism would run whole on every rank,
//! run data-parallel instead, each device on its share of the batch. Where
//! the layouts meet, the host moves the activations and their gradients
//! between them (a relayout: the data-parallel rows are cut from the
//! tensor-parallel copy, and gathered back for the gradient).
//!
//! Build and check it keeps the math:
//! ```sh
//! piper plugin build examples/plugins/mixed-layout
//! piper plugin verify examples/plugins/mixed-layout/build/mixed-layout.wasm --devices 2
//! ```

use piper_sdk::{
    export_strategy, Dag, Error, Filter, OptionSpec, Options, PluginInfo, ReplicateOptions,
    Strategy,
};

pub struct MixedLayout;

impl Strategy for MixedLayout {
    fn info() -> PluginInfo {
        PluginInfo::new(
            "mixed-layout",
            env!("CARGO_PKG_VERSION"),
            "Tensor parallelism on the blocks, data parallelism on the embedding and the head",
        )
        .option(OptionSpec::str(
            "stream",
            Some("tp"),
            "stream of the tensor-parallel exchanges",
        ))
    }

    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
        let devices: Vec<u32> = (0..dag.cluster().devices).collect();
        let regions = dag.tag_extents().get("PP").copied().unwrap_or(1);
        // Preconditions first, with the numbers in the message.
        if regions < 3 {
            return Err(Error::msg(format!(
                "mixed-layout needs a block region between the embedding's and the head's: the model has {regions} PP regions"
            )));
        }
        let stream = options.str("stream")?.unwrap_or("tp");
        for r in 0..regions {
            let region = Filter::tag("PP", r);
            if r == 0 || r == regions - 1 {
                // 1. The ends: data parallelism over every device.
                dag.replicate(&region, &devices, &ReplicateOptions::zero(0))?;
            } else {
                // 2. The blocks: tensor parallelism over every device.
                dag.shard_tensor(&region, &devices, stream)?;
            }
        }
        Ok(())
    }
}

export_strategy!(MixedLayout);
