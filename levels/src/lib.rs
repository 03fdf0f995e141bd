//! # amp-levels
//!
//! The optimization levels O0-O3 of candle-amp: [`Level`] and its storage
//! table ([`Level::policy`]), [`AmpConfig`], [`initialize`] (converts the
//! Linear weights of a model built with `amp::nn` and builds the optimizer),
//! [`initialize_distributed`] (the same for one rank of a data-parallel
//! group), the [`MemoryReport`], and checkpoints ([`AmpContext::save`],
//! [`AmpContext::load`], [`AmpContext::export`]).
//!
//! The modules, each importing only those listed below it:
//!
//! - `checkpoint/`: saving, loading (converting, resharding) and exporting;
//! - `report`: the memory report;
//! - `distributed/`: data parallelism (gradient averaging, ZeRO for O3),
//!   installed into the context as its data-parallel hook;
//! - `context`: [`AmpContext`], [`AmpOptimizer`], [`initialize`], the step;
//! - `config`: [`AmpConfig`], [`Compute`];
//! - `level`: [`Level`] and its table; `error`: [`Error`].
#![warn(missing_docs)]

mod checkpoint;
mod comm_stats;
mod config;
mod context;
mod data_parallel;
mod distributed;
mod error;
mod initialize;
mod level;
mod optimizer;
mod report;

pub use checkpoint::export::{write_tensors, ExportDType};
pub use checkpoint::index::{shard_files, shard_path};
pub use comm_stats::CommStats;
pub use config::{matches, AmpConfig, Compute, DEFAULT_BUCKET_MB, MAX_BUCKET_MB};
pub use context::AmpContext;
pub use distributed::initialize_distributed;
pub use error::{Error, Result};
pub use initialize::{initialize, INITIALIZED_MARK};
pub use level::{state_bytes, GradStorage, Level, Policy, WeightStorage};
pub use optimizer::{AmpOptimizer, Stepped};
pub use report::{Categories, MemoryReport};
