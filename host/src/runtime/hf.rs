//! Hugging Face's formats at the checkpoint edge. A checkpoint directory
//! also holds `config.json` and `generation_config.json` in transformers'
//! names for its family (`GPT2LMHeadModel`; `LlamaForCausalLM`, or
//! `Qwen3ForCausalLM` with q/k norms; none for models with experts), so
//! `from_pretrained(dir)` opens it;
//! and [`load_weights`] reads a directory transformers wrote
//! (`model.safetensors`, or the shards `model.safetensors.index.json`
//! lists) into Piper's parameters by name, refusing a missing, surplus or
//! misshapen tensor by name. `piper train --init-from DIR` starts from it.
//!
//! Everything read is hostile until checked: the index is bounded in size,
//! its shard names are plain file names in the directory, each tensor's
//! dtype and shape are checked before its bytes are converted, and
//! `config.json`'s sizes must be the run's model's.

use super::files::{hf_name, transpose, write_atomic, CheckpointError, NamedTensors};
use crate::model::params::{ParamTable, Role};
use crate::model::{Family, ModelConfig};
use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The largest `config.json` or index read (a real index of a 400B model
/// is a few hundred KiB).
const MAX_JSON_BYTES: u64 = 16 << 20;

fn format_error(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Format {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// The dtype transformers loads the model in (`dtype`, and `torch_dtype` as
/// transformers 4 names it): the one its parameters trained in. The weights
/// file keeps the fp32 master weights either way (a resume continues
/// exactly); transformers rounds them on load, to the values Piper's
/// kernels read.
fn torch_dtype(cfg: &ModelConfig) -> &'static str {
    match cfg.precision.params {
        crate::model::Dtype::F32 => "float32",
        crate::model::Dtype::Bf16 => "bfloat16",
    }
}

/// transformers' `config.json` for `cfg` (`None` for a model with experts:
/// transformers' mixture-of-experts classes count the load-balancing loss
/// over the whole batch, not per sequence as Piper does, and their expert
/// layouts are not checked against Piper's).
pub fn config_json(cfg: &ModelConfig) -> Option<Value> {
    let a = cfg.arch();
    if cfg.moe.is_some() {
        return None;
    }
    match a.family {
        Family::Gpt2 => Some(json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.layers,
            "n_head": cfg.heads,
            "n_inner": null,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "initializer_range": 0.02,
            "scale_attn_weights": true,
            "tie_word_embeddings": true,
            "use_cache": true,
            "dtype": torch_dtype(cfg),
            "torch_dtype": torch_dtype(cfg),
        })),
        Family::Llama => {
            let mut c = json!({
                "vocab_size": cfg.vocab,
                "hidden_size": cfg.d_model,
                "intermediate_size": a.hidden,
                "num_hidden_layers": cfg.layers,
                "num_attention_heads": a.heads,
                "num_key_value_heads": a.kv_heads,
                "head_dim": a.head_dim,
                "hidden_act": "silu",
                "max_position_embeddings": cfg.seq_len,
                "rms_norm_eps": a.norm_eps as f64,
                "rope_theta": a.rope_theta,
                "rope_parameters": { "rope_type": "default", "rope_theta": a.rope_theta },
                "tie_word_embeddings": a.tied,
                "attention_bias": false,
                "attention_dropout": 0.0,
                "initializer_range": 0.02,
                "use_cache": true,
                "dtype": torch_dtype(cfg),
                "torch_dtype": torch_dtype(cfg),
            });
            let o = c.as_object_mut().expect("an object");
            let (arch, kind) = if a.qk_norm {
                ("Qwen3ForCausalLM", "qwen3")
            } else {
                o.insert("mlp_bias".into(), json!(false));
                ("LlamaForCausalLM", "llama")
            };
            if kind != "llama" {
                o.insert("use_sliding_window".into(), json!(false));
                o.insert("sliding_window".into(), Value::Null);
                o.insert("max_window_layers".into(), json!(cfg.layers));
                o.insert(
                    "layer_types".into(),
                    json!(vec!["full_attention"; cfg.layers as usize]),
                );
            }
            o.insert("architectures".into(), json!([arch]));
            o.insert("model_type".into(), json!(kind));
            Some(c)
        }
    }
}

/// `generation_config.json`, as `save_pretrained` writes one beside a
/// causal language model (Piper's vocabularies have no special tokens but
/// GPT-2's end of text).
pub fn generation_config_json(cfg: &ModelConfig) -> Value {
    if cfg.vocab == 50257 && cfg.family == Family::Gpt2 {
        json!({ "_from_model_config": true, "bos_token_id": 50256, "eos_token_id": 50256 })
    } else {
        json!({ "_from_model_config": true })
    }
}

/// Write both configs into a checkpoint directory (nothing for a model
/// transformers has no class for).
pub fn write_configs(dir: &Path, cfg: &ModelConfig) -> Result<(), CheckpointError> {
    let Some(config) = config_json(cfg) else {
        return Ok(());
    };
    let text = serde_json::to_string_pretty(&config).expect("json serializes");
    write_atomic(&dir.join("config.json"), text.as_bytes())?;
    let text = serde_json::to_string_pretty(&generation_config_json(cfg)).expect("json serializes");
    write_atomic(&dir.join("generation_config.json"), text.as_bytes())
}

fn read_json(path: &Path) -> Result<Value, CheckpointError> {
    let len = std::fs::metadata(path)
        .map_err(|source| CheckpointError::Io {
            path: path.display().to_string(),
            source,
        })?
        .len();
    if len > MAX_JSON_BYTES {
        return Err(format_error(
            path,
            format!("is {len} bytes; more than {MAX_JSON_BYTES} is not read"),
        ));
    }
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| format_error(path, e.to_string()))
}

/// `dir/config.json`, when there is one, describes `cfg`: each size it
/// states must be the model's (a mismatch names the key and both values).
pub fn check_config(dir: &Path, cfg: &ModelConfig) -> Result<(), CheckpointError> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Ok(());
    }
    let got = read_json(&path)?;
    let Some(want) = config_json(cfg) else {
        return Ok(());
    };
    let keys: &[&str] = match cfg.family {
        Family::Gpt2 => &["model_type", "vocab_size", "n_embd", "n_layer", "n_head"],
        Family::Llama => &[
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "tie_word_embeddings",
        ],
    };
    for key in keys {
        let (g, w) = (&got[*key], &want[*key]);
        // transformers leaves some keys out at their defaults.
        let defaulted = g.is_null()
            && match *key {
                "num_key_value_heads" => want["num_key_value_heads"] == want["num_attention_heads"],
                "head_dim" => {
                    want["head_dim"].as_u64() == Some(cfg.d_model as u64 / cfg.heads.max(1) as u64)
                }
                "tie_word_embeddings" => true,
                _ => false,
            };
        let same = g == w || (g.as_f64().is_some() && g.as_f64() == w.as_f64());
        if !same && !defaulted {
            return Err(format_error(
                &path,
                format!(
                    "`{key}` is {g}, the model `{}` has {w}: give the --model that describes this checkpoint",
                    cfg.name
                ),
            ));
        }
    }
    if cfg.family == Family::Llama {
        let qk = matches!(
            got["model_type"].as_str(),
            Some("qwen3") | Some("qwen3_moe")
        );
        if got["model_type"].is_string() && qk != cfg.arch().qk_norm {
            return Err(format_error(
                &path,
                format!(
                    "`model_type` is {}, the model `{}` has qk_norm = {}",
                    got["model_type"],
                    cfg.name,
                    cfg.arch().qk_norm
                ),
            ));
        }
    }
    Ok(())
}

/// The safetensors files of an HF directory: `model.safetensors`, or the
/// shards its index lists, with the tensor names each holds per the index.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(format_error(
            dir,
            "has neither model.safetensors nor model.safetensors.index.json (a Piper checkpoint's step directory, or a directory transformers' save_pretrained wrote)",
        ));
    }
    let v = read_json(&index)?;
    let map = v["weight_map"]
        .as_object()
        .ok_or_else(|| format_error(&index, "has no `weight_map` object"))?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            format_error(&index, format!("`weight_map.{name}` is not a file name"))
        })?;
        let plain = !file.is_empty()
            && !file.contains(['/', '\\'])
            && file != "."
            && file != ".."
            && file.ends_with(".safetensors");
        if !plain {
            return Err(format_error(
                &index,
                format!("`weight_map.{name}` names {file:?}: a shard must be a .safetensors file in the directory itself"),
            ));
        }
        files.insert(file.to_string());
    }
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

/// A tensor's values as f32 (F32, BF16 or F16 in the file).
fn values(
    path: &Path,
    name: &str,
    t: &safetensors::tensor::TensorView<'_>,
) -> Result<Vec<f32>, CheckpointError> {
    let d = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(format_error(
                path,
                format!("tensor `{name}` is {other:?}; Piper reads F32, BF16 and F16"),
            ))
        }
    })
}

/// Names a file may give Piper's parameter `name`.
fn file_names(cfg: &ModelConfig, name: &str) -> Vec<String> {
    match cfg.family {
        Family::Gpt2 => {
            let hf = hf_name(name);
            vec![format!("transformer.{hf}"), hf]
        }
        Family::Llama => vec![name.to_string()],
    }
}

/// Buffers transformers may store that are no parameters (GPT-2's causal
/// mask, old Llama files' rotary frequencies).
fn is_buffer(cfg: &ModelConfig, name: &str) -> bool {
    match cfg.family {
        Family::Gpt2 => name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias"),
        Family::Llama => name.ends_with("rotary_emb.inv_freq"),
    }
}

/// Read `cfg`'s parameters from an HF directory (or a Piper checkpoint's
/// step directory): every parameter present with its shape, nothing the
/// model lacks, a tied head's copy (if stored) equal to the embedding.
pub fn load_weights(dir: &Path, cfg: &ModelConfig) -> Result<NamedTensors, CheckpointError> {
    check_config(dir, cfg)?;
    let table = ParamTable::new(cfg);
    // File name -> Piper name, expected shape in the file, conv1d.
    let mut wanted: BTreeMap<String, (String, Vec<usize>, bool)> = BTreeMap::new();
    for &id in table.in_model_order() {
        let (name, entry) = (table.name(id), table.entry(id));
        let file_shape = if entry.is_conv1d() {
            vec![entry.shape[1], entry.shape[0]]
        } else {
            entry.shape.clone()
        };
        for f in file_names(cfg, name) {
            wanted.insert(f, (name.to_string(), file_shape.clone(), entry.is_conv1d()));
        }
    }
    let tied_copies = ["lm_head.weight"];
    let mut out = NamedTensors::new();
    let mut tied_head: Option<(PathBuf, Vec<f32>)> = None;
    for path in weight_files(dir)? {
        let file = std::fs::File::open(&path).map_err(|source| CheckpointError::Io {
            path: path.display().to_string(),
            source,
        })?;
        // SAFETY: the file is only read; one changed under us while it is
        // mapped gives wrong values, which the shape checks may not catch,
        // as reading it would.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| CheckpointError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let st = SafeTensors::deserialize(&map).map_err(|e| format_error(&path, e.to_string()))?;
        for (fname, view) in st.tensors() {
            let Some((name, shape, conv1d)) = wanted.get(&fname) else {
                if is_buffer(cfg, &fname) {
                    continue;
                }
                if tied_copies.contains(&fname.as_str()) && cfg.arch().tied {
                    let v = values(&path, &fname, &view)?;
                    tied_head = Some((path.clone(), v));
                    continue;
                }
                return Err(format_error(
                    &path,
                    format!(
                        "tensor `{fname}` is not a parameter of the model `{}` ({} family): is --model the checkpoint's architecture?",
                        cfg.name,
                        cfg.family.name()
                    ),
                ));
            };
            if view.shape() != shape.as_slice() {
                return Err(format_error(
                    &path,
                    format!(
                        "tensor `{fname}` has shape {:?}, the model `{}` needs {shape:?}",
                        view.shape(),
                        cfg.name
                    ),
                ));
            }
            let v = values(&path, &fname, &view)?;
            let v = if *conv1d {
                transpose(&v, shape[0], shape[1])
            } else {
                v
            };
            if out.insert(name.clone(), v).is_some() {
                return Err(format_error(
                    &path,
                    format!("tensor `{name}` is stored twice (as `{fname}` and another name)"),
                ));
            }
        }
    }
    if let Some(missing) = table
        .in_model_order()
        .iter()
        .map(|&id| table.name(id))
        .find(|n| !out.contains_key(*n))
    {
        return Err(format_error(
            dir,
            format!(
                "has no tensor `{}` (the model `{}` needs it): is --model the checkpoint's architecture?",
                file_names(cfg, missing)[0],
                cfg.name
            ),
        ));
    }
    if let Some((path, head)) = tied_head {
        let emb = table
            .in_model_order()
            .iter()
            .find(|&&id| {
                matches!(
                    table.entry(id).role,
                    Role::TokenEmbedding | Role::EmbedTokens
                )
            })
            .map(|&id| &out[table.name(id)]);
        if emb != Some(&head) {
            return Err(format_error(
                &path,
                format!(
                    "`lm_head.weight` differs from the token embedding, but the model `{}` ties them (tie_embeddings = false describes a head of its own)",
                    cfg.name
                ),
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::files::{gpt2_entries, write_safetensors};

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("piper-hf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn params(cfg: &ModelConfig) -> NamedTensors {
        let table = ParamTable::new(cfg);
        table
            .ids()
            .map(|id| {
                let n = table.entry(id).numel();
                let v = (0..n)
                    .map(|i| (i % 97) as f32 * 0.01 - id.index() as f32)
                    .collect();
                (table.name(id).to_string(), v)
            })
            .collect()
    }

    #[test]
    fn weights_round_trip_whole_or_sharded_and_mismatches_are_named() {
        for cfg in [ModelConfig::tiny(), ModelConfig::llama_tiny()] {
            let p = params(&cfg);
            // One file, as a Piper checkpoint writes it.
            let one = scratch(&format!("one-{}", cfg.name));
            write_safetensors(
                &one.join("model.safetensors"),
                gpt2_entries(&cfg, &p, ""),
                None,
            )
            .unwrap();
            write_configs(&one, &cfg).unwrap();
            assert_eq!(load_weights(&one, &cfg).unwrap(), p, "{}", cfg.name);
            // Shards with an index, names as transformers writes them.
            let sharded = scratch(&format!("shards-{}", cfg.name));
            let prefix = if cfg.family == Family::Gpt2 {
                "transformer."
            } else {
                ""
            };
            let entries = gpt2_entries(&cfg, &p, prefix);
            let half = entries.len() / 2;
            let mut map = serde_json::Map::new();
            for (i, chunk) in [&entries[..half], &entries[half..]].iter().enumerate() {
                let file = format!("model-0000{}-of-00002.safetensors", i + 1);
                for e in chunk.iter() {
                    map.insert(e.0.clone(), json!(file));
                }
                write_safetensors(&sharded.join(&file), chunk.to_vec(), None).unwrap();
            }
            let index = json!({ "metadata": {}, "weight_map": map });
            std::fs::write(
                sharded.join("model.safetensors.index.json"),
                index.to_string(),
            )
            .unwrap();
            assert_eq!(load_weights(&sharded, &cfg).unwrap(), p, "{}", cfg.name);
            // The other family's model refuses the files by name.
            let other = if cfg.family == Family::Gpt2 {
                ModelConfig::llama_tiny()
            } else {
                ModelConfig::tiny()
            };
            let e = load_weights(&sharded, &other).unwrap_err().to_string();
            assert!(e.contains("is not a parameter of the model"), "{e}");
            // A config.json of another shape is refused naming the key.
            let e = load_weights(
                &one,
                &ModelConfig {
                    layers: 4,
                    ..cfg.clone()
                },
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("config.json") && e.contains("layer"), "{e}");
            let _ = std::fs::remove_dir_all(&one);
            let _ = std::fs::remove_dir_all(&sharded);
        }
    }

    #[test]
    fn a_misshapen_missing_or_escaping_tensor_is_refused_by_name() {
        let cfg = ModelConfig::llama_tiny();
        let p = params(&cfg);
        let dir = scratch("bad");
        let mut entries = gpt2_entries(&cfg, &p, "");
        // A wrong shape.
        let q = entries
            .iter_mut()
            .find(|e| e.0 == "model.layers.3.self_attn.k_proj.weight")
            .unwrap();
        q.1 = vec![q.1[1], q.1[0]];
        write_safetensors(&dir.join("model.safetensors"), entries.clone(), None).unwrap();
        let e = load_weights(&dir, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("`model.layers.3.self_attn.k_proj.weight` has shape [64, 32]")
                && e.contains("needs [32, 64]"),
            "{e}"
        );
        // A missing one.
        entries.retain(|e| e.0 != "model.layers.3.self_attn.k_proj.weight");
        write_safetensors(&dir.join("model.safetensors"), entries, None).unwrap();
        let e = load_weights(&dir, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("has no tensor `model.layers.3.self_attn.k_proj.weight`"),
            "{e}"
        );
        // An index whose shard escapes the directory.
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            r#"{"weight_map": {"lm_head.weight": "../../etc/passwd"}}"#,
        )
        .unwrap();
        let e = load_weights(&dir, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("must be a .safetensors file in the directory itself"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn half_precision_values_convert_exactly() {
        use safetensors::tensor::TensorView;
        let read = |dtype, bits: &[u16]| {
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            let t = TensorView::new(dtype, vec![bits.len()], &bytes).unwrap();
            values(Path::new("w.safetensors"), "w", &t).unwrap()
        };
        let f16 = read(
            Dtype::F16,
            &[0x3c00, 0xc000, 0x0001, 0x7bff, 0x7c00, 0x7e00],
        );
        assert_eq!(f16[..4], [1.0, -2.0, 2f32.powi(-24), 65504.0]);
        assert!(f16[4].is_infinite() && f16[5].is_nan());
        let bf16 = read(Dtype::BF16, &[0x3f80, 0xc020, 0x0001, 0x7f80]);
        assert_eq!(bf16[..3], [1.0, -2.5, f32::from_bits(0x0001_0000)]);
        assert!(bf16[3].is_infinite());
    }
}
