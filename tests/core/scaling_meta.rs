//! ScalingMeta: the amax history ring and both compute algorithms step by
//! step against hand-worked values; the guards for zero, inf and NaN amax.

use amp::{AmaxComputeAlgo, CoreError as Error, DelayedScaling, QType, ScaleRule, ScalingMeta};
use candle_core::{Device, Tensor};

fn amax(v: f32) -> Tensor {
    Tensor::new(&[v], &Device::Cpu).unwrap()
}

fn history(m: &ScalingMeta) -> Vec<f32> {
    m.amax_history().to_vec1().unwrap()
}

fn scale(m: &ScalingMeta) -> f32 {
    m.scale().to_vec1::<f32>().unwrap()[0]
}

fn scale_inv(m: &ScalingMeta) -> f32 {
    m.scale_inv().to_vec1::<f32>().unwrap()[0]
}

#[test]
fn history_rolls_in_transformer_engine_order() {
    let mut m = ScalingMeta::new(QType::E4M3, 4, &Device::Cpu).unwrap();
    // step 1: amax 2 recorded in slot 0
    m.record_amax(&amax(2.0)).unwrap();
    assert_eq!(history(&m), [2.0, 0.0, 0.0, 0.0]);
    m.update_scale(ScaleRule::Te, AmaxComputeAlgo::Max, 0)
        .unwrap();
    // roll by -1: slot 0 moves to the end; slot 0 zeroed
    assert_eq!(history(&m), [0.0, 0.0, 0.0, 2.0]);
    assert_eq!(scale(&m), 224.0); // 448 / 2
                                  // step 2: amax 8
    m.record_amax(&amax(8.0)).unwrap();
    assert_eq!(history(&m), [8.0, 0.0, 0.0, 2.0]);
    m.update_scale(ScaleRule::Te, AmaxComputeAlgo::Max, 0)
        .unwrap();
    assert_eq!(history(&m), [0.0, 0.0, 2.0, 8.0]);
    assert_eq!(scale(&m), 56.0); // 448 / max(8, 2)
                                 // step 3: amax 1; max over the window is still 8
    m.record_amax(&amax(1.0)).unwrap();
    m.update_scale(ScaleRule::Te, AmaxComputeAlgo::Max, 0)
        .unwrap();
    assert_eq!(history(&m), [0.0, 2.0, 8.0, 1.0]);
    assert_eq!(scale(&m), 56.0);
    // steps 4, 5, 6: amax 1 each; 2 and then 8 fall out of the window (3 past + current)
    let mut scales = vec![];
    for _ in 0..3 {
        m.record_amax(&amax(1.0)).unwrap();
        m.update_scale(ScaleRule::Te, AmaxComputeAlgo::Max, 0)
            .unwrap();
        scales.push(scale(&m));
    }
    assert_eq!(scales, [56.0, 56.0, 448.0]);
    assert_eq!(history(&m), [0.0, 1.0, 1.0, 1.0]);
    assert_eq!(scale_inv(&m), 1.0 / 448.0);
}

#[test]
fn most_recent_uses_only_the_current_slot() {
    let mut m = ScalingMeta::new(QType::E4M3, 3, &Device::Cpu).unwrap();
    let mut scales = vec![];
    for a in [4.0, 1.0, 2.0] {
        m.record_amax(&amax(a)).unwrap();
        m.update_scale(ScaleRule::Te, AmaxComputeAlgo::MostRecent, 0)
            .unwrap();
        scales.push(scale(&m));
    }
    assert_eq!(scales, [112.0, 448.0, 224.0]);
    assert_eq!(history(&m), [0.0, 1.0, 2.0]);
}

#[test]
fn power_of_two_rule_and_margin() {
    let mut m = ScalingMeta::new(QType::E5M2, 1, &Device::Cpu).unwrap();
    m.record_amax(&amax(100.0)).unwrap();
    m.update_scale(ScaleRule::PowerOfTwo, AmaxComputeAlgo::Max, 1)
        .unwrap();
    // 57344 / 100 = 573.4 -> 2^9 = 512, margin 1 -> 256
    assert_eq!(scale(&m), 256.0);
    assert_eq!(scale_inv(&m), 1.0 / 256.0);
    let mut f16 = ScalingMeta::new(QType::F16, 1, &Device::Cpu).unwrap();
    f16.record_amax(&amax(1e-3)).unwrap();
    f16.update_scale(ScaleRule::PowerOfTwo, AmaxComputeAlgo::Max, 0)
        .unwrap();
    // 65504 / 1e-3 = 6.55e7 -> 2^25
    assert_eq!(scale(&f16), 2f32.powi(25));
}

#[test]
fn recording_twice_in_a_step_keeps_the_larger_and_nan_wins() {
    let mut m = ScalingMeta::new(QType::E4M3, 2, &Device::Cpu).unwrap();
    m.record_amax(&amax(3.0)).unwrap();
    m.record_amax(&amax(1.0)).unwrap();
    assert_eq!(history(&m)[0], 3.0);
    m.record_amax(&amax(f32::NAN)).unwrap();
    m.record_amax(&amax(5.0)).unwrap();
    assert!(history(&m)[0].is_nan());
}

#[test]
fn zero_inf_and_nan_amax_keep_the_previous_scale() {
    for rule in [ScaleRule::Te, ScaleRule::PowerOfTwo] {
        let mut m = ScalingMeta::new(QType::E4M3, 1, &Device::Cpu)
            .unwrap()
            .with_scale(8.0)
            .unwrap();
        for bad in [0.0, f32::INFINITY, f32::NAN] {
            m.record_amax(&amax(bad)).unwrap();
            m.update_scale(rule, AmaxComputeAlgo::Max, 0).unwrap();
            assert_eq!(scale(&m), 8.0, "{rule:?} {bad}");
            assert_eq!(scale_inv(&m), 0.125);
        }
    }
    // A NaN anywhere in the window keeps the scale under `max` until it leaves.
    let mut m = ScalingMeta::new(QType::E4M3, 2, &Device::Cpu).unwrap();
    m.record_amax(&amax(f32::NAN)).unwrap();
    m.update_scale(ScaleRule::Te, AmaxComputeAlgo::Max, 0)
        .unwrap();
    m.record_amax(&amax(4.0)).unwrap();
    m.update_scale(ScaleRule::Te, AmaxComputeAlgo::Max, 0)
        .unwrap();
    assert_eq!(scale(&m), 1.0);
    m.record_amax(&amax(4.0)).unwrap();
    m.update_scale(ScaleRule::Te, AmaxComputeAlgo::Max, 0)
        .unwrap();
    assert_eq!(scale(&m), 112.0);
}

#[test]
fn delayed_update_honours_margin_and_interval() {
    let recipe = DelayedScaling {
        margin: 1,
        interval: 2,
        amax_history_len: 1,
        ..Default::default()
    };
    let mut m = ScalingMeta::new(QType::E4M3, recipe.amax_history_len, &Device::Cpu).unwrap();
    let mut scales = vec![];
    for a in [1.0, 2.0, 4.0, 8.0] {
        m.record_amax(&amax(a)).unwrap();
        m.update_delayed(&recipe).unwrap();
        scales.push(scale(&m));
    }
    // updates 0 and 2 recompute (448 / amax / 2), 1 and 3 keep the scale
    assert_eq!(scales, [224.0, 224.0, 56.0, 56.0]);
    assert_eq!(m.updates(), 4);
}

#[test]
fn interval_skips_scale_updates_but_the_history_rolls_every_step() {
    let recipe = DelayedScaling {
        interval: 3,
        amax_history_len: 3,
        ..Default::default()
    };
    let mut m = ScalingMeta::new(QType::E4M3, recipe.amax_history_len, &Device::Cpu).unwrap();
    let mut trace = vec![];
    for a in [1.0, 2.0, 4.0, 8.0, 0.5] {
        m.record_amax(&amax(a)).unwrap();
        m.update_delayed(&recipe).unwrap();
        trace.push((scale(&m), history(&m)));
    }
    assert_eq!(
        trace,
        [
            (448.0, vec![0.0, 0.0, 1.0]), // update 0 recomputes: 448 / 1
            (448.0, vec![0.0, 1.0, 2.0]), // update 1 keeps the scale
            (448.0, vec![0.0, 2.0, 4.0]), // update 2 keeps it
            (56.0, vec![0.0, 4.0, 8.0]),  // update 3 recomputes: max(2, 4, 8)
            (56.0, vec![0.0, 8.0, 0.5]),  // update 4 keeps it
        ]
    );
}

#[test]
fn bad_inputs_are_named_errors() {
    let e = ScalingMeta::new(QType::E4M3, 0, &Device::Cpu).unwrap_err();
    assert!(
        matches!(&e, Error::Config { field, .. } if field == "amax_history_len"),
        "{e}"
    );
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = ScalingMeta::new(QType::E4M3, 1, &Device::Cpu)
            .unwrap()
            .with_scale(bad)
            .unwrap_err();
        assert!(matches!(e, Error::BadScale { .. }), "{e}");
    }
    let dev = Device::Cpu;
    let one = Tensor::ones(1, candle_core::DType::F32, &dev).unwrap();
    let two = Tensor::ones(2, candle_core::DType::F32, &dev).unwrap();
    let e =
        ScalingMeta::from_parts(QType::E4M3, two.clone(), one.clone(), one.clone()).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let f16 = one.to_dtype(candle_core::DType::F16).unwrap();
    let e = ScalingMeta::from_parts(QType::E4M3, one.clone(), f16, one.clone()).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let e = ScalingMeta::from_parts(
        QType::E4M3,
        one.clone(),
        one.clone(),
        Tensor::ones((1, 1), candle_core::DType::F32, &dev).unwrap(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Rank { .. }), "{e}");
    let mut m = ScalingMeta::new(QType::E4M3, 1, &dev).unwrap();
    let e = m.record_amax(&two).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}
