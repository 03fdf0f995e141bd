//! # amp-optim
//!
//! Optimizers of candle-amp:
//! - [`AdamW`]: the F32 reference with PyTorch's rule and defaults, a
//!   `candle_nn::Optimizer` over `Var`s;
//! - [`LowBitAdamW`]: MS-AMP's LBAdamW, moments in scaled E4M3 / FP16 (or
//!   any [`StateFormat`]), weights in F32, scaled FP16 (O1/O2 master) or
//!   FP8 + FP16 master (O3), gradients F32 or FP8 decoded on the fly, global
//!   norm clipping, learning-rate schedules, loss scaling and skipping of
//!   non-finite steps. Each parameter's update is one fused kernel
//!   (`LowBitStep`) with a CPU body and, under feature `cuda`, a CUDA body
//!   (`kernels/lowbit.cu`: one or two launches, bit-identical to the CPU
//!   body), as is the gradient sum of squares for the global norm; on a GPU
//!   the clipping and skip decision run on the device (`clip.rs`) and the
//!   small parameters take one launch for all (`multi.rs`).
//!
//! ```
//! use amp_core::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
//! use amp_optim::{Grad, Grads, LowBitAdamW, LowBitAdamWConfig, AdamWConfig};
//! use candle_core::{DType, Device, Tensor};
//!
//! // A weight stored as scaled FP16 (the O1/O2 master), gradients in FP8.
//! let w0 = Tensor::new(&[[1.0f32, -2.0], [0.5, 3.0]], &Device::Cpu)?;
//! let (w16, _) = ScalingTensor::quantize(&w0, QType::F16, &CurrentScaling::default())?;
//! let slot = WeightSlot::new(Weight::F16(w16));
//! let cfg = LowBitAdamWConfig { adam: AdamWConfig { lr: 0.05, weight_decay: 0.0, ..Default::default() }, ..Default::default() };
//! let mut opt = LowBitAdamW::new(vec![("w".into(), slot.clone())], cfg)?;
//! for _ in 0..200 {
//!     let w = slot.read()?.master_f32()?;
//!     let g = (&w * 2.0)?;                                  // d/dw of |w|^2
//!     let (g8, _) = ScalingTensor::quantize(&g, QType::E4M3, &CurrentScaling::default())?;
//!     let mut grads = Grads::new();
//!     grads.insert("w", Grad::Scaled(g8));
//!     opt.step(&grads)?;
//! }
//! let w = slot.read()?.master_f32()?;
//! assert!(w.abs()?.max_all()?.to_scalar::<f32>()? < 0.1);
//! # Ok::<(), amp_optim::Error>(())
//! ```
#![warn(missing_docs)]

mod adamw;
mod clip;
mod codec;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cuda_buf;
#[cfg(feature = "cuda")]
mod cuda_codec;
#[cfg(feature = "cuda")]
mod cuda_multi;
#[cfg(feature = "cuda")]
mod cuda_restore;
#[cfg(feature = "cuda")]
mod cuda_sum_sq;
mod dispatch;
mod error;
mod fused;
mod grad;
mod loss_scaler;
mod lowbit;
mod multi;
mod restore;
mod schedule;
mod state;
mod step;
mod telemetry;
mod update;

pub use adamw::{AdamStep, AdamW, AdamWConfig};
pub use codec::{step_decode, step_encode};
pub use error::{Error, Result};
pub use grad::{Grad, Grads};
pub use loss_scaler::{LossScaler, LossScaling};
pub use lowbit::{LowBitAdamW, LowBitAdamWConfig, ParamState, StepOutcome};
pub use schedule::{Constant, LrSchedule, WarmupCosine};
pub use state::{State, StateFormat};
pub use step::ReduceNorm;
pub use telemetry::MomentRecord;
