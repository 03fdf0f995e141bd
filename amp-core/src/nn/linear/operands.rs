//! What a Linear's forward feeds its GEMMs: the passes a compute mode runs
//! in FP8, with their scaling and formats ([`Passes`]), and the weight's
//! and the input's FP8 operands. With dgrad in FP8 the weight's cast also
//! writes Wᵀ (dgrad's K-major operand); with wgrad, x's writes xᵀ: each is
//! kept for backward in place of the row-major codes (same bytes), so the
//! backward GEMMs need no transpose. An FP16 weight's cast may have been
//! made ahead, with every other weight's (`ahead.rs`).

use super::ahead;
use super::layer_scaling::{cast, noted, Role, Scaling, Source};
use super::Linear;
use crate::error::Result;
use crate::nn::mode::ComputeMode;
use crate::numerics::recipe::{Format, TileRecipe};
use crate::scaling::tensor::ScalingTensor;
use crate::scaling::weight::Weight;
use candle_core::Tensor;

/// A GEMM operand and, where a backward GEMM takes it K-major, its
/// transpose (`None` where the pass is not FP8).
pub(super) type Operand = (Option<ScalingTensor>, Option<ScalingTensor>);

/// The passes a compute mode runs with per-tensor FP8 casts, their
/// scaling and formats; the block and rowwise modes' tiles instead.
pub(super) struct Passes {
    pub scaling: Scaling,
    pub fprop: bool,
    pub dgrad: bool,
    pub wgrad: bool,
    pub fmt: Format,
    /// The block GEMMs' recipe (block and rowwise modes: none of the
    /// per-tensor casts).
    pub block: Option<TileRecipe>,
}

impl Passes {
    pub(super) fn of(mode: &ComputeMode) -> Self {
        let native = |fmt| Self {
            scaling: Scaling::Current(Default::default()),
            fprop: false,
            dgrad: false,
            wgrad: false,
            fmt,
            block: None,
        };
        match mode {
            ComputeMode::Native => native(Default::default()),
            ComputeMode::Fp8Current(r) => Self {
                scaling: Scaling::Current(r.clone()),
                fprop: true,
                dgrad: true,
                wgrad: true,
                fmt: r.fp8_format,
                block: None,
            },
            ComputeMode::Fp8Delayed(r) => {
                let o = r.override_linear_precision;
                Self {
                    scaling: Scaling::Delayed(r.clone()),
                    fprop: !o.fprop,
                    dgrad: !o.dgrad,
                    wgrad: !o.wgrad,
                    fmt: r.fp8_format,
                    block: None,
                }
            }
            ComputeMode::Fp8Block(r) => Self {
                block: Some(TileRecipe::from(r)),
                ..native(r.fp8_format)
            },
            ComputeMode::Fp8Rowwise(r) => Self {
                block: Some(TileRecipe::from(r)),
                ..native(r.fp8_format)
            },
        }
    }
}

impl Linear {
    /// The weight's forward-format operand for fprop and dgrad (with Wᵀ
    /// where dgrad is FP8): an O3 weight's stored FP8 copy as it is, a
    /// cast made ahead where it matches, else the layer's own cast.
    pub(super) fn weight_operand(&self, weight: &Weight, p: &Passes, step: u64) -> Result<Operand> {
        let fwd = p.fmt.forward();
        // an FP16 weight's cast under current scaling, maybe made ahead
        let ahead_cast = match (weight, &p.scaling) {
            (Weight::F16(t), Scaling::Current(r)) if p.dgrad => Some((t, fwd.into(), r)),
            _ => None,
        };
        // every forward tells the cache what it casts (nothing here: a
        // native or block forward, so nothing is cast ahead for it)
        let ready = ahead::take(&self.ahead, ahead_cast)?;
        if !(p.fprop || p.dgrad) {
            return Ok((None, None));
        }
        let source = match weight {
            // O3: the stored FP8 copy is the GEMM operand as it is.
            Weight::Fp8 { weight: w8, .. } | Weight::Fp8Gathered(w8)
                if w8.qtype() == fwd.into() =>
            {
                return Ok((Some(w8.clone()), None));
            }
            Weight::F32(var) => Source::Tensor(var.as_tensor()),
            Weight::F16(t) | Weight::Fp8 { master: t, .. } | Weight::Fp8Gathered(t) => {
                Source::Scaled(t)
            }
        };
        let (q, qt) = match ready {
            Some((q, qt)) => noted(source, Role::Weight, &self.casts, (q, Some(qt)))?,
            None => cast(
                source,
                fwd,
                &p.scaling,
                &self.scaling,
                Role::Weight,
                step,
                &self.casts,
                p.dgrad,
            )?,
        };
        Ok((Some(q), qt))
    }

    /// The input's forward-format operand for fprop and wgrad (with xᵀ
    /// where wgrad is FP8), from `x_amax` where a producer took it.
    pub(super) fn input_operand(
        &self,
        x: &Tensor,
        x_amax: Option<&Tensor>,
        p: &Passes,
        step: u64,
    ) -> Result<Operand> {
        if !(p.fprop || p.wgrad) {
            return Ok((None, None));
        }
        let source = match x_amax {
            Some(a) => Source::Measured(x, a),
            None => Source::Tensor(x),
        };
        let (q, qt) = cast(
            source,
            p.fmt.forward(),
            &p.scaling,
            &self.scaling,
            Role::Input,
            step,
            &self.casts,
            p.wgrad,
        )?;
        Ok((Some(q), qt))
    }
}
