//! The error type of `amp-core`: every variant names the operation.

use candle_core::{DType, DeviceLocation, Shape};

/// Errors of `amp-core`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor has a dtype the operation does not take.
    #[error("{op}: expected dtype {expected}, got {got:?}")]
    DType {
        /// The operation.
        op: &'static str,
        /// What it takes, in words.
        expected: &'static str,
        /// What it got.
        got: DType,
    },
    /// Shapes that do not fit together.
    #[error("{op}: incompatible shapes {lhs:?} and {rhs:?}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// First shape.
        lhs: Shape,
        /// Second shape.
        rhs: Shape,
    },
    /// A tensor of the wrong rank.
    #[error("{op}: expected a tensor of rank {expected}, got shape {got:?}")]
    Rank {
        /// The operation.
        op: &'static str,
        /// The rank it takes.
        expected: usize,
        /// The shape it got.
        got: Shape,
    },
    /// Tensors on different devices.
    #[error("{op}: tensors on different devices, {lhs:?} and {rhs:?}")]
    Device {
        /// The operation.
        op: &'static str,
        /// First device.
        lhs: DeviceLocation,
        /// Second device.
        rhs: DeviceLocation,
    },
    /// A device this build or this operation does not support.
    #[error("{op}: unsupported device {device:?}")]
    UnsupportedDevice {
        /// The operation.
        op: &'static str,
        /// The device.
        device: DeviceLocation,
    },
    /// A scale that is zero, negative, NaN or infinite.
    #[error("{op}: bad scale {value} (a scale must be finite and positive)")]
    BadScale {
        /// The operation.
        op: &'static str,
        /// The value.
        value: f32,
    },
    /// An operation that the given format or setting does not support.
    #[error("{op}: {what}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// What is not supported.
        what: String,
    },
    /// Source and destination slices of different lengths.
    #[error("{op}: source has {src} elements, destination {dst}")]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// Source length.
        src: usize,
        /// Destination length.
        dst: usize,
    },
    /// A configuration value that is out of range or of the wrong type.
    #[error("config field `{field}`: {reason}")]
    Config {
        /// The field, as a path (`override_linear_precision.wgrad`).
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration file that could not be read.
    #[error("config file {path}: {reason}")]
    ConfigFile {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// A shared slot whose writer panicked.
    #[error("{op}: lock poisoned by a panic in another thread")]
    Poisoned {
        /// The operation.
        op: &'static str,
    },
    /// The build lacks a feature the call needs.
    #[error("built without feature `{0}`")]
    NotCompiled(&'static str),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
