"""torch_llama.py: the PyTorch reference for the Llama example's speed and memory.

The model is the Llama example's (examples/llama/model.rs): RMSNorm, rotary
positions (rotate_half; Llama 3's frequency scaling at `1b`), grouped-query
attention (F.scaled_dot_product_attention with enable_gqa), the SwiGLU MLP,
no biases, N(0, 0.02) initialisation, with the same sizes. The head is tied
to the embedding by default, as Llama-3.2-1B; `--untied-head` gives the
example's parameter set (its head is trained apart). Timing, modes and the
JSON line are torch_gpt.py's (this script imports them):

  bf16          torch.autocast(bfloat16), eager, AdamW(foreach)
  bf16-compile  the same model under torch.compile

  python3 scripts/gpu/torch_llama.py --size 1b --vocab 128256 --batch 8 --seq 2048 --modes bf16,bf16-compile
"""
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402  (timing, runner and parser shared)

# name: (layers, heads, kv heads, width, inner width), as SIZES in examples/llama/model.rs
SIZES = {
    "tiny": (4, 4, 2, 128, 352),
    "150m": (12, 12, 4, 768, 2048),
    "1b": (16, 32, 8, 2048, 8192),
}


def rope_tables(seq, hd, llama32, device):
    """cos, sin [seq, hd] (each half repeated), Llama 3 scaling at 1b."""
    theta = 500000.0 if llama32 else 10000.0
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    if llama32:
        factor, low, high, orig = 32.0, 1.0, 4.0, 8192
        wavelen = 2 * math.pi / inv
        smooth = (orig / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        mid = (wavelen <= orig / low) & (wavelen >= orig / high)
        scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        inv = scaled
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    r = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + r * sin


class Block(nn.Module):
    def __init__(self, width, heads, kv_heads, inner):
        super().__init__()
        self.heads, self.kv = heads, kv_heads
        hd = width // heads
        self.attn_norm = nn.RMSNorm(width, eps=1e-5)
        self.q = nn.Linear(width, heads * hd, bias=False)
        self.k = nn.Linear(width, kv_heads * hd, bias=False)
        self.v = nn.Linear(width, kv_heads * hd, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.mlp_norm = nn.RMSNorm(width, eps=1e-5)
        self.gate = nn.Linear(width, inner, bias=False)
        self.up = nn.Linear(width, inner, bias=False)
        self.down = nn.Linear(inner, width, bias=False)

    def forward(self, h, cos, sin):
        b, t, d = h.shape
        x = self.attn_norm(h)
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, -1).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, -1).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + self.o(a.transpose(1, 2).reshape(b, t, d))
        x = self.mlp_norm(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class Llama(nn.Module):
    def __init__(self, size, vocab, seq, untied_head=False, checkpoint=False):
        super().__init__()
        layers, heads, kv, width, inner = SIZES[size]
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads, kv, inner) for _ in range(layers))
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab, bias=False)
        if not untied_head:
            self.head.weight = self.embed.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
        cos, sin = rope_tables(seq, width // heads, size == "1b", "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        h = self.embed(tokens)
        for block in self.blocks:
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(block, h, cos, sin, use_reentrant=False)
            else:
                h = block(h, cos, sin)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def build(args):
    return Llama(args.size, args.vocab, args.seq, args.untied_head, args.checkpoint)


def main():
    p = torch_gpt.parser()
    for a in p._actions:
        if a.dest == "size":
            a.choices, a.default = list(SIZES), "1b"
        if a.dest == "modes":
            a.default = "bf16,bf16-compile"
    args = p.parse_args()
    torch_gpt.build = build
    torch_gpt.SIZES = SIZES
    for mode in args.modes.split(","):
        try:
            line = torch_gpt.run(mode, args)
            line["model"] = "llama"
        except Exception as e:  # report it and go on with the next mode
            line = {"mode": mode, "size": args.size, "error": repr(e)[:400]}
        print(torch_gpt.json.dumps(line), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
