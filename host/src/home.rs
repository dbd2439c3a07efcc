//! Where Piper keeps what it makes for later, and the digest that names
//! it: `$PIPER_HOME` (the plugin compile cache, the registry's store,
//! `piper calibrate`'s `cpu-local.toml`) and hex sha256. Its own module
//! because `plugin/`, `registry/`, `sim/`, `cli/` and the runtime's
//! checkpoints all use it and none owns it.

use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// `$PIPER_HOME`, defaulting to `$XDG_CACHE_HOME/piper` or `~/.cache/piper`:
/// the compile cache (`compiled/`), the plugin store (`store/`) and the
/// calibrated `cpu-local.toml`.
pub fn piper_home() -> PathBuf {
    std::env::var_os("PIPER_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|c| PathBuf::from(c).join("piper")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/piper")))
        .unwrap_or_else(|| std::env::temp_dir().join("piper"))
}

/// Hex sha256 of some bytes: a component's identity in errors, the cache
/// and the store.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
