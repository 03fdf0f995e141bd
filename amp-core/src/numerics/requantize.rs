//! Format-to-format requantize as two kernels, so the CUDA path writes no
//! F32 copy: the amax of the decoded values, then (after the caller picks
//! the new scale) decode, scale and encode in one pass. Bit-identical to
//! quantizing the F32 dequantized tensor: both see the same f32 values
//! `decode(code) * scale_inv`.

use crate::error::Result;
use crate::numerics::cast::{amax_of, one, quantize_slice, Dequantize};
use crate::numerics::kernel::arity;
use crate::numerics::kernel::{scalar, Kernel};
use crate::numerics::qtype::QType;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape};

/// The values `decode(code) * scale_inv` of codes and scale_inv, on the CPU.
fn decoded(
    qtype: QType,
    q: (&CpuStorage, &Layout),
    scale_inv: (&CpuStorage, &Layout),
) -> Result<Vec<f32>> {
    let op = Dequantize {
        qtype,
        dtype: DType::F32,
    };
    let mut out = op.cpu(&[q, scale_inv])?;
    match out.pop() {
        Some((CpuStorage::F32(v), _)) => Ok(v),
        _ => Err(arity(DecodedAmax::NAME)),
    }
}

/// codes, scale_inv -> `max |decode(code) * scale_inv|` (1-element F32).
pub(crate) struct DecodedAmax {
    pub qtype: QType,
}

impl Kernel for DecodedAmax {
    const NAME: &'static str = "decoded_amax";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [q, s] = inputs else {
            return Err(arity(Self::NAME));
        };
        Ok(vec![one(amax_of(&decoded(self.qtype, *q, *s)?))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::decoded_amax(self.qtype, inputs)
    }
}

/// codes, scale_inv, scale -> codes of `to`, the decoded values' amax and
/// `[saturated, flushed]`, as [`Quantize`](crate::numerics::cast::Quantize) of the
/// decoded values.
pub(crate) struct Requantize {
    pub from: QType,
    pub to: QType,
    /// Whether the counts output is made (numerics/counts.rs).
    pub counts: bool,
}

impl Kernel for Requantize {
    const NAME: &'static str = "requantize";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [q, si, (s, ls)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let scale = scalar(Self::NAME, s, ls)?;
        // any finite target scale: a negative one negates the values, zero
        // gives zero codes (the head's gradient times a negative or zero
        // incoming gradient, `nn/linear/head_loss.rs`)
        if !scale.is_finite() {
            return Err(crate::error::Error::BadScale {
                op: Self::NAME,
                value: scale,
            });
        }
        let values = decoded(self.from, *q, *si)?;
        let (codes, amax, counts) = quantize_slice(self.to, &values, scale);
        let mut out = vec![(codes, q.1.shape().clone()), one(amax)];
        if self.counts {
            out.push((CpuStorage::I64(counts.to_vec()), Shape::from(2usize)));
        }
        Ok(out)
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::requantize(self.from, self.to, self.counts, inputs)
    }
}

#[cfg(test)]
mod tests {
    use crate::{CurrentScaling, QType, ScalingTensor};
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn requantize_equals_quantizing_the_dequantized_value() {
        crate::numerics::counts::set_cast_counts(true);
        let dev = Device::Cpu;
        let xs: Vec<f32> = (0..4099u32)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B1) & 0xBFFF_FFFF) * 1e-30)
            .collect();
        let x = Tensor::from_vec(xs, 4099, &dev).unwrap();
        let r = CurrentScaling::default();
        for from in [QType::E4M3, QType::E5M2, QType::F16] {
            let (q, _) = ScalingTensor::quantize(&x, from, &r).unwrap();
            for to in [QType::E4M3, QType::E5M2, QType::F16] {
                let (got, amax) = q.requantize(to, &r).unwrap();
                let y = q.dequantize(DType::F32).unwrap();
                let (want, want_amax) = ScalingTensor::quantize(&y, to, &r).unwrap();
                let bytes = |t: &ScalingTensor| {
                    t.data()
                        .to_dtype(DType::F32)
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(bytes(&got), bytes(&want), "{from} -> {to}");
                assert_eq!(
                    amax.to_vec1::<f32>().unwrap(),
                    want_amax.to_vec1::<f32>().unwrap()
                );
                assert_eq!(got.scale_inv().unwrap(), want.scale_inv().unwrap());
                assert_eq!(
                    got.meta().last_cast_stats().unwrap().unwrap(),
                    want.meta().last_cast_stats().unwrap().unwrap()
                );
            }
        }
    }
}
