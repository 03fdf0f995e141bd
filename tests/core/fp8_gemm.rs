//! The FP8 GEMM reference against a float64 matmul of the decoded inputs.

use crate::common;

use amp::{
    fp8_gemm, fp8_gemm_amax, fp8_gemm_fused, CurrentScaling, Epilogue, QType, ScalingTensor,
};
use candle_core::DType;
use common::{f64s, randn, rel_err, t};

/// FP8 GEMM with F32 output against f64: only the f32 accumulation order
/// and the scale products differ.
const GEMM_F32_RTOL: f64 = 1e-6;
/// BF16 output adds one rounding to 8 significant bits.
const GEMM_BF16_RTOL: f64 = 1.0 / 256.0;

/// `a [m, k]` (unit scale) and `b [n, k]` (times `b_scale`) from seeds,
/// current-scaled to `qa` and `qb`.
fn operands(
    (m, k, n): (usize, usize, usize),
    (qa, qb): (QType, QType),
    seeds: (u64, u64),
    b_scale: f32,
) -> (ScalingTensor, ScalingTensor) {
    let sc = CurrentScaling::default();
    let a = t(randn(m * k, seeds.0), &[m, k]);
    let b = t(
        randn(n * k, seeds.1).iter().map(|v| v * b_scale).collect(),
        &[n, k],
    );
    let (aq, _) = ScalingTensor::quantize(&a, qa, &sc).unwrap();
    let (bq, _) = ScalingTensor::quantize(&b, qb, &sc).unwrap();
    (aq, bq)
}

/// The float64 product `A · Bᵀ` of the decoded operands, row-major `[m, n]`.
fn reference(aq: &ScalingTensor, bq: &ScalingTensor) -> Vec<f64> {
    let (m, k) = aq.shape().dims2().unwrap();
    let n = bq.shape().dims2().unwrap().0;
    let ad = f64s(&aq.dequantize(DType::F64).unwrap());
    let bd = f64s(&bq.dequantize(DType::F64).unwrap());
    let mut want = vec![0f64; m * n];
    for r in 0..m {
        for c in 0..n {
            want[r * n + c] = (0..k).map(|j| ad[r * k + j] * bd[c * k + j]).sum();
        }
    }
    want
}

#[test]
fn fp8_gemm_matches_a_float64_matmul_of_the_decoded_inputs() {
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
            let seeds = (10 + i as u64, 20 + i as u64);
            let (aq, bq) = operands((m, k, n), (qa, qb), seeds, 0.02);
            let want = reference(&aq, &bq);
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

/// The epilogue: `round((A·Bᵀ·α + residual) + bias)` is the F32 product with
/// the two addends added in that order in f32 and one rounding (bit for bit
/// on the CPU), within BF16's rounding of a float64 reference, and without
/// addends the plain GEMM.
#[test]
fn fp8_gemm_fused_adds_residual_and_bias_before_one_rounding() {
    let (m, n) = (24, 32);
    let (aq, bq) = operands((m, 48, n), (QType::E4M3, QType::E4M3), (31, 32), 0.05);
    let dot = reference(&aq, &bq);
    let bias = t(randn(n, 33), &[n]).to_dtype(DType::BF16).unwrap();
    let res = t(randn(m * n, 34).iter().map(|v| v * 3.0).collect(), &[m, n])
        .to_dtype(DType::BF16)
        .unwrap();
    let f32s = |x: &candle_core::Tensor| x.to_dtype(DType::F32).unwrap();
    let product = fp8_gemm(&aq, &bq, DType::F32).unwrap();
    for (with_bias, with_res) in [(true, true), (true, false), (false, true)] {
        let epi = Epilogue {
            bias: with_bias.then_some(&bias),
            residual: with_res.then_some(&res),
        };
        let y = fp8_gemm_fused(&aq, &bq, DType::BF16, true, epi).unwrap();
        let mut want = product.clone();
        if with_res {
            want = (want + f32s(&res)).unwrap();
        }
        if with_bias {
            want = want.broadcast_add(&f32s(&bias)).unwrap();
        }
        let exact = want.to_dtype(DType::BF16).unwrap();
        assert_eq!(
            f64s(&y),
            f64s(&exact),
            "bias {with_bias} residual {with_res}"
        );
        // against float64 sums of the decoded operands and the addends
        let (bias64, res64) = (f64s(&bias), f64s(&res));
        let want64: Vec<f64> = (0..m * n)
            .map(|i| {
                dot[i]
                    + if with_res { res64[i] } else { 0.0 }
                    + if with_bias { bias64[i % n] } else { 0.0 }
            })
            .collect();
        let err = rel_err(&f64s(&y), &want64);
        assert!(err < GEMM_BF16_RTOL, "rel err {err:e}");
    }
    let plain = fp8_gemm_fused(&aq, &bq, DType::BF16, false, Epilogue::default()).unwrap();
    let want = fp8_gemm(&aq, &bq, DType::BF16).unwrap();
    assert_eq!(f64s(&plain), f64s(&want), "no addends");
}

#[test]
fn fp8_gemm_fused_refuses_addends_of_the_wrong_shape_or_dtype() {
    let sc = CurrentScaling::default();
    let (aq, _) = ScalingTensor::quantize(&t(randn(64, 1), &[4, 16]), QType::E4M3, &sc).unwrap();
    let (bq, _) = ScalingTensor::quantize(&t(randn(128, 2), &[8, 16]), QType::E4M3, &sc).unwrap();
    let bad = [
        t(randn(7, 3), &[7]),
        t(randn(8, 3), &[1, 8]),
        t(randn(32, 3), &[8, 4]),
        t(randn(8, 3), &[8]).to_dtype(DType::U32).unwrap(),
    ];
    for (i, x) in bad.iter().enumerate() {
        let as_bias = Epilogue {
            bias: Some(x),
            residual: None,
        };
        let as_res = Epilogue {
            bias: None,
            residual: Some(x),
        };
        for epi in [as_bias, as_res] {
            let e = fp8_gemm_fused(&aq, &bq, DType::BF16, false, epi);
            assert!(
                e.is_err(),
                "addend {i} {:?} {:?} accepted",
                x.dims(),
                x.dtype()
            );
        }
    }
}

/// `fp8_gemm_amax`: the output is the plain GEMM's, the amax the bits of
/// max |y| (the amax a current-scaling cast of y takes), NaN where an
/// operand's cast saw inf or NaN; `quantize_from_amax` with it casts y to
/// the same codes and scales as `quantize`.
#[test]
fn fp8_gemm_amax_is_the_outputs_amax_and_carries_the_flags() {
    let sc = CurrentScaling::default();
    let (m, k) = (20, 32);
    let (aq, bq) = operands((m, k, 12), (QType::E5M2, QType::E4M3), (41, 42), 0.1);
    let (y, amax) = fp8_gemm_amax(&aq, &bq, DType::F32, false).unwrap();
    let plain = fp8_gemm(&aq, &bq, DType::F32).unwrap();
    assert_eq!(f64s(&y), f64s(&plain));
    let want = f64s(&plain).iter().fold(0f64, |m, v| m.max(v.abs()));
    assert_eq!(f64s(&amax), vec![want]);
    let (q1, a1) = ScalingTensor::quantize(&plain, QType::E4M3, &sc).unwrap();
    let (q2, a2) = ScalingTensor::quantize_from_amax(&y, QType::E4M3, &sc, amax).unwrap();
    assert_eq!(f64s(&a1), f64s(&a2));
    assert_eq!(f64s(q1.data()), f64s(q2.data()), "codes");
    assert_eq!(
        f64s(q1.meta().scale_inv()),
        f64s(q2.meta().scale_inv()),
        "scale_inv"
    );
    // an operand whose source held inf: finite codes (saturated), NaN amax
    let mut bad = randn(m * k, 43);
    bad[5] = f32::INFINITY;
    let (bad_q, _) = ScalingTensor::quantize(&t(bad, &[m, k]), QType::E4M3, &sc).unwrap();
    let (_, amax) = fp8_gemm_amax(&bad_q, &bq, DType::F32, false).unwrap();
    assert!(f64s(&amax)[0].is_nan(), "non-finite operand: amax {amax}");
    let (_, amax) = fp8_gemm_amax(&bq, &bad_q, DType::F32, false).unwrap();
    assert!(
        f64s(&amax)[0].is_nan(),
        "non-finite second operand: amax {amax}"
    );
    // a wrong-size amax is refused
    let two = t(vec![1.0, 2.0], &[2]);
    assert!(ScalingTensor::quantize_from_amax(&y, QType::E4M3, &sc, two).is_err());
}
