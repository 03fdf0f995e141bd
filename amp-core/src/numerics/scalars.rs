//! Many one-element device tensors read to the host at once: the
//! optimizer's per-tensor sums of squares and gradient amaxes, read once
//! per step. On CUDA one small gather kernel per 256 values writes them
//! side by side and one copy brings them back (a concatenation launched a
//! copy per value, and a conversion per F32 one).

use crate::error::{Error, Result};
use crate::numerics::kernel::{launch, scalar, slice, Kernel};
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape, Tensor};

/// The values of one-element F32 or F64 tensors on one device, as F64 (F32
/// widened exactly), in order; one device-to-host copy.
///
/// ```
/// use amp_core::read_scalars;
/// use candle_core::{Device, Tensor};
/// let a = Tensor::new(&[1.5f32], &Device::Cpu)?;
/// let b = Tensor::new(&[-2.0f64], &Device::Cpu)?;
/// assert_eq!(read_scalars(&[&a, &b])?, [1.5, -2.0]);
/// # Ok::<(), amp_core::Error>(())
/// ```
///
/// # Errors
/// [`Error::Shape`] for a tensor of other than one element,
/// [`Error::DType`] for another dtype, [`Error::Device`] for tensors on
/// different devices.
pub fn read_scalars(ts: &[&Tensor]) -> Result<Vec<f64>> {
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    Ok(gather_scalars(ts)?.to_vec1::<f64>()?)
}

/// [`read_scalars`] without the read: the values side by side in one F64
/// tensor on their device (one launch per 256 values on CUDA), for a kernel
/// that reads them there.
///
/// # Errors
/// As [`read_scalars`]; [`Error::Unsupported`] for no tensors.
pub fn gather_scalars(ts: &[&Tensor]) -> Result<Tensor> {
    const OP: &str = "read_scalars";
    for t in ts {
        if t.elem_count() != 1 {
            return Err(Error::Shape {
                op: OP,
                lhs: Shape::from(1usize),
                rhs: t.shape().clone(),
            });
        }
        if !matches!(t.dtype(), DType::F32 | DType::F64) {
            return Err(Error::DType {
                op: OP,
                expected: "F32 or F64",
                got: t.dtype(),
            });
        }
    }
    let [out] = <[Tensor; 1]>::try_from(launch(&Gather, ts)?).map_err(|_| Error::Unsupported {
        op: OP,
        what: "a gather without its output".into(),
    })?;
    Ok(out)
}

struct Gather;

impl Kernel for Gather {
    const NAME: &'static str = "read_scalars";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let values = inputs
            .iter()
            .map(|(s, l)| match s {
                CpuStorage::F64(_) => Ok(slice::<f64>(Self::NAME, s, l)?[0]),
                _ => Ok(f64::from(scalar(Self::NAME, s, l)?)),
            })
            .collect::<Result<Vec<f64>>>()?;
        let n = values.len();
        Ok(vec![(CpuStorage::F64(values), Shape::from(n))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::gather_scalars(inputs)
    }
}
