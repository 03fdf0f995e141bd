//! Block-scaled casts (1 x 128 tiles, 128 x 128 blocks, rowwise) and the
//! block-scaled GEMM against an independent float64 model: every tile
//! boundary and tail, all-zero tiles, NaN and inf confined to their tile,
//! the outlier case, and the named errors.

use crate::common;

use amp::{
    block_gemm, BlockTensor, CoreError as Error, CurrentScaling, Fp8Format, QType, ScaleRule,
    ScalingTensor, Tiling,
};
use candle_core::{DType, Device, Tensor};
use common::{model_encode, positive_values, randn, t};

/// A tensor's elements, flattened.
trait Flat {
    fn flat<T: candle_core::WithDType>(&self) -> Vec<T>;
}

impl Flat for Tensor {
    fn flat<T: candle_core::WithDType>(&self) -> Vec<T> {
        self.flatten_all().unwrap().to_vec1().unwrap()
    }
}

/// The model of one tile's scale: the largest power of two `s` with
/// `amax * s <= max`, 1 where the amax is zero or not finite.
fn model_scale(amax: f64, max: f64) -> f64 {
    if !(amax > 0.0 && amax.is_finite()) {
        return 1.0;
    }
    let mut e = 0i32;
    while amax * 2f64.powi(e + 1) <= max {
        e += 1;
    }
    while amax * 2f64.powi(e) > max {
        e -= 1;
    }
    2f64.powi(e.clamp(-126, 127))
}

/// The model's codes and scale_inv of `x` `[rows, cols]` under `tiling`: a
/// tile holding inf or NaN encodes with scale 1 and stores NaN.
fn model(x: &[f32], rows: usize, cols: usize, tiling: Tiling, f: Fp8Format) -> (Vec<u8>, Vec<f64>) {
    let (th, tw) = match tiling {
        Tiling::Vec128 => (1, 128),
        Tiling::Blk128 => (128, 128),
        Tiling::Row => (1, cols.max(1)),
    };
    let (sr, sc) = (rows.div_ceil(th), cols.div_ceil(tw));
    let mut amax = vec![0f64; sr * sc];
    let mut nan = vec![false; sr * sc];
    for r in 0..rows {
        for c in 0..cols {
            let i = (r / th) * sc + c / tw;
            let v = x[r * cols + c];
            nan[i] |= v.is_nan();
            amax[i] = amax[i].max((v as f64).abs());
        }
    }
    let values = positive_values(f);
    let max = values[values.len() - 1].0;
    let bad: Vec<bool> = amax
        .iter()
        .zip(&nan)
        .map(|(a, &n)| n || a.is_infinite())
        .collect();
    let scales: Vec<f64> = amax
        .iter()
        .zip(&bad)
        .map(|(&a, &b)| if b { 1.0 } else { model_scale(a, max) })
        .collect();
    let mut codes = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let s = scales[(r / th) * sc + c / tw];
            codes[r * cols + c] = model_encode(&values, (x[r * cols + c] as f64 * s) as f32);
        }
    }
    let inv = scales
        .iter()
        .zip(&bad)
        .map(|(s, &b)| if b { f64::NAN } else { 1.0 / s });
    (codes, inv.collect())
}

/// Values spread over 2^-12..2^12 by tile, so that every tile has its own
/// scale.
fn spread(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    randn(rows * cols, seed)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi(((i / 97) % 25) as i32 - 12))
        .collect()
}

fn check_against_model(x: &[f32], rows: usize, cols: usize, tiling: Tiling, qtype: QType) {
    let f = qtype.fp8().expect("FP8");
    let q = BlockTensor::quantize(
        &t(x.to_vec(), &[rows, cols]),
        qtype,
        tiling,
        ScaleRule::PowerOfTwo,
    )
    .expect("quantize");
    let (codes, scale_inv) = model(x, rows, cols, tiling, f);
    let got: Vec<u8> = q.data().flat();
    assert_eq!(got, codes, "{tiling} {qtype} [{rows}, {cols}]: codes");
    let got_s: Vec<f32> = q.tile_scales().unwrap().flat();
    // NaN scales are the canonical NaN's bits
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let want_s: Vec<f32> = scale_inv
        .iter()
        .map(|&v| {
            if v.is_nan() {
                f32::from_bits(0x7FFF_FFFF)
            } else {
                v as f32
            }
        })
        .collect();
    assert_eq!(
        bits(&got_s),
        bits(&want_s),
        "{tiling} {qtype} [{rows}, {cols}]: scales"
    );
    // the stored layout is cuBLASLt's (1 x 128: [across][rows]; 128 x 128:
    // [down][across padded to 4], padding 1; rowwise: [rows])
    let across = tiling.tiles(rows, cols).1;
    let stored: Vec<f32> = q.scale_inv().flat();
    let (len, at): (usize, Box<dyn Fn(usize, usize) -> usize>) = match tiling {
        Tiling::Vec128 => (across * rows, Box::new(|d, a| a * rows + d)),
        Tiling::Blk128 => {
            let ld = across.div_ceil(4) * 4;
            (rows.div_ceil(128) * ld, Box::new(move |d, a| d * ld + a))
        }
        Tiling::Row => (rows, Box::new(|d, _| d)),
    };
    let mut want = vec![1f32; len];
    for (i, s) in want_s.iter().enumerate() {
        want[at(i / across, i % across)] = *s;
    }
    assert_eq!(
        bits(&stored),
        bits(&want),
        "{tiling} [{rows}, {cols}]: stored layout"
    );
    // dequantize: decode(code) * scale_inv of its tile, exactly
    let y: Vec<f32> = q.dequantize(DType::F32).unwrap().flat();
    let (th, tw) = tiling.tile(cols);
    let sc = tiling.tiles(rows, cols).1;
    for r in 0..rows {
        for c in 0..cols {
            let want = f.decode(codes[r * cols + c]) as f64 * scale_inv[(r / th) * sc + c / tw];
            let got = y[r * cols + c] as f64;
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "[{r}, {c}] {got} {want}"
            );
        }
    }
}

#[test]
fn casts_match_the_float64_model_at_every_tail() {
    for (rows, cols) in [
        (1, 1),
        (3, 128),
        (3, 129),
        (2, 300),
        (130, 257),
        (129, 128),
        (5, 77),
    ] {
        let x = spread(rows, cols, (rows * 1000 + cols) as u64);
        for tiling in [Tiling::Vec128, Tiling::Blk128, Tiling::Row] {
            for qtype in [QType::E4M3, QType::E5M2] {
                check_against_model(&x, rows, cols, tiling, qtype);
            }
        }
    }
}

#[test]
fn every_input_dtype_casts_its_own_values() {
    let x = spread(4, 200, 3);
    for dtype in [DType::F16, DType::BF16] {
        let xd = t(x.clone(), &[4, 200]).to_dtype(dtype).unwrap();
        let back: Vec<f32> = xd.to_dtype(DType::F32).unwrap().flat();
        let q =
            BlockTensor::quantize(&xd, QType::E4M3, Tiling::Vec128, ScaleRule::PowerOfTwo).unwrap();
        let (codes, _) = model(&back, 4, 200, Tiling::Vec128, Fp8Format::E4M3);
        let got: Vec<u8> = q.data().flat();
        assert_eq!(got, codes, "{dtype:?}");
    }
}

#[test]
fn zero_nan_and_inf_stay_in_their_tile() {
    let (rows, cols) = (130, 260);
    let clean = spread(rows, cols, 9);
    for tiling in [Tiling::Vec128, Tiling::Blk128, Tiling::Row] {
        let mut x = clean.clone();
        // an all-zero tile at the start of row 0 (tile (0, 0)), a NaN in the
        // tile holding [2, 130], an infinity in the one holding [129, 259]
        let (th, tw) = tiling.tile(cols);
        for r in 0..th.min(rows) {
            for c in 0..tw.min(cols) {
                x[r * cols + c] = 0.0;
            }
        }
        x[2 * cols + 130] = f32::NAN;
        x[129 * cols + 259] = f32::NEG_INFINITY;
        let q = BlockTensor::quantize(
            &t(x.clone(), &[rows, cols]),
            QType::E4M3,
            tiling,
            ScaleRule::PowerOfTwo,
        )
        .unwrap();
        let reference = BlockTensor::quantize(
            &t(clean.clone(), &[rows, cols]),
            QType::E4M3,
            tiling,
            ScaleRule::PowerOfTwo,
        )
        .unwrap();
        check_against_model(&x, rows, cols, tiling, QType::E4M3);
        let s: Vec<Vec<f32>> = q.tile_scales().unwrap().to_vec2().unwrap();
        let s_ref: Vec<Vec<f32>> = reference.tile_scales().unwrap().to_vec2().unwrap();
        let sc = tiling.tiles(rows, cols).1;
        let touched = |tr: usize, tc: usize| {
            [(0, 0), (2, 130), (129, 259)]
                .iter()
                .any(|&(r, c)| r / th == tr && (c / tw).min(sc - 1) == tc)
        };
        let zero_tile = (0, 0);
        for (tr, row) in s.iter().enumerate() {
            for (tc, &v) in row.iter().enumerate() {
                if (tr, tc) == zero_tile {
                    assert_eq!(v, 1.0, "{tiling}: the zero tile keeps scale 1");
                } else if touched(tr, tc) {
                    assert!(v.is_nan(), "{tiling}: tile ({tr}, {tc}) holds inf or NaN");
                } else {
                    assert_eq!(v, s_ref[tr][tc], "{tiling}: tile ({tr}, {tc}) unaffected");
                }
            }
        }
        // the tiles with inf or NaN decode to NaN
        let y: Vec<Vec<f32>> = q.dequantize(DType::F32).unwrap().to_vec2().unwrap();
        assert!(y[2][130].is_nan() && y[129][259].is_nan(), "{tiling}");
        let codes: Vec<Vec<u8>> = q.data().to_vec2().unwrap();
        assert_eq!(codes[2][130], 0x7F, "NaN encodes to NaN");
        assert_eq!(codes[129][259], 0xFE, "-inf saturates to -448");
        assert_eq!(codes[0][0], 0, "zero tile");
    }
}

#[test]
fn one_outlier_costs_only_its_tile() {
    // 8 rows of 128 (8 tiles of 1 x 128): the rest log-uniform over
    // 2^-8..1, one value 10^4 above the rest's top in tile 0.
    let n = 8 * 128;
    let u = randn(n, 21);
    let mut x: Vec<f32> = u
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let sign = if v.is_sign_negative() { -1.0 } else { 1.0 };
            sign * 2f32.powf(-8.0 * ((i * 7919 % 1000) as f32 / 1000.0))
        })
        .collect();
    x[5] = 1e4;
    let xt = t(x.clone(), &[8, 128]);
    let rel = |y: &[f32], i: usize| ((y[i] - x[i]) / x[i]).abs();
    // per tensor: the scale fits 10^4 into 448 (2^-5), and the rest falls
    // into E4M3's subnormals, where the spacing is 2^-9
    let (pt, _) = ScalingTensor::quantize(&xt, QType::E4M3, &CurrentScaling::default()).unwrap();
    let y: Vec<f32> = pt.dequantize(DType::F32).unwrap().flat();
    let rest: Vec<usize> = (0..n).filter(|&i| i != 5).collect();
    let eps = 0.125; // E4M3's machine epsilon, 2^-3
    let worse = rest.iter().filter(|&&i| rel(&y, i) > eps).count();
    let flushed = rest.iter().filter(|&&i| y[i] == 0.0).count();
    assert!(
        worse * 2 > rest.len(),
        "per tensor: {worse} of {} beyond eps",
        rest.len()
    );
    assert!(flushed > 0, "per tensor flushes some of the rest to zero");
    // 1 x 128 tiles: every other tile within half an ulp (2^-4) of each value
    let q = BlockTensor::quantize(&xt, QType::E4M3, Tiling::Vec128, ScaleRule::PowerOfTwo).unwrap();
    let y: Vec<f32> = q.dequantize(DType::F32).unwrap().flat();
    for i in 128..n {
        assert!(rel(&y, i) <= 0.0625, "block: [{i}] {} vs {}", y[i], x[i]);
    }
}

/// f64 product of the decoded operands (independent decode: the model's
/// values, each tile's scale_inv).
fn model_gemm(a: &BlockTensor, b: &BlockTensor) -> Vec<f64> {
    let decode = |q: &BlockTensor| -> Vec<f64> {
        let f = q.qtype().fp8().unwrap();
        let (rows, cols) = q.shape().dims2().unwrap();
        let codes: Vec<u8> = q.data().flat();
        let s: Vec<f32> = q.tile_scales().unwrap().flat();
        let (th, tw) = q.tiling().tile(cols);
        let sc = q.tiling().tiles(rows, cols).1;
        let values = positive_values(f);
        let value = |c: u8| {
            let v = values
                .iter()
                .find(|(_, k)| *k == c & 0x7F)
                .map_or(f64::NAN, |v| v.0);
            if c & 0x80 != 0 {
                -v
            } else {
                v
            }
        };
        (0..rows * cols)
            .map(|i| value(codes[i]) * s[(i / cols / th) * sc + (i % cols) / tw] as f64)
            .collect()
    };
    let (m, k) = a.shape().dims2().unwrap();
    let n = b.shape().dims2().unwrap().0;
    let (da, db) = (decode(a), decode(b));
    let mut y = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k).map(|p| da[i * k + p] * db[j * k + p]).sum();
        }
    }
    y
}

#[test]
fn block_gemm_matches_float64() {
    let (m, n, k) = (130, 200, 300);
    let xa = t(spread(m, k, 31), &[m, k]);
    let xb = t(spread(n, k, 32), &[n, k]);
    for (ta, tb) in [
        (Tiling::Vec128, Tiling::Blk128),
        (Tiling::Vec128, Tiling::Vec128),
        (Tiling::Blk128, Tiling::Vec128),
        (Tiling::Row, Tiling::Row),
    ] {
        let a = BlockTensor::quantize(&xa, QType::E4M3, ta, ScaleRule::PowerOfTwo).unwrap();
        let b = BlockTensor::quantize(&xb, QType::E4M3, tb, ScaleRule::PowerOfTwo).unwrap();
        let y: Vec<f32> = block_gemm(&a, &b, DType::F32).unwrap().flat();
        let want = model_gemm(&a, &b);
        // f32 accumulation over k = 300 terms: bound by the sum of |terms|
        let norm: f64 = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
        for (i, (&g, &w)) in y.iter().zip(&want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-5 * norm.max(1e-30),
                "{ta} x {tb} [{i}] {g} {w}"
            );
        }
        // and the GEMM of the transposed 128 x 128 operand (dgrad's W)
        if tb == Tiling::Blk128 {
            let bt = b.t().unwrap();
            assert_eq!(bt.shape().dims(), [k, n]);
            let back: Vec<f32> = bt.t().unwrap().dequantize(DType::F32).unwrap().flat();
            let orig: Vec<f32> = b.dequantize(DType::F32).unwrap().flat();
            assert_eq!(back, orig, "128x128 blocks transpose exactly");
        }
    }
}

#[test]
fn bad_inputs_are_named_errors() {
    let x = t(vec![1.0; 12], &[3, 4]);
    let r = ScaleRule::PowerOfTwo;
    assert!(matches!(
        BlockTensor::quantize(&x, QType::F16, Tiling::Vec128, r),
        Err(Error::Unsupported { .. })
    ));
    let x3 = x.reshape((3, 2, 2)).unwrap();
    assert!(matches!(
        BlockTensor::quantize(&x3, QType::E4M3, Tiling::Vec128, r),
        Err(Error::Rank { .. })
    ));
    let xi = x.to_dtype(DType::U32).unwrap();
    assert!(matches!(
        BlockTensor::quantize(&xi, QType::E4M3, Tiling::Vec128, r),
        Err(Error::DType { .. })
    ));
    let w = BlockTensor::quantize(&x, QType::E4M3, Tiling::Blk128, r).unwrap();
    assert!(matches!(
        block_gemm(&w, &w, DType::F32),
        Err(Error::Unsupported { .. })
    ));
    let a = BlockTensor::quantize(&x, QType::E4M3, Tiling::Vec128, r).unwrap();
    let other =
        BlockTensor::quantize(&t(vec![1.0; 15], &[3, 5]), QType::E4M3, Tiling::Blk128, r).unwrap();
    assert!(matches!(
        block_gemm(&a, &other, DType::F32),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        block_gemm(&a, &w, DType::U8),
        Err(Error::DType { .. })
    ));
    assert!(matches!(a.t(), Err(Error::Unsupported { .. })));
    let bad = Tensor::ones((3, 2), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        BlockTensor::from_parts(a.data().clone(), bad, QType::E4M3, Tiling::Vec128),
        Err(Error::Shape { .. })
    ));
    let ok = BlockTensor::from_parts(
        a.data().clone(),
        a.scale_inv().clone(),
        QType::E4M3,
        Tiling::Vec128,
    )
    .unwrap();
    assert_eq!(ok.nbytes(), 12 + 4 * 3);
}

#[test]
fn the_pair_cast_is_both_casts() {
    for (rows, cols) in [(1, 1), (3, 129), (130, 257), (256, 128), (0, 5)] {
        let x = t(spread(rows, cols, 41), &[rows, cols]);
        let r = ScaleRule::PowerOfTwo;
        for tiling in [Tiling::Vec128, Tiling::Row] {
            let (a, b) =
                BlockTensor::quantize_pair(&x, QType::E5M2, tiling, r, (true, true)).unwrap();
            let (a, b) = (a.unwrap(), b.unwrap());
            let one = BlockTensor::quantize(&x, QType::E5M2, tiling, r).unwrap();
            let xt = x.t().unwrap().contiguous().unwrap();
            let other = BlockTensor::quantize(&xt, QType::E5M2, tiling, r).unwrap();
            for (got, want, what) in [(&a, &one, "rowwise"), (&b, &other, "transposed")] {
                assert_eq!(
                    got.data().flat::<u8>(),
                    want.data().flat::<u8>(),
                    "[{rows}, {cols}] {what} codes"
                );
                assert_eq!(
                    got.scale_inv().flat::<f32>(),
                    want.scale_inv().flat::<f32>(),
                    "[{rows}, {cols}] {what} scales"
                );
                assert_eq!(got.shape(), want.shape());
            }
            let (none, only_t) =
                BlockTensor::quantize_pair(&x, QType::E5M2, tiling, r, (false, true)).unwrap();
            assert!(none.is_none() && only_t.is_some());
        }
        assert!(
            BlockTensor::quantize_pair(&x, QType::E5M2, Tiling::Blk128, r, (true, true)).is_err()
        );
    }
}

/// A scaled FP16 weight decoded straight into a GEMM's dtype
/// (`Weight::native`) holds the values of the F32 decode converted, and
/// `of_scaled` leaves the CPU to cast the decoded value itself (`None`);
/// a target that is not FP8 is an error.
#[test]
fn a_scaled_weight_decodes_straight_and_the_cpu_casts_its_value() {
    let x = Tensor::from_vec(spread(256, 384, 3), (256, 384), &Device::Cpu).unwrap();
    let (w, _) = ScalingTensor::quantize(&x, QType::F16, &CurrentScaling::default()).unwrap();
    let weight = amp::Weight::F16(w.clone());
    let bits = |t: Tensor| -> Vec<u32> {
        t.to_dtype(DType::F32)
            .unwrap()
            .flat::<f32>()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let straight = weight.native(dtype).unwrap();
        assert_eq!(straight.dtype(), dtype);
        let converted = weight.master_f32().unwrap().to_dtype(dtype).unwrap();
        assert_eq!(bits(straight), bits(converted), "{dtype:?}");
    }
    for tiling in [Tiling::Blk128, Tiling::Row, Tiling::Vec128] {
        let r = BlockTensor::of_scaled(
            &w,
            DType::BF16,
            QType::E4M3,
            tiling,
            ScaleRule::PowerOfTwo,
            (true, true),
        )
        .unwrap();
        assert!(r.is_none(), "{tiling}: the CPU took a CUDA path");
    }
    let not_fp8 = BlockTensor::of_scaled(
        &w,
        DType::BF16,
        QType::F16,
        Tiling::Blk128,
        ScaleRule::PowerOfTwo,
        (true, true),
    );
    assert!(not_fp8.is_err());
}
