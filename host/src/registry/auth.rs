//! Registry credentials, first found wins:
//! 1. `PIPER_REGISTRY_TOKEN`: a bearer token;
//! 2. `PIPER_REGISTRY_USERNAME` + `PIPER_REGISTRY_PASSWORD`: basic;
//! 3. docker's `config.json` (`$DOCKER_CONFIG/config.json`, else
//!    `~/.docker/config.json`), the entry for the registry host: `auth`
//!    (base64 `user:password`, what `docker login` writes), or
//!    `registrytoken` (bearer);
//! 4. anonymous.
//!
//! Credential helpers (`credsStore`, `credHelpers`) are not run: a plugin
//! pull never executes another program.

use super::RegistryError;
use base64::Engine;
use oci_client::secrets::RegistryAuth;
use std::path::PathBuf;

/// Where the credentials came from, for messages (never the secret).
pub fn credentials(registry: &str) -> Result<(RegistryAuth, String), RegistryError> {
    if let Ok(t) = std::env::var("PIPER_REGISTRY_TOKEN") {
        if !t.is_empty() {
            return Ok((RegistryAuth::Bearer(t), "PIPER_REGISTRY_TOKEN".into()));
        }
    }
    if let (Ok(u), Ok(p)) = (
        std::env::var("PIPER_REGISTRY_USERNAME"),
        std::env::var("PIPER_REGISTRY_PASSWORD"),
    ) {
        if !u.is_empty() {
            return Ok((RegistryAuth::Basic(u, p), "PIPER_REGISTRY_USERNAME".into()));
        }
    }
    let path = docker_config();
    let Some(path) = path else {
        return Ok((RegistryAuth::Anonymous, "anonymous".into()));
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((RegistryAuth::Anonymous, "anonymous".into()))
        }
        Err(e) => return Err(super::io("cannot read", &path)(e)),
    };
    let bad = |why: String| RegistryError::Invalid(format!("{}: {why}", path.display()));
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let auths = &v["auths"];
    let entry = [
        registry.to_string(),
        format!("https://{registry}"),
        format!("http://{registry}"),
    ]
    .iter()
    .find_map(|k| auths.get(k))
    .cloned();
    let Some(entry) = entry else {
        return Ok((RegistryAuth::Anonymous, "anonymous".into()));
    };
    let shown = format!("{} (auths.{registry})", path.display());
    if let Some(tok) = entry["registrytoken"].as_str().filter(|t| !t.is_empty()) {
        return Ok((RegistryAuth::Bearer(tok.to_string()), shown));
    }
    if let Some(a) = entry["auth"].as_str().filter(|a| !a.is_empty()) {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(a)
            .map_err(|e| bad(format!("auths.{registry}.auth is not base64 ({e})")))?;
        let text = String::from_utf8(raw)
            .map_err(|_| bad(format!("auths.{registry}.auth is not UTF-8")))?;
        let (u, p) = text
            .split_once(':')
            .ok_or_else(|| bad(format!("auths.{registry}.auth is not user:password")))?;
        return Ok((RegistryAuth::Basic(u.to_string(), p.to_string()), shown));
    }
    Ok((RegistryAuth::Anonymous, "anonymous".into()))
}

fn docker_config() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("DOCKER_CONFIG") {
        return Some(PathBuf::from(d).join("config.json"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker/config.json"))
}
