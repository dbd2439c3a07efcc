//! The plugin registry against a real OCI registry: Debian's `docker-registry`
//! (CNCF distribution) started on 127.0.0.1 with a temporary storage folder
//! and a free port, stopped afterwards. Everything runs through the `piper`
//! binary, each case with its own `PIPER_HOME` (compile cache and store).
//!
//! Without `docker-registry` on PATH the tests are reported as not run
//! (`piper::test_support::not_run`; `scripts/test.sh` lists them, CI fails).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("piper-reg-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn have_registry() -> bool {
    let ok = Command::new("docker-registry")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        piper::test_support::not_run(
            "registry",
            "the registry tests need Debian's docker-registry (apt-get install docker-registry apache2-utils); .ci/run installs it",
        );
    }
    ok
}

/// A running `docker-registry serve`, killed on drop.
struct Registry {
    child: Child,
    port: u16,
    storage: PathBuf,
    log: PathBuf,
}

impl Registry {
    /// Start one; `htpasswd`: a file of bcrypt users for basic auth.
    fn start(dir: &Path, htpasswd: Option<&Path>) -> Registry {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let storage = dir.join("storage");
        std::fs::create_dir_all(&storage).unwrap();
        let auth = htpasswd
            .map(|p| {
                format!(
                    "auth:\n  htpasswd:\n    realm: piper-test\n    path: {}\n",
                    p.display()
                )
            })
            .unwrap_or_default();
        let cfg = dir.join("config.yml");
        std::fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n{auth}",
                storage.display()
            ),
        )
        .unwrap();
        let log = dir.join("registry.log");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::from(
                std::fs::File::create(dir.join("registry.out")).unwrap(),
            ))
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        let r = Registry {
            child,
            port,
            storage,
            log,
        };
        let t = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the registry did not start: {}",
                std::fs::read_to_string(&r.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    fn reference(&self, repo_tag: &str) -> String {
        format!("oci://127.0.0.1:{}/{repo_tag}", self.port)
    }

    /// The blob file the registry keeps for a digest.
    fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.trim_start_matches("sha256:");
        self.storage
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// How many times the registry answered a GET of this blob.
    fn blob_gets(&self, digest: &str) -> usize {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        log.lines()
            .filter(|l| {
                l.contains("response completed")
                    && l.contains("http.request.method=GET")
                    && l.contains(&format!("/blobs/{digest}"))
            })
            .count()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `piper` with its own home.
fn piper(home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_piper"));
    c.env("PIPER_HOME", home)
        .env("DOCKER_CONFIG", home.join("docker"))
        .env_remove("PIPER_REGISTRY_USERNAME")
        .env_remove("PIPER_REGISTRY_PASSWORD")
        .env_remove("PIPER_REGISTRY_TOKEN");
    c
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(o.status.success(), "{c:?} failed:\n{}", text(&o));
    text(&o)
}

fn fails(c: &mut Command) -> String {
    let o = c.output().unwrap();
    assert!(!o.status.success(), "{c:?} succeeded:\n{}", text(&o));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A bundled plugin written out as a component file.
fn component(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(format!("{name}.wasm"));
    std::fs::write(&p, piper::plugin::bundled::get(name).unwrap()).unwrap();
    p
}

fn digest(bytes: &[u8]) -> String {
    piper::registry::digest_of(bytes)
}

/// The plan hash `piper plan --json` prints for these arguments.
fn plan_hash(home: &Path, args: &[&str]) -> String {
    let out = ok(piper(home)
        .args(["plan", "--json", "--model", "tiny", "--devices", "4"])
        .args(args));
    let start = out.find('{').unwrap();
    let end = out.rfind('}').unwrap();
    let v: serde_json::Value = serde_json::from_str(&out[start..=end]).unwrap();
    v["hash"].as_str().unwrap().to_string()
}

/// GET over plain HTTP/1.1 with the OCI distribution API; (status, headers, body).
fn http_get(port: u16, path: &str, accept: &str) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, head, raw[split + 4..].to_vec())
}

#[test]
fn publish_pull_inspect_list_remove_round_trip_and_plain_oci_clients_read_it() {
    if !have_registry() {
        return;
    }
    let dir = scratch("roundtrip");
    let reg = Registry::start(&dir, None);
    let (alice, bob) = (dir.join("alice"), dir.join("bob"));
    let file = component(&dir, "1f1b");
    let bytes = std::fs::read(&file).unwrap();
    let r = reg.reference("team/one-f-one-b:1.0.0");
    let out = ok(piper(&alice)
        .args(["plugin", "publish"])
        .arg(&file)
        .arg(&r)
        .arg("--insecure"));
    assert!(out.contains("published"), "{out}");
    // Tags are semver.
    let e = fails(
        piper(&alice)
            .args(["plugin", "publish"])
            .arg(&file)
            .arg(reg.reference("team/x:latest"))
            .arg("--insecure"),
    );
    assert!(e.contains("tags are semantic versions"), "{e}");
    // --insecure is for loopback only.
    let e = fails(piper(&alice).args([
        "plugin",
        "pull",
        "oci://registry.example.com/team/x:1.0.0",
        "--insecure",
    ]));
    assert!(
        e.contains("--insecure (plain HTTP) is only for registries on this machine"),
        "{e}"
    );

    // A colleague pulls it: the same bytes land in their store.
    let out = ok(piper(&bob)
        .args(["plugin", "pull"])
        .arg(&r)
        .arg("--insecure"));
    assert!(out.contains("1f1b 0.1.0"), "{out}");
    let stored = bob
        .join("store/blobs/sha256")
        .join(digest(&bytes).trim_start_matches("sha256:"));
    assert_eq!(
        std::fs::read(&stored).unwrap(),
        bytes,
        "pulled bytes equal the published ones"
    );
    let list = ok(piper(&bob).args(["plugin", "list"]));
    assert!(list.contains(&r), "{list}");
    let inspect = ok(piper(&bob)
        .args(["plugin", "inspect", "--json"])
        .arg(&r)
        .arg("--insecure"));
    let v: serde_json::Value = serde_json::from_str(&inspect).unwrap();
    assert_eq!(v["component"], digest(&bytes));
    assert_eq!(v["wit"], "piper:strategy@0.4.0");
    assert_eq!(v["info"]["name"], "1f1b");
    let manifest_digest = v["digest"].as_str().unwrap().to_string();

    // Any OCI client reads it: manifest and blob over the distribution API, CNCF media types.
    let (status, head, body) = http_get(
        reg.port,
        "/v2/team/one-f-one-b/manifests/1.0.0",
        "application/vnd.oci.image.manifest.v1+json",
    );
    assert_eq!(status, 200, "{head}");
    assert_eq!(digest(&body), manifest_digest);
    let m: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(m["mediaType"], "application/vnd.oci.image.manifest.v1+json");
    assert_eq!(
        m["config"]["mediaType"],
        "application/vnd.wasm.config.v0+json"
    );
    assert_eq!(m["layers"][0]["mediaType"], "application/wasm");
    assert_eq!(m["layers"][0]["digest"], digest(&bytes));
    let (_, _, config) = http_get(
        reg.port,
        &format!(
            "/v2/team/one-f-one-b/blobs/{}",
            m["config"]["digest"].as_str().unwrap()
        ),
        "*/*",
    );
    let config: serde_json::Value = serde_json::from_slice(&config).unwrap();
    assert_eq!(config["architecture"], "wasm");
    let exports: Vec<&str> = config["component"]["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(exports, ["info", "apply"]);
    assert!(config["component"]["imports"]
        .to_string()
        .contains("piper:strategy/dag@0.4.0"));
    let (status, _, blob) = http_get(
        reg.port,
        &format!("/v2/team/one-f-one-b/blobs/{}", digest(&bytes)),
        "*/*",
    );
    assert_eq!(status, 200);
    assert_eq!(blob, bytes);

    // Run by reference (tag and digest): the bundled plugin's plan.
    let want = plan_hash(&bob, &["--strategy", "1f1b:microbatches=8"]);
    assert_eq!(
        plan_hash(
            &bob,
            &["--insecure", "--strategy", &format!("{r}:microbatches=8")]
        ),
        want
    );
    let by_digest = format!("{}@{manifest_digest}", reg.reference("team/one-f-one-b"));
    assert_eq!(
        plan_hash(
            &bob,
            &[
                "--offline",
                "--strategy",
                &format!("{by_digest}:microbatches=8")
            ]
        ),
        want
    );

    // Remove its last tag: the tag, the record and the component go (as
    // `docker rmi` does); then the digest is no longer there either.
    let out = ok(piper(&bob).args(["plugin", "remove"]).arg(&r));
    assert!(out.contains(&format!("removed {r}")), "{out}");
    assert!(
        out.contains(&format!("removed {}", digest(&bytes))),
        "{out}"
    );
    assert!(!stored.exists(), "the component left the store");
    let e = fails(piper(&bob).args(["plugin", "remove"]).arg(&by_digest));
    assert!(e.contains("is not in the local store"), "{e}");
    let e = fails(
        piper(&bob)
            .args(["plan", "--offline", "--strategy"])
            .arg(&r),
    );
    assert!(
        e.contains("not in the local store, and --offline forbids the network"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tampering_in_the_registry_the_store_or_a_moved_tag_is_refused_and_nothing_runs() {
    if !have_registry() {
        return;
    }
    let dir = scratch("tamper");
    let reg = Registry::start(&dir, None);
    let home = dir.join("home");
    let (one, gpipe) = (component(&dir, "1f1b"), component(&dir, "gpipe"));
    let r = reg.reference("team/pipe:1.0.0");
    ok(piper(&home)
        .args(["plugin", "publish"])
        .arg(&one)
        .arg(&r)
        .arg("--insecure"));

    // A lockfile pins the tag; the tag then moves to another plugin.
    let cfg = dir.join("run.toml");
    std::fs::write(
        &cfg,
        format!("model = \"tiny\"\ndevices = 4\n[[strategy]]\nname = \"{r}\"\noptions = {{ microbatches = 8 }}\n"),
    )
    .unwrap();
    let out = ok(piper(&home).args(["lock"]).arg(&cfg).arg("--insecure"));
    assert!(out.contains("wrote"), "{out}");
    let lock = std::fs::read_to_string(dir.join("piper.lock")).unwrap();
    ok(piper(&home)
        .args(["plan", "--insecure", "--config"])
        .arg(&cfg));
    let pinned = lock
        .lines()
        .find(|l| l.starts_with("digest"))
        .unwrap()
        .split('"')
        .nth(1)
        .unwrap()
        .to_string();
    ok(piper(&home)
        .args(["plugin", "publish"])
        .arg(&gpipe)
        .arg(&r)
        .arg("--insecure"));
    let e = fails(
        piper(&home)
            .args(["plan", "--insecure", "--config"])
            .arg(&cfg),
    );
    assert!(e.contains("the tag now points to sha256:"), "{e}");
    assert!(e.contains(&format!("pins {pinned}")), "{e}");
    // Offline, the lockfile's digest runs from the store.
    ok(piper(&home)
        .args(["plan", "--offline", "--config"])
        .arg(&cfg));

    // A blob altered in the registry's storage: a fresh store refuses it.
    let r2 = reg.reference("team/altered:1.0.0");
    let bytes = std::fs::read(&one).unwrap();
    let interleaved = component(&dir, "interleaved-1f1b");
    ok(piper(&home)
        .args(["plugin", "publish"])
        .arg(&interleaved)
        .arg(&r2)
        .arg("--insecure"));
    let ibytes = std::fs::read(&interleaved).unwrap();
    let blob = reg.blob_file(&digest(&ibytes));
    let mut evil = ibytes.clone();
    let n = evil.len();
    evil[n - 1] ^= 0xff;
    std::fs::write(&blob, &evil).unwrap();
    let fresh = dir.join("fresh");
    let e = fails(
        piper(&fresh)
            .args(["plan", "--insecure", "--strategy"])
            .arg(&r2),
    );
    assert!(e.contains(&digest(&ibytes)), "{e}");
    assert!(e.contains(&digest(&evil)), "{e}");
    assert!(e.contains("refusing"), "{e}");
    assert!(!fresh
        .join("store/blobs/sha256")
        .join(digest(&evil).trim_start_matches("sha256:"))
        .exists());

    // A store file altered on disk: refused with both digests, never run.
    let stored = home
        .join("store/blobs/sha256")
        .join(digest(&bytes).trim_start_matches("sha256:"));
    let mut altered = bytes.clone();
    altered[100] ^= 0x01;
    std::fs::write(&stored, &altered).unwrap();
    let e = fails(
        piper(&home)
            .args(["plan", "--offline", "--config"])
            .arg(&cfg),
    );
    assert!(e.contains("was altered"), "{e}");
    assert!(
        e.contains(digest(&bytes).trim_start_matches("sha256:")),
        "{e}"
    );
    assert!(
        e.contains(digest(&altered).trim_start_matches("sha256:")),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn signatures_from_trusted_keys_are_required_when_the_run_config_says_so() {
    if !have_registry() {
        return;
    }
    let dir = scratch("sign");
    let reg = Registry::start(&dir, None);
    let home = dir.join("home");
    let file = component(&dir, "1f1b");
    let (signed, unsigned) = (
        reg.reference("team/signed:1.0.0"),
        reg.reference("team/unsigned:1.0.0"),
    );
    ok(piper(&home)
        .args(["plugin", "publish"])
        .arg(&file)
        .arg(&signed)
        .arg("--insecure"));
    ok(piper(&home)
        .args(["plugin", "publish"])
        .arg(&file)
        .arg(&unsigned)
        .arg("--insecure"));
    let (alice_key, mallory_key) = (dir.join("alice.key"), dir.join("mallory.key"));
    let alice = ok(piper(&home).args(["plugin", "keygen"]).arg(&alice_key));
    let alice_pub = std::fs::read_to_string(dir.join("alice.pub"))
        .unwrap()
        .trim()
        .to_string();
    assert!(alice.contains(&alice_pub));
    ok(piper(&home).args(["plugin", "keygen"]).arg(&mallory_key));
    let mallory_pub = std::fs::read_to_string(dir.join("mallory.pub"))
        .unwrap()
        .trim()
        .to_string();
    let e = fails(piper(&home).args(["plugin", "keygen"]).arg(&alice_key));
    assert!(e.contains("refusing to overwrite a key"), "{e}");

    // Signed by mallory only; the run trusts alice.
    ok(piper(&home)
        .args(["plugin", "sign"])
        .arg(&signed)
        .arg("--key")
        .arg(&mallory_key)
        .arg("--insecure"));
    let cfg = |name: &str, key: &str| {
        let p = dir.join(format!("{}.toml", key.len() + name.len()));
        std::fs::write(
            &p,
            format!("model = \"tiny\"\n[[strategy]]\nname = \"{name}\"\n[registry]\ntrusted_keys = [\"{key}\"]\n"),
        )
        .unwrap();
        p
    };
    let e = fails(
        piper(&home)
            .args(["plan", "--insecure", "--config"])
            .arg(cfg(&signed, &alice_pub)),
    );
    assert!(
        e.contains("signed only by keys this run does not trust"),
        "{e}"
    );
    assert!(e.contains(&mallory_pub), "{e}");
    let e = fails(
        piper(&home)
            .args(["plan", "--insecure", "--config"])
            .arg(cfg(&unsigned, &alice_pub)),
    );
    assert!(e.contains("is unsigned"), "{e}");
    // Alice signs it: it runs, and again offline from the signatures kept in the store.
    ok(piper(&home)
        .args(["plugin", "sign"])
        .arg(&signed)
        .arg("--key")
        .arg(&alice_key)
        .arg("--insecure"));
    ok(piper(&home)
        .args(["plan", "--insecure", "--config"])
        .arg(cfg(&signed, &alice_pub)));
    ok(piper(&home)
        .args(["plan", "--offline", "--config"])
        .arg(cfg(&signed, &alice_pub)));
    let e = fails(
        piper(&home)
            .args(["plan", "--config"])
            .arg(cfg(&signed, "ed25519:bm90IGEga2V5")),
    );
    assert!(e.contains("public key `ed25519:bm90IGEga2V5`"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unreachable_registry_is_named_and_offline_runs_from_the_store() {
    if !have_registry() {
        return;
    }
    let dir = scratch("down");
    let home = dir.join("home");
    let file = component(&dir, "1f1b");
    let r = {
        let reg = Registry::start(&dir, None);
        let r = reg.reference("team/p:1.0.0");
        ok(piper(&home)
            .args(["plugin", "publish"])
            .arg(&file)
            .arg(&r)
            .arg("--insecure"));
        r
    }; // stopped here
    let e = fails(
        piper(&home)
            .args(["plan", "--insecure", "--strategy"])
            .arg(&r),
    );
    assert!(e.contains("cannot reach the registry 127.0.0.1:"), "{e}");
    assert!(e.contains("--offline"), "{e}");
    ok(piper(&home)
        .args(["plan", "--offline", "--strategy"])
        .arg(&r));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_processes_pulling_one_reference_share_one_download_and_one_copy() {
    if !have_registry() {
        return;
    }
    let dir = scratch("concurrent");
    let reg = Registry::start(&dir, None);
    let file = component(&dir, "zb-h1");
    let bytes = std::fs::read(&file).unwrap();
    let r = reg.reference("team/zb:1.0.0");
    ok(piper(&dir.join("publisher"))
        .args(["plugin", "publish"])
        .arg(&file)
        .arg(&r)
        .arg("--insecure"));
    let shared = dir.join("shared");
    let runs: Vec<Child> = (0..2)
        .map(|_| {
            piper(&shared)
                .args([
                    "plan",
                    "--insecure",
                    "--model",
                    "tiny",
                    "--devices",
                    "4",
                    "--strategy",
                ])
                .arg(format!("{r}:microbatches=4"))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in runs {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    let blobs: Vec<_> = std::fs::read_dir(shared.join("store/blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(blobs.len(), 1, "one copy in the store: {blobs:?}");
    assert_eq!(reg.blob_gets(&digest(&bytes)), 1, "downloaded once");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn basic_auth_refuses_anonymous_pushes_with_how_to_log_in_and_takes_credentials() {
    if !have_registry() {
        return;
    }
    let dir = scratch("auth");
    let hash = Command::new("htpasswd")
        .args(["-Bbn", "ci", "s3cret"])
        .output()
        .unwrap();
    assert!(hash.status.success(), "htpasswd (apache2-utils) is needed");
    let htpasswd = dir.join("htpasswd");
    std::fs::write(&htpasswd, &hash.stdout).unwrap();
    let reg = Registry::start(&dir, Some(&htpasswd));
    let home = dir.join("home");
    let file = component(&dir, "1f1b");
    let r = reg.reference("team/private:1.0.0");
    let e = fails(
        piper(&home)
            .args(["plugin", "publish"])
            .arg(&file)
            .arg(&r)
            .arg("--insecure"),
    );
    assert!(
        e.contains(&format!("docker login 127.0.0.1:{}", reg.port)),
        "{e}"
    );
    assert!(e.contains("PIPER_REGISTRY_USERNAME"), "{e}");
    let e = fails(
        piper(&home)
            .args(["plugin", "publish"])
            .arg(&file)
            .arg(&r)
            .arg("--insecure")
            .env("PIPER_REGISTRY_USERNAME", "ci")
            .env("PIPER_REGISTRY_PASSWORD", "wrong"),
    );
    assert!(e.contains("refused the credentials"), "{e}");
    ok(piper(&home)
        .args(["plugin", "publish"])
        .arg(&file)
        .arg(&r)
        .arg("--insecure")
        .env("PIPER_REGISTRY_USERNAME", "ci")
        .env("PIPER_REGISTRY_PASSWORD", "s3cret"));
    // A colleague logged in with docker: config.json's auth is used for pulls.
    let colleague = dir.join("colleague");
    std::fs::create_dir_all(colleague.join("docker")).unwrap();
    use base64::Engine;
    let auth = base64::engine::general_purpose::STANDARD.encode("ci:s3cret");
    std::fs::write(
        colleague.join("docker/config.json"),
        format!(
            "{{\"auths\": {{\"127.0.0.1:{}\": {{\"auth\": \"{auth}\"}}}}}}",
            reg.port
        ),
    )
    .unwrap();
    ok(piper(&colleague)
        .args(["plugin", "pull"])
        .arg(&r)
        .arg("--insecure"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a pull trusts, in order: the bytes stop at the size their manifest
/// gives; a torn or altered store blob is fetched again online (offline it
/// is named); an untrusted component is refused before it is compiled, its
/// `info()` run or a local tag moved.
#[test]
fn pulls_are_bounded_by_their_descriptor_and_trusted_before_anything_runs() {
    if !have_registry() {
        return;
    }
    let dir = scratch("bounded");
    let reg = Registry::start(&dir, None);
    let home = dir.join("home");
    let file = component(&dir, "1f1b");
    let bytes = std::fs::read(&file).unwrap();
    let r = reg.reference("team/big:1.0.0");
    ok(piper(&home)
        .args(["plugin", "publish"])
        .arg(&file)
        .arg(&r)
        .arg("--insecure"));

    // The registry's copy grows by 64 MiB: the download stops at the first
    // byte past the manifest's size, before any digest could be checked.
    let blob = reg.blob_file(&digest(&bytes));
    let mut grown = bytes.clone();
    grown.resize(bytes.len() + (64 << 20), 7);
    std::fs::write(&blob, &grown).unwrap();
    let fresh = dir.join("fresh");
    let e = fails(
        piper(&fresh)
            .args(["plan", "--insecure", "--strategy"])
            .arg(&r),
    );
    assert!(
        e.contains(&format!(
            "more than the {} bytes its manifest gives",
            bytes.len()
        )),
        "{e}"
    );
    std::fs::write(&blob, &bytes).unwrap();

    // A store blob torn on disk: online it is fetched again and runs;
    // offline it is refused naming both digests.
    ok(piper(&home)
        .args(["plan", "--insecure", "--strategy"])
        .arg(&r));
    let stored = home
        .join("store/blobs/sha256")
        .join(digest(&bytes).trim_start_matches("sha256:"));
    std::fs::write(&stored, &bytes[..bytes.len() / 2]).unwrap();
    let e = fails(
        piper(&home)
            .args(["plan", "--offline", "--strategy"])
            .arg(&r),
    );
    assert!(e.contains("was altered"), "{e}");
    ok(piper(&home)
        .args(["plan", "--insecure", "--strategy"])
        .arg(&r));
    assert_eq!(std::fs::read(&stored).unwrap(), bytes);

    // Unsigned under a run that requires a signature: refused, and the
    // store holds no record or tag of it (it was never loaded).
    let key = dir.join("k.key");
    ok(piper(&home).args(["plugin", "keygen"]).arg(&key));
    let public = std::fs::read_to_string(dir.join("k.pub")).unwrap();
    let u = reg.reference("team/unsigned:2.0.0");
    ok(piper(&home)
        .args(["plugin", "publish"])
        .arg(component(&dir, "gpipe"))
        .arg(&u)
        .arg("--insecure"));
    let cfg = dir.join("trust.toml");
    std::fs::write(
        &cfg,
        format!(
            "model = \"tiny\"\n[[strategy]]\nname = \"{u}\"\n[registry]\ntrusted_keys = [\"{}\"]\n",
            public.trim()
        ),
    )
    .unwrap();
    let clean = dir.join("clean");
    let e = fails(
        piper(&clean)
            .args(["plan", "--insecure", "--config"])
            .arg(&cfg),
    );
    assert!(e.contains("is unsigned"), "{e}");
    let held = |sub: &str| {
        std::fs::read_dir(clean.join("store").join(sub))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    assert_eq!(
        held("manifests/sha256"),
        0,
        "a record of an untrusted plugin"
    );
    assert_eq!(held("tags"), 0, "a tag moved to an untrusted plugin");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A registry that answers a manifest with endless bytes (a hostile or
/// broken server): the pull reads 1 MiB of it and stops, naming the cap.
#[test]
fn a_manifest_is_read_against_its_cap_as_it_arrives() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let count = count.clone();
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let line = String::from_utf8_lossy(&head).into_owned();
                let digest = format!("sha256:{}", "a".repeat(64));
                let kind = "application/vnd.oci.image.manifest.v1+json";
                if line.starts_with("HEAD") || line.starts_with("GET /v2/ ") {
                    let _ = write!(
                        s,
                        "HTTP/1.1 200 OK\r\nDocker-Content-Digest: {digest}\r\nContent-Type: {kind}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    );
                    return;
                }
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nDocker-Content-Digest: {digest}\r\nContent-Type: {kind}\r\nConnection: close\r\n\r\n{{"
                );
                let chunk = vec![b' '; 64 << 10];
                // Up to 1 GiB: a reader without a cap holds all of it.
                for _ in 0..(1 << 14) {
                    if s.write_all(&chunk).is_err() {
                        return;
                    }
                    count.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    let dir = scratch("endless");
    let e = fails(
        piper(&dir.join("home"))
            .args(["plan", "--insecure", "--strategy"])
            .arg(format!("oci://127.0.0.1:{port}/team/endless:1.0.0")),
    );
    assert!(
        e.contains("its manifest is over the 1048576-byte cap (stopped reading there)"),
        "{e}"
    );
    // The server got no further than socket buffers past the cap.
    let sent = served.load(std::sync::atomic::Ordering::Relaxed);
    assert!(sent < 64 << 20, "the client read {sent} bytes");
    let _ = std::fs::remove_dir_all(&dir);
}
