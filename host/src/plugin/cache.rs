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

fn hmac(key: &[u8; 32], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    k[..32].copy_from_slice(key);
    let ipad: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
    let opad: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
    let inner = Sha256::new()
        .chain_update(&ipad)
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(&opad)
        .chain_update(inner)
        .finalize()
        .into()
}

fn random_key() -> std::io::Result<[u8; 32]> {
    let mut key = [0u8; 32];
    match std::fs::File::open("/dev/urandom") {
        Ok(mut f) => std::io::Read::read_exact(&mut f, &mut key)?,
        Err(_) => {
            // No /dev/urandom: derive from time, pid and addresses.
            let seed = format!(
                "{:?}{}{:p}",
                std::time::SystemTime::now(),
                std::process::id(),
                &key
            );
            key.copy_from_slice(&Sha256::digest(seed.as_bytes()));
        }
    }
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
        let (body, tag) = bytes.split_at(bytes.len() - 32);
        if hmac(&self.key, body) != tag {
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
        let tag = hmac(&self.key, &body);
        body.extend_from_slice(&tag);
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
    fn hmac_matches_rfc4231_test_case_2() {
        // RFC 4231 §4.3: key "Jefe" (zero-padded, as HMAC pads short keys).
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(b"Jefe");
        let tag = super::hmac(&key, b"what do ya want for nothing?");
        let hex: String = tag.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_ne!(tag, super::hmac(&[2; 32], b"what do ya want for nothing?"));
    }
}
