//! Builds the PTX of `kernels/lowbit.cu` (the fused low-bit AdamW step and
//! the gradient sum of squares) with nvcc, only under the `cuda` feature:
//! the default build needs no CUDA toolkit. `-fmad=false`: no multiply-add
//! contraction, so the update rounds as the CPU body does (see lowbit.cu).
//!
//! The kernels' codecs are amp-core's (`amp-core/kernels/codec.cuh`, shared
//! with the cast kernels), and so is the nvcc driver
//! (`amp-core/build/nvcc.rs`). Build with `--features cuda` through
//! `scripts/gpu/build-cuda.sh` (nvcc 13.0).

include!("../amp-core/build/nvcc.rs");

fn main() {
    build_ptx(
        &["lowbit"],
        &["-fmad=false"],
        &["../amp-core/kernels/codec.cuh"],
    );
}
