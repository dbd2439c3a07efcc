//! The run config (TOML) and how flags override it.
//!
//! ```toml
//! model = "tiny"              # preset, a model TOML path, or an inline [model] table
//! devices = 8
//!
//! [[strategy]]
//! name = "dp"                 # bundled name, path to a .wasm component, or oci://HOST/REPO:TAG
//! options = { degree = 2 }
//!
//! [[strategy]]
//! name = "1f1b"
//! options = { microbatches = 8 }
//!
//! [registry]                  # plugins by reference: `name = "oci://HOST/REPO:TAG"`
//! trusted_keys = ["ed25519:…"] # every oci:// plugin must be signed by one of these
//!
//! [precision]                 # fp32 by default; `--precision fp32|bf16` overrides
//! params = "bf16"             # parameters, activations, messages
//! reduce = "fp32"             # gradients and their reductions (alias `grads`)
//! master = "fp32"             # the weights AdamW steps
//!
//! [optimizer]                 # AdamW (defaults shown); `--weight-decay` overrides
//! beta1 = 0.9
//! beta2 = 0.95
//! eps = 1e-8
//! weight_decay = 0.1
//!
//! [sandbox]                   # limits for every plugin call
//! memory_mib = 512
//! fuel = 60_000_000_000
//! deadline_ms = 20_000
//! ```
//! Overrides (the CLI's `--model`, `--devices`, `--strategy`,
//! `--precision`): a model, a device count and a precision replace the
//! file's; strategies, when given, replace the file's whole strategy list. No strategy at all means the bundled `1f1b`
//! over every device.

use crate::model::{ModelConfig, ModelError, Precision};
use crate::plugin::SandboxLimits;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A run config that cannot be read or says something impossible.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading run config {}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("run config {}", .path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A strategy, an optimizer number or a size that is not one.
    #[error("{0}")]
    Invalid(String),
}

type Result<T, E = ConfigError> = std::result::Result<T, E>;

macro_rules! bail {
    ($($arg:tt)*) => {
        return Err(ConfigError::Invalid(format!($($arg)*)))
    };
}

/// What a caller sets over the file (the CLI's run flags).
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// The run config (TOML) to read, if any.
    pub config: Option<PathBuf>,
    /// A preset (`tiny`, `gpt2-small`, `llama-tiny`) or a model TOML file.
    pub model: Option<String>,
    pub devices: Option<u32>,
    /// `NAME[:k=v,...]` each; when any, the file's list is replaced.
    pub strategies: Vec<String>,
    /// A named precision policy (`fp32`, `bf16`) over the file's table.
    pub precision: Option<String>,
}

/// A model: a name/path, or the config inline.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ModelSpec {
    Name(String),
    Inline(ModelConfig),
}

/// One strategy of the list, with its options as text.
#[derive(Clone, Debug, PartialEq)]
pub struct StrategySpec {
    pub name: String,
    pub options: Vec<(String, String)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileStrategy {
    name: String,
    #[serde(default)]
    options: BTreeMap<String, toml::Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    model: Option<ModelSpec>,
    devices: Option<u32>,
    #[serde(default)]
    strategy: Vec<FileStrategy>,
    #[serde(default)]
    sandbox: SandboxLimits,
    #[serde(default)]
    registry: RegistryConfig,
    #[serde(default)]
    optimizer: OptimizerConfig,
    #[serde(default)]
    precision: Precision,
}

/// The run config's `[optimizer]` table: AdamW's hyper-parameters besides
/// the learning rate (which `--lr` and the schedule flags set).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimizerConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        let d = crate::runtime::AdamW::default();
        OptimizerConfig {
            beta1: d.beta1,
            beta2: d.beta2,
            eps: d.eps,
            weight_decay: d.weight_decay,
        }
    }
}

impl OptimizerConfig {
    /// Betas in [0, 1), eps positive, weight decay 0 or positive: each
    /// number named when it is not.
    pub fn check(&self) -> Result<()> {
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(b.is_finite() && (0.0..1.0).contains(&b)) {
                bail!("[optimizer] {name} must be at least 0 and below 1, got {b}");
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            bail!(
                "[optimizer] eps must be a positive number, got {}",
                self.eps
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            bail!(
                "the weight decay must be 0 or a positive number, got {}",
                self.weight_decay
            );
        }
        Ok(())
    }
}

/// The run config's `[registry]` table.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    /// Public keys (`ed25519:<base64>`); when any is given, every `oci://`
    /// plugin of the run needs a valid signature by one of them.
    #[serde(default)]
    pub trusted_keys: Vec<String>,
}

/// Everything a run needs, resolved.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The file it was read from, if any (a lockfile beside it pins its
    /// `oci://` plugins).
    pub path: Option<PathBuf>,
    pub model: ModelSpec,
    pub devices: Option<u32>,
    pub strategies: Vec<StrategySpec>,
    pub sandbox: SandboxLimits,
    pub registry: RegistryConfig,
    pub optimizer: OptimizerConfig,
    /// The precision policy (checked: fp32 master weights).
    pub precision: Precision,
}

/// The bundled pipeline strategy used when none is given.
pub const DEFAULT_STRATEGY: &str = "1f1b";

impl StrategySpec {
    /// `NAME[:k=v,k=v]`, NAME a bundled name, a path or an `oci://` reference.
    pub fn parse(s: &str) -> Result<Self> {
        let (name, opts) = match s.rsplit_once(':') {
            Some((n, o)) if o.contains('=') || o.is_empty() => (n, o),
            _ => (s, ""),
        };
        if name.is_empty() {
            bail!("strategy `{s}` has no name");
        }
        let mut options = Vec::new();
        for kv in opts.split(',').filter(|kv| !kv.trim().is_empty()) {
            let Some((k, v)) = kv.split_once('=') else {
                bail!("strategy `{s}`: option `{kv}` is not KEY=VALUE");
            };
            options.push((k.trim().to_string(), v.trim().to_string()));
        }
        Ok(StrategySpec {
            name: name.to_string(),
            options,
        })
    }
}

fn value_text(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl RunConfig {
    /// Read the config file (if any) and apply the overrides over it.
    pub fn resolve(args: &Overrides) -> Result<Self> {
        let file: FileConfig = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                toml::from_str(&text).map_err(|source| ConfigError::Parse {
                    path: path.clone(),
                    source: Box::new(source),
                })?
            }
            None => FileConfig::default(),
        };
        // A file a config names (a model TOML, a strategy's `.wasm`) is
        // relative to the config, wherever it is run from.
        let beside = |name: String| -> String {
            let dir = args.config.as_deref().and_then(|c| c.parent());
            let is_file = name.ends_with(".toml") || name.ends_with(".wasm");
            match dir {
                Some(d) if is_file && std::path::Path::new(&name).is_relative() => {
                    d.join(&name).to_string_lossy().into_owned()
                }
                _ => name,
            }
        };
        let model = match (&args.model, file.model) {
            (Some(m), _) => ModelSpec::Name(m.clone()),
            (None, Some(ModelSpec::Name(n))) => ModelSpec::Name(beside(n)),
            (None, Some(m)) => m,
            (None, None) => ModelSpec::Name("tiny".into()),
        };
        let mut strategies: Vec<StrategySpec> = if args.strategies.is_empty() {
            file.strategy
                .into_iter()
                .map(|s| StrategySpec {
                    name: beside(s.name),
                    options: s
                        .options
                        .iter()
                        .map(|(k, v)| (k.clone(), value_text(v)))
                        .collect(),
                })
                .collect()
        } else {
            args.strategies
                .iter()
                .map(|s| StrategySpec::parse(s))
                .collect::<Result<_>>()?
        };
        if strategies.is_empty() {
            strategies.push(StrategySpec {
                name: DEFAULT_STRATEGY.into(),
                options: Vec::new(),
            });
        }
        let precision = match &args.precision {
            Some(name) => Precision::named(name).map_err(ConfigError::Invalid)?,
            None => file.precision,
        };
        precision.check().map_err(ConfigError::Invalid)?;
        Ok(RunConfig {
            path: args.config.clone(),
            model,
            devices: args.devices.or(file.devices),
            strategies,
            sandbox: file.sandbox,
            registry: file.registry,
            optimizer: file.optimizer,
            precision,
        })
    }

    /// The model, carrying the run's precision policy.
    pub fn model_config(&self) -> Result<ModelConfig> {
        let mut m = match &self.model {
            ModelSpec::Name(n) => ModelConfig::from_name_or_file(n)?,
            ModelSpec::Inline(m) => {
                m.validate()?;
                m.clone()
            }
        };
        m.precision = self.precision;
        Ok(m)
    }
}

/// `512MiB`, `2GiB`, `1000000`.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mult) = [
        ("KiB", 1u64 << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("TiB", 1 << 40),
        ("KB", 1000),
        ("MB", 1_000_000),
        ("GB", 1_000_000_000),
        ("B", 1),
    ]
    .iter()
    .find_map(|(u, m)| t.strip_suffix(u).map(|n| (n.trim(), *m)))
    .unwrap_or((t, 1));
    let Ok(v) = num.parse::<f64>() else {
        bail!("`{s}` is not a size (e.g. 512MiB, 2GiB, 1000000)");
    };
    let bytes = v * mult as f64;
    if !(bytes >= 1.0 && bytes <= (1u64 << 60) as f64) {
        bail!("memory size `{s}` must be between 1 byte and 1 EiB");
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(super::parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(super::parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(super::parse_size("1000").unwrap(), 1000);
        assert!(super::parse_size("lots")
            .unwrap_err()
            .to_string()
            .contains("not a size"));
        // Extremes: never a silent 0 or a saturated cap.
        for bad in ["NaN", "inf", "-1GiB", "0", "99999999999TiB", "0.1B"] {
            let e = super::parse_size(bad).unwrap_err().to_string();
            assert!(
                e.contains("between 1 byte and 1 EiB") || e.contains("not a size"),
                "{bad}: {e}"
            );
        }
    }

    use super::*;

    #[test]
    fn strategy_specs_parse_names_paths_and_options() {
        let s = StrategySpec::parse("1f1b:microbatches=8,stages=4").unwrap();
        assert_eq!(s.name, "1f1b");
        assert_eq!(
            s.options,
            vec![
                ("microbatches".into(), "8".into()),
                ("stages".into(), "4".into())
            ]
        );
        assert_eq!(StrategySpec::parse("dp").unwrap().options, vec![]);
        let p = StrategySpec::parse("target/x.wasm:k=v").unwrap();
        assert_eq!(p.name, "target/x.wasm");
        assert!(StrategySpec::parse("1f1b:oops").unwrap().name == "1f1b:oops");
        assert!(StrategySpec::parse("1f1b:a=1,b").is_err());
    }

    #[test]
    fn flags_override_the_file_and_unknown_keys_are_errors() {
        let dir = std::env::temp_dir().join(format!("piper-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run.toml");
        std::fs::write(
            &path,
            "model = \"tiny\"\ndevices = 8\n[[strategy]]\nname = \"dp\"\noptions = { degree = 2 }\n[sandbox]\nfuel = 1000\n",
        )
        .unwrap();
        let args = Overrides {
            config: Some(path.clone()),
            devices: Some(2),
            ..Default::default()
        };
        let c = RunConfig::resolve(&args).unwrap();
        assert_eq!(c.devices, Some(2));
        assert_eq!(c.strategies[0].options, vec![("degree".into(), "2".into())]);
        assert_eq!(c.sandbox.fuel, 1000);
        assert_eq!(c.optimizer, OptimizerConfig::default());
        std::fs::write(&path, "[optimizer]\nbeta2 = 0.999\neps = 1e-6\n").unwrap();
        let o = RunConfig::resolve(&args).unwrap().optimizer;
        assert_eq!((o.beta1, o.beta2, o.eps), (0.9, 0.999, 1e-6));
        o.check().unwrap();
        std::fs::write(&path, "[optimizer]\nbeta2 = 1.0\n").unwrap();
        let e = RunConfig::resolve(&args)
            .unwrap()
            .optimizer
            .check()
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("beta2 must be at least 0 and below 1, got 1"),
            "{e}"
        );
        // The file is named, its parse error is the source.
        let chain = |e: ConfigError| {
            let cause = std::error::Error::source(&e).map(|c| c.to_string());
            format!("{e}: {}", cause.unwrap_or_default())
        };
        std::fs::write(&path, "[optimizer]\nbeta3 = 0.5\n").unwrap();
        let err = chain(RunConfig::resolve(&args).unwrap_err());
        assert!(err.contains("beta3") && err.contains("run.toml"), "{err}");
        std::fs::write(&path, "modle = \"tiny\"\n").unwrap();
        let err = chain(RunConfig::resolve(&args).unwrap_err());
        assert!(err.contains("modle"), "{err}");
        // The precision table reaches the model; the flag replaces it.
        std::fs::write(&path, "[precision]\nparams = \"bf16\"\n").unwrap();
        let c = RunConfig::resolve(&args).unwrap();
        assert_eq!(c.model_config().unwrap().precision, Precision::BF16);
        let flag = Overrides {
            precision: Some("fp32".into()),
            ..args.clone()
        };
        assert!(RunConfig::resolve(&flag).unwrap().precision.is_fp32());
        std::fs::write(&path, "[precision]\nmaster = \"bf16\"\n").unwrap();
        let err = RunConfig::resolve(&args).unwrap_err().to_string();
        assert!(err.contains("master weights must be fp32"), "{err}");
        let err = RunConfig::resolve(&Overrides {
            precision: Some("fp8".into()),
            ..args.clone()
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("unknown precision `fp8`"), "{err}");
    }
}
