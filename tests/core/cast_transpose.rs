//! The cast-transpose (`ScalingTensor::quantize_with_t`, `quantize_t`, and
//! from a scaled FP16 tensor `requantize_t`, `requantize_with_t`): the cast
//! and its transpose bit for bit, on the CPU (the reference the CUDA kernel
//! is checked against by `examples/cuda_check`).

use crate::common;

use amp::{CoreError as Error, CurrentScaling, QType, ScalingMeta, ScalingTensor};
use candle_core::{DType, Device, Tensor};
use common::randt;

fn bits(t: &Tensor) -> Vec<u8> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::U8 => t.to_vec1::<u8>().unwrap(),
        _ => t
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect(),
    }
}

/// A scaled FP16 tensor (an O2 weight) cast to FP8 with its transpose is,
/// bit for bit, the cast of its dequantized F32 value: codes, transposed
/// codes, scale, amax and counts, under current and delayed scaling, also
/// with inf and NaN among the values and a scale that sends some values
/// past the FP8 range. An FP8 source and a 1-D one take the F32 path.
#[test]
fn requantize_t_is_the_cast_of_the_dequantized_value() {
    amp::set_cast_counts(true);
    let mut v = common::randn(37 * 70, 5);
    v[3] = f32::INFINITY;
    v[40] = f32::NAN;
    v[41] = -0.0;
    v[42] = 1e-9;
    let x = Tensor::from_vec(v, (37, 70), &Device::Cpu).unwrap();
    let w = ScalingTensor::quantize(&x, QType::F16, &CurrentScaling::default())
        .unwrap()
        .0;
    let value = w.dequantize(DType::F32).unwrap();
    for qtype in [QType::E4M3, QType::E5M2] {
        let r = CurrentScaling::default();
        let (q, qt, amax) = w.requantize_t(qtype, &r).unwrap();
        let (e, et, eamax) = ScalingTensor::quantize_t(&value, qtype, &r).unwrap();
        assert_eq!(bits(q.data()), bits(e.data()), "{qtype} codes");
        assert_eq!(bits(qt.data()), bits(et.data()), "{qtype} transposed");
        assert_eq!(bits(&amax), bits(&eamax), "{qtype} amax");
        assert_eq!(
            q.scale_inv().unwrap().to_bits(),
            e.scale_inv().unwrap().to_bits()
        );
        assert_eq!(
            q.meta().last_cast_stats().unwrap().unwrap(),
            e.meta().last_cast_stats().unwrap().unwrap()
        );
        for scale in [1.0f32, 3.0e4] {
            let meta = ScalingMeta::new(qtype, 1, &Device::Cpu)
                .unwrap()
                .with_scale(scale)
                .unwrap();
            let (q, qt, amax) = w.requantize_with_t(&meta).unwrap();
            let (e, et, eamax) = ScalingTensor::quantize_with_t(&value, &meta).unwrap();
            assert_eq!(bits(q.data()), bits(e.data()), "{qtype} x{scale} codes");
            assert_eq!(bits(qt.data()), bits(et.data()), "{qtype} x{scale} t");
            assert_eq!(bits(&amax), bits(&eamax), "{qtype} x{scale} amax");
            assert_eq!(
                q.meta().last_cast_stats().unwrap(),
                e.meta().last_cast_stats().unwrap()
            );
        }
    }
    // an FP8 source, and a 1-D one (refused by rank, as quantize_t)
    let w8 = ScalingTensor::quantize(&x, QType::E4M3, &CurrentScaling::default())
        .unwrap()
        .0;
    let r = CurrentScaling::default();
    let (q, _, _) = w8.requantize_t(QType::E5M2, &r).unwrap();
    let (e, _, _) =
        ScalingTensor::quantize_t(&w8.dequantize(DType::F32).unwrap(), QType::E5M2, &r).unwrap();
    assert_eq!(bits(q.data()), bits(e.data()), "from E4M3");
    let flat = ScalingTensor::quantize(&x.flatten_all().unwrap(), QType::F16, &r)
        .unwrap()
        .0;
    let e = flat.requantize_t(QType::E4M3, &r).unwrap_err();
    assert!(matches!(e, Error::Rank { .. }), "{e}");
}

/// The cast-transpose returns the cast and its transpose, bit for bit, with
/// one metadata (scale, amax, counts) for both; FP16 and a non-2-D input
/// are handled (cast then transpose) or refused (rank).
#[test]
fn quantize_with_t_is_the_cast_and_its_transpose() {
    amp::set_cast_counts(true);
    let x = randt(&[37, 70], 11, 4.0);
    for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
        let meta = ScalingMeta::new(qtype, 1, &Device::Cpu)
            .unwrap()
            .with_scale(5.0)
            .unwrap();
        let (q, qt, amax) = ScalingTensor::quantize_with_t(&x, &meta).unwrap();
        let (r, ramax) = ScalingTensor::quantize_with(&x, &meta).unwrap();
        assert_eq!(qt.shape().dims(), [70, 37], "{qtype}");
        assert_eq!(bits(q.data()), bits(r.data()), "{qtype} codes");
        assert_eq!(
            bits(qt.data()),
            bits(r.t().unwrap().data()),
            "{qtype} transposed"
        );
        assert_eq!(bits(&amax), bits(&ramax), "{qtype} amax");
        for s in [&q, &qt] {
            assert_eq!(
                s.meta().last_cast_stats().unwrap(),
                r.meta().last_cast_stats().unwrap(),
                "{qtype} counts"
            );
            assert_eq!(s.scale_inv().unwrap(), r.scale_inv().unwrap());
        }
        let (c, ct, _) = ScalingTensor::quantize_t(&x, qtype, &CurrentScaling::default()).unwrap();
        let (rc, _) = ScalingTensor::quantize(&x, qtype, &CurrentScaling::default()).unwrap();
        assert_eq!(bits(c.data()), bits(rc.data()), "{qtype} current");
        assert_eq!(
            bits(ct.data()),
            bits(rc.t().unwrap().data()),
            "{qtype} current t"
        );
    }
    let meta = ScalingMeta::new(QType::E4M3, 1, &Device::Cpu).unwrap();
    let e = ScalingTensor::quantize_with_t(&x.flatten_all().unwrap(), &meta).unwrap_err();
    assert!(matches!(e, Error::Rank { .. }), "{e}");
}
