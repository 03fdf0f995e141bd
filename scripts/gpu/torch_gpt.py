"""torch_gpt.py: the PyTorch reference for the GPT example's speed and memory.

Runs on the GPU machine, in the same device call as our runs (figures from
two machines are not comparable). The model is the GPT example's
(examples/gpt/model.rs): decoder-only, pre-LayerNorm, causal attention,
tanh GELU MLP, learned positions, no dropout, GPT-2 initialisation
(N(0, 0.02), biases 0), with the same sizes. By default its Linears have no
biases and the output head is tied to the token embedding (124M and 355M
parameters at 125m and 350m), which is what BENCHMARKS.md's PyTorch figures
were measured with; `--bias --untied-head` gives the example's exact
parameter set (163M and 406M). `--checkpoint` recomputes every block in
backward (torch.utils.checkpoint, non-reentrant), as the example's
`--recompute full`.

Modes (`--modes`, comma-separated), each timed the same way:
  bf16          torch.autocast(bfloat16), eager, AdamW(foreach)
  bf16-compile  the same model under torch.compile
  fp8-torchao   torchao's convert_to_float8_training (tensorwise scaling),
                under torch.compile; the head stays in BF16

One training step on one fixed random batch, `--warmup` untimed steps, then
`--steps` timed ones, each between two device synchronizations. For each
mode one JSON line: tokens/s over the median step, the median step, the
peak allocated memory (torch.cuda.max_memory_allocated, reset before the
first step) and the memory still allocated after the last step (weights,
gradients, AdamW state: "persistent"). A mode that fails prints a line
with "error" and the others still run.

  python3 scripts/gpu/torch_gpt.py --size 350m --modes bf16,bf16-compile,fp8-torchao
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# name: (layers, heads, width), as SIZES in examples/gpt/model.rs
SIZES = {
    "tiny": (4, 4, 128),
    "125m": (12, 12, 768),
    "350m": (24, 16, 1024),
    "760m": (24, 16, 1536),
    "1.3b": (24, 32, 2048),
    "2.7b": (32, 32, 2560),
    "6.7b": (32, 32, 4096),
    "13b": (40, 40, 5120),
}


class Block(nn.Module):
    """h + attn(ln_1(h)), then h + mlp(ln_2(h))."""

    def __init__(self, width, heads, bias):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width, bias=bias)
        self.c_proj = nn.Linear(width, width, bias=bias)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width, bias=bias)
        self.mlp_proj = nn.Linear(4 * width, width, bias=bias)

    def forward(self, h):
        b, t, d = h.shape
        split = self.c_attn(self.ln_1(h)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in split)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.c_proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))


class GPT(nn.Module):
    """Token and position embeddings, the blocks, ln_f, the output head;
    forward returns the mean cross-entropy (in F32) against `targets`."""

    def __init__(self, layers, heads, width, vocab, seq, bias=False, untied_head=False, checkpoint=False):
        super().__init__()
        self.checkpoint = checkpoint
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads, bias) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if not untied_head:
            self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens, targets):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def build(args):
    layers, heads, width = SIZES[args.size]
    return GPT(layers, heads, width, args.vocab, args.seq, args.bias, args.untied_head, args.checkpoint)


def timed_steps(step, warmup, steps):
    """Runs `step` warmup + steps times, each between two synchronizations;
    returns the timed steps' seconds and their losses."""
    times, losses = [], []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    return times, losses


def run(mode, args):
    torch.manual_seed(0)
    model = build(args).cuda()
    params = sum(p.numel() for p in model.parameters())
    if mode == "fp8-torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn != "head")
    elif mode not in ("bf16", "bf16-compile"):
        raise ValueError(f"unknown mode {mode}")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    forward = model if mode == "bf16" else torch.compile(model)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    y = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    torch.cuda.reset_peak_memory_stats()
    times, losses = timed_steps(step, args.warmup, args.steps)
    persistent = torch.cuda.memory_allocated()
    median = statistics.median(times)
    return {
        "mode": mode, "size": args.size, "params": params, "batch": args.batch,
        "checkpoint": args.checkpoint,
        "seq": args.seq, "tokens_per_s": args.batch * args.seq / median,
        "step_ms": median * 1e3, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "persistent_gib": persistent / 2**30,
        "persistent_bytes_per_param": persistent / params,
        "last_loss": losses[-1], "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


def parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="350m", choices=SIZES)
    p.add_argument("--checkpoint", action="store_true", help="recompute every block in backward")
    p.add_argument("--modes", default="bf16,bf16-compile,fp8-torchao")
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bias", action="store_true", help="biases in the blocks' Linears, as ours")
    p.add_argument("--untied-head", action="store_true", help="a head of its own, as ours")
    return p


def main():
    args = parser().parse_args()
    for mode in args.modes.split(","):
        try:
            line = run(mode, args)
        except Exception as e:  # report it and go on with the next mode
            line = {"mode": mode, "size": args.size, "error": repr(e)[:400]}
        print(json.dumps(line), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
