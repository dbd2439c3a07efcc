//! The `piper` command line (clap): `plan`, `train`, `plugin info|list|new|build|check`.
//! The last stage of the flow for a user; errors here are `anyhow` chains
//! of the typed errors of each stage.

mod config;
#[cfg(feature = "mpi")]
mod job;
mod train;

pub use config::{RunConfig, StrategySpec};

use crate::compile::compile;
use crate::dag::{Cluster, TrainingDag};
use crate::plugin::author::{self, Lang};
use crate::plugin::{bundled, PluginHost};
use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "piper",
    version,
    about = "Piper: distributed training with strategies as sandboxed Wasm plugins"
)]
struct Cli {
    /// Log what the host does (plugin compiles, cache hits, plugin logs).
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply strategies to a model's DAG and print the per-device plans.
    Plan(PlanArgs),
    /// Train: apply the strategies, compile, and run the plans on virtual CPU devices.
    Train(train::TrainArgs),
    /// Inspect strategy plugins.
    #[command(subcommand)]
    Plugin(PluginCommand),
}

/// What a run is made of; flags override the `--config` file.
#[derive(Args, Clone, Default)]
pub struct RunArgs {
    /// Run config (TOML): model, devices, strategies with options, sandbox limits.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A preset (`tiny`, `gpt2-small`) or a model TOML file.
    #[arg(long)]
    pub model: Option<String>,
    /// Number of (virtual) devices.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..))]
    pub devices: Option<u32>,
    /// A strategy: bundled name or path to a .wasm component, with options:
    /// `1f1b:microbatches=8,stages=4`. Repeat to compose (`--strategy dp:degree=2 --strategy 1f1b`).
    #[arg(long = "strategy", value_name = "NAME[:k=v,...]")]
    pub strategies: Vec<String>,
}

#[derive(Args)]
struct PlanArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
    /// Write the plan to this file instead of standard output.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Subcommand)]
enum PluginCommand {
    /// What a plugin's `info()` returns, its WIT version and sha256, and the
    /// sandbox limits and host budget it runs under.
    Info {
        /// Bundled name or path to a .wasm component.
        plugin: String,
        #[arg(long)]
        json: bool,
        /// Run config whose `[sandbox]` table sets the limits (default: the defaults).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The bundled strategies.
    List,
    /// Write a working skeleton of a new strategy in a new folder NAME.
    New {
        /// Folder and plugin name: lowercase letters, digits and '-'.
        name: String,
        /// The language to write it in.
        #[arg(long, value_enum)]
        lang: Lang,
        /// Where to create the folder (default: the current one).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Build the plugin in DIR (language detected from its files) into
    /// DIR/build/NAME.wasm.
    Build {
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Write the component here instead.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// What the host sees in a component: WIT version, imports, exports,
    /// `info()`, and whether this host accepts it (never runs `apply`).
    Check {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = if cli.verbose {
        tracing::Level::INFO
    } else {
        tracing::Level::WARN
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .try_init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Plan(a) => plan(a),
        Command::Train(a) => train::train(a),
        Command::Plugin(PluginCommand::Info {
            plugin,
            json,
            config,
        }) => plugin_info(&plugin, json, config),
        Command::Plugin(PluginCommand::List) => plugin_list(),
        Command::Plugin(PluginCommand::New { name, lang, dir }) => {
            let made = author::new_plugin(&name, lang, &dir)?;
            println!("created {} ({} strategy)", made.display(), lang.title());
            println!("next: piper plugin build {}", made.display());
            Ok(())
        }
        Command::Plugin(PluginCommand::Build { dir, out }) => {
            let built = author::build(&dir, out.as_deref())?;
            println!("{}", built.component.display());
            Ok(())
        }
        Command::Plugin(PluginCommand::Check { file, json }) => plugin_check(&file, json),
    }
}

/// A model DAG with every strategy applied, ready to compile.
pub struct Prepared {
    pub config: RunConfig,
    pub dag: TrainingDag,
    /// One line per applied strategy.
    pub applied: Vec<String>,
}

/// Resolve config + flags, build the DAG, load and apply the strategies.
pub fn prepare(args: &RunArgs) -> Result<Prepared> {
    prepare_with(args, 4)
}

/// [`prepare`] with the device count used when neither flags nor config
/// give one (an MPI job: the world size).
pub fn prepare_with(args: &RunArgs, default_devices: u32) -> Result<Prepared> {
    let config = RunConfig::resolve(args)?;
    let model = config.model_config()?;
    let devices = config.devices.unwrap_or(default_devices);
    if devices == 0 {
        bail!("--devices must be at least 1");
    }
    let mut dag =
        TrainingDag::build(&model, Cluster::new(devices)).context("building the model DAG")?;
    let host = PluginHost::new(
        config.sandbox.clone(),
        Some(PluginHost::default_cache_dir()),
    )?;
    let mut applied = Vec::new();
    for s in &config.strategies {
        let plugin = host.load(&s.name)?;
        let report = host.apply(&plugin, &mut dag, &s.options)?;
        applied.push(format!(
            "{}@{} ({}): {} host calls, {:.2e} fuel, {:.1} ms",
            plugin.info.name,
            plugin.info.version,
            s.options
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(","),
            report.host_calls,
            report.fuel_used as f64,
            report.elapsed.as_secs_f64() * 1e3
        ));
    }
    Ok(Prepared {
        config,
        dag,
        applied,
    })
}

fn plan(a: PlanArgs) -> Result<()> {
    let p = prepare(&a.run)?;
    let plan = compile(&p.dag).context("compiling the plan")?;
    let text = if a.json {
        plan.to_json()
    } else {
        let mut t = plan.render_table();
        t.push_str("\nstrategies:\n");
        for line in &p.applied {
            t.push_str(&format!("  {line}\n"));
        }
        t
    };
    match a.out {
        Some(path) => {
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?
        }
        None => println!("{text}"),
    }
    Ok(())
}

fn plugin_info(spec: &str, json: bool, config: Option<PathBuf>) -> Result<()> {
    let limits = match config {
        Some(path) => {
            RunConfig::resolve(&RunArgs {
                config: Some(path),
                ..Default::default()
            })?
            .sandbox
        }
        None => Default::default(),
    };
    let host = PluginHost::new(limits.clone(), Some(PluginHost::default_cache_dir()))?;
    let p = host.load(spec)?;
    if json {
        let v = serde_json::json!({
            "info": p.info,
            "wit": format!("piper:strategy@{}", p.wit_version),
            "sha256": p.sha256,
            "origin": p.origin,
            "sandbox": limits,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("{} {}", p.info.name, p.info.version);
    println!("  {}", p.info.description);
    println!("  wit:    piper:strategy@{}", p.wit_version);
    println!("  sha256: {}", p.sha256);
    println!("  from:   {}", p.origin);
    if p.info.options.is_empty() {
        println!("  options: none");
    } else {
        println!("  options:");
        print_options(&p.info.options);
    }
    println!("  sandbox (the run config's [sandbox] table overrides):");
    for (k, v) in limits.describe() {
        println!("    {k:<20} {v}");
    }
    Ok(())
}

fn plugin_list() -> Result<()> {
    let host = PluginHost::new(Default::default(), Some(PluginHost::default_cache_dir()))?;
    let width = bundled::names().iter().map(|n| n.len()).max().unwrap_or(0);
    for name in bundled::names() {
        let p = host.load(name)?;
        println!(
            "{:<width$}  {:<8} {}",
            p.info.name, p.info.version, p.info.description
        );
    }
    Ok(())
}

fn plugin_check(file: &std::path::Path, json: bool) -> Result<()> {
    let host = PluginHost::new(Default::default(), Some(PluginHost::default_cache_dir()))?;
    let i = author::check(&host, file)?;
    let accepted = i.verdict.is_ok();
    if json {
        let v = serde_json::json!({
            "file": file.display().to_string(),
            "sha256": i.sha256,
            "bytes": i.bytes,
            "wit": i.wit_version.as_ref().map(|v| format!("piper:strategy@{v}")),
            "host_accepts": format!("piper:strategy@{}", crate::plugin::WIT_ACCEPTED),
            "imports": i.imports,
            "exports": i.exports,
            "accepted": accepted,
            "info": i.verdict.as_ref().ok().map(|p| &p.info),
            "refused": i.verdict.as_ref().err().map(|e| e.to_string()),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("{}", file.display());
        println!("  sha256:  {}", i.sha256);
        println!("  size:    {} bytes", i.bytes);
        println!(
            "  wit:     {} (this host accepts piper:strategy@{})",
            i.wit_version
                .as_ref()
                .map(|v| format!("piper:strategy@{v}"))
                .unwrap_or_else(|| "no piper:strategy import".into()),
            crate::plugin::WIT_ACCEPTED
        );
        println!("  imports:");
        for n in &i.imports {
            println!("    {n}");
        }
        println!("  exports: {}", i.exports.join(", "));
        match &i.verdict {
            Ok(p) => {
                println!(
                    "  info:    {} {} — {}",
                    p.info.name, p.info.version, p.info.description
                );
                print_options(&p.info.options);
                println!("  accepted: yes");
            }
            Err(e) => println!("  accepted: no: {e}"),
        }
    }
    if !accepted {
        bail!("this host refuses {}", file.display());
    }
    Ok(())
}

/// One line per option: name, type, default, help.
fn print_options(options: &[crate::plugin::OptionInfo]) {
    for o in options {
        let d = o
            .default
            .as_deref()
            .map(|d| format!(" = {d}"))
            .unwrap_or_default();
        println!("    {:<14} {:<5}{d:<12}  {}", o.name, o.ty, o.help);
    }
}
