//! The CUDA bodies of the kernels below the GEMM (feature `cuda`): scaled
//! casts, the cast-transpose, amax, requantize, the amax history and scale
//! update, the non-finite flag, scalar gathers; and the device plumbing the
//! other layers' launchers share (PTX loading, launch helpers, candle's
//! memory pool settings). The GEMM's (`gemm::cublaslt`) and the fused
//! ops' (`nn::fused::cuda`) launchers live with their ops.
//!
//! # How the kernels are built and loaded
//! `kernels/amp.cu` is compiled to PTX by nvcc in `build.rs` (only under this
//! feature) and embedded in the library; the driver JIT-compiles it once per
//! process when the first kernel is used (candle's module cache). Chosen over
//! NVRTC at run time because: the `cuda` build already needs nvcc 13.0
//! (candle-kernels), so it adds no build requirement; errors in the CUDA C
//! show up at build time, not in a device run; the binary does not depend on
//! NVRTC finding `cuda_fp8.h` and libcu++ headers on the device; and nothing
//! is compiled in the training process. The PTX targets
//! `compute_{CUDA_COMPUTE_CAP}` (default 90, Hopper; 89 for Ada; older
//! GPUs lack the FP8 conversions and the build stops) with nvcc 13.0, PTX
//! ISA 9.0: the device's CUDA 13.0 driver refuses newer ISAs. The first
//! kernel or GEMM loaded on a device checks its compute capability against
//! that (`launch::ensure_supported`, `numerics/capability.rs`).
//!
//! # Structure
//! One launch per op, a grid-stride loop of at most 8 blocks of 256 threads
//! per SM. Quantize reads the input once and writes the codes, the input's
//! amax and the saturated/flushed counts: each thread folds 16 elements per
//! step (16-byte loads and stores where both pointers are 16-byte aligned,
//! element by element otherwise and for the tail), a warp and block
//! reduction follow, then one atomic per block into outputs zeroed on the
//! stream. The amax is kept as the bits of `|x|`, so an integer max orders
//! NaN above inf exactly as the CPU kernel does. FP8 codes are made two at a
//! time by the hardware conversion (`cvt.rn.satfinite.e4m3x2.f32`, RNE with
//! saturation, as the CPU's encode) with no branch; its NaN codes (which keep
//! the input's sign) are rewritten to 0x7F on the packed word, and zero
//! codes for the flush count are found there too. Decoded amax and
//! requantize take 16 codes per step the same way; dequantize writes one
//! 16-byte word of outputs per thread and step, consecutive threads on
//! consecutive words (four strided 16-byte stores a thread ran at half the
//! copy bandwidth). Requantize is two passes over the codes (amax of the
//! decoded values, then decode-scale-encode) with the scale update between
//! them; no F32 copy is written. Scale updates are one block; current
//! scaling's metadata is one of them with no previous scale (1).
//!
//! The GPU tests (`tests/gpu/main.rs`, run with `--features cuda` on a GPU)
//! check every kernel here bit for bit against the CPU body.
//!
//! Scales are read from device memory by the kernels; no op here copies
//! anything to the host or synchronizes. Unlike the CPU body, quantize
//! cannot refuse a bad scale without reading it: every constructor of
//! [`ScalingMeta`](crate::scaling::meta::ScalingMeta) and the scale update produce finite
//! normal scales.

mod block;
mod block_scaled;
mod bucket;
mod cast;
pub(crate) mod cast_t;
pub(crate) mod cast_t_many;
mod decode_sum;
pub(crate) mod launch;
mod meta;
pub(crate) mod pool;
mod scalars;
pub(crate) mod transpose;

pub(crate) use block::{block_dequantize, block_quantize, block_quantize_pair};
pub(crate) use block_scaled::block_quantize_scaled;
pub(crate) use bucket::{
    bucket_amax, bucket_column_max, bucket_concat, bucket_copy_from, bucket_decode_sum,
    bucket_flag_scale_inv, bucket_max, bucket_mean_bound, bucket_quantize, bucket_requantize,
    bucket_scales, bucket_scales_sent,
};
pub(crate) use cast::{amax, decoded_amax, dequantize, quantize, requantize};
pub(crate) use decode_sum::decode_sum;
pub(crate) use meta::{flag_scale_inv, record_amax, scale_update};
pub use pool::{
    device_memory, keep_freed_memory, pool_peaks, reset_pool_peaks, set_pool_release_threshold,
    skip_event_tracking,
};
pub(crate) use scalars::gather_scalars;
