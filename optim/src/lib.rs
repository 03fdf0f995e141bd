//! # amp-optim
//!
//! Optimizers of candle-amp: the F32 AdamW reference, low-bit AdamW (FP8
//! first moment, FP16 second moment), scaled FP16 master weights and loss
//! scaling. Under construction: see the project's issues.
#![warn(missing_docs)]
