//! A scaling tensor's value times a device scalar, without an F32 copy
//! ([`ScalingTensor::times`]): the codes cast again in one pass with the
//! current-scaling scale of the product's amax.

use crate::error::Result;
use crate::numerics::recipe::CurrentScaling;
use crate::scaling::meta::ScalingMeta;
use crate::scaling::tensor::ScalingTensor;
use candle_core::{DType, Tensor};

impl ScalingTensor {
    /// `g` times this tensor's value (a current-scaled FP8 tensor, as a
    /// weight gradient; `g` a one-element F32 tensor): the codes decoded
    /// with `scale_inv * |g|` and encoded again in one pass
    /// (`requantize_with`) with the default current-scaling scale of the
    /// larger of `amax * |g|` and the decoded codes' own amax (a code
    /// rounded up may exceed the F32 source's amax: the reductions take the
    /// codes' largest value to be at most the cast of the amax), `g`'s sign
    /// in the target scale. For a power-of-two `g` the codes are those
    /// before (negated for a negative `g`), the scale divided by `|g|`;
    /// otherwise the value is rounded to FP8 a second time. The metadata keeps that amax, non-finite
    /// where the gradient's or `g` is (a NaN then), and the cast's counts; a
    /// zero `g` gives zero codes with a finite scale.
    pub(crate) fn times(&self, g: &Tensor) -> Result<Self> {
        let m = self.meta();
        let a = g.abs()?;
        // the magnitude decoded with a positive finite factor (1 where |g| is
        // 0, subnormal or not finite: the target scale's sign, 0 then, or the
        // amax, NaN then, carries it); the sign into the target scale
        let usable = a
            .ge(f64::from(f32::MIN_POSITIVE))?
            .mul(&a.le(f64::from(f32::MAX))?)?;
        let a_safe = usable.where_cond(&a, &a.ones_like()?)?;
        let sign = (g.gt(0.0)?.to_dtype(DType::F32)? - g.lt(0.0)?.to_dtype(DType::F32)?)?;
        let amax_g = m.amax()?.broadcast_mul(&a)?;
        let magnitude = ScalingTensor::from_parts(
            self.data().clone(),
            ScalingMeta::from_parts(
                self.qtype(),
                m.scale().clone(),
                m.scale_inv().broadcast_mul(&a_safe)?,
                amax_g.clone(),
            )?,
        )?;
        // the max of the two, and NaN where amax * |g| is not finite (x * 0)
        let amax = magnitude
            .decoded_amax()?
            .broadcast_mul(&usable.to_dtype(DType::F32)?)?
            .maximum(&amax_g)?
            .broadcast_add(&amax_g.affine(0.0, 0.0)?)?;
        let rule = CurrentScaling::default();
        let meta =
            ScalingMeta::for_current_amax(self.qtype(), &amax, rule.scale_rule, rule.margin)?;
        let signed = ScalingMeta::from_parts(
            self.qtype(),
            meta.scale().broadcast_mul(&sign)?,
            meta.scale_inv().clone(),
            amax.reshape(1)?,
        )?;
        let (q, _) = magnitude.requantize_with(&signed)?;
        let out = ScalingMeta::from_parts(
            self.qtype(),
            meta.scale().clone(),
            meta.scale_inv().clone(),
            amax.reshape(1)?,
        )?;
        let out = match q.meta().last_cast_counts() {
            Some(c) => out.with_last_cast(Some(c)),
            None => out,
        };
        Self::from_parts(q.data().clone(), out)
    }
}

#[cfg(test)]
mod tests {
    use crate::numerics::recipe::CurrentScaling;
    use crate::scaling::tensor::ScalingTensor;
    use crate::QType;
    use candle_core::{DType, Device, Tensor};

    fn grad() -> ScalingTensor {
        let v: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.013)
            .collect();
        let x = Tensor::from_vec(v, (8, 8), &Device::Cpu).unwrap();
        ScalingTensor::quantize(&x, QType::E4M3, &CurrentScaling::default())
            .unwrap()
            .0
    }

    fn f32s(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// `ScalingTensor::times`: the same codes for a power of two, a power-of-two
    /// finite positive scale for 1/3, 0 and -1, the codes' largest value
    /// within the cast of the recorded amax, a NaN amax for a NaN `g`.
    #[test]
    fn the_weight_gradient_times_g() {
        let q = grad();
        let before = f32s(&q.dequantize(DType::F32).unwrap());
        for g in [0.125f32, 1.0 / 3.0, 0.0, -1.0, -0.25] {
            let gt = Tensor::new(&[g], &Device::Cpu).unwrap();
            let r = q.times(&gt).unwrap();
            let scale = f32s(r.meta().scale())[0];
            assert!(scale.is_finite() && scale > 0.0, "{g}: scale {scale}");
            assert_eq!(scale, 2f32.powi(scale.log2() as i32), "{g}: scale {scale}");
            let after = f32s(&r.dequantize(DType::F32).unwrap());
            let amax = f32s(&r.meta().amax().unwrap())[0];
            for (a, b) in before.iter().zip(&after) {
                assert!(
                    (a * g - b).abs() <= (a * g).abs() / 8.0 + 1e-9,
                    "{g}: {a} x g -> {b}"
                );
                assert!(b.abs() <= amax * 1.125, "{g}: {b} above amax {amax}");
            }
            if g.abs().log2().fract() == 0.0 && g != 0.0 {
                let (d0, d1) = (
                    q.data().to_dtype(DType::U32).unwrap(),
                    r.data().to_dtype(DType::U32).unwrap(),
                );
                let (d0, d1): (Vec<u32>, Vec<u32>) = (
                    d0.flatten_all().unwrap().to_vec1().unwrap(),
                    d1.flatten_all().unwrap().to_vec1().unwrap(),
                );
                if g > 0.0 {
                    assert_eq!(d0, d1, "{g}: codes changed");
                }
                assert_eq!(scale, f32s(q.meta().scale())[0] / g.abs(), "{g}");
            }
        }
        let nan = Tensor::new(&[f32::NAN], &Device::Cpu).unwrap();
        let r = q.times(&nan).unwrap();
        assert!(f32s(&r.meta().amax().unwrap())[0].is_nan());
    }
}
