//! ScalingTensor: quantize / dequantize round trips within the format's
//! bound, the FP8 GEMM against a float64 matmul, and the named errors.

use crate::common;

use amp::{
    fp8_gemm, CoreError as Error, CurrentScaling, QType, ScaleRule, ScalingMeta, ScalingTensor,
};
use candle_core::{DType, Device, Tensor};
use common::{f64s, randn, randt, rel_err, t};

/// FP8 GEMM with F32 output against f64: only the f32 accumulation order
/// and the scale products differ.
const GEMM_F32_RTOL: f64 = 1e-6;

#[test]
fn round_trip_error_is_within_half_an_ulp() {
    // Values spread over many binades so that scaled values cover the whole
    // normal range of each format, plus its subnormals.
    let x: Vec<f32> = randn(4096, 1)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 2f32.powi((i % 16) as i32 - 8))
        .collect();
    let xt = t(x.clone(), &[64, 64]);
    for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
        let (q, amax) = ScalingTensor::quantize(&xt, qtype, &CurrentScaling::default()).unwrap();
        assert_eq!(q.shape().dims(), [64, 64]);
        assert_eq!(q.data().dtype(), qtype.storage_dtype());
        let want_amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(amax.to_vec1::<f32>().unwrap(), [want_amax]);
        let scale = 1.0 / q.scale_inv().unwrap();
        assert!(
            want_amax * scale <= qtype.max(),
            "{qtype}: amax * scale within max"
        );
        let (mant, min_normal, min_sub) = match qtype {
            QType::E4M3 => (3, 2f32.powi(-6), 2f32.powi(-9)),
            QType::E5M2 => (2, 2f32.powi(-14), 2f32.powi(-16)),
            QType::F16 => (10, 2f32.powi(-14), 2f32.powi(-24)),
        };
        let y: Vec<f32> = q
            .dequantize(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut normals = 0;
        for (a, b) in x.iter().zip(&y) {
            let err = (*a as f64 - *b as f64).abs();
            if (a.abs() * scale) >= min_normal {
                normals += 1;
                // half an ulp, relative: 2^-(mant + 1) of the value
                assert!(
                    err <= a.abs() as f64 * 2f64.powi(-(mant + 1)),
                    "{qtype}: {a} -> {b}"
                );
            } else {
                // half the smallest subnormal, absolute, in unscaled units
                assert!(err <= (min_sub / 2.0 / scale) as f64, "{qtype}: {a} -> {b}");
            }
        }
        assert!(normals > 3000, "{qtype}: {normals} normal");
        if qtype == QType::E4M3 {
            assert!(normals < 4096, "E4M3: the subnormal range is exercised too");
        }
    }
}

#[test]
fn quantize_takes_every_float_dtype_and_dequantize_gives_every_float_dtype() {
    let x = t(vec![0.5, -1.25, 3.0, 0.0, -0.0, 7.5], &[2, 3]);
    let want: Vec<f64> = f64s(&x);
    for in_dtype in [DType::F32, DType::F16, DType::BF16] {
        let xin = x.to_dtype(in_dtype).unwrap();
        let (q, _) =
            ScalingTensor::quantize(&xin, QType::E4M3, &CurrentScaling::default()).unwrap();
        for out in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let y = q.dequantize(out).unwrap();
            assert_eq!(y.dtype(), out);
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&f64s(&y)),
                bits(&want),
                "{in_dtype:?} -> {out:?} (signed zeros included)"
            );
        }
    }
}

#[test]
fn quantize_with_uses_the_given_scale_and_reports_amax() {
    let x = t(vec![1.0, -2.0, 600.0], &[3]);
    let meta = ScalingMeta::new(QType::E4M3, 16, &Device::Cpu)
        .unwrap()
        .with_scale(0.5)
        .unwrap();
    let (q, amax) = ScalingTensor::quantize_with(&x, &meta).unwrap();
    assert_eq!(amax.to_vec1::<f32>().unwrap(), [600.0]);
    assert_eq!(q.scale_inv().unwrap(), 2.0);
    // 600 * 0.5 = 300 -> nearest E4M3 is 288 (step 32 above 256); 288 * 2 = 576
    assert_eq!(
        q.dequantize(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
        [1.0, -2.0, 576.0]
    );
    // A second cast with a scale that overflows saturates to max.
    let big = meta.clone().with_scale(4.0).unwrap();
    let (q, _) = ScalingTensor::quantize_with(&x, &big).unwrap();
    assert_eq!(
        q.dequantize(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
        [1.0, -2.0, 112.0]
    );
}

#[test]
fn requantize_changes_format_with_a_fresh_scale() {
    let x = t(randn(1000, 7), &[1000]);
    let r = CurrentScaling::default();
    let (q16, _) = ScalingTensor::quantize(&x, QType::F16, &r).unwrap();
    let (q8, amax) = q16.requantize(QType::E4M3, &r).unwrap();
    assert_eq!(q8.qtype(), QType::E4M3);
    // Same as quantizing the F32 value of the FP16 tensor.
    let direct = ScalingTensor::quantize(&q16.dequantize(DType::F32).unwrap(), QType::E4M3, &r)
        .unwrap()
        .0;
    assert_eq!(
        q8.data().to_vec1::<u8>().unwrap(),
        direct.data().to_vec1::<u8>().unwrap()
    );
    let a = amax.to_vec1::<f32>().unwrap()[0];
    assert_eq!(
        q8.scale_inv().unwrap(),
        1.0 / ScaleRule::PowerOfTwo.compute(a, 1.0, 448.0, 0)
    );
}

#[test]
fn all_zero_and_non_finite_inputs_keep_scale_one() {
    let zeros = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
    let (q, _) = ScalingTensor::quantize(&zeros, QType::E4M3, &CurrentScaling::default()).unwrap();
    assert_eq!(q.scale_inv().unwrap(), 1.0);
    let x = t(vec![1.0, f32::NAN, f32::INFINITY, -f32::INFINITY], &[4]);
    let (q, amax) = ScalingTensor::quantize(&x, QType::E4M3, &CurrentScaling::default()).unwrap();
    assert!(amax.to_vec1::<f32>().unwrap()[0].is_nan());
    assert_eq!(q.scale_inv().unwrap(), 1.0);
    assert_eq!(q.data().to_vec1::<u8>().unwrap(), [0x38, 0x7F, 0x7E, 0xFE]);
}

#[test]
fn nbytes_counts_data_and_metadata() {
    let x = Tensor::ones((10, 10), DType::F32, &Device::Cpu).unwrap();
    let (q8, _) = ScalingTensor::quantize(&x, QType::E4M3, &CurrentScaling::default()).unwrap();
    assert_eq!(q8.nbytes(), 100 + 4 + 4 + 4);
    let (q16, _) = ScalingTensor::quantize(&x, QType::F16, &CurrentScaling::default()).unwrap();
    assert_eq!(q16.nbytes(), 200 + 12);
    let meta = ScalingMeta::new(QType::E4M3, 16, &Device::Cpu).unwrap();
    assert_eq!(meta.nbytes(), 4 + 4 + 16 * 4);
}

#[test]
fn bad_inputs_are_named_errors() {
    let r = CurrentScaling::default();
    let dev = Device::Cpu;
    // unsupported input dtype
    let ints = Tensor::new(&[1u32, 2], &dev).unwrap();
    let e = ScalingTensor::quantize(&ints, QType::E4M3, &r).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let x = Tensor::ones((2, 8), DType::F32, &dev).unwrap();
    let (q, _) = ScalingTensor::quantize(&x, QType::E4M3, &r).unwrap();
    // unsupported output dtype
    let e = q.dequantize(DType::U8).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    // data dtype that does not match the qtype
    let meta = ScalingMeta::new(QType::E4M3, 1, &dev).unwrap();
    let e = ScalingTensor::from_parts(x.clone(), meta).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    // GEMM: k mismatch, rank, FP16 operand, output dtype
    let (q3, _) = ScalingTensor::quantize(
        &Tensor::ones((2, 3), DType::F32, &dev).unwrap(),
        QType::E4M3,
        &r,
    )
    .unwrap();
    let e = fp8_gemm(&q, &q3, DType::F32).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let (q1d, _) =
        ScalingTensor::quantize(&Tensor::ones(8, DType::F32, &dev).unwrap(), QType::E4M3, &r)
            .unwrap();
    let e = fp8_gemm(&q1d, &q, DType::F32).unwrap_err();
    assert!(matches!(e, Error::Rank { .. }), "{e}");
    let (q16, _) = ScalingTensor::quantize(&x, QType::F16, &r).unwrap();
    let e = fp8_gemm(&q, &q16, DType::F32).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    let e = fp8_gemm(&q, &q, DType::U32).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
}

#[test]
fn cast_stats_count_saturated_and_flushed_elements() {
    let x = t(
        vec![1e-6, 1000.0, 1.0, 0.0, -1e-7, f32::INFINITY, -500.0, 448.0],
        &[8],
    );
    let meta = ScalingMeta::new(QType::E4M3, 1, &Device::Cpu).unwrap();
    let (q, _) = ScalingTensor::quantize_with(&x, &meta).unwrap();
    let s = q.cast_stats(&x).unwrap();
    assert_eq!((s.saturated, s.flushed, s.total), (3, 2, 8));
    // With a scale from current scaling nothing saturates.
    let x = t(vec![1.0, 2.0, 300.0], &[3]);
    let (q, _) = ScalingTensor::quantize(&x, QType::E5M2, &CurrentScaling::default()).unwrap();
    assert_eq!(q.cast_stats(&x).unwrap().saturated, 0);
    let e = q.cast_stats(&t(vec![1.0], &[1])).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}

#[test]
fn te_rule_scales_round_trip_within_half_an_ulp_plus_f32_rounding() {
    // A non-power-of-two scale adds the f32 roundings of x * scale, of
    // scale_inv and of the final product: 3 * 2^-24 relative at most.
    let x = t(randn(4096, 31), &[4096]);
    for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
        let mut meta = ScalingMeta::new(qtype, 4, &Device::Cpu).unwrap();
        let (_, amax) = ScalingTensor::quantize_with(&x, &meta).unwrap();
        meta.record_amax(&amax).unwrap();
        meta.update_scale(ScaleRule::Te, amp::AmaxComputeAlgo::Max, 0)
            .unwrap();
        let (q, _) = ScalingTensor::quantize_with(&x, &meta).unwrap();
        let scale = meta.scale().to_vec1::<f32>().unwrap()[0];
        assert_ne!(
            scale.log2().fract(),
            0.0,
            "{qtype}: a TE scale that is not a power of two"
        );
        let mant = match qtype {
            QType::E4M3 => 3,
            QType::E5M2 => 2,
            QType::F16 => 10,
        };
        let bound = 2f64.powi(-(mant + 1)) + 3.0 * 2f64.powi(-24);
        let (xs, ys) = (f64s(&x), f64s(&q.dequantize(DType::F32).unwrap()));
        let min_normal = match qtype {
            QType::E4M3 => 2f64.powi(-6),
            QType::E5M2 | QType::F16 => 2f64.powi(-14),
        };
        for (a, b) in xs.iter().zip(&ys) {
            if a.abs() * scale as f64 >= min_normal {
                assert!((a - b).abs() <= a.abs() * bound, "{qtype}: {a} -> {b}");
            }
        }
        // And the GEMM with TE scales on both sides.
        let w = randt(&[64, 64], 32, 0.1);
        let mut wm = ScalingMeta::new(QType::E4M3, 1, &Device::Cpu).unwrap();
        let (_, wa) = ScalingTensor::quantize_with(&w, &wm).unwrap();
        wm.record_amax(&wa).unwrap();
        wm.update_scale(ScaleRule::Te, amp::AmaxComputeAlgo::Max, 0)
            .unwrap();
        let (wq, _) = ScalingTensor::quantize_with(&w, &wm).unwrap();
        if qtype.fp8().is_some() {
            let a = ScalingTensor::quantize_with(&x.reshape((64, 64)).unwrap(), &meta)
                .unwrap()
                .0;
            let (ad, bd) = (
                f64s(&a.dequantize(DType::F64).unwrap()),
                f64s(&wq.dequantize(DType::F64).unwrap()),
            );
            let want: Vec<f64> = (0..64 * 64)
                .map(|i| {
                    (0..64)
                        .map(|j| ad[(i / 64) * 64 + j] * bd[(i % 64) * 64 + j])
                        .sum()
                })
                .collect();
            let err = rel_err(&f64s(&fp8_gemm(&a, &wq, DType::F32).unwrap()), &want);
            assert!(err < GEMM_F32_RTOL, "{qtype} TE-scaled GEMM: {err:e}");
        }
    }
}

#[test]
fn requantize_adds_at_most_one_rounding_of_the_target_format() {
    let x = t(randn(2048, 41), &[2048]);
    let r = CurrentScaling::default();
    let all = [QType::E4M3, QType::E5M2, QType::F16];
    for from in all {
        let (q, _) = ScalingTensor::quantize(&x, from, &r).unwrap();
        let qv = f64s(&q.dequantize(DType::F32).unwrap());
        for to in all {
            let (rq, _) = q.requantize(to, &r).unwrap();
            assert_eq!(rq.qtype(), to);
            let rv = f64s(&rq.dequantize(DType::F32).unwrap());
            let mant = match to {
                QType::E4M3 => 3,
                QType::E5M2 => 2,
                QType::F16 => 10,
            };
            let scale = 1.0 / rq.scale_inv().unwrap() as f64;
            for (a, b) in qv.iter().zip(&rv) {
                // half an ulp of the target, relative, or half its smallest
                // subnormal in the subnormal range
                let tol =
                    (a.abs() * 2f64.powi(-(mant + 1))).max(2f64.powi(-(mant + 1) - 16) / scale);
                assert!((a - b).abs() <= tol, "{from}->{to}: {a} -> {b}");
            }
            if from == to {
                assert_eq!(rv, qv, "{from}: re-encoding the same format is exact");
            }
        }
    }
}

#[test]
fn a_scale_that_is_not_finite_positive_and_normal_is_refused() {
    let x = t(vec![1.0, 2.0], &[2]);
    let dev = Device::Cpu;
    for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY, 1e-39] {
        let e = ScalingMeta::new(QType::E4M3, 1, &dev)
            .unwrap()
            .with_scale(bad)
            .unwrap_err();
        assert!(matches!(e, Error::BadScale { .. }), "{e}");
        let s = Tensor::new(&[bad], &dev).unwrap();
        let one = Tensor::ones(1, DType::F32, &dev).unwrap();
        let meta =
            ScalingMeta::from_parts(QType::E4M3, s.clone(), one.clone(), one.clone()).unwrap();
        let e = ScalingTensor::quantize_with(&x, &meta).unwrap_err();
        assert!(
            matches!(e, Error::BadScale { .. }),
            "quantize with scale {bad}: {e}"
        );
        let meta = ScalingMeta::from_parts(QType::E4M3, one.clone(), s, one).unwrap();
        let codes = Tensor::new(&[0x38u8], &dev).unwrap();
        let q = ScalingTensor::from_parts(codes, meta).unwrap();
        let e = q.dequantize(DType::F32).unwrap_err();
        assert!(
            matches!(e, Error::BadScale { .. }),
            "dequantize with scale_inv {bad}: {e}"
        );
    }
}

#[test]
fn fp16_nan_is_canonical_both_ways() {
    let x = t(vec![f32::NAN, -f32::NAN, 1.0], &[3]);
    let meta = ScalingMeta::new(QType::F16, 1, &Device::Cpu).unwrap();
    let (q, _) = ScalingTensor::quantize_with(&x, &meta).unwrap();
    let bits: Vec<u16> = q
        .data()
        .to_vec1::<half::f16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(bits[..2], [amp::F16_NAN_BITS; 2]);
    let y = q.dequantize(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(y[0].to_bits(), amp::CANONICAL_NAN_BITS);
}
