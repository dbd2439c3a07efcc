//! The compile cache: compiled components on disk, keyed by the component's
//! sha256 and the engine's compatibility hash. Deserializing compiled code is
//! only safe for files this host wrote, so each file ends with an HMAC-SHA256
//! under a random per-installation key (`key`, mode 0600); a file whose tag
//! does not verify is ignored and recompiled.

use sha2::{Digest, Sha256};
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use wasmtime::component::Component;
use wasmtime::Engine;

/// A directory of compiled components.
pub struct CompileCache {
    dir: PathBuf,
    key: [u8; 32],
}

/// The engine's compatibility hash as hex (changes with wasmtime version,
/// target and settings).
pub(crate) fn engine_hash(engine: &Engine) -> String {
    struct Sha(Sha256);
    impl Hasher for Sha {
        fn finish(&self) -> u64 {
            0
        }
        fn write(&mut self, bytes: &[u8]) {
            self.0.update(bytes);
        }
    }
    let mut h = Sha(Sha256::new());
    engine.precompile_compatibility_hash().hash(&mut h);
    h.0.finalize()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// HMAC-SHA256 over the cache entry's identity (component digest and engine
/// hash) and its body, so a valid file renamed to another plugin's key does
/// not verify.
fn tag(key: &[u8; 32], sha256: &str, engine_hash: &str, body: &[u8]) -> [u8; 32] {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    for part in [sha256.as_bytes(), engine_hash.as_bytes()] {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac.update(body);
    mac.finalize().into_bytes().into()
}

fn random_key() -> std::io::Result<[u8; 32]> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key)
        .map_err(|e| std::io::Error::other(format!("no OS randomness: {e}")))?;
    Ok(key)
}

impl CompileCache {
    /// Open (creating it, private to the user) the cache directory.
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
        let key_path = dir.join("key");
        let key = match std::fs::read(&key_path) {
            Ok(k) if k.len() == 32 => k.try_into().expect("32 bytes"),
            _ => {
                let key = random_key()?;
                let tmp = dir.join(format!("key.{}", std::process::id()));
                let mut f = std::fs::File::create(&tmp)?;
                #[cfg(unix)]
                {
                    use std::os::unix::fs::PermissionsExt;
                    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
                }
                f.write_all(&key)?;
                drop(f);
                std::fs::rename(&tmp, &key_path)?;
                // Another process may have won the race: use what is there.
                std::fs::read(&key_path)?.try_into().unwrap_or(key)
            }
        };
        Ok(CompileCache {
            dir: dir.to_path_buf(),
            key,
        })
    }

    fn path(&self, sha256: &str, engine: &str) -> PathBuf {
        self.dir.join(format!("{sha256}-{engine}.cwasm"))
    }

    /// A compiled component, if this host cached it and the file is intact.
    pub(crate) fn get(
        &self,
        engine: &Engine,
        sha256: &str,
        engine_hash: &str,
    ) -> Option<Component> {
        let bytes = std::fs::read(self.path(sha256, engine_hash)).ok()?;
        if bytes.len() < 32 {
            return None;
        }
        let (body, mac) = bytes.split_at(bytes.len() - 32);
        if tag(&self.key, sha256, engine_hash, body) != mac {
            tracing::warn!("compile cache: {sha256} fails its integrity check; recompiling");
            return None;
        }
        // SAFETY: the body was produced by `Component::serialize` of this
        // host (the HMAC under our private key proves it) for an engine with
        // the same compatibility hash.
        unsafe { Component::deserialize(engine, body) }.ok()
    }

    /// Store a compiled component (atomically: temp file, then rename).
    pub(crate) fn put(
        &self,
        component: &Component,
        sha256: &str,
        engine_hash: &str,
    ) -> std::io::Result<()> {
        let mut body = component
            .serialize()
            .map_err(|e| std::io::Error::other(format!("{e:#}")))?;
        let mac = tag(&self.key, sha256, engine_hash, &body);
        body.extend_from_slice(&mac);
        let path = self.path(sha256, engine_hash);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &body)?;
        std::fs::rename(&tmp, &path)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_tag_binds_the_body_to_its_digest_and_engine() {
        let key = [7u8; 32];
        let t = super::tag(&key, "aa", "e1", b"body");
        assert_ne!(t, super::tag(&key, "bb", "e1", b"body"));
        assert_ne!(t, super::tag(&key, "aa", "e2", b"body"));
        assert_ne!(t, super::tag(&key, "aa", "e1", b"bodz"));
        assert_ne!(t, super::tag(&[8u8; 32], "aa", "e1", b"body"));
        // Length prefixes: moving a byte between the parts changes the tag.
        assert_ne!(t, super::tag(&key, "a", "ae1", b"body"));
    }
}
