//! The cast-transpose (`ScalingTensor::quantize_with_t`, `quantize_t`): the
//! cast and its transpose bit for bit, on the CPU (the reference the CUDA
//! kernel is checked against by `examples/cuda_check`).

mod common;

use amp::{CurrentScaling, Error, QType, ScalingMeta, ScalingTensor};
use candle_core::{DType, Device, Tensor};
use common::randt;

/// The cast-transpose returns the cast and its transpose, bit for bit, with
/// one metadata (scale, amax, counts) for both; FP16 and a non-2-D input
/// are handled (cast then transpose) or refused (rank).
#[test]
fn quantize_with_t_is_the_cast_and_its_transpose() {
    let x = randt(&[37, 70], 11, 4.0);
    for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
        let meta = ScalingMeta::new(qtype, 1, &Device::Cpu)
            .unwrap()
            .with_scale(5.0)
            .unwrap();
        let (q, qt, amax) = ScalingTensor::quantize_with_t(&x, &meta).unwrap();
        let (r, ramax) = ScalingTensor::quantize_with(&x, &meta).unwrap();
        assert_eq!(qt.shape().dims(), [70, 37], "{qtype}");
        let bits = |t: &Tensor| -> Vec<u8> {
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
        };
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
