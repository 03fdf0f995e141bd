//! FP8 formats (OCP E4M3FN and E5M2): the only place their constants live.
//!
//! Semantics of [`Fp8Format::encode`], identical to CUDA's
//! `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)`:
//! round to nearest, ties to even; finite values beyond `max()` and +-inf
//! saturate to +-max; subnormals are kept; any NaN becomes the one canonical
//! code [`Fp8Format::NAN_CODE`] (0x7F, sign dropped, as CUDA does).
//! [`Fp8Format::decode`] turns every NaN code into the canonical f32 NaN
//! [`CANONICAL_NAN_BITS`] (0x7FFF_FFFF, as CUDA does).
//!
//! The `float8` crate converts correctly but its `F8E4M3::MAX` (416) and
//! `is_infinite` (true for 448) are wrong: never use them.

use crate::error::{Error, Result};

/// Largest finite E4M3 value (S.1111.110).
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 value (S.11110.11).
pub const E5M2_MAX: f32 = 57344.0;
/// Largest finite IEEE binary16 value.
pub const F16_MAX: f32 = 65504.0;
/// The f32 bit pattern every decoded NaN code becomes.
pub const CANONICAL_NAN_BITS: u32 = 0x7FFF_FFFF;

/// An 8-bit floating-point format of the OCP FP8 specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Fp8Format {
    /// 4 exponent bits (bias 7), 3 mantissa bits, no infinities, max 448.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like inf/NaN, max 57344.
    E5M2,
}

/// The bit layout of a format, as const parameters of the generic kernels.
pub(crate) trait Layout {
    const MANT: u32;
    const BIAS: i32;
    const MAX: f32;
    const HAS_INF: bool;
}
pub(crate) struct E4M3L;
pub(crate) struct E5M2L;
impl Layout for E4M3L {
    const MANT: u32 = 3;
    const BIAS: i32 = 7;
    const MAX: f32 = E4M3_MAX;
    const HAS_INF: bool = false;
}
impl Layout for E5M2L {
    const MANT: u32 = 2;
    const BIAS: i32 = 15;
    const MAX: f32 = E5M2_MAX;
    const HAS_INF: bool = true;
}

/// Scalar encode written without data-dependent branches, so that a loop of
/// it vectorizes: both the normal and the subnormal result are computed and
/// one is selected.
#[inline(always)]
pub(crate) fn encode_bits<L: Layout>(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = f32::from_bits(bits & 0x7FFF_FFFF);
    let is_nan = abs.is_nan();
    // Saturate first: inf and anything above max become max (NaN is replaced below).
    let a = abs.min(L::MAX);
    let abits = a.to_bits();
    // Normal range: rebias the exponent and round the mantissa to MANT bits,
    // ties to even; a carry out of the mantissa bumps the exponent correctly.
    let shift = 23 - L::MANT;
    let odd = (abits >> shift) & 1;
    let rebias = ((L::BIAS - 127) as u32) << 23;
    let normal = (abits
        .wrapping_add(rebias)
        .wrapping_add((1 << (shift - 1)) - 1)
        .wrapping_add(odd)
        >> shift) as u8;
    // Subnormal range: adding 2^(24 - BIAS - MANT) makes the FPU round `a` to a
    // multiple of the smallest subnormal (ties to even); its count is the code.
    let magic_bits = ((24 - L::BIAS - L::MANT as i32 + 127) as u32) << 23;
    let sub = ((a + f32::from_bits(magic_bits)).to_bits() - magic_bits) as u8;
    let min_normal = f32::from_bits(((1 - L::BIAS + 127) as u32) << 23);
    let code = if a < min_normal { sub } else { normal } | sign;
    if is_nan {
        Fp8Format::NAN_CODE
    } else {
        code
    }
}

/// Decodes by the bit fields; used to build the tables at compile time.
const fn decode_bits(code: u8, mant: u32, bias: i32, has_inf: bool) -> f32 {
    let sign = ((code as u32) >> 7) << 31;
    let exp_bits = 7 - mant;
    let e = ((code as u32) >> mant) & ((1 << exp_bits) - 1);
    let m = (code as u32) & ((1 << mant) - 1);
    let e_max = (1 << exp_bits) - 1;
    if has_inf && e == e_max {
        return if m == 0 {
            f32::from_bits(sign | 0x7F80_0000)
        } else {
            f32::from_bits(CANONICAL_NAN_BITS)
        };
    }
    if !has_inf && e == e_max && m == (1 << mant) - 1 {
        return f32::from_bits(CANONICAL_NAN_BITS);
    }
    if e == 0 {
        // m * 2^(1 - bias - mant), exact in f32.
        let unit = f32::from_bits(((1 - bias - mant as i32 + 127) as u32) << 23);
        let v = m as f32 * unit;
        return if sign != 0 { -v } else { v };
    }
    let f32_exp = (e as i32 - bias + 127) as u32;
    f32::from_bits(sign | (f32_exp << 23) | (m << (23 - mant)))
}

const fn build_table(mant: u32, bias: i32, has_inf: bool) -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_bits(i as u8, mant, bias, has_inf);
        i += 1;
    }
    t
}

static E4M3_TABLE: [f32; 256] = build_table(3, 7, false);
static E5M2_TABLE: [f32; 256] = build_table(2, 15, true);

impl Fp8Format {
    /// The one NaN code encode produces, in both formats (S=0, all ones).
    pub const NAN_CODE: u8 = 0x7F;

    /// Largest finite value.
    pub const fn max(self) -> f32 {
        match self {
            Self::E4M3 => E4M3_MAX,
            Self::E5M2 => E5M2_MAX,
        }
    }

    /// Smallest positive normal value: 2^-6 (E4M3), 2^-14 (E5M2).
    pub fn min_normal(self) -> f32 {
        match self {
            Self::E4M3 => 2f32.powi(-6),
            Self::E5M2 => 2f32.powi(-14),
        }
    }

    /// Smallest positive subnormal value: 2^-9 (E4M3), 2^-16 (E5M2).
    pub fn min_subnormal(self) -> f32 {
        match self {
            Self::E4M3 => 2f32.powi(-9),
            Self::E5M2 => 2f32.powi(-16),
        }
    }

    /// Number of explicit mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Self::E4M3 => 3,
            Self::E5M2 => 2,
        }
    }

    /// The 256 decoded values, indexed by code.
    pub fn table(self) -> &'static [f32; 256] {
        match self {
            Self::E4M3 => &E4M3_TABLE,
            Self::E5M2 => &E5M2_TABLE,
        }
    }

    /// True for the codes that decode to NaN.
    pub fn is_nan_code(self, code: u8) -> bool {
        self.decode(code).is_nan()
    }

    /// Casts one f32 to its code (RNE, saturating, canonical NaN).
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Self::E4M3 => encode_bits::<E4M3L>(x),
            Self::E5M2 => encode_bits::<E5M2L>(x),
        }
    }

    /// The value of one code.
    #[inline]
    pub fn decode(self, code: u8) -> f32 {
        self.table()[code as usize]
    }

    /// Bulk [`encode`](Self::encode).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the slices differ in length.
    pub fn encode_slice(self, src: &[f32], dst: &mut [u8]) -> Result<()> {
        check_len("encode_slice", src.len(), dst.len())?;
        self.encode_loop(src, dst, 1.0);
        Ok(())
    }

    /// Bulk encode of `x * scale`: the product is rounded to f32 first, then cast.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the slices differ in length.
    pub fn encode_scaled_slice(self, src: &[f32], scale: f32, dst: &mut [u8]) -> Result<()> {
        check_len("encode_scaled_slice", src.len(), dst.len())?;
        self.encode_loop(src, dst, scale);
        Ok(())
    }

    /// Bulk [`decode`](Self::decode).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the slices differ in length.
    pub fn decode_slice(self, src: &[u8], dst: &mut [f32]) -> Result<()> {
        check_len("decode_slice", src.len(), dst.len())?;
        self.decode_loop(src, dst, 1.0);
        Ok(())
    }

    /// Bulk decode of `decode(code) * scale_inv` (one f32 product per element).
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] when the slices differ in length.
    pub fn decode_scaled_slice(self, src: &[u8], scale_inv: f32, dst: &mut [f32]) -> Result<()> {
        check_len("decode_scaled_slice", src.len(), dst.len())?;
        self.decode_loop(src, dst, scale_inv);
        Ok(())
    }
}

fn check_len(op: &'static str, src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(Error::LengthMismatch { op, src, dst })
    }
}

impl std::fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::E4M3 => "E4M3",
            Self::E5M2 => "E5M2",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::bulk::{decode_generic, encode_generic};

    #[test]
    fn constants_match_tables() {
        assert_eq!(Fp8Format::E4M3.decode(0x7E), E4M3_MAX);
        assert_eq!(Fp8Format::E5M2.decode(0x7B), E5M2_MAX);
        assert_eq!(
            Fp8Format::E4M3.decode(0x01),
            Fp8Format::E4M3.min_subnormal()
        );
        assert_eq!(
            Fp8Format::E5M2.decode(0x01),
            Fp8Format::E5M2.min_subnormal()
        );
        assert_eq!(Fp8Format::E4M3.decode(0x08), Fp8Format::E4M3.min_normal());
        assert_eq!(Fp8Format::E5M2.decode(0x04), Fp8Format::E5M2.min_normal());
    }

    #[test]
    fn nan_is_canonical_both_ways() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for nan in [
                f32::NAN,
                -f32::NAN,
                f32::from_bits(0x7F80_0001),
                f32::from_bits(0xFFC0_1234),
            ] {
                assert_eq!(f.encode(nan), Fp8Format::NAN_CODE);
            }
            for c in 0..=255u8 {
                let v = f.decode(c);
                if v.is_nan() {
                    assert_eq!(v.to_bits(), CANONICAL_NAN_BITS);
                }
            }
        }
    }

    #[test]
    fn every_bulk_variant_equals_the_scalar_cast() {
        let codes: Vec<u8> = (0..=255).collect();
        let xs: Vec<f32> = (0..200_000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B1)))
            .collect();
        let mut out = vec![0f32; 256];
        let mut enc = vec![0u8; xs.len()];
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            type Decode = fn(&[u8], &mut [f32], f32);
            type Encode = fn(&[f32], &mut [u8], f32);
            let (dec, encode): (Decode, Encode) = match f {
                Fp8Format::E4M3 => (decode_generic::<E4M3L>, encode_generic::<E4M3L>),
                Fp8Format::E5M2 => (decode_generic::<E5M2L>, encode_generic::<E5M2L>),
            };
            dec(&codes, &mut out, 1.0);
            for c in 0..=255u8 {
                assert_eq!(
                    out[c as usize].to_bits(),
                    f.decode(c).to_bits(),
                    "{f} {c:#04x}"
                );
            }
            encode(&xs, &mut enc, 1.0);
            for (x, e) in xs.iter().zip(&enc) {
                assert_eq!(*e, f.encode(*x));
            }
            f.encode_slice(&xs, &mut enc).unwrap();
            for (x, e) in xs.iter().zip(&enc) {
                assert_eq!(*e, f.encode(*x));
            }
        }
    }

    #[test]
    fn length_mismatch_is_an_error() {
        let mut dst = [0u8; 3];
        let err = Fp8Format::E4M3
            .encode_slice(&[1.0; 4], &mut dst)
            .unwrap_err();
        assert!(
            matches!(err, Error::LengthMismatch { src: 4, dst: 3, .. }),
            "{err}"
        );
    }
}
