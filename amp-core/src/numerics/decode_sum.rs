//! [`decode_sum`]: the F32 rank-order sum (or mean) of several ranks' FP8
//! codes of one chunk, all with one scale, in one pass: the middle of an
//! FP8 all-reduce (the received chunks decoded and added), without an F32
//! copy of each rank's chunk. Bit for bit the composed ops it replaces:
//! `dequantize` of each chunk, candle's `add` in rank order, and `/ N`
//! (candle's affine: `y * (1 / N) + 0`).

use crate::error::{Error, Result};
use crate::numerics::cast::{amax_of, one};
use crate::numerics::kernel::{arity, launch, slice, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::scale::check_scale;
use candle_core::{CpuStorage, CudaStorage, Layout, Shape, Tensor};

/// Most ranks one launch sums (`SUM_MAX` in amp.cu).
pub(crate) const MAX_RANKS: usize = 64;

/// chunks (`U8`, one length), scale_inv -> the sum (F32), its amax.
pub(crate) struct DecodeSum {
    pub qtype: QType,
    /// Divide by the number of chunks.
    pub average: bool,
}

impl DecodeSum {
    /// `1 / N` as candle's `Tensor / f64` applies it (f64, then f32).
    pub(crate) fn inv_n(ranks: usize) -> f32 {
        (1.0 / ranks as f64) as f32
    }
}

impl Kernel for DecodeSum {
    const NAME: &'static str = "decode_sum";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let Some(((s, ls), chunks)) = inputs.split_last() else {
            return Err(arity(Self::NAME));
        };
        let Some(format) = self.qtype.fp8() else {
            return Err(Error::Unsupported {
                op: Self::NAME,
                what: "FP16 codes".into(),
            });
        };
        if chunks.is_empty() {
            return Err(arity(Self::NAME));
        }
        // one scale for every chunk, or one a chunk
        let scale_invs = slice::<f32>(Self::NAME, s, ls)?;
        if scale_invs.len() != 1 && scale_invs.len() != chunks.len() {
            return Err(Error::Shape {
                op: Self::NAME,
                lhs: Shape::from(chunks.len()),
                rhs: ls.shape().clone(),
            });
        }
        // NaN is a rank's non-finite flag (its values decode to NaN)
        for &si in scale_invs.iter().filter(|s| !s.is_nan()) {
            check_scale(Self::NAME, si)?;
        }
        let shape = chunks[0].1.shape().clone();
        let mut sum = vec![0f32; shape.elem_count()];
        let mut part = vec![0f32; shape.elem_count()];
        for (k, (c, l)) in chunks.iter().enumerate() {
            let codes = slice::<u8>(Self::NAME, c, l)?;
            if codes.len() != sum.len() {
                return Err(Error::Shape {
                    op: Self::NAME,
                    lhs: shape.clone(),
                    rhs: l.shape().clone(),
                });
            }
            let dst = if k == 0 { &mut sum } else { &mut part };
            let scale_inv = scale_invs[if scale_invs.len() == 1 { 0 } else { k }];
            format.decode_scaled_slice(codes, scale_inv, dst)?;
            if k > 0 {
                for (y, p) in sum.iter_mut().zip(&part) {
                    *y += p;
                }
            }
        }
        if self.average && chunks.len() > 1 {
            let inv_n = Self::inv_n(chunks.len());
            for y in &mut sum {
                *y = *y * inv_n + 0.0;
            }
        }
        let amax = amax_of(&sum);
        Ok(vec![(CpuStorage::F32(sum), shape), one(amax)])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        let chunks = inputs.len().saturating_sub(1);
        crate::numerics::cuda::decode_sum(self.qtype, self.average, Self::inv_n(chunks), inputs)
    }
}

/// The rank-order sum of `chunks` (FP8 codes of `qtype`, `U8`, one length
/// each, 1 to 64 of them), every code decoded with `scale_inv` (one
/// element for every chunk, or one a chunk: chunk `k` with element `k`; a
/// NaN scale decodes its chunk to NaN, a rank's non-finite flag),
/// divided by the number of chunks when `average`: bit for bit
/// `(dequantize(c_0) + dequantize(c_1) + ..) / N` composed of candle ops,
/// in one pass without an F32 copy of each chunk. Returns the F32 sum and
/// its amax (NaN when it holds a NaN).
///
/// ```
/// use amp_core::{decode_sum, QType};
/// use candle_core::{Device, Tensor};
/// let one = Tensor::new(&[0x38u8, 0x40], &Device::Cpu)?; // E4M3 1.0, 2.0
/// let two = Tensor::new(&[0x40u8, 0x48], &Device::Cpu)?; // 2.0, 4.0
/// let s = Tensor::new(&[0.5f32], &Device::Cpu)?;
/// let (mean, amax) = decode_sum(&[one, two], &s, QType::E4M3, true)?;
/// assert_eq!(mean.to_vec1::<f32>()?, [0.75, 1.5]);
/// assert_eq!(amax.to_vec1::<f32>()?, [1.5]);
/// # Ok::<(), amp_core::Error>(())
/// ```
///
/// # Errors
/// [`Error::Unsupported`] for FP16 codes, no chunk or more than 64;
/// [`Error::Shape`] for chunks of different lengths or a `scale_inv` of
/// another length; [`Error::DType`].
pub fn decode_sum(
    chunks: &[Tensor],
    scale_inv: &Tensor,
    qtype: QType,
    average: bool,
) -> Result<(Tensor, Tensor)> {
    if chunks.is_empty() || chunks.len() > MAX_RANKS {
        return Err(Error::Unsupported {
            op: DecodeSum::NAME,
            what: format!("{} chunks (1 to {MAX_RANKS})", chunks.len()),
        });
    }
    let mut inputs: Vec<&Tensor> = chunks.iter().collect();
    inputs.push(scale_inv);
    let [sum, amax] = <[Tensor; 2]>::try_from(launch(&DecodeSum { qtype, average }, &inputs)?)
        .map_err(|_| arity(DecodeSum::NAME))?;
    Ok((sum, amax))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CurrentScaling, ScalingTensor};
    use candle_core::{DType, Device};

    #[test]
    fn equals_the_composed_candle_ops() -> Result<()> {
        for qtype in [QType::E4M3, QType::E5M2] {
            for ranks in 1..=5usize {
                for average in [false, true] {
                    let chunks = (0..ranks)
                        .map(|r| {
                            let x = Tensor::randn(0f32, 3.0, 1001, &Device::Cpu)?
                                .affine(1.0 + r as f64, 0.0)?;
                            // small values as -0.0, to check the zero's sign
                            let neg_zero = x.zeros_like()?.neg()?;
                            let x = x.abs()?.gt(0.01)?.where_cond(&x, &neg_zero)?;
                            Ok(ScalingTensor::quantize(&x, qtype, &CurrentScaling::default())?.0)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let s = chunks[0].meta().scale_inv().clone();
                    let mut want: Option<Tensor> = None;
                    for c in &chunks {
                        let d =
                            ScalingTensor::from_parts(c.data().clone(), chunks[0].meta().clone())?
                                .dequantize(DType::F32)?;
                        want = Some(match want {
                            None => d,
                            Some(w) => (w + d)?,
                        });
                    }
                    let mut want = want.expect("a chunk");
                    if average && ranks > 1 {
                        want = (want / ranks as f64)?;
                    }
                    let codes: Vec<Tensor> = chunks.iter().map(|c| c.data().clone()).collect();
                    let (got, amax) = decode_sum(&codes, &s, qtype, average)?;
                    let bits = |t: &Tensor| -> Result<Vec<u32>> {
                        Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
                    };
                    assert_eq!(bits(&got)?, bits(&want)?, "{qtype:?} {ranks} {average}");
                    assert_eq!(bits(&amax)?, bits(&crate::numerics::cast::amax(&want)?)?);
                }
            }
        }
        Ok(())
    }

    #[test]
    fn bad_inputs_are_errors() -> Result<()> {
        let s = Tensor::new(&[1f32], &Device::Cpu)?;
        let a = Tensor::zeros(3, DType::U8, &Device::Cpu)?;
        let b = Tensor::zeros(4, DType::U8, &Device::Cpu)?;
        assert!(decode_sum(&[], &s, QType::E4M3, true).is_err());
        assert!(decode_sum(&[a.clone(), b], &s, QType::E4M3, true).is_err());
        assert!(decode_sum(std::slice::from_ref(&a), &s, QType::F16, true).is_err());
        let many = vec![a; 65];
        assert!(decode_sum(&many, &s, QType::E5M2, false).is_err());
        Ok(())
    }
}
