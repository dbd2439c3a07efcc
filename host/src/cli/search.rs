//! `piper plan --search`: the best strategy for a model and a cluster, found
//! by simulating every candidate of the search space (`search/`), printed as
//! a table of the top candidates with why the first beat the second, and
//! written as a run config that `piper train --config` runs and `piper plan
//! --config` reproduces.

use super::sim::{cluster_for, SimArgs};
use super::{RunArgs, RunConfig};
use crate::compile::human_bytes;
use crate::model::ModelConfig;
use crate::plugin::PluginHost;
use crate::search::space::{self, SpaceFile};
use crate::search::{self, Outcome, Query, Scored, Search};
use crate::session::{parse_size, Loader};
use crate::sim::report::{self, human_time};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args, Clone, Default)]
pub struct SearchArgs {
    /// Find the best strategy for the model on the cluster instead of
    /// planning the one given: every composition of the bundled plugins
    /// (and a `--search-space` file's), simulated.
    #[arg(long, conflicts_with_all = ["compare", "simulate"])]
    pub search: bool,
    /// Rows of the global batch (default: the model's `batch_size`).
    #[arg(long, requires = "search", value_parser = clap::value_parser!(u32).range(1..))]
    pub global_batch: Option<u32>,
    /// Candidates shown (and stacked in `--report`).
    #[arg(long, requires = "search", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub top: u32,
    /// Stop trying new candidates after this many seconds.
    #[arg(long, requires = "search")]
    pub budget: Option<f64>,
    /// More plugins to search over, with the option values to try (TOML;
    /// see `docs/search.md`).
    #[arg(long, requires = "search", value_name = "FILE.toml")]
    pub search_space: Option<PathBuf>,
}

/// Run the search and print (or write) what it found.
pub fn run(
    run: &RunArgs,
    sim_args: &SimArgs,
    a: &SearchArgs,
    out: Option<&Path>,
    json: bool,
) -> Result<()> {
    let Inputs {
        config,
        model,
        devices,
        cluster,
        cap,
        budget,
        file,
    } = inputs(run, sim_args, a)?;
    let candidates = space::enumerate(&model, devices, cluster.devices_per_node, file.as_ref());
    if candidates.is_empty() {
        bail!(
            "no candidate for {} on {devices} devices: no plugin of the space fits them",
            model.name
        );
    }
    let host = PluginHost::new(
        config.sandbox.clone(),
        Some(PluginHost::default_cache_dir()),
    )?;
    let plugins = {
        let loader = Loader::new(&host, &config, &run.sources())?;
        search::load_all(&candidates, |name| {
            (loader.load(name)).map_err(|e| format!("{:#}", anyhow::Error::from(e)))
        })
    };
    let result = search::search(
        &host,
        Query {
            model: &model,
            cluster: &cluster,
            devices,
            cap,
            candidates,
            plugins,
            budget,
            // The report draws the top candidates' timelines.
            keep: if sim_args.report.is_some() {
                a.top as usize
            } else {
                0
            },
        },
    );
    let ranked = result.ranked();
    let summary = summary(&result);
    let where_ = format!(
        "{} on {} ({} devices, {} each)",
        model.name,
        cluster.name,
        devices,
        human_bytes(cap)
    );
    if ranked.is_empty() {
        bail!("{}", nothing_fits(&result, &model, cap, &where_, &summary));
    }
    let top = &ranked[..ranked.len().min(a.top as usize)];
    let why = (top.len() >= 2).then(|| search::why(top[0].1, top[1].1));
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&result, top, &summary, why.as_deref(), cap))?
        );
    } else {
        println!("searched {where_}");
        println!("  {summary}");
        print_failures(&result);
        print_table(&result, top, cap);
        print_balanced(&result, top);
        if let Some(w) = &why {
            println!(
                "#1 {} beat #2 {}: {w}",
                result.candidates[top[0].0].label(),
                result.candidates[top[1].0].label()
            );
        }
    }
    let (best_ix, best) = top[0];
    if let Some(path) = out {
        let text = best_config(
            &model,
            devices,
            &result.candidates[best_ix],
            best,
            &where_,
            &config,
        )?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        if !json {
            println!(
                "best written to {p} (plan {}): piper train --config {p}",
                best.hash,
                p = path.display()
            );
        }
    }
    if let Some(p) = &sim_args.report {
        write_report(p, &result, top, (&cluster, cap), &where_)?;
        if !json {
            println!("report: {}", p.display());
        }
    }
    Ok(())
}

/// What a search runs on, from the flags and the run config, checked.
struct Inputs {
    config: RunConfig,
    model: ModelConfig,
    devices: u32,
    cluster: crate::sim::Cluster,
    cap: u64,
    budget: Option<Duration>,
    file: Option<SpaceFile>,
}

fn inputs(run: &RunArgs, sim_args: &SimArgs, a: &SearchArgs) -> Result<Inputs> {
    if !run.strategies.is_empty() {
        bail!("--search finds the strategies itself: drop --strategy (name your own plugins in --search-space)");
    }
    let config = RunConfig::resolve(&run.overrides())?;
    if run.config.is_some() && !config.strategies.is_empty() {
        bail!("--search finds the strategies itself: the run config names some; remove its [[strategy]] tables");
    }
    let mut model = config.model_config()?;
    if let Some(b) = a.global_batch {
        model.batch_size = b;
        model
            .validate()
            .with_context(|| format!("--global-batch {b}"))?;
    }
    let devices = match (config.devices, &sim_args.cluster) {
        (Some(d), _) => d,
        (None, Some(c)) => u32::try_from(crate::sim::Cluster::resolve(c, 8)?.devices())
            .context("the cluster has more devices than a plan may")?,
        (None, None) => 8,
    };
    let cluster = cluster_for(sim_args.cluster.as_deref(), devices)?;
    let cap = match &sim_args.device_memory {
        Some(s) => parse_size(s)?,
        None => cluster.memory_bytes as u64,
    };
    let budget = match a.budget {
        None => None,
        Some(s) if s.is_finite() && s > 0.0 && s <= 7.0 * 24.0 * 3600.0 => {
            Some(Duration::from_secs_f64(s))
        }
        Some(s) => bail!("--budget must be more than 0 and at most 604800 seconds, got {s}"),
    };
    let file = match &a.search_space {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading the search space {}", p.display()))?;
            Some(SpaceFile::parse(&text, &p.display().to_string())?)
        }
        None => None,
    };
    Ok(Inputs {
        config,
        model,
        devices,
        cluster,
        cap,
        budget,
        file,
    })
}

/// `--report`: every top candidate's timeline stacked (the search keeps
/// the fastest `top`'s for it).
fn write_report(
    p: &Path,
    result: &Search,
    top: &[(usize, &Scored)],
    (cluster, cap): (&crate::sim::Cluster, u64),
    where_: &str,
) -> Result<()> {
    let sections: Vec<report::Section> = (top.iter().enumerate())
        .filter_map(|(rank, (i, s))| {
            Some(report::Section {
                title: format!("#{} {}", rank + 1, result.candidates[*i].label()),
                sim: s.sim.as_ref()?,
                capacity: Some(cap as f64),
                source: format!("simulated on {}", cluster.name),
            })
        })
        .collect();
    let html = report::html(&format!("Piper strategy search: {where_}"), &sections);
    std::fs::write(p, html).with_context(|| format!("writing {}", p.display()))
}

/// `812 candidates in 41.3 s (19.7/s): 240 cut by the memory estimate, …`.
fn summary(r: &Search) -> String {
    let n = r.candidates.len();
    let secs = r.elapsed.as_secs_f64();
    let c = |f: fn(&Outcome) -> bool| r.count(f);
    format!(
        "{n} candidates in {secs:.1} s ({:.1}/s{}): {} cut by the memory estimate, {} failed, {} over the cap by their plan, {} duplicate plans, {} simulated, {} not tried (budget)",
        n as f64 / secs.max(1e-9),
        match r.balanced_from.len() {
            0 => String::new(),
            k => format!("; the last {k} the fastest pipelines again with stages balanced by the cost hints"),
        },
        c(|o| matches!(o, Outcome::CutByEstimate { .. })),
        c(|o| matches!(o, Outcome::Failed { .. })),
        c(|o| matches!(o, Outcome::OverCap { .. })),
        c(|o| matches!(o, Outcome::Duplicate { .. })),
        c(|o| matches!(o, Outcome::Simulated(_))),
        c(|o| matches!(o, Outcome::NotTried)),
    )
}

/// The first few failures, one line each.
fn print_failures(r: &Search) {
    let failed: Vec<(usize, &String)> = (r.outcomes.iter().enumerate())
        .filter_map(|(i, o)| match o {
            Outcome::Failed { reason } => Some((i, reason)),
            _ => None,
        })
        .collect();
    for (i, why) in failed.iter().take(3) {
        let line: String = why.lines().next().unwrap_or("").chars().take(240).collect();
        println!("  failed: {}: {line}", r.candidates[*i].label());
    }
    if failed.len() > 3 {
        println!(
            "  … {} more failed (--json lists them all)",
            failed.len() - 3
        );
    }
}

fn print_table(r: &Search, top: &[(usize, &Scored)], cap: u64) {
    let labels: Vec<String> = top.iter().map(|(i, _)| r.candidates[*i].label()).collect();
    let w = labels
        .iter()
        .map(|l| l.chars().count())
        .max()
        .unwrap_or(9)
        .max(9);
    println!(
        "  {:>3}  {:<w$}  {:>10}  {:>12}  {:>6}  {:>7}  {:>13}  {:>21}",
        "#", "candidate", "step", "tokens/s", "MFU", "bubble", "exposed comm", "peak mem / cap"
    );
    for (rank, ((_, s), label)) in top.iter().zip(&labels).enumerate() {
        println!(
            "  {:>3}  {:<w$}  {:>10}  {:>12.0}  {:>5.1}%  {:>6.1}%  {:>13}  {:>21}",
            rank + 1,
            label,
            human_time(s.step_time),
            s.tokens_per_s,
            s.mfu * 100.0,
            s.bubble * 100.0,
            human_time(s.exposed_comm),
            format!("{} / {}", human_bytes(s.peak()), human_bytes(cap)),
        );
    }
}

/// What balancing the stages recovered, for each balanced candidate in
/// the top: its bubble and step against the even cut's.
fn print_balanced(r: &Search, top: &[(usize, &Scored)]) {
    for (b, o) in r.balanced_pairs() {
        if !top.iter().any(|(i, _)| *i == b) {
            continue;
        }
        let (Outcome::Simulated(sb), Outcome::Simulated(so)) = (&r.outcomes[b], &r.outcomes[o])
        else {
            continue;
        };
        println!(
            "  stages balanced by the cost hints: {}: bubble {:.1}% -> {:.1}%, step {} -> {}",
            r.candidates[b].label(),
            so.bubble * 100.0,
            sb.bubble * 100.0,
            human_time(so.step_time),
            human_time(sb.step_time),
        );
    }
}

/// Why nothing fits: the smallest peak found, the cap, and the knob that
/// came closest.
fn nothing_fits(r: &Search, model: &ModelConfig, cap: u64, where_: &str, summary: &str) -> String {
    let smallest = (r.outcomes.iter().enumerate())
        .filter_map(|(i, o)| match o {
            Outcome::OverCap { peak, .. } => Some((i, *peak, true)),
            Outcome::CutByEstimate { bytes } => Some((i, *bytes, false)),
            _ => None,
        })
        .min_by_key(|x| x.1);
    let Some((i, bytes, planned)) = smallest else {
        let first = r.outcomes.iter().enumerate().find_map(|(i, o)| match o {
            Outcome::Failed { reason } => Some(format!("{}: {reason}", r.candidates[i].label())),
            _ => None,
        });
        return format!(
            "no candidate could be planned for {where_} ({summary}){}",
            first.map_or(String::new(), |f| format!("; the first failure: {f}"))
        );
    };
    let c = &r.candidates[i];
    let knob = match c.shape {
        Some(s) if s.zero < 3 && s.dp > 1 => {
            "a higher ZeRO stage over the data-parallel group came closest".to_string()
        }
        Some(s) => {
            let states = search::states_lower_bound(model, &s);
            if planned && bytes > 2 * states {
                format!(
                    "activations are most of it ({} of model states): more microbatches, a smaller batch (--global-batch) or recomputation",
                    human_bytes(states)
                )
            } else {
                format!(
                    "model states alone need {} per device: more devices",
                    human_bytes(states)
                )
            }
        }
        None => "more devices".to_string(),
    };
    format!(
        "nothing fits {where_}: the smallest {} peak is {} ({}) against the cap {}; {knob} ({summary})",
        if planned { "predicted" } else { "estimated" },
        human_bytes(bytes),
        c.label(),
        human_bytes(cap)
    )
}

fn to_json(
    r: &Search,
    top: &[(usize, &Scored)],
    summary: &str,
    why: Option<&str>,
    cap: u64,
) -> serde_json::Value {
    let outcome = |o: &Outcome| -> serde_json::Value {
        match o {
            Outcome::CutByEstimate { bytes } => {
                serde_json::json!({"outcome": "cut-by-estimate", "bytes": bytes})
            }
            Outcome::Failed { reason } => {
                serde_json::json!({"outcome": "failed", "reason": reason})
            }
            Outcome::OverCap { peak, device } => {
                serde_json::json!({"outcome": "over-cap", "peak": peak, "device": device})
            }
            Outcome::Duplicate { of } => {
                serde_json::json!({"outcome": "duplicate", "of": r.candidates[*of].label()})
            }
            Outcome::NotTried => serde_json::json!({"outcome": "not-tried"}),
            Outcome::Simulated(s) => serde_json::json!({
                "outcome": "simulated", "hash": s.hash, "step_time": s.step_time,
                "tokens_per_s": s.tokens_per_s, "mfu": s.mfu, "bubble": s.bubble,
                "exposed_comm": s.exposed_comm, "peak_bytes": s.peak(),
            }),
        }
    };
    serde_json::json!({
        "summary": summary,
        "cap": cap,
        "top": top.iter().map(|(i, _)| r.candidates[*i].label()).collect::<Vec<_>>(),
        "why": why,
        "candidates": r.candidates.iter().zip(&r.outcomes).map(|(c, o)| {
            let mut v = outcome(o);
            v["candidate"] = serde_json::Value::String(c.label());
            v
        }).collect::<Vec<_>>(),
    })
}

/// The best candidate as a run config (`--config`), model inline so the
/// plan is reproduced whatever the model's origin.
fn best_config(
    model: &ModelConfig,
    devices: u32,
    c: &space::Candidate,
    s: &Scored,
    where_: &str,
    config: &RunConfig,
) -> Result<String> {
    let typed = |v: &str| -> toml::Value {
        if let Ok(i) = v.parse::<i64>() {
            toml::Value::Integer(i)
        } else if let Ok(b) = v.parse::<bool>() {
            toml::Value::Boolean(b)
        } else if let Some(f) = v.parse::<f64>().ok().filter(|f| f.is_finite()) {
            toml::Value::Float(f)
        } else {
            toml::Value::String(v.into())
        }
    };
    let mut doc = toml::Table::new();
    doc.insert("devices".into(), toml::Value::Integer(devices.into()));
    doc.insert("model".into(), toml::Value::try_from(model)?);
    let strategies: Vec<toml::Value> = c
        .steps
        .iter()
        .map(|st| {
            let mut t = toml::Table::new();
            // A config's files are relative to it: a plugin file is
            // written absolute, so the config works wherever it is kept.
            let name = match st.plugin.ends_with(".wasm") {
                true => std::fs::canonicalize(&st.plugin)
                    .map_or(st.plugin.clone(), |p| p.to_string_lossy().into_owned()),
                false => st.plugin.clone(),
            };
            t.insert("name".into(), toml::Value::String(name));
            let opts: toml::Table = (st.options.iter())
                .map(|(k, v)| (k.clone(), typed(v)))
                .collect();
            if !opts.is_empty() {
                t.insert("options".into(), toml::Value::Table(opts));
            }
            toml::Value::Table(t)
        })
        .collect();
    doc.insert("strategy".into(), toml::Value::Array(strategies));
    if config.sandbox != crate::plugin::SandboxLimits::default() {
        doc.insert("sandbox".into(), toml::Value::try_from(&config.sandbox)?);
    }
    if !model.precision.is_fp32() {
        doc.insert("precision".into(), toml::Value::try_from(model.precision)?);
    }
    Ok(format!(
        "# The best of `piper plan --search` for {where_}: {} (plan {}),\n# step {}, {:.0} tokens/s, MFU {:.1}%, peak {} per device (simulated).\n{}",
        c.label(),
        s.hash,
        human_time(s.step_time),
        s.tokens_per_s,
        s.mfu * 100.0,
        human_bytes(s.peak()),
        toml::to_string(&doc)?
    ))
}
