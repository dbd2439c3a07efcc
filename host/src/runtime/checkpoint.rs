//! Checkpoints and step-1 dumps as safetensors.
//!
//! A checkpoint directory holds `model.safetensors` (GPT-2 names and layout,
//! as Hugging Face's `gpt2`: `wte.weight`, `h.0.attn.c_attn.weight` stored
//! `[in, out]`, …), `optimizer.safetensors` (AdamW moments `m.<name>`,
//! `v.<name>` in the internal layout) and `state.json` (step, seed, model,
//! next data position). Resuming restores all of it exactly, so the resumed
//! run is bit-identical to an uninterrupted one.

use crate::model::params::ParamTable;
use crate::model::ModelConfig;
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

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

fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
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

/// Serialize named f32 tensors (`(name, shape, data)`) and u32/i32 extras.
pub fn write_safetensors(
    path: &Path,
    tensors: Vec<(String, Vec<usize>, Vec<u8>, Dtype)>,
    meta: Option<HashMap<String, String>>,
) -> Result<(), CheckpointError> {
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
    std::fs::write(path, bytes).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })
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
    /// Write the checkpoint directory.
    pub fn save(&self, dir: &Path) -> Result<(), CheckpointError> {
        let io = |source| CheckpointError::Io {
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let cfg = &self.state.model;
        write_safetensors(
            &dir.join("model.safetensors"),
            gpt2_entries(cfg, &self.params, ""),
            None,
        )?;
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
        write_safetensors(&dir.join("optimizer.safetensors"), opt, None)?;
        let state = serde_json::to_string_pretty(&self.state).expect("state serializes");
        std::fs::write(dir.join("state.json"), state).map_err(io)
    }

    /// Read a checkpoint directory, checking every tensor's size.
    pub fn load(dir: &Path) -> Result<Self, CheckpointError> {
        let state_path = dir.join("state.json");
        let state: TrainState =
            serde_json::from_slice(&read(&state_path)?).map_err(|e| CheckpointError::Format {
                path: state_path.display().to_string(),
                message: e.to_string(),
            })?;
        let cfg = &state.model;
        let mpath = dir.join("model.safetensors");
        let mbytes = read(&mpath)?;
        let st = SafeTensors::deserialize(&mbytes).map_err(|e| CheckpointError::Format {
            path: mpath.display().to_string(),
            message: e.to_string(),
        })?;
        let opath = dir.join("optimizer.safetensors");
        let obytes = read(&opath)?;
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
