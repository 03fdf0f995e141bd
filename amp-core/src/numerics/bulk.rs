//! Bulk casts: the loops behind `Fp8Format::{encode,decode}_*slice`, written
//! once and compiled for the baseline target and, on x86-64, for AVX2
//! (chosen at run time), where they vectorize. Bit-identical to the scalar
//! casts (tested for every code and many inputs).

use crate::numerics::format::{encode_bits, Fp8Format, Layout, CANONICAL_NAN_BITS, E4M3L, E5M2L};

/// Decodes by arithmetic on the bits (no table gather), so that a loop of it
/// vectorizes; equal to the table for every code (tested).
#[inline(always)]
fn decode_arith<L: Layout>(code: u8) -> f32 {
    let c = code as u32;
    let sign = (c & 0x80) << 24;
    let mag = c & 0x7F;
    let normal = f32::from_bits((mag << (23 - L::MANT)) + (((127 - L::BIAS) as u32) << 23));
    let unit = f32::from_bits(((1 - L::BIAS - L::MANT as i32 + 127) as u32) << 23);
    let sub = mag as f32 * unit;
    let v = if mag < (1 << L::MANT) { sub } else { normal };
    let v = f32::from_bits(v.to_bits() | sign);
    // Specials: E4M3 has NaN at 0x7F only; E5M2 has inf at 0x7C, NaN above.
    let inf_code = if L::HAS_INF { 0x7C } else { 0x80 };
    let nan_from = if L::HAS_INF { 0x7D } else { 0x7F };
    let v = if mag == inf_code {
        f32::from_bits(sign | 0x7F80_0000)
    } else {
        v
    };
    if mag >= nan_from {
        f32::from_bits(CANONICAL_NAN_BITS)
    } else {
        v
    }
}

/// The bulk loops, written once and compiled twice on x86-64: for the
/// baseline target and for AVX2 (chosen at run time), where they vectorize.
macro_rules! bulk_loops {
    ($($attr:meta)?; $encode:ident, $decode:ident) => {
        $(#[$attr])?
        pub(crate) fn $encode<L: Layout>(src: &[f32], dst: &mut [u8], scale: f32) {
            for (d, &x) in dst.iter_mut().zip(src) {
                *d = encode_bits::<L>(x * scale);
            }
        }
        $(#[$attr])?
        pub(crate) fn $decode<L: Layout>(src: &[u8], dst: &mut [f32], scale_inv: f32) {
            for (d, &c) in dst.iter_mut().zip(src) {
                *d = decode_arith::<L>(c) * scale_inv;
            }
        }
    };
}
bulk_loops!(; encode_generic, decode_generic);
#[cfg(target_arch = "x86_64")]
bulk_loops!(target_feature(enable = "avx2"); encode_avx2, decode_avx2);

/// Calls the AVX2 build of a loop where the CPU has AVX2, else the baseline
/// one, for the format's layout.
macro_rules! dispatch {
    ($format:expr, $avx2:ident, $generic:ident, $($arg:expr),*) => {{
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present, checked on the line above.
            unsafe {
                match $format {
                    Fp8Format::E4M3 => $avx2::<E4M3L>($($arg),*),
                    Fp8Format::E5M2 => $avx2::<E5M2L>($($arg),*),
                }
            }
            return;
        }
        match $format {
            Fp8Format::E4M3 => $generic::<E4M3L>($($arg),*),
            Fp8Format::E5M2 => $generic::<E5M2L>($($arg),*),
        }
    }};
}

impl Fp8Format {
    pub(crate) fn encode_loop(self, src: &[f32], dst: &mut [u8], scale: f32) {
        dispatch!(self, encode_avx2, encode_generic, src, dst, scale)
    }

    pub(crate) fn decode_loop(self, src: &[u8], dst: &mut [f32], scale_inv: f32) {
        dispatch!(self, decode_avx2, decode_generic, src, dst, scale_inv)
    }
}
