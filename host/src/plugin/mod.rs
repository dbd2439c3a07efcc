//! Plugin host: loads strategy components (WIT world `piper:strategy/strategy`)
//! with wasmtime and runs their `apply` on the global training DAG. After
//! `dag/` in the flow and before `compile/`.
//!
//! Every call (`info` at load, `apply` per run) gets a **fresh instance** in its
//! own store with:
//! - a memory cap (a [`wasmtime::ResourceLimiter`] that records a refusal),
//! - a fuel budget (deterministic instruction count) and an epoch deadline
//!   (wall clock, a 10 ms ticker),
//! - a wasm stack cap (engine-wide), a cap on calls into the host and on
//!   resource-table entries,
//! - a deny-all WASI 0.2 context: no files, environment, arguments or
//!   sockets; stdout/stderr captured (panic messages come from there);
//!   clocks fixed at the epoch; randomness seeded.
//!
//! `apply` is transactional: the plugin rewrites a copy of the DAG, which
//! replaces the caller's only when `apply` returns `Ok`. Any failure — trap,
//! panic, fuel, deadline, memory, stack, call flood, a directive error, an
//! `Err` from the plugin — becomes a [`PluginError`] naming the plugin (name,
//! version, sha256 prefix), the call and the cause.
//!
//! Compiled components are cached on disk under `$PIPER_HOME/compiled`, keyed
//! by the plugin's sha256 and the engine's compatibility hash; each file
//! carries an HMAC under a per-installation key, so only files this host wrote
//! are ever deserialized.

pub mod author;
mod cache;
mod host_impl;
mod limits;
mod no_sleep;
mod options;
/// What an older contract's module shares with every other: its `log`
/// forwarded to the current one (`$old` and `$new` name the two `log`
/// modules), and its world's records converted (`plugin_info`, `options`;
/// the world's types cannot be mapped by `bindgen`'s `with`).
macro_rules! older_world {
    ($old:ident, $new:ident) => {
        impl $old::Host for PluginState {
            fn log(&mut self, level: $old::Level, message: String) -> wasmtime::Result<()> {
                let level = match level {
                    $old::Level::Trace => $new::Level::Trace,
                    $old::Level::Debug => $new::Level::Debug,
                    $old::Level::Info => $new::Level::Info,
                    $old::Level::Warn => $new::Level::Warn,
                    $old::Level::Error => $new::Level::Error,
                };
                $new::Host::log(self, level, message)
            }
        }

        /// The component's `info()` as the current record.
        pub(super) fn plugin_info(i: bindings::PluginInfo) -> super::bindings::PluginInfo {
            use super::bindings::OptionType as N;
            use bindings::OptionType as O;
            super::bindings::PluginInfo {
                name: i.name,
                version: i.version,
                description: i.description,
                options: i
                    .options
                    .into_iter()
                    .map(|o| super::bindings::OptionSpec {
                        name: o.name,
                        type_: match o.type_ {
                            O::Int => N::Int,
                            O::Float => N::Float,
                            O::Bool => N::Bool,
                            O::Str => N::Str,
                        },
                        default: o.default,
                        help: o.help,
                    })
                    .collect(),
            }
        }

        /// Checked options as the component's `apply` takes them.
        pub(super) fn options(
            entries: &[super::bindings::OptionEntry],
        ) -> Vec<bindings::OptionEntry> {
            use super::bindings::OptionValue as N;
            use bindings::OptionValue as O;
            entries
                .iter()
                .map(|e| bindings::OptionEntry {
                    name: e.name.clone(),
                    value: match &e.value {
                        N::Int(v) => O::Int(*v),
                        N::Float(v) => O::Float(*v),
                        N::Bool(v) => O::Bool(*v),
                        N::Str(v) => O::Str(v.clone()),
                    },
                })
                .collect()
        }
    };
}
use older_world;

mod v01;
mod v02;
mod v03;

pub use cache::CompileCache;
pub use limits::{LimitsError, SandboxLimits};
pub use options::{OptionInfo, OptionType};

/// The `piper:strategy` versions this host accepts, as shown to users.
pub const WIT_ACCEPTED: &str = WIT_ACCEPTS;

use crate::dag::TrainingDag;
use crate::home::{piper_home, sha256_hex};
use limits::{FixedClock, Limiter};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, Store, Trap};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

pub(crate) mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "strategy",
        imports: { default: trappable },
        with: { "piper:strategy/dag.training-dag": super::DagHandle },
    });
}

/// The `piper:strategy` version the SDKs and `piper plugin new` target.
pub const WIT_VERSION: &str = "0.4.0";
/// The versions this host links, each with its own bindings: the current
/// ones above, 0.1.x through `v01.rs`, 0.2.x through `v02.rs`, 0.3.x
/// through `v03.rs`.
const WIT_ACCEPTS: &str = "0.1.x, 0.2.x, 0.3.x or 0.4.x";

/// Which bindings a component's `piper:strategy` version instantiates with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contract {
    V01,
    V02,
    V03,
    V04,
}

impl Contract {
    /// The contract of a version string (`0.3.0`), if this host links it.
    fn of(version: &str) -> Option<Contract> {
        let patch = |minor: &str| {
            version
                .strip_prefix(minor)
                .is_some_and(|p| p.parse::<u32>().is_ok())
        };
        if patch("0.4.") {
            Some(Contract::V04)
        } else if patch("0.3.") {
            Some(Contract::V03)
        } else if patch("0.2.") {
            Some(Contract::V02)
        } else if patch("0.1.") {
            Some(Contract::V01)
        } else {
            None
        }
    }
}

/// An instantiated component, through the bindings of its version.
enum Instance {
    V01(v01::bindings::Strategy),
    V02(v02::bindings::Strategy),
    V03(v03::bindings::Strategy),
    V04(bindings::Strategy),
}

/// Strategy components bundled into the binary at build time: (name, wasm).
pub mod bundled {
    include!(concat!(env!("OUT_DIR"), "/bundled.rs"));

    /// The bundled plugin called `name`.
    pub fn get(name: &str) -> Option<&'static [u8]> {
        BUNDLED.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
    }

    /// Names of the bundled plugins.
    pub fn names() -> Vec<&'static str> {
        BUNDLED.iter().map(|(n, _)| *n).collect()
    }
}

/// The host-side resource behind `training-dag`: the store's DAG.
pub struct DagHandle;

/// Everything one plugin call can touch.
pub(crate) struct PluginState {
    wasi: WasiCtx,
    table: ResourceTable,
    /// The working copy `apply` rewrites.
    pub(crate) dag: Option<TrainingDag>,
    limiter: Limiter,
    pub(crate) calls: u64,
    pub(crate) max_calls: u64,
    /// Why the host stopped the plugin, when it did so from a host call.
    pub(crate) stop: Option<Cause>,
    /// The last directive error returned to the plugin, and whether it was
    /// a host-budget refusal.
    pub(crate) last_directive_error: Option<(String, bool)>,
    pub(crate) logs: Vec<String>,
    /// Bytes of `logs`; lines past `max_log_bytes` are dropped and counted.
    pub(crate) log_bytes: usize,
    pub(crate) dropped_lines: u64,
    pub(crate) dropped_bytes: u64,
    pub(crate) plugin: String,
    /// The host budget's argument and message bounds.
    pub(crate) limits: SandboxLimits,
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// What a plugin's `info()` returned.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub description: String,
    pub options: Vec<OptionInfo>,
}

/// A loaded, compiled plugin.
#[derive(Clone)]
pub struct Plugin {
    pub info: PluginInfo,
    /// Hex sha256 of the component bytes.
    pub sha256: String,
    /// The `piper:strategy` version it was built against.
    pub wit_version: String,
    /// Where it came from (bundled name or path).
    pub origin: String,
    component: Component,
}

impl Plugin {
    /// `1f1b@0.1.0 (sha256 3fa2b1c9d0e4)`.
    pub fn ident(&self) -> String {
        format!(
            "`{}@{}` (sha256 {})",
            self.info.name,
            self.info.version,
            &self.sha256[..12]
        )
    }
}

/// Why a plugin call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Cause {
    #[error("cannot read or compile the component: {0}")]
    Load(String),
    #[error("it imports what the host does not provide: {}; a strategy may import only WASI 0.2 and piper:strategy@{WIT_ACCEPTS}", .0.join(", "))]
    Imports(Vec<String>),
    #[error("it was built against piper:strategy@{found}, but this host accepts piper:strategy@{accepted}")]
    Version { found: String, accepted: String },
    #[error("ran out of fuel: the budget of {0} instructions is spent (sandbox.fuel)")]
    Fuel(u64),
    #[error("exceeded its wall-clock deadline of {0} ms (sandbox.deadline_ms)")]
    Deadline(u64),
    #[error("exceeded its memory cap of {0} MiB (sandbox.memory_mib)")]
    Memory(u64),
    #[error("overflowed its wasm stack of {0} KiB (sandbox.max_wasm_stack_kib)")]
    Stack(u64),
    #[error("made more than {0} calls into the host (sandbox.max_host_calls)")]
    HostCalls(u64),
    #[error("holds more than {0} resources (sandbox.max_table_entries)")]
    Resources(usize),
    #[error("tried to sleep for {0} ns: plugins run on a stopped clock and may not block (sleeps and timers are refused)")]
    Sleep(u64),
    #[error("wrote more than {0} bytes to stdout/stderr (sandbox.max_log_bytes)")]
    Output(usize),
    #[error("{0}")]
    Limit(String),
    #[error(transparent)]
    Limits(#[from] LimitsError),
    #[error("panicked: {0}")]
    Panic(String),
    #[error("trapped: {0}")]
    Trap(String),
    #[error("a directive failed: {0}")]
    Directive(String),
    #[error("returned an error: {0}")]
    Returned(String),
    #[error("{0}")]
    Options(String),
}

/// A failed plugin call: which plugin, which call, why.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("plugin {plugin}: {call}: {cause}")]
pub struct PluginError {
    /// `name@version (sha256 prefix)`, or the origin before `info` is known.
    pub plugin: String,
    /// `load`, `info` or `apply`.
    pub call: String,
    pub cause: Cause,
}

/// What one `apply` did.
#[derive(Clone, Debug)]
pub struct ApplyReport {
    pub host_calls: u64,
    pub fuel_used: u64,
    pub elapsed: Duration,
    pub logs: Vec<String>,
    /// Log lines dropped past `sandbox.max_log_bytes`, and their bytes.
    pub dropped_log_lines: u64,
    pub dropped_log_bytes: u64,
    /// Host work units the plugin's calls cost (`sandbox.max_host_work`).
    pub host_work: u64,
}

/// What [`PluginHost::inspect`] found in a component.
pub struct Inspection {
    /// Hex sha256 of the bytes.
    pub sha256: String,
    pub bytes: usize,
    /// Import names as the component declares them (`wasi:io/streams@0.2.6`, ...).
    pub imports: Vec<String>,
    /// Export names (`info`, `apply`).
    pub exports: Vec<String>,
    /// The `piper:strategy` version it imports, if it imports one.
    pub wit_version: Option<String>,
    /// The plugin with its `info()`, or why this host refuses it.
    pub verdict: Result<Plugin, PluginError>,
}

/// Loads and runs strategy plugins.
pub struct PluginHost {
    engine: Engine,
    linker: Linker<PluginState>,
    limits: SandboxLimits,
    cache: Option<CompileCache>,
    compiles: AtomicU64,
    cache_hits: AtomicU64,
    ticker_stop: Arc<AtomicBool>,
}

impl Drop for PluginHost {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

/// One epoch tick.
const TICK: Duration = Duration::from_millis(10);

impl PluginHost {
    /// A host with these limits; `cache` = where compiled components are kept
    /// (`None`: compile every time).
    pub fn new(limits: SandboxLimits, cache: Option<PathBuf>) -> Result<Self, PluginError> {
        let fail = |m: String| PluginError {
            plugin: "host".into(),
            call: "start".into(),
            cause: Cause::Load(m),
        };
        limits.validate().map_err(|e| PluginError {
            plugin: "host".into(),
            call: "start".into(),
            cause: Cause::Limits(e),
        })?;
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.consume_fuel(true);
        config.epoch_interruption(true);
        config.max_wasm_stack(limits.max_wasm_stack_kib as usize * 1024);
        let engine = Engine::new(&config).map_err(|e| fail(format!("{e:#}")))?;
        let mut linker: Linker<PluginState> = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(|e| fail(format!("{e:#}")))?;
        v01::bindings::Strategy::add_to_linker::<_, HasSelf<PluginState>>(&mut linker, |s| s)
            .map_err(|e| fail(format!("{e:#}")))?;
        v02::bindings::Strategy::add_to_linker::<_, HasSelf<PluginState>>(&mut linker, |s| s)
            .map_err(|e| fail(format!("{e:#}")))?;
        v03::bindings::Strategy::add_to_linker::<_, HasSelf<PluginState>>(&mut linker, |s| s)
            .map_err(|e| fail(format!("{e:#}")))?;
        bindings::Strategy::add_to_linker::<_, HasSelf<PluginState>>(&mut linker, |s| s)
            .map_err(|e| fail(format!("{e:#}")))?;
        no_sleep::shadow_clock_subscriptions(&mut linker).map_err(|e| fail(format!("{e:#}")))?;
        let ticker_stop = Arc::new(AtomicBool::new(false));
        {
            let engine = engine.clone();
            let stop = ticker_stop.clone();
            std::thread::Builder::new()
                .name("piper-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(TICK);
                        engine.increment_epoch();
                    }
                })
                .map_err(|e| fail(e.to_string()))?;
        }
        let cache = match cache {
            Some(dir) => Some(CompileCache::open(&dir).map_err(|e| fail(e.to_string()))?),
            None => None,
        };
        Ok(PluginHost {
            engine,
            linker,
            limits,
            cache,
            compiles: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            ticker_stop,
        })
    }

    /// The default cache directory: `$PIPER_HOME/compiled`, `$PIPER_HOME`
    /// defaulting to `$XDG_CACHE_HOME/piper` or `~/.cache/piper`.
    pub fn default_cache_dir() -> PathBuf {
        piper_home().join("compiled")
    }

    pub fn limits(&self) -> &SandboxLimits {
        &self.limits
    }
    /// Components compiled (cache misses) so far.
    pub fn compiles(&self) -> u64 {
        self.compiles.load(Ordering::Relaxed)
    }
    /// Components loaded from the compile cache so far.
    pub fn cache_hits(&self) -> u64 {
        self.cache_hits.load(Ordering::Relaxed)
    }

    /// Load a plugin by bundled name (`1f1b`) or path to a `.wasm` component.
    pub fn load(&self, spec: &str) -> Result<Plugin, PluginError> {
        if let Some(bytes) = bundled::get(spec) {
            return self.load_bytes(bytes, spec);
        }
        let path = Path::new(spec);
        if path.exists() || spec.ends_with(".wasm") {
            return self.load_file(path);
        }
        Err(PluginError {
            plugin: format!("`{spec}`"),
            call: "load".into(),
            cause: Cause::Load(format!(
                "no bundled strategy of that name and no such file; bundled: {}",
                bundled::names().join(", ")
            )),
        })
    }

    pub fn load_file(&self, path: &Path) -> Result<Plugin, PluginError> {
        let bytes = std::fs::read(path).map_err(|e| PluginError {
            plugin: format!("`{}`", path.display()),
            call: "load".into(),
            cause: Cause::Load(e.to_string()),
        })?;
        self.load_bytes(&bytes, &path.display().to_string())
    }

    /// Compile (or fetch from the cache), check imports and read `info()`.
    pub fn load_bytes(&self, bytes: &[u8], origin: &str) -> Result<Plugin, PluginError> {
        let sha256 = sha256_hex(bytes);
        let who = format!("`{origin}` (sha256 {})", &sha256[..12]);
        let fail = |call: &str, cause: Cause| PluginError {
            plugin: who.clone(),
            call: call.into(),
            cause,
        };
        let component = self
            .compile(bytes, &sha256)
            .map_err(|e| fail("load", Cause::Load(e)))?;
        self.load_compiled(component, sha256, origin)
    }

    /// Check the imports of a compiled component and read its `info()`.
    fn load_compiled(
        &self,
        component: Component,
        sha256: String,
        origin: &str,
    ) -> Result<Plugin, PluginError> {
        let who = format!("`{origin}` (sha256 {})", &sha256[..12]);
        let fail = |call: &str, cause: Cause| PluginError {
            plugin: who.clone(),
            call: call.into(),
            cause,
        };
        let wit_version = self
            .check_imports(&component)
            .map_err(|c| fail("load", c))?;
        let mut plugin = Plugin {
            info: PluginInfo {
                name: origin.to_string(),
                version: String::new(),
                description: String::new(),
                options: Vec::new(),
            },
            sha256,
            wit_version,
            origin: origin.into(),
            component,
        };
        plugin.info = self.call_info(&plugin).map_err(|c| fail("info", c))?;
        Ok(plugin)
    }

    /// What `piper plugin check` reports: the component's imports and
    /// exports, the `piper:strategy` version it imports, and whether this
    /// host accepts it (with `info()` if so). Never runs `apply`. An error
    /// only when the bytes are not a component at all.
    pub fn inspect(&self, bytes: &[u8], origin: &str) -> Result<Inspection, PluginError> {
        let sha256 = sha256_hex(bytes);
        let component = self.compile(bytes, &sha256).map_err(|e| PluginError {
            plugin: format!("`{origin}` (sha256 {})", &sha256[..12]),
            call: "load".into(),
            cause: Cause::Load(e),
        })?;
        let ty = component.component_type();
        let imports: Vec<String> = ty
            .imports(&self.engine)
            .map(|(n, _)| n.to_string())
            .collect();
        let exports: Vec<String> = ty
            .exports(&self.engine)
            .map(|(n, _)| n.to_string())
            .collect();
        let wit_version = imports.iter().find_map(|n| {
            n.strip_prefix("piper:strategy/")
                .and_then(|rest| rest.split_once('@'))
                .map(|(_, v)| v.to_string())
        });
        let verdict = self.load_compiled(component, sha256.clone(), origin);
        Ok(Inspection {
            sha256,
            bytes: bytes.len(),
            imports,
            exports,
            wit_version,
            verdict,
        })
    }

    fn compile(&self, bytes: &[u8], sha256: &str) -> Result<Component, String> {
        let engine_hash = cache::engine_hash(&self.engine);
        if let Some(cache) = &self.cache {
            if let Some(c) = cache.get(&self.engine, sha256, &engine_hash) {
                self.cache_hits.fetch_add(1, Ordering::Relaxed);
                tracing::info!("plugin {}: loaded from the compile cache", &sha256[..12]);
                return Ok(c);
            }
        }
        not_a_component(bytes)?;
        let t = Instant::now();
        let component = Component::new(&self.engine, bytes).map_err(|e| one_line(&e))?;
        self.compiles.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            "plugin {}: compiled in {:.0} ms (cache miss)",
            &sha256[..12],
            t.elapsed().as_secs_f64() * 1e3
        );
        if let Some(cache) = &self.cache {
            if let Err(e) = cache.put(&component, sha256, &engine_hash) {
                tracing::warn!("could not write the compile cache: {e}");
            }
        }
        Ok(component)
    }

    /// Refuse imports beyond WASI 0.2 and a compatible `piper:strategy`.
    fn check_imports(&self, component: &Component) -> Result<String, Cause> {
        let ty = component.component_type();
        let mut unexpected = Vec::new();
        let mut version = None;
        for (name, _) in ty.imports(&self.engine) {
            let (path, ver) = name.split_once('@').unwrap_or((name, ""));
            if let Some(iface) = path.strip_prefix("piper:strategy/") {
                if !["types", "dag", "log"].contains(&iface) {
                    unexpected.push(name.to_string());
                    continue;
                }
                if Contract::of(ver).is_none() || version.as_deref().is_some_and(|v| v != ver) {
                    return Err(Cause::Version {
                        found: ver.to_string(),
                        accepted: WIT_ACCEPTS.into(),
                    });
                }
                version = Some(ver.to_string());
            } else if path.starts_with("wasi:") && ver.starts_with("0.2.") {
                // WASI 0.2: provided, deny-all.
            } else if name == "training-dag" {
                // The world's `use dag.{training-dag}`: a type, not a capability.
            } else {
                unexpected.push(name.to_string());
            }
        }
        if !unexpected.is_empty() {
            return Err(Cause::Imports(unexpected));
        }
        Ok(version.unwrap_or_else(|| WIT_VERSION.to_string()))
    }

    fn new_store(
        &self,
        dag: Option<TrainingDag>,
        plugin: &str,
    ) -> (Store<PluginState>, MemoryOutputPipe) {
        let l = &self.limits;
        let stdout = MemoryOutputPipe::new(l.max_log_bytes);
        let stderr = MemoryOutputPipe::new(l.max_log_bytes);
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(stdout)
            .stderr(stderr.clone())
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .wall_clock(FixedClock)
            .monotonic_clock(FixedClock)
            .secure_random(wasmtime_wasi::Deterministic::new(vec![
                0x5e, 0xed, 0x00, 0x01,
            ]))
            .insecure_random(wasmtime_wasi::Deterministic::new(vec![
                0x5e, 0xed, 0x00, 0x02,
            ]))
            .insecure_random_seed(0x5eed)
            .max_random_size(64 << 10);
        let mut table = ResourceTable::new();
        // WASI resources (streams, pollables) count against the same cap.
        table.set_max_capacity(l.max_table_entries);
        let dag = dag.map(|mut d| {
            d.set_budget(Some(l.dag_budget()));
            d
        });
        let state = PluginState {
            wasi: wasi.build(),
            table,
            dag,
            limiter: Limiter::new(l.memory_mib as usize * 1024 * 1024),
            calls: 0,
            max_calls: l.max_host_calls,
            stop: None,
            last_directive_error: None,
            logs: Vec::new(),
            log_bytes: 0,
            dropped_lines: 0,
            dropped_bytes: 0,
            plugin: plugin.to_string(),
            limits: l.clone(),
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_fuel(l.fuel).expect("fuel is enabled");
        store.set_hostcall_fuel(usize::try_from(l.argument_bytes()).unwrap_or(usize::MAX));
        store.set_epoch_deadline(l.deadline_ms.div_ceil(TICK.as_millis() as u64) + 1);
        (store, stderr)
    }

    /// Turn a wasmtime error into the cause a user can act on.
    fn cause(
        &self,
        store: &mut Store<PluginState>,
        stderr: &MemoryOutputPipe,
        e: wasmtime::Error,
    ) -> Cause {
        if let Some(c) = store.data_mut().stop.take() {
            return c;
        }
        let l = &self.limits;
        if store.data().limiter.refused {
            return Cause::Memory(l.memory_mib);
        }
        let table_full = e.chain().any(|c| {
            matches!(
                c.downcast_ref::<wasmtime::component::ResourceTableError>(),
                Some(wasmtime::component::ResourceTableError::Full)
            )
        });
        if table_full {
            return Cause::Resources(l.max_table_entries);
        }
        if format!("{e:#}").contains("write beyond capacity of MemoryOutputPipe") {
            return Cause::Output(l.max_log_bytes);
        }
        // wasmtime's hostcall fuel: lifting one call's arguments (or a
        // result) would copy more than `argument_bytes` out of the guest.
        if format!("{e:#}").contains("fuel allocated for hostcalls has been exhausted") {
            return Cause::Limit(format!(
                "over the host budget `sandbox.max_host_bytes` = {}: one call's arguments would copy more than {} into the host (an eighth of the budget, at most 128 MiB; lists or strings repeated by reference count each time)",
                l.max_host_bytes,
                crate::compile::human_bytes(l.argument_bytes())
            ));
        }
        let err_text = String::from_utf8_lossy(&stderr.contents()).into_owned();
        match e.downcast_ref::<Trap>() {
            Some(Trap::OutOfFuel) => return Cause::Fuel(l.fuel),
            Some(Trap::Interrupt) => return Cause::Deadline(l.deadline_ms),
            Some(Trap::StackOverflow) => return Cause::Stack(l.max_wasm_stack_kib),
            _ => {}
        }
        if let Some(msg) = panic_message(&err_text) {
            // Rust's std panics when the capped stdout/stderr pipe refuses a write.
            if msg.starts_with("failed printing to std") {
                return Cause::Output(l.max_log_bytes);
            }
            return Cause::Panic(clip(msg, l.max_error_bytes));
        }
        let mut text = format!("{e:#}");
        if !err_text.trim().is_empty() {
            text.push_str(&format!("; stderr: {}", err_text.trim()));
        }
        Cause::Trap(clip(text, l.max_error_bytes))
    }

    /// Instantiate a plugin with the bindings of the version it imports.
    fn instantiate(
        &self,
        store: &mut Store<PluginState>,
        plugin: &Plugin,
    ) -> Result<Instance, Cause> {
        let load = |e: wasmtime::Error| Cause::Load(format!("{e:#}"));
        Ok(match Contract::of(&plugin.wit_version) {
            Some(Contract::V01) => Instance::V01(
                v01::bindings::Strategy::instantiate(store, &plugin.component, &self.linker)
                    .map_err(load)?,
            ),
            Some(Contract::V02) => Instance::V02(
                v02::bindings::Strategy::instantiate(store, &plugin.component, &self.linker)
                    .map_err(load)?,
            ),
            Some(Contract::V03) => Instance::V03(
                v03::bindings::Strategy::instantiate(store, &plugin.component, &self.linker)
                    .map_err(load)?,
            ),
            _ => Instance::V04(
                bindings::Strategy::instantiate(store, &plugin.component, &self.linker)
                    .map_err(load)?,
            ),
        })
    }

    fn call_info(&self, plugin: &Plugin) -> Result<PluginInfo, Cause> {
        let (mut store, stderr) = self.new_store(None, &plugin.origin);
        let info = match self.instantiate(&mut store, plugin)? {
            Instance::V01(i) => i.call_info(&mut store).map(v01::plugin_info),
            Instance::V02(i) => i.call_info(&mut store).map(v02::plugin_info),
            Instance::V03(i) => i.call_info(&mut store).map(v03::plugin_info),
            Instance::V04(i) => i.call_info(&mut store),
        }
        .map_err(|e| self.cause(&mut store, &stderr, e))?;
        Ok(PluginInfo {
            name: info.name,
            version: info.version,
            description: info.description,
            options: info
                .options
                .into_iter()
                .map(|o| OptionInfo {
                    name: o.name,
                    ty: match o.type_ {
                        bindings::OptionType::Int => OptionType::Int,
                        bindings::OptionType::Float => OptionType::Float,
                        bindings::OptionType::Bool => OptionType::Bool,
                        bindings::OptionType::Str => OptionType::Str,
                    },
                    default: o.default,
                    help: o.help,
                })
                .collect(),
        })
    }

    /// Run the plugin's `apply` on `dag`. On any failure `dag` is unchanged.
    pub fn apply(
        &self,
        plugin: &Plugin,
        dag: &mut TrainingDag,
        options: &[(String, String)],
    ) -> Result<ApplyReport, PluginError> {
        let fail = |cause: Cause| PluginError {
            plugin: plugin.ident(),
            call: "apply".into(),
            cause,
        };
        if !Engine::same(plugin.component.engine(), &self.engine) {
            return Err(fail(Cause::Load(
                "this plugin was loaded by another PluginHost; load it with the host that applies it".into(),
            )));
        }
        let entries = Self::check_options(plugin, options).map_err(fail)?;
        let t = Instant::now();
        let (mut store, stderr) = self.new_store(Some(dag.clone()), &plugin.ident());
        let inst = self.instantiate(&mut store, plugin).map_err(fail)?;
        let handle = store
            .data_mut()
            .table
            .push(DagHandle)
            .map_err(|e| fail(Cause::Load(e.to_string())))?;
        let result = match inst {
            Instance::V01(i) => i.call_apply(&mut store, handle, &v01::options(&entries)),
            Instance::V02(i) => i.call_apply(&mut store, handle, &v02::options(&entries)),
            Instance::V03(i) => i.call_apply(&mut store, handle, &v03::options(&entries)),
            Instance::V04(i) => i.call_apply(&mut store, handle, &entries),
        };
        let fuel_used = self.limits.fuel - store.get_fuel().unwrap_or(0);
        let max_err = self.limits.max_error_bytes;
        let outcome = match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(msg)) => Err(match store.data().last_directive_error.as_ref() {
                Some((d, limit)) if msg.contains(d.as_str()) || d.contains(&msg) => {
                    if *limit {
                        Cause::Limit(clip(msg, max_err))
                    } else {
                        Cause::Directive(clip(msg, max_err))
                    }
                }
                _ => Cause::Returned(clip(msg, max_err)),
            }),
            Err(e) => Err(self.cause(&mut store, &stderr, e)),
        };
        let state = store.into_data();
        for line in &state.logs {
            tracing::info!("{line}");
        }
        if state.dropped_lines > 0 {
            tracing::warn!(
                "plugin {}: {} log lines ({} bytes) dropped past sandbox.max_log_bytes = {}",
                plugin.ident(),
                state.dropped_lines,
                state.dropped_bytes,
                self.limits.max_log_bytes
            );
        }
        outcome.map_err(fail)?;
        let mut new_dag = state.dag.expect("the DAG stays in the store");
        let host_work = new_dag.work_used();
        new_dag.set_budget(None);
        *dag = new_dag;
        Ok(ApplyReport {
            host_calls: state.calls,
            fuel_used,
            elapsed: t.elapsed(),
            logs: state.logs,
            dropped_log_lines: state.dropped_lines,
            dropped_log_bytes: state.dropped_bytes,
            host_work,
        })
    }
}

/// A message cut to `max` bytes (on a character boundary), saying how much
/// was elided.
pub(crate) fn clip(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let total = s.len();
    let mut cut = max.saturating_sub(40);
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s.push_str(&format!("… ({} bytes elided)", total - cut));
    s
}

/// The message of a Rust panic from a guest's stderr.
fn panic_message(stderr: &str) -> Option<String> {
    let at = stderr.find("panicked at")?;
    let rest = &stderr[at..];
    let mut lines = rest.lines();
    let location = lines.next()?.trim_end_matches(':').to_string();
    let msg: Vec<&str> = lines.take_while(|l| !l.starts_with("note:")).collect();
    Some(format!(
        "{} ({})",
        msg.join(" ").trim(),
        location.replace("panicked at ", "at ")
    ))
}

/// What the first eight bytes say when they are not a component's header:
/// the wasm magic number, then the component encoding's version and layer
/// (`0d 00 01 00`; a core module has version 1, layer 0).
fn not_a_component(bytes: &[u8]) -> Result<(), String> {
    const MAGIC: &[u8; 4] = b"\0asm";
    const COMPONENT: [u8; 4] = [0x0d, 0x00, 0x01, 0x00];
    const MODULE: [u8; 4] = [0x01, 0x00, 0x00, 0x00];
    if bytes.len() < 8 || &bytes[..4] != MAGIC {
        return Err(format!(
            "not a WebAssembly component (bad magic number: the file starts with {}, a component with 00 61 73 6d)",
            hex_prefix(bytes)
        ));
    }
    match &bytes[4..8] {
        v if v == COMPONENT => Ok(()),
        v if v == MODULE => Err(
            "a core WebAssembly module, not a component: build for wasm32-wasip2, or wrap it with \
             `wasm-tools component new` (strategies are components of the piper:strategy world)"
                .into(),
        ),
        _ => Err(format!(
            "not a WebAssembly component (unknown version and layer {})",
            hex_prefix(&bytes[4..8])
        )),
    }
}

/// Up to the first 8 bytes as hex, for messages.
fn hex_prefix(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "nothing (an empty file)".into();
    }
    bytes
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A compile error in one line: the chain's messages joined, each one's
/// lines folded (wasmparser spreads its expected bytes over many).
fn one_line(e: &wasmtime::Error) -> String {
    e.chain()
        .map(|c| {
            c.to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect::<Vec<_>>()
        .join(": ")
}
