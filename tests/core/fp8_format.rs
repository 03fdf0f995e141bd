//! The FP8 casts against the OCP spec: every code, every tie, saturation,
//! NaN, zeros and subnormals, from vectors made by ml_dtypes
//! (tests/data/gen_fp8_vectors.py), an f64 model and a property test.

use crate::common;

use amp::{Fp8Format, CANONICAL_NAN_BITS, E4M3_MAX, E5M2_MAX};
use common::{model_encode, positive_values};
use proptest::prelude::*;

const FORMATS: [(Fp8Format, &str); 2] = [(Fp8Format::E4M3, "e4m3"), (Fp8Format::E5M2, "e5m2")];

struct Vectors {
    decode_bits: Vec<u32>,
    input_bits: Vec<u32>,
    codes: Vec<u8>,
}

fn vectors(name: &str) -> Vectors {
    let text = include_str!("../data/fp8_vectors.toml");
    let table: toml::Table = text.parse().expect("vector file parses");
    let section = table[name].as_table().expect("format section");
    let ints = |key: &str| -> Vec<i64> {
        section[key]
            .as_array()
            .expect("array")
            .iter()
            .map(|v| v.as_integer().expect("int"))
            .collect()
    };
    Vectors {
        decode_bits: ints("decode_bits").into_iter().map(|v| v as u32).collect(),
        input_bits: ints("input_bits").into_iter().map(|v| v as u32).collect(),
        codes: ints("codes").into_iter().map(|v| v as u8).collect(),
    }
}

#[test]
fn all_256_codes_decode_as_the_spec_says() {
    for (format, name) in FORMATS {
        let v = vectors(name);
        assert_eq!(v.decode_bits.len(), 256);
        for code in 0..=255u8 {
            let want = f32::from_bits(v.decode_bits[code as usize]);
            let got = format.decode(code);
            if want.is_nan() {
                assert_eq!(got.to_bits(), CANONICAL_NAN_BITS, "{name} {code:#04x}");
            } else {
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{name} {code:#04x}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn nan_codes_and_infinities_are_where_the_spec_puts_them() {
    let nans = |f: Fp8Format| {
        (0..=255u8)
            .filter(|&c| f.decode(c).is_nan())
            .collect::<Vec<_>>()
    };
    assert_eq!(nans(Fp8Format::E4M3), [0x7F, 0xFF]);
    assert_eq!(nans(Fp8Format::E5M2), [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF]);
    assert_eq!(Fp8Format::E5M2.decode(0x7C), f32::INFINITY);
    assert_eq!(Fp8Format::E5M2.decode(0xFC), f32::NEG_INFINITY);
    assert!((0..=255u8).all(|c| !Fp8Format::E4M3.decode(c).is_infinite()));
    assert_eq!(Fp8Format::E4M3.max(), E4M3_MAX);
    assert_eq!(Fp8Format::E5M2.max(), E5M2_MAX);
}

#[test]
fn encode_of_decode_is_identity_for_every_non_nan_code() {
    for (format, name) in FORMATS {
        for code in 0..=255u8 {
            let v = format.decode(code);
            if v.is_nan() {
                assert_eq!(format.encode(v), Fp8Format::NAN_CODE);
            } else if v.is_infinite() {
                // E5M2 +-inf saturates to +-max by the SATFINITE rule.
                assert_eq!(
                    format.encode(v),
                    if v > 0.0 { 0x7B } else { 0xFB },
                    "{name}"
                );
            } else {
                assert_eq!(format.encode(v), code, "{name} {code:#04x} = {v}");
            }
        }
    }
}

#[test]
fn encode_matches_ml_dtypes_at_every_tie_and_edge() {
    for (format, name) in FORMATS {
        let v = vectors(name);
        assert!(
            v.input_bits.len() > 1000,
            "{name}: {} vectors",
            v.input_bits.len()
        );
        let inputs: Vec<f32> = v.input_bits.iter().map(|&b| f32::from_bits(b)).collect();
        for (x, &want) in inputs.iter().zip(&v.codes) {
            assert_eq!(
                format.encode(*x),
                want,
                "{name}: encode({x:e} = {:#010x})",
                x.to_bits()
            );
        }
        let mut bulk = vec![0u8; inputs.len()];
        format.encode_slice(&inputs, &mut bulk).unwrap();
        assert_eq!(bulk, v.codes, "{name}: bulk encode");
    }
}

#[test]
fn hand_picked_cases() {
    let e4 = Fp8Format::E4M3;
    let e5 = Fp8Format::E5M2;
    // 1.0625 is the midpoint of 1.0 (0x38) and 1.125 (0x39): to even, 0x38.
    assert_eq!(e4.encode(1.0625), 0x38);
    // 1.1875 is the midpoint of 1.125 (0x39) and 1.25 (0x3A): to even, 0x3A.
    assert_eq!(e4.encode(1.1875), 0x3A);
    // Saturation: beyond max and infinities go to max, sign kept.
    for x in [449.0, 464.0, 480.0, 1e30, f32::INFINITY] {
        assert_eq!(e4.encode(x), 0x7E);
        assert_eq!(e4.encode(-x), 0xFE);
    }
    assert_eq!(e5.encode(61440.0), 0x7B);
    assert_eq!(e5.encode(f32::NEG_INFINITY), 0xFB);
    // Zeros keep their sign; half the smallest subnormal is a tie to zero.
    assert_eq!(e4.encode(0.0), 0x00);
    assert_eq!(e4.encode(-0.0), 0x80);
    assert_eq!(e4.encode(2f32.powi(-10)), 0x00);
    assert_eq!(
        e4.encode(f32::from_bits(2f32.powi(-10).to_bits() + 1)),
        0x01
    );
    assert_eq!(e4.encode(-1e-30), 0x80);
    // 1.5 * smallest subnormal is a tie between codes 1 and 2: to even, 2.
    assert_eq!(e4.encode(1.5 * 2f32.powi(-9)), 0x02);
    // Largest subnormal rounds up into the smallest normal at its top midpoint.
    assert_eq!(e4.encode(7.5 * 2f32.powi(-9)), 0x08);
    assert_eq!(e5.encode(3.5 * 2f32.powi(-16)), 0x04);
}

#[test]
fn encode_matches_the_f64_model_on_a_dense_sweep() {
    // Every sign and exponent, with mantissas at and around every position
    // an FP8 tie can take (bits 19..22 set, low bits 0, 1, all-ones).
    for (format, name) in FORMATS {
        let values = positive_values(format);
        for hi in 0..(1u32 << 13) {
            for lo in [
                0u32, 1, 0x3_FFFF, 0x4_0000, 0x4_0001, 0x7_FFFF, 0x1_FFFF, 0x2_0000, 0x2_0001,
            ] {
                let bits = (hi << 19) | lo;
                let x = f32::from_bits(bits);
                assert_eq!(
                    format.encode(x),
                    model_encode(&values, x),
                    "{name} {bits:#010x}"
                );
            }
        }
    }
}

#[test]
fn float8_crate_agrees_on_finite_values_below_max() {
    // An independent third opinion for E4M3 (its constants are wrong, its
    // conversion is right): only where semantics coincide.
    for bits in (0u32..0x43E0_0000).step_by(977) {
        let x = f32::from_bits(bits);
        let theirs = float8::F8E4M3::from_f32(x).to_bits();
        assert_eq!(Fp8Format::E4M3.encode(x), theirs, "{bits:#010x}");
    }
}

#[test]
fn bulk_decode_equals_scalar_decode() {
    for (format, _) in FORMATS {
        let codes: Vec<u8> = (0..=255).collect();
        let mut out = vec![0f32; 256];
        format.decode_slice(&codes, &mut out).unwrap();
        for (c, v) in codes.iter().zip(&out) {
            assert_eq!(v.to_bits(), format.decode(*c).to_bits());
        }
        format.decode_scaled_slice(&codes, 0.5, &mut out).unwrap();
        for (c, v) in codes.iter().zip(&out) {
            assert_eq!(v.to_bits(), (format.decode(*c) * 0.5).to_bits());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn encode_matches_the_f64_model(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        for (format, _) in FORMATS {
            prop_assert_eq!(format.encode(x), model_encode(&positive_values(format), x));
        }
    }

    #[test]
    fn scaled_encode_is_encode_of_the_f32_product(x in -1e6f32..1e6, e in -20i32..20) {
        let scale = 2f32.powi(e) * 1.3;
        for (format, _) in FORMATS {
            let mut out = [0u8];
            format.encode_scaled_slice(&[x], scale, &mut out).unwrap();
            prop_assert_eq!(out[0], format.encode(x * scale));
        }
    }
}
