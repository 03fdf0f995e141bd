//! Transformer Engine's normalisation modules: `LayerNorm`, `LayerNormLinear`
//! (LayerNorm then an FP8 Linear) and `LayerNormMLP` (LayerNorm, fc1, GELU,
//! fc2).
//!
//! Trap avoided: `candle_nn::LayerNorm` runs a fused op without a backward
//! for contiguous inputs with a bias, so gradients stop there during
//! training. Ours runs `fused::layer_norm` (forward and backward kernels)
//! whenever an input or parameter is tracked, candle's fused op for
//! inference, and composes candle ops for parameters other than F32.

use super::build::linear_b;
use super::linear::Linear;
use crate::error::{Error, Result};
use candle_core::{DType, Module, Tensor, D};

/// Layer normalisation over the last dimension with a learned scale
/// (`weight`, init 1) and shift (`bias`, init 0), F32 parameters.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// From existing parameters.
    ///
    /// # Errors
    /// [`Error::Shape`] unless both are 1-D of one length.
    pub fn new(weight: Tensor, bias: Tensor, eps: f64) -> Result<Self> {
        if weight.rank() != 1 || weight.shape() != bias.shape() {
            return Err(Error::Shape {
                op: "LayerNorm::new",
                lhs: weight.shape().clone(),
                rhs: bias.shape().clone(),
            });
        }
        Ok(Self { weight, bias, eps })
    }

    /// `x`'s last dimension must be the layer's.
    fn check(&self, x: &Tensor) -> Result<()> {
        let dim = self.weight.elem_count();
        if x.rank() == 0 || x.dim(D::Minus1)? != dim {
            return Err(Error::Shape {
                op: "LayerNorm::forward",
                lhs: x.shape().clone(),
                rhs: (dim,).into(),
            });
        }
        Ok(())
    }

    /// Whether `fused::layer_norm`'s kernels take `x` and the parameters
    /// (F32 parameters; F32 or BF16 input on CUDA, any float on the CPU).
    fn fused_kernels(&self, x: &Tensor) -> bool {
        let fused_dtype = matches!(x.dtype(), DType::F32 | DType::BF16) || !x.device().is_cuda();
        self.weight.dtype() == DType::F32 && self.bias.dtype() == DType::F32 && fused_dtype
    }

    /// The forward pass.
    ///
    /// # Errors
    /// [`Error::Shape`] when the last dimension is not the layer's.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        self.check(x)?;
        if !(x.track_op() || self.weight.track_op() || self.bias.track_op())
            && x.is_contiguous()
            && x.dtype() == DType::F32
        {
            return Ok(candle_nn::ops::layer_norm(
                x,
                &self.weight,
                &self.bias,
                self.eps as f32,
            )?);
        }
        if self.fused_kernels(x) {
            // one kernel forward, two backward (`fused::layer_norm`)
            return super::fused::layer_norm(x, &self.weight, &self.bias, self.eps);
        }
        let internal = match x.dtype() {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        };
        let xf = x.to_dtype(internal)?;
        let centered = xf.broadcast_sub(&xf.mean_keepdim(D::Minus1)?)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        Ok(normed
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)?
            .to_dtype(x.dtype())?)
    }
}

impl LayerNorm {
    /// The forward handed to the next op outside candle's graph (see
    /// [`Fuse::norm`](super::Fuse::norm)): `(out, token, handoff)` where
    /// the fused kernels run (F32 parameters, F32 or BF16 input; any float
    /// input on the CPU) and an input or parameter is tracked; `None`
    /// otherwise (then [`try_forward`](Self::try_forward)).
    ///
    /// # Errors
    /// As [`try_forward`](Self::try_forward).
    pub(crate) fn try_handoff(
        &self,
        x: &Tensor,
        res_grad: Option<super::fused::ResidualGrad>,
    ) -> Result<Option<(Tensor, Tensor, super::fused::Handoff)>> {
        self.check(x)?;
        let tracked = x.track_op() || self.weight.track_op() || self.bias.track_op();
        if !(tracked && self.fused_kernels(x)) {
            return Ok(None);
        }
        super::fused::layer_norm_handoff(x, &self.weight, &self.bias, self.eps, res_grad).map(Some)
    }
}

impl Module for LayerNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(x).map_err(candle_core::Error::wrap)
    }
}

/// A [`LayerNorm`] from a `VarBuilder` (`<prefix>.weight`, `<prefix>.bias`).
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn layer_norm(dim: usize, eps: f64, vb: candle_nn::VarBuilder) -> Result<LayerNorm> {
    let weight = vb.get_with_hints(dim, "weight", candle_nn::Init::Const(1.0))?;
    let bias = vb.get_with_hints(dim, "bias", candle_nn::Init::Const(0.0))?;
    LayerNorm::new(weight, bias, eps)
}

/// LayerNorm followed by an FP8 Linear (TE's `LayerNormLinear`); the
/// normalised output is what the Linear casts to FP8.
#[derive(Debug, Clone)]
pub struct LayerNormLinear {
    /// The normalisation (`<prefix>.layer_norm`).
    pub norm: LayerNorm,
    /// The projection (`<prefix>.linear`).
    pub linear: Linear,
}

/// A [`LayerNormLinear`] from a `VarBuilder`.
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn layer_norm_linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    eps: f64,
    vb: candle_nn::VarBuilder,
) -> Result<LayerNormLinear> {
    Ok(LayerNormLinear {
        norm: layer_norm(in_dim, eps, vb.pp("layer_norm"))?,
        linear: linear_b(in_dim, out_dim, bias, vb.pp("linear"))?,
    })
}

impl Module for LayerNormLinear {
    /// `linear(norm(x))`, the normalised output handed to the Linear's op
    /// ([`Fuse::norm`](super::Fuse::norm)): not kept for backward.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let fuse = super::Fuse {
            norm: Some(&self.norm),
            ..Default::default()
        };
        self.linear
            .forward_with(x, fuse)
            .map_err(candle_core::Error::wrap)
    }
}

/// LayerNorm, fc1, GELU (tanh approximation, TE's `gelu`: [`fused::gelu`]),
/// fc2 (TE's `LayerNormMLP`); both GEMMs in FP8 inside a scope.
///
/// [`fused::gelu`]: super::fused::gelu
#[derive(Debug, Clone)]
pub struct LayerNormMLP {
    /// The normalisation (`<prefix>.layer_norm`).
    pub norm: LayerNorm,
    /// Up projection (`<prefix>.fc1`).
    pub fc1: Linear,
    /// Down projection (`<prefix>.fc2`).
    pub fc2: Linear,
}

/// A [`LayerNormMLP`] `dim -> hidden -> dim` from a `VarBuilder`.
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn layer_norm_mlp(
    dim: usize,
    hidden: usize,
    eps: f64,
    vb: candle_nn::VarBuilder,
) -> Result<LayerNormMLP> {
    Ok(LayerNormMLP {
        norm: layer_norm(dim, eps, vb.pp("layer_norm"))?,
        fc1: linear_b(dim, hidden, true, vb.pp("fc1"))?,
        fc2: linear_b(hidden, dim, true, vb.pp("fc2"))?,
    })
}

impl Module for LayerNormMLP {
    /// `fc2(gelu(fc1(norm(x))))` through [`pre_norm_mlp`](super::pre_norm_mlp):
    /// the tensors between the parts handed op to op.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        super::pre_norm_mlp(x, &self.norm, &self.fc1, &self.fc2, false)
            .map_err(candle_core::Error::wrap)
    }
}
