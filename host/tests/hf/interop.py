"""Hugging Face's side of the interop test (host/tests/it/hf.rs).

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
  interop.py autocast DUMP HEADS
                             the step-1 loss of the GPT-2 of a Piper dump
                             under PyTorch's bf16 autocast (fp32 weights), by
                             benches/reference/torch_gpt.py's model
Prints one JSON object.

  interop.py serve           the same commands, one JSON list of arguments a
                             line on stdin, one JSON object a line on stdout
                             ({"error": ...} when one fails), until stdin
                             closes: the tests import torch and transformers
                             once for all their questions.
"""
import json
import os
import sys
import traceback

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


def autocast(dump, heads):
    reference = os.path.join(os.path.dirname(__file__), "../../../benches/reference")
    sys.path.insert(0, os.path.abspath(reference))
    import torch_gpt

    return torch_gpt.step1_loss(dump, int(heads), "bf16")


def ping():
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


COMMANDS = {"loss": loss, "save": save, "autocast": autocast, "ping": ping}


def serve():
    for line in sys.stdin:
        args = json.loads(line)
        try:
            result = COMMANDS[args[0]](*args[1:])
        except Exception:
            result = {"error": traceback.format_exc()}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        print(json.dumps(COMMANDS[sys.argv[1]](*sys.argv[2:])))
