#!/usr/bin/env bash
# multi-gpu.sh [CARRY_DIR]: issue 9's GPU measurements on `nvidia-h200-x2`
# in one call, most important first, each step under `timeout` with its log
# in $OUT (a call cut short still returns what is done):
#   1. nccl_check --bench on 2 GPUs under torchrun (every collective, the
#      FP8 all-reduce against the CPU, 256 MiB of F32 gradients: F32 vs FP8);
#   2. the same checks launched by a shell loop that sets the variables;
#   3. GPT 350M O2 (BF16 activations) on 2 GPUs under torchrun, then on 1;
#   4. the same at O3 (ZeRO) on 2 GPUs.
# CARRY_DIR holds gpt.gz and nccl_check.gz built with `--features nccl`,
# and device-env.sh. NVLink multicast stays off (KINDS.md).
set -uo pipefail
C=${1:-.carry/nccl}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source "$C/device-env.sh"
for b in gpt nccl_check; do gzip -dc "$C/$b.gz" > "/tmp/$b" && chmod +x "/tmp/$b"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/facts.log"
TORCHRUN=$(command -v torchrun || echo "python3 -m torch.distributed.run")
summ() { grep -c " PASS " "$1" | sed 's/^/PASS lines: /'; grep -E " FAIL |BENCH|rror" "$1" | head -12; }
echo "== 1. nccl_check --bench, torchrun"
timeout 120 $TORCHRUN --no-python --nproc-per-node 2 --master-port 29500 /tmp/nccl_check --bench \
  > "$OUT/nccl_torchrun.log" 2>&1; echo "rc=$?"; summ "$OUT/nccl_torchrun.log"
echo "== 2. nccl_check, shell loop"
for r in 0 1; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29600 \
    timeout 90 /tmp/nccl_check > "$OUT/nccl_loop_$r.log" 2>&1 &
done; wait; summ "$OUT/nccl_loop_0.log"; summ "$OUT/nccl_loop_1.log"
gptargs="--device cuda --size 350m --vocab 50304 --batch 8 --seq 1024 --steps ${STEPS:-10} --timing-skip ${SKIP:-3} --eval-every 1000 --compute fp8-current --activations bf16 --json"
show() { grep '^{' "$1" | python3 -c "
import json, sys
for l in sys.stdin:
    j = json.loads(l)
    print('$2', 'tok/s(median) %.0f' % j['tokens_per_s_median'], 'step %.1f ms' % j['step_ms_median'],
          'peak %.2f GiB' % (j['peak_device_bytes'] / 2**30), 'pers %.3f GB' % (j['persistent_bytes']['total'] / 1e9),
          'B/lp %.3f' % j['bytes_per_linear_param'], 'world', j.get('world_size'), 'val %.4f' % j['val_loss'])"; }
for lv in O2 O3; do
  echo "== 3. gpt 350m $lv, 2 GPUs, torchrun"
  timeout 150 $TORCHRUN --no-python --nproc-per-node 2 --master-port 29700 /tmp/gpt $gptargs --level $lv \
    > "$OUT/gpt_${lv}_2.log" 2>&1; echo "rc=$?"; show "$OUT/gpt_${lv}_2.log" "$lv x2"; grep -iE "error" "$OUT/gpt_${lv}_2.log" | head -3
  echo "== gpt 350m $lv, 1 GPU"
  timeout 100 /tmp/gpt $gptargs --level $lv > "$OUT/gpt_${lv}_1.log" 2>&1; echo "rc=$?"; show "$OUT/gpt_${lv}_1.log" "$lv x1"
done
