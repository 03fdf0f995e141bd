"""summary.py GPT_JSONL TORCH_LOG: one line per run of run-gpt.sh's JSON
lines and of torch_gpt.py's, as BENCHMARKS.md quotes them. torch_gpt.py's
tok/s is over the median step: compare ours' tok/s(median) with it."""
import json
import sys

for line in open(sys.argv[1]):
    j = json.loads(line)
    print(j["size"], j["level"], j["compute"], j.get("activations", "F32"), "tok/s %.0f" % j["tokens_per_s"],
          "tok/s(median) %.0f" % j.get("tokens_per_s_median", float("nan")),
          "step %.1f" % j["step_ms_median"], "max %.1f" % j.get("step_ms_max", float("nan")),
          "fwd %.1f" % j["forward_ms_median"],
          "peak %.2f GiB" % (j["peak_device_bytes"] / 2**30),
          "pers %.3f GB" % (j["persistent_bytes"]["total"] / 1e9),
          "B/lp %.3f" % j["bytes_per_linear_param"],
          "loss %.4f val %.4f" % (j["final_loss"], j["val_loss"]),
          "mfu %.3f" % (j.get("mfu") or float("nan")))
for line in open(sys.argv[2]):
    if line.startswith('{"mode"'):
        j = json.loads(line)
        if "tokens_per_s" not in j:
            print("torch", j.get("size"), j.get("mode"), "no result:", j.get("error", j))
            continue
        print("torch", j["size"], j["mode"], "tok/s %.0f" % j["tokens_per_s"],
              "step %.1f" % j["step_ms"], "peak %.2f GiB" % j["peak_gib"])
