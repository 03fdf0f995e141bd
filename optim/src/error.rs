//! The error type of `amp-optim`.

/// Errors of `amp-optim`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A gradient whose shape differs from its parameter's.
    #[error("{op}: gradient of `{name}` has shape {got:?}, the parameter {expected:?}")]
    GradShape {
        /// The operation.
        op: &'static str,
        /// The parameter.
        name: String,
        /// The parameter's shape.
        expected: candle_core::Shape,
        /// The gradient's shape.
        got: candle_core::Shape,
    },
    /// A hyperparameter out of range.
    #[error("config field `{field}`: {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A gradient for a parameter the optimizer does not hold.
    #[error("gradient for unknown parameter `{0}`")]
    UnknownParam(String),
    /// Two parameters with one name.
    #[error("parameter name `{0}` used twice")]
    DuplicateName(String),
    /// An error of the numerics core.
    #[error(transparent)]
    Core(#[from] amp_core::Error),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// What the optimizer's step met that its own kernels or states should
/// never give (an output count, a storage that changed, an outcome read
/// of the wrong length): an internal fault, reported as the step's error.
pub(crate) fn kernel_error(what: &str) -> Error {
    amp_core::Error::Unsupported {
        op: "LowBitAdamW::step",
        what: what.into(),
    }
    .into()
}
