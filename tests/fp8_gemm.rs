//! The FP8 GEMM reference against a float64 matmul of the decoded inputs.

mod common;

use amp::{fp8_gemm, CurrentScaling, QType, ScalingTensor};
use candle_core::DType;
use common::{f64s, randn, rel_err, t};

/// FP8 GEMM with F32 output against f64: only the f32 accumulation order
/// and the scale products differ.
const GEMM_F32_RTOL: f64 = 1e-6;
/// BF16 output adds one rounding to 8 significant bits.
const GEMM_BF16_RTOL: f64 = 1.0 / 256.0;

#[test]
fn fp8_gemm_matches_a_float64_matmul_of_the_decoded_inputs() {
    let r = CurrentScaling::default();
    for (i, &(m, k, n)) in [
        (1, 16, 1),
        (3, 17, 5),
        (16, 64, 32),
        (33, 250, 19),
        (128, 512, 96),
    ]
    .iter()
    .enumerate()
    {
        for (qa, qb) in [
            (QType::E4M3, QType::E4M3),
            (QType::E5M2, QType::E4M3),
            (QType::E4M3, QType::E5M2),
        ] {
            let a = t(randn(m * k, 10 + i as u64), &[m, k]);
            let b = t(
                randn(n * k, 20 + i as u64)
                    .iter()
                    .map(|v| v * 0.02)
                    .collect(),
                &[n, k],
            );
            let (aq, _) = ScalingTensor::quantize(&a, qa, &r).unwrap();
            let (bq, _) = ScalingTensor::quantize(&b, qb, &r).unwrap();
            let ad = f64s(&aq.dequantize(DType::F64).unwrap());
            let bd = f64s(&bq.dequantize(DType::F64).unwrap());
            let mut want = vec![0f64; m * n];
            for r in 0..m {
                for c in 0..n {
                    want[r * n + c] = (0..k).map(|j| ad[r * k + j] * bd[c * k + j]).sum();
                }
            }
            let y = fp8_gemm(&aq, &bq, DType::F32).unwrap();
            assert_eq!(y.dims(), [m, n]);
            let err = rel_err(&f64s(&y), &want);
            assert!(
                err < GEMM_F32_RTOL,
                "({m},{k},{n}) {qa}x{qb}: rel err {err:e}"
            );
            let y16 = fp8_gemm(&aq, &bq, DType::BF16).unwrap();
            assert_eq!(y16.dtype(), DType::BF16);
            let err = rel_err(&f64s(&y16), &want);
            assert!(err < GEMM_BF16_RTOL, "bf16 out: rel err {err:e}");
        }
    }
}
