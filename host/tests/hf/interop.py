"""Hugging Face's side of the interop test (host/tests/hf.rs).

  interop.py loss DIR DUMP   the loss of transformers' model of DIR on the
                             batch of a Piper step-1 dump (inputs, targets):
                             the mean token cross-entropy, as Piper's
  interop.py save CONFIG_DIR OUT
                             a randomly initialised transformers model of
                             CONFIG_DIR's config.json, saved by
                             save_pretrained into OUT in several shards
Prints one JSON object.
"""
import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM


def loss(model_dir, dump):
    d = load_file(dump)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=d["inputs"].long()).logits
    v = logits.shape[-1]
    value = F.cross_entropy(logits.reshape(-1, v), d["targets"].reshape(-1).long())
    return {"loss": value.item(), "class": type(model).__name__}


def save(config_dir, out):
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="200KB")
    return {"class": type(model).__name__}


if __name__ == "__main__":
    what = sys.argv[1]
    result = loss(*sys.argv[2:4]) if what == "loss" else save(*sys.argv[2:4])
    print(json.dumps(result))
