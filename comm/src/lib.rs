//! # amp-comm
//!
//! Communication for candle-amp: the `Communicator` trait, an in-process
//! backend, NCCL, and FP8 gradient all-reduce. Under construction: see the
//! project's issues.
#![warn(missing_docs)]
