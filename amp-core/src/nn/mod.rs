//! `amp::nn`: layers whose matrix products run in FP8 inside an
//! [`fp8_autocast`] scope, built from a `VarBuilder` like `candle_nn`'s.
//!
//! The same model runs in every [`ComputeMode`] with no code change: only
//! the scope around its forward differs.

mod linear;
mod linear_op;
mod mode;
mod norm;
mod sink;

pub use linear::{linear, linear_b, linear_no_bias, Linear};
pub use linear_op::LayerScaling;
pub use mode::{current_mode, fp8_autocast, with_fp8_autocast, ComputeMode, Fp8Autocast};
pub use norm::{
    layer_norm, layer_norm_linear, layer_norm_mlp, LayerNorm, LayerNormLinear, LayerNormMLP,
};
pub use sink::GradSink;
