//! Typed access to the options the host passes to `apply` (already checked
//! against the strategy's declared types and completed with defaults).

use crate::bindings as b;

/// One option value.
#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
}

/// A wrongly typed or out-of-range option.
#[derive(Clone, Debug, PartialEq)]
pub struct OptionError {
    pub option: String,
    pub message: String,
}

impl std::fmt::Display for OptionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "option `{}`: {}", self.option, self.message)
    }
}

impl std::error::Error for OptionError {}

/// The options of one `apply` call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Options {
    pub entries: Vec<(String, OptionValue)>,
}

impl Options {
    pub fn new(entries: Vec<(String, OptionValue)>) -> Self {
        Options { entries }
    }

    pub(crate) fn from_wit(entries: Vec<b::OptionEntry>) -> Self {
        Options {
            entries: entries
                .into_iter()
                .map(|e| {
                    let v = match e.value {
                        b::OptionValue::Int(i) => OptionValue::Int(i),
                        b::OptionValue::Float(f) => OptionValue::Float(f),
                        b::OptionValue::Bool(x) => OptionValue::Bool(x),
                        b::OptionValue::Str(s) => OptionValue::Str(s),
                    };
                    (e.name, v)
                })
                .collect(),
        }
    }

    /// The raw value, if given or defaulted.
    pub fn get(&self, name: &str) -> Option<&OptionValue> {
        self.entries.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    fn err(name: &str, message: String) -> OptionError {
        OptionError {
            option: name.into(),
            message,
        }
    }

    /// An integer option as `u32` (an error if negative or too large).
    pub fn u32(&self, name: &str) -> Result<Option<u32>, OptionError> {
        match self.get(name) {
            None => Ok(None),
            Some(OptionValue::Int(i)) => u32::try_from(*i).map(Some).map_err(|_| {
                Self::err(name, format!("must be between 0 and {}, got {i}", u32::MAX))
            }),
            Some(v) => Err(Self::err(name, format!("expected an integer, got {v:?}"))),
        }
    }

    /// An integer option as `u64`.
    pub fn u64(&self, name: &str) -> Result<Option<u64>, OptionError> {
        match self.get(name) {
            None => Ok(None),
            Some(OptionValue::Int(i)) => u64::try_from(*i)
                .map(Some)
                .map_err(|_| Self::err(name, format!("must not be negative, got {i}"))),
            Some(v) => Err(Self::err(name, format!("expected an integer, got {v:?}"))),
        }
    }

    pub fn f64(&self, name: &str) -> Result<Option<f64>, OptionError> {
        match self.get(name) {
            None => Ok(None),
            Some(OptionValue::Float(f)) => Ok(Some(*f)),
            Some(OptionValue::Int(i)) => Ok(Some(*i as f64)),
            Some(v) => Err(Self::err(name, format!("expected a number, got {v:?}"))),
        }
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, OptionError> {
        match self.get(name) {
            None => Ok(None),
            Some(OptionValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Self::err(
                name,
                format!("expected true or false, got {v:?}"),
            )),
        }
    }

    pub fn str(&self, name: &str) -> Result<Option<&str>, OptionError> {
        match self.get(name) {
            None => Ok(None),
            Some(OptionValue::Str(s)) => Ok(Some(s)),
            Some(v) => Err(Self::err(name, format!("expected a string, got {v:?}"))),
        }
    }
}
