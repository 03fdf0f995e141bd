//! The NCCL backend's stand-in in builds without feature `nccl`: the same
//! API, whose constructors return [`Error::NotCompiled`] (candle's
//! `dummy_cuda_backend` habit). No value of it can exist.

use crate::communicator::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::launch::{LaunchEnv, RendezvousConfig};
use candle_core::{Device, Tensor};

enum Never {}

/// The NCCL backend; this build has no NCCL (feature `nccl`), so every
/// constructor returns [`Error::NotCompiled`].
pub struct NcclComm {
    never: Never,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.never {}
    }
}

impl NcclComm {
    /// Built without feature `nccl`.
    ///
    /// # Errors
    /// Always [`Error::NotCompiled`].
    pub fn from_env() -> Result<Self> {
        Err(Error::NotCompiled("nccl"))
    }

    /// Built without feature `nccl`.
    ///
    /// # Errors
    /// Always [`Error::NotCompiled`].
    pub fn new(_launch: &LaunchEnv, _rendezvous: &RendezvousConfig) -> Result<Self> {
        Err(Error::NotCompiled("nccl"))
    }

    /// Built without feature `nccl`.
    ///
    /// # Errors
    /// Always [`Error::NotCompiled`].
    pub fn with_device(
        _device: Device,
        _rank: usize,
        _world_size: usize,
        _rendezvous: &RendezvousConfig,
    ) -> Result<Self> {
        Err(Error::NotCompiled("nccl"))
    }

    /// Built without feature `nccl`.
    ///
    /// # Errors
    /// Always [`Error::NotCompiled`].
    pub fn nccl_version() -> Result<i32> {
        Err(Error::NotCompiled("nccl"))
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        match self.never {}
    }
    fn world_size(&self) -> usize {
        match self.never {}
    }
    fn device(&self) -> &Device {
        match self.never {}
    }
    fn all_reduce(&self, _: &Tensor, _: ReduceOp) -> Result<Tensor> {
        match self.never {}
    }
    fn reduce_scatter(&self, _: &Tensor, _: ReduceOp) -> Result<Tensor> {
        match self.never {}
    }
    fn all_gather(&self, _: &Tensor) -> Result<Tensor> {
        match self.never {}
    }
    fn all_gather_shards(&self, _: &Tensor, _: usize) -> Result<Tensor> {
        match self.never {}
    }
    fn broadcast(&self, _: &Tensor, _: usize) -> Result<Tensor> {
        match self.never {}
    }
    fn all_to_all(&self, _: &[Tensor]) -> Result<Vec<Tensor>> {
        match self.never {}
    }
    fn barrier(&self) -> Result<()> {
        match self.never {}
    }
    fn bytes_sent(&self) -> u64 {
        match self.never {}
    }
    fn reset_bytes_sent(&self) {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_say_the_feature_is_missing() {
        let err = NcclComm::from_env().unwrap_err();
        assert!(matches!(err, Error::NotCompiled("nccl")));
        assert_eq!(err.to_string(), "built without feature `nccl`");
        assert!(NcclComm::nccl_version().is_err());
    }
}
