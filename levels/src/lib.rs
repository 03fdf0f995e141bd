//! # amp-levels
//!
//! The optimization levels O0-O3 of candle-amp: [`Level`] and its storage
//! table ([`Level::policy`]), [`AmpConfig`], [`initialize`] (converts the
//! Linear weights of a model built with `amp::nn` and builds the optimizer)
//! the [`MemoryReport`], and checkpoints ([`AmpContext::save`],
//! [`AmpContext::load`]).
#![warn(missing_docs)]

mod checkpoint;
#[cfg(test)]
mod checkpoint_tests;
mod ckpt_header;
mod ckpt_index;
mod ckpt_load;
mod ckpt_reader;
mod ckpt_reshard;
mod config;
mod context;
mod distributed;
mod error;
mod eval;
mod export;
mod level;
mod report;
mod zero;

pub use config::{matches, AmpConfig, Compute};
pub use context::{initialize, AmpContext, AmpOptimizer, INITIALIZED_MARK};
pub use distributed::initialize_distributed;
pub use error::{Error, Result};
pub use export::ExportDType;
pub use level::{state_bytes, GradStorage, Level, Policy, WeightStorage};
pub use report::{Categories, MemoryReport};
pub use zero::shard_path;
