//! Regions of one model under different layouts: where a data edge joins
//! two, compile plans a relayout between them, and the plan trains at one
//! device's losses and step-1 gradients within its planned peaks; what no
//! relayout can bring is refused naming the edge and both layouts. The
//! strategies are written as directive calls (the fuzzer's [`Program`]),
//! each the one a user reported.

use crate::fuzz::{Call, Model, Outcome, Program, F};
use piper::dag::Label;

fn regions() -> std::ops::Range<u32> {
    0..4
}

/// Each region's calls from `lay(region)`.
fn program(model: Model, devices: u32, lay: impl Fn(u32) -> Vec<Call>) -> Program {
    Program {
        model,
        devices,
        calls: regions().flat_map(lay).collect(),
    }
}

fn replicate(r: u32, devices: &[u32]) -> Call {
    Call::Replicate {
        f: F::pp(r),
        devices: devices.to_vec(),
        zero: 0,
    }
}

fn trains(p: &Program) {
    match p.run() {
        Outcome::Ran => {}
        other => panic!("{other:?}\nthe strategy:\n{p:?}"),
    }
}

/// Context parallelism on the even regions and plain data parallelism on
/// the odd ones, over the same two devices: each region boundary moves the
/// tensor between two chunks of every sequence and halves of the rows. (On
/// Llama: GPT-2's tied embedding and head, in regions 0 and 3, must share a
/// layout, tested below.)
#[test]
fn context_parallel_regions_beside_data_parallel_ones_train_at_one_devices_numbers() {
    for ring in [true, false] {
        trains(&program(Model::Llama, 2, |r| {
            if r % 2 == 1 {
                return vec![replicate(r, &[0, 1])];
            }
            vec![
                Call::Place {
                    f: F::pp(r),
                    devices: vec![0],
                    stream: "pp",
                },
                Call::ContextParallel {
                    f: F::pp(r),
                    degree: 2,
                    ring,
                },
            ]
        }));
    }
}

/// Tensor-parallel regions (with and without sequence parallelism)
/// beside data-parallel ones on the same devices: alternating on Llama, on
/// the middle regions only on GPT-2 (its tied embedding and head share a
/// layout).
#[test]
fn tensor_parallel_regions_beside_data_parallel_ones_train_at_one_devices_numbers() {
    let cases = [
        (Model::Gpt2, false, [false, true, true, false]),
        (Model::Gpt2, true, [false, true, true, false]),
        (Model::Llama, false, [true, false, true, false]),
        (Model::Llama, true, [false, true, false, true]),
    ];
    for (model, sp, tp) in cases {
        trains(&program(model, 2, |r| {
            if !tp[r as usize] {
                return vec![replicate(r, &[0, 1])];
            }
            let mut c = vec![Call::ShardTensor {
                f: F::pp(r),
                devices: vec![0, 1],
            }];
            if sp {
                c.push(Call::SequenceParallel { f: F::pp(r) });
            }
            c
        }));
    }
}

/// GPT-2's tied `wte` held two ways (tensor-parallel embedding,
/// data-parallel head) is refused naming both layouts.
#[test]
fn a_tied_weight_held_two_ways_is_refused_naming_both_layouts() {
    let p = program(Model::Gpt2, 2, |r| match r {
        0 => vec![Call::ShardTensor {
            f: F::pp(r),
            devices: vec![0, 1],
        }],
        _ => vec![replicate(r, &[0, 1])],
    });
    match p.run() {
        Outcome::NotCompiled(e) => assert!(
            e.contains("the tied embedding/head weight `wte` is held two ways")
                && e.contains("tensor-parallel group of 2 (shard-tensor)")
                && e.contains("data-parallel shares (replicate)"),
            "{e}"
        ),
        other => panic!("{other:?}"),
    }
}

/// A region on one device feeding regions replicated over two, which feed
/// one device again: the new member receives its rows, the narrower group
/// gathers them, and the gradients come back.
#[test]
fn a_region_on_one_device_feeds_a_wider_group() {
    trains(&program(Model::Gpt2, 2, |r| match r {
        0 | 3 => vec![Call::Place {
            f: F::pp(r),
            devices: vec![0],
            stream: "pp",
        }],
        _ => vec![replicate(r, &[0, 1])],
    }));
}

/// Context parallelism's ring with 4 microbatches, full recomputation and
/// the recompute nodes on a stream of their own; tensor parallelism with
/// its recompute on its own stream.
#[test]
fn recompute_on_its_own_stream_runs_beside_ring_and_tensor_exchanges() {
    let mut cp = vec![Call::Split { f: F::all(), n: 4 }];
    cp.extend(regions().flat_map(|r| {
        [
            Call::Place {
                f: F::pp(r),
                devices: vec![0],
                stream: "pp",
            },
            Call::ContextParallel {
                f: F::pp(r),
                degree: 2,
                ring: true,
            },
        ]
    }));
    let mut tp: Vec<Call> = regions()
        .map(|r| Call::ShardTensor {
            f: F::pp(r),
            devices: vec![0, 1],
        })
        .collect();
    for calls in [&mut cp, &mut tp] {
        calls.push(Call::Recompute {
            f: F::all(),
            full: true,
        });
        calls.push(Call::SetStream {
            f: F {
                pass: Some(Label::R),
                ..F::all()
            },
            stream: "recompute",
        });
    }
    for calls in [cp, tp] {
        trains(&Program {
            model: Model::Gpt2,
            devices: 2,
            calls,
        });
    }
}

/// Pipeline stages with layouts of their own: data-parallel halves on
/// [0, 1] feeding a tensor-parallel pair on [2, 3] (a pipeline would pair
/// the groups device for device; the relayout sends each rank of the pair
/// the whole batch from the two halves, and the halves their gradients),
/// whose last region is data-parallel again (the tied head's layout is the
/// embedding's).
#[test]
fn a_stage_with_a_layout_of_its_own_feeds_the_next_across_devices() {
    trains(&program(Model::Gpt2, 4, |r| match r {
        0 | 1 => vec![replicate(r, &[0, 1])],
        2 => vec![Call::ShardTensor {
            f: F::pp(r),
            devices: vec![2, 3],
        }],
        _ => vec![replicate(r, &[2, 3])],
    }));
}

/// `place` moves a tensor- or context-parallel region whole: a context-
/// parallel pair moved onto three devices is refused naming `place`.
#[test]
fn place_refuses_to_move_a_context_parallel_pair_onto_another_size() {
    let moved = program(Model::Gpt2, 3, |r| {
        vec![
            Call::Place {
                f: F::pp(r),
                devices: vec![0],
                stream: "pp",
            },
            Call::ContextParallel {
                f: F::pp(r),
                degree: 2,
                ring: true,
            },
            Call::Place {
                f: F::pp(r),
                devices: vec![0, 1, 2],
                stream: "pp",
            },
        ]
    });
    match moved.run() {
        Outcome::Refused(e) => assert!(
            e.contains("place(")
                && e.contains("is context-parallel on 2 devices")
                && e.contains("place moves its groups whole"),
            "{e}"
        ),
        other => panic!("{other:?}"),
    }
}

/// The example strategy with a layout per region
/// (`examples/plugins/mixed-layout`: tensor parallelism on the blocks, data
/// parallelism on the embedding's and the head's regions) builds with
/// `piper plugin build` and passes `piper plugin verify` on 2 devices.
#[test]
fn the_mixed_layout_example_builds_and_keeps_the_math() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let tmp = std::env::temp_dir().join(format!("piper-mixed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    // `plugin build` names the component after its folder.
    let dir = tmp.join("mixed-layout");
    std::fs::create_dir_all(dir.join("src")).unwrap();
    let example = repo.join("examples/plugins/mixed-layout");
    // A copy outside the repository, its SDK path made absolute.
    let sdk = repo.join("sdk").canonicalize().unwrap();
    let manifest = std::fs::read_to_string(example.join("Cargo.toml"))
        .unwrap()
        .replace("../../../sdk", &sdk.display().to_string());
    std::fs::write(dir.join("Cargo.toml"), manifest).unwrap();
    std::fs::copy(example.join("src/lib.rs"), dir.join("src/lib.rs")).unwrap();
    let home = tmp.join("home");
    let run = |args: &[&str], target: bool| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_piper"));
        c.args(args).env("PIPER_HOME", &home);
        if target {
            // The bundled plugins' target folder, where the SDK's
            // dependencies already are.
            c.env("CARGO_TARGET_DIR", repo.join("target/plugins"));
        }
        let o = c.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o.status.success(), text)
    };
    let (ok, out) = run(&["plugin", "build", dir.to_str().unwrap()], true);
    assert!(ok, "{out}");
    let wasm = dir.join("build/mixed-layout.wasm");
    let (ok, out) = run(
        &["plugin", "verify", wasm.to_str().unwrap(), "--devices", "2"],
        false,
    );
    assert!(
        ok && out.contains("PASS: `mixed-layout@0.1.0`")
            && out.contains("trains tiny on 2 devices as one device does"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The fuzzer's first finding: a MoE's expert segments keep each
/// assignment's input and the routing's four words per choice, which the
/// plan left out; with the dense segments recomputed the expert segments'
/// saved tensors set the peak, measured above the plan. Phased (by `shard`)
/// and whole, with and without recomputation.
#[test]
fn a_moes_expert_segments_are_planned_as_the_runtime_holds_them() {
    for (shard, full) in [(true, true), (false, true), (true, false)] {
        let mut calls = vec![Call::Place {
            f: F::all(),
            devices: vec![0],
            stream: "pp",
        }];
        if shard {
            calls.push(replicate(0, &[0]));
            calls.push(Call::Shard {
                f: F {
                    ep: true,
                    ..F::pp(0)
                },
                devices: vec![0],
                stream: "ep",
            });
        }
        if full {
            calls.push(Call::Recompute { f: F::all(), full });
        }
        trains(&Program {
            model: Model::Moe,
            devices: 1,
            calls,
        });
    }
}

/// The fuzzer's third finding: under sequence parallelism a selective
/// recompute keeps the blocks' norm outputs gathered over the group (whole
/// on each rank), which the plan counted as dropped; GPT-2 and Llama, with
/// tensor parallelism on every region.
#[test]
fn selective_recompute_under_sequence_parallelism_is_planned_as_kept() {
    for model in [Model::Gpt2, Model::Llama] {
        let mut calls = Vec::new();
        for r in regions() {
            calls.push(Call::ShardTensor {
                f: F::pp(r),
                devices: vec![0, 1],
            });
            calls.push(Call::SequenceParallel { f: F::pp(r) });
        }
        calls.push(Call::Recompute {
            f: F::all(),
            full: false,
        });
        trains(&Program {
            model,
            devices: 2,
            calls,
        });
    }
}

/// The fuzzer's fourth finding: ZeRO-2 on a group of one replica shards
/// nothing (its gradients go to the update whole), but the tied all-reduce
/// between the embedding's and the head's groups waited for per-microbatch
/// gradients from it. Tied groups of one device and of two, ZeRO-1 and 2.
#[test]
fn tied_groups_under_zero_two_train_with_one_replica_or_several() {
    let cases: [(Model, &[u32], &[u32], u8); 4] = [
        (Model::Gpt2, &[0], &[1], 2),
        (Model::Moe, &[0], &[1], 2),
        (Model::Moe, &[0], &[1], 1),
        (Model::Gpt2, &[0, 1], &[2, 3], 2),
    ];
    for (model, first, rest, zero) in cases {
        let devices = (first.len() + rest.len()) as u32;
        trains(&program(model, devices, |r| {
            vec![Call::Replicate {
                f: F::pp(r),
                devices: if r == 0 { first } else { rest }.to_vec(),
                zero,
            }]
        }));
    }
}
