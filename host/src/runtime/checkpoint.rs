//! Checkpoints and step-1 dumps as safetensors.
//!
//! A checkpoint directory holds `model.safetensors` (Hugging Face's names
//! and layout: GPT-2's `wte.weight`, `h.0.attn.c_attn.weight` stored
//! `[in, out]`, …; the Llama family's `model.layers.0.self_attn.q_proj.weight`
//! `[out, in]`), `config.json` and `generation_config.json` (`hf.rs`: the
//! directory opens with transformers' `from_pretrained`), `optimizer.safetensors` (AdamW moments `m.<name>`,
//! `v.<name>` in the internal layout) and `state.json` (step, seed, model,
//! schedule, and the sha256 of each of the other files). Resuming restores
//! all of it exactly, so the resumed run is bit-identical to an
//! uninterrupted one; a file whose digest differs is refused, never loaded.
//!
//! Every file is written under a temporary name, fsync'd and renamed, and
//! `state.json` comes last: a directory with a `state.json` is complete. A
//! run's checkpoints live under one root ([`save_step`]): `ROOT/step-NNNNNNNN/`
//! per save and `ROOT/latest` naming the newest, replaced only after the
//! step directory is whole, so a process killed at any moment leaves the
//! previous checkpoint loadable ([`resolve`]).

use super::files::{bytes_of, io_error, sync_dir, transpose, writer_gone, writer_tag_of};
pub use super::files::{
    gpt2_entries, hf_name, write_atomic, write_safetensors, CheckpointError, NamedTensors,
    PAUSE_ENV,
};
use crate::home::sha256_hex;
use crate::model::params::ParamTable;
use crate::model::ModelConfig;
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Host tensors by GPT-2 name: what crosses the checkpoint and dump edge
/// (the runtime inside names parameters by id).
pub const FILES: [&str; 2] = ["model.safetensors", "optimizer.safetensors"];

/// `state.json`: the training state and the digests of the other files.
#[derive(Serialize, Deserialize)]
struct StateFile {
    #[serde(flatten)]
    state: TrainState,
    /// sha256 (hex) of each of [`FILES`] (absent: refused on load).
    #[serde(default)]
    files: BTreeMap<String, String>,
}

/// What a checkpoint holds besides tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Steps completed; the next step is `step + 1` (also the data position).
    pub step: u32,
    pub seed: u64,
    pub model: ModelConfig,
    /// The learning-rate schedule trained under (absent in checkpoints
    /// written before schedules: those resume under any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<crate::runtime::Schedule>,
    /// The data trained on and where the next step's batch starts (absent
    /// in checkpoints written before it: those resume on any data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<crate::runtime::DataPosition>,
}

/// Everything needed to continue training.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub state: TrainState,
    pub params: NamedTensors,
    pub m: NamedTensors,
    pub v: NamedTensors,
}

fn read(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })
}

fn tensor(
    st: &SafeTensors,
    name: &str,
    len: usize,
    path: &Path,
) -> Result<Vec<f32>, CheckpointError> {
    let fmt = |message: String| CheckpointError::Format {
        path: path.display().to_string(),
        message,
    };
    let t = st
        .tensor(name)
        .map_err(|e| fmt(format!("tensor `{name}`: {e}")))?;
    if t.dtype() != Dtype::F32 || t.data().len() != len * 4 {
        return Err(fmt(format!(
            "tensor `{name}` is {:?} {:?}; expected F32 with {len} elements",
            t.dtype(),
            t.shape()
        )));
    }
    Ok(t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

impl Checkpoint {
    /// Write the checkpoint directory: each file atomically, `state.json`
    /// (with the others' digests) last, then the directory fsync'd.
    pub fn save(&self, dir: &Path) -> Result<(), CheckpointError> {
        std::fs::create_dir_all(dir).map_err(io_error(dir))?;
        let cfg = &self.state.model;
        let mut files = BTreeMap::new();
        let digest = write_safetensors(
            &dir.join(FILES[0]),
            gpt2_entries(cfg, &self.params, ""),
            None,
        )?;
        files.insert(FILES[0].to_string(), digest);
        let table = ParamTable::new(cfg);
        let mut opt = Vec::new();
        for &id in table.in_model_order() {
            let (name, shape) = (table.name(id), &table.entry(id).shape);
            for (k, t) in [("m", &self.m), ("v", &self.v)] {
                if let Some(v) = t.get(name) {
                    opt.push((
                        format!("{k}.{name}"),
                        shape.clone(),
                        bytes_of(v),
                        Dtype::F32,
                    ));
                }
            }
        }
        let digest = write_safetensors(&dir.join(FILES[1]), opt, None)?;
        files.insert(FILES[1].to_string(), digest);
        // transformers' configs: the directory opens with from_pretrained.
        super::hf::write_configs(dir, cfg)?;
        let state = StateFile {
            state: self.state.clone(),
            files,
        };
        let json = serde_json::to_string_pretty(&state).expect("state serializes");
        write_atomic(&dir.join("state.json"), json.as_bytes())?;
        sync_dir(dir)
    }

    /// Read a checkpoint directory, checking every tensor's size.
    pub fn load(dir: &Path) -> Result<Self, CheckpointError> {
        let state_path = dir.join("state.json");
        let file: StateFile =
            serde_json::from_slice(&read(&state_path)?).map_err(|e| CheckpointError::Format {
                path: state_path.display().to_string(),
                message: e.to_string(),
            })?;
        let state = file.state;
        let cfg = &state.model;
        // The model comes from a file like any model TOML: its counts are
        // checked before anything is sized from them.
        cfg.validate().map_err(|e| CheckpointError::Format {
            path: state_path.display().to_string(),
            message: e.to_string(),
        })?;
        // Every file is checked against its digest before any is parsed.
        let read_checked = |name: &str| -> Result<(PathBuf, Vec<u8>), CheckpointError> {
            let path = dir.join(name);
            let recorded = file
                .files
                .get(name)
                .ok_or_else(|| CheckpointError::Format {
                    path: state_path.display().to_string(),
                    message: format!(
                        "records no sha256 for {name}; a checkpoint without digests is not loaded"
                    ),
                })?;
            let bytes = read(&path)?;
            let actual = sha256_hex(&bytes);
            if &actual != recorded {
                return Err(CheckpointError::Digest {
                    path: path.display().to_string(),
                    actual,
                    recorded: recorded.clone(),
                });
            }
            Ok((path, bytes))
        };
        let (mpath, mbytes) = read_checked(FILES[0])?;
        let (opath, obytes) = read_checked(FILES[1])?;
        let st = SafeTensors::deserialize(&mbytes).map_err(|e| CheckpointError::Format {
            path: mpath.display().to_string(),
            message: e.to_string(),
        })?;
        let ot = SafeTensors::deserialize(&obytes).map_err(|e| CheckpointError::Format {
            path: opath.display().to_string(),
            message: e.to_string(),
        })?;
        let table = ParamTable::new(cfg);
        let (mut params, mut m, mut v) = (
            NamedTensors::new(),
            NamedTensors::new(),
            NamedTensors::new(),
        );
        for &id in table.in_model_order() {
            let (name, entry) = (table.name(id).to_string(), table.entry(id));
            let shape = &entry.shape;
            let len = entry.numel();
            let raw = tensor(&st, &hf_name(&name), len, &mpath)?;
            let p = if entry.is_conv1d() {
                transpose(&raw, shape[1], shape[0])
            } else {
                raw
            };
            params.insert(name.clone(), p);
            m.insert(
                name.clone(),
                tensor(&ot, &format!("m.{name}"), len, &opath)?,
            );
            v.insert(
                name.clone(),
                tensor(&ot, &format!("v.{name}"), len, &opath)?,
            );
        }
        Ok(Checkpoint {
            state,
            params,
            m,
            v,
        })
    }
}

/// The name of step `step`'s directory under a checkpoint root.
pub fn step_dir_name(step: u32) -> String {
    format!("step-{step:08}")
}

/// The step a root's entry is the checkpoint of (`step-NNNNNNNN`), if it is one.
fn step_of(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("step-")?;
    (digits.len() == 8 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// The complete checkpoints under `root` (directories holding a
/// `state.json`), by step, oldest first.
pub fn steps_in(root: &Path) -> Result<Vec<(u32, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(root).map_err(io_error(root))? {
        let entry = entry.map_err(io_error(root))?;
        let name = entry.file_name();
        if let Some(step) = name.to_str().and_then(step_of) {
            let dir = entry.path();
            if dir.join("state.json").is_file() {
                out.push((step, dir));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// What a [`save_step`] did.
#[derive(Debug)]
pub struct Saved {
    /// The checkpoint directory written.
    pub dir: PathBuf,
    /// Older checkpoints removed to keep the newest `keep`.
    pub removed: Vec<PathBuf>,
}

/// The kinds of leftover a killed save leaves in a root: a step directory
/// being written (`.step-N.PID.K.partial`) and a complete one moved aside
/// while the same step is written again (`.step-N.PID.K.old`).
fn leftover(name: &str) -> Option<(u32, u32, bool)> {
    let rest = name.strip_prefix('.')?;
    let (rest, old) = match (rest.strip_suffix(".partial"), rest.strip_suffix(".old")) {
        (Some(r), _) => (r, false),
        (_, Some(r)) => (r, true),
        _ => return None,
    };
    let mut parts = rest.split('.');
    let step = step_of(parts.next()?)?;
    let pid = parts.next()?.parse().ok()?;
    Some((step, pid, old))
}

/// Put a root's leftovers right before a save: a complete step moved aside
/// by a re-save that was killed before its replacement was in place goes
/// back under its name (it is the only complete copy); other leftovers of
/// writers that are gone are removed.
fn recover(root: &Path) -> Result<(), CheckpointError> {
    for entry in std::fs::read_dir(root).map_err(io_error(root))? {
        let entry = entry.map_err(io_error(root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((step, pid, old)) = leftover(&name) else {
            continue;
        };
        let p = entry.path();
        let home = root.join(step_dir_name(step));
        if old && p.join("state.json").is_file() && !home.join("state.json").is_file() {
            if home.exists() {
                std::fs::remove_dir_all(&home).map_err(io_error(&home))?;
            }
            std::fs::rename(&p, &home).map_err(io_error(&p))?;
        } else if writer_gone(pid) {
            std::fs::remove_dir_all(&p).map_err(io_error(&p))?;
        }
    }
    sync_dir(root)
}

/// Save `ck` as `root/step-NNNNNNNN/` and point `root/latest` at it: the
/// directory is written whole under a temporary name and renamed, and only
/// then is `latest` replaced (atomically). A step written before (a run
/// resumed from an older checkpoint) is moved aside until its replacement
/// is in place; killed in between, the next save or [`resolve`] finds the
/// moved copy. With `keep > 0`, the checkpoints written longest ago beyond
/// the newest `keep` are removed afterwards (by the time each was written,
/// not by step: after a resume from step 100, step 110 is newer than an
/// older run's step 200).
pub fn save_step(root: &Path, ck: &Checkpoint, keep: u32) -> Result<Saved, CheckpointError> {
    save_step_stopping(root, ck, keep, &mut Stop::never())
}

/// Where a save may be stopped, for the tests that kill it at each point.
#[doc(hidden)]
pub struct Stop {
    after: Option<u32>,
    done: u32,
    /// The writer's process id in its leftovers' names.
    pid: u32,
}

impl Stop {
    pub fn never() -> Self {
        Stop {
            after: None,
            done: 0,
            pid: std::process::id(),
        }
    }
    /// Stop (as a kill would: nothing after it runs) once `n` steps are
    /// done; the leftovers are named as a process that has ended would
    /// name them.
    pub fn after(n: u32) -> Self {
        Stop {
            after: Some(n),
            done: 0,
            pid: u32::MAX,
        }
    }
    /// One step of the save done: an error if the save stops here.
    fn step(&mut self, what: &str) -> Result<(), CheckpointError> {
        self.done += 1;
        match self.after {
            Some(n) if self.done >= n => Err(CheckpointError::Format {
                path: what.to_string(),
                message: format!("stopped after step {n} of the save (a test's kill)"),
            }),
            _ => Ok(()),
        }
    }
}

/// [`save_step`], stopped where `stop` says.
#[doc(hidden)]
pub fn save_step_stopping(
    root: &Path,
    ck: &Checkpoint,
    keep: u32,
    stop: &mut Stop,
) -> Result<Saved, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io_error(root))?;
    recover(root)?;
    let name = step_dir_name(ck.state.step);
    let dir = root.join(&name);
    let partial = root.join(format!(".{name}.{}.partial", writer_tag_of(stop.pid)));
    if let Err(e) = ck.save(&partial) {
        // Failed, not killed: nothing of it is left behind.
        let _ = std::fs::remove_dir_all(&partial);
        return Err(e);
    }
    stop.step("the step written under a temporary name")?;
    if dir.exists() {
        let old = root.join(format!(".{name}.{}.old", writer_tag_of(stop.pid)));
        std::fs::rename(&dir, &old).map_err(io_error(&dir))?;
        stop.step("the old copy moved aside")?;
        std::fs::rename(&partial, &dir).map_err(io_error(&dir))?;
        sync_dir(root)?;
        stop.step("the new copy in place")?;
        std::fs::remove_dir_all(&old).map_err(io_error(&old))?;
        stop.step("the old copy removed")?;
    } else {
        std::fs::rename(&partial, &dir).map_err(io_error(&dir))?;
        stop.step("the step in place")?;
    }
    sync_dir(root)?;
    write_atomic(&root.join("latest"), format!("{name}\n").as_bytes())?;
    sync_dir(root)?;
    stop.step("latest written")?;
    let mut removed = Vec::new();
    if keep > 0 {
        let mut all = by_time_written(root)?;
        let excess = all.len().saturating_sub(keep as usize);
        all.truncate(excess);
        for old in all.into_iter().filter(|d| *d != dir) {
            std::fs::remove_dir_all(&old).map_err(io_error(&old))?;
            stop.step("an old checkpoint removed")?;
            removed.push(old);
        }
    }
    Ok(Saved { dir, removed })
}

/// A root's complete checkpoints, oldest written first (by their
/// `state.json`'s time, then step).
fn by_time_written(root: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let mut all: Vec<(std::time::SystemTime, u32, PathBuf)> = Vec::new();
    for (step, dir) in steps_in(root)? {
        let state = dir.join("state.json");
        let meta = std::fs::metadata(&state).map_err(io_error(&state))?;
        let when = meta.modified().map_err(io_error(&state))?;
        all.push((when, step, dir));
    }
    all.sort();
    Ok(all.into_iter().map(|(_, _, d)| d).collect())
}

/// How [`resolve`] found the checkpoint it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// The path was a checkpoint directory itself.
    Directory,
    /// The root's `latest` pointer named it.
    Latest,
    /// The root had no `latest` (a run killed before its first pointer
    /// was written): the newest complete `step-*` directory.
    Newest,
}

/// A complete copy of step directory `name` a re-save moved aside in
/// `root` (`.NAME.PID.K.old`), if there is one.
fn moved_aside(root: &Path, name: &str) -> Result<Option<PathBuf>, CheckpointError> {
    for entry in std::fs::read_dir(root).map_err(io_error(root))? {
        let entry = entry.map_err(io_error(root))?;
        let n = entry.file_name().to_string_lossy().into_owned();
        let is_copy = n
            .strip_prefix('.')
            .is_some_and(|r| r.starts_with(&format!("{name}.")))
            && leftover(&n).is_some_and(|(_, _, old)| old);
        if is_copy && entry.path().join("state.json").is_file() {
            return Ok(Some(entry.path()));
        }
    }
    Ok(None)
}

/// The checkpoint directory `path` stands for: `path` itself when it holds
/// a `state.json`, else the one its `latest` names (or that step's copy an
/// interrupted re-save moved aside), else the complete `step-*` directory
/// written last.
pub fn resolve(path: &Path) -> Result<(PathBuf, Found), CheckpointError> {
    let format = |message: String| CheckpointError::Format {
        path: path.display().to_string(),
        message,
    };
    if !path.is_dir() {
        return Err(format("no such checkpoint directory".into()));
    }
    if path.join("state.json").is_file() {
        return Ok((path.to_path_buf(), Found::Directory));
    }
    let latest = path.join("latest");
    if latest.is_file() {
        let text = std::fs::read_to_string(&latest).map_err(io_error(&latest))?;
        let name = text.trim();
        if step_of(name).is_none() {
            return Err(CheckpointError::Format {
                path: latest.display().to_string(),
                message: format!(
                    "names `{}`, not a step directory (step-NNNNNNNN)",
                    name.chars().take(64).collect::<String>()
                ),
            });
        }
        let dir = path.join(name);
        if !dir.join("state.json").is_file() {
            // A re-save of this step killed between moving the complete
            // copy aside and putting the new one in place.
            if let Some(moved) = moved_aside(path, name)? {
                return Ok((moved, Found::Latest));
            }
            return Err(CheckpointError::Format {
                path: latest.display().to_string(),
                message: format!(
                    "names {name}, which is not a complete checkpoint (no state.json)"
                ),
            });
        }
        return Ok((dir, Found::Latest));
    }
    match by_time_written(path)?.pop() {
        Some(dir) => Ok((dir, Found::Newest)),
        None => Err(format(
            "holds no checkpoint: no state.json, no `latest`, no complete step-NNNNNNNN directory"
                .into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Checkpoint {
        let model = ModelConfig::tiny();
        let table = ParamTable::new(&model);
        let full = |k: f32| -> NamedTensors {
            table
                .in_model_order()
                .iter()
                .map(|&id| {
                    let n = table.entry(id).numel();
                    (
                        table.name(id).to_string(),
                        (0..n).map(|i| k * i as f32).collect(),
                    )
                })
                .collect()
        };
        Checkpoint {
            state: TrainState {
                step: 3,
                seed: 1,
                model,
                schedule: None,
                data: None,
            },
            params: full(0.5),
            m: full(0.25),
            v: full(0.125),
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("piper-ck-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn roots_keep_the_newest_and_latest_names_the_last_complete_one() {
        let root = scratch("root");
        let mut ck = tiny();
        for step in [2, 4, 6] {
            ck.state.step = step;
            let saved = save_step(&root, &ck, 2).unwrap();
            assert_eq!(saved.dir, root.join(step_dir_name(step)));
        }
        let steps: Vec<u32> = steps_in(&root).unwrap().iter().map(|s| s.0).collect();
        assert_eq!(steps, vec![4, 6]);
        let (dir, found) = resolve(&root).unwrap();
        assert_eq!(
            (dir.clone(), found),
            (root.join("step-00000006"), Found::Latest)
        );
        assert_eq!(Checkpoint::load(&dir).unwrap(), ck);
        // No temporary file is left behind.
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
        // Without `latest` (killed before it was first written), the newest
        // complete directory; a partial one is never taken.
        std::fs::remove_file(root.join("latest")).unwrap();
        std::fs::create_dir_all(root.join("step-00000009")).unwrap();
        assert_eq!(resolve(&root).unwrap(), (dir, Found::Newest));
        // A hostile pointer is refused, not followed.
        std::fs::write(root.join("latest"), "../../etc\n").unwrap();
        let e = resolve(&root).unwrap_err().to_string();
        assert!(
            e.contains("latest") && e.contains("not a step directory"),
            "{e}"
        );
        std::fs::write(root.join("latest"), "step-00000009\n").unwrap();
        let e = resolve(&root).unwrap_err().to_string();
        assert!(e.contains("not a complete checkpoint"), "{e}");
        let empty = scratch("empty");
        std::fs::create_dir_all(&empty).unwrap();
        assert!(resolve(&empty)
            .unwrap_err()
            .to_string()
            .contains("holds no checkpoint"));
        let _ = std::fs::remove_dir_all(&root);
        let _ = std::fs::remove_dir_all(&empty);
    }

    #[test]
    fn damaged_files_are_refused_naming_the_file_and_both_digests() {
        let dir = scratch("damaged");
        let ck = tiny();
        ck.save(&dir).unwrap();
        let model = dir.join(FILES[0]);
        let good = std::fs::read(&model).unwrap();
        // Ten bytes flipped inside a tensor: the size checks alone pass.
        let mut bad = good.clone();
        let at = bad.len() - 100;
        for b in &mut bad[at..at + 10] {
            *b ^= 0xff;
        }
        std::fs::write(&model, &bad).unwrap();
        let e = Checkpoint::load(&dir).unwrap_err().to_string();
        assert!(e.contains(&model.display().to_string()), "{e}");
        assert!(
            e.contains(&sha256_hex(&bad)) && e.contains(&sha256_hex(&good)),
            "{e}"
        );
        // Truncated: refused naming it, too.
        std::fs::write(&model, &good[..good.len() / 2]).unwrap();
        let e = Checkpoint::load(&dir).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("damaged"),
            "{e}"
        );
        std::fs::write(&model, &good).unwrap();
        assert_eq!(Checkpoint::load(&dir).unwrap(), ck);
        // A state.json without digests is not trusted.
        let state = dir.join("state.json");
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("files");
        std::fs::write(&state, v.to_string()).unwrap();
        let e = Checkpoint::load(&dir).unwrap_err().to_string();
        assert!(e.contains("state.json") && e.contains("sha256"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_save_stopped_at_every_point_leaves_a_resumable_latest() {
        // A run resumed from step 3 writes step 3 again with other values:
        // killed at any point of that save, the root resumes to one of the
        // two complete copies, and the next save finds it whole.
        let (a, mut b) = (tiny(), tiny());
        for t in b.params.values_mut() {
            t.iter_mut().for_each(|x| *x += 1.0);
        }
        let mut stopped = 0;
        for k in 1.. {
            let root = scratch(&format!("stop-{k}"));
            let mut older = a.clone();
            older.state.step = 2;
            save_step(&root, &older, 0).unwrap();
            save_step(&root, &a, 0).unwrap();
            let r = save_step_stopping(&root, &b, 1, &mut Stop::after(k));
            let (dir, _) = resolve(&root).unwrap();
            let got = Checkpoint::load(&dir).unwrap();
            assert!(got == a || got == b, "stopped after step {k}: neither copy");
            if r.is_ok() {
                assert_eq!(got, b);
                let _ = std::fs::remove_dir_all(&root);
                break;
            }
            stopped += 1;
            // The next save puts the root right and points at itself.
            let mut next = b.clone();
            next.state.step = 4;
            save_step(&root, &next, 0).unwrap();
            let (dir, found) = resolve(&root).unwrap();
            assert_eq!((dir, found), (root.join("step-00000004"), Found::Latest));
            let three = Checkpoint::load(&root.join("step-00000003")).unwrap();
            assert!(
                three == a || three == b,
                "stopped after step {k}: step 3 lost"
            );
            let left: Vec<String> = std::fs::read_dir(&root)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(".step-"))
                .collect();
            assert!(left.is_empty(), "stopped after step {k}: {left:?} left");
            let _ = std::fs::remove_dir_all(&root);
        }
        assert!(stopped >= 4, "the save has {stopped} stopping points");
    }

    #[test]
    fn keep_holds_the_checkpoints_written_last_not_the_highest_steps() {
        let root = scratch("keep-time");
        let mut ck = tiny();
        // An earlier run reached step 200; this one resumed from 100.
        for step in [200, 100, 110, 120] {
            ck.state.step = step;
            save_step(&root, &ck, 2).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let steps: Vec<u32> = steps_in(&root).unwrap().iter().map(|s| s.0).collect();
        assert_eq!(steps, vec![110, 120]);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn writers_on_one_root_at_once_never_share_a_temporary_name() {
        let root = scratch("two-writers");
        std::thread::scope(|s| {
            for step in [5, 6] {
                let root = &root;
                s.spawn(move || {
                    let mut ck = tiny();
                    ck.state.step = step;
                    save_step(root, &ck, 0).unwrap();
                });
            }
        });
        for step in [5, 6] {
            let mut want = tiny();
            want.state.step = step;
            let got = Checkpoint::load(&root.join(step_dir_name(step))).unwrap();
            assert_eq!(got, want);
        }
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_state_json_with_impossible_model_numbers_is_refused() {
        let dir = scratch("bad-state");
        tiny().save(&dir).unwrap();
        let state = dir.join("state.json");
        let text = std::fs::read_to_string(&state).unwrap();
        for (field, value, want) in [
            (
                "layers_per_region",
                "0",
                "layers_per_region must be at least 1, got 0",
            ),
            (
                "layers",
                "4000000000",
                "layers must be at most 16384, got 4000000000",
            ),
        ] {
            let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
            v["model"][field] = serde_json::from_str(value).unwrap();
            std::fs::write(&state, v.to_string()).unwrap();
            let e = Checkpoint::load(&dir).unwrap_err().to_string();
            assert!(e.contains("state.json") && e.contains(want), "{e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
