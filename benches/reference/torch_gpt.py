"""PyTorch reference for `cargo bench -p piper --bench train` (CPU) and
`scripts/gpu-check.sh` (GPU).

The same model and step as Piper's runtime: GPT-2 blocks (pre-LayerNorm,
causal attention with a packed qkv projection, tanh-GELU MLP of 4x width,
biases everywhere), learned position embeddings, the head tied to the token
embedding; or with `--family llama` Llama blocks (RMSNorm, rotary positions
in the rotate-half convention, grouped-query attention over `--kv-heads`,
Qwen3's per-head q/k RMSNorm with `--qk-norm`, a SwiGLU MLP of
`--intermediate`, no biases) and an untied head. Cross-entropy over the
batch, AdamW (beta 0.9 / 0.95, eps 1e-8, weight decay 0.1 on matrices and
embeddings), gradient clipping at 1.0.
fp32 by default (TF32 off); `--precision bf16` autocasts to bf16 with fp32
master weights. On the CPU (`--threads`) or a GPU (`--device cuda`, fused
AdamW), eager or `--compile` (torch.compile). Prints one JSON line: tokens/s
of the best step (GPU: the median of the timed steps), the threads used,
the peak GPU memory.

With `--weights DUMP` (a GPT-2 model's `piper train --dump-step1` file) it
loads Piper's weights and batch instead, runs one forward (bf16 autocast with
`--precision bf16`) and prints the step-1 loss: Piper's numerics against
PyTorch's mixed precision on the same inputs (`host/tests/it/hf.rs`).

    python3 benches/reference/torch_gpt.py --layers 6 --d-model 384 --heads 6 \
        --seq 256 --batch 8 --vocab 256 --steps 3 --threads 2
    python3 benches/reference/torch_gpt.py --layers 12 --d-model 768 --heads 12 \
        --seq 1024 --batch 8 --vocab 50257 --steps 10 --device cuda --compile
"""

import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        hs = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, hs).transpose(1, 2)
        k = k.view(b, t, self.heads, hs).transpose(1, 2)
        v = v.view(b, t, self.heads, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, d, heads, kv_heads, hidden, qk_norm, eps):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1 = RMSNorm(d, eps)
        self.q = nn.Linear(d, heads * self.hd, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, d, bias=False)
        self.q_norm = RMSNorm(self.hd, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.hd, eps) if qk_norm else None
        self.norm2 = RMSNorm(d, eps)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.hd)
        k = self.k(h).view(b, t, self.kv_heads, self.hd)
        v = self.v(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, self.heads * self.hd)
        x = x + self.o(y)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers, d, heads, kv_heads, hidden, qk_norm, seq, vocab, theta=10000.0):
        super().__init__()
        eps = 1e-6
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            LlamaBlock(d, heads, kv_heads, hidden, qk_norm, eps) for _ in range(layers))
        self.norm = RMSNorm(d, eps)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class GPT(nn.Module):
    def __init__(self, layers, d, heads, seq, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        # GPT-2's initialisation, as Piper's: N(0, 0.02) weights, zero biases.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def step1_loss(path, heads, precision):
    """The loss of the GPT of a Piper step-1 dump on its batch."""
    from safetensors.torch import load_file

    d = load_file(path)
    w = {k[len("param."):]: v for k, v in d.items() if k.startswith("param.")}
    vocab, dm = w["wte.weight"].shape
    layers = sum(1 for k in w if k.endswith(".ln_1.weight"))
    model = GPT(layers, dm, heads, w["wpe.weight"].shape[0], vocab)
    # GPT-2's Conv1D weights are (in, out); nn.Linear's are (out, in).
    names = {"qkv": "attn.c_attn", "proj": "attn.c_proj", "fc": "mlp.c_fc",
             "fc_proj": "mlp.c_proj", "ln1": "ln_1", "ln2": "ln_2"}
    state = {"wte.weight": w["wte.weight"], "wpe.weight": w["wpe.weight"],
             "ln_f.weight": w["ln_f.weight"], "ln_f.bias": w["ln_f.bias"]}
    for i in range(layers):
        for ours, theirs in names.items():
            for part in ("weight", "bias"):
                t = w[f"h.{i}.{theirs}.{part}"]
                linear = part == "weight" and not ours.startswith("ln")
                state[f"blocks.{i}.{ours}.{part}"] = t.t() if linear else t
    model.load_state_dict(state)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                         enabled=precision == "bf16"):
        loss = model(d["inputs"].long(), d["targets"].long())
    return {"loss": loss.item(), "precision": precision, "torch": torch.__version__}


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 6), ("d-model", 384), ("heads", 6), ("seq", 256),
                          ("batch", 8), ("vocab", 256), ("steps", 3), ("threads", 0)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--family", default="gpt2", choices=["gpt2", "llama"])
    p.add_argument("--kv-heads", type=int, default=0)
    p.add_argument("--intermediate", type=int, default=0)
    p.add_argument("--qk-norm", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--compile", action="store_true")
    p.add_argument("--weights", help="a Piper --dump-step1 file (GPT-2): its step-1 loss")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    if a.weights:
        print(json.dumps(step1_loss(a.weights, a.heads, a.precision)))
        return
    cuda = a.device.startswith("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(1337)
    if a.family == "llama":
        model = Llama(a.layers, a.d_model, a.heads, a.kv_heads or a.heads, a.intermediate,
                      a.qk_norm, a.seq, a.vocab).to(a.device)
    else:
        model = GPT(a.layers, a.d_model, a.heads, a.seq, a.vocab).to(a.device)
    decay = [q for n, q in model.named_parameters() if q.dim() >= 2]
    no_decay = [q for n, q in model.named_parameters() if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if cuda else {"foreach": False}))
    run = torch.compile(model) if a.compile else model
    g = torch.Generator().manual_seed(0)
    times = []
    for step in range(a.steps + 1):
        idx = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(a.device)
        tgt = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(a.device)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16,
                            enabled=a.precision == "bf16"):
            loss = run(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - start
        if step > 0:  # the first step warms up (and compiles)
            times.append(secs)
    times.sort()
    step_s = times[len(times) // 2] if cuda else times[0]
    print(json.dumps({
        "tokens_per_s": a.batch * a.seq / step_s,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": a.device,
        "precision": a.precision,
        "compile": a.compile,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "loss": loss.item(),
    }))


if __name__ == "__main__":
    main()
