//! The pointwise and layout ops as candle custom ops: GELU and its
//! backward, the bias add and its column-sum gradient, the 2-D transpose
//! of codes.

use super::cpu;
#[cfg(feature = "cuda")]
use super::ops::wrap;
use super::ops::{f32s, last_dim, store};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// GELU, tanh form.
pub(super) struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "amp_gelu"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = f32s(x, l)?.into_iter().map(cpu::gelu).collect();
        Ok((store(v, x.dtype()), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::ops::gelu(x, l, None).map_err(wrap)?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(gelu_bwd(x, &dy.contiguous()?)?))
    }
}

/// `dy * gelu'(x)` of a contiguous `dy`, one kernel, no graph node.
pub(super) fn gelu_bwd(x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    x.apply_op2_no_bwd(dy, &GeluBwd)
}

/// `dy * gelu'(x)` of `(x, dy)`.
pub(super) struct GeluBwd;

impl CustomOp2 for GeluBwd {
    fn name(&self) -> &'static str {
        "amp_gelu_bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let v = f32s(x, lx)?
            .into_iter()
            .zip(f32s(g, lg)?)
            .map(|(x, g)| g * cpu::gelu_grad(x))
            .collect();
        Ok((store(v, x.dtype()), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::ops::gelu(x, lx, Some((g, lg))).map_err(wrap)?;
        Ok((out, lx.shape().clone()))
    }
}

/// `x + b` over the rows of `x` (F32 `b`); backward: `dy`, and the column
/// sums of `dy` for `b`.
pub(crate) struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "amp_bias_add"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let b = f32s(b, lb)?;
        let mut v = f32s(x, lx)?;
        for row in v.chunks_mut(b.len().max(1)) {
            row.iter_mut().zip(&b).for_each(|(y, b)| *y += b);
        }
        Ok((store(v, x.dtype()), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::layout::bias_add(x, lx, b, lb).map_err(wrap)?;
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let db = dy
            .apply_op1_no_bwd(&ColSum { amax: false })?
            .reshape(b.shape())?;
        Ok((Some(dy), Some(db)))
    }
}

/// The sums over the rows (all dimensions but the last), F32, in the order
/// of `cpu::col_sum` on both devices (the same bits); with `amax`, one
/// element more: `max |x|` as the `amax` kernel takes it, from the same
/// pass over `x`.
pub(super) struct ColSum {
    pub amax: bool,
}

impl CustomOp1 for ColSum {
    fn name(&self) -> &'static str {
        match self.amax {
            true => "amp_col_sum_amax",
            false => "amp_col_sum",
        }
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let cols = last_dim(l);
        let xs = f32s(x, l)?;
        let mut out = super::cpu::col_sum(&xs, cols);
        if self.amax {
            out.push(crate::numerics::cast::amax_of(&xs));
        }
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let cols = last_dim(l);
        Ok(match self.amax {
            true => (
                super::cuda::layout::col_sum_amax(x, l).map_err(wrap)?,
                Shape::from(cols + 1),
            ),
            false => (
                super::cuda::layout::col_sum(x, l).map_err(wrap)?,
                Shape::from(cols),
            ),
        })
    }
}
