//! `piper plugin check FILE`: what the host sees in a component — its WIT
//! version, imports, exports, what `info()` returns and whether this host
//! accepts it — without running `apply`.

pub use crate::plugin::Inspection;
use crate::plugin::{PluginError, PluginHost};
use std::path::Path;

/// Inspect the component at `path` with `host`'s limits.
pub fn check(host: &PluginHost, path: &Path) -> Result<Inspection, PluginError> {
    let bytes = std::fs::read(path).map_err(|e| PluginError {
        plugin: format!("`{}`", path.display()),
        call: "load".into(),
        cause: crate::plugin::Cause::Load(e.to_string()),
    })?;
    host.inspect(&bytes, &path.display().to_string())
}
