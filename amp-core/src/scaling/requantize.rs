//! A scaling tensor cast to another storage type without writing it as
//! F32 ([`ScalingTensor::requantize`] and its kin): two passes over the
//! codes, or for FP16 to FP8 the cast-transpose reading the codes. Each is
//! bit for bit the cast of `dequantize(F32)`.

use crate::error::Result;
use crate::numerics::cast_t::{RequantizeTMany, MANY_T_OUTPUTS};
use crate::numerics::counts::cast_counts;
use crate::numerics::kernel::arity;
use crate::numerics::kernel::{launch, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::recipe::CurrentScaling;
use crate::numerics::requantize::{DecodedAmax, Requantize};
use crate::numerics::scale::FromAmax;
use crate::scaling::meta::ScalingMeta;
use crate::scaling::tensor::{counted, one_pass_t, ScalingTensor};
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
        let op = Requantize {
            from,
            to: qtype,
            counts: cast_counts(),
        };
        let outs = launch(&op, &[&self.data, scale_inv, meta.scale()])?;
        let (outs, counts) = counted(outs, 2, op.counts, Requantize::NAME)?;
        let [data, amax] = <[Tensor; 2]>::try_from(outs).map_err(|_| arity(Requantize::NAME))?;
        Self::from_cast(data, &meta, amax, counts)
    }

    /// The amax of the value, `max |dequantize(F32)|`, from the codes in
    /// one pass (NaN when a code is NaN), as a 1-element F32 tensor.
    ///
    /// # Errors
    /// Only candle's, on a corrupt tensor.
    pub fn decoded_amax(&self) -> Result<Tensor> {
        let [amax] = <[Tensor; 1]>::try_from(launch(
            &DecodedAmax {
                qtype: self.qtype(),
            },
            &[&self.data, self.meta.scale_inv()],
        )?)
        .map_err(|_| arity(DecodedAmax::NAME))?;
        Ok(amax)
    }

    /// The value cast with `meta`'s scale (to `meta`'s storage type): bit
    /// for bit [`quantize_with`](Self::quantize_with)`(&self.dequantize(F32)?,
    /// meta)`, in one pass over the codes with no F32 copy. Returns the
    /// tensor and the value's amax.
    ///
    /// # Errors
    /// As [`quantize_with`](Self::quantize_with).
    pub fn requantize_with(&self, meta: &ScalingMeta) -> Result<(Self, Tensor)> {
        let op = Requantize {
            from: self.qtype(),
            to: meta.qtype(),
            counts: cast_counts(),
        };
        let outs = launch(&op, &[&self.data, self.meta.scale_inv(), meta.scale()])?;
        let (outs, counts) = counted(outs, 2, op.counts, Requantize::NAME)?;
        let [data, amax] = <[Tensor; 2]>::try_from(outs).map_err(|_| arity(Requantize::NAME))?;
        Self::from_cast(data, meta, amax, counts)
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
            FromAmax::of(recipe),
            true,
            &[&self.data, &amax, scale_inv],
            amax.clone(),
        )
    }

    /// [`requantize_t`](Self::requantize_t) of many tensors, bit for bit
    /// each one's own: the FP16 tensors the cast-transpose takes in place
    /// (a model's Linear weights) in two launches for all of them on CUDA
    /// (the others one by one, as `requantize_t` casts them).
    ///
    /// # Errors
    /// As [`requantize_t`](Self::requantize_t); [`Error::Device`](crate::Error::Device) when the
    /// tensors live on different devices.
    pub fn requantize_t_many(
        tensors: &[&Self],
        qtype: QType,
        recipe: &CurrentScaling,
    ) -> Result<Vec<(Self, Self, Tensor)>> {
        let from = FromAmax::of(recipe);
        let batched: Vec<usize> = (0..tensors.len())
            .filter(|&i| tensors[i].casts_t_in_place(qtype) && tensors[i].elem_count() > 0)
            .collect();
        let mut out: Vec<Option<(Self, Self, Tensor)>> = vec![None; tensors.len()];
        if !batched.is_empty() {
            let inputs: Vec<&Tensor> = batched
                .iter()
                .flat_map(|&i| [&tensors[i].data, tensors[i].meta.scale_inv()])
                .collect();
            let op = RequantizeTMany {
                qtype,
                from,
                counts: cast_counts(),
            };
            let mut outs = launch(&op, &inputs)?;
            let counts = if op.counts { outs.pop() } else { None };
            let Some(amax) = outs.pop() else {
                return Err(arity(RequantizeTMany::NAME));
            };
            if outs.len() != batched.len() * MANY_T_OUTPUTS {
                return Err(arity(RequantizeTMany::NAME));
            }
            let mut parts = outs.into_iter();
            for (k, &i) in batched.iter().enumerate() {
                let (Some(data), Some(data_t), Some(scale), Some(scale_inv)) =
                    (parts.next(), parts.next(), parts.next(), parts.next())
                else {
                    return Err(arity(RequantizeTMany::NAME));
                };
                let a = amax.narrow(0, k, 1)?;
                let c = counts.as_ref().map(|c| c.get(k)).transpose()?;
                let q = Self::from_current(data, qtype, scale, scale_inv, &a, c, from.flag)?;
                let qt = q.with_data(data_t);
                out[i] = Some((q, qt, a));
            }
        }
        out.into_iter()
            .zip(tensors)
            .map(|(done, t)| match done {
                Some(r) => Ok(r),
                None => t.requantize_t(qtype, recipe),
            })
            .collect()
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
                .is_ok_and(|(rows, cols)| one_pass_t(to, rows, cols, self.data.device()))
    }
}
