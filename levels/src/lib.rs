//! # amp-levels
//!
//! The optimization levels O0-O3 of candle-amp: `AmpConfig`, the policy
//! engine, `initialize`, the memory report and checkpoints. Under
//! construction: see the project's issues.
#![warn(missing_docs)]
