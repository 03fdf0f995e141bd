//! The FP8 Linear's non-finite flag. A saturating cast turns inf into the
//! format's max; where a cast's amax is not finite, the GEMM that reads
//! its codes must still give NaN, so the flag (1, or NaN) rides in the
//! operand's scale_inv: an FP8 GEMM applies scale_inv to its result
//! (cuBLASLt through its scale pointers), so it reaches every output
//! element at no extra pass, and with a finite amax the product is
//! bit-identical to the unflagged one.

use crate::error::Result;
use crate::numerics::kernel::arity;
use crate::numerics::kernel::{launch, scalar, Kernel};
use crate::scaling::meta::ScalingMeta;
use crate::scaling::tensor::ScalingTensor;
use candle_core::{CpuStorage, CudaStorage, Layout, Shape, Tensor};

/// `t` with its scale_inv multiplied by its cast's `amax * 0 + 1` (1 when
/// finite, NaN otherwise), in one launch (`scale_inv * (amax * 0 + 1)`)
/// where an affine and a product took two.
pub(crate) fn flagged_by_amax(t: &ScalingTensor) -> Result<ScalingTensor> {
    let m = t.meta();
    if m.flagged() {
        // the cast kernel multiplied the flag in already
        return Ok(t.clone());
    }
    let [scale_inv] = <[Tensor; 1]>::try_from(launch(&FlagScaleInv, &[m.scale_inv(), &m.amax()?])?)
        .map_err(|_| arity(FlagScaleInv::NAME))?;
    let meta = ScalingMeta::from_parts(
        t.qtype(),
        m.scale().clone(),
        scale_inv,
        m.amax_history().clone(),
    )?;
    ScalingTensor::from_parts(t.data().clone(), meta)
}

/// `v * (amax * 0 + 1)` for 1-element F32 tensors: `v`, or NaN where
/// `amax` is not finite (one launch).
pub(crate) fn flagged(v: &Tensor, amax: &Tensor) -> Result<Tensor> {
    let [out] = <[Tensor; 1]>::try_from(launch(&FlagScaleInv, &[v, amax])?)
        .map_err(|_| arity(FlagScaleInv::NAME))?;
    Ok(out)
}

/// scale_inv, amax -> scale_inv * (amax * 0 + 1), in f32.
struct FlagScaleInv;

impl Kernel for FlagScaleInv {
    const NAME: &'static str = "flag_scale_inv";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(s, ls), (a, la)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let v = scalar(Self::NAME, s, ls)? * (scalar(Self::NAME, a, la)? * 0.0 + 1.0);
        Ok(vec![(CpuStorage::F32(vec![v]), ls.shape().clone())])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::flag_scale_inv(inputs)
    }
}
