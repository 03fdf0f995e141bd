//! AdamW and the low-bit AdamW (`amp::optim`), FP8 moments included.
//! One test binary for these modules (one link instead of one each).

#[path = "../common/mod.rs"]
mod common;

mod adamw;
mod fp8_moments;
mod lowbit;
