//! The OCI distribution client: `oci-client` on a current-thread tokio
//! runtime, TLS by rustls (ring), plain HTTP only for loopback registries
//! under `--insecure`. Writes and reads the CNCF Wasm layout and checks every
//! byte it receives against its digest.

use super::auth;
use super::{
    Access, Reference, RegistryError, CONFIG_MEDIA_TYPE, LAYER_MEDIA_TYPE, MANIFEST_MEDIA_TYPE,
};
use crate::plugin::Plugin;
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::errors::OciDistributionError;
use oci_client::manifest::{OciDescriptor, OciImageIndex, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, RegistryOperation};
use std::collections::BTreeMap;

/// Largest manifest or config accepted, bytes (a plugin's are a few KiB).
const MAX_MANIFEST_BYTES: usize = 1 << 20;
/// Largest component accepted, bytes (a Python plugin is about 19 MiB).
pub const MAX_COMPONENT_BYTES: u64 = 256 << 20;
/// Referrer manifests read for one subject (signatures), and the largest
/// referrer body read.
const MAX_REFERRERS: usize = 16;
const MAX_REFERRER_BYTES: u64 = 64 << 10;

/// A blob's bytes as they arrive, refused past `limit` (the size its
/// descriptor gives): the stream stops at the first byte over.
struct Capped {
    buf: Vec<u8>,
    limit: u64,
    over: bool,
}

impl tokio::io::AsyncWrite for Capped {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        if me.buf.len() as u64 + data.len() as u64 > me.limit {
            me.over = true;
            return std::task::Poll::Ready(Err(std::io::Error::other(
                "past the size its descriptor gives",
            )));
        }
        me.buf.extend_from_slice(data);
        std::task::Poll::Ready(Ok(data.len()))
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

pub struct Remote {
    client: Client,
    /// Plain requests (capped manifest reads), with the client's protocol.
    http: reqwest::Client,
    scheme: &'static str,
    rt: tokio::runtime::Runtime,
    auth: RegistryAuth,
    registry: String,
}

/// A plugin manifest, checked to be the CNCF Wasm layout.
pub struct Manifest {
    /// Digest of the manifest bytes.
    pub digest: String,
    pub layer_digest: String,
    pub layer_size: u64,
    pub raw: Vec<u8>,
}

fn oci_ref(r: &Reference) -> oci_client::Reference {
    match (&r.digest, &r.tag) {
        (Some(d), _) => {
            oci_client::Reference::with_digest(r.registry.clone(), r.repository.clone(), d.clone())
        }
        (None, Some(t)) => {
            oci_client::Reference::with_tag(r.registry.clone(), r.repository.clone(), t.clone())
        }
        (None, None) => oci_client::Reference::with_tag(
            r.registry.clone(),
            r.repository.clone(),
            "latest".into(),
        ),
    }
}

impl Remote {
    pub fn new(r: &Reference, access: &Access) -> Result<Self, RegistryError> {
        if access.offline {
            return Err(RegistryError::NotInStore {
                reference: r.to_string(),
            });
        }
        if access.insecure && !r.is_loopback() {
            return Err(RegistryError::InsecureRemote(r.registry.clone()));
        }
        // rustls needs one process-wide crypto provider; a second install is a no-op error.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let protocol = if access.insecure {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        };
        let client = Client::new(ClientConfig {
            protocol,
            ..Default::default()
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| {
                RegistryError::Invalid(format!("cannot start the registry client: {e}"))
            })?;
        let (auth, _from) = auth::credentials(&r.registry)?;
        let http = reqwest::Client::builder().build().map_err(|e| {
            RegistryError::Invalid(format!("cannot start the registry client: {e}"))
        })?;
        Ok(Remote {
            client,
            http,
            scheme: if access.insecure { "http" } else { "https" },
            rt,
            auth,
            registry: r.registry.clone(),
        })
    }

    /// Turn a client error into one that says what to do.
    fn error(&self, r: &Reference, e: OciDistributionError) -> RegistryError {
        use OciDistributionError as E;
        match e {
            E::AuthenticationFailure(_) | E::UnauthorizedError { .. } => {
                RegistryError::Unauthorized {
                    registry: self.registry.clone(),
                }
            }
            E::ServerError {
                code: 401 | 403, ..
            } => RegistryError::Unauthorized {
                registry: self.registry.clone(),
            },
            E::ImageManifestNotFoundError(_) | E::ServerError { code: 404, .. } => {
                RegistryError::NotFound {
                    reference: r.to_string(),
                }
            }
            E::RegistryError { ref envelope, .. }
                if envelope.errors.iter().any(|x| {
                    let c = format!("{:?}", x.code);
                    c.contains("Unauthorized") || c.contains("Denied")
                }) =>
            {
                RegistryError::Unauthorized {
                    registry: self.registry.clone(),
                }
            }
            E::RegistryError { ref envelope, .. }
                if envelope
                    .errors
                    .iter()
                    .any(|x| format!("{:?}", x.code).contains("Unknown")) =>
            {
                RegistryError::NotFound {
                    reference: r.to_string(),
                }
            }
            E::DigestError(oci_client::errors::DigestError::VerificationError {
                expected,
                actual,
            }) => RegistryError::TamperedDownload {
                reference: r.to_string(),
                expected,
                found: actual,
            },
            E::RequestError(ref re) if re.is_connect() || re.is_timeout() => {
                RegistryError::Unreachable {
                    registry: self.registry.clone(),
                    cause: error_chain(re),
                }
            }
            other => RegistryError::Registry {
                reference: r.to_string(),
                message: other.to_string(),
            },
        }
    }

    /// The manifest digest a tag points to now.
    pub fn resolve(&self, r: &Reference) -> Result<String, RegistryError> {
        let oref = oci_ref(r);
        self.rt
            .block_on(self.client.fetch_manifest_digest(&oref, &self.auth))
            .map_err(|e| self.error(r, e))
    }

    /// `GET /v2/<repository>/<what>/<reference>` (a manifest, or a
    /// referrers index), authenticated as the client is, read against
    /// [`MAX_MANIFEST_BYTES`] as it arrives: the body and the digest the
    /// registry gives in `Docker-Content-Digest`.
    fn capped_get(
        &self,
        r: &Reference,
        path: &str,
        accept: &str,
    ) -> Result<(Vec<u8>, Option<String>), RegistryError> {
        let oref = oci_ref(r);
        let url = format!(
            "{}://{}/v2/{}/{path}",
            self.scheme,
            oref.resolve_registry(),
            oref.repository()
        );
        let unreachable = |e: reqwest::Error| RegistryError::Unreachable {
            registry: self.registry.clone(),
            cause: error_chain(&e),
        };
        self.rt.block_on(async {
            let token = self
                .client
                .auth(&oref, &self.auth, RegistryOperation::Pull)
                .await
                .map_err(|e| self.error(r, e))?;
            let mut req = self.http.get(&url).header(reqwest::header::ACCEPT, accept);
            req = match (token, &self.auth) {
                (Some(t), _) => req.bearer_auth(t),
                (None, RegistryAuth::Basic(u, p)) => req.basic_auth(u, Some(p)),
                (None, _) => req,
            };
            let mut res = req.send().await.map_err(unreachable)?;
            match res.status().as_u16() {
                200..=299 => {}
                401 | 403 => {
                    return Err(RegistryError::Unauthorized {
                        registry: self.registry.clone(),
                    })
                }
                404 => {
                    return Err(RegistryError::NotFound {
                        reference: r.to_string(),
                    })
                }
                code => {
                    return Err(RegistryError::Registry {
                        reference: r.to_string(),
                        message: format!("GET {url} answered {code}"),
                    })
                }
            }
            let digest = (res.headers().get("docker-content-digest"))
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let over = || RegistryError::NotAPlugin {
                reference: r.to_string(),
                why: format!(
                    "its {} is over the {MAX_MANIFEST_BYTES}-byte cap (stopped reading there)",
                    path.split('/')
                        .next()
                        .unwrap_or("manifest")
                        .trim_end_matches('s')
                ),
            };
            if res
                .content_length()
                .is_some_and(|n| n > MAX_MANIFEST_BYTES as u64)
            {
                return Err(over());
            }
            let mut body = Vec::new();
            while let Some(chunk) = res.chunk().await.map_err(unreachable)? {
                if body.len() + chunk.len() > MAX_MANIFEST_BYTES {
                    return Err(over());
                }
                body.extend_from_slice(&chunk);
            }
            Ok((body, digest))
        })
    }

    /// The manifest at `r`, read against its cap as it arrives, verified
    /// against its digest and checked to be a plugin (the CNCF Wasm layout:
    /// one `application/wasm` layer).
    pub fn manifest(&self, r: &Reference) -> Result<Manifest, RegistryError> {
        let raw = self.manifest_bytes(r)?;
        let not_plugin = |why: String| RegistryError::NotAPlugin {
            reference: r.to_string(),
            why,
        };
        let found = super::digest_of(&raw);
        let m: OciImageManifest = serde_json::from_slice(&raw)
            .map_err(|e| not_plugin(format!("its manifest is not an OCI image manifest ({e})")))?;
        if m.config.media_type != CONFIG_MEDIA_TYPE {
            return Err(not_plugin(format!(
                "its config is `{}`, not `{CONFIG_MEDIA_TYPE}`",
                m.config.media_type
            )));
        }
        let wasm: Vec<&OciDescriptor> = m
            .layers
            .iter()
            .filter(|l| l.media_type == LAYER_MEDIA_TYPE)
            .collect();
        if wasm.len() != 1 || m.layers.len() != 1 {
            return Err(not_plugin(format!(
                "it has {} layers ({} of `{LAYER_MEDIA_TYPE}`); a plugin has exactly one",
                m.layers.len(),
                wasm.len()
            )));
        }
        let size = u64::try_from(wasm[0].size).unwrap_or(u64::MAX);
        if size > MAX_COMPONENT_BYTES {
            return Err(not_plugin(format!(
                "its component is {size} bytes, over the {MAX_COMPONENT_BYTES}-byte cap"
            )));
        }
        Ok(Manifest {
            digest: found,
            layer_digest: wasm[0].digest.clone(),
            layer_size: size,
            raw: raw.to_vec(),
        })
    }

    /// A blob of `r`'s repository, verified against `digest`, streamed
    /// against the `size` its descriptor gives: the download stops at the
    /// first byte past it, before the digest could be checked.
    pub fn blob(&self, r: &Reference, digest: &str, size: u64) -> Result<Vec<u8>, RegistryError> {
        let oref = oci_ref(r);
        let desc = OciDescriptor {
            media_type: LAYER_MEDIA_TYPE.into(),
            digest: digest.into(),
            size: i64::try_from(size).unwrap_or(i64::MAX),
            ..Default::default()
        };
        let mut sink = Capped {
            buf: Vec::with_capacity(size.min(64 << 20) as usize),
            limit: size,
            over: false,
        };
        let pulled = self
            .rt
            .block_on(self.client.pull_blob(&oref, &desc, &mut sink));
        if sink.over {
            return Err(RegistryError::Oversized {
                reference: r.to_string(),
                digest: digest.into(),
                size,
            });
        }
        pulled.map_err(|e| self.error(r, e))?;
        let out = sink.buf;
        let found = super::digest_of(&out);
        if found != digest {
            return Err(RegistryError::TamperedDownload {
                reference: r.to_string(),
                expected: digest.into(),
                found,
            });
        }
        Ok(out)
    }

    /// Push a component as the CNCF Wasm layout; returns the manifest digest.
    pub fn publish(
        &self,
        r: &Reference,
        component: &[u8],
        plugin: &Plugin,
        imports: &[String],
        exports: &[String],
    ) -> Result<String, RegistryError> {
        let layer_digest = super::digest_of(component);
        let created = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let config = serde_json::json!({
            "created": created,
            "architecture": "wasm",
            "os": "wasip2",
            "layerDigests": [layer_digest],
            "component": {
                "exports": exports,
                "imports": imports,
                "target": "piper:strategy/strategy",
            },
        });
        let mut annotations = BTreeMap::new();
        annotations.insert("org.opencontainers.image.created".into(), created);
        annotations.insert(
            "org.opencontainers.image.title".into(),
            plugin.info.name.clone(),
        );
        annotations.insert(
            "org.opencontainers.image.version".into(),
            plugin.info.version.clone(),
        );
        annotations.insert(
            "org.opencontainers.image.description".into(),
            plugin.info.description.clone(),
        );
        annotations.insert(
            "dev.piper.wit".into(),
            format!("piper:strategy@{}", plugin.wit_version),
        );
        let layers = vec![ImageLayer::new(
            component.to_vec(),
            LAYER_MEDIA_TYPE.into(),
            None,
        )];
        let config = Config::new(
            serde_json::to_vec(&config).expect("json"),
            CONFIG_MEDIA_TYPE.into(),
            None,
        );
        let mut manifest = OciImageManifest::build(&layers, &config, Some(annotations));
        manifest.media_type = Some(MANIFEST_MEDIA_TYPE.into());
        manifest.artifact_type = Some(CONFIG_MEDIA_TYPE.into());
        self.push(r, &layers, config, manifest)
    }

    /// Authenticate for a push, push, and return the manifest's digest.
    fn push(
        &self,
        r: &Reference,
        layers: &[ImageLayer],
        config: Config,
        manifest: OciImageManifest,
    ) -> Result<String, RegistryError> {
        let oref = oci_ref(r);
        self.rt
            .block_on(async {
                self.client
                    .auth(&oref, &self.auth, RegistryOperation::Push)
                    .await?;
                self.client
                    .push(&oref, layers, config, &self.auth, Some(manifest))
                    .await
            })
            .map_err(|e| self.error(r, e))?;
        self.resolve(r)
    }

    /// Push an artifact manifest with one layer (a signature) referring to
    /// `subject` (a manifest digest of the same repository), under `tag`.
    pub fn push_referrer(
        &self,
        r: &Reference,
        subject: &str,
        subject_size: u64,
        artifact_type: &str,
        body: &[u8],
        tag: &str,
    ) -> Result<String, RegistryError> {
        let layers = vec![ImageLayer::new(body.to_vec(), artifact_type.into(), None)];
        let config = Config::new(
            b"{}".to_vec(),
            "application/vnd.oci.empty.v1+json".into(),
            None,
        );
        let mut manifest = OciImageManifest::build(&layers, &config, None);
        manifest.media_type = Some(MANIFEST_MEDIA_TYPE.into());
        manifest.artifact_type = Some(artifact_type.into());
        manifest.subject = Some(OciDescriptor {
            media_type: MANIFEST_MEDIA_TYPE.into(),
            digest: subject.into(),
            size: i64::try_from(subject_size).unwrap_or(i64::MAX),
            ..Default::default()
        });
        self.push(&r.at_tag(tag), &layers, config, manifest)
    }

    /// The bodies of the artifacts of `artifact_type` referring to `subject`:
    /// through the referrers API where the registry has one, else the
    /// `sha256-<hex>.sig` tag.
    pub fn referrers(
        &self,
        r: &Reference,
        subject: &str,
        artifact_type: &str,
        fallback_tag: &str,
    ) -> Result<Vec<Vec<u8>>, RegistryError> {
        let index = self
            .capped_get(
                r,
                &format!(
                    "referrers/{subject}?artifactType={}",
                    query_value(artifact_type)
                ),
                OCI_INDEX_MEDIA_TYPE,
            )
            .ok()
            .and_then(|(raw, _)| serde_json::from_slice::<OciImageIndex>(&raw).ok());
        let mut manifests: Vec<Reference> = index
            .map(|i| {
                i.manifests
                    .iter()
                    .filter(|m| m.artifact_type.as_deref() == Some(artifact_type))
                    .map(|m| r.at_digest(&m.digest))
                    .collect()
            })
            .unwrap_or_default();
        if manifests.is_empty() {
            manifests.push(r.at_tag(fallback_tag));
        }
        // A bounded look: a registry listing thousands of referrers gets
        // the first few read.
        manifests.truncate(MAX_REFERRERS);
        let mut bodies = Vec::new();
        for m in manifests {
            let raw = match self.manifest_bytes(&m) {
                Ok(raw) => raw,
                Err(RegistryError::NotFound { .. } | RegistryError::NotAPlugin { .. }) => continue,
                Err(other) => return Err(other),
            };
            let Ok(man) = serde_json::from_slice::<OciImageManifest>(&raw) else {
                continue;
            };
            if man.subject.as_ref().map(|s| s.digest.as_str()) != Some(subject) {
                continue;
            }
            for l in man.layers.iter().filter(|l| l.media_type == artifact_type) {
                let size = u64::try_from(l.size).unwrap_or(u64::MAX);
                if size > MAX_REFERRER_BYTES {
                    continue;
                }
                bodies.push(self.blob(&m, &l.digest, size)?);
            }
        }
        Ok(bodies)
    }
}

impl Remote {
    /// A manifest's bytes, capped while they arrive, checked against the
    /// digest `m` names or the registry gives.
    fn manifest_bytes(&self, m: &Reference) -> Result<Vec<u8>, RegistryError> {
        // What the client asks for: the digest, else the tag (`latest`).
        let oref = oci_ref(m);
        let name = oref.digest().or(oref.tag()).unwrap_or("latest");
        let (raw, digest) =
            self.capped_get(m, &format!("manifests/{name}"), MANIFEST_MEDIA_TYPE)?;
        let found = super::digest_of(&raw);
        match m.digest.clone().or(digest) {
            Some(want) if want != found => Err(RegistryError::TamperedDownload {
                reference: m.to_string(),
                expected: want,
                found,
            }),
            _ => Ok(raw),
        }
    }
}

/// A query value with the characters a media type holds that a query
/// would read otherwise (`+` as a space, `/`, `&`, `=`) percent-encoded.
fn query_value(v: &str) -> String {
    v.chars()
        .map(|c| match c {
            'A'..='Z' | 'a'..='z' | '0'..='9' | '-' | '.' | '_' | '~' => c.to_string(),
            other => {
                let mut b = [0u8; 4];
                (other.encode_utf8(&mut b).bytes())
                    .map(|x| format!("%{x:02X}"))
                    .collect()
            }
        })
        .collect()
}

/// The media type of a referrers index.
const OCI_INDEX_MEDIA_TYPE: &str = "application/vnd.oci.image.index.v1+json";

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
