//! The two rules that turn an amax into a scale, as scalar functions: the CPU
//! kernels call them and the CUDA kernels must compute the same f32 results.
//!
//! Convention (TE and MS-AMP): `q = cast(x * scale)`, `x ~= q * scale_inv`,
//! `scale_inv = 1 / scale`.

use crate::error::{Error, Result};
use crate::numerics::qtype::QType;

/// How a scale is chosen from an amax.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum ScaleRule {
    /// Transformer Engine: `scale = (max / amax) / 2^margin`, clamped to
    /// `f32::MAX` where it overflows.
    Te,
    /// MS-AMP: `scale = 2^(floor(log2(max / amax)) - margin)`, exact to
    /// invert. The exponent is the largest `e` with `amax * 2^e <= max`,
    /// computed exactly (no `log2` rounding), clamped to the normal f32 range.
    #[default]
    PowerOfTwo,
}

impl ScaleRule {
    /// The scale for `amax`, or `prev_scale` where `amax` is zero, negative,
    /// infinite or NaN (the guard both references apply), where `max` is not
    /// finite and positive, or where the rule would give no normal finite
    /// scale (so `1 / scale` is always finite).
    pub fn compute(self, amax: f32, prev_scale: f32, max: f32, margin: u32) -> f32 {
        if !(amax > 0.0 && amax.is_finite() && max > 0.0 && max.is_finite()) {
            return prev_scale;
        }
        let scale = match self {
            Self::Te => {
                let s = (max / amax) / pow2(margin.min(255) as i32);
                if s.is_infinite() {
                    f32::MAX
                } else {
                    s
                }
            }
            Self::PowerOfTwo => {
                // f64 holds max/amax of two f32s exactly enough: the quotient
                // of 24-bit significands is never within 2^-53 of a power of two
                // without being one, so its exponent field is floor(log2).
                let q = max as f64 / amax as f64;
                let e = ((q.to_bits() >> 52) & 0x7FF) as i64 - 1023;
                let e = (e - margin as i64).clamp(-126, 127);
                pow2(e as i32)
            }
        };
        // A subnormal scale would have an infinite inverse.
        if scale >= f32::MIN_POSITIVE && scale.is_finite() {
            scale
        } else {
            prev_scale
        }
    }
}

/// 2^e as f32 for e in [-126, 127]; 0 below and inf above.
fn pow2(e: i32) -> f32 {
    if e < -126 {
        0.0
    } else if e > 127 {
        f32::INFINITY
    } else {
        f32::from_bits(((e + 127) as u32) << 23)
    }
}

/// Current scaling inside a cast: the scale comes from the input's amax
/// (`rule.compute(amax, 1, max, margin)`, the scale update of a one-slot
/// history with no previous scale), computed by the cast kernel itself,
/// which also returns it and its inverse: no launch of its own.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FromAmax {
    pub rule: ScaleRule,
    pub margin: u32,
    /// The scale_inv written carries the amax's finiteness: `scale_inv *
    /// (amax * 0 + 1)`, NaN where the amax is not finite (the FP8 Linear's
    /// flag, `scaling/flag.rs`), in the cast's own launch.
    pub flag: bool,
}

impl FromAmax {
    /// The scale a cast to `qtype` applies: from the amax, or the scale.
    pub(crate) fn scale(from: Option<Self>, qtype: QType, op: &'static str, v: f32) -> Result<f32> {
        match from {
            Some(c) => Ok(c.rule.compute(v, 1.0, qtype.max(), c.margin)),
            None => check_scale(op, v).map(|()| v),
        }
    }
}

/// A scale must be finite, positive and normal, so that its inverse is
/// finite too.
pub(crate) fn check_scale(op: &'static str, scale: f32) -> Result<()> {
    if scale >= f32::MIN_POSITIVE && scale.is_finite() {
        Ok(())
    } else {
        Err(Error::BadScale { op, value: scale })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::format::E4M3_MAX;

    #[test]
    fn te_rule_hand_worked() {
        // 448 / 3.5 = 128; margin 1 halves it.
        assert_eq!(ScaleRule::Te.compute(3.5, 1.0, E4M3_MAX, 0), 128.0);
        assert_eq!(ScaleRule::Te.compute(3.5, 1.0, E4M3_MAX, 1), 64.0);
        // 448 / 3 is not a power of two: the f32 quotient itself.
        assert_eq!(ScaleRule::Te.compute(3.0, 1.0, E4M3_MAX, 0), 448.0f32 / 3.0);
        // Tiny amax: the quotient overflows, TE clamps to f32::MAX.
        assert_eq!(ScaleRule::Te.compute(1e-45, 1.0, E4M3_MAX, 0), f32::MAX);
    }

    #[test]
    fn power_of_two_rule_hand_worked() {
        // 448 / 3.5 = 128 exactly: floor(log2) = 7.
        assert_eq!(ScaleRule::PowerOfTwo.compute(3.5, 1.0, E4M3_MAX, 0), 128.0);
        // 448 / 3.6 = 124.4: floor(log2) = 6.
        assert_eq!(ScaleRule::PowerOfTwo.compute(3.6, 1.0, E4M3_MAX, 0), 64.0);
        assert_eq!(ScaleRule::PowerOfTwo.compute(3.6, 1.0, E4M3_MAX, 2), 16.0);
        // amax above max: a negative exponent. 448 / 1000 = 0.448 -> 2^-2.
        assert_eq!(
            ScaleRule::PowerOfTwo.compute(1000.0, 1.0, E4M3_MAX, 0),
            0.25
        );
        // amax just above 3.5 (one ulp): the exponent drops by one, exactly.
        let a = f32::from_bits(3.5f32.to_bits() + 1);
        assert_eq!(ScaleRule::PowerOfTwo.compute(a, 1.0, E4M3_MAX, 0), 64.0);
        // amax * scale never exceeds max.
        for bits in (0x0080_0000u32..0x7F00_0000).step_by(0x0001_2345) {
            let amax = f32::from_bits(bits);
            let s = ScaleRule::PowerOfTwo.compute(amax, 1.0, E4M3_MAX, 0);
            if s < 2f32.powi(127) && s > 2f32.powi(-126) {
                assert!(amax as f64 * s as f64 <= E4M3_MAX as f64, "{amax} {s}");
                assert!(amax as f64 * s as f64 * 2.0 > E4M3_MAX as f64, "{amax} {s}");
            }
        }
    }

    #[test]
    fn a_scale_whose_inverse_overflows_is_refused() {
        // TE rule, huge amax and margin: (448 / 3e38) / 2^10 is subnormal.
        assert_eq!(ScaleRule::Te.compute(3e38, 2.0, E4M3_MAX, 10), 2.0);
        assert_eq!(
            ScaleRule::PowerOfTwo.compute(3e38, 2.0, E4M3_MAX, 10),
            2f32.powi(-126)
        );
        for max in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert_eq!(ScaleRule::PowerOfTwo.compute(1.0, 3.0, max, 0), 3.0);
            assert_eq!(ScaleRule::Te.compute(1.0, 3.0, max, 0), 3.0);
        }
    }

    #[test]
    fn guards_keep_the_previous_scale() {
        for rule in [ScaleRule::Te, ScaleRule::PowerOfTwo] {
            for amax in [0.0, -0.0, -1.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                assert_eq!(rule.compute(amax, 7.0, E4M3_MAX, 0), 7.0, "{rule:?} {amax}");
            }
        }
    }
}
