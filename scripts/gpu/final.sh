set -uo pipefail
C=.carry/gpu
source $C/device-env.sh
gzip -dc $C/cuda_check.gz > /tmp/cuda_check && chmod +x /tmp/cuda_check
timeout 150 /tmp/cuda_check --skip-exhaustive --watchdog 140 > $OUT/check.log 2>&1; echo "cuda_check rc=$?"
grep -A12 "== summary" $OUT/check.log | tr '\n' ' '; echo
grep "causal_attention_qkv\|FAIL" $OUT/check.log | head -5
RUNS="O0:native O0:fp8-delayed O1:fp8-current O2:fp8-current O3:fp8-current"
NO_CHECK=1 STEPS=8 SKIP=3 TORCH_MODES=bf16 OUT=/tmp/a bash $C/run-gpt.sh $C 125m "$RUNS" > /tmp/a.log 2>&1
NO_CHECK=1 STEPS=8 SKIP=3 TORCH_MODES=bf16,bf16-compile,fp8-torchao OUT=/tmp/b bash $C/run-gpt.sh $C 350m "$RUNS" > /tmp/b.log 2>&1
cp /tmp/a/gpt.log $OUT/gpt-125m.log; cp /tmp/b/gpt.log $OUT/gpt-350m.log
cat /tmp/a/torch_gpt.log > $OUT/torch.log; cat /tmp/b/torch_gpt.log >> $OUT/torch.log; cp /tmp/a/facts.log $OUT/facts.log
python3 - <<'PY' | tee /tmp/summary.txt
import json
for f in ["/tmp/a/gpt.jsonl","/tmp/b/gpt.jsonl"]:
    for l in open(f):
        j=json.loads(l); print(j["size"], j["level"], j["compute"], "tok/s %.0f"%j["tokens_per_s"], "step %.1f"%j["step_ms_median"], "fwd %.1f"%j["forward_ms_median"], "peak %.2f GiB"%(j["peak_device_bytes"]/2**30), "pers %.3f GB"%(j["persistent_bytes"]["total"]/1e9), "B/lp %.3f"%j["bytes_per_linear_param"], "loss %.4f val %.4f"%(j["final_loss"], j["val_loss"]))
PY
cp /tmp/summary.txt $OUT/summary.txt
grep -h '^{"mode"' /tmp/a/torch_gpt.log /tmp/b/torch_gpt.log | python3 -c "
import json,sys
for l in sys.stdin:
    j=json.loads(l); print('torch', j['size'], j['mode'], 'tok/s %.0f'%j['tokens_per_s'], 'step %.1f'%j['step_ms'], 'peak %.2f GiB'%j['peak_gib'])
"
grep -v '^{' /tmp/a/torch_gpt.log /tmp/b/torch_gpt.log | tail -4
grep -B3 "rc=[1-9]" /tmp/a/gpt.log /tmp/b/gpt.log | grep -v "^.*: *[0-9]*: " | head -12
