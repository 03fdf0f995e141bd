//! `AmpConfig::fp8_moments`: one byte a Linear parameter less in the
//! memory report, checkpoints that resume bit for bit and convert to and
//! from FP16 second moments, and a clear error where a level keeps F32
//! moments.

use crate::ckpt_common::{build_with, contents, tmp, train};
use amp::levels::{initialize, AmpConfig, Level};
use amp::nn;
use amp::optim::{AdamWConfig, StateFormat};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

#[test]
fn fp8_moments_store_one_byte_a_linear_parameter_less() {
    for level in [Level::O2, Level::O3] {
        let (with, wctx, mut wopt) = build_with(8, level, None, true);
        let (without, octx, mut oopt) = build_with(8, level, None, false);
        train(&with, &wctx, &mut wopt, 0..2);
        train(&without, &octx, &mut oopt, 0..2);
        let (a, b) = (
            wctx.memory_report(&wopt).unwrap(),
            octx.memory_report(&oopt).unwrap(),
        );
        assert_eq!(a.linear_params, b.linear_params);
        // every second moment: one byte an element instead of two
        assert_eq!(
            2 * a.bytes.second_moments,
            b.bytes.second_moments,
            "{level}"
        );
        assert_eq!(a.bytes.second_moments, a.linear_params, "{level}");
        // O2 6 -> 5, O3 on one rank 2 + 5 -> 2 + 4
        let before = if level == Level::O2 { 6.0 } else { 7.0 };
        assert_eq!(b.predicted_bytes_per_linear_param, before, "{level}: {b}");
        assert_eq!(
            a.predicted_bytes_per_linear_param,
            before - 1.0,
            "{level}: {a}"
        );
        // measured beyond the prediction: the same scales either way
        let slack = |r: &amp::levels::MemoryReport| {
            r.measured_bytes_per_linear_param - r.predicted_bytes_per_linear_param
        };
        assert!((slack(&a) - slack(&b)).abs() < 1e-9, "{level}: {a}\n{b}");
        for p in wopt.inner().params() {
            let want = if p.exp_avg.format() == StateFormat::E4M3 {
                StateFormat::E4M3Sqrt
            } else {
                StateFormat::F32
            };
            assert_eq!(p.exp_avg_sq.format(), want, "{level} {}", p.name);
        }
    }
    assert_eq!(
        Level::O3
            .policy()
            .with_fp8_moments()
            .predicted_bytes_per_linear_param(4),
        2.0 + 4.0 / 4.0
    );
}

#[test]
fn fp8_moments_resume_bit_exact_and_convert_to_and_from_fp16() {
    let level = Level::O2;
    let (straight, sctx, mut sopt) = build_with(8, level, None, true);
    train(&straight, &sctx, &mut sopt, 0..6);
    let (first, fctx, mut fopt) = build_with(8, level, None, true);
    train(&first, &fctx, &mut fopt, 0..3);
    let mid = tmp("fp8-moments-mid.safetensors");
    fctx.save(&mid, &fopt).unwrap();
    let (resumed, rctx, mut ropt) = build_with(8, level, None, true);
    rctx.load(&mid, &mut ropt).unwrap();
    train(&resumed, &rctx, &mut ropt, 3..6);
    let (a, b) = (
        tmp("fp8-moments-straight.safetensors"),
        tmp("fp8-moments-resumed.safetensors"),
    );
    sctx.save(&a, &sopt).unwrap();
    rctx.save(&b, &ropt).unwrap();
    let (ca, cb) = (contents(&a), contents(&b));
    assert!(
        ca.0.iter().any(|(n, _)| n.ends_with("__exp_avg_sq_root")),
        "roots are saved under a name of their own"
    );
    assert_eq!(ca, cb, "a resumed run with FP8 moments is the straight run");

    // The roots' checkpoint into a run with FP16 second moments and back:
    // the values, re-encoded (FP16 holds the E4M3 roots' squares exactly).
    let (_, pctx, mut popt) = build_with(8, level, None, false);
    pctx.load(&mid, &mut popt).unwrap();
    let (_, qctx, mut qopt) = build_with(8, level, None, true);
    let fp16 = tmp("fp8-moments-fp16.safetensors");
    pctx.save(&fp16, &popt).unwrap();
    qctx.load(&fp16, &mut qopt).unwrap();
    for ((p, q), f) in popt
        .inner()
        .params()
        .iter()
        .zip(qopt.inner().params())
        .zip(fopt.inner().params())
    {
        let (vp, vq, vf) = (
            p.exp_avg_sq.to_vec().unwrap(),
            q.exp_avg_sq.to_vec().unwrap(),
            f.exp_avg_sq.to_vec().unwrap(),
        );
        assert_eq!(q.exp_avg_sq.format(), f.exp_avg_sq.format(), "{}", p.name);
        for ((x, y), z) in vp.iter().zip(&vq).zip(&vf) {
            assert!(
                (x - z).abs() <= 1e-3 * z.abs(),
                "{}: FP16 {x} vs saved {z}",
                p.name
            );
            // back to roots: E4M3's rounding of the root, at most 1/16
            assert!(
                (y.sqrt() - z.sqrt()).abs() <= z.sqrt() / 16.0,
                "{}: {y} vs {z}",
                p.name
            );
        }
    }
}

#[test]
fn fp8_moments_need_a_level_with_fp8_moments() {
    for level in [Level::O0, Level::O1] {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let _fc = nn::linear(4, 4, vb.pp("fc")).unwrap();
        let cfg = AmpConfig {
            level,
            fp8_moments: true,
            ..Default::default()
        };
        let Err(e) = initialize(&varmap, AdamWConfig::default(), cfg) else {
            panic!("{level}: fp8_moments accepted")
        };
        let e = e.to_string();
        assert!(
            e.contains("fp8_moments") && e.contains("O2"),
            "{level}: {e}"
        );
    }
}
