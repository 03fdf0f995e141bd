//! `amp::nn`: layers whose matrix products run in FP8 inside an
//! [`fp8_autocast`] scope, built from a `VarBuilder` like `candle_nn`'s.
//!
//! The same model runs in every [`ComputeMode`] with no code change: only
//! the scope around its forward differs. A two-layer MLP trained under each:
//!
//! ```
//! use amp_core::nn::{self, fp8_autocast, ComputeMode};
//! use amp_core::{CurrentScaling, DelayedScaling};
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{Optimizer, VarBuilder, VarMap};
//!
//! let dev = Device::Cpu;
//! let x = Tensor::randn(0f32, 1.0, (128, 8), &dev)?;
//! let y = x.sum_keepdim(1)?.tanh()?;                       // a smooth target
//! for mode in [
//!     ComputeMode::Native,
//!     ComputeMode::Fp8Current(CurrentScaling::default()),   // MS-AMP
//!     ComputeMode::Fp8Delayed(DelayedScaling::default()),   // Transformer Engine
//! ] {
//!     let varmap = VarMap::new();
//!     let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//!     let fc1 = nn::linear(8, 32, vb.pp("fc1"))?;
//!     let fc2 = nn::linear(32, 1, vb.pp("fc2"))?;
//!     let mut opt = candle_nn::AdamW::new_lr(varmap.all_vars(), 1e-2)?;
//!     let mut first = None;
//!     let mut loss_v = 0.0;
//!     for _ in 0..100 {
//!         let _scope = fp8_autocast(true, mode.clone());  // one scaling step
//!         let pred = fc2.forward(&fc1.forward(&x)?.relu()?)?;
//!         let loss = (pred - &y)?.sqr()?.mean_all()?;
//!         loss_v = loss.to_scalar::<f32>()?;
//!         first.get_or_insert(loss_v);
//!         opt.backward_step(&loss)?;
//!     }
//!     assert!(loss_v < 0.5 * first.unwrap_or(0.0), "{mode:?}: {first:?} -> {loss_v}");
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod blocks;
pub mod fused;
mod linear;
mod mode;
mod norm;
mod precomputed;
mod recompute;
mod selective;
mod stream;

pub use crate::scaling::param_grads::{collect_param_grads, ParamGrads};
pub use crate::scaling::sink::GradSink;
pub use crate::scaling::telemetry::{
    set_telemetry, telemetry_enabled, CastRecord, TELEMETRY_ROLES,
};
pub use blocks::{
    causal_self_attention, layer_norm_linear, layer_norm_mlp, layer_norm_mlp_with,
    linear_cross_entropy, linear_cross_entropy_stream, pre_norm_block, pre_norm_block_stream,
    pre_norm_mlp, pre_norm_mlp_with, rope_self_attention, BlockAttention, LayerNormLinear,
    LayerNormMLP, MlpForm,
};
pub use fused::{
    causal_attention, causal_attention_qkv, cross_entropy, embedding, embedding_grad,
    flash_attention_enabled, flash_head_dim, gelu, rope, rope_tables, set_flash_attention, swiglu,
    with_embedding_backward, Activation, LookupGrad, RopeScaling,
};
pub use linear::{
    cast_weights_ahead, fp8_activation_inputs, linear, linear_b, linear_no_bias, loss_chunk_rows,
    native_op_on_cuda, producer_amax, registered_linear, set_fp8_activation_inputs,
    set_loss_chunk_rows, set_native_op_on_cuda, set_producer_amax, set_weight_casts_ahead,
    weight_casts_ahead, Fuse, LayerScaling, Linear, DEFAULT_LOSS_CHUNK_ROWS,
};
pub use mode::{
    current_mode, fp8_autocast, in_inference, inference, with_fp8_autocast, ComputeMode,
    Fp8Autocast, Inference,
};
pub use norm::{layer_norm, rms_norm, LayerNorm, RmsNorm};
pub use recompute::recompute;
pub use selective::selective;
pub use stream::Stream;
