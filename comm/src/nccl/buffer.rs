//! Device memory of candle's CUDA tensors as NCCL buffers: byte views of
//! any dtype (the data-moving collectives send bytes), F32 views for the
//! reductions, and freshly allocated outputs wrapped as tensors.

use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{DType, Layout, Shape, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr};
use std::sync::Arc;

const DTYPES: &str = "U8, U32, I16, I32, I64, F16, BF16, F32, F64 or F8E4M3";

fn cuda_storage<'a>(op: &'static str, storage: &'a Storage) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        // The communicator checks devices first; this is a second line.
        _ => Err(Error::UnsupportedDevice {
            op,
            backend: "nccl",
            device: candle_core::DeviceLocation::Cpu,
        }),
    }
}

fn range_error(op: &'static str, have: usize, start: usize, n: usize) -> Error {
    Error::InvalidArgument {
        op,
        what: format!(
            "storage holds {have} elements, the layout reads {start}..{}",
            start + n
        ),
    }
}

fn as_bytes<'a, T>(
    op: &'static str,
    s: &'a CudaSlice<T>,
    start: usize,
    n: usize,
) -> Result<CudaView<'a, u8>> {
    let view = s
        .try_slice(start..start + n)
        .ok_or_else(|| range_error(op, s.len(), start, n))?;
    // SAFETY: the view covers exactly the `n` elements (`n * size_of::<T>()`
    // bytes), and every bit pattern is a valid `u8`.
    unsafe { view.transmute::<u8>(n * std::mem::size_of::<T>()) }
        .ok_or_else(|| range_error(op, s.len(), start, n))
}

fn as_bytes_mut<T>(s: &mut CudaSlice<T>, n: usize) -> Option<CudaViewMut<'_, u8>> {
    // SAFETY: the candle dtypes allocated here are plain numbers for which
    // every bit pattern is valid, so writing arbitrary bytes keeps them valid.
    unsafe { s.transmute_mut::<u8>(n * std::mem::size_of::<T>()) }
}

/// The `n` elements a contiguous `layout` reads, as bytes.
pub(super) fn bytes<'a>(
    op: &'static str,
    storage: &'a Storage,
    layout: &Layout,
    n: usize,
) -> Result<CudaView<'a, u8>> {
    let start = layout.start_offset();
    let cs = cuda_storage(op, storage)?;
    match &cs.slice {
        CudaStorageSlice::U8(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::U32(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::I16(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::I32(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::I64(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::BF16(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::F16(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::F32(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::F64(s) => as_bytes(op, s, start, n),
        CudaStorageSlice::F8E4M3(s) => as_bytes(op, s, start, n),
        _ => Err(Error::DType {
            op,
            expected: DTYPES,
            got: cs.dtype(),
        }),
    }
}

/// The `n` F32 elements a contiguous `layout` reads.
pub(super) fn f32s<'a>(
    op: &'static str,
    storage: &'a Storage,
    layout: &Layout,
    n: usize,
) -> Result<CudaView<'a, f32>> {
    let start = layout.start_offset();
    let cs = cuda_storage(op, storage)?;
    match &cs.slice {
        CudaStorageSlice::F32(s) => s
            .try_slice(start..start + n)
            .ok_or_else(|| range_error(op, s.len(), start, n)),
        _ => Err(Error::DType {
            op,
            expected: "F32",
            got: cs.dtype(),
        }),
    }
}

/// A fresh, uninitialised device buffer of `n` elements of `dtype`, which a
/// collective fills completely before [`into_tensor`](Self::into_tensor).
pub(super) struct Output {
    slice: CudaStorageSlice,
    n: usize,
}

fn alloc<T: DeviceRepr>(device: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: uninitialised memory; every `Output` is completely written by
    // the collective it is passed to before it becomes a tensor. One element
    // at least: the driver refuses empty allocations.
    unsafe { device.alloc::<T>(n.max(1)) }.map_err(|e| Error::Candle(candle_core::Error::wrap(e)))
}

impl Output {
    /// Allocated on `device`, the stream the collective runs on: the
    /// buffer is freed there too, after that stream's work.
    pub(super) fn new(
        op: &'static str,
        device: &Arc<CudaStream>,
        dtype: DType,
        n: usize,
    ) -> Result<Self> {
        let slice = match dtype {
            DType::U8 => CudaStorageSlice::U8(alloc(device, n)?),
            DType::U32 => CudaStorageSlice::U32(alloc(device, n)?),
            DType::I16 => CudaStorageSlice::I16(alloc(device, n)?),
            DType::I32 => CudaStorageSlice::I32(alloc(device, n)?),
            DType::I64 => CudaStorageSlice::I64(alloc(device, n)?),
            DType::BF16 => CudaStorageSlice::BF16(alloc::<half::bf16>(device, n)?),
            DType::F16 => CudaStorageSlice::F16(alloc::<half::f16>(device, n)?),
            DType::F32 => CudaStorageSlice::F32(alloc(device, n)?),
            DType::F64 => CudaStorageSlice::F64(alloc(device, n)?),
            DType::F8E4M3 => CudaStorageSlice::F8E4M3(alloc::<float8::F8E4M3>(device, n)?),
            got => {
                return Err(Error::DType {
                    op,
                    expected: DTYPES,
                    got,
                })
            }
        };
        Ok(Self { slice, n })
    }

    /// All of it, as bytes.
    pub(super) fn bytes(&mut self, op: &'static str) -> Result<CudaViewMut<'_, u8>> {
        let n = self.n;
        let view = match &mut self.slice {
            CudaStorageSlice::U8(s) => as_bytes_mut(s, n),
            CudaStorageSlice::U32(s) => as_bytes_mut(s, n),
            CudaStorageSlice::I16(s) => as_bytes_mut(s, n),
            CudaStorageSlice::I32(s) => as_bytes_mut(s, n),
            CudaStorageSlice::I64(s) => as_bytes_mut(s, n),
            CudaStorageSlice::BF16(s) => as_bytes_mut(s, n),
            CudaStorageSlice::F16(s) => as_bytes_mut(s, n),
            CudaStorageSlice::F32(s) => as_bytes_mut(s, n),
            CudaStorageSlice::F64(s) => as_bytes_mut(s, n),
            CudaStorageSlice::F8E4M3(s) => as_bytes_mut(s, n),
            _ => None,
        };
        view.ok_or(Error::InvalidArgument {
            op,
            what: format!("an output buffer of {n} elements"),
        })
    }

    /// All of it, as F32 (an output allocated as F32).
    pub(super) fn f32s(&mut self, op: &'static str) -> Result<CudaViewMut<'_, f32>> {
        let n = self.n;
        match &mut self.slice {
            CudaStorageSlice::F32(s) => s.try_slice_mut(0..n),
            _ => None,
        }
        .ok_or(Error::InvalidArgument {
            op,
            what: format!("an F32 output buffer of {n} elements"),
        })
    }

    /// The buffer as a tensor of `shape` (`n` elements) on `device`.
    pub(super) fn into_tensor(self, device: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
        let storage = CudaStorage {
            slice: self.slice,
            device: device.clone(),
        };
        Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
    }
}
