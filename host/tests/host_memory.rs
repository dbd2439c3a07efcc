//! The host's own memory under plugins that make it hold memory in bulk,
//! measured in real `piper plan` processes. A binary of its own: a child's
//! peak resident set (`wait4`'s rusage) counts its parent's resident set at
//! the spawn (exec records the address space it leaves), so the parent must
//! stay small — as a test binary running only these tests does, and the one
//! running every other end-to-end test does not.

fn wasm(stem: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("PIPER_PLUGINS_WASM_DIR")).join(format!("{stem}.wasm"))
}

/// Run `piper` with `args` and `PIPER_HOME` at `home`; its success, stderr
/// and peak resident memory (bytes, from `wait4`'s rusage).
fn piper_peak(home: &std::path::Path, args: &[&str]) -> (bool, String, u64) {
    // Reaped by `wait4` below, which also gives its resource usage.
    #[allow(clippy::zombie_processes)]
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_piper"))
        .args(args)
        .env("PIPER_HOME", home)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut stderr = child.stderr.unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut stderr, &mut s).unwrap();
        s
    });
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value; wait4 fills it in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our own child, not yet waited for.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4 failed");
    let ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    (ok, reader.join().unwrap(), usage.ru_maxrss as u64 * 1024)
}

/// Legal calls that make the host hold memory in bulk are refused under
/// `sandbox.max_host_bytes`, each with its message, and the `piper plan`
/// process stays under 1.5x the budget. Plans of every bundled strategy
/// are unchanged by the budget (the other plan tests).
#[test]
fn plugins_that_make_the_host_hold_memory_in_bulk_are_refused_under_the_byte_budget() {
    let home = std::env::temp_dir().join(format!("piper-host-bytes-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let cap: u64 = 256 << 20;
    let cfg = home.join("run.toml");
    std::fs::write(
        &cfg,
        format!("[sandbox]\nmax_host_bytes = {cap}\nmemory_mib = 64\n"),
    )
    .unwrap();
    let hostile = wasm("piper_testing_hostile");
    let budget = "over the host budget `sandbox.max_host_bytes` = 268435456";
    for (mode, expect) in [
        ("filter-flood", budget),
        ("split-chain", budget),
        ("tag-flood", budget),
        (
            "alias-args",
            "one call's arguments would copy more than 32.00 MiB into the host",
        ),
        // What a plugin keeps is its own memory, under its own cap.
        (
            "query-hoard",
            "exceeded its memory cap of 64 MiB (sandbox.memory_mib)",
        ),
    ] {
        let spec = format!("{}:mode={mode}", hostile.display());
        let (ok, err, peak) = piper_peak(
            &home,
            &[
                "plan",
                "--config",
                cfg.to_str().unwrap(),
                "--devices",
                "1",
                "--strategy",
                &spec,
            ],
        );
        assert!(!ok, "mode {mode} planned");
        assert!(
            err.contains(expect) && err.contains("plugin `hostile@0.1.0` (sha256 "),
            "mode {mode}: `{err}` should contain `{expect}`"
        );
        assert!(
            peak < cap * 3 / 2,
            "mode {mode}: `piper plan` peaked at {} MiB resident, the budget is {} MiB",
            peak >> 20,
            cap >> 20
        );
        eprintln!("mode {mode}: refused, peak resident {} MiB", peak >> 20);
    }
    let _ = std::fs::remove_dir_all(&home);
}
