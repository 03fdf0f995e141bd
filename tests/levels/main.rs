//! The levels O0-O3: memory report, owned steps, checkpoints and their resharding, bounded property tests of the parsers.
//! One test binary for these modules (one link instead of one each).
// `AmpOptimizer::backward_step(_owned)` are deprecated for `AmpContext::step`
// but kept, and these tests still check them.
#![allow(deprecated)]

#[path = "../ckpt_common/mod.rs"]
mod ckpt_common;
#[path = "../common/mod.rs"]
mod common;

mod casts_ahead;
mod checkpoint;
mod checkpoint_reshard;
mod embedding_rows;
mod fp8_moments;
mod fuzz_inputs;
mod owned;
mod report;
mod tied;
