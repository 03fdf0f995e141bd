//! The error type of `amp-levels`.

/// Errors of `amp-levels`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A config value out of range.
    #[error("config field `{field}`: {reason}")]
    Config {
        /// The field.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A checkpoint that cannot be written or read, and why.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// An error of the numerics core.
    #[error(transparent)]
    Core(#[from] amp_core::Error),
    /// An error of the optimizer.
    #[error(transparent)]
    Optim(#[from] amp_optim::Error),
    /// An error of the communication layer (a failed or missing rank).
    #[error(transparent)]
    Comm(#[from] amp_comm::Error),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
