//! Builds the PTX of `kernels/amp.cu` (casts, scales), `kernels/cast_t.cu`
//! (the cast-transpose; both include `kernels/cast.cuh`), `kernels/nn.cu`
//! (fused training ops; it includes the `nn_*.cuh` parts),
//! `kernels/flash.cu` (causal flash attention) and `kernels/block.cu`
//! (block-scaled casts) with nvcc, only under the `cuda` feature: the
//! default build needs no CUDA toolkit.
//!
//! `kernels/codec.cuh`, the FP8 and FP16 codecs and scale rules, is shared
//! with the optimizer's kernels (optim/kernels/lowbit.cu), and
//! `build/nvcc.rs`, the nvcc driver (flags, version check, where libcu++
//! is), with optim's build script. Build with `--features cuda` through
//! `scripts/gpu/build-cuda.sh` (nvcc 13.0).

include!("build/nvcc.rs");

fn main() {
    build_ptx(&["amp", "nn", "cast_t", "flash", "block"], &[], &[]);
}
