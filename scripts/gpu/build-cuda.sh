#!/usr/bin/env bash
# build-cuda.sh: run a cargo command that builds candle-amp with `--features
# cuda` (or `nccl`) on a machine without a GPU and without a CUDA install.
#
#   scripts/gpu/build-cuda.sh cargo build --release --features cuda --example gpt
#   scripts/gpu/build-cuda.sh cargo test --release --features cuda --no-run --test gpu
#   eval "$(scripts/gpu/build-cuda.sh --print-env)"    # only the variables
#
# The binaries are meant for Hopper GPUs (H100, H200) whose driver speaks
# CUDA 13.0. On first use the script fetches the CUDA 13.0 pieces that the
# build needs from the Python package index (pip, no root), arranges them as
# a CUDA root, adds the files the wheels lack, and records what it installed
# in a stamp; later runs find the stamp and only export the variables. Then
# it runs its arguments with those variables set. See scripts/gpu/README.md.
#
# Why these versions: they are the `cuda-toolkit==13.0.2` set (and the NCCL)
# that PyTorch 2.11 for CUDA 13.0 depends on, so the shared libraries linked
# here are the same files PyTorch brings to the GPU machine, where
# device-env.sh points the loader at them. nvcc must stay at 13.0: it writes
# PTX ISA 9.0, and a CUDA 13.0 driver refuses PTX of a newer ISA
# (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), which would break every kernel that
# candle and candle-amp ship as PTX.
#
# Environment: CANDLE_AMP_CUDA_CACHE (where to install; default
# ${XDG_CACHE_HOME:-$HOME/.cache}/candle-amp-cuda), CUDA_COMPUTE_CAP (default
# 90), CUDAFORGE_THREADS (default: every core). Needs python3 with pip, gcc.
set -euo pipefail

CUDA_SET=13.0.2
PKGS=(
  nvidia-cuda-nvcc==13.0.88            # nvcc, ptxas, fatbinary, nvlink
  nvidia-nvvm==13.0.88                 # cicc and libdevice, nvcc's back end
  nvidia-cuda-crt==13.0.88             # include/crt, which nvcc includes
  nvidia-cuda-cccl==13.0.85            # libcu++ headers (cuda_fp8.h and cuda_bf16.h need them)
  nvidia-cuda-runtime==13.0.96         # cuda.h, cuda_runtime.h, libcudart
  nvidia-cuda-nvrtc==13.0.88           # libnvrtc (candle links it)
  nvidia-cublas==13.1.0.3              # libcublas, libcublasLt (candle links them)
  nvidia-curand==10.4.0.35             # libcurand (candle links it)
  nvidia-nccl-cu13==2.28.9             # libnccl, nccl.h (feature `nccl` only)
)
# The stamp holds the package list and a layout tag: change the tag whenever
# the steps below change, so that an older install is redone.
LAYOUT_TAG=v6

CACHE="${CANDLE_AMP_CUDA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-amp-cuda}"
PREFIX="$CACHE/cuda-$CUDA_SET"
ROOT="$PREFIX/site/nvidia/cu13"
STAMP="$PREFIX/.ready"
WANT="$(printf '%s\n' "${PKGS[@]}" "$LAYOUT_TAG")"

say() { echo "build-cuda.sh: $*" >&2; }
die() { say "$*"; exit 1; }

# The wheels put every CUDA piece under site/nvidia/cu13 and NCCL beside it
# under site/nvidia/nccl; the steps below make cu13 a CUDA root the build
# tools accept.
install_into() {
  local tmp=$1 root="$1/site/nvidia/cu13" nccl="$1/site/nvidia/nccl"
  say "installing the CUDA $CUDA_SET build pieces into $PREFIX (once; about 900 MB to download)"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-deps --only-binary=:all: --no-compile --target "$tmp/site" "${PKGS[@]}"
  [ -x "$root/bin/nvcc" ] || die "no nvcc after the install"

  # cudarc looks in lib/, cudaforge and nvcc.profile in lib64/.
  ln -sfn lib "$root/lib64"

  # The linker resolves -lcudart and friends to NAME.so, which the wheels
  # do not ship (only NAME.so.MAJOR).
  local so
  for so in libcudart.so.13 libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10; do
    [ -e "$root/lib/$so" ] || die "the wheels brought no $so"
    ln -sfn "$so" "$root/lib/${so%.so.*}.so"
  done
  ln -sfn ../../nccl/lib/libnccl.so.2 "$root/lib/libnccl.so.2"
  ln -sfn ../../nccl/lib/libnccl.so.2 "$root/lib/libnccl.so"
  local h
  for h in nccl.h nccl_device.h; do
    if [ -e "$nccl/include/$h" ]; then ln -sfn "../../nccl/include/$h" "$root/include/$h"; fi
  done

  # libcuda.so belongs to the GPU driver and is in no wheel, but candle links
  # cudarc with `dynamic-linking`, so the link needs a libcuda.so defining
  # every driver entry point. Build one of empty functions from the names
  # cuda.h declares (the current names, and with __CUDA_API_VERSION_INTERNAL
  # the older ones the driver still exports; declarations may span lines),
  # plus the three of cudaProfiler.h, which no installed wheel carries. Its
  # soname is the driver's, so the binary loads the real libcuda.so.1 on the
  # GPU machine.
  mkdir -p "$root/lib/stubs"
  local stub="$root/lib/stubs/libcuda_stub.c"
  { gcc -E -P -x c -I "$root/include" "$root/include/cuda.h"
    gcc -E -P -x c -D__CUDA_API_VERSION_INTERNAL -I "$root/include" "$root/include/cuda.h"
    echo 'CUresult cuProfilerInitialize( CUresult cuProfilerStart( CUresult cuProfilerStop('
  } | tr '\n' ' ' \
    | grep -oE '\bCUresult[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*\(' \
    | sed -E 's/^CUresult[[:space:]]+//; s/[[:space:]]*\($//' \
    | sort -u | sed 's/.*/void &(void) {}/' > "$stub"
  local n; n=$(wc -l < "$stub")
  [ "$n" -gt 400 ] || die "the libcuda stub found only $n entry points in cuda.h"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$stub"

  local v; v="$("$root/bin/nvcc" --version)"
  case "$v" in *"release 13.0,"*) ;; *) die "nvcc is not 13.0: $v" ;; esac
}

ensure_installed() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && return 0
  command -v python3 >/dev/null || die "python3 with pip is needed"
  command -v gcc >/dev/null || die "gcc is needed (nvcc's host compiler, and the stub)"
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9                              # two first runs never install at once
  if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    rm -rf "$PREFIX.tmp"
    mkdir -p "$PREFIX.tmp"
    install_into "$PREFIX.tmp"
    rm -rf "$PREFIX"
    mv "$PREFIX.tmp" "$PREFIX"         # the links inside are relative
    printf '%s\n' "$WANT" > "$STAMP"   # written last: a stamp means complete
    say "CUDA root ready: $ROOT"
  fi
  exec 9>&-
}

ensure_installed

export CUDA_ROOT="$ROOT" CUDA_PATH="$ROOT" CUDA_HOME="$ROOT" CUDA_TOOLKIT_ROOT_DIR="$ROOT"
export NVCC="$ROOT/bin/nvcc"
export PATH="$ROOT/bin:$PATH"
# No GPU here to ask: build for Hopper. candle-kernels' build (cudaforge)
# turns 90 into sm_90a, which runs on H100 and H200 only.
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
# cudarc binds the CUDA 13.0 API (never a newer one for a 13.0 driver).
export CUDARC_CUDA_VERSION=13000
# cudaforge uses half the cores unless told.
export CUDAFORGE_THREADS="${CUDAFORGE_THREADS:-$(nproc)}"

if [ "${1:-}" = "--print-env" ]; then
  for v in CUDA_ROOT CUDA_PATH CUDA_HOME CUDA_TOOLKIT_ROOT_DIR NVCC PATH CUDA_COMPUTE_CAP \
           CUDARC_CUDA_VERSION CUDAFORGE_THREADS; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done
  exit 0
fi
if [ "$#" -eq 0 ]; then
  say "CUDA environment ready; give a command, e.g. cargo build --release --features cuda"
  exit 0
fi
exec "$@"
