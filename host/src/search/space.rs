//! The search space: compositions of strategy plugins in the orders that
//! make sense — data parallelism (`dp`, or `zero` stage 1–3) → tensor
//! parallelism → expert parallelism → one pipeline schedule — each plugin's
//! options over the values that divide the model and the cluster, and any
//! plugin a `--search-space` file names with its own value lists.
//!
//! ```toml
//! bundled = true                      # the bundled library too (default)
//! [[plugin]]
//! name = "path/to/my_pipeline.wasm"   # a bundled name, a path or oci://HOST/REPO:TAG
//! role = "pipeline"                   # replicate | tensor | experts | pipeline
//! [plugin.options]
//! microbatches = [8, 16]              # the values tried
//! chunks = { from = 1, to = 4 }       # an integer range, both ends included
//! stream = "pp"                       # one value
//! ```

use crate::model::ModelConfig;
use serde::Serialize;
use std::collections::BTreeMap;

/// One strategy of a candidate: a plugin and its options (as text, as the
/// command line gives them).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Step {
    pub plugin: String,
    pub options: Vec<(String, String)>,
}

impl Step {
    fn new(plugin: &str, options: &[(&str, String)]) -> Self {
        Step {
            plugin: plugin.into(),
            options: options
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        }
    }
    /// `zero:stage=1,dp=2`.
    pub fn label(&self) -> String {
        let name = self.plugin.rsplit('/').next().unwrap_or(&self.plugin);
        if self.options.is_empty() {
            return name.to_string();
        }
        let opts: Vec<String> = self
            .options
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        format!("{name}:{}", opts.join(","))
    }
}

/// Strategies applied in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Candidate {
    pub steps: Vec<Step>,
    /// The data-parallel degree, tensor-parallel degree and pipeline
    /// positions it spreads the model over, when the space knows them
    /// (bundled plugins), for the memory estimate.
    #[serde(skip)]
    pub shape: Option<Shape>,
}

impl Candidate {
    /// `zero:stage=1,dp=2+1f1b:microbatches=8`, as `--compare` takes it.
    pub fn label(&self) -> String {
        self.steps
            .iter()
            .map(Step::label)
            .collect::<Vec<_>>()
            .join("+")
    }
}

/// How a candidate of the bundled library spreads the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Data-parallel degree and ZeRO stage (0: plain data parallelism).
    pub dp: u32,
    pub zero: u8,
    pub tp: u32,
    /// Context-parallel degree (1 without `cp`).
    pub cp: u32,
    /// Expert-parallel degree (1 without `ep`).
    pub ep: u32,
    /// Pipeline positions (devices ÷ dp ÷ tp).
    pub pp: u32,
    /// Model copies each position holds (DualPipe's two).
    pub copies: u32,
    /// Microbatches a replica's batch is cut into (1 without a pipeline).
    pub microbatches: u32,
    /// Model chunks a position holds (interleaving's virtual stages,
    /// DualPipeV's two, DualPipe's two directions; 1 otherwise).
    pub chunks: u32,
}

/// Where a plugin goes in a composition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    Replicate,
    Tensor,
    Experts,
    Pipeline,
}

/// A plugin of a search-space file with the option values to try.
#[derive(Clone, Debug, PartialEq)]
pub struct UserPlugin {
    pub name: String,
    pub role: Role,
    /// Each option's values (text); the candidates take their product.
    pub options: Vec<(String, Vec<String>)>,
}

/// A `--search-space` file.
#[derive(Clone, Debug, PartialEq)]
pub struct SpaceFile {
    pub bundled: bool,
    pub plugins: Vec<UserPlugin>,
}

/// A search-space file that cannot be used: the key and value named.
#[derive(Debug, thiserror::Error)]
pub enum SpaceError {
    #[error("search space {path}: {message}")]
    Parse { path: String, message: String },
    #[error("search space {path}: plugin {plugin}: option `{key}` = {value}: {why}")]
    Value {
        path: String,
        plugin: String,
        key: String,
        value: String,
        why: String,
    },
    #[error("search space {path}: {why}")]
    Empty { path: String, why: String },
}

/// Gradient bucket sizes tried beside the 25 MiB default, bytes.
const OTHER_BUCKETS: [u64; 2] = [4 << 20, 100 << 20];

/// The most values one option may list, and candidates one file may add.
const MAX_VALUES: usize = 256;
const MAX_USER_COMBINATIONS: usize = 4096;

impl SpaceFile {
    /// Parse a search-space file's text (`path` names it in errors).
    pub fn parse(text: &str, path: &str) -> Result<Self, SpaceError> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct File {
            #[serde(default = "yes")]
            bundled: bool,
            #[serde(default)]
            plugin: Vec<FilePlugin>,
        }
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct FilePlugin {
            name: String,
            role: Role,
            #[serde(default)]
            options: BTreeMap<String, toml::Value>,
        }
        fn yes() -> bool {
            true
        }
        let file: File = toml::from_str(text).map_err(|e| SpaceError::Parse {
            path: path.into(),
            message: e.to_string(),
        })?;
        let mut plugins = Vec::new();
        for p in file.plugin {
            if p.name.trim().is_empty() {
                return Err(SpaceError::Empty {
                    path: path.into(),
                    why: "a [[plugin]] with an empty `name`".into(),
                });
            }
            let mut options = Vec::new();
            let mut combinations = 1usize;
            for (key, value) in &p.options {
                let bad = |why: &str| SpaceError::Value {
                    path: path.into(),
                    plugin: p.name.clone(),
                    key: key.clone(),
                    value: value.to_string(),
                    why: why.into(),
                };
                let values = values_of(value).map_err(|w| bad(&w))?;
                if values.is_empty() {
                    return Err(bad("an empty list: give at least one value"));
                }
                combinations = combinations.saturating_mul(values.len());
                if combinations > MAX_USER_COMBINATIONS {
                    return Err(bad(&format!(
                        "the plugin's options would make more than {MAX_USER_COMBINATIONS} combinations"
                    )));
                }
                options.push((key.clone(), values));
            }
            plugins.push(UserPlugin {
                name: p.name,
                role: p.role,
                options,
            });
        }
        if !file.bundled && plugins.is_empty() {
            return Err(SpaceError::Empty {
                path: path.into(),
                why: "`bundled = false` and no [[plugin]]: the space is empty".into(),
            });
        }
        Ok(SpaceFile {
            bundled: file.bundled,
            plugins,
        })
    }
}

/// An option's values: one scalar, a list of scalars, or `{ from, to }`.
fn values_of(v: &toml::Value) -> Result<Vec<String>, String> {
    let scalar = |v: &toml::Value| -> Result<String, String> {
        match v {
            toml::Value::String(s) => Ok(s.clone()),
            toml::Value::Integer(i) => Ok(i.to_string()),
            toml::Value::Float(f) if f.is_finite() => Ok(f.to_string()),
            toml::Value::Boolean(b) => Ok(b.to_string()),
            _ => Err("not a string, integer, finite float or boolean".into()),
        }
    };
    match v {
        toml::Value::Array(items) => {
            if items.len() > MAX_VALUES {
                return Err(format!("more than {MAX_VALUES} values"));
            }
            items.iter().map(scalar).collect()
        }
        toml::Value::Table(t) => {
            let end = |k: &str| -> Result<i64, String> {
                match t.get(k) {
                    Some(toml::Value::Integer(i)) => Ok(*i),
                    Some(_) => Err(format!("`{k}` must be an integer")),
                    None => Err(format!("a range needs `from` and `to`, `{k}` is missing")),
                }
            };
            if let Some(k) = t.keys().find(|k| *k != "from" && *k != "to") {
                return Err(format!("a range takes `from` and `to` only, not `{k}`"));
            }
            let (from, to) = (end("from")?, end("to")?);
            if to < from {
                return Err(format!("the range ends ({to}) before it starts ({from})"));
            }
            if (to - from) as u64 >= MAX_VALUES as u64 {
                return Err(format!("more than {MAX_VALUES} values"));
            }
            Ok((from..=to).map(|i| i.to_string()).collect())
        }
        other => scalar(other).map(|s| vec![s]),
    }
}

/// Every combination of the option lists.
fn combinations(options: &[(String, Vec<String>)]) -> Vec<Vec<(String, String)>> {
    let mut out = vec![Vec::new()];
    for (key, values) in options {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                values.iter().map(move |v| {
                    let mut p = prefix.clone();
                    p.push((key.clone(), v.clone()));
                    p
                })
            })
            .collect();
    }
    out
}

/// The divisors of `n` from 2 up.
fn divisors(n: u32) -> Vec<u32> {
    (2..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// A choice for one role: its steps (none, or one) and what it does to
/// the shape (`None` for a user plugin: unknown).
type Choice = (Option<Step>, Option<(u32, u8)>);

/// Every candidate for `model` on `devices` devices, `per_node` to a node.
pub fn enumerate(
    model: &ModelConfig,
    devices: u32,
    per_node: u32,
    file: Option<&SpaceFile>,
) -> Vec<Candidate> {
    let bundled = file.is_none_or(|f| f.bundled);
    let user = |role: Role| -> Vec<Step> {
        file.map(|f| {
            f.plugins
                .iter()
                .filter(|p| p.role == role)
                .flat_map(|p| {
                    combinations(&p.options).into_iter().map(|options| Step {
                        plugin: p.name.clone(),
                        options,
                    })
                })
                .collect()
        })
        .unwrap_or_default()
    };
    let moe = model.moe.is_some();
    let regions = model.region_sizes().len() as u32;
    let batch = model.batch_size;

    // Data parallelism: (step, (degree, ZeRO stage)).
    let mut replicate: Vec<Choice> = vec![(None, Some((1, 0)))];
    if bundled {
        for d in divisors(devices) {
            if !batch.is_multiple_of(d) {
                continue;
            }
            // The default 25 MiB gradient buckets (DDP's), smaller and
            // larger ones; ZeRO-3 works per segment, with or without
            // resharding after the forward.
            let dd = ("degree", d.to_string());
            replicate.push((
                Some(Step::new("dp", std::slice::from_ref(&dd))),
                Some((d, 0)),
            ));
            for b in OTHER_BUCKETS {
                replicate.push((
                    Some(Step::new(
                        "dp",
                        &[dd.clone(), ("bucket-bytes", b.to_string())],
                    )),
                    Some((d, 0)),
                ));
            }
            for z in 1..=3u8 {
                let base = [("stage", z.to_string()), ("dp", d.to_string())];
                replicate.push((Some(Step::new("zero", &base)), Some((d, z))));
                let others: Vec<(&str, String)> = match z {
                    3 => vec![("reshard-after-forward", "false".into())],
                    _ => OTHER_BUCKETS
                        .iter()
                        .map(|b| ("bucket-bytes", b.to_string()))
                        .collect(),
                };
                for other in others {
                    let mut more = base.to_vec();
                    more.push(other);
                    replicate.push((Some(Step::new("zero", &more)), Some((d, z))));
                }
            }
        }
    }
    replicate.extend(user(Role::Replicate).into_iter().map(|s| (Some(s), None)));

    let mut out = Vec::new();
    for (rep, rep_shape) in &replicate {
        let dp = rep_shape.map(|s| s.0);
        let rest = dp.map(|d| devices / d);
        // Tensor parallelism inside a node and inside each data-parallel
        // replica's devices (the mesh: tp × pp × dp).
        let mut tensor: Vec<(Option<Step>, Option<u32>)> = vec![(None, Some(1))];
        if bundled {
            for t in divisors(rest.unwrap_or(devices)) {
                let fits = t > 1 && t <= per_node && model.tensor_split(t).is_ok();
                if fits {
                    tensor.push((Some(Step::new("tp", &[("tp", t.to_string())])), Some(t)));
                }
            }
        }
        tensor.extend(user(Role::Tensor).into_iter().map(|s| (Some(s), None)));
        // Context parallelism next to tp (the mesh: tp × cp × pp × dp), on
        // models that run the memory-efficient attention.
        // (tp step, cp degree, tp degree, pipeline positions)
        type Context = (Option<Step>, u32, Option<u32>, Option<u32>);
        let mut contexts: Vec<Context> = Vec::new();
        for (tp_step, tp) in &tensor {
            let positions = match (rest, tp) {
                (Some(r), Some(t)) if r % t == 0 => Some(r / t),
                (Some(_), Some(_)) => continue,
                _ => None,
            };
            contexts.push((tp_step.clone(), 1, *tp, positions));
            if bundled && model.flash_attention() {
                for c in divisors(positions.unwrap_or(1)) {
                    if c > 1 && model.seq_len.is_multiple_of(2 * c) {
                        contexts.push((tp_step.clone(), c, *tp, positions.map(|p| p / c)));
                    }
                }
            }
        }
        for (tp_step, cp, tp, positions) in &contexts {
            let (tp_step, cp, tp, positions) = (tp_step, *cp, tp, *positions);
            let cp_step = (cp > 1).then(|| Step::new("cp", &[("cp", cp.to_string())]));
            // Expert parallelism over the data-parallel group (or every
            // device; with tensor or context parallelism, the dp × tp × cp
            // mesh, which tensor-parallel experts need), MoE models only.
            let mut experts: Vec<(Option<Step>, u32)> = match tp_step {
                Some(_) if moe => Vec::new(),
                _ => vec![(None, 1)],
            };
            if moe {
                if bundled {
                    let e = match (dp, tp) {
                        (Some(1), Some(1)) if cp == 1 => devices,
                        (Some(d), Some(t)) => d * t * cp,
                        _ => 1,
                    };
                    if e > 1 && model.moe.as_ref().is_some_and(|m| m.experts % e == 0) {
                        experts.push((Some(Step::new("ep", &[])), e));
                    }
                }
                experts.extend(user(Role::Experts).into_iter().map(|s| (Some(s), 1)));
            }
            for (ep_step, ep) in &experts {
                // `ep` alone replicates the model over every device.
                let positions = match (ep_step.is_some(), dp, positions) {
                    (true, Some(1), Some(_)) if tp_step.is_none() && cp == 1 => Some(1),
                    (_, _, p) => p,
                };
                let head: Vec<Step> = [rep, tp_step, &cp_step, ep_step]
                    .into_iter()
                    .flatten()
                    .cloned()
                    .collect();
                let shape = |pp: u32, copies: u32, microbatches: u32, chunks: u32| {
                    rep_shape.zip(*tp).map(|((d, z), t)| Shape {
                        dp: d,
                        zero: z,
                        tp: t,
                        cp,
                        ep: *ep,
                        pp,
                        copies,
                        microbatches,
                        chunks,
                    })
                };
                // Experts on a tensor-parallel mesh split each replica's
                // sequences of a microbatch over the tp group: they must
                // divide (compile refuses the plan otherwise).
                let split = match (ep_step, tp) {
                    (Some(_), Some(t)) if moe => *t,
                    _ => 1,
                };
                let replicas = dp.unwrap_or(1);
                // No pipeline: the model must already be on every device.
                if positions == Some(1) && !head.is_empty() {
                    if !(batch / replicas.max(1)).is_multiple_of(split) {
                        continue;
                    }
                    out.push(Candidate {
                        steps: head.clone(),
                        shape: shape(1, 1, 1, 1),
                    });
                    continue;
                }
                for (step, m, chunks) in
                    pipelines(positions, regions, batch / replicas.max(1), split, bundled)
                {
                    let copies = if step.plugin == "dualpipe" { 2 } else { 1 };
                    // ZeRO-2/3 over DualPipe's parameter copies is not
                    // supported (ZeRO-1 is).
                    if copies == 2 && rep_shape.is_some_and(|(_, z)| z > 1) {
                        continue;
                    }
                    let mut steps = head.clone();
                    steps.push(step);
                    out.push(Candidate {
                        steps,
                        shape: positions.and_then(|p| shape(p, copies, m, chunks)),
                    });
                }
                for step in user(Role::Pipeline) {
                    let mut steps = head.clone();
                    steps.push(step);
                    out.push(Candidate { steps, shape: None });
                }
            }
        }
    }
    out
}

/// The bundled pipeline schedules over `positions` pipeline devices (when
/// known), with microbatch counts that divide a replica's `batch` rows into
/// microbatches of a multiple of `split` rows and meet each schedule's
/// documented preconditions; each with its microbatch count and the model
/// chunks a position holds.
fn pipelines(
    positions: Option<u32>,
    regions: u32,
    batch: u32,
    split: u32,
    bundled: bool,
) -> Vec<(Step, u32, u32)> {
    let Some(p) = positions.filter(|p| *p >= 2 && bundled) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for k in [1, 2, 4, 8, 16] {
        let m = p * k;
        if m == 0 || !batch.is_multiple_of(m) || !(batch / m).is_multiple_of(split.max(1)) {
            continue;
        }
        let mb = ("microbatches", m.to_string());
        if regions >= p {
            for name in ["gpipe", "1f1b", "zb-h1"] {
                out.push((Step::new(name, std::slice::from_ref(&mb)), m, 1));
            }
            if p % 2 == 0 && m >= 2 * p && m % 2 == 0 {
                out.push((Step::new("dualpipe", std::slice::from_ref(&mb)), m, 2));
            }
        }
        if regions >= 2 * p && m >= 2 * p {
            for name in ["dualpipev", "zbv"] {
                out.push((Step::new(name, std::slice::from_ref(&mb)), m, 2));
            }
        }
        for v in [2u32, 4] {
            if regions >= p * v {
                for name in ["interleaved-1f1b", "interleaved-zb"] {
                    out.push((
                        Step::new(name, &[("virtual", v.to_string()), mb.clone()]),
                        m,
                        v,
                    ));
                }
            }
        }
    }
    out
}

/// Each `PP` region's compute: the forward and backward FLOPs of its
/// segments (the cost hints the simulator times).
pub fn region_costs(model: &ModelConfig) -> Vec<f64> {
    let mut costs = vec![0.0; model.region_sizes().len()];
    for s in model.segments() {
        if let Some(c) = costs.get_mut(s.region as usize) {
            *c += s.cost.fwd_flops + s.cost.bwd_flops;
        }
    }
    costs
}

/// The most regions the balanced cut's search takes on (it is quadratic in
/// them, times the stages).
const MAX_BALANCED_REGIONS: usize = 2048;

/// The first region of each of `stages` contiguous runs of `costs` that
/// make the heaviest run lightest (and, among those, the runs' squared sum
/// smallest: the lighter stages even too), when that heaviest run is
/// lighter than the even cut's ([`crate::sdk`]'s pipelines cut evenly,
/// earlier stages taking the remainder); `None` when the even cut is as
/// good, or the sizes are out of range.
pub fn balanced_boundaries(costs: &[f64], stages: u32) -> Option<Vec<u32>> {
    let (n, k) = (costs.len(), stages as usize);
    if k < 2 || k > n || n > MAX_BALANCED_REGIONS {
        return None;
    }
    let mut prefix = vec![0.0; n + 1];
    for (i, c) in costs.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    let run = |a: usize, b: usize| prefix[b] - prefix[a];
    let even_heaviest = {
        let (per, extra) = (n / k, n % k);
        let mut start = 0;
        let mut worst: f64 = 0.0;
        for s in 0..k {
            let end = start + per + usize::from(s < extra);
            worst = worst.max(run(start, end));
            start = end;
        }
        worst
    };
    // best[j][i]: the first i regions in j runs, as (heaviest, squares);
    // from[j][i]: where the last of those runs starts.
    let worse = |a: (f64, f64), b: (f64, f64)| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1));
    let none = (f64::INFINITY, f64::INFINITY);
    let mut best = vec![vec![none; n + 1]; k + 1];
    let mut from = vec![vec![0usize; n + 1]; k + 1];
    best[0][0] = (0.0, 0.0);
    for j in 1..=k {
        for i in j..=n - (k - j) {
            for start in (j - 1)..i {
                let prev = best[j - 1][start];
                if prev.0.is_infinite() {
                    continue;
                }
                let c = run(start, i);
                let cand = (prev.0.max(c), prev.1 + c * c);
                if worse(cand, best[j][i]).is_lt() {
                    best[j][i] = cand;
                    from[j][i] = start;
                }
            }
        }
    }
    if best[k][n].0 >= even_heaviest * (1.0 - 1e-9) {
        return None;
    }
    let mut firsts = vec![0u32; k];
    let mut i = n;
    for j in (1..=k).rev() {
        let start = from[j][i];
        firsts[j - 1] = start as u32;
        i = start;
    }
    Some(firsts)
}

/// `c` with its bundled pipeline cut at [`balanced_boundaries`] of
/// `model`'s region costs, when that cut is lighter than the even one.
/// `None` for candidates without a bundled pipeline (or a known shape).
pub fn balanced(c: &Candidate, model: &ModelConfig) -> Option<Candidate> {
    let shape = c.shape?;
    let last = c.steps.last()?;
    let stages = match last.plugin.as_str() {
        "dualpipe" => shape.pp,
        "gpipe" | "1f1b" | "zb-h1" | "zbv" | "dualpipev" | "interleaved-1f1b"
        | "interleaved-zb" => shape.pp.checked_mul(shape.chunks)?,
        _ => return None,
    };
    if last.options.iter().any(|(k, _)| k == "boundaries") {
        return None;
    }
    let firsts = balanced_boundaries(&region_costs(model), stages)?;
    let text = firsts
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join("/");
    let mut out = c.clone();
    let step = out.steps.last_mut()?;
    step.options.push(("boundaries".into(), text));
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundled_space_divides_the_model_and_the_cluster() {
        let tiny = ModelConfig::tiny();
        let all = enumerate(&tiny, 4, 4, None);
        let labels: Vec<String> = all.iter().map(Candidate::label).collect();
        for want in [
            "dp:degree=4",
            "zero:stage=3,dp=4",
            "zero:stage=1,dp=2+1f1b:microbatches=4",
            "tp:tp=2+gpipe:microbatches=2",
            "tp:tp=4",
            "1f1b:microbatches=16",
            "dualpipev:microbatches=8",
            "zbv:microbatches=8",
            "interleaved-1f1b:virtual=2,microbatches=4",
            "interleaved-zb:virtual=2,microbatches=4",
        ] {
            assert!(
                labels.contains(&want.to_string()),
                "{want} missing: {labels:?}"
            );
        }
        // With data parallelism (the mesh), inside each replica's devices;
        // degrees divide the devices; no duplicates.
        for want in [
            "dp:degree=2+tp:tp=2",
            "zero:stage=3,dp=2+tp:tp=2",
            "zero:stage=1,dp=2+tp:tp=2",
        ] {
            assert!(labels.contains(&want.to_string()), "{want} missing");
        }
        assert!(!labels.iter().any(|l| l.contains("dp=2+tp:tp=4")));
        assert!(!labels.iter().any(|l| l.contains("dp=3")));
        let mut sorted = labels.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), labels.len());
        // A bundled candidate knows its shape.
        let c = all
            .iter()
            .find(|c| c.label() == "zero:stage=2,dp=2+1f1b:microbatches=4")
            .unwrap();
        assert_eq!(
            c.shape,
            Some(Shape {
                dp: 2,
                zero: 2,
                tp: 1,
                cp: 1,
                ep: 1,
                pp: 2,
                copies: 1,
                microbatches: 4,
                chunks: 1,
            })
        );
    }

    /// Context parallelism is a role on models that run the memory-efficient
    /// attention: next to tp, inside each replica, with degrees whose
    /// 2·cp chunks divide the sequence; never on the probability kernel.
    #[test]
    fn context_parallelism_joins_the_space_on_flash_attention_models() {
        let probs = ModelConfig::tiny();
        let labels = |m: &ModelConfig| -> Vec<String> {
            enumerate(m, 8, 8, None)
                .iter()
                .map(Candidate::label)
                .collect()
        };
        assert!(!labels(&probs).iter().any(|l| l.contains("cp:")));
        let flash = ModelConfig {
            attention: crate::model::Attention::Flash,
            ..ModelConfig::tiny()
        };
        let all = enumerate(&flash, 8, 8, None);
        let labels: Vec<String> = all.iter().map(Candidate::label).collect();
        for want in [
            "cp:cp=8",
            "zero:stage=1,dp=2+tp:tp=2+cp:cp=2",
            "zero:stage=3,dp=2+cp:cp=2+1f1b:microbatches=4",
        ] {
            let cps: Vec<&String> = labels.iter().filter(|l| l.contains("cp:")).collect();
            assert!(
                labels.contains(&want.to_string()),
                "{want} missing: {cps:?}"
            );
        }
        let c = all
            .iter()
            .find(|c| c.label() == "zero:stage=1,dp=2+tp:tp=2+cp:cp=2")
            .unwrap();
        assert_eq!(
            c.shape.map(|s| (s.dp, s.tp, s.cp, s.pp)),
            Some((2, 2, 2, 1))
        );
    }

    /// On a MoE model, tensor parallelism comes with `ep` over the dp × tp
    /// mesh (tensor-parallel experts need it), never without.
    #[test]
    fn moe_models_get_tensor_parallelism_with_experts_over_the_mesh() {
        let mut moe = ModelConfig::tiny();
        moe.moe = Some(crate::model::MoeConfig::new(8, 2));
        let all = enumerate(&moe, 8, 8, None);
        let labels: Vec<String> = all.iter().map(Candidate::label).collect();
        for want in [
            "dp:degree=2+tp:tp=2+ep+1f1b:microbatches=4",
            "zero:stage=1,dp=4+tp:tp=2+ep",
        ] {
            assert!(labels.contains(&want.to_string()), "{want} missing");
        }
        let c = all
            .iter()
            .find(|c| c.label() == "zero:stage=1,dp=4+tp:tp=2+ep")
            .unwrap();
        assert_eq!(c.shape.map(|s| (s.dp, s.tp, s.ep)), Some((4, 2, 8)));
        assert!(
            !labels
                .iter()
                .any(|l| l.contains("tp:tp=") && !l.contains("+ep")),
            "tp without ep on a MoE model"
        );
        // With the memory-efficient attention, cp joins: experts over the
        // dp × cp (× tp) mesh.
        moe.attention = crate::model::Attention::Flash;
        let all = enumerate(&moe, 8, 8, None);
        for (want, shape) in [
            (
                "zero:stage=1,dp=2+cp:cp=2+ep+1f1b:microbatches=4",
                (2, 1, 2, 4, 2),
            ),
            ("dp:degree=2+tp:tp=2+cp:cp=2+ep", (2, 2, 2, 8, 1)),
            ("cp:cp=4+ep+1f1b:microbatches=4", (1, 1, 4, 4, 2)),
        ] {
            let c = all.iter().find(|c| c.label() == want);
            let got = c
                .and_then(|c| c.shape)
                .map(|s| (s.dp, s.tp, s.cp, s.ep, s.pp));
            assert_eq!(got, Some(shape), "{want}");
        }
    }

    #[test]
    fn balanced_boundaries_lighten_the_heaviest_stage_or_keep_the_even_cut() {
        // gpt2-small: twelve one-layer regions, the last also holding the
        // LM head (about five layers' worth): the head's stage goes alone.
        let m = ModelConfig::gpt2_small();
        let costs = region_costs(&m);
        assert_eq!(costs.len(), 12);
        assert!(costs[11] > 4.0 * costs[5], "{costs:?}");
        let firsts = balanced_boundaries(&costs, 4).unwrap();
        assert_eq!(firsts, [0, 3, 7, 11]);
        // Even costs: the even cut is already the best.
        assert_eq!(balanced_boundaries(&[1.0; 12], 4), None);
        // The heaviest run is never heavier than the even cut's, over
        // assorted shapes; every stage keeps a region.
        for (costs, k) in [
            (vec![1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0], 3),
            (vec![5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 4),
            (vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2),
        ] {
            if let Some(f) = balanced_boundaries(&costs, k) {
                assert_eq!(f.len(), k as usize);
                assert_eq!(f[0], 0);
                assert!(f.windows(2).all(|w| w[0] < w[1]), "{f:?}");
            }
        }
        assert_eq!(balanced_boundaries(&[1.0; 3], 4), None);
        // A candidate gains the option; one without a pipeline does not.
        let all = enumerate(&m, 4, 4, None);
        let c = all
            .iter()
            .find(|c| c.label() == "1f1b:microbatches=16")
            .unwrap();
        assert_eq!(
            balanced(c, &m).unwrap().label(),
            "1f1b:microbatches=16,boundaries=0/3/7/11"
        );
        let dp = all.iter().find(|c| c.label() == "dp:degree=4").unwrap();
        assert!(balanced(dp, &m).is_none());
    }

    #[test]
    fn a_space_file_adds_plugins_with_value_lists_and_names_bad_values() {
        let f = SpaceFile::parse(
            "bundled = false\n[[plugin]]\nname = \"my.wasm\"\nrole = \"pipeline\"\n[plugin.options]\nmicrobatches = [4, 8]\nchunks = { from = 1, to = 3 }\nstream = \"pp\"\n",
            "space.toml",
        )
        .unwrap();
        let all = enumerate(&ModelConfig::tiny(), 4, 4, Some(&f));
        assert_eq!(
            all.len(),
            6,
            "{:?}",
            all.iter().map(Candidate::label).collect::<Vec<_>>()
        );
        assert!(all.iter().all(|c| c.steps.len() == 1 && c.shape.is_none()));
        for (text, want) in [
            ("[[plugin]]\nname = \"x\"\nrole = \"pipe\"\n", "unknown variant `pipe`"),
            (
                "[[plugin]]\nname = \"x\"\nrole = \"pipeline\"\n[plugin.options]\nmb = []\n",
                "option `mb` = []: an empty list",
            ),
            (
                "[[plugin]]\nname = \"x\"\nrole = \"pipeline\"\n[plugin.options]\nmb = { from = 9, to = 2 }\n",
                "the range ends (2) before it starts (9)",
            ),
            (
                "[[plugin]]\nname = \"x\"\nrole = \"pipeline\"\n[plugin.options]\nmb = { from = 1, to = 100000 }\n",
                "more than 256 values",
            ),
            ("bundled = false\n", "the space is empty"),
            ("colour = 3\n", "unknown field `colour`"),
        ] {
            let e = SpaceFile::parse(text, "space.toml").unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("space.toml"), "{text}: {e}");
        }
    }
}
