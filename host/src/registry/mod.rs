//! Plugin registry: strategies shared as OCI artifacts. Beside the flow,
//! before `plugin/`: it turns `oci://HOST/REPO:TAG` into verified component
//! bytes, which the plugin host then runs under the same sandbox as any other
//! plugin (a pulled plugin is a stranger's code and never gets more).
//!
//! - [`store`]: the local content-addressed store (`$PIPER_HOME/store`):
//!   every read re-hashes the bytes; files appear under their digest only
//!   whole (write, then rename); a per-digest lock keeps concurrent pulls
//!   (MPI ranks) from downloading twice.
//! - [`remote`]: the OCI distribution client (`oci-client` on tokio) writing
//!   and reading the CNCF Wasm layout: manifest, config
//!   `application/vnd.wasm.config.v0+json` (imports, exports), one
//!   `application/wasm` layer.
//! - [`auth`]: anonymous, basic or bearer credentials from the environment or
//!   docker's `config.json`.
//! - [`sign`]: ed25519 signatures stored as OCI artifacts referring to the
//!   plugin's manifest, and the trust a run config requires.
//! - [`lock`]: `piper.lock`, pinning each referenced plugin to its digest.

pub mod auth;
pub mod lock;
pub mod remote;
pub mod sign;
pub mod store;

pub use lock::Lockfile;
pub use sign::Trust;
pub use store::{Record, Store};

use crate::plugin::{PluginError, PluginHost};
use std::path::PathBuf;

/// The CNCF Wasm OCI artifact layout's media types.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.wasm.config.v0+json";
pub const LAYER_MEDIA_TYPE: &str = "application/wasm";
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";

/// Why a registry operation failed. Each case names the reference and what
/// to do next.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("`{0}` is not a plugin reference: {1}")]
    BadReference(String, String),
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} was altered: its name says sha256:{expected} but its bytes hash to sha256:{found}; refusing to use it (remove it with `piper plugin remove`, then pull again)")]
    TamperedStore {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error("{reference}: the registry sent bytes that hash to {found}, not the {expected} the manifest names; refusing them (the registry's storage was altered or the transfer corrupted)")]
    TamperedDownload {
        reference: String,
        expected: String,
        found: String,
    },
    #[error("{reference}: the tag now points to {found}, but the lockfile {lock} pins {locked}; refusing to run it (check who moved the tag; `piper lock` re-pins on purpose)")]
    LockMismatch {
        reference: String,
        lock: PathBuf,
        locked: String,
        found: String,
    },
    #[error("{reference} is not in the lockfile {lock}: run `piper lock` to pin it")]
    NotLocked { reference: String, lock: PathBuf },
    #[error("{registry} refused the credentials or asked for some: log in with `docker login {registry}` (read from ~/.docker/config.json or $DOCKER_CONFIG), or set PIPER_REGISTRY_USERNAME and PIPER_REGISTRY_PASSWORD (or PIPER_REGISTRY_TOKEN)")]
    Unauthorized { registry: String },
    #[error("cannot reach the registry {registry} ({cause}); `--offline` runs plugins already in the local store")]
    Unreachable { registry: String, cause: String },
    #[error("{reference}: not found in the registry")]
    NotFound { reference: String },
    #[error("{reference}: not in the local store, and --offline forbids the network (pull it first, or run without --offline)")]
    NotInStore { reference: String },
    #[error("{reference}: {message}")]
    Registry { reference: String, message: String },
    #[error("{reference} is not a Piper plugin artifact: {why}")]
    NotAPlugin { reference: String, why: String },
    #[error("{reference}: the registry sent more than the {size} bytes its manifest gives blob {digest}; refusing it (stopped reading there)")]
    Oversized {
        reference: String,
        digest: String,
        size: u64,
    },
    #[error("{0}")]
    Signature(String),
    #[error("--insecure (plain HTTP) is only for registries on this machine (localhost, 127.0.0.1, ::1), not {0}")]
    InsecureRemote(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Plugin(#[from] PluginError),
}

pub(crate) fn io(
    what: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> RegistryError {
    let path = path.into();
    move |source| RegistryError::Io { what, path, source }
}

/// `sha256:<hex>` of some bytes.
pub fn digest_of(bytes: &[u8]) -> String {
    format!("sha256:{}", crate::home::sha256_hex(bytes))
}

/// `oci://HOST[:PORT]/REPO(:TAG|@sha256:HEX)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl Reference {
    /// Whether a strategy spec names a registry plugin.
    pub fn is_oci(spec: &str) -> bool {
        spec.starts_with("oci://")
    }

    pub fn parse(text: &str) -> Result<Self, RegistryError> {
        let bad = |why: &str| RegistryError::BadReference(text.to_string(), why.to_string());
        let rest = text.strip_prefix("oci://").ok_or_else(|| {
            bad("it must start with oci:// (oci://HOST/REPO:TAG or oci://HOST/REPO@sha256:DIGEST)")
        })?;
        if rest.len() > 512 {
            return Err(bad("longer than 512 bytes"));
        }
        let (registry, path) = rest
            .split_once('/')
            .ok_or_else(|| bad("no repository after the registry host"))?;
        let host_ok = !registry.is_empty()
            && registry
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c));
        if !host_ok {
            return Err(bad(
                "the registry host may hold letters, digits, '.', '-', a :port or [IPv6]",
            ));
        }
        let (repository, tag, digest) = if let Some((repo, d)) = path.split_once('@') {
            let hex = d
                .strip_prefix("sha256:")
                .ok_or_else(|| bad("a digest must be sha256:<64 hex digits>"))?;
            if hex.len() != 64 || !hex.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')) {
                return Err(bad("a digest must be sha256:<64 lowercase hex digits>"));
            }
            (repo, None, Some(d.to_string()))
        } else {
            let (repo, tag) = match path.rsplit_once(':') {
                Some((r, t)) if !t.contains('/') => (r, t),
                _ => return Err(bad("it names no tag or digest (add :1.0.0 or @sha256:...)")),
            };
            let tag_ok = !tag.is_empty()
                && tag.len() <= 128
                && tag.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                && tag
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
            if !tag_ok {
                return Err(bad("a tag is 1 to 128 letters, digits, '.', '_' or '-'"));
            }
            (repo, Some(tag.to_string()), None)
        };
        // OCI repository names: lowercase components separated by '/'; no
        // empty, '.' or '..' component can reach the store's paths.
        let repo_ok = !repository.is_empty()
            && repository.split('/').all(|part| {
                !part.is_empty()
                    && part.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && part.ends_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c))
            });
        if !repo_ok {
            return Err(bad(
                "the repository is lowercase letters, digits and . _ - in /-separated parts",
            ));
        }
        Ok(Reference {
            registry: registry.to_string(),
            repository: repository.to_string(),
            tag,
            digest,
        })
    }

    /// The same repository at a digest.
    pub fn at_digest(&self, digest: &str) -> Reference {
        Reference {
            digest: Some(digest.to_string()),
            tag: None,
            ..self.clone()
        }
    }

    /// The same repository at a tag.
    pub fn at_tag(&self, tag: &str) -> Reference {
        Reference {
            tag: Some(tag.to_string()),
            digest: None,
            ..self.clone()
        }
    }

    /// Whether the registry is this machine (plain HTTP allowed there only).
    pub fn is_loopback(&self) -> bool {
        let host = match self.registry.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or(""),
            None => self.registry.split(':').next().unwrap_or(""),
        };
        matches!(host, "localhost" | "127.0.0.1" | "::1")
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oci://{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

/// How this invocation may reach registries.
#[derive(Clone, Debug, Default)]
pub struct Access {
    /// Plain HTTP, for loopback registries only.
    pub insecure: bool,
    /// Never touch the network: the local store only.
    pub offline: bool,
}

/// A plugin resolved for a run: its bytes (verified) and where they came from.
pub struct Resolved {
    pub bytes: Vec<u8>,
    /// `oci://HOST/REPO:TAG@sha256:...`, the plugin's origin in messages.
    pub origin: String,
    pub record: Record,
}

/// Resolve `spec` (an `oci://` reference) for a run: pin it through the
/// lockfile when there is one, take it from the store or the registry,
/// check the trusted signatures the run config requires, and return verified
/// bytes.
pub fn resolve_for_run(
    spec: &str,
    store: &Store,
    access: &Access,
    lock: Option<&Lockfile>,
    trust: &Trust,
    host: &PluginHost,
) -> Result<Resolved, RegistryError> {
    let reference = Reference::parse(spec)?;
    let locked = match lock {
        Some(l) => Some(l.digest_of(&reference)?),
        None => None,
    };
    let manifest_digest = match (&reference.digest, access.offline) {
        (Some(d), _) => d.clone(),
        (None, true) => match (&locked, store.tag(&reference)?) {
            (Some(l), _) => l.clone(),
            (None, Some(d)) => d,
            (None, None) => {
                return Err(RegistryError::NotInStore {
                    reference: reference.to_string(),
                })
            }
        },
        (None, false) => remote::Remote::new(&reference, access)?.resolve(&reference)?,
    };
    if let (Some(l), Some(lockfile)) = (&locked, lock) {
        if *l != manifest_digest {
            return Err(RegistryError::LockMismatch {
                reference: reference.to_string(),
                lock: lockfile.path.clone(),
                locked: l.clone(),
                found: manifest_digest,
            });
        }
    }
    let pinned = reference.at_digest(&manifest_digest);
    let (record, pulled) = match store.record(&manifest_digest)? {
        // Verified before it is trusted: a torn or altered blob is fetched
        // again online (offline, reading it below names both digests).
        Some(r) if store.intact(&r.component_digest) => (r, false),
        Some(r) if access.offline && store.has_blob(&r.component_digest) => (r, false),
        _ if access.offline => {
            return Err(RegistryError::NotInStore {
                reference: pinned.to_string(),
            })
        }
        _ => (pull_trusted(&pinned, store, access, host, trust)?, true),
    };
    let bytes = store.blob(&record.component_digest)?;
    if !pulled {
        trust.check(&reference, &record, store, access)?;
    }
    // The local tag moves only to what was verified and trusted.
    if reference.tag.is_some() && !access.offline {
        store.set_tag(&reference, &manifest_digest)?;
    }
    Ok(Resolved {
        bytes,
        origin: format!("{reference}@{manifest_digest}"),
        record,
    })
}

/// Download `reference` (tag or digest) into the store: manifest, config and
/// component, each verified against its digest; the component must load in
/// this host (its `info()` is kept in the record). Waits for, and then
/// reuses, a concurrent pull of the same component.
pub fn pull(
    reference: &Reference,
    store: &Store,
    access: &Access,
    host: &PluginHost,
) -> Result<Record, RegistryError> {
    pull_trusted(reference, store, access, host, &Trust::new(&[])?)
}

/// [`pull`], with the signatures `trust` requires checked once the bytes
/// are verified and before anything else happens to them: the component is
/// compiled, its `info()` run and the local tag moved only when a trusted
/// key signed it.
pub fn pull_trusted(
    reference: &Reference,
    store: &Store,
    access: &Access,
    host: &PluginHost,
    trust: &Trust,
) -> Result<Record, RegistryError> {
    if access.offline {
        return Err(RegistryError::NotInStore {
            reference: reference.to_string(),
        });
    }
    let remote = remote::Remote::new(reference, access)?;
    let manifest = remote.manifest(reference)?;
    let component_digest = manifest.layer_digest.clone();
    {
        let _guard = store.lock(&component_digest)?;
        if !store.intact(&component_digest) {
            let bytes = remote.blob(reference, &component_digest, manifest.layer_size)?;
            store.put_blob(&bytes, &component_digest)?;
        }
    }
    let bytes = store.blob(&component_digest)?;
    let signatures = trust.verify(reference, &manifest.digest, &component_digest, &[], access)?;
    let plugin = host.load_bytes(&bytes, &reference.to_string())?;
    let mut record = Record::of(&plugin, reference, &manifest.digest, &component_digest);
    record.signatures = signatures;
    store.put_record(&record)?;
    if reference.tag.is_some() {
        store.set_tag(reference, &manifest.digest)?;
    }
    Ok(record)
}

/// Publish a component file to `reference` (a semver tag): the CNCF layout,
/// the config listing the component's imports and exports. The component
/// must be one this host accepts. It is kept in the local store too.
pub fn publish(
    bytes: &[u8],
    reference: &Reference,
    store: &Store,
    access: &Access,
    host: &PluginHost,
) -> Result<Record, RegistryError> {
    let tag = reference.tag.as_deref().ok_or_else(|| {
        RegistryError::Invalid(format!(
            "{reference}: publish to a tag (oci://HOST/REPO:1.0.0), not a digest"
        ))
    })?;
    semver::Version::parse(tag).map_err(|e| {
        RegistryError::Invalid(format!(
            "{reference}: tags are semantic versions (1.0.0, 0.2.1-rc.1): `{tag}` is not ({e})"
        ))
    })?;
    let inspection = host.inspect(bytes, &reference.to_string())?;
    let plugin = inspection.verdict?;
    let remote = remote::Remote::new(reference, access)?;
    let published = remote.publish(
        reference,
        bytes,
        &plugin,
        &inspection.imports,
        &inspection.exports,
    )?;
    let component_digest = digest_of(bytes);
    store.put_blob(bytes, &component_digest)?;
    let record = Record::of(&plugin, reference, &published, &component_digest);
    store.put_record(&record)?;
    store.set_tag(reference, &published)?;
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_tags_and_digests_and_refuse_the_rest() {
        let r = Reference::parse("oci://127.0.0.1:5000/team/zb-h1:1.2.0").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5000");
        assert_eq!(r.repository, "team/zb-h1");
        assert_eq!(r.tag.as_deref(), Some("1.2.0"));
        assert!(r.is_loopback());
        assert_eq!(r.to_string(), "oci://127.0.0.1:5000/team/zb-h1:1.2.0");
        let d = format!("oci://ghcr.io/a/b@sha256:{}", "ab".repeat(32));
        let r = Reference::parse(&d).unwrap();
        assert_eq!(r.digest.as_deref(), Some(&d[d.find('@').unwrap() + 1..]));
        assert!(!r.is_loopback());
        assert_eq!(r.to_string(), d);
        for bad in [
            "ghcr.io/a/b:1",
            "oci://ghcr.io",
            "oci://ghcr.io/a/b",
            "oci://ghcr.io/A/b:1",
            "oci://ghcr.io/a/../b:1",
            "oci://ghcr.io/a//b:1",
            "oci://ghcr.io/a/b:",
            "oci://ghcr.io/a/b:x/y",
            "oci://ghcr.io/a/b@sha256:12",
            "oci://gh cr.io/a/b:1",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad}");
        }
        assert!(Reference::parse("oci://localhost:5000/x:1")
            .unwrap()
            .is_loopback());
        assert!(Reference::parse("oci://[::1]:5000/x:1")
            .unwrap()
            .is_loopback());
    }
}
