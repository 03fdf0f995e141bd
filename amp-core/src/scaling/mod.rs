//! Scaling, above the numerics: per-tensor scaling metadata kept on the
//! device ([`ScalingMeta`](meta::ScalingMeta): scale, its inverse, the amax
//! history and the delayed and current scale updates), what each cast
//! saturated or flushed ([`CastStats`](crate::numerics::cast::CastStats)), scaled tensors
//! ([`ScalingTensor`](tensor::ScalingTensor), and per tile
//! [`BlockTensor`](block::BlockTensor)), how a parameter is stored
//! ([`Weight`](weight::Weight), [`WeightSlot`](weight::WeightSlot)), where
//! FP8 weight gradients go ([`GradSink`](sink::GradSink)), the
//! non-finite flag a GEMM operand carries into its output, and the casts'
//! precision telemetry ([`CastRecord`](telemetry::CastRecord)), which the
//! layers and the optimizer both record.

pub(crate) mod block;
pub(crate) mod flag;
pub(crate) mod meta;
pub(crate) mod param_grads;
mod requantize;
pub(crate) mod sink;
pub(crate) mod stats;
pub(crate) mod telemetry;
pub(crate) mod tensor;
mod times;
pub(crate) mod weight;
