//! Precision telemetry (`amp::nn::set_telemetry`): what a Linear's FP8
//! casts record, against values computed here from the same tensors.

use crate::common;

use amp::nn::{self, fp8_autocast, set_telemetry, ComputeMode, GradSink};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::randt;

#[test]
fn records_follow_the_casts_and_cost_nothing_when_off() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = nn::linear(16, 8, vb.pp("l")).unwrap();
    layer.set_grad_sink(Some(GradSink::new())).unwrap();
    // one outlier 10^6 times the rest: per-tensor E4M3 flushes most of the
    // others to zero
    let mut v = common::randn(4 * 16, 5)
        .iter()
        .map(|x| x * 1e-5)
        .collect::<Vec<f32>>();
    v[7] = 10.0;
    let x = Var::from_tensor(&Tensor::from_vec(v.clone(), (4, 16), &Device::Cpu).unwrap()).unwrap();
    let step = |on: bool| {
        set_telemetry(on);
        let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
        let y = layer.forward(x.as_tensor()).unwrap();
        let out = (y * randt(&[4, 8], 6, 1.0))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward();
        set_telemetry(false);
        out.unwrap();
        layer.take_telemetry().unwrap()
    };
    assert!(
        step(false).iter().all(Option::is_none),
        "recorded while off"
    );
    let [input, weight, grad_out, wgrad] = step(true);
    let (input, weight) = (input.unwrap(), weight.unwrap());
    assert!(grad_out.is_some() && wgrad.is_some(), "every role recorded");
    assert_eq!(input.total, 64);
    assert_eq!(weight.total, 128);
    assert_eq!(wgrad.unwrap().total, 128);
    assert_eq!(input.amax, 10.0);
    // the input's flushes, counted here: |x| * scale below E4M3's smallest
    // subnormal's half (2^-10)
    let flushed = v
        .iter()
        .filter(|&&e| e != 0.0 && (e.abs() * input.scale) <= 2f32.powi(-10))
        .count() as u64;
    assert!(flushed > 20, "the outlier case flushes most ({flushed})");
    assert_eq!(input.flushed, flushed);
    assert_eq!(input.saturated, 0);
    // the weight (small, no outlier) keeps E4M3's relative precision; the
    // input loses what it flushed, which is small against the outlier
    assert!(weight.rel_err < 1.0 / 16.0, "{weight:?}");
    assert!(
        input.rel_err > 0.0 && input.rel_err < 1.0 / 16.0,
        "{input:?}"
    );
    // taken: a second read finds nothing
    assert!(layer.take_telemetry().unwrap().iter().all(Option::is_none));
}

#[test]
fn block_scaled_casts_record_too_and_keep_an_outlier_local() {
    // the outlier input of the test above through 1 x 128 tiles: its tile
    // holds the outlier, the other tiles keep E4M3's precision and flush
    // nothing (a 256-wide input: two tiles a row)
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = nn::linear(256, 128, vb.pp("l")).unwrap();
    // seeded weights: the default init draws from an unseeded generator, and
    // a uniform draw of 32768 values lands below a block's flush threshold
    // (about 2^-18 of its amax) in roughly one run in seven
    // (the weight and the bias told apart by rank: the map's order is not
    // fixed)
    for var in varmap.all_vars() {
        var.set(&randt(var.dims(), 9 + var.rank() as u64, 0.05))
            .unwrap();
    }
    let mut v = common::randn(4 * 256, 7)
        .iter()
        .map(|x| x * 1e-5)
        .collect::<Vec<f32>>();
    v[7] = 10.0;
    let x = Var::from_tensor(&Tensor::from_vec(v, (4, 256), &Device::Cpu).unwrap()).unwrap();
    set_telemetry(true);
    {
        let _s = fp8_autocast(true, ComputeMode::Fp8Block(Default::default()));
        let y = layer.forward(x.as_tensor()).unwrap();
        (y * randt(&[4, 128], 8, 1.0))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
    }
    set_telemetry(false);
    let [input, weight, grad_out, _] = layer.take_telemetry().unwrap();
    let (input, weight, grad_out) = (input.unwrap(), weight.unwrap(), grad_out.unwrap());
    assert_eq!(
        (input.total, weight.total, grad_out.total),
        (1024, 32768, 512)
    );
    assert_eq!(input.amax, 10.0);
    // the outlier's tile: 119 values beside it, flushed there; the other
    // seven tiles flush nothing
    assert!(input.flushed > 0 && input.flushed < 128, "{input:?}");
    for r in [input, weight, grad_out] {
        assert_eq!(r.saturated, 0, "{r:?}");
        assert!(r.scale > 0.0 && r.rel_err < 1.0 / 16.0, "{r:?}");
    }
    assert_eq!((weight.flushed, grad_out.flushed), (0, 0));
}
