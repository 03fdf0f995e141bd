//! A scaling tensor's value cast to another storage type without writing
//! it as F32: `requantize` (two passes over the codes) and, for an FP16
//! tensor to FP8, `requantize_t` / `requantize_with_t` (the cast-transpose
//! reading the codes). Each is bit for bit the cast of `dequantize(F32)`.

use super::ScalingTensor;
use crate::cast::arity;
use crate::error::Result;
use crate::kernel::{launch, Kernel};
use crate::meta::ScalingMeta;
use crate::qtype::QType;
use crate::recipe::CurrentScaling;
use crate::requantize::{DecodedAmax, Requantize};
use candle_core::{DType, Tensor};

impl ScalingTensor {
    /// The same value in another storage type, with a fresh scale from its
    /// amax (current scaling by `recipe`). Equal to quantizing the F32
    /// dequantized value, without writing it (two passes over the codes).
    ///
    /// # Errors
    /// As [`dequantize`](Self::dequantize) and [`quantize`](Self::quantize).
    pub fn requantize(&self, qtype: QType, recipe: &CurrentScaling) -> Result<(Self, Tensor)> {
        let from = self.qtype();
        let scale_inv = self.meta.scale_inv();
        let [amax] = <[Tensor; 1]>::try_from(launch(
            &DecodedAmax { qtype: from },
            &[&self.data, scale_inv],
        )?)
        .map_err(|_| arity(DecodedAmax::NAME))?;
        let meta = ScalingMeta::for_current_amax(qtype, &amax, recipe.scale_rule, recipe.margin)?;
        let [data, amax, counts] = <[Tensor; 3]>::try_from(launch(
            &Requantize { from, to: qtype },
            &[&self.data, scale_inv, meta.scale()],
        )?)
        .map_err(|_| arity(Requantize::NAME))?;
        Self::from_cast(data, &meta, amax, counts)
    }

    /// [`quantize_t`](Self::quantize_t) of this tensor's value: bit for bit
    /// `quantize_t(&self.dequantize(F32)?, qtype, recipe)`. For an FP16
    /// tensor and an FP8 target no F32 copy is written: the amax comes from
    /// the codes and the cast decodes as it reads (how a Linear's FP16
    /// weight becomes its GEMM operands each step, 6 bytes moved per
    /// element instead of 14); other cases go through the F32 copy.
    ///
    /// # Errors
    /// As [`quantize_t`](Self::quantize_t).
    pub fn requantize_t(
        &self,
        qtype: QType,
        recipe: &CurrentScaling,
    ) -> Result<(Self, Self, Tensor)> {
        if !self.casts_t_in_place(qtype) {
            return Self::quantize_t(&self.dequantize(DType::F32)?, qtype, recipe);
        }
        let scale_inv = self.meta.scale_inv();
        let [amax] = <[Tensor; 1]>::try_from(launch(
            &DecodedAmax { qtype: QType::F16 },
            &[&self.data, scale_inv],
        )?)
        .map_err(|_| arity(DecodedAmax::NAME))?;
        Self::cast_t_current(
            qtype,
            recipe,
            true,
            &[&self.data, &amax, scale_inv],
            amax.clone(),
        )
    }

    /// [`quantize_with_t`](Self::quantize_with_t) of this tensor's value,
    /// as [`requantize_t`](Self::requantize_t) (no F32 copy for an FP16
    /// tensor and an FP8 target).
    ///
    /// # Errors
    /// As [`quantize_with_t`](Self::quantize_with_t).
    pub fn requantize_with_t(&self, meta: &ScalingMeta) -> Result<(Self, Self, Tensor)> {
        if !self.casts_t_in_place(meta.qtype()) {
            return Self::quantize_with_t(&self.dequantize(DType::F32)?, meta);
        }
        Self::cast_t_with(
            meta,
            true,
            &[&self.data, meta.scale(), self.meta.scale_inv()],
        )
    }

    /// Whether the cast-transpose reads this tensor's codes directly: FP16
    /// to FP8, 2-D, a shape the CUDA kernel takes.
    fn casts_t_in_place(&self, to: QType) -> bool {
        self.qtype() == QType::F16
            && self
                .data
                .dims2()
                .is_ok_and(|(rows, cols)| super::one_pass_t(to, rows, cols, self.data.device()))
    }
}
