#!/usr/bin/env python3
"""check_hf_gpt2.py GPT_BIN WORKDIR: the GPT example against Hugging Face's
`transformers` both ways (needs torch and transformers):

1. transformers writes a small random GPT-2 (`save_pretrained`, tied
   embeddings, 300 tokens, 2 blocks) to WORKDIR/hf-in;
2. the example starts from it (`--init-from`), takes one step at a
   learning rate of 1e-12 (the weights do not move) and exports
   WORKDIR/hf-out (`--export`);
3. transformers loads WORKDIR/hf-out and its logits must equal the
   original model's (max abs difference printed; fails above 1e-4).
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

bin_, work = sys.argv[1], Path(sys.argv[2])
work.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(cfg).eval()
with torch.no_grad():  # not the initialiser's zeros and ones: every value counts
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
model.save_pretrained(work / "hf-in")
out = subprocess.run([bin_, "--init-from", str(work / "hf-in"), "--export", str(work / "hf-out"),
                      "--steps", "1", "--lr", "1e-12", "--batch", "2", "--seq", "32", "--json"],
                     capture_output=True, text=True)
if out.returncode != 0:
    sys.exit(f"the example failed: {out.stderr}")
summary = json.loads(out.stdout.strip().splitlines()[-1])
assert summary["size"].startswith("hf:"), summary["size"]
print("example:", summary["size"], summary["val_loss"])
back = GPT2LMHeadModel.from_pretrained(work / "hf-out").eval()
tokens = torch.randint(0, 300, (2, 40))
with torch.no_grad():
    a = model(tokens).logits
    b = back(tokens).logits
diff = (a - b).abs().max().item()
print(f"logits: max abs difference {diff:.3g} (scale {a.abs().max().item():.3g})")
sys.exit(0 if diff <= 1e-4 else 1)
