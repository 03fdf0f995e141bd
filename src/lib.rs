//! # candle-amp
//!
//! FP8 mixed-precision training for [candle](https://github.com/huggingface/candle),
//! in the manner of Microsoft's MS-AMP and compatible with NVIDIA Transformer
//! Engine's FP8 recipes.
//!
//! This crate re-exports the public API of its members:
//! - `amp-core` (everything at the root of `amp`, and [`nn`]), four layers:
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

pub use amp_core::*;

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
