//! The FP8 layers and fused ops of `amp::nn`.
//! One test binary for these modules (one link instead of one each).
// `AmpOptimizer::backward_step(_owned)` are deprecated for `AmpContext::step`
// but kept, and these tests still check them.
#![allow(deprecated)]

#[path = "../common/mod.rs"]
mod common;

mod blocks;
mod fp8_act;
mod fused;
mod head_loss;
mod linear;
mod linear_fuse;
mod llama;
mod norm;
mod param_grads;
mod recompute;
mod rope;
mod selective;
mod telemetry;
mod training;
