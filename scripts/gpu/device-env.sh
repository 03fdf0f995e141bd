# device-env.sh: source on the GPU machine before running a binary built
# with scripts/gpu/build-cuda.sh:
#
#   source scripts/gpu/device-env.sh && ./gpt --device cuda ...
#
# Such a binary needs libcudart.so.13, libcublas.so.13, libcublasLt.so.13,
# libnvrtc.so.13 and libcurand.so.10 (with `nccl` also libnccl.so.2) from
# the CUDA 13.0.2 set build-cuda.sh links against, and libcuda.so.1 from the
# driver (already on the loader's path there). PyTorch for CUDA 13.0 brings
# the same files in its `nvidia` wheels; this finds them through the
# python3 on PATH (without importing torch) and puts them first on
# LD_LIBRARY_PATH, with a CUDA 13.0 toolkit's lib64 as a fallback.
# CANDLE_AMP_CUDA_LIBS (colon-separated folders) replaces the search.
_amp_libs=${CANDLE_AMP_CUDA_LIBS:-}
if [ -z "$_amp_libs" ]; then
  _amp_site=$(python3 - <<'PY' 2>/dev/null
import importlib.util, os
spec = importlib.util.find_spec("nvidia")
for path in (spec.submodule_search_locations or []) if spec else []:
    print(os.path.dirname(path))
    break
PY
)
  for _amp_d in "$_amp_site/nvidia/cu13/lib" "$_amp_site/nvidia/nccl/lib" \
                "${CUDA_HOME:-/usr/local/cuda}/lib64"; do
    [ -d "$_amp_d" ] && _amp_libs="${_amp_libs:+$_amp_libs:}$_amp_d"
  done
fi
[ -n "$_amp_libs" ] || echo "device-env.sh: no CUDA 13 libraries found (set CANDLE_AMP_CUDA_LIBS)" >&2
export LD_LIBRARY_PATH="$_amp_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _amp_libs _amp_site _amp_d
