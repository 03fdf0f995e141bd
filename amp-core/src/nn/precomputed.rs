//! An output computed before its autograd op is applied: the op's forward
//! hands it to candle once (custom ops return a storage), its backward
//! does the real work. Used by the FP8 Linear and the fused attention.

use crate::error::Error;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Shape, Storage, Tensor};
use std::sync::Mutex;

/// The output, taken by the op's first (and only) forward.
pub(crate) struct Precomputed {
    op: &'static str,
    y: Mutex<Option<Tensor>>,
}

fn wrap(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

impl Precomputed {
    pub(crate) fn new(op: &'static str, y: Tensor) -> Self {
        Self {
            op,
            y: Mutex::new(Some(y)),
        }
    }

    /// The output, contiguous (once: a second forward is an error).
    pub(crate) fn take(&self) -> candle_core::Result<Tensor> {
        let op = self.op;
        let y = self
            .y
            .lock()
            .map_err(|_| wrap(Error::Poisoned { op }))?
            .take()
            .ok_or_else(|| {
                wrap(Error::Unsupported {
                    op,
                    what: "forward run twice".into(),
                })
            })?;
        y.contiguous()
    }

    /// The output as a CPU storage.
    pub(crate) fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((s.try_clone(layout)?, y.shape().clone())),
            _ => Err(wrap(Error::UnsupportedDevice {
                op: self.op,
                device: y.device().location(),
            })),
        }
    }

    /// The output copied into a fresh CUDA storage (candle's custom ops
    /// return their own).
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let y = self.take()?;
        let (storage, layout) = y.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((s.try_clone(layout)?, y.shape().clone())),
            _ => Err(wrap(Error::UnsupportedDevice {
                op: self.op,
                device: y.device().location(),
            })),
        }
    }
}

/// The `cpu_fwd` and `cuda_fwd` of a custom op (arity 1, 2 or 3) whose
/// output is its [`Precomputed`] field `y`.
macro_rules! precomputed_fwd {
    (1) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            self.y.cpu()
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            self.y.cuda()
        }
    };
    (2) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            self.y.cpu()
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            self.y.cuda()
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            self.y.cpu()
        }

        /// The output computed before the op was applied, copied into the
        /// op's own storage (candle's custom ops return a fresh storage).
        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            self.y.cuda()
        }
    };
}
pub(crate) use precomputed_fwd;
