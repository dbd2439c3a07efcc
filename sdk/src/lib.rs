//! # piper-sdk: write a Piper parallelism strategy
//!
//! A Piper strategy is a WebAssembly component that rewrites the host's global
//! training DAG with a handful of directives. This crate is all a strategy
//! crate needs: it wraps the `piper:strategy` WIT bindings in a small typed API
//! ([`Dag`], [`Filter`], [`Options`], [`PluginInfo`]) and exports your type with
//! one macro, [`export_strategy!`].
//!
//! ## A complete strategy
//!
//! `Cargo.toml`:
//! ```toml
//! [package]
//! name = "my-pipeline"
//! version = "0.1.0"
//! edition = "2021"
//!
//! [lib]
//! crate-type = ["cdylib"]
//!
//! [dependencies]
//! piper-sdk = { path = "../../sdk" }   # or the published version
//! ```
//!
//! `src/lib.rs` — GPipe: all forwards, then all backwards, one stage per device:
//! ```
//! use piper_sdk::{export_strategy, Dag, Error, Filter, OptionSpec, Options, Pass, PluginInfo, Strategy};
//!
//! pub struct MyPipeline;
//!
//! impl Strategy for MyPipeline {
//!     fn info() -> PluginInfo {
//!         PluginInfo::new("my-pipeline", "0.1.0", "GPipe over every device")
//!             .option(OptionSpec::int("microbatches", Some("4"), "microbatches per step"))
//!     }
//!
//!     fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error> {
//!         let mbs = options.u32("microbatches")?.unwrap_or(4);
//!         let devices = dag.cluster().devices;
//!         let regions = dag.tag_extents().get("PP").copied().unwrap_or(1);
//!         // Preconditions first, with the numbers in the message.
//!         if regions % devices != 0 {
//!             return Err(Error::msg(format!(
//!                 "my-pipeline needs PP regions divisible by devices: {regions} regions, {devices} devices"
//!             )));
//!         }
//!         // 1. Cut the batch into microbatches.
//!         dag.split(&Filter::all(), "MB", mbs)?;
//!         // 2. Stage d holds a contiguous block of PP regions; transfers go on stream "pp".
//!         let per = regions / devices;
//!         for r in 0..regions {
//!             dag.place(&Filter::tag("PP", r), &[r / per], "pp")?;
//!         }
//!         // 3. On each device: every forward, then every backward.
//!         for d in 0..devices {
//!             let block: Vec<u32> = (d * per..(d + 1) * per).collect();
//!             let step = |m: u32, pass: Pass| -> Vec<Filter> {
//!                 block.iter().map(|r| Filter::tag("PP", *r).and("MB", m).pass(pass)).collect()
//!             };
//!             let mut groups: Vec<Vec<Filter>> = (0..mbs).map(|m| step(m, Pass::F)).collect();
//!             groups.extend((0..mbs).map(|m| step(m, Pass::B)));
//!             dag.order(&groups)?;
//!         }
//!         Ok(())
//!     }
//! }
//!
//! export_strategy!(MyPipeline);
//! # fn main() {}
//! ```
//!
//! Build and run it:
//! ```sh
//! rustup target add wasm32-wasip2
//! cargo build --target wasm32-wasip2 --release
//! piper plan --model tiny --devices 4 --strategy target/wasm32-wasip2/release/my_pipeline.wasm:microbatches=8
//! ```
//!
//! ## The vocabulary
//! - [`Dag::split`] copies the model into microbatches (`MB` tag);
//! - [`Dag::place`] puts nodes on devices; crossing edges get send/recv;
//! - [`Dag::replicate`] is data parallelism, with ZeRO stages via [`ReplicateOptions`];
//! - [`Dag::order`] fixes the order of groups of nodes on one device (a filter on
//!   `Pass::BI`/`Pass::BW` splits the backward in two, zero-bubble style);
//! - primitives ([`Dag::query`], [`Dag::node`], [`Dag::neighbours`],
//!   [`Dag::tag_extents`], [`Dag::cluster`], [`Dag::add_temporal_edge`],
//!   [`Dag::set_stream`], [`Dag::set_priority`]) cover what no directive foresaw.
//!
//! Nodes are named by [`Filter`]s over tags (`PP` region, `EP` expert block,
//! `MB` microbatch, and the pass). Every call checks its arguments; a failing
//! call leaves the DAG unchanged and returns a [`DagError`] whose message names
//! the call and the offending nodes — propagate it with `?`.
//!
//! ## Group helpers
//! [`strided_group`] is the device group of a data- or expert-parallel
//! strategy: `degree` devices spread evenly over the cluster (so a pipeline
//! after it shifts the group per stage), refused with the numbers when the
//! degree does not divide the device count (`dp`, `zero` and `ep` use it).
//! [`mesh`] says how `dp`, `zero`, `tp` and a pipeline compose into one
//! device mesh (tensor parallelism contiguous, then pipeline positions,
//! then data-parallel replicas), with the groups each one gives.
//!
//! ## Pipeline helpers
//! [`pipeline::Pipeline::new`] is the layout every pipeline strategy starts
//! with, read from its options: stages over pipeline positions (a
//! [`pipeline::Layout`]: one per position, Megatron's interleaving, DualPipeV's
//! V, or a fold of your own), regions cut evenly or at `boundaries`,
//! microbatches, and composition with a `dp`/`zero` group applied before;
//! [`pipeline::Pipeline::split_place`] then splits and places. [`dualpipe`]
//! holds DeepSeek's eight-part DualPipe template ([`dualpipe::dual_schedule`],
//! and [`dualpipe::dual_groups`] to turn it into `order` groups) for the
//! DualPipe family. A segment placed on two device groups for different microbatches
//! becomes two parameter copies whose gradients the host all-reduces (that is
//! how `dualpipe` expresses its second model copy).
//!
//! ## The sandbox
//! The host runs each `apply` in a fresh instance with a memory cap, a fuel and
//! wall-clock budget, a stack cap and a cap on host calls. The plugin sees no
//! files, environment, network or real clock; randomness is seeded. Keep the
//! interface bulk: a strategy should make O(directives) calls, not one per node.

#![allow(clippy::too_many_arguments)]

mod dag;
pub mod dualpipe;
mod filter;
mod info;
pub mod mesh;
mod options;
pub mod pipeline;
pub mod recompute;

pub use dag::{
    ClusterInfo, Dag, DagError, DagErrorKind, EdgeKind, KvExchange, Neighbour, Neighbours,
    NodeCost, NodeInfo, RecomputePolicy, ReplicateOptions,
};
pub use filter::{Filter, Pass, TagMatch};
pub use info::{OptionSpec, OptionType, PluginInfo};
pub use options::{OptionError, OptionValue, Options};

/// The generated `piper:strategy` bindings (for advanced use; the types above
/// are the supported API).
#[allow(missing_docs, clippy::all)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "strategy",
        pub_export_macro: true,
        default_bindings_module: "piper_sdk::bindings",
    });
}

/// The `degree` devices of one group of a parallelism spread evenly over the
/// cluster's `devices` (0, stride, 2·stride, …, stride = devices ÷ degree),
/// so a pipeline applied after it can shift the group per stage; `degree`
/// must divide `devices`. `strategy` and `option` name them in the error:
/// `tp needs a degree that divides the device count: got tp 3 for 8 devices`.
pub fn strided_group(
    strategy: &str,
    option: &str,
    degree: u32,
    devices: u32,
) -> Result<Vec<u32>, Error> {
    if degree == 0 || degree > devices || !devices.is_multiple_of(degree) {
        return Err(Error::msg(format!(
            "{strategy} needs a degree that divides the device count: got {option} {degree} for {devices} devices"
        )));
    }
    let stride = devices / degree;
    Ok((0..degree).map(|i| i * stride).collect())
}

/// A strategy's error: a message for the user. `?` converts directive errors
/// and option errors into it.
#[derive(Debug, Clone, PartialEq)]
pub struct Error(pub String);

impl Error {
    pub fn msg(m: impl Into<String>) -> Self {
        Error(m.into())
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl From<DagError> for Error {
    fn from(e: DagError) -> Self {
        Error(e.message)
    }
}
impl From<OptionError> for Error {
    fn from(e: OptionError) -> Self {
        Error(e.to_string())
    }
}
impl From<String> for Error {
    fn from(e: String) -> Self {
        Error(e)
    }
}
impl From<&str> for Error {
    fn from(e: &str) -> Self {
        Error(e.to_string())
    }
}

/// What a strategy implements.
pub trait Strategy {
    /// Name, version, description and the options it takes.
    fn info() -> PluginInfo;
    /// Rewrite the DAG. `options` holds every declared option that was given
    /// or has a default, already type-checked by the host.
    fn apply(dag: &mut dyn Dag, options: &Options) -> Result<(), Error>;
}

/// Write a line to the host's log (shown with the plugin's name).
pub fn log(level: LogLevel, message: &str) {
    #[cfg(target_arch = "wasm32")]
    {
        use bindings::piper::strategy::log as l;
        let lv = match level {
            LogLevel::Debug => l::Level::Debug,
            LogLevel::Info => l::Level::Info,
            LogLevel::Warn => l::Level::Warn,
        };
        l::log(lv, message);
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let _ = (level, message);
    }
}

/// Log levels a strategy may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
}

/// Export a [`Strategy`] as the component's `info` and `apply`.
#[macro_export]
macro_rules! export_strategy {
    ($strategy:ty) => {
        #[doc(hidden)]
        pub struct __PiperStrategyExport;
        impl $crate::bindings::Guest for __PiperStrategyExport {
            fn info() -> $crate::bindings::PluginInfo {
                $crate::__export::info::<$strategy>()
            }
            fn apply(
                dag: &$crate::bindings::piper::strategy::dag::TrainingDag,
                options: ::std::vec::Vec<$crate::bindings::OptionEntry>,
            ) -> ::std::result::Result<(), ::std::string::String> {
                $crate::__export::apply::<$strategy>(dag, options)
            }
        }
        $crate::bindings::export!(__PiperStrategyExport with_types_in $crate::bindings);
    };
}

#[doc(hidden)]
pub mod __export {
    use super::*;

    pub fn info<S: Strategy>() -> bindings::PluginInfo {
        S::info().into()
    }

    pub fn apply<S: Strategy>(
        dag: &bindings::piper::strategy::dag::TrainingDag,
        options: Vec<bindings::OptionEntry>,
    ) -> Result<(), String> {
        let options = Options::from_wit(options);
        let mut dag = dag::WitDag(dag);
        S::apply(&mut dag, &options).map_err(|e| e.0)
    }
}
