"""Hugging Face's side of the interop test (host/tests/hf.rs).

  interop.py loss DIR DUMP [auto]
                             the loss of transformers' model of DIR on the
                             batch of a Piper step-1 dump (inputs, targets):
                             the mean token cross-entropy, as Piper's; in
                             fp32, or with `auto` in the dtype config.json
                             names (bf16 computes in bf16, as eager PyTorch)
  interop.py save CONFIG_DIR OUT [bfloat16]
                             a randomly initialised transformers model of
                             CONFIG_DIR's config.json, saved by
                             save_pretrained into OUT in several shards
                             (in fp32, or bf16 with `bfloat16`)
Prints one JSON object.
"""
import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM


def loss(model_dir, dump, dtype="float32"):
    d = load_file(dump)
    dtype = "auto" if dtype == "auto" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=d["inputs"].long()).logits
    v = logits.shape[-1]
    value = F.cross_entropy(
        logits.float().reshape(-1, v), d["targets"].reshape(-1).long()
    )
    return {
        "loss": value.item(),
        "class": type(model).__name__,
        "dtype": str(model.dtype),
    }


def save(config_dir, out, dtype="float32"):
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, max_shard_size="200KB")
    return {"class": type(model).__name__}


if __name__ == "__main__":
    what = sys.argv[1]
    result = loss(*sys.argv[2:5]) if what == "loss" else save(*sys.argv[2:5])
    print(json.dumps(result))
