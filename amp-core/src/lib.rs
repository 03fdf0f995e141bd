//! # amp-core
//!
//! The core of candle-amp, in four layers, each importing only those below
//! it:
//! 1. the numerics (`numerics/`): FP8 formats with exact OCP semantics
//!    ([`Fp8Format`]), what a scaled tensor stores ([`QType`]), the scale
//!    rules of Transformer Engine and MS-AMP ([`ScaleRule`]), the recipes
//!    ([`DelayedScaling`], [`CurrentScaling`]), the [`kernel`] mechanism and
//!    the cast kernels, with their CUDA bodies;
//! 2. scaling (`scaling/`): per-tensor scaling metadata kept on the device
//!    ([`ScalingMeta`]), scaled low-precision tensors ([`ScalingTensor`]),
//!    how a parameter is stored ([`Weight`]) and where its FP8 gradient goes
//!    ([`GradSink`]);
//! 3. the FP8 GEMM (`gemm/`): [`fp8_gemm`], a CPU reference and cuBLASLt;
//! 4. the layers ([`nn`]): FP8 `Linear`, `LayerNorm`, fused ops with their
//!    backward, flash attention, the `fp8_autocast` scope; the only part
//!    that uses `candle-nn`.
//!
//! ```
//! use amp_core::{Fp8Format, CurrentScaling, QType, ScalingTensor, fp8_gemm};
//! use candle_core::{DType, Device, Tensor};
//!
//! assert_eq!(Fp8Format::E4M3.encode(448.0), 0x7E);
//! assert_eq!(Fp8Format::E4M3.encode(1e9), 0x7E);        // saturates
//! assert_eq!(Fp8Format::E4M3.decode(0x7E), 448.0);
//!
//! let dev = Device::Cpu;
//! let x = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &dev)?;
//! let w = Tensor::new(&[[0.5f32, -1.0], [2.0, 0.25]], &dev)?;
//! let r = CurrentScaling::default();
//! let (xq, _) = ScalingTensor::quantize(&x, QType::E4M3, &r)?;
//! let (wq, _) = ScalingTensor::quantize(&w, QType::E4M3, &r)?;
//! let y = fp8_gemm(&xq, &wq, DType::F32)?;              // x · wᵀ
//! assert_eq!(y.to_vec2::<f32>()?, [[-1.5, 2.5], [-2.5, 7.0]]);
//! # Ok::<(), amp_core::Error>(())
//! ```
//!
//! # Features
//! - `cuda`: CUDA bodies of every kernel (scaled casts, amax, requantize,
//!   scale updates, the fused ops and flash attention; PTX built by nvcc
//!   13.0 in `build.rs`) and the cuBLASLt FP8 GEMM behind [`fp8_gemm`]. Results are bit-identical to the CPU
//!   kernels (the GEMM up to f32 summation order). Without it the build is
//!   CPU-only and needs no CUDA toolkit; CUDA tensors then get
//!   [`Error::NotCompiled`].
#![warn(missing_docs)]

mod error;
mod gemm;
pub mod nn;
mod numerics;
mod scaling;

pub use error::{Error, Result};
pub use gemm::block::{block_gemm, block_gemm_fused, supported_tilings};
pub use gemm::{fp8_gemm, fp8_gemm_acc, fp8_gemm_amax, fp8_gemm_fused, fp8_gemm_with, Epilogue};
pub use numerics::block::{Tiling, TILE as BLOCK_TILE};
pub use numerics::bucket::{
    bucket_amax, bucket_column_max, bucket_concat, bucket_copy, bucket_copy_from,
    bucket_decode_amax, bucket_decode_sum, bucket_decode_sum_quantize, bucket_flag_scale_inv,
    bucket_max, bucket_mean_bound, bucket_quantize, bucket_requantize, bucket_scales,
    bucket_scales_sent, Piece,
};
pub use numerics::capability::{check_capability, parse_capability, MIN_COMPUTE_CAPABILITY};
pub use numerics::cast::F16_NAN_BITS;
pub use numerics::cast::{amax, CastStats};
pub use numerics::clock::StreamMark;
pub use numerics::counts::{cast_counts, set_cast_counts};
#[cfg(feature = "cuda")]
pub use numerics::cuda::launch::{compute_capability, ensure_supported, multiprocessors};
pub use numerics::cuda::{
    device_memory, keep_freed_memory, pool_peaks, reset_pool_peaks, set_pool_release_threshold,
    skip_event_tracking,
};
pub use numerics::decode_sum::decode_sum;
pub use numerics::format::{Fp8Format, CANONICAL_NAN_BITS, E4M3_MAX, E5M2_MAX, F16_MAX};
pub use numerics::qtype::QType;
pub use numerics::readback::HostReadback;
pub use numerics::recipe::{
    AmaxComputeAlgo, CurrentScaling, DelayedScaling, Float8BlockScaling, Float8RowwiseScaling,
    Format, OverrideLinearPrecision, MAX_AMAX_HISTORY_LEN, MAX_MARGIN,
};
pub use numerics::scalars::{gather_scalars, read_scalars};
pub use numerics::scale::ScaleRule;
pub use numerics::stream::{defer_side_work, SideStream};
pub use numerics::{config, kernel};
pub use scaling::block::BlockTensor;
pub use scaling::meta::ScalingMeta;
pub use scaling::param_grads::{collect_param_grads, ParamGrads};
pub use scaling::sink::{with_sink_listener, GradSink};
pub use scaling::telemetry::{set_telemetry, telemetry_enabled, CastRecord, TELEMETRY_ROLES};
pub use scaling::tensor::ScalingTensor;
pub use scaling::weight::{Weight, WeightSlot};
