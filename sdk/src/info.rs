//! What a strategy says about itself: name, version, description and the
//! options it takes (with type, default and help), shown by `piper plugin info`
//! and used by the host to check options before `apply`.

use crate::bindings as b;

/// The type of an option's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptionType {
    Int,
    Float,
    Bool,
    Str,
}

/// One option a strategy takes.
#[derive(Clone, Debug, PartialEq)]
pub struct OptionSpec {
    pub name: String,
    pub ty: OptionType,
    /// Default value as text; `None`: optional, the strategy derives a value
    /// (say it in `help`).
    pub default: Option<String>,
    pub help: String,
}

impl OptionSpec {
    fn new(name: &str, ty: OptionType, default: Option<&str>, help: &str) -> Self {
        OptionSpec {
            name: name.into(),
            ty,
            default: default.map(String::from),
            help: help.into(),
        }
    }
    pub fn int(name: &str, default: Option<&str>, help: &str) -> Self {
        Self::new(name, OptionType::Int, default, help)
    }
    pub fn float(name: &str, default: Option<&str>, help: &str) -> Self {
        Self::new(name, OptionType::Float, default, help)
    }
    pub fn bool(name: &str, default: Option<&str>, help: &str) -> Self {
        Self::new(name, OptionType::Bool, default, help)
    }
    pub fn str(name: &str, default: Option<&str>, help: &str) -> Self {
        Self::new(name, OptionType::Str, default, help)
    }
}

/// A strategy's self-description.
#[derive(Clone, Debug, PartialEq)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub description: String,
    pub options: Vec<OptionSpec>,
}

impl PluginInfo {
    pub fn new(name: &str, version: &str, description: &str) -> Self {
        PluginInfo {
            name: name.into(),
            version: version.into(),
            description: description.into(),
            options: Vec::new(),
        }
    }
    /// Declare an option.
    pub fn option(mut self, spec: OptionSpec) -> Self {
        self.options.push(spec);
        self
    }
}

impl From<PluginInfo> for b::PluginInfo {
    fn from(p: PluginInfo) -> Self {
        b::PluginInfo {
            name: p.name,
            version: p.version,
            description: p.description,
            options: p
                .options
                .into_iter()
                .map(|o| b::OptionSpec {
                    name: o.name,
                    type_: match o.ty {
                        OptionType::Int => b::OptionType::Int,
                        OptionType::Float => b::OptionType::Float,
                        OptionType::Bool => b::OptionType::Bool,
                        OptionType::Str => b::OptionType::Str,
                    },
                    default: o.default,
                    help: o.help,
                })
                .collect(),
        }
    }
}
