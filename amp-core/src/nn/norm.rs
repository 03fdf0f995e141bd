//! `LayerNorm` and its RMS form (RMSNorm), with a backward (Transformer
//! Engine's normalisation layers; the composite `LayerNormLinear` and
//! `LayerNormMLP` are in `blocks.rs`, and take either form, as TE's
//! `normalization="RMSNorm"`).
//!
//! Trap avoided: `candle_nn::LayerNorm` runs a fused op without a backward
//! for contiguous inputs with a bias, so gradients stop there during
//! training. Ours runs `fused::layer_norm` (forward and backward kernels)
//! whenever an input or parameter is tracked, candle's fused op for
//! inference, and composes candle ops for parameters other than F32.

use crate::error::{Error, Result};
use candle_core::{DType, Module, Tensor, D};

/// A LayerNorm's output handed to the next op: `(out, amax where asked,
/// token, handoff)` (see `fused::layer_norm_handoff`).
pub(crate) type HandedNorm = (Tensor, Option<Tensor>, Tensor, super::fused::Handoff);

/// Layer normalisation over the last dimension with a learned scale
/// (`weight`, init 1) and shift (`bias`, init 0), F32 parameters; or its
/// RMS form ([`LayerNorm::new_rms`], [`rms_norm`]): `x / sqrt(mean(x²) +
/// eps) * weight`, no shift (Llama's RMSNorm).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    /// The shift; zero and not a parameter in the RMS form.
    bias: Tensor,
    eps: f64,
    rms: bool,
}

/// RMSNorm: a [`LayerNorm`] in its RMS form (the same kernels with the
/// mean taken as 0, and no shift), built by [`rms_norm`] or
/// [`LayerNorm::new_rms`]; every block that takes a LayerNorm takes it.
pub type RmsNorm = LayerNorm;

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
        Ok(Self {
            weight,
            bias,
            eps,
            rms: false,
        })
    }

    /// RMSNorm from its scale (`weight`): `x / sqrt(mean(x²) + eps) *
    /// weight`.
    ///
    /// # Errors
    /// [`Error::Shape`] unless `weight` is 1-D.
    pub fn new_rms(weight: Tensor, eps: f64) -> Result<Self> {
        let bias = weight.zeros_like()?.detach();
        let mut norm = Self::new(weight, bias, eps)?;
        norm.rms = true;
        Ok(norm)
    }

    /// Whether this is the RMS form (RMSNorm).
    pub fn is_rms(&self) -> bool {
        self.rms
    }

    /// The scale.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The parameters (scale, and the shift unless RMS): what
    /// [`recompute`](super::recompute) needs to be told a block reads.
    pub fn vars(&self) -> Vec<Tensor> {
        if self.rms {
            vec![self.weight.clone()]
        } else {
            vec![self.weight.clone(), self.bias.clone()]
        }
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

    /// Whether the norm hands its output on `x` (and takes a handed `x`):
    /// its fused kernels run there.
    pub(crate) fn can_hand(&self, x: &Tensor) -> bool {
        self.fused_kernels(x)
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
            if self.rms {
                return Ok(candle_nn::ops::rms_norm(x, &self.weight, self.eps as f32)?);
            }
            return Ok(candle_nn::ops::layer_norm(
                x,
                &self.weight,
                &self.bias,
                self.eps as f32,
            )?);
        }
        if self.fused_kernels(x) {
            // one kernel forward, two backward (`fused::layer_norm`)
            return super::fused::norm(x, &self.weight, &self.bias, self.eps, self.rms);
        }
        let internal = match x.dtype() {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        };
        let xf = x.to_dtype(internal)?;
        let centered = if self.rms {
            xf
        } else {
            xf.broadcast_sub(&xf.mean_keepdim(D::Minus1)?)?
        };
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let scaled = normed.broadcast_mul(&self.weight.to_dtype(internal)?)?;
        let out = if self.rms {
            scaled
        } else {
            scaled.broadcast_add(&self.bias.to_dtype(internal)?)?
        };
        Ok(out.to_dtype(x.dtype())?)
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
        want_amax: bool,
        x_from: Option<(Tensor, super::fused::Handoff)>,
    ) -> Result<Option<HandedNorm>> {
        self.check(x)?;
        let x_tracked = match &x_from {
            Some((token, _)) => token.track_op(),
            None => x.track_op(),
        };
        let tracked = x_tracked || self.weight.track_op() || self.bias.track_op();
        if !(tracked && self.fused_kernels(x)) {
            return Ok(None);
        }
        super::fused::layer_norm_handoff(
            x,
            &self.weight,
            &self.bias,
            (self.eps, self.rms),
            (res_grad, x_from),
            want_amax,
        )
        .map(Some)
    }
}

impl LayerNorm {
    /// The output again, as the handed forward computed it (the fused
    /// kernel on detached tensors): what `nn::selective` casts again.
    pub(crate) fn recomputed(&self, x: &Tensor) -> Result<Tensor> {
        super::fused::norm(
            &x.detach(),
            &self.weight.detach(),
            &self.bias.detach(),
            self.eps,
            self.rms,
        )
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

/// An [`RmsNorm`] from a `VarBuilder` (`<prefix>.weight`, init 1; no
/// shift).
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn rms_norm(dim: usize, eps: f64, vb: candle_nn::VarBuilder) -> Result<RmsNorm> {
    let weight = vb.get_with_hints(dim, "weight", candle_nn::Init::Const(1.0))?;
    LayerNorm::new_rms(weight, eps)
}
