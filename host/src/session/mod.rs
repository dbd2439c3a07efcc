//! The session: a run config → the model's DAG → its strategies loaded
//! (bundled, from a file, or pulled and verified from a registry) and
//! applied → the plan. What `piper plan`, `train`, `search`, `plugin verify`
//! and `calibrate` share, and what a program using Piper as a library calls:
//!
//! ```no_run
//! use piper::runtime::{train_loop, Corpus, LoopConfig, TrainOptions, Trainer};
//! use piper::session::{prepare, Overrides, RunConfig, Sources};
//! let config = RunConfig::resolve(&Overrides {
//!     model: Some("tiny".into()),
//!     devices: Some(2),
//!     strategies: vec!["1f1b:microbatches=4".into()],
//!     ..Default::default()
//! })?;
//! let prepared = prepare(&config, &Sources::offline(), 2)?;
//! let model = config.model_config()?;
//! let mut trainer = Trainer::new(&model, prepared.compile()?, TrainOptions::default())?;
//! let run = LoopConfig { steps: 20, ..Default::default() };
//! let summary = train_loop(&mut trainer, &model, &Corpus::builtin(), None, &run, &mut ())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//! The training loop over a plan is [`crate::runtime::train_loop`].

pub mod config;

pub use config::{
    parse_size, ConfigError, ModelSpec, OptimizerConfig, Overrides, RegistryConfig, RunConfig,
    StrategySpec, DEFAULT_STRATEGY,
};

use crate::compile::{compile, CompileError, Plan};
use crate::dag::{Cluster, TrainingDag};
use crate::model::ModelError;
use crate::plugin::{Plugin, PluginError, PluginHost};
use crate::registry::{self, RegistryError};
use std::path::PathBuf;

/// What stopped a session, by stage; each names what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("--devices must be at least 1")]
    NoDevices,
    #[error("building the model DAG")]
    Dag(#[source] ModelError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("compiling the plan of `{strategies}`")]
    Compile {
        strategies: String,
        #[source]
        source: Box<CompileError>,
    },
}

type Result<T, E = SessionError> = std::result::Result<T, E>;

/// Where `oci://` plugins may come from.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// How registries may be reached (offline: the local store only).
    pub access: registry::Access,
    /// The lockfile pinning `oci://` plugins; without one, `piper.lock`
    /// beside the run config when there is one.
    pub lock: Option<PathBuf>,
}

impl Sources {
    /// The local plugin store only: no registry is contacted.
    pub fn offline() -> Self {
        Sources {
            access: registry::Access {
                offline: true,
                insecure: false,
            },
            lock: None,
        }
    }
}

/// A model DAG with every strategy applied, ready to compile.
pub struct Prepared {
    pub config: RunConfig,
    pub dag: TrainingDag,
    /// One line per applied strategy.
    pub applied: Vec<String>,
}

impl Prepared {
    /// The strategies as the user gave them: `tp:tp=2 + dp:degree=2`.
    pub fn strategies(&self) -> String {
        let specs: Vec<String> = (self.config.strategies.iter())
            .map(|s| {
                let opts: Vec<String> = s.options.iter().map(|(k, v)| format!("{k}={v}")).collect();
                match opts.is_empty() {
                    true => s.name.clone(),
                    false => format!("{}:{}", s.name, opts.join(",")),
                }
            })
            .collect();
        specs.join(" + ")
    }

    /// Compile the DAG; an error names the strategies that made it.
    pub fn compile(&self) -> Result<Plan> {
        compile(&self.dag).map_err(|source| SessionError::Compile {
            strategies: self.strategies(),
            source: Box::new(source),
        })
    }
}

/// Build the model's DAG on the config's devices (`default_devices` when it
/// gives none), load the strategies and apply them in order.
pub fn prepare(config: &RunConfig, sources: &Sources, default_devices: u32) -> Result<Prepared> {
    let model = config.model_config()?;
    let devices = config.devices.unwrap_or(default_devices);
    if devices == 0 {
        return Err(SessionError::NoDevices);
    }
    let mut dag = TrainingDag::build(&model, Cluster::new(devices)).map_err(SessionError::Dag)?;
    let strategies = Strategies::load(config, sources)?;
    let applied = strategies.apply(&mut dag)?;
    Ok(Prepared {
        config: config.clone(),
        dag,
        applied,
    })
}

/// The run's strategies, loaded into one sandboxed host.
pub struct Strategies {
    pub host: PluginHost,
    pub plugins: Vec<(Plugin, Vec<(String, String)>)>,
}

/// Loads plugins by the names a run gives them: bundled names and paths
/// directly, `oci://` references through the local store (pulled and
/// verified, pinned by the lockfile, signed by a trusted key).
pub struct Loader<'a> {
    pub host: &'a PluginHost,
    lock: Option<registry::Lockfile>,
    trust: registry::Trust,
    access: registry::Access,
}

impl<'a> Loader<'a> {
    pub fn new(host: &'a PluginHost, config: &RunConfig, sources: &Sources) -> Result<Self> {
        let beside = config.path.as_deref().map(registry::Lockfile::beside);
        let lock = match (&sources.lock, beside) {
            (Some(p), _) => Some(registry::Lockfile::read(p)?),
            (None, Some(b)) if b.is_file() => Some(registry::Lockfile::read(&b)?),
            _ => None,
        };
        let trust = registry::Trust::new(&config.registry.trusted_keys)?;
        Ok(Loader {
            host,
            lock,
            trust,
            access: sources.access.clone(),
        })
    }

    pub fn load(&self, name: &str) -> Result<Plugin> {
        if registry::Reference::is_oci(name) {
            let store = registry::Store::open(&registry::Store::default_dir())?;
            let r = registry::resolve_for_run(
                name,
                &store,
                &self.access,
                self.lock.as_ref(),
                &self.trust,
                self.host,
            )?;
            return Ok(self.host.load_bytes(&r.bytes, &r.origin)?);
        }
        Ok(self.host.load(name)?)
    }
}

impl Strategies {
    /// Load every strategy of `config`, under its `[sandbox]` limits.
    pub fn load(config: &RunConfig, sources: &Sources) -> Result<Self> {
        let host = PluginHost::new(
            config.sandbox.clone(),
            Some(PluginHost::default_cache_dir()),
        )?;
        let plugins = {
            let loader = Loader::new(&host, config, sources)?;
            let mut plugins = Vec::new();
            for s in &config.strategies {
                plugins.push((loader.load(&s.name)?, s.options.clone()));
            }
            plugins
        };
        Ok(Strategies { host, plugins })
    }

    /// Apply them in order to `dag`; one line per strategy saying what it
    /// cost.
    pub fn apply(&self, dag: &mut TrainingDag) -> Result<Vec<String>> {
        let mut applied = Vec::new();
        for (plugin, options) in &self.plugins {
            let report = self.host.apply(plugin, dag, options)?;
            applied.push(format!(
                "{}@{} ({}): {} host calls, {:.2e} fuel, {:.1} ms",
                plugin.info.name,
                plugin.info.version,
                options
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(","),
                report.host_calls,
                report.fuel_used as f64,
                report.elapsed.as_secs_f64() * 1e3
            ));
        }
        Ok(applied)
    }
}
