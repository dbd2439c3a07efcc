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

use crate::home::sha256_hex;
use crate::model::params::ParamTable;
use crate::model::ModelConfig;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Host tensors by GPT-2 name: what crosses the checkpoint and dump edge
/// (the runtime inside names parameters by id).
pub type NamedTensors = BTreeMap<String, Vec<f32>>;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint {path}: {message}")]
    Format { path: String, message: String },
    #[error("checkpoint file {path} is damaged or was changed: its sha256 is {actual}, state.json records {recorded}; it is not loaded (resume from another checkpoint)")]
    Digest {
        path: String,
        actual: String,
        recorded: String,
    },
}

/// The files of a checkpoint directory besides `state.json`.
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

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Tests only: how long to stop inside a checkpoint write, after the first
/// temporary file is on disk and before it is renamed (the window a test
/// kills the process in).
#[doc(hidden)]
pub const PAUSE_ENV: &str = "PIPER_TEST_PAUSE_IN_CHECKPOINT_MS";

/// Write `bytes` to `path` whole or not at all: a temporary name beside it,
/// fsync'd, then renamed over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    let mut f = std::fs::File::create(&tmp).map_err(io_error(&tmp))?;
    f.write_all(bytes).map_err(io_error(&tmp))?;
    f.sync_all().map_err(io_error(&tmp))?;
    drop(f);
    if let Some(ms) = std::env::var(PAUSE_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms.min(60_000)));
    }
    std::fs::rename(&tmp, path).map_err(io_error(path))
}

/// fsync a directory, so the renames inside it survive a crash.
fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
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

/// GPT-2 (Hugging Face) name of an internal parameter.
pub fn hf_name(name: &str) -> String {
    match name {
        "wte" | "wpe" => format!("{name}.weight"),
        other => other.to_string(),
    }
}

/// `[rows, cols]` to `[cols, rows]`.
pub(crate) fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Serialize named f32 tensors (`(name, shape, data)`) and u32/i32 extras,
/// written atomically ([`write_atomic`]); returns the file's sha256.
pub fn write_safetensors(
    path: &Path,
    tensors: Vec<(String, Vec<usize>, Vec<u8>, Dtype)>,
    meta: Option<HashMap<String, String>>,
) -> Result<String, CheckpointError> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, s, b, d)| {
            (
                n.clone(),
                TensorView::new(*d, s.clone(), b).expect("shape matches data"),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, meta).map_err(|e| CheckpointError::Format {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    write_atomic(path, &bytes)?;
    Ok(sha256_hex(&bytes))
}

/// The model's parameters as GPT-2 safetensors entries, in the model's
/// order. Linear weights are `[out, in]` inside, `[in, out]` (Conv1D) in
/// GPT-2 files.
pub fn gpt2_entries(
    cfg: &ModelConfig,
    params: &NamedTensors,
    prefix: &str,
) -> Vec<(String, Vec<usize>, Vec<u8>, Dtype)> {
    let table = ParamTable::new(cfg);
    table
        .in_model_order()
        .iter()
        .filter_map(|&id| {
            let (name, entry) = (table.name(id), table.entry(id));
            let v = params.get(name)?;
            let shape = entry.shape.clone();
            let (shape, data) = if entry.is_conv1d() {
                (vec![shape[1], shape[0]], transpose(v, shape[0], shape[1]))
            } else {
                (shape, v.clone())
            };
            Some((
                format!("{prefix}{}", hf_name(name)),
                shape,
                bytes_of(&data),
                Dtype::F32,
            ))
        })
        .collect()
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

/// Save `ck` as `root/step-NNNNNNNN/` and point `root/latest` at it: the
/// directory is written whole under a temporary name and renamed, and only
/// then is `latest` replaced (atomically). With `keep > 0`, the oldest
/// complete checkpoints beyond the newest `keep` are removed afterwards.
pub fn save_step(root: &Path, ck: &Checkpoint, keep: u32) -> Result<Saved, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io_error(root))?;
    let name = step_dir_name(ck.state.step);
    let dir = root.join(&name);
    // Leftovers of writes a killed process never finished (never loaded:
    // they have no `step-` name).
    for entry in std::fs::read_dir(root).map_err(io_error(root))? {
        let entry = entry.map_err(io_error(root))?;
        let n = entry.file_name().to_string_lossy().into_owned();
        if n.starts_with(".step-") && (n.ends_with(".partial") || n.ends_with(".old")) {
            let p = entry.path();
            std::fs::remove_dir_all(&p).map_err(io_error(&p))?;
        }
    }
    let partial = root.join(format!(".{name}.partial"));
    ck.save(&partial)?;
    if dir.exists() {
        // The same step written before (a run resumed from an older one):
        // moved aside, replaced, then removed.
        let old = root.join(format!(".{name}.old"));
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io_error(&old))?;
        }
        std::fs::rename(&dir, &old).map_err(io_error(&dir))?;
        std::fs::rename(&partial, &dir).map_err(io_error(&dir))?;
        std::fs::remove_dir_all(&old).map_err(io_error(&old))?;
    } else {
        std::fs::rename(&partial, &dir).map_err(io_error(&dir))?;
    }
    sync_dir(root)?;
    write_atomic(&root.join("latest"), format!("{name}\n").as_bytes())?;
    sync_dir(root)?;
    let mut removed = Vec::new();
    if keep > 0 {
        let all = steps_in(root)?;
        let excess = all.len().saturating_sub(keep as usize);
        for (_, old) in all.into_iter().take(excess).filter(|(_, d)| *d != dir) {
            std::fs::remove_dir_all(&old).map_err(io_error(&old))?;
            removed.push(old);
        }
    }
    Ok(Saved { dir, removed })
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

/// The checkpoint directory `path` stands for: `path` itself when it holds
/// a `state.json`, else the one its `latest` names, else the newest
/// complete `step-*` directory in it.
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
            return Err(CheckpointError::Format {
                path: latest.display().to_string(),
                message: format!(
                    "names {name}, which is not a complete checkpoint (no state.json)"
                ),
            });
        }
        return Ok((dir, Found::Latest));
    }
    match steps_in(path)?.pop() {
        Some((_, dir)) => Ok((dir, Found::Newest)),
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
}
