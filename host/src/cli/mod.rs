//! The `piper` command line (clap): `plan`, `train`, `plugin info|list|new|build|check|verify`.
//! The last stage of the flow for a user; errors here are `anyhow` chains
//! of the typed errors of each stage.

mod backend;
mod calibrate;
mod comm;
#[cfg(feature = "mpi")]
mod job;
mod search;
mod sim;
mod train;
mod verify;

pub use crate::session::{Prepared, RunConfig, StrategySpec};

use crate::plugin::author::{self, Lang};
use crate::plugin::{bundled, PluginHost};
use crate::registry;
use crate::session;
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
    Plan(Box<PlanArgs>),
    /// Train: apply the strategies, compile, and run the plans on the
    /// runtime's devices (virtual CPU devices, or GPUs with `--backend cuda`).
    Train(Box<train::TrainArgs>),
    /// Check a compute backend against the CPU's.
    #[command(subcommand)]
    Backend(BackendCommand),
    /// Measure the CPU runtime on this machine and write the `cpu-local`
    /// cluster the simulator predicts it with.
    Calibrate(calibrate::CalibrateArgs),
    /// Check the runtime's communication (in one process, or across the
    /// ranks of an MPI job).
    #[command(subcommand)]
    Comm(CommCommand),
    /// Prepare training data.
    #[command(subcommand)]
    Data(DataCommand),
    /// Inspect, write, build and share strategy plugins.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// Pin every `oci://` plugin of a run config to its digest in a lockfile
    /// (default: `piper.lock` beside the config), pulling each into the store.
    Lock {
        config: PathBuf,
        #[arg(long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        registry: RegistryArgs,
    },
}

/// What a run is made of; flags override the `--config` file.
#[derive(Args, Clone, Default)]
pub struct RunArgs {
    /// Run config (TOML): model, devices, strategies with options, sandbox limits.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A preset (`tiny`, `gpt2-small`, `llama-tiny`) or a model TOML file.
    #[arg(long)]
    pub model: Option<String>,
    /// Number of (virtual) devices.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..))]
    pub devices: Option<u32>,
    /// A strategy: bundled name or path to a .wasm component, with options:
    /// `1f1b:microbatches=8,stages=4`. Repeat to compose (`--strategy dp:degree=2 --strategy 1f1b`).
    #[arg(long = "strategy", value_name = "NAME[:k=v,...]")]
    pub strategies: Vec<String>,
    /// Precision policy: `fp32` (default) or `bf16` (bf16 parameters,
    /// activations and messages; fp32 gradients, master weights and moments).
    /// Replaces the run config's `[precision]` table.
    #[arg(long, value_name = "fp32|bf16")]
    pub precision: Option<String>,
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// The lockfile pinning `oci://` plugins (default: `piper.lock` beside
    /// `--config`, when there is one).
    #[arg(long)]
    pub lock: Option<PathBuf>,
}

/// How registry plugins may be reached.
#[derive(Args, Clone, Default)]
pub struct RegistryArgs {
    /// Use the local plugin store only: no registry is contacted.
    #[arg(long)]
    pub offline: bool,
    /// Plain HTTP, for a registry on this machine (localhost, 127.0.0.1, ::1) only.
    #[arg(long)]
    pub insecure: bool,
}

impl RunArgs {
    /// What the flags set over the run config.
    pub fn overrides(&self) -> session::Overrides {
        session::Overrides {
            config: self.config.clone(),
            model: self.model.clone(),
            devices: self.devices,
            strategies: self.strategies.clone(),
            precision: self.precision.clone(),
        }
    }
    /// Where the run's `oci://` plugins may come from.
    pub fn sources(&self) -> session::Sources {
        session::Sources {
            access: self.registry.access(),
            lock: self.lock.clone(),
        }
    }
}

impl RegistryArgs {
    fn access(&self) -> registry::Access {
        registry::Access {
            insecure: self.insecure,
            offline: self.offline,
        }
    }
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
    #[command(flatten)]
    sim: sim::SimArgs,
    #[command(flatten)]
    search: search::SearchArgs,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize a UTF-8 text file into a token file for `piper train
    /// --data FILE.bin` (llm.c's format: a 1 KiB header, then uint16
    /// tokens, or uint32 for vocabularies over 65,536).
    Tokenize {
        text: PathBuf,
        /// `byte` (vocabulary 256), `gpt2` (GPT-2 BPE, vocabulary 50257), or a Hugging Face `tokenizer.json` (the file, or a directory holding it).
        #[arg(long, default_value = "byte")]
        tokenizer: String,
        /// The token file to write (replaced whole, never half-written).
        #[arg(long, value_name = "FILE.bin")]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
enum BackendCommand {
    /// Every kernel on the same inputs as the CPU backend, training against
    /// the CPU's losses, strategies against one device, and with `--bench`
    /// gpt2-small's speed; `check.json` in `--out`.
    Check(backend::CheckArgs),
    /// What the backend runs on (on CUDA: the driver's, NVRTC's and
    /// cuBLAS's versions, the library files loaded, each GPU), then one
    /// kernel and one matrix product with known results.
    Info(backend::InfoArgs),
}

#[derive(Subcommand)]
enum CommCommand {
    /// Every collective (all-reduce, reduce-scatter, all-gather, all-to-all)
    /// over groups of 1 to N devices with uneven sizes against a reference,
    /// and the bytes each device sent against the algorithm's; under
    /// `mpirun`, across the ranks.
    Check(comm::CheckArgs),
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
    /// The bundled strategies and the plugins in the local store.
    List,
    /// Publish a component to a registry: `piper plugin publish FILE oci://HOST/REPO:1.0.0`.
    Publish {
        file: PathBuf,
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Pull a plugin into the local store (verified, and loaded once to read its info).
    Pull {
        reference: String,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// A registry plugin's manifest, digests, WIT version and `info()`.
    Inspect {
        reference: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        registry: RegistryArgs,
    },
    /// Remove a plugin (by tag or digest) from the local store.
    Remove { reference: String },
    /// Make an ed25519 key pair: the private key to FILE, the public one to FILE.pub.
    Keygen { file: PathBuf },
    /// Sign a registry plugin with a private key from `piper plugin keygen`.
    Sign {
        reference: String,
        #[arg(long)]
        key: PathBuf,
        #[command(flatten)]
        registry: RegistryArgs,
    },
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
    /// Does a strategy keep the math? Trains `tiny` (dense and with a
    /// dropless MoE) under it and on one device, and holds the losses and
    /// step-1 gradients to 1e-5, naming the worst tensor.
    Verify(verify::VerifyArgs),
    /// What the host sees in a component: WIT version, imports, exports,
    /// `info()`, and whether this host accepts it (never runs `apply`).
    Check {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
}

/// Entry point of the binary.
/// Does `args` (the program name first) parse as a `piper` command line?
/// Clap's message when not. Nothing runs: the docs' commands are checked
/// against the CLI with it.
pub fn parses<I, T>(args: I) -> Result<(), String>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    Cli::try_parse_from(args)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// The CLI reference in Markdown (`docs/reference/cli.md`): every command
/// with its description, usage and options, read from clap's own model of
/// this CLI (default features), so the reference cannot drift from it.
pub fn reference() -> String {
    use clap::CommandFactory;
    let mut root = Cli::command();
    root.build();
    let mut out = String::from(
        "# The `piper` command\n\n\
         Every command and flag, generated from the CLI itself (`piper::cli::reference`; \
         `host/tests/it/cli.rs` fails when this page and the CLI differ, and \
         `PIPER_WRITE_DOCS=1 cargo test -p piper --test it cli::the_cli_reference` rewrites it). \
         `-v`/`--verbose` works with every command.\n",
    );
    reference_of(&root, "piper", &mut out);
    out
}

/// One command's section, then its subcommands'.
fn reference_of(cmd: &clap::Command, path: &str, out: &mut String) {
    use std::fmt::Write;
    let one_line = |s: String| s.split_whitespace().collect::<Vec<_>>().join(" ");
    let _ = write!(out, "\n## `{path}`\n\n");
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        let _ = write!(out, "{}\n\n", one_line(about.to_string()));
    }
    let usage = cmd.clone().render_usage().to_string();
    let usage = usage.trim_start_matches("Usage: ").trim();
    let _ = write!(out, "```text\n{usage}\n```\n");
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !a.is_global_set())
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        out.push_str("\n| argument | what it does |\n|---|---|\n");
        for a in args {
            let value = a
                .get_value_names()
                .map(|v| {
                    v.iter()
                        .map(|n| format!("<{n}>"))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_else(|| format!("<{}>", a.get_id().as_str().to_uppercase()));
            let takes = a.get_action().takes_values();
            let name = match (a.get_long(), a.get_short()) {
                (Some(l), Some(s)) if takes => format!("`-{s}`, `--{l} {value}`"),
                (Some(l), Some(s)) => format!("`-{s}`, `--{l}`"),
                (Some(l), None) if takes => format!("`--{l} {value}`"),
                (Some(l), None) => format!("`--{l}`"),
                (None, Some(s)) if takes => format!("`-{s} {value}`"),
                (None, Some(s)) => format!("`-{s}`"),
                (None, None) => format!("`{value}`"),
            };
            let mut help = a
                .get_long_help()
                .or(a.get_help())
                .map(|h| one_line(h.to_string()))
                .unwrap_or_default();
            let possible: Vec<String> = a
                .get_possible_values()
                .iter()
                .filter(|p| !p.is_hide_set())
                .map(|p| format!("`{}`", p.get_name()))
                .collect();
            if !possible.is_empty() && takes {
                let _ = write!(help, " (one of {})", possible.join(", "));
            }
            let defaults: Vec<String> = a
                .get_default_values()
                .iter()
                .map(|d| d.to_string_lossy().into_owned())
                .collect();
            if !defaults.is_empty() && takes {
                let _ = write!(help, " [default: {}]", defaults.join(", "));
            }
            let cell = |s: &str| s.replace('|', "\\|");
            let _ = writeln!(out, "| {} | {} |", cell(&name), cell(&help));
        }
    }
    for sub in cmd.get_subcommands().filter(|c| c.get_name() != "help") {
        reference_of(sub, &format!("{path} {}", sub.get_name()), out);
    }
}

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
        Command::Plan(a) => plan(*a),
        Command::Train(a) => train::train(*a),
        Command::Backend(BackendCommand::Check(a)) => backend::check(a),
        Command::Backend(BackendCommand::Info(a)) => backend::info(a),
        Command::Calibrate(a) => calibrate::calibrate(a),
        Command::Comm(CommCommand::Check(a)) => comm::check(a),
        Command::Data(DataCommand::Tokenize {
            text,
            tokenizer,
            out,
        }) => tokenize(&text, &tokenizer, &out),
        Command::Plugin(PluginCommand::Info {
            plugin,
            json,
            config,
        }) => plugin_info(&plugin, json, config),
        Command::Plugin(PluginCommand::List) => plugin_list(),
        Command::Plugin(PluginCommand::New { name, lang, dir }) => {
            let made = author::new_plugin(&name, lang, &dir)?;
            println!("created {} ({} strategy)", made.display(), lang.title());
            println!("next:");
            for step in author::next_steps(lang, &made) {
                println!("  {step}");
            }
            Ok(())
        }
        Command::Plugin(PluginCommand::Build { dir, out }) => {
            let built = author::build(&dir, out.as_deref())?;
            println!("{}", built.component.display());
            Ok(())
        }
        Command::Plugin(PluginCommand::Check { file, json }) => plugin_check(&file, json),
        Command::Plugin(PluginCommand::Verify(a)) => verify::verify(a),
        Command::Plugin(PluginCommand::Publish {
            file,
            reference,
            registry: r,
        }) => {
            let bytes =
                std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
            let reference = registry::Reference::parse(&reference)?;
            let rec = registry::publish(&bytes, &reference, &store()?, &r.access(), &host()?)?;
            println!(
                "published {} ({} {}) as {}",
                file.display(),
                rec.name,
                rec.version,
                rec.reference
            );
            Ok(())
        }
        Command::Plugin(PluginCommand::Pull {
            reference,
            registry: r,
        }) => {
            let reference = registry::Reference::parse(&reference)?;
            let rec = registry::pull(&reference, &store()?, &r.access(), &host()?)?;
            println!(
                "pulled {} ({} {}, component {})",
                rec.reference, rec.name, rec.version, rec.component_digest
            );
            Ok(())
        }
        Command::Plugin(PluginCommand::Inspect {
            reference,
            json,
            registry: r,
        }) => plugin_inspect(&reference, json, &r),
        Command::Plugin(PluginCommand::Remove { reference }) => {
            let reference = registry::Reference::parse(&reference)?;
            let gone = store()?.remove(&reference)?;
            if gone.is_empty() {
                bail!(
                    "{reference} is not in the local store ({})",
                    registry::Store::default_dir().display()
                );
            }
            for g in gone {
                println!("removed {g}");
            }
            Ok(())
        }
        Command::Plugin(PluginCommand::Keygen { file }) => {
            let public = registry::sign::keygen(&file)?;
            println!("private key: {} (keep it secret)", file.display());
            println!("public key:  {public}");
            println!("trust it in a run config: [registry] trusted_keys = [\"{public}\"]");
            Ok(())
        }
        Command::Plugin(PluginCommand::Sign {
            reference,
            key,
            registry: r,
        }) => {
            let reference = registry::Reference::parse(&reference)?;
            let key = registry::sign::load_key(&key)?;
            let sig = registry::sign::sign(&reference, &key, &r.access())?;
            println!("signed {reference} ({}) with {}", sig.manifest, sig.key);
            Ok(())
        }
        Command::Lock {
            config,
            out,
            registry: r,
        } => lock(&config, out, &r),
    }
}

/// Resolve config + flags, build the DAG, load and apply the strategies.
pub fn prepare(args: &RunArgs) -> Result<Prepared> {
    prepare_with(args, 4)
}

/// [`prepare`] with the device count used when neither flags nor config
/// give one (an MPI job: the world size).
pub fn prepare_with(args: &RunArgs, default_devices: u32) -> Result<Prepared> {
    let config = RunConfig::resolve(&args.overrides())?;
    Ok(session::prepare(&config, &args.sources(), default_devices)?)
}

fn plan(a: PlanArgs) -> Result<()> {
    if a.search.search {
        return search::run(&a.run, &a.sim, &a.search, a.out.as_deref(), a.json);
    }
    // clap's `requires = "search"` does not hold beside `--simulate` (which
    // conflicts with `--search`): say so rather than plan without them.
    if a.search.global_batch.is_some()
        || a.search.budget.is_some()
        || a.search.search_space.is_some()
    {
        bail!("--global-batch, --budget and --search-space shape a --search; one plan takes its batch from the model's `batch_size`");
    }
    if !a.sim.simulate && (a.sim.cluster.is_some() || a.sim.report.is_some()) {
        bail!("--cluster and --report time a plan: give --simulate (or --search)");
    }
    if !a.sim.compare.is_empty() {
        if a.json || a.out.is_some() {
            bail!("--compare prints one row per candidate: --json and --out write one plan, run them per candidate");
        }
        return sim::compare(&a.run, &a.sim);
    }
    let p = prepare(&a.run)?;
    let plan = p.compile()?;
    if a.sim.simulate {
        let title = p
            .config
            .strategies
            .iter()
            .map(|s| s.name.rsplit('/').next().unwrap_or(&s.name).to_string())
            .collect::<Vec<_>>()
            .join(" + ");
        let title = format!("{title}, {} devices, {}", plan.devices.len(), plan.model);
        sim::run(&plan, &a.sim, &title)?;
        if a.out.is_none() && !a.json {
            return Ok(());
        }
    }
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
            RunConfig::resolve(&session::Overrides {
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
    let host = host()?;
    let width = bundled::names().iter().map(|n| n.len()).max().unwrap_or(0);
    println!("bundled:");
    for name in bundled::names() {
        let p = host.load(name)?;
        println!(
            "  {:<width$}  {:<8} {}",
            p.info.name, p.info.version, p.info.description
        );
    }
    let store = store()?;
    let entries = store.list()?;
    println!("in the local store ({}):", store.root().display());
    if entries.is_empty() {
        println!("  none (piper plugin pull oci://HOST/REPO:TAG)");
    }
    for (rec, tags) in entries {
        println!("  {} {}  {}", rec.name, rec.version, rec.reference);
        for t in tags {
            println!("      tag {t}");
        }
    }
    Ok(())
}

/// A plugin host with the default limits and compile cache.
fn host() -> Result<PluginHost> {
    Ok(PluginHost::new(
        Default::default(),
        Some(PluginHost::default_cache_dir()),
    )?)
}

/// The local plugin store.
fn store() -> Result<registry::Store> {
    Ok(registry::Store::open(&registry::Store::default_dir())?)
}

fn plugin_inspect(reference: &str, json: bool, r: &RegistryArgs) -> Result<()> {
    let reference = registry::Reference::parse(reference)?;
    let remote = registry::remote::Remote::new(&reference, &r.access())?;
    let manifest = remote.manifest(&reference)?;
    let rec = registry::pull(
        &reference.at_digest(&manifest.digest),
        &store()?,
        &r.access(),
        &host()?,
    )?;
    let manifest_json: serde_json::Value = serde_json::from_slice(&manifest.raw)?;
    if json {
        let v = serde_json::json!({
            "reference": reference.to_string(),
            "digest": manifest.digest,
            "component": rec.component_digest,
            "size": manifest.layer_size,
            "wit": rec.wit,
            "info": { "name": rec.name, "version": rec.version, "description": rec.description, "options": rec.options },
            "manifest": manifest_json,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("{reference}");
    println!("  digest:    {}", manifest.digest);
    println!(
        "  component: {} ({} bytes)",
        rec.component_digest, manifest.layer_size
    );
    println!("  wit:       {}", rec.wit);
    println!(
        "  info:      {} {} — {}",
        rec.name, rec.version, rec.description
    );
    println!("  options:   {}", rec.options.join(", "));
    println!("  manifest:");
    for line in serde_json::to_string_pretty(&manifest_json)?.lines() {
        println!("    {line}");
    }
    Ok(())
}

fn lock(config: &std::path::Path, out: Option<PathBuf>, r: &RegistryArgs) -> Result<()> {
    let cfg = RunConfig::resolve(&session::Overrides {
        config: Some(config.to_path_buf()),
        ..Default::default()
    })?;
    let (store, host) = (store()?, host()?);
    let mut entries = Vec::new();
    for s in cfg
        .strategies
        .iter()
        .filter(|s| registry::Reference::is_oci(&s.name))
    {
        let reference = registry::Reference::parse(&s.name)?;
        let digest = match &reference.digest {
            Some(d) => d.clone(),
            None => registry::remote::Remote::new(&reference, &r.access())?.resolve(&reference)?,
        };
        let rec = registry::pull(&reference.at_digest(&digest), &store, &r.access(), &host)?;
        if reference.tag.is_some() {
            store.set_tag(&reference, &digest)?;
        }
        println!("{reference} -> {digest} ({} {})", rec.name, rec.version);
        entries.push(registry::lock::Entry {
            reference: reference.to_string(),
            digest,
            component: rec.component_digest,
        });
    }
    let path = out.unwrap_or_else(|| registry::Lockfile::beside(config));
    registry::Lockfile {
        path: path.clone(),
        entries,
    }
    .write()?;
    println!("wrote {}", path.display());
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

/// `piper data tokenize`.
fn tokenize(text: &std::path::Path, tokenizer: &str, out: &std::path::Path) -> Result<()> {
    use crate::runtime::data::{self, file};
    let tokenizer = crate::runtime::Tokenizer::parse(tokenizer)?;
    let tokens = tokenizer.encode(&data::read_text(text)?)?;
    let width = file::Width::for_vocab(tokenizer.vocab());
    file::write(out, &tokens, width)?;
    println!(
        "{}: {} {} tokens ({} tokenizer, llm.c header)",
        out.display(),
        tokens.len(),
        width.name(),
        tokenizer.name()
    );
    Ok(())
}
