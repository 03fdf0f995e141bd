//! The activations a Linear can apply inside its op (see
//! [`Fuse::activation`](crate::nn::Fuse)): GELU (GPT-2's MLP) and SwiGLU
//! (Llama's, TE's `LayerNormMLP(activation="swiglu")`), and SwiGLU's op.

use super::cpu;
#[cfg(feature = "cuda")]
use super::ops::wrap;
use super::ops::{f32s, last_dim, store};
use super::pointwise::Gelu;
use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};

/// An activation applied to a Linear's input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh form ([`gelu`](super::gelu)): width unchanged.
    Gelu,
    /// SwiGLU ([`swiglu`]): an input of `2 f` (gate, then up) to `f`.
    SwiGlu,
}

impl Activation {
    /// The input width that gives an output of `out` (the width of the
    /// Linear that takes it).
    pub fn input_width(self, out: usize) -> usize {
        match self {
            Self::Gelu => out,
            Self::SwiGlu => 2 * out,
        }
    }

    /// The activation as a graph op.
    ///
    /// # Errors
    /// As [`gelu`](super::gelu) or [`swiglu`].
    pub fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Gelu => super::gelu(x),
            Self::SwiGlu => swiglu(x),
        }
    }

    /// The activation of a detached `x` (no graph node): what a layer that
    /// applies it inside its own op computes.
    pub(crate) fn detached(self, x: &Tensor) -> Result<Tensor> {
        let x = x.detach().contiguous()?;
        Ok(match self {
            Self::Gelu => {
                super::float_dtype("gelu", &x)?;
                x.apply_op1_no_bwd(&Gelu)?
            }
            Self::SwiGlu => {
                check(&x)?;
                x.apply_op1_no_bwd(&SwiGlu)?
            }
        })
    }

    /// [`detached`](Self::detached) and, for GELU, the output's amax (F32
    /// `[1]`, bit for bit [`amax`](crate::amax) of the output) from the same
    /// pass on CUDA: what an FP8 cast of the output under current scaling
    /// needs. `None` for SwiGLU.
    pub(crate) fn detached_amax(self, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        match self {
            Self::Gelu => {
                let x = x.detach().contiguous()?;
                super::float_dtype("gelu", &x)?;
                let [y, amax] =
                    <[Tensor; 2]>::try_from(crate::numerics::kernel::launch(&GeluAmax, &[&x])?)
                        .map_err(|_| Error::Unsupported {
                            op: "gelu_amax",
                            what: "two outputs".into(),
                        })?;
                Ok((y, Some(amax)))
            }
            Self::SwiGlu => Ok((self.detached(x)?, None)),
        }
    }

    /// The gradient of the activation's input `z` from its output's `dy`,
    /// detached: the backward of a layer that applied it inside its op.
    pub(crate) fn backward_detached(self, z: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let z = z.detach().contiguous()?;
        let dy = dy.contiguous()?;
        Ok(match self {
            Self::Gelu => super::pointwise::gelu_bwd(&z, &dy)?,
            Self::SwiGlu => z.apply_op2_no_bwd(&dy, &SwiGluBwd)?,
        })
    }

    /// The gradient `dz` of the activation's input `z` from its output's
    /// `dy` (detached, no graph node), with the column sums of `dz` (F32
    /// `[cols]`: the gradient of a bias added to `z`) and its amax (F32
    /// `[1]`, as [`amax`](crate::amax) takes it: what `dz`'s
    /// current-scaling cast needs), from one pass on CUDA, bit for bit the
    /// separate backward, bias gradient and amax: `(dz, sums, amax)`.
    /// A Linear whose output feeds the activation's Linear gets its bias
    /// gradient this way. `None` for SwiGLU and for dtypes other than F32
    /// and BF16.
    ///
    /// # Errors
    /// candle's.
    pub fn backward_with_col_sums(
        self,
        z: &Tensor,
        dy: &Tensor,
    ) -> Result<Option<(Tensor, Tensor, Tensor)>> {
        let float = |t: &Tensor| {
            matches!(
                t.dtype(),
                candle_core::DType::F32 | candle_core::DType::BF16
            )
        };
        if self != Self::Gelu || !float(z) || z.dtype() != dy.dtype() || z.shape() != dy.shape() {
            return Ok(None);
        }
        let z = z.detach().contiguous()?;
        let dy = dy.contiguous()?;
        let [dz, both] =
            <[Tensor; 2]>::try_from(crate::numerics::kernel::launch(&GeluBwdColSum, &[&z, &dy])?)
                .map_err(|_| Error::Unsupported {
                op: "gelu_bwd_col_sum_amax",
                what: "two outputs".into(),
            })?;
        let cols = both.elem_count() - 1;
        Ok(Some((
            dz,
            both.narrow(0, 0, cols)?,
            both.narrow(0, cols, 1)?,
        )))
    }
}

/// GELU's backward `dz` of `(z, dy)` and `col_sum_amax` of `dz`:
/// `[dz, sums and amax [cols + 1]]`.
struct GeluBwdColSum;

impl crate::numerics::kernel::Kernel for GeluBwdColSum {
    const NAME: &'static str = "gelu_bwd_col_sum_amax";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(z, lz), (g, lg)] = inputs else {
            return Err(Error::Unsupported {
                op: Self::NAME,
                what: "two inputs".into(),
            });
        };
        let (dz, shape) = super::pointwise::GeluBwd.cpu_fwd(z, lz, g, lg)?;
        let (both, bshape) = super::pointwise::ColSum { amax: true }
            .cpu_fwd(&dz, &Layout::contiguous(shape.clone()))?;
        Ok(vec![(dz, shape), (both, bshape)])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> Result<Vec<(candle_core::CudaStorage, Shape)>> {
        let [(z, lz), (g, lg)] = inputs else {
            return Err(Error::Unsupported {
                op: Self::NAME,
                what: "two inputs".into(),
            });
        };
        let shape = lz.shape().clone();
        let cols = last_dim(lz);
        let (dz, both) = match super::cuda::layout::gelu_bwd_col_sum_amax(z, lz, g, lg)? {
            Some(out) => out,
            // rows not whole 16-byte words: the two kernels
            None => {
                let dz = super::cuda::ops::gelu(z, lz, Some((g, lg)))?;
                let both =
                    super::cuda::layout::col_sum_amax(&dz, &Layout::contiguous(shape.clone()))?;
                (dz, both)
            }
        };
        Ok(vec![(dz, shape), (both, Shape::from(cols + 1))])
    }
}

/// SwiGLU over the last dimension: `x` `[.., 2 f]` (gate `a`, then up `b`,
/// side by side as one projection produces them) to `silu(a) * b` `[..,
/// f]`, with `silu(a) = a / (1 + exp(-a))`; math in F32, the output in
/// `x`'s dtype; a one-kernel backward.
///
/// # Errors
/// [`Error::DType`] for a non-float input, [`Error::Shape`] for an odd or
/// zero last dimension; candle's.
pub fn swiglu(x: &Tensor) -> Result<Tensor> {
    check(x)?;
    Ok(x.contiguous()?.apply_op1(SwiGlu)?)
}

/// A float input with an even, non-zero last dimension.
fn check(x: &Tensor) -> Result<()> {
    super::float_dtype("swiglu", x)?;
    match x.dims().last() {
        Some(&w) if w > 0 && w % 2 == 0 => Ok(()),
        _ => Err(Error::Shape {
            op: "swiglu",
            lhs: x.shape().clone(),
            rhs: Shape::from(2),
        }),
    }
}

/// `x`'s shape with the last dimension halved.
fn halved(l: &Layout) -> Shape {
    let mut dims = l.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last /= 2;
    }
    Shape::from(dims)
}

/// SwiGLU as an op.
struct SwiGlu;

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "amp_swiglu"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let f = last_dim(l) / 2;
        let v = f32s(x, l)?;
        let mut out = Vec::with_capacity(v.len() / 2);
        for row in v.chunks(2 * f.max(1)) {
            let (a, b) = row.split_at(f);
            out.extend(a.iter().zip(b).map(|(&a, &b)| cpu::swiglu(a, b)));
        }
        Ok((store(out, x.dtype()), halved(l)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::ops::swiglu(x, l, None).map_err(wrap)?;
        Ok((out, halved(l)))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&dy.contiguous()?, &SwiGluBwd)?))
    }
}

/// SwiGLU's input gradient of `(x, dy)`.
struct SwiGluBwd;

impl CustomOp2 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "amp_swiglu_bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let f = last_dim(lx) / 2;
        let (v, g) = (f32s(x, lx)?, f32s(g, lg)?);
        if g.len() * 2 != v.len() {
            candle_core::bail!("amp_swiglu_bwd: a gradient of another size");
        }
        let mut out = vec![0f32; v.len()];
        for ((row, dy), o) in v
            .chunks(2 * f.max(1))
            .zip(g.chunks(f.max(1)))
            .zip(out.chunks_mut(2 * f.max(1)))
        {
            let (a, b) = row.split_at(f);
            let (da, db) = o.split_at_mut(f);
            for k in 0..f {
                (da[k], db[k]) = cpu::swiglu_grad(a[k], b[k], dy[k]);
            }
        }
        Ok((store(out, x.dtype()), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        if lg.shape().elem_count() * 2 != lx.shape().elem_count() {
            candle_core::bail!("amp_swiglu_bwd: a gradient of another size");
        }
        let out = super::cuda::ops::swiglu(x, lx, Some((g, lg))).map_err(wrap)?;
        Ok((out, lx.shape().clone()))
    }
}

/// GELU of `x` and `max |y|` of its stored outputs: `[y, amax]`.
struct GeluAmax;

impl crate::numerics::kernel::Kernel for GeluAmax {
    const NAME: &'static str = "gelu_amax";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(x, l)] = inputs else {
            return Err(Error::Unsupported {
                op: Self::NAME,
                what: "one input".into(),
            });
        };
        let (y, shape) = Gelu.cpu_fwd(x, l)?;
        // the amax of what is stored (rounded to x's dtype), as `amax` reads it
        let stored = f32s(&y, &Layout::contiguous(shape.clone()))?;
        let amax = crate::numerics::cast::amax_of(&stored);
        Ok(vec![
            (y, shape),
            (CpuStorage::F32(vec![amax]), Shape::from(1usize)),
        ])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> Result<Vec<(candle_core::CudaStorage, Shape)>> {
        let [(x, l)] = inputs else {
            return Err(Error::Unsupported {
                op: Self::NAME,
                what: "one input".into(),
            });
        };
        let (y, amax) = super::cuda::ops::gelu_amax(x, l)?;
        Ok(vec![(y, l.shape().clone()), (amax, Shape::from(1usize))])
    }
}
