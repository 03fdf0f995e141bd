//! Our custom-op mechanism: a kernel with several inputs and several outputs,
//! dispatched over candle's storages in one place.
//!
//! candle's `CustomOp1/2/3` return one tensor; quantize returns two (the codes
//! and the input's amax, from one pass over the data) and the scale update
//! three. So each op here is a [`Kernel`] with a `cpu` body and a `cuda` body
//! beside it (the CUDA bodies live in the `cuda` module, built with the
//! `cuda` feature; without it they answer [`Error::NotCompiled`]); [`launch`]
//! checks devices, takes the storages and wraps the outputs as tensors. None
//! of these ops records a backward: they sit below the autograd ops built on
//! them.
//!
//! Public so that the other crates (the optimizer's fused step) plug their
//! kernels in the same way.

use crate::error::{Error, Result};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, CudaStorage, Layout, Shape, Storage, Tensor};

/// An op of several inputs and outputs.
pub trait Kernel {
    /// The op's name, for errors.
    const NAME: &'static str;
    /// The CPU body. Inputs are contiguous (see [`launch`]).
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>>;

    /// The CUDA body, on the device's stream; no host synchronization and
    /// no device-to-host copy. Inputs are contiguous. The default answers
    /// [`Error::UnsupportedDevice`].
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let device = match inputs.first() {
            Some((s, _)) => s.device().location(),
            None => candle_core::DeviceLocation::Cuda { gpu_id: 0 },
        };
        Err(Error::UnsupportedDevice {
            op: Self::NAME,
            device,
        })
    }
}

/// Runs `kernel` on `inputs` (made contiguous first) and returns its outputs.
///
/// # Errors
/// [`Error::Device`] when inputs live on different devices,
/// [`Error::UnsupportedDevice`] on a device without a body (Metal, or CUDA
/// for a kernel without a CUDA body), and the kernel's own.
pub fn launch<K: Kernel>(kernel: &K, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let first = inputs.first().ok_or(Error::Unsupported {
        op: K::NAME,
        what: "no input".into(),
    })?;
    for t in &inputs[1..] {
        if !t.device().same_device(first.device()) {
            return Err(Error::Device {
                op: K::NAME,
                lhs: first.device().location(),
                rhs: t.device().location(),
            });
        }
    }
    let contiguous = inputs
        .iter()
        .map(|t| t.contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let guards: Vec<_> = contiguous.iter().map(|t| t.storage_and_layout()).collect();
    let unsupported = || Error::UnsupportedDevice {
        op: K::NAME,
        device: first.device().location(),
    };
    match &*guards[0].0 {
        Storage::Cpu(_) => {
            let mut cpu = Vec::with_capacity(guards.len());
            for (storage, layout) in &guards {
                match &**storage {
                    Storage::Cpu(s) => cpu.push((s, *layout)),
                    _ => return Err(unsupported()),
                }
            }
            Ok(kernel
                .cpu(&cpu)?
                .into_iter()
                .map(|(s, shape)| {
                    Tensor::from_storage(Storage::Cpu(s), shape, BackpropOp::none(), false)
                })
                .collect())
        }
        Storage::Cuda(_) => {
            let mut cuda = Vec::with_capacity(guards.len());
            for (storage, layout) in &guards {
                match &**storage {
                    Storage::Cuda(s) => cuda.push((s, *layout)),
                    _ => return Err(unsupported()),
                }
            }
            Ok(kernel
                .cuda(&cuda)?
                .into_iter()
                .map(|(s, shape)| {
                    Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
                })
                .collect())
        }
        _ => Err(unsupported()),
    }
}

/// The contiguous data of a storage as a slice of `T`.
/// # Errors
/// When the storage holds another dtype or the layout is not contiguous.
pub fn slice<'a, T: candle_core::WithDType>(
    op: &'static str,
    storage: &'a CpuStorage,
    layout: &Layout,
) -> Result<&'a [T]> {
    let data = storage.as_slice::<T>()?;
    let (start, end) = layout.contiguous_offsets().ok_or(Error::Unsupported {
        op,
        what: "non-contiguous input".into(),
    })?;
    Ok(&data[start..end])
}

/// The one f32 value of a 1-element storage (a scale or an amax).
/// # Errors
/// When the storage is not one F32 element.
pub fn scalar(op: &'static str, storage: &CpuStorage, layout: &Layout) -> Result<f32> {
    let s = slice::<f32>(op, storage, layout)?;
    match s {
        [v] => Ok(*v),
        _ => Err(Error::Shape {
            op,
            lhs: Shape::from(1usize),
            rhs: layout.shape().clone(),
        }),
    }
}

/// The error of a kernel given the wrong number of inputs.
pub(crate) fn arity(op: &'static str) -> Error {
    Error::Unsupported {
        op,
        what: "wrong number of inputs".into(),
    }
}
