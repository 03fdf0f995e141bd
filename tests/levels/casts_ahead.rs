//! The weights' FP8 casts made ahead (`amp::nn::cast_weights_ahead`, which
//! `AmpContext::step` calls after each step): the forward that takes them
//! computes what it computes casting its weights itself, and a cast made
//! for another weight or another recipe is never taken.

use crate::common;

use amp::levels::{initialize, AmpConfig, Compute, Level};
use amp::nn::{self, fp8_autocast, ComputeMode, Linear};
use amp::optim::AdamWConfig;
use amp::{CurrentScaling, QType, ScaleRule, ScalingTensor, Weight};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::{masters, randn, randt, seed_varmap, t, values};

const D: usize = 16;

fn config(level: Level) -> AmpConfig {
    AmpConfig {
        level,
        compute: Compute::Fp8Current {
            recipe: Default::default(),
        },
        ..Default::default()
    }
}

fn model(varmap: &VarMap) -> (Linear, Linear) {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    let fc1 = nn::linear(D, 2 * D, vb.pp("fc1")).unwrap();
    let fc2 = nn::linear(2 * D, D, vb.pp("fc2")).unwrap();
    seed_varmap(varmap, 70, 0.3);
    (fc1, fc2)
}

fn forward(fc1: &Linear, fc2: &Linear, x: &Tensor) -> amp::Result<Tensor> {
    Ok(fc2.forward(&fc1.forward(x)?.relu()?)?.sqr()?.mean_all()?)
}

fn out(fc1: &Linear, fc2: &Linear, x: &Tensor, r: &CurrentScaling) -> Vec<u32> {
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(r.clone()));
    let y = fc2.forward(&fc1.forward(x).unwrap()).unwrap();
    values(&y).iter().map(|v| v.to_bits()).collect()
}

/// At O1 and O2 (FP16 weights) both layers' weights are cast ahead after
/// a step, and the forward taking them is bit for bit the forward casting
/// them itself; after a weight is replaced, or under another recipe, the
/// forward casts again (a stale cast would give the old weight's output).
/// At O0 and O3 nothing is cast ahead.
#[test]
fn a_forward_takes_only_casts_made_from_its_own_weight() {
    let x = t(randn(4 * D, 3), &[4, D]);
    let r = CurrentScaling::default();
    for level in [Level::O1, Level::O2] {
        let varmap = VarMap::new();
        let (fc1, fc2) = model(&varmap);
        let (amp, mut opt) = initialize(&varmap, AdamWConfig::default(), config(level)).unwrap();
        for step in 0..2u64 {
            let xs = t(randn(4 * D, 10 + step), &[4, D]);
            amp.step(&mut opt, || forward(&fc1, &fc2, &xs)).unwrap();
        }
        // the step cast both ahead; the first forward takes them
        let ahead = out(&fc1, &fc2, &x, &r);
        let itself = out(&fc1, &fc2, &x, &r);
        assert_eq!(ahead, itself, "{level:?}");
        assert_eq!(
            nn::cast_weights_ahead(amp.linears()).unwrap(),
            2,
            "{level:?}"
        );
        // a new weight in fc1's slot: the cast made ahead is the old one's
        let (w, _) = ScalingTensor::quantize(&randt(&[2 * D, D], 99, 0.5), QType::F16, &r).unwrap();
        fc1.weight_slot().replace(Weight::F16(w)).unwrap();
        let replaced = out(&fc1, &fc2, &x, &r);
        assert_eq!(replaced, out(&fc1, &fc2, &x, &r), "{level:?}");
        assert_ne!(
            replaced, itself,
            "{level:?}: the new weight changes the output"
        );
        // another recipe than the one cast ahead for
        nn::cast_weights_ahead(amp.linears()).unwrap();
        let te = CurrentScaling {
            margin: 3,
            scale_rule: ScaleRule::Te,
            ..Default::default()
        };
        let other = out(&fc1, &fc2, &x, &te);
        assert_eq!(other, out(&fc1, &fc2, &x, &te), "{level:?}");
        // and the next cast ahead follows the recipe the forward last took
        nn::cast_weights_ahead(amp.linears()).unwrap();
        assert_eq!(other, out(&fc1, &fc2, &x, &te), "{level:?}");
    }
    for level in [Level::O0, Level::O3] {
        let varmap = VarMap::new();
        let (fc1, fc2) = model(&varmap);
        let (amp, mut opt) = initialize(&varmap, AdamWConfig::default(), config(level)).unwrap();
        let xs = t(randn(4 * D, 10), &[4, D]);
        amp.step(&mut opt, || forward(&fc1, &fc2, &xs)).unwrap();
        assert_eq!(
            nn::cast_weights_ahead(amp.linears()).unwrap(),
            0,
            "{level:?}"
        );
    }
}

/// Training with the casts made ahead and without (`set_weight_casts_ahead`)
/// gives the same weights after four steps at O1 and O2. (The switch is
/// process-wide; other tests' values do not depend on it.)
#[test]
fn training_with_casts_ahead_is_training_without() {
    let run = |level: Level, on: bool| {
        nn::set_weight_casts_ahead(on);
        let varmap = VarMap::new();
        let (fc1, fc2) = model(&varmap);
        let (amp, mut opt) = initialize(&varmap, AdamWConfig::default(), config(level)).unwrap();
        for step in 0..4u64 {
            let xs = t(randn(4 * D, 20 + step), &[4, D]);
            amp.step(&mut opt, || forward(&fc1, &fc2, &xs)).unwrap();
        }
        nn::set_weight_casts_ahead(true);
        masters(&opt)
    };
    for level in [Level::O1, Level::O2] {
        assert_eq!(run(level, true), run(level, false), "{level:?}");
    }
}
