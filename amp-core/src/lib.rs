//! # amp-core
//!
//! The numerics of candle-amp: FP8 formats with exact OCP semantics
//! ([`Fp8Format`]), per-tensor scaling metadata kept on the device
//! ([`ScalingMeta`]), scaled low-precision tensors ([`ScalingTensor`]),
//! the scale rules of Transformer Engine and MS-AMP ([`ScaleRule`]), the
//! recipes ([`DelayedScaling`], [`CurrentScaling`]) and the FP8 GEMM
//! reference ([`fp8_gemm`]).
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
//!   scale updates; PTX built by nvcc 13.0 in `build.rs`) and the cuBLASLt
//!   FP8 GEMM behind [`fp8_gemm`]. Results are bit-identical to the CPU
//!   kernels (the GEMM up to f32 summation order). Without it the build is
//!   CPU-only and needs no CUDA toolkit; CUDA tensors then get
//!   [`Error::NotCompiled`].
#![warn(missing_docs)]

mod bulk;
mod cast;
mod cast_t;
pub mod config;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
mod cuda;
mod error;
mod format;
mod gemm;
pub mod kernel;
mod meta;
pub mod nn;
mod qtype;
mod recipe;
mod requantize;
mod scalars;
mod scale;
mod stats;
mod tensor;
mod weight;

pub use cast::F16_NAN_BITS;
pub use cuda::{
    keep_freed_memory, pool_peaks, reset_pool_peaks, set_pool_release_threshold,
    skip_event_tracking,
};
pub use error::{Error, Result};
pub use format::{Fp8Format, CANONICAL_NAN_BITS, E4M3_MAX, E5M2_MAX, F16_MAX};
pub use gemm::{fp8_gemm, fp8_gemm_amax, fp8_gemm_fused, fp8_gemm_with, Epilogue};
pub use meta::ScalingMeta;
pub use qtype::QType;
pub use recipe::{
    AmaxComputeAlgo, CurrentScaling, DelayedScaling, Format, OverrideLinearPrecision, MAX_MARGIN,
};
pub use scalars::{gather_scalars, read_scalars};
pub use scale::ScaleRule;
pub use stats::CastStats;
pub use tensor::ScalingTensor;
pub use weight::{Weight, WeightSlot};
