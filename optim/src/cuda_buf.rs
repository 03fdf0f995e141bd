//! The optimizer kernels' output buffers on CUDA: U8, F16 or F32 codes,
//! allocated uninitialized for a kernel that writes every element read.

use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::DType;
use half::f16;

/// An output buffer of U8, F16 or F32 codes (any other dtype: F32), every
/// element of which the kernel it is handed to writes before it is read.
pub(crate) enum Buf {
    U8(candle_core::cuda_backend::cudarc::driver::CudaSlice<u8>),
    F16(candle_core::cuda_backend::cudarc::driver::CudaSlice<f16>),
    F32(candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>),
}

impl Buf {
    pub(crate) fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> amp_core::Result<Self> {
        // SAFETY (all): the kernel the buffer goes to writes every element
        // that is read (lowbit_step's pass 1; lowbit_multi each moment's
        // place, the padding between places never read).
        Ok(match dtype {
            DType::U8 => Self::U8(unsafe { dev.alloc::<u8>(n)? }),
            DType::F16 => Self::F16(unsafe { dev.alloc::<f16>(n)? }),
            _ => Self::F32(unsafe { dev.alloc::<f32>(n)? }),
        })
    }

    pub(crate) fn address(&mut self, dev: &CudaDevice) -> u64 {
        let stream = dev.cuda_stream();
        match self {
            Self::U8(s) => s.device_ptr_mut(&stream).0,
            Self::F16(s) => s.device_ptr_mut(&stream).0,
            Self::F32(s) => s.device_ptr_mut(&stream).0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Self::U8(s) => s.len(),
            Self::F16(s) => s.len(),
            Self::F32(s) => s.len(),
        }
    }

    pub(crate) fn storage(self, dev: &CudaDevice) -> CudaStorage {
        match self {
            Self::U8(s) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
            Self::F16(s) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
            Self::F32(s) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
        }
    }
}
