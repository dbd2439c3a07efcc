//! `piper.lock`: the `oci://` plugins of a run config pinned to digests.
//! `piper lock CONFIG` writes it beside the config; a run reads it from
//! there (or `--lock FILE`) and refuses a tag that now points elsewhere.
//!
//! ```toml
//! [[plugin]]
//! reference = "oci://registry.example.com/team/zb-v:1.2.0"
//! digest = "sha256:…"      # the manifest
//! component = "sha256:…"   # the component it names
//! ```

use super::{io, Reference, RegistryError};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub reference: String,
    pub digest: String,
    pub component: String,
}

#[derive(Serialize, Deserialize, Default)]
struct File {
    #[serde(default)]
    plugin: Vec<Entry>,
}

#[derive(Clone, Debug)]
pub struct Lockfile {
    pub path: PathBuf,
    pub entries: Vec<Entry>,
}

impl Lockfile {
    /// The lockfile beside a run config.
    pub fn beside(config: &Path) -> PathBuf {
        config.with_file_name("piper.lock")
    }

    pub fn read(path: &Path) -> Result<Self, RegistryError> {
        let text = std::fs::read_to_string(path).map_err(io("cannot read the lockfile", path))?;
        let f: File = toml::from_str(&text)
            .map_err(|e| RegistryError::Invalid(format!("lockfile {}: {e}", path.display())))?;
        Ok(Lockfile {
            path: path.into(),
            entries: f.plugin,
        })
    }

    pub fn write(&self) -> Result<(), RegistryError> {
        let mut text = String::from(
            "# Written by `piper lock`: the registry plugins of the run config, pinned.\n# A run refuses a tag that now points to another digest.\n\n",
        );
        text.push_str(
            &toml::to_string(&File {
                plugin: self.entries.clone(),
            })
            .expect("toml"),
        );
        std::fs::write(&self.path, text).map_err(io("cannot write the lockfile", &self.path))
    }

    /// The manifest digest pinned for `r` (a digest reference pins itself).
    pub fn digest_of(&self, r: &Reference) -> Result<String, RegistryError> {
        if let Some(d) = &r.digest {
            return Ok(d.clone());
        }
        let key = r.to_string();
        self.entries
            .iter()
            .find(|e| e.reference == key)
            .map(|e| e.digest.clone())
            .ok_or_else(|| RegistryError::NotLocked {
                reference: key,
                lock: self.path.clone(),
            })
    }
}
