//! Optimizer states (Adam moments) in F32 or a scaled low-bit format.

use crate::adamw::flat;
use crate::error::Result;
use amp_core::{CurrentScaling, QType, ScalingTensor};
use candle_core::{DType, Device, Shape, Tensor};

/// The storage of one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum StateFormat {
    /// Plain F32.
    F32,
    /// FP8 E4M3 with a per-tensor power-of-two scale.
    E4M3,
    /// FP8 E5M2 with a per-tensor power-of-two scale.
    E5M2,
    /// FP16 with a per-tensor power-of-two scale.
    F16,
    /// The square roots of the values (a second moment) in FP8 E4M3 with a
    /// per-tensor power-of-two scale: the quantity Adam divides by, so its
    /// relative error is E4M3's (at most 1/16, as E5M2 on the values gives)
    /// over E4M3's range in the square root (2^17.8, the values' 2^35.6
    /// against E5M2's 2^31.8). A non-zero root below the smallest code
    /// stores as the smallest code, never as zero, so no update divides by
    /// a flushed moment. One byte an element: with an E4M3 first moment,
    /// both Adam moments in FP8 (docs/ARCHITECTURE.md, "FP8 moments").
    E4M3Sqrt,
}

impl StateFormat {
    fn qtype(self) -> Option<QType> {
        match self {
            Self::F32 => None,
            Self::E4M3 => Some(QType::E4M3),
            Self::E5M2 => Some(QType::E5M2),
            Self::F16 => Some(QType::F16),
            Self::E4M3Sqrt => Some(QType::E4M3),
        }
    }
}

/// The smallest positive E4M3 code's value (2^-9): a non-zero square root
/// `r` of an [`StateFormat::E4M3Sqrt`] moment with scale `s` stores as at
/// least `MIN_ROOT_CODE / s`.
pub(crate) const MIN_ROOT_CODE: f32 = 1.0 / 512.0;

/// `r` raised to the smallest non-zero value the codes of scale `scale`
/// hold where it is positive and below it (a positive root never stores
/// as zero); every other value (zero, NaN) as it is. `scale` is a power of
/// two, so the bound is exact.
pub(crate) fn root_floor(r: f32, scale: f32) -> f32 {
    let floor = MIN_ROOT_CODE / scale;
    if r > 0.0 && r < floor {
        floor
    } else {
        r
    }
}

/// 32 random bits of element `i` under `salt` (a counter-based hash: the
/// same on the CPU and in lowbit.cu's `mix32`).
pub(crate) fn random_bits(i: u64, salt: u32) -> u32 {
    fn mix(mut h: u32) -> u32 {
        h ^= h >> 16;
        h = h.wrapping_mul(0x7FEB_352D);
        h ^= h >> 15;
        h = h.wrapping_mul(0x846C_A68B);
        h ^ (h >> 16)
    }
    mix((i as u32) ^ mix(((i >> 32) as u32) ^ mix(salt)))
}

/// The root `r` (>= 0) of element `i` as the step stores it with scale
/// `scale` (a power of two, `r * scale <= 448`): `r * scale` rounded
/// stochastically to E4M3's grid (up with probability its distance from
/// the code below over the codes' spacing, from [`random_bits`]), and at
/// least the smallest code where `r` is positive (roots under it are
/// biased up: no update divides by a flushed zero). Round-to-nearest would never let a root fall: with
/// beta2 = 0.999 a step moves it by at most 0.05%, less than half of
/// E4M3's spacing (1/16 to 1/8 of the value), so every decay would round
/// back to the old code; stochastic rounding moves it by the right amount
/// on average. The result is exactly representable: encoding it rounds
/// nothing. NaN and inf pass unchanged.
pub(crate) fn stochastic_root(r: f32, scale: f32, i: u64, salt: u32) -> f32 {
    let y = r * scale;
    if !(y > 0.0 && y.is_finite()) {
        return r;
    }
    let bits = random_bits(i, salt);
    // E4M3's smallest normal is 2^-6: below, codes are 2^-9 apart
    let rounded = if y < 1.0 / 64.0 {
        let t = y * 512.0;
        let u = (bits >> 8) as f32 * (1.0 / 16_777_216.0);
        (t + u).floor() / 512.0
    } else {
        // keep 3 of f32's 23 mantissa bits: add 20 random bits, truncate
        f32::from_bits((y.to_bits() + (bits >> 12)) & !0xF_FFFF)
    };
    // a positive root stays positive, whatever it rounded to
    let floor = MIN_ROOT_CODE / scale;
    (rounded / scale).max(floor)
}

/// One moment of one parameter.
#[derive(Debug, Clone)]
pub enum State {
    /// F32 values.
    F32(Tensor),
    /// Scaled low-bit values; the scale is re-chosen from the amax at every
    /// write, so the state never saturates.
    Scaled(ScalingTensor),
    /// The values' square roots, scaled E4M3 ([`StateFormat::E4M3Sqrt`]).
    Sqrt(ScalingTensor),
}

impl State {
    /// All zeros in `format`.
    ///
    /// # Errors
    /// Only candle's.
    pub fn zeros(format: StateFormat, shape: &Shape, device: &Device) -> Result<Self> {
        Self::encode(format, &Tensor::zeros(shape, DType::F32, device)?)
    }

    /// Stores `values` (F32) in `format`.
    ///
    /// # Errors
    /// Only candle's.
    pub fn encode(format: StateFormat, values: &Tensor) -> Result<Self> {
        Ok(match format.qtype() {
            None => Self::F32(values.clone()),
            Some(_) if format == StateFormat::E4M3Sqrt => Self::Sqrt(encode_roots(values)?),
            Some(qtype) => {
                Self::Scaled(ScalingTensor::quantize(values, qtype, &CurrentScaling::default())?.0)
            }
        })
    }

    /// The values as a flat F32 vector (decoded on the fly).
    ///
    /// # Errors
    /// Only candle's.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        match self {
            Self::F32(t) => flat(t),
            Self::Scaled(t) => flat(&t.dequantize(DType::F32)?),
            Self::Sqrt(t) => flat(&t.dequantize(DType::F32)?.sqr()?),
        }
    }

    /// The values as an F32 tensor of the state's shape (decoded).
    ///
    /// # Errors
    /// Only candle's.
    pub fn values(&self) -> Result<Tensor> {
        Ok(match self {
            Self::F32(t) => t.clone(),
            Self::Scaled(t) => t.dequantize(DType::F32)?,
            Self::Sqrt(t) => t.dequantize(DType::F32)?.sqr()?,
        })
    }

    /// The storage format.
    pub fn format(&self) -> StateFormat {
        match self {
            Self::F32(_) => StateFormat::F32,
            Self::Scaled(t) => match t.qtype() {
                QType::E4M3 => StateFormat::E4M3,
                QType::E5M2 => StateFormat::E5M2,
                QType::F16 => StateFormat::F16,
            },
            Self::Sqrt(_) => StateFormat::E4M3Sqrt,
        }
    }

    /// The shape of the values.
    pub fn shape(&self) -> &Shape {
        match self {
            Self::F32(t) => t.shape(),
            Self::Scaled(t) | Self::Sqrt(t) => t.shape(),
        }
    }

    /// Bytes held, scale included.
    pub fn nbytes(&self) -> usize {
        match self {
            Self::F32(t) => t.elem_count() * 4,
            Self::Scaled(t) | Self::Sqrt(t) => t.nbytes(),
        }
    }
}

/// `sqrt(values)` (non-negative F32) as E4M3 with the power-of-two scale of
/// its amax, each positive root at least the smallest code
/// ([`root_floor`]), as the step writes them.
fn encode_roots(values: &Tensor) -> Result<ScalingTensor> {
    let roots = values.to_dtype(DType::F32)?.sqrt()?;
    if roots.elem_count() == 0 {
        return Ok(ScalingTensor::quantize(&roots, QType::E4M3, &CurrentScaling::default())?.0);
    }
    let amax = roots.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = amp_core::ScaleRule::PowerOfTwo.compute(amax, 1.0, QType::E4M3.max(), 0);
    let floored: Vec<f32> = flat(&roots)?
        .into_iter()
        .map(|r| root_floor(r, scale))
        .collect();
    let floored = Tensor::from_vec(floored, roots.shape(), roots.device())?;
    Ok(ScalingTensor::quantize(&floored, QType::E4M3, &CurrentScaling::default())?.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `y` is an E4M3 value: it encodes and decodes unchanged.
    fn is_e4m3(y: f32) -> bool {
        let f = QType::E4M3.fp8().expect("an FP8 format");
        let mut code = [0u8];
        let mut back = [0f32];
        f.encode_scaled_slice(&[y], 1.0, &mut code)
            .expect("one value");
        f.decode_scaled_slice(&code, 1.0, &mut back)
            .expect("one code");
        back[0] == y
    }

    #[test]
    fn root_states_encode_values_as_their_roots() -> Result<()> {
        let dev = Device::Cpu;
        let empty = State::zeros(StateFormat::E4M3Sqrt, &Shape::from(0), &dev)?;
        assert_eq!(
            (empty.format(), empty.to_vec()?.len()),
            (StateFormat::E4M3Sqrt, 0)
        );
        let v = [0.0f32, 1e-30, 0.25, 4.0, 9.0];
        let s = State::encode(StateFormat::E4M3Sqrt, &Tensor::new(&v, &dev)?)?;
        let back = s.to_vec()?;
        // 0.25, 4 and 9 are squares of codes; the tiny value is lifted to
        // the smallest code (2^-9 / scale, squared), never zero
        assert_eq!([back[0], back[2], back[3], back[4]], [0.0, 0.25, 4.0, 9.0]);
        assert!(back[1] > 0.0 && back[1] < 1e-4, "{back:?}");
        assert_eq!(s.values()?.to_vec1::<f32>()?, back);
        Ok(())
    }

    #[test]
    fn stochastic_roots_are_codes_unbiased_and_never_flush() {
        for scale in [1.0f32, 2f32.powi(-7), 2f32.powi(20)] {
            for y in [
                0.0011f32, 0.0017, 0.013, 0.02, 0.7, 1.0, 3.3, 100.1, 300.0, 447.0, 448.0,
            ] {
                let r = y / scale;
                let n = 20_000;
                let mut sum = 0f64;
                for i in 0..n {
                    let s = stochastic_root(r, scale, i, 0xC0FFEE);
                    assert!(is_e4m3(s * scale), "{s} at scale {scale} is no code");
                    assert!(s * scale <= 448.0);
                    assert!(s > 0.0, "a positive root stored as zero");
                    sum += f64::from(s);
                }
                let mean = sum / n as f64;
                // the floor lifts roots under 2^-9 (in codes): no bias test there
                if y >= MIN_ROOT_CODE {
                    let rel = (mean - f64::from(r)).abs() / f64::from(r);
                    assert!(rel < 0.01, "{y} at {scale}: mean {mean}, bias {rel}");
                }
            }
        }
        assert_eq!(stochastic_root(0.0, 4.0, 3, 1), 0.0);
        assert!(stochastic_root(f32::NAN, 4.0, 3, 1).is_nan());
        // a code stays where it is, whatever the bits
        for i in 0..1000 {
            assert_eq!(stochastic_root(0.375, 1.0, i, 7), 0.375);
        }
        // different salts and indices give different bits
        assert_ne!(random_bits(0, 1), random_bits(0, 2));
        assert_ne!(random_bits(1, 1), random_bits(1 << 32, 1));
    }
}
