//! `AmpOptimizer::backward_step_owned`: the loss (and the forward's saved
//! tensors) dropped before the optimizer step, the same step as
//! `backward_step`.

use crate::common;

use amp::levels::{initialize, AmpConfig, Compute, Level};
use amp::nn;
use amp::optim::{AdamWConfig, StepOutcome};
use candle_core::{DType, Device, Module};
use candle_nn::{VarBuilder, VarMap};
use common::{masters, randn, seed_varmap, t};

/// O0 native, the others with FP8 GEMMs (current scaling).
fn level_config(level: Level) -> AmpConfig {
    let mut cfg = AmpConfig {
        level,
        ..Default::default()
    };
    if level != Level::O0 {
        cfg.compute = Compute::Fp8Current {
            recipe: Default::default(),
        };
    }
    cfg
}

/// `backward_step_owned` (the loss dropped before the optimizer step) and
/// `AmpContext::step` (the forward in the FP8 scope too) step exactly as
/// `backward_step`: the same outcome and the same weights after three
/// steps, at every level.
#[test]
fn backward_step_owned_steps_as_backward_step() {
    let d = 16;
    for level in Level::ALL {
        // 0: backward_step, 1: backward_step_owned, 2: AmpContext::step
        let run = |how: u8| -> Vec<(String, Vec<f32>)> {
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
            let fc1 = nn::linear(d, 2 * d, vb.pp("fc1")).unwrap();
            let fc2 = nn::linear(2 * d, d, vb.pp("fc2")).unwrap();
            // the same initial values in both runs
            seed_varmap(&varmap, 50, 0.3);
            let (amp, mut opt) =
                initialize(&varmap, AdamWConfig::default(), level_config(level)).unwrap();
            for step in 0..3u64 {
                let x = t(randn(4 * d, 10 + step), &[4, d]);
                let forward = || -> amp::Result<candle_core::Tensor> {
                    Ok(fc2.forward(&fc1.forward(&x)?.relu()?)?.sqr()?.mean_all()?)
                };
                let outcome = if how == 2 {
                    let s = amp.step(&mut opt, forward).unwrap();
                    assert!(s.loss.to_scalar::<f32>().unwrap() > 0.0);
                    s.outcome
                } else {
                    let loss = {
                        let _fp8 = amp.autocast();
                        forward().unwrap()
                    };
                    if how == 1 {
                        opt.backward_step_owned(loss).unwrap()
                    } else {
                        opt.backward_step(&loss).unwrap()
                    }
                };
                assert!(matches!(outcome, StepOutcome::Applied { .. }), "{level:?}");
            }
            masters(&opt)
        };
        let base = run(0);
        assert_eq!(run(1), base, "{level:?}");
        assert_eq!(run(2), base, "{level:?} AmpContext::step");
    }
}

/// O1-O3 on a model with no `amp::nn` Linear (built with candle's own
/// layers) is an error that says how to fix it, not a silent F32 run; O0
/// takes it.
#[test]
fn a_level_on_a_model_without_amp_linears_is_an_error() {
    for level in Level::ALL {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let _plain = candle_nn::linear(8, 8, vb.pp("fc")).unwrap();
        let out = initialize(&varmap, AdamWConfig::default(), level_config(level));
        match (level, out) {
            (Level::O0, r) => assert!(r.is_ok(), "O0 refused a plain model"),
            (_, Ok(_)) => panic!("{level} took a model without amp::nn Linear layers"),
            (_, Err(e)) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("amp::nn::linear") && msg.contains("O0"),
                    "{msg}"
                );
                // nothing was claimed: the fixed call goes through
                let fixed = initialize(&varmap, AdamWConfig::default(), level_config(Level::O0));
                assert!(fixed.is_ok(), "{level}: the varmap stayed claimed");
            }
        }
    }
}
