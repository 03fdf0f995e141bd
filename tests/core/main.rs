//! FP8 formats, scaling metadata and tensors, casts, the FP8 GEMM, recipes (amp-core below `nn`).
//! One test binary for these modules (one link instead of one each).

#[path = "../common/mod.rs"]
mod common;

mod block_scaling;
mod capability;
mod cast_transpose;
mod fp8_format;
mod fp8_gemm;
mod recipe;
mod scalars;
mod scaling_meta;
mod scaling_tensor;
