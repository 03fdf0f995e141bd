//! The transpose of a 2-D tensor into a contiguous one: the K-major GEMM
//! operands of dgrad and wgrad (FP8 codes, FP16 values). On CUDA a tiled
//! kernel for 1- and 2-byte elements (candle's strided copy moves FP8
//! codes at a tenth of the bandwidth); candle's copy otherwise. Not
//! differentiable.

use crate::error::{Error, Result};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

/// The transpose of a 2-D tensor, contiguous.
///
/// # Errors
/// [`Error::Rank`] unless 2-D; candle's.
pub(crate) fn transpose_2d(t: &Tensor) -> Result<Tensor> {
    if t.rank() != 2 {
        return Err(Error::Rank {
            op: "transpose_2d",
            expected: 2,
            got: t.shape().clone(),
        });
    }
    // the kernel's grid has one row of 32 x 32 tiles per 32 rows: at most
    // 65535 of them (2M rows); beyond that, candle's copy
    let tiles_fit = t.dim(0)?.div_ceil(32) <= 65_535;
    if t.device().is_cuda()
        && tiles_fit
        && matches!(t.dtype(), DType::U8 | DType::F16 | DType::BF16)
    {
        return Ok(t.contiguous()?.apply_op1_no_bwd(&Transpose2d)?);
    }
    Ok(t.t()?.contiguous()?)
}

/// The tiled kernel as a candle op (CUDA only; the CPU uses candle's copy).
struct Transpose2d;

impl CustomOp1 for Transpose2d {
    fn name(&self) -> &'static str {
        "amp_transpose_2d"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp_transpose_2d: CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = l.shape().dims2()?;
        let out = crate::numerics::cuda::transpose::transpose_2d(s, l)
            .map_err(candle_core::Error::wrap)?;
        Ok((out, Shape::from((cols, rows))))
    }
}
