//! Files on disk, below checkpoints (`checkpoint.rs`) and transformers'
//! interop (`hf.rs`): atomic writes (a temporary name unique to the writer,
//! fsync, rename), directory syncs, and safetensors files of named f32
//! tensors in Hugging Face's GPT-2 names and layout.

use crate::home::sha256_hex;
use crate::model::params::ParamTable;
use crate::model::ModelConfig;
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

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
pub(super) fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
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
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", writer_tag()));
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

/// `PID.N`: this process and a count, so two writers (two processes, two
/// threads) never share a temporary name.
fn writer_tag() -> String {
    writer_tag_of(std::process::id())
}

pub(super) fn writer_tag_of(pid: u32) -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{pid}.{n}")
}

/// Has the process `pid` that left a leftover ended? This process's own
/// are live (another thread may be writing them); without `/proc` every
/// other process's are taken as ended.
pub(super) fn writer_gone(pid: u32) -> bool {
    let proc = Path::new("/proc");
    pid != std::process::id() && (!proc.is_dir() || !proc.join(pid.to_string()).exists())
}

/// fsync a directory, so the renames inside it survive a crash.
pub(super) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
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

pub(super) fn bytes_of(v: &[f32]) -> Vec<u8> {
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
