//! Strategy plugins end to end: real components built from `plugins/` and
//! `tests/plugins/`, loaded by the wasmtime host, applied to the DAG, compiled.

use crate::common;

use piper::compile::compile;
use piper::compile::plan::OpKind;
use piper::dag::{Cluster, TrainingDag};
use piper::model::ModelConfig;
use piper::plugin::{PluginHost, SandboxLimits};
use std::path::PathBuf;

fn wasm(stem: &str) -> PathBuf {
    PathBuf::from(env!("PIPER_PLUGINS_WASM_DIR")).join(format!("{stem}.wasm"))
}

fn tiny(devices: u32) -> TrainingDag {
    TrainingDag::build(&ModelConfig::tiny(), Cluster::new(devices)).unwrap()
}

fn opts(kv: &[(&str, &str)]) -> Vec<(String, String)> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Tight limits so the hostile cases end quickly.
fn strict() -> SandboxLimits {
    SandboxLimits {
        memory_mib: 64,
        fuel: 400_000_000,
        deadline_ms: 20_000,
        max_wasm_stack_kib: 256,
        max_host_calls: 100_000,
        max_host_work: 200_000_000,
        ..SandboxLimits::default()
    }
}

/// The process's resident memory, bytes (`VmRSS` in `/proc/self/status`).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[test]
fn hostile_arguments_at_the_host_boundary_are_refused_quickly_with_a_named_limit() {
    let host = PluginHost::new(strict(), None).unwrap();
    let hostile = host.load_file(&wasm("piper_testing_hostile")).unwrap();
    let mut dag = tiny(1);
    let before = dag.clone();
    let cases = [
        ("huge-split", "over the host budget `sandbox.max_nodes`"),
        ("sleep", "tried to sleep for 3600000000000 ns"),
        ("log-flood", "over the host budget `sandbox.max_host_work`"),
        (
            "print-flood",
            "wrote more than 1048576 bytes to stdout/stderr (sandbox.max_log_bytes)",
        ),
        (
            "long-string",
            "over the host budget `sandbox.max_string_bytes` = 4096: a string of 10485760 bytes",
        ),
        (
            "long-list",
            "over the host budget `sandbox.max_list_len` = 1048576: a list of 4194304 devices",
        ),
        ("names", "over the host budget `sandbox.max_names` = 1024"),
        ("path-flood", "over the host budget `sandbox.max_host_work`"),
        (
            "wasi-resources",
            "holds more than 4096 resources (sandbox.max_table_entries)",
        ),
    ];
    for (mode, expect) in cases {
        let rss = resident_bytes();
        let t = std::time::Instant::now();
        let err = host
            .apply(&hostile, &mut dag, &opts(&[("mode", mode)]))
            .unwrap_err()
            .to_string();
        let took = t.elapsed();
        let grew = resident_bytes().saturating_sub(rss);
        assert!(
            err.contains(expect),
            "mode {mode}: `{err}` should contain `{expect}`"
        );
        assert!(err.starts_with("plugin `hostile@0.1.0` (sha256 "), "{err}");
        assert!(took.as_secs_f64() < 15.0, "mode {mode} took {took:?}");
        assert!(
            grew < 1 << 30,
            "mode {mode}: resident memory grew by {grew} bytes"
        );
        assert!(
            err.len() < 8192,
            "mode {mode}: a {} byte message",
            err.len()
        );
        assert!(dag.same_state(&before), "mode {mode} changed the DAG");
        // The next plugin runs normally.
        host.apply(&hostile, &mut dag.clone(), &opts(&[("mode", "ok")]))
            .unwrap();
    }
    // A 16 MiB error message reaches the user cut to sandbox.max_error_bytes.
    let err = host
        .apply(&hostile, &mut dag, &opts(&[("mode", "big-error")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.len() < 4096 + 200 && err.contains("bytes elided)"),
        "{} bytes",
        err.len()
    );
    // A `PASS` that names no node label (only the raw WIT string can) is
    // refused at the edge, naming the call and the labels there are.
    let err = host
        .apply(&hostile, &mut tiny(1), &opts(&[("mode", "bad-pass")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("directive `query`: PASS \"forward\" is not one of [\"F\", \"B\"")
            && !err.contains("the host accepted"),
        "{err}"
    );
    // Extreme priorities are legal: the plan compiles, highest first.
    let mut d = tiny(1);
    host.apply(&hostile, &mut d, &opts(&[("mode", "priority")]))
        .unwrap();
    compile(&d).unwrap();
}

#[test]
fn a_plugin_under_the_default_limits_is_also_stopped_quickly() {
    // The classes above under the defaults, not only the strict test limits.
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let hostile = host.load_file(&wasm("piper_testing_hostile")).unwrap();
    for (mode, expect) in [
        ("huge-split", "sandbox.max_nodes"),
        ("sleep", "tried to sleep"),
        ("long-list", "sandbox.max_list_len"),
    ] {
        let t = std::time::Instant::now();
        let err = host
            .apply(&hostile, &mut tiny(1), &opts(&[("mode", mode)]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(expect), "mode {mode}: {err}");
        assert!(t.elapsed().as_secs_f64() < 15.0, "mode {mode}");
    }
}

#[test]
fn out_of_range_sandbox_limits_are_refused_with_the_key() {
    for (limits, key) in [
        (
            SandboxLimits {
                memory_mib: 0,
                ..SandboxLimits::default()
            },
            "sandbox.memory_mib = 0",
        ),
        (
            SandboxLimits {
                max_wasm_stack_kib: u64::MAX,
                ..SandboxLimits::default()
            },
            "sandbox.max_wasm_stack_kib",
        ),
        (
            SandboxLimits {
                deadline_ms: u64::MAX,
                ..SandboxLimits::default()
            },
            "sandbox.deadline_ms",
        ),
        (
            SandboxLimits {
                max_names: 1 << 40,
                ..SandboxLimits::default()
            },
            "sandbox.max_names",
        ),
    ] {
        let err = PluginHost::new(limits, None).err().unwrap().to_string();
        assert!(
            err.contains(key) && err.contains("must be between"),
            "{err}"
        );
    }
}

fn steps(plan: &piper::compile::Plan, device: usize) -> String {
    common::steps(plan, device as u32).join(" ")
}

#[test]
fn bundled_1f1b_plugin_produces_the_textbook_orders() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let plugin = host.load("1f1b").unwrap();
    assert_eq!(plugin.info.name, "1f1b");
    assert_eq!(plugin.wit_version, "0.4.0");
    let mut dag = tiny(4);
    let report = host
        .apply(&plugin, &mut dag, &opts(&[("microbatches", "8")]))
        .unwrap();
    assert!(
        report.host_calls < 100,
        "bulk interface: {} calls",
        report.host_calls
    );
    let plan = compile(&dag).unwrap();
    assert_eq!(
        steps(&plan, 0),
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    );
    assert_eq!(
        steps(&plan, 3),
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    );
}

#[test]
fn dp_then_1f1b_on_8_devices_all_reduces_on_the_dp_stream() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let mut dag = tiny(8);
    host.apply(
        &host.load("dp").unwrap(),
        &mut dag,
        &opts(&[("degree", "2")]),
    )
    .unwrap();
    host.apply(
        &host.load("1f1b").unwrap(),
        &mut dag,
        &opts(&[("microbatches", "8")]),
    )
    .unwrap();
    let plan = compile(&dag).unwrap();
    for d in 0..8 {
        let dp: Vec<_> = plan.devices[d]
            .streams
            .iter()
            .filter(|s| s.stream == "dp")
            .flat_map(|s| s.ops.iter())
            .collect();
        assert!(
            !dp.is_empty() && dp.iter().all(|o| o.kind() == OpKind::AllReduce),
            "device {d}"
        );
    }
    assert_eq!(
        steps(&plan, 0),
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    );
    assert_eq!(steps(&plan, 4), steps(&plan, 0));
}

#[test]
fn gpipe_plugin_runs_all_forwards_first() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let mut dag = tiny(2);
    host.apply(
        &host.load("gpipe").unwrap(),
        &mut dag,
        &opts(&[("microbatches", "4")]),
    )
    .unwrap();
    let plan = compile(&dag).unwrap();
    assert_eq!(steps(&plan, 1), "F0 F1 F2 F3 B0 B1 B2 B3");
}

#[test]
fn options_are_checked_against_info() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let p = host.load("1f1b").unwrap();
    let mut dag = tiny(4);
    let err = host
        .apply(&p, &mut dag, &opts(&[("micro", "8")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`1f1b@0.1.0`") && err.contains("unknown option `micro`"),
        "{err}"
    );
    assert!(
        err.contains("microbatches (int)") && err.contains("stages (int)"),
        "{err}"
    );
    let err = host
        .apply(&p, &mut dag, &opts(&[("microbatches", "eight")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("option `microbatches` expects an int, got `eight`"),
        "{err}"
    );
    // Preconditions with numbers.
    let err = host
        .apply(&p, &mut dag, &opts(&[("stages", "16")]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("got 16 stages for 8 regions"), "{err}");
}

#[test]
fn hostile_plugins_are_stopped_with_specific_messages_and_the_host_carries_on() {
    let host = PluginHost::new(strict(), None).unwrap();
    let hostile = host.load_file(&wasm("piper_testing_hostile")).unwrap();
    assert_eq!(hostile.info.name, "hostile");
    let mut dag = tiny(1);
    let before = dag.clone();
    let cases = [
        (
            "loop",
            "ran out of fuel: the budget of 400000000 instructions is spent",
        ),
        ("alloc", "exceeded its memory cap of 64 MiB"),
        ("recurse", "overflowed its wasm stack of 256 KiB"),
        ("panic", "panicked: hostile plugin panics on purpose"),
        ("error", "returned an error: hostile plugin refuses to plan"),
        ("nomatch", "filter {PP:999} matches no node"),
        ("cycle", "it would make a cycle"),
        ("flood", "made more than 100000 calls into the host"),
    ];
    for (mode, expect) in cases {
        let err = host
            .apply(&hostile, &mut dag, &opts(&[("mode", mode)]))
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(expect),
            "mode {mode}: `{msg}` should contain `{expect}`"
        );
        assert!(msg.starts_with("plugin `hostile@0.1.0` (sha256 "), "{msg}");
        assert!(msg.contains(": apply: "), "{msg}");
        // Transactional: the DAG is untouched, in full state.
        assert!(dag.same_state(&before), "mode {mode} changed the DAG");
        // The next plugin in the same process runs normally.
        host.apply(&hostile, &mut dag.clone(), &opts(&[("mode", "ok")]))
            .unwrap();
    }
    let err = host
        .apply(&hostile, &mut dag, &opts(&[("mode", "nomatch")]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("a directive failed"), "{err}");
    // Each run starts from a fresh instance: the global counter is never seen.
    for _ in 0..3 {
        host.apply(&hostile, &mut dag.clone(), &opts(&[("mode", "global")]))
            .unwrap();
    }
    // And a well-behaved plugin still works afterwards.
    let mut dag = tiny(4);
    host.apply(&host.load("1f1b").unwrap(), &mut dag, &[])
        .unwrap();
    compile(&dag).unwrap();
}

#[test]
fn a_plugin_past_its_wall_clock_deadline_is_stopped() {
    let limits = SandboxLimits {
        fuel: u64::MAX / 2,
        deadline_ms: 300,
        ..strict()
    };
    let host = PluginHost::new(limits, None).unwrap();
    let hostile = host.load_file(&wasm("piper_testing_hostile")).unwrap();
    let t = std::time::Instant::now();
    let err = host
        .apply(&hostile, &mut tiny(1), &opts(&[("mode", "loop")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("exceeded its wall-clock deadline of 300 ms"),
        "{err}"
    );
    assert!(t.elapsed().as_secs() < 10);
}

#[test]
fn a_plugin_built_against_another_major_wit_version_is_refused() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let err = host
        .load_file(&wasm("piper_testing_wrong_version"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains(
            "built against piper:strategy@1.0.0, but this host accepts piper:strategy@0.1.x, 0.2.x, 0.3.x or 0.4.x"
        ),
        "{err}"
    );
    assert!(err.contains(": load: "), "{err}");
}

/// A component built from source against `piper:strategy@0.1.0` (before
/// `recompute`) loads through the 0.1 bindings, plans exactly as its
/// directives called natively, reads node records back intact, and gets a
/// directive's error back as the 0.1 case with the host's message.
#[test]
fn a_plugin_built_against_wit_0_1_loads_and_plans_like_its_directives_called_natively() {
    use piper::dag::Filter;
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let old = host.load_file(&wasm("piper_testing_wit_0_1")).unwrap();
    assert_eq!(old.wit_version, "0.1.0");
    assert_eq!(old.info.name, "wit-0-1");
    let mut dag = tiny(4);
    host.apply(&old, &mut dag, &opts(&[("microbatches", "4")]))
        .unwrap();
    let mut native = tiny(4);
    let regions = native.tag_extents()["PP"];
    native.split(&Filter::all(), "MB", 4).unwrap();
    for r in 0..regions {
        native
            .place(&Filter::tag("PP", r), &[r * 4 / regions], "pp")
            .unwrap();
    }
    let (a, b) = (compile(&dag).unwrap(), compile(&native).unwrap());
    assert_eq!(a.hash, b.hash);
    assert_eq!(
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap()
    );
    let err = host
        .apply(&old, &mut tiny(4), &opts(&[("fail", "true")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("device-out-of-range: directive `place({PP:0}, devices [4], stream \"pp\")`: device 4 does not exist, the cluster has 4"),
        "{err}"
    );
}

/// A component built from source against `piper:strategy@0.2.0` (before
/// `sequence-parallel`) loads through the 0.2 bindings and plans exactly as
/// its directives called natively, `recompute`'s policy crossing intact;
/// a directive's error comes back as the 0.2 case with the host's message.
#[test]
fn a_plugin_built_against_wit_0_2_loads_and_plans_like_its_directives_called_natively() {
    use piper::dag::{Filter, Label, RecomputePolicy};
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let old = host.load_file(&wasm("piper_testing_wit_0_2")).unwrap();
    assert_eq!(old.wit_version, "0.2.0");
    assert_eq!(old.info.name, "wit-0-2");
    for (policy, native_policy) in [
        ("full", RecomputePolicy::Full),
        ("selective", RecomputePolicy::Selective),
    ] {
        let mut dag = tiny(4);
        let args = opts(&[("microbatches", "4"), ("policy", policy)]);
        host.apply(&old, &mut dag, &args).unwrap();
        let mut native = tiny(4);
        let regions = native.tag_extents()["PP"];
        native.split(&Filter::all(), "MB", 4).unwrap();
        for r in 0..regions {
            native
                .place(&Filter::tag("PP", r), &[r * 4 / regions], "pp")
                .unwrap();
        }
        native
            .recompute(&Filter::all().pass(Label::F), native_policy)
            .unwrap();
        let (a, b) = (compile(&dag).unwrap(), compile(&native).unwrap());
        assert_eq!(a.hash, b.hash, "{policy}");
    }
    let err = host
        .apply(&old, &mut tiny(4), &opts(&[("fail", "true")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("device-out-of-range: directive `place({PP:0}, devices [4], stream \"pp\")`"),
        "{err}"
    );
}

/// A component built from source against `piper:strategy@0.3.0` (before
/// `context-parallel`) loads through the 0.3 bindings and plans exactly as
/// its directives called natively (`sequence-parallel`, the 0.3 addition,
/// included); a directive's error comes back with the host's message.
#[test]
fn a_plugin_built_against_wit_0_3_loads_and_plans_like_its_directives_called_natively() {
    use piper::dag::Filter;
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let old = host.load_file(&wasm("piper_testing_wit_0_3")).unwrap();
    assert_eq!(old.wit_version, "0.3.0");
    assert_eq!(old.info.name, "wit-0-3");
    let mut dag = tiny(2);
    host.apply(&old, &mut dag, &opts(&[])).unwrap();
    let mut native = tiny(2);
    native.shard_tensor(&Filter::all(), &[0, 1], "tp").unwrap();
    native.sequence_parallel(&Filter::all()).unwrap();
    let (a, b) = (compile(&dag).unwrap(), compile(&native).unwrap());
    assert_eq!(a.hash, b.hash);
    let err = host
        .apply(&old, &mut tiny(2), &opts(&[("fail", "true")]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "device-out-of-range: directive `shard-tensor({}, devices [2], stream \"tp\")`"
        ),
        "{err}"
    );
}

#[test]
fn garbage_is_refused_at_load() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let refused = |bytes: &[u8]| {
        let err = host
            .load_bytes(bytes, "junk.wasm")
            .err()
            .unwrap()
            .to_string();
        // One line, naming the plugin and its digest.
        assert!(!err.contains('\n'), "{err}");
        let digest = &piper::home::sha256_hex(bytes)[..12];
        assert!(
            err.contains(&format!("`junk.wasm` (sha256 {digest})"))
                && err.contains("cannot read or compile"),
            "{err}"
        );
        err
    };
    let err = refused(b"#!/bin/sh\necho not wasm\n");
    assert!(
        err.contains(
            "not a WebAssembly component (bad magic number: the file starts with 23 21 2f 62"
        ),
        "{err}"
    );
    assert!(refused(b"").contains("starts with nothing (an empty file)"));
    let err = refused(b"\0asm\x01\0\0\0");
    assert!(
        err.contains("a core WebAssembly module, not a component"),
        "{err}"
    );
    let err = refused(b"\0asm not really");
    assert!(
        err.contains("unknown version and layer 20 6e 6f 74"),
        "{err}"
    );
    // A component header with garbage after it: wasmparser's own reason,
    // folded into the line.
    let err = refused(b"\0asm\x0d\0\x01\0\xff\xff\xff\xff\xff\xff");
    assert!(
        err.contains("cannot read or compile the component: "),
        "{err}"
    );
    let err = host.load("no-such-strategy").err().unwrap().to_string();
    assert!(err.contains("bundled: dp, gpipe, 1f1b"), "{err}");
}

#[test]
fn the_compile_cache_skips_compilation_and_ignores_tampered_files() {
    let dir = std::env::temp_dir().join(format!("piper-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = PluginHost::new(SandboxLimits::default(), Some(dir.clone())).unwrap();
    first.load("gpipe").unwrap();
    assert_eq!((first.compiles(), first.cache_hits()), (1, 0));
    // A second host (a second `piper plan`) finds it compiled.
    let second = PluginHost::new(SandboxLimits::default(), Some(dir.clone())).unwrap();
    let p = second.load("gpipe").unwrap();
    assert_eq!((second.compiles(), second.cache_hits()), (0, 1));
    let mut dag = tiny(2);
    second.apply(&p, &mut dag, &[]).unwrap();
    // A file the host did not write (or a flipped byte) is never deserialized.
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "cwasm") {
            let mut bytes = std::fs::read(&path).unwrap();
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0xff;
            std::fs::write(&path, bytes).unwrap();
        }
    }
    let third = PluginHost::new(SandboxLimits::default(), Some(dir.clone())).unwrap();
    third.load("gpipe").unwrap();
    assert_eq!((third.compiles(), third.cache_hits()), (1, 0));
    // A valid cached file renamed to another plugin's key is recompiled,
    // never run as that plugin: the MAC covers the digest and the engine.
    let one = PluginHost::new(SandboxLimits::default(), Some(dir.clone())).unwrap();
    let dp = one.load("dp").unwrap();
    let gpipe = one.load("gpipe").unwrap();
    let file_of = |sha: &str| {
        std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.file_name().unwrap().to_string_lossy().starts_with(sha))
            .unwrap()
    };
    std::fs::copy(file_of(&gpipe.sha256), file_of(&dp.sha256)).unwrap();
    let fourth = PluginHost::new(SandboxLimits::default(), Some(dir.clone())).unwrap();
    let p = fourth.load("dp").unwrap();
    assert_eq!(p.info.name, "dp");
    assert_eq!((fourth.compiles(), fourth.cache_hits()), (1, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_plugin_importing_anything_else_is_refused_with_the_list() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let err = host
        .load_file(&wasm("piper_testing_extra_import"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("it imports what the host does not provide: evil:plugin/sockets"),
        "{err}"
    );
}

/// The `recompute` plugin's wrong inputs are named: a policy, a region list,
/// a region past the model, `every = 0`, and being listed before the
/// strategy that places the model.
#[test]
fn the_recompute_plugin_names_what_is_wrong() {
    let host = PluginHost::new(SandboxLimits::default(), None).unwrap();
    let recompute = host.load("recompute").unwrap();
    let pipeline = host.load("1f1b").unwrap();
    let placed = || {
        let mut dag = tiny(2);
        host.apply(&pipeline, &mut dag, &opts(&[])).unwrap();
        dag
    };
    for (o, want) in [
        (
            &[("policy", "fast")][..],
            "recompute: policy `fast` is not none, full or selective",
        ),
        (
            &[("regions", "0/x")],
            "recompute: regions `0/x`: `x` is not a region index (e.g. `0/2/5`)",
        ),
        (
            &[("regions", "1/1")],
            "recompute: regions name region 1 twice",
        ),
        (
            &[("regions", "3/99")],
            "recompute: region 99 is past the model's 8 PP regions",
        ),
        (&[("every", "0")], "recompute needs every ≥ 1: got 0"),
    ] {
        let mut dag = placed();
        let err = host
            .apply(&recompute, &mut dag, &opts(o))
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{o:?}: {err}");
    }
    let err = host
        .apply(&recompute, &mut tiny(2), &opts(&[]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("directive `recompute({PP:0,PASS:F}, full)`: F{PP:0}#0 is not placed on any device yet; place it first"),
        "{err}"
    );
    // Listed last it plans, every region's forwards recomputed once.
    let mut dag = placed();
    host.apply(&recompute, &mut dag, &opts(&[("every", "2")]))
        .unwrap();
    let r = dag.query(&"{PASS:R}".parse().unwrap()).unwrap();
    let f = dag.query(&"{PASS:F}".parse().unwrap()).unwrap();
    assert_eq!(r.len() * 2, f.len());
    assert!(r
        .iter()
        .all(|n| n.tags.iter().any(|(k, v)| k == "PP" && v % 2 == 0)));
}
