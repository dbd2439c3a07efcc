//! The local plugin store, content-addressed: `$PIPER_HOME/store/`
//!
//! ```text
//! blobs/sha256/<hex>            component bytes, named by their digest
//! manifests/sha256/<hex>.json   a Record per manifest digest (name, version, WIT, info, source)
//! tags/<registry>/<repo>/<tag>  the manifest digest a tag pointed to when last seen
//! locks/<hex>.lock              one per component being downloaded
//! ```
//!
//! Every read of a blob re-hashes it and refuses a mismatch with both
//! digests. Every write goes to a temporary file in the same folder and is
//! renamed into place, so a half-written file is never visible under its
//! name; concurrent writers of the same digest write the same bytes.

use super::{io, Reference, RegistryError};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::{Path, PathBuf};

/// What the store knows about one pulled, published or built plugin.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// `oci://HOST/REPO@sha256:...`
    pub reference: String,
    pub manifest_digest: String,
    pub component_digest: String,
    pub name: String,
    pub version: String,
    pub description: String,
    /// `piper:strategy@0.1.0`
    pub wit: String,
    /// The option names `info()` declares.
    pub options: Vec<String>,
    /// Unix seconds when it entered the store.
    pub stored_at: u64,
    /// Signatures found and verified for it (public keys, `ed25519:...`).
    #[serde(default)]
    pub signatures: Vec<super::sign::Signature>,
}

impl Record {
    /// The record of a loaded plugin from `reference` at these digests.
    pub fn of(
        plugin: &crate::plugin::Plugin,
        reference: &Reference,
        manifest_digest: &str,
        component_digest: &str,
    ) -> Record {
        Record {
            reference: reference.at_digest(manifest_digest).to_string(),
            manifest_digest: manifest_digest.into(),
            component_digest: component_digest.into(),
            name: plugin.info.name.clone(),
            version: plugin.info.version.clone(),
            description: plugin.info.description.clone(),
            wit: format!("piper:strategy@{}", plugin.wit_version),
            options: plugin.info.options.iter().map(|o| o.name.clone()).collect(),
            stored_at: now(),
            signatures: Vec::new(),
        }
    }
}

/// Unix seconds now.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub struct Store {
    root: PathBuf,
}

/// Holds a per-digest lock until dropped.
pub struct Guard(#[allow(dead_code)] File);

fn hex_of(digest: &str) -> Result<&str, RegistryError> {
    digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')))
        .ok_or_else(|| RegistryError::Invalid(format!("`{digest}` is not a sha256 digest")))
}

impl Store {
    /// `$PIPER_HOME/store` (`PIPER_HOME` defaulting as for the compile cache).
    pub fn default_dir() -> PathBuf {
        crate::home::piper_home().join("store")
    }

    pub fn open(root: &Path) -> Result<Self, RegistryError> {
        for sub in ["blobs/sha256", "manifests/sha256", "tags", "locks"] {
            let d = root.join(sub);
            std::fs::create_dir_all(&d).map_err(io("cannot create the plugin store folder", &d))?;
        }
        Ok(Store { root: root.into() })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn blob_path(&self, digest: &str) -> Result<PathBuf, RegistryError> {
        Ok(self.root.join("blobs/sha256").join(hex_of(digest)?))
    }

    fn record_path(&self, manifest_digest: &str) -> Result<PathBuf, RegistryError> {
        Ok(self
            .root
            .join("manifests/sha256")
            .join(format!("{}.json", hex_of(manifest_digest)?)))
    }

    fn tag_path(&self, r: &Reference) -> Result<PathBuf, RegistryError> {
        let tag = r
            .tag
            .as_deref()
            .ok_or_else(|| RegistryError::Invalid(format!("{r} has no tag")))?;
        // Reference::parse admits no '..', empty or '/'-bearing parts here.
        Ok(self
            .root
            .join("tags")
            .join(&r.registry)
            .join(&r.repository)
            .join(tag))
    }

    /// Write `bytes` to `path` whole: a temporary file, then a rename.
    fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RegistryError> {
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
        let tmp = dir.join(format!(
            ".tmp-{}-{:?}-{}",
            std::process::id(),
            std::thread::current().id(),
            path.file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default()
        ));
        // Written and flushed to disk before it takes its name, and the
        // rename made durable: a crash never leaves a torn file named.
        let mut f = File::create(&tmp).map_err(io("cannot write", &tmp))?;
        std::io::Write::write_all(&mut f, bytes).map_err(io("cannot write", &tmp))?;
        f.sync_all().map_err(io("cannot write", &tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(io("cannot move into place", path))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("cannot write", dir))
    }

    /// Whether a blob file exists under this digest (not yet verified).
    pub fn has_blob(&self, digest: &str) -> bool {
        self.blob_path(digest).is_ok_and(|p| p.is_file())
    }

    /// Whether the blob under `digest` is there and hashes to it (a torn
    /// or altered file is not: it is fetched again where that is allowed).
    pub fn intact(&self, digest: &str) -> bool {
        self.has_blob(digest) && self.blob(digest).is_ok()
    }

    /// The bytes stored under `digest`, verified.
    pub fn blob(&self, digest: &str) -> Result<Vec<u8>, RegistryError> {
        let path = self.blob_path(digest)?;
        let bytes = std::fs::read(&path).map_err(io("cannot read the stored plugin", &path))?;
        let found = super::digest_of(&bytes);
        if found != digest {
            return Err(RegistryError::TamperedStore {
                path,
                expected: hex_of(digest)?.to_string(),
                found: found.trim_start_matches("sha256:").to_string(),
            });
        }
        Ok(bytes)
    }

    /// Keep `bytes`, which must hash to `digest`.
    pub fn put_blob(&self, bytes: &[u8], digest: &str) -> Result<(), RegistryError> {
        let found = super::digest_of(bytes);
        if found != digest {
            return Err(RegistryError::Invalid(format!(
                "refusing to store bytes hashing to {found} under {digest}"
            )));
        }
        Self::write_atomic(&self.blob_path(digest)?, bytes)
    }

    /// An exclusive lock for work on one digest (blocks while another
    /// process holds it).
    pub fn lock(&self, digest: &str) -> Result<Guard, RegistryError> {
        let path = self
            .root
            .join("locks")
            .join(format!("{}.lock", hex_of(digest)?));
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io("cannot open the lock", &path))?;
        f.lock().map_err(io("cannot lock", &path))?;
        Ok(Guard(f))
    }

    pub fn put_record(&self, r: &Record) -> Result<(), RegistryError> {
        let text = serde_json::to_vec_pretty(r).expect("a record serializes");
        Self::write_atomic(&self.record_path(&r.manifest_digest)?, &text)
    }

    pub fn record(&self, manifest_digest: &str) -> Result<Option<Record>, RegistryError> {
        let path = self.record_path(manifest_digest)?;
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| {
                RegistryError::Invalid(format!(
                    "{} is not a store record ({e}); remove it and pull again",
                    path.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("cannot read", path)(e)),
        }
    }

    pub fn set_tag(&self, r: &Reference, manifest_digest: &str) -> Result<(), RegistryError> {
        hex_of(manifest_digest)?;
        Self::write_atomic(&self.tag_path(r)?, manifest_digest.as_bytes())
    }

    /// The manifest digest a tag pointed to when last seen.
    pub fn tag(&self, r: &Reference) -> Result<Option<String>, RegistryError> {
        let path = self.tag_path(r)?;
        match std::fs::read_to_string(&path) {
            Ok(t) => {
                let t = t.trim().to_string();
                hex_of(&t)?;
                Ok(Some(t))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("cannot read", path)(e)),
        }
    }

    /// Every record, with the tags pointing at it.
    pub fn list(&self) -> Result<Vec<(Record, Vec<String>)>, RegistryError> {
        let dir = self.root.join("manifests/sha256");
        let mut out = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(io("cannot read", &dir))? {
            let p = e.map_err(io("cannot read", &dir))?.path();
            let Some(hex) = p
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if let Some(r) = self.record(&format!("sha256:{hex}"))? {
                out.push((r, Vec::new()));
            }
        }
        let mut tags = Vec::new();
        collect_files(&self.root.join("tags"), &mut tags);
        for t in tags {
            let Ok(digest) = std::fs::read_to_string(&t) else {
                continue;
            };
            let rel = t.strip_prefix(self.root.join("tags")).unwrap_or(&t);
            let parts: Vec<String> = rel
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if parts.len() < 3 {
                continue;
            }
            let shown = format!(
                "oci://{}/{}:{}",
                parts[0],
                parts[1..parts.len() - 1].join("/"),
                parts[parts.len() - 1]
            );
            if let Some((_, ts)) = out
                .iter_mut()
                .find(|(r, _)| r.manifest_digest == digest.trim())
            {
                ts.push(shown);
            }
        }
        out.sort_by(|a, b| a.0.reference.cmp(&b.0.reference));
        Ok(out)
    }

    /// Forget a reference: a tag, or (by digest) the record, its tags and
    /// the component when nothing else refers to it. Returns what went.
    pub fn remove(&self, r: &Reference) -> Result<Vec<String>, RegistryError> {
        let mut removed = Vec::new();
        let digest = match (&r.digest, &r.tag) {
            (Some(d), _) => Some(d.clone()),
            (None, Some(_)) => {
                let d = self.tag(r)?;
                if d.is_some() {
                    let p = self.tag_path(r)?;
                    std::fs::remove_file(&p).map_err(io("cannot remove", &p))?;
                    removed.push(r.to_string());
                }
                d
            }
            (None, None) => None,
        };
        let Some(digest) = digest else {
            return Ok(removed);
        };
        // Other tags still naming this manifest keep it.
        let still_tagged = self
            .list()?
            .into_iter()
            .any(|(rec, tags)| rec.manifest_digest == digest && !tags.is_empty());
        if r.tag.is_some() && still_tagged {
            return Ok(removed);
        }
        if let Some(rec) = self.record(&digest)? {
            let p = self.record_path(&digest)?;
            std::fs::remove_file(&p).map_err(io("cannot remove", &p))?;
            removed.push(rec.reference.clone());
            let shared = self
                .list()?
                .iter()
                .any(|(o, _)| o.component_digest == rec.component_digest);
            if !shared && self.has_blob(&rec.component_digest) {
                let b = self.blob_path(&rec.component_digest)?;
                std::fs::remove_file(&b).map_err(io("cannot remove", &b))?;
                removed.push(rec.component_digest.clone());
            }
        }
        Ok(removed)
    }
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect_files(&p, out);
        } else if !p
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with(".tmp-"))
        {
            out.push(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("piper-store-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn blobs_are_verified_on_every_read_and_tampering_names_both_digests() {
        let root = tmp("verify");
        let s = Store::open(&root).unwrap();
        let bytes = b"\0asm component".to_vec();
        let d = super::super::digest_of(&bytes);
        s.put_blob(&bytes, &d).unwrap();
        assert_eq!(s.blob(&d).unwrap(), bytes);
        assert!(
            s.put_blob(b"other", &d).is_err(),
            "bytes must match their name"
        );
        std::fs::write(s.blob_path(&d).unwrap(), b"\0asm evil").unwrap();
        let e = s.blob(&d).unwrap_err().to_string();
        let evil = super::super::digest_of(b"\0asm evil");
        assert!(e.contains(d.trim_start_matches("sha256:")), "{e}");
        assert!(e.contains(evil.trim_start_matches("sha256:")), "{e}");
        assert!(e.contains("was altered"), "{e}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
