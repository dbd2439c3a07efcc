//! Plugin signatures: ed25519 over the plugin's manifest and component
//! digests, stored in the registry as an OCI artifact whose `subject` is the
//! plugin's manifest (found through the referrers API where the registry has
//! one) and tagged `sha256-<hex>.sig` (the convention for registries without
//! it). A run config's `[registry] trusted_keys` makes every `oci://` plugin
//! of the run need a valid signature by one of those keys.

use super::remote::Remote;
use super::{io, Access, Record, Reference, RegistryError, Store};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use ed25519_dalek::{Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The signature artifact's type (and its one layer's media type).
pub const ARTIFACT_TYPE: &str = "application/vnd.dev.piper.signature.v1+json";

/// One signature document, as stored in the registry and the local store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Signature {
    /// `ed25519:<base64 public key>`
    pub key: String,
    pub manifest: String,
    pub component: String,
    /// base64 of the 64-byte signature of [`message`].
    pub signature: String,
}

/// What is signed: both digests, with a domain prefix.
pub fn message(manifest: &str, component: &str) -> Vec<u8> {
    format!("piper-plugin-signature-v1\nmanifest {manifest}\ncomponent {component}\n").into_bytes()
}

pub fn public_text(k: &VerifyingKey) -> String {
    format!("ed25519:{}", B64.encode(k.as_bytes()))
}

pub fn parse_public(text: &str) -> Result<VerifyingKey, RegistryError> {
    let bad = |why: &str| {
        RegistryError::Signature(format!("public key `{text}`: {why} (expected ed25519:<base64 of 32 bytes>, as `piper plugin keygen` prints)"))
    };
    let b64 = text
        .strip_prefix("ed25519:")
        .ok_or_else(|| bad("no ed25519: prefix"))?;
    let raw = B64.decode(b64).map_err(|_| bad("not base64"))?;
    let arr: [u8; 32] = raw.try_into().map_err(|_| bad("not 32 bytes"))?;
    VerifyingKey::from_bytes(&arr).map_err(|_| bad("not a valid ed25519 point"))
}

/// Make a key pair: the private key to `path` (mode 0600, never
/// overwritten), the public one to `path.pub`; returns the public key text.
pub fn keygen(path: &Path) -> Result<String, RegistryError> {
    if path.exists() {
        return Err(RegistryError::Invalid(format!(
            "{} exists; refusing to overwrite a key",
            path.display()
        )));
    }
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed)
        .map_err(|e| RegistryError::Invalid(format!("no randomness for a key: {e}")))?;
    let key = SigningKey::from_bytes(&seed);
    let public = public_text(&key.verifying_key());
    let text = format!("ed25519-private:{}\n", B64.encode(seed));
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(io("cannot create the key file", path))?;
        f.write_all(text.as_bytes())
            .map_err(io("cannot write the key file", path))?;
    }
    let pub_path = path.with_extension("pub");
    std::fs::write(&pub_path, format!("{public}\n")).map_err(io("cannot write", &pub_path))?;
    Ok(public)
}

pub fn load_key(path: &Path) -> Result<SigningKey, RegistryError> {
    let text = std::fs::read_to_string(path).map_err(io("cannot read the key file", path))?;
    let bad = || {
        RegistryError::Signature(format!(
            "{} is not a private key written by `piper plugin keygen`",
            path.display()
        ))
    };
    let b64 = text
        .trim()
        .strip_prefix("ed25519-private:")
        .ok_or_else(bad)?;
    let raw = B64.decode(b64).map_err(|_| bad())?;
    let seed: [u8; 32] = raw.try_into().map_err(|_| bad())?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Sign the plugin at `r` and push the signature; returns it.
pub fn sign(r: &Reference, key: &SigningKey, access: &Access) -> Result<Signature, RegistryError> {
    let remote = Remote::new(r, access)?;
    let m = remote.manifest(r)?;
    let sig = key.sign(&message(&m.digest, &m.layer_digest));
    let doc = Signature {
        key: public_text(&key.verifying_key()),
        manifest: m.digest.clone(),
        component: m.layer_digest.clone(),
        signature: B64.encode(sig.to_bytes()),
    };
    let body = serde_json::to_vec(&doc).expect("json");
    let tag = format!("{}.sig", m.digest.replace(':', "-"));
    remote.push_referrer(r, &m.digest, m.raw.len() as u64, ARTIFACT_TYPE, &body, &tag)?;
    Ok(doc)
}

impl Signature {
    /// Whether this document is a valid signature of exactly these digests.
    fn verifies(&self, manifest: &str, component: &str) -> bool {
        if self.manifest != manifest || self.component != component {
            return false;
        }
        let Ok(k) = parse_public(&self.key) else {
            return false;
        };
        let Ok(raw) = B64.decode(&self.signature) else {
            return false;
        };
        let Ok(arr): Result<[u8; 64], _> = raw.try_into() else {
            return false;
        };
        k.verify(
            &message(manifest, component),
            &ed25519_dalek::Signature::from_bytes(&arr),
        )
        .is_ok()
    }
}

/// The keys a run trusts; empty: signatures not required.
#[derive(Clone, Debug, Default)]
pub struct Trust {
    keys: Vec<String>,
}

impl Trust {
    pub fn new(keys: &[String]) -> Result<Self, RegistryError> {
        let keys = keys
            .iter()
            .map(|k| parse_public(k).map(|v| public_text(&v)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Trust { keys })
    }

    pub fn required(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Refuse `record` unless a trusted key signed it. Online, the
    /// registry's signatures are read and the valid ones kept in the store
    /// (so `--offline` runs check the same documents again).
    pub fn check(
        &self,
        r: &Reference,
        record: &Record,
        store: &Store,
        access: &Access,
    ) -> Result<(), RegistryError> {
        if !self.required() {
            return Ok(());
        }
        let (m, c) = (&record.manifest_digest, &record.component_digest);
        let valid = self.verify(r, m, c, &record.signatures, access)?;
        let mut kept = record.clone();
        kept.signatures = valid;
        if kept != *record {
            store.put_record(&kept)?;
        }
        Ok(())
    }

    /// The valid signatures of manifest `m` with component `c` (those
    /// already `known`, and online the registry's), refused unless a
    /// trusted key made one. Nothing is loaded or stored here. With no
    /// trusted keys required: every valid one found, never refused.
    pub fn verify(
        &self,
        r: &Reference,
        m: &str,
        c: &str,
        known: &[Signature],
        access: &Access,
    ) -> Result<Vec<Signature>, RegistryError> {
        if !self.required() {
            return Ok(known.iter().filter(|d| d.verifies(m, c)).cloned().collect());
        }
        let mut docs: Vec<Signature> = known.to_vec();
        if !access.offline {
            let remote = Remote::new(r, access)?;
            let tag = format!("{}.sig", m.replace(':', "-"));
            for body in remote.referrers(r, m, ARTIFACT_TYPE, &tag)? {
                if let Ok(doc) = serde_json::from_slice::<Signature>(&body) {
                    if !docs.contains(&doc) {
                        docs.push(doc);
                    }
                }
            }
        }
        let valid: Vec<&Signature> = docs.iter().filter(|d| d.verifies(m, c)).collect();
        if valid.iter().any(|d| self.keys.contains(&d.key)) {
            return Ok(valid.into_iter().cloned().collect());
        }
        let who = format!("{r} ({m})");
        Err(RegistryError::Signature(if docs.is_empty() {
            format!(
                "{who} is unsigned, and the run config requires a signature by one of: {}",
                self.keys.join(", ")
            )
        } else if valid.is_empty() {
            format!(
                "{who}: none of its {} signature(s) verifies (the plugin or the signature was altered); refusing it",
                docs.len()
            )
        } else {
            format!(
                "{who} is signed only by keys this run does not trust ({}); trusted: {}",
                valid
                    .iter()
                    .map(|d| d.key.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                self.keys.join(", ")
            )
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_only_for_its_digests_and_key() {
        let key = SigningKey::from_bytes(&[7u8; 32]);
        let (m, c) = ("sha256:aa", "sha256:bb");
        let doc = Signature {
            key: public_text(&key.verifying_key()),
            manifest: m.into(),
            component: c.into(),
            signature: B64.encode(key.sign(&message(m, c)).to_bytes()),
        };
        assert!(doc.verifies(m, c));
        assert!(!doc.verifies(m, "sha256:cc"));
        let mut forged = doc.clone();
        forged.key = public_text(&SigningKey::from_bytes(&[8u8; 32]).verifying_key());
        assert!(!forged.verifies(m, c));
        assert!(parse_public("ed25519:abc").is_err());
        assert_eq!(parse_public(&doc.key).unwrap(), key.verifying_key());
    }
}
