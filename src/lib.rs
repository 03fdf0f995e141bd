//! # candle-amp
//!
//! FP8 mixed-precision training for [candle](https://github.com/huggingface/candle),
//! in the manner of Microsoft's MS-AMP and compatible with NVIDIA Transformer
//! Engine's FP8 recipes.
//!
//! This crate re-exports the public API of its members:
//! - `amp-core` (its numerics and scaled tensors at the root of `amp`, the
//!   layers in [`nn`], the device's pool and streams in [`cuda`], the
//!   kernels underneath the levels in [`kernels`]), four layers:
//!   the numerics (FP8 formats with exact OCP semantics, casts, the TE and
//!   MS-AMP scale rules, the recipes), scaling metadata on the device and
//!   scaled tensors, the FP8 GEMM, and the layers of [`nn`] (FP8 `Linear`,
//!   `LayerNorm`, `LayerNormLinear`, `LayerNormMLP`, fused ops with their
//!   backward, flash attention, the `fp8_autocast` scope);
//! - [`optim`]: AdamW, low-bit AdamW, loss scaling, schedules;
//! - [`comm`]: the `Communicator` trait, an in-process backend (ranks as
//!   threads) and FP8 gradient all-reduce;
//! - [`levels`]: the optimization levels O0-O3 (`initialize`, the policy
//!   table, the memory report, checkpoints, data parallelism).
//!
//! ```
//! use amp::{CurrentScaling, QType, ScalingTensor};
//! use candle_core::{DType, Device, Tensor};
//! let x = Tensor::new(&[1.0f32, -0.3, 20.0], &Device::Cpu)?;
//! let (q, _amax) = ScalingTensor::quantize(&x, QType::E4M3, &CurrentScaling::default())?;
//! let y = q.dequantize(DType::F32)?;
//! assert_eq!(y.to_vec1::<f32>()?, [1.0, -0.3125, 20.0]);
//! # Ok::<(), amp::Error>(())
//! ```
#![warn(missing_docs)]

// The numerics and layers users build with, at the root.
pub use amp_core::nn;
pub use amp_core::{
    block_gemm, block_gemm_fused, fp8_gemm, fp8_gemm_acc, fp8_gemm_amax, fp8_gemm_fused,
    fp8_gemm_with, AmaxComputeAlgo, BlockTensor, CastStats, CurrentScaling, DelayedScaling,
    Epilogue, Float8BlockScaling, Float8RowwiseScaling, Format, Fp8Format, GradSink,
    OverrideLinearPrecision, QType, ScaleRule, ScalingMeta, ScalingTensor, Tiling, Weight,
    WeightSlot, BLOCK_TILE, CANONICAL_NAN_BITS, E4M3_MAX, E5M2_MAX, F16_MAX, F16_NAN_BITS,
    MAX_AMAX_HISTORY_LEN, MAX_MARGIN,
};
pub use amp_core::{cast_counts, set_cast_counts};

/// The CUDA device: which GPUs the CUDA path runs on (compute capability
/// 8.9 or newer, checked when the first kernel loads; `AMP_COMPUTE_CAP`
/// overrides what the check believes), the memory pool's knobs a training
/// loop sets once (`keep_freed_memory`, `skip_event_tracking`), the pool's
/// peaks for memory reports, timing marks on the device's stream, a read
/// to the host that waits only when read, and the side stream
/// communication runs on. Each is a no-op or `None` off CUDA
/// where the docs say so.
pub mod cuda {
    pub use amp_core::{check_capability, parse_capability, MIN_COMPUTE_CAPABILITY};
    #[cfg(feature = "cuda")]
    pub use amp_core::{compute_capability, ensure_supported, multiprocessors};
    pub use amp_core::{
        defer_side_work, device_memory, keep_freed_memory, pool_peaks, reset_pool_peaks,
        set_pool_release_threshold, skip_event_tracking, HostReadback, SideStream, StreamMark,
    };
}

/// The kernels underneath the levels, for those who build their own
/// reductions or check the CUDA bodies against the CPU ones: the bucketed
/// reduction's steps, the rank-order decode-and-sum, scalar reads, amax,
/// the kernel trait and the numerics' configuration.
pub mod kernels {
    pub use amp_core::{
        amax, bucket_amax, bucket_column_max, bucket_concat, bucket_copy, bucket_copy_from,
        bucket_decode_amax, bucket_decode_sum, bucket_decode_sum_quantize, bucket_flag_scale_inv,
        bucket_max, bucket_mean_bound, bucket_quantize, bucket_requantize, bucket_scales,
        bucket_scales_sent, config, decode_sum, gather_scalars, kernel, read_scalars,
        with_sink_listener, Piece,
    };
}

pub use amp_levels::{
    initialize, initialize_distributed, AmpConfig, AmpContext, AmpOptimizer, Compute, Level,
    MemoryReport, Stepped,
};

/// The facade's error: what [`initialize`] and the steps return, and what
/// every member's error converts into (the numerics' [`CoreError`], the
/// optimizer's, the communicator's, candle's), so that
/// `fn main() -> amp::Result<()>` takes them all with `?`.
pub use amp_levels::{Error, Result};

/// The numerics core's own error (`amp-core`), inside [`Error::Core`].
pub use amp_core::Error as CoreError;

/// Optimization levels: the policy table, config, report (`amp-levels`).
pub mod levels {
    pub use amp_levels::*;
}

/// Communication: the `Communicator` trait, the in-process backend, FP8
/// gradient all-reduce (`amp-comm`).
pub mod comm {
    pub use amp_comm::*;
}

/// Optimizers: AdamW, low-bit AdamW, loss scaling, schedules (`amp-optim`).
pub mod optim {
    pub use amp_optim::*;
}
