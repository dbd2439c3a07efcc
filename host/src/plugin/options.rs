//! Strategy options: what a plugin declares (`info()`'s options, each with
//! its [`OptionType`]) and the check of what a user gives (`name=text`
//! pairs from `--strategy` or a run config) against it, completed with the
//! plugin's defaults, before `apply` runs.

use super::{bindings, Cause, Plugin, PluginHost};
use serde::Serialize;

/// A strategy option as the plugin declares it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OptionInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: OptionType,
    pub default: Option<String>,
    pub help: String,
}

/// The type of a strategy option's value; printed and serialized as
/// `int`, `float`, `bool` or `str`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OptionType {
    Int,
    Float,
    Bool,
    Str,
}

impl OptionType {
    pub fn as_str(self) -> &'static str {
        match self {
            OptionType::Int => "int",
            OptionType::Float => "float",
            OptionType::Bool => "bool",
            OptionType::Str => "str",
        }
    }
}

impl std::fmt::Display for OptionType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl PluginHost {
    /// Check `options` (name, text) against the plugin's declared options and
    /// complete them with defaults.
    pub fn check_options(
        plugin: &Plugin,
        options: &[(String, String)],
    ) -> Result<Vec<bindings::OptionEntry>, Cause> {
        let takes = || {
            if plugin.info.options.is_empty() {
                "it takes no options".to_string()
            } else {
                format!(
                    "it takes {}",
                    plugin
                        .info
                        .options
                        .iter()
                        .map(|o| format!("{} ({})", o.name, o.ty))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        };
        let parse = |spec: &OptionInfo, text: &str| -> Result<bindings::OptionValue, Cause> {
            let bad = || {
                Cause::Options(format!(
                    "option `{}` expects {} {}, got `{text}`",
                    spec.name,
                    if spec.ty == OptionType::Int {
                        "an"
                    } else {
                        "a"
                    },
                    spec.ty
                ))
            };
            Ok(match spec.ty {
                OptionType::Int => {
                    bindings::OptionValue::Int(text.trim().parse().map_err(|_| bad())?)
                }
                OptionType::Float => {
                    bindings::OptionValue::Float(text.trim().parse().map_err(|_| bad())?)
                }
                OptionType::Bool => bindings::OptionValue::Bool(match text.trim() {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    _ => return Err(bad()),
                }),
                OptionType::Str => bindings::OptionValue::Str(text.to_string()),
            })
        };
        let mut out = Vec::new();
        for (name, text) in options {
            let Some(spec) = plugin.info.options.iter().find(|o| &o.name == name) else {
                return Err(Cause::Options(format!(
                    "unknown option `{name}`: {}",
                    takes()
                )));
            };
            if out.iter().any(|e: &bindings::OptionEntry| &e.name == name) {
                return Err(Cause::Options(format!("option `{name}` is given twice")));
            }
            out.push(bindings::OptionEntry {
                name: name.clone(),
                value: parse(spec, text)?,
            });
        }
        for spec in &plugin.info.options {
            if let (Some(d), false) = (&spec.default, out.iter().any(|e| e.name == spec.name)) {
                let value = parse(spec, d).map_err(|_| {
                    Cause::Options(format!(
                        "the plugin's own default `{d}` for option `{}` is not a valid {}",
                        spec.name, spec.ty
                    ))
                })?;
                out.push(bindings::OptionEntry {
                    name: spec.name.clone(),
                    value,
                });
            }
        }
        Ok(out)
    }
}
