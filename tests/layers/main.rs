//! The FP8 layers and fused ops of `amp::nn`.
//! One test binary for these modules (one link instead of one each).

#[path = "../common/mod.rs"]
mod common;

mod blocks;
mod fused;
mod linear;
mod linear_fuse;
mod norm;
mod training;
