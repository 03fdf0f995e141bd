//! The error type of `amp-comm`: every variant names the operation.

use candle_core::{DType, DeviceLocation};
use std::time::Duration;

/// Errors of `amp-comm`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor of a dtype the operation does not take.
    #[error("{op}: expected dtype {expected}, got {got:?}")]
    DType {
        /// The operation.
        op: &'static str,
        /// What it takes, in words.
        expected: &'static str,
        /// What it got.
        got: DType,
    },
    /// A tensor on another device than the communicator's.
    #[error("{op}: tensor on {got:?}, the communicator is on {expected:?}")]
    Device {
        /// The operation.
        op: &'static str,
        /// The communicator's device.
        expected: DeviceLocation,
        /// The tensor's device.
        got: DeviceLocation,
    },
    /// A device the backend does not support.
    #[error("{op}: the {backend} backend does not support tensors on {device:?}")]
    UnsupportedDevice {
        /// The operation.
        op: &'static str,
        /// The backend.
        backend: &'static str,
        /// The device.
        device: DeviceLocation,
    },
    /// An argument that is wrong on this rank alone (a root out of range,
    /// a chunk count other than the world size, a shard of the wrong length).
    #[error("{op}: {what}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        what: String,
    },
    /// Ranks that called different collectives, or one collective with
    /// tensors that do not fit together (shapes, dtypes, lengths, roots).
    #[error("{op}: ranks disagree: {detail}")]
    Mismatch {
        /// The operation.
        op: &'static str,
        /// Which ranks and what differs.
        detail: String,
    },
    /// Ranks that did not arrive at a collective in time.
    #[error("{op}: rank {rank} waited {waited:?} for rank(s) {missing:?}, which never arrived")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The ranks that did not arrive.
        missing: Vec<usize>,
        /// How long it waited.
        waited: Duration,
    },
    /// The group is broken: a rank failed (an error in a collective, a
    /// dropped communicator, a panic, a timeout). Every pending and later
    /// collective of every rank returns this.
    #[error("{op}: rank {rank} failed: {reason}")]
    PeerFailed {
        /// The operation.
        op: &'static str,
        /// The rank that failed first.
        rank: usize,
        /// What happened to it.
        reason: String,
    },
    /// A rank's thread panicked (from [`run_ranks`](crate::run_ranks)).
    #[error("run_ranks: rank {rank} panicked: {message}")]
    Panicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// A launch variable (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// `MASTER_PORT`, `AMP_RENDEZVOUS_PORT`, `AMP_RENDEZVOUS_TIMEOUT_S`)
    /// that is missing or invalid.
    #[error("{op}: environment variable {var}: {what}")]
    Env {
        /// The operation.
        op: &'static str,
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        what: String,
    },
    /// The TCP rendezvous that hands out the NCCL unique id failed (a
    /// socket error, or a peer that does not speak its protocol).
    #[error("{op}: {detail}")]
    Rendezvous {
        /// The operation.
        op: &'static str,
        /// What happened.
        detail: String,
    },
    /// An error reported by NCCL.
    #[error("{op}: NCCL: {detail}")]
    Nccl {
        /// The operation.
        op: &'static str,
        /// NCCL's error.
        detail: String,
    },
    /// A backend this build does not contain.
    #[error("built without feature `{0}`")]
    NotCompiled(&'static str),
    /// An error from amp-core (quantize, dequantize, scales).
    #[error(transparent)]
    Core(#[from] amp_core::Error),
    /// An error from candle.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
