//! LowBitAdamW: against float64 AdamW on a quadratic, skipped steps change no
//! byte, every weight storage trains a small model like F32, clipping over
//! mixed gradient storages, and named errors.

use crate::common;

use amp::optim::{
    AdamWConfig, Error, Grad, Grads, LossScaling, LowBitAdamW, LowBitAdamWConfig, LrSchedule,
    State, StateFormat, StepOutcome, WarmupCosine,
};
use amp::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use candle_core::{DType, Device, Tensor, Var};
use common::{mse, randn, randt, t};

fn q(x: &Tensor, qtype: QType) -> ScalingTensor {
    ScalingTensor::quantize(x, qtype, &CurrentScaling::default())
        .unwrap()
        .0
}

fn slot(kind: &str, init: &Tensor) -> WeightSlot {
    WeightSlot::new(match kind {
        "F32" => Weight::F32(Var::from_tensor(init).unwrap()),
        "F16" => Weight::F16(q(init, QType::F16)),
        _ => Weight::Fp8 {
            weight: q(init, QType::E4M3),
            master: q(init, QType::F16),
        },
    })
}

/// The value the forward pass reads: the FP8 copy at O3, else the master.
fn forward_value(s: &WeightSlot) -> Tensor {
    match &*s.read().unwrap() {
        Weight::Fp8 { weight, .. } => weight.dequantize(DType::F32).unwrap(),
        w => w.master_f32().unwrap(),
    }
}

#[test]
fn lowbit_tracks_float64_adamw_on_a_quadratic_and_reaches_the_same_minimum() {
    let n = 64;
    let a: Vec<f64> = (0..n).map(|i| 0.5 + 1.5 * i as f64 / n as f64).collect();
    let c: Vec<f64> = randn(n, 5).iter().map(|&x| x as f64).collect();
    let steps = 400;
    let sched = WarmupCosine {
        peak: 0.05,
        min: 0.0,
        warmup: 20,
        total: steps,
    };
    let adam = AdamWConfig {
        lr: 0.05,
        weight_decay: 0.0,
        ..Default::default()
    };
    let s = slot("F32", &Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap());
    let mut opt = LowBitAdamW::new(
        vec![("w".into(), s.clone())],
        LowBitAdamWConfig {
            adam,
            ..Default::default()
        },
    )
    .unwrap()
    .with_schedule(sched);
    // float64 reference
    let (mut w, mut m, mut v) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
    let mut path = vec![0f64; n]; // path length of the reference, per element
                                  // Bound from the formats: each step re-encodes m in E4M3 (half-ulp
                                  // relative error 2^-4) and v in FP16 (2^-11, so 2^-12 on sqrt(v)). An
                                  // error in m decays with beta1, so its total effect on the trajectory is
                                  // at most 2^-4 / (1 - beta1) of the distance travelled; v's adds 2^-12 of
                                  // it. The floor covers elements flushed to E4M3 subnormals: per step at
                                  // most lr * 2^-10 / 224 of the tensor's max |m| / sqrt(v), taken as 1.
    let eps_m = 2f64.powi(-4) / (1.0 - adam.beta1);
    let eps_v = 2f64.powi(-12);
    let mut floor = 0f64;
    let mut worst_ratio = 0f64;
    for step in 1..=steps {
        let wl: Vec<f32> = s.read().unwrap().master_f32().unwrap().to_vec1().unwrap();
        let g: Vec<f32> = (0..n)
            .map(|i| (a[i] * (wl[i] as f64 - c[i])) as f32)
            .collect();
        let mut grads = Grads::new();
        grads.insert("w", Grad::F32(t(g, &[n])));
        assert!(matches!(
            opt.step(&grads).unwrap(),
            StepOutcome::Applied { .. }
        ));
        let lr = sched.lr(step);
        let (bc1, bc2) = (
            1.0 - adam.beta1.powi(step as i32),
            1.0 - adam.beta2.powi(step as i32),
        );
        floor += lr * 2f64.powi(-10) / 224.0;
        for i in 0..n {
            let g = a[i] * (w[i] - c[i]);
            m[i] = adam.beta1 * m[i] + (1.0 - adam.beta1) * g;
            v[i] = adam.beta2 * v[i] + (1.0 - adam.beta2) * g * g;
            let d = lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + adam.eps);
            w[i] -= d;
            path[i] += d.abs();
        }
        let now: Vec<f32> = s.read().unwrap().master_f32().unwrap().to_vec1().unwrap();
        for i in 0..n {
            let bound = (eps_m + eps_v) * path[i] + floor;
            let dev = (now[i] as f64 - w[i]).abs();
            assert!(
                dev <= bound,
                "step {step}, w[{i}]: deviation {dev:e} > bound {bound:e}"
            );
            worst_ratio = worst_ratio.max(dev / bound);
        }
    }
    let fin: Vec<f32> = s.read().unwrap().master_f32().unwrap().to_vec1().unwrap();
    let norm = |x: &dyn Fn(usize) -> f64| (0..n).map(|i| x(i) * x(i)).sum::<f64>().sqrt();
    let c_norm = norm(&|i| c[i]);
    let lb = norm(&|i| fin[i] as f64 - c[i]) / c_norm;
    let rf = norm(&|i| w[i] - c[i]) / c_norm;
    assert!(
        rf < 0.01 && lb < 0.01,
        "distance to the minimum: low-bit {lb:e}, reference {rf:e}"
    );
    assert!(
        worst_ratio > 0.0,
        "the low-bit run must differ from the reference somewhere"
    );
}

/// Every byte of the weights and optimizer state.
fn snapshot(opt: &LowBitAdamW) -> Vec<u8> {
    fn bytes(t: &Tensor, out: &mut Vec<u8>) {
        let t = t.flatten_all().unwrap();
        match t.dtype() {
            DType::U8 => out.extend(t.to_vec1::<u8>().unwrap()),
            DType::F16 => out.extend(
                t.to_vec1::<half::f16>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_bits().to_le_bytes()),
            ),
            _ => out.extend(
                t.to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_bits().to_le_bytes()),
            ),
        }
    }
    fn scaled(s: &ScalingTensor, out: &mut Vec<u8>) {
        bytes(s.data(), out);
        bytes(s.meta().scale(), out);
        bytes(s.meta().scale_inv(), out);
        bytes(s.meta().amax_history(), out);
    }
    let mut out = opt.step_count().to_le_bytes().to_vec();
    for p in opt.params() {
        match &*p.slot.read().unwrap() {
            Weight::F32(v) => bytes(v.as_tensor(), &mut out),
            Weight::F16(s) | Weight::Fp8Gathered(s) => scaled(s, &mut out),
            Weight::Fp8 { weight, master } => {
                scaled(weight, &mut out);
                scaled(master, &mut out);
            }
        }
        for st in [&p.exp_avg, &p.exp_avg_sq] {
            match st {
                State::F32(t) => bytes(t, &mut out),
                State::Scaled(s) | State::Sqrt(s) => scaled(s, &mut out),
            }
        }
    }
    out
}

#[test]
fn a_step_with_inf_or_nan_changes_no_byte_and_backs_the_scaler_off() {
    let init = t(randn(12, 9), &[3, 4]);
    let params = ["F32", "F16", "FP8"]
        .map(|k| (k.to_string(), slot(k, &init)))
        .to_vec();
    let cfg = LowBitAdamWConfig {
        loss_scaling: LossScaling::dynamic(),
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let mut opt = LowBitAdamW::new(params, cfg).unwrap();
    let good = |scale: f64| {
        let mut g = Grads::new();
        let x = (t(randn(12, 10), &[3, 4]) * scale).unwrap();
        g.insert("F32", Grad::F32(x.clone()));
        g.insert("F16", Grad::Scaled(q(&x, QType::E4M3)));
        g.insert("FP8", Grad::Scaled(q(&x, QType::E5M2)));
        g
    };
    assert!(matches!(
        opt.step(&good(65536.0)).unwrap(),
        StepOutcome::Applied { .. }
    ));
    for bad in [f32::NAN, f32::INFINITY, -f32::INFINITY] {
        for target in ["F32", "F16", "FP8"] {
            let before = snapshot(&opt);
            let scale = opt.scaler().scale;
            let mut g = good(scale);
            let mut v = randn(12, 11);
            v[5] = bad;
            let x = t(v, &[3, 4]);
            g.insert(
                target,
                if target == "F32" {
                    Grad::F32(x)
                } else {
                    Grad::Scaled(q(&x, QType::E4M3))
                },
            );
            assert_eq!(opt.step(&g).unwrap(), StepOutcome::Skipped);
            assert_eq!(snapshot(&opt), before, "{bad} in {target}");
            assert_eq!(opt.scaler().scale, scale * 0.5, "the scaler backs off");
        }
    }
    assert_eq!(opt.step_count(), 1);
}

#[test]
fn a_deferred_outcome_is_read_in_the_step_on_the_cpu() {
    // `defer_outcome` leaves the outcome on a GPU only: the CPU path reads
    // it in the step, so nothing is ever pending there and every outcome
    // is final (the GPU tests compare deferred steps with these)
    let init = t(randn(12, 41), &[3, 4]);
    let cfg = LowBitAdamWConfig {
        defer_outcome: true,
        ..Default::default()
    };
    let mut opt = LowBitAdamW::new(vec![("w".to_string(), slot("F16", &init))], cfg).unwrap();
    let grads = |v: f32| {
        let mut g = Grads::new();
        g.insert(
            "w",
            Grad::F32((t(randn(12, 42), &[3, 4]) * f64::from(v)).unwrap()),
        );
        g
    };
    assert!(matches!(
        opt.step(&grads(1.0)).unwrap(),
        StepOutcome::Applied { .. }
    ));
    assert!(!opt.has_pending());
    assert_eq!(opt.resolve().unwrap(), None);
    assert_eq!(opt.step(&grads(f32::NAN)).unwrap(), StepOutcome::Skipped);
    assert_eq!((opt.step_count(), opt.skipped_count()), (1, 1));
}

#[test]
fn the_schedule_counts_batches_and_adam_counts_applied_steps() {
    let init = t(randn(12, 31), &[3, 4]);
    let sched = WarmupCosine {
        peak: 1e-2,
        min: 1e-3,
        warmup: 10,
        total: 100,
    };
    let cfg = LowBitAdamWConfig {
        loss_scaling: LossScaling::dynamic(),
        ..Default::default()
    };
    let mut opt = LowBitAdamW::new(vec![("w".to_string(), slot("F32", &init))], cfg)
        .unwrap()
        .with_schedule(sched);
    let grads = |v: f32| {
        let mut g = Grads::new();
        let x = (t(randn(12, 32), &[3, 4]) * f64::from(v)).unwrap();
        g.insert("w", Grad::F32(x));
        g
    };
    assert_eq!(opt.learning_rate(), sched.lr(1));
    assert!(matches!(
        opt.step(&grads(1.0)).unwrap(),
        StepOutcome::Applied { .. }
    ));
    assert_eq!(opt.step(&grads(f32::NAN)).unwrap(), StepOutcome::Skipped);
    // two batches consumed, one step applied: the schedule is at the third
    // batch, Adam's t at 1
    assert_eq!((opt.step_count(), opt.skipped_count()), (1, 1));
    assert_eq!(opt.learning_rate(), sched.lr(3));
    assert_eq!(opt.params()[0].step, 1);
}

#[test]
fn every_weight_storage_trains_like_f32() {
    // y = x · W*ᵀ + noise, fit W from zero-mean init.
    let (n_in, n_out, rows) = (16, 8, 128);
    let x = t(randn(rows * n_in, 21), &[rows, n_in]);
    let w_true = randt(&[n_out, n_in], 22, 0.5);
    let noise = randt(&[rows, n_out], 23, 0.5);
    let y = (x.matmul(&w_true.t().unwrap()).unwrap() + noise).unwrap();
    let init = randt(&[n_out, n_in], 24, 0.1);
    let steps = 300;
    let mut finals = vec![];
    for kind in ["F32", "F16", "FP8"] {
        let s = slot(kind, &init);
        let cfg = LowBitAdamWConfig {
            adam: AdamWConfig {
                lr: 0.05,
                weight_decay: 0.0,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut opt = LowBitAdamW::new(vec![("w".into(), s.clone())], cfg)
            .unwrap()
            .with_schedule(WarmupCosine {
                peak: 0.05,
                min: 0.0,
                warmup: 10,
                total: steps,
            });
        for _ in 0..steps {
            // The forward reads the stored weight; a low-bit weight's gradient
            // reaches the optimizer as FP8, as the FP8 Linear's sink hands it.
            let wv = Var::from_tensor(&forward_value(&s)).unwrap();
            let loss = mse(&x.matmul(&wv.as_tensor().t().unwrap()).unwrap(), &y);
            let g = loss.backward().unwrap().remove(wv.as_tensor()).unwrap();
            let mut grads = Grads::new();
            grads.insert(
                "w",
                if kind == "F32" {
                    Grad::F32(g)
                } else {
                    Grad::Scaled(q(&g, QType::E4M3))
                },
            );
            opt.step(&grads).unwrap();
        }
        // The trained model is the master weight (at O3 the FP8 copy is a
        // working copy of it); its loss on the training data:
        let w = s.read().unwrap().master_f32().unwrap();
        let loss = mse(&x.matmul(&w.t().unwrap()).unwrap(), &y);
        finals.push((kind, loss.to_scalar::<f32>().unwrap()));
    }
    let f32_loss = finals[0].1;
    // F32 fits down to the noise: variance (0.5 * 0.98)^2 (randn's std is
    // 0.98), less what 128 weights absorb of 1024 targets.
    let noise = (0.5f32 * 0.98).powi(2);
    assert!(
        f32_loss < noise && f32_loss > 0.8 * noise,
        "F32 fits: {f32_loss} vs noise {noise}"
    );
    // What FP8 costs: the O3 forward reads E4M3 weights (RMS error about
    // 2^-4/sqrt(3) of |w| ~ 0.5, so 0.018), and the master settles where the
    // quantized forward fits best; its excess loss is a fraction of
    // n_in * E[x^2] * 0.018^2 = 0.005, about 2.5e-3 measured, under 2% here.
    for (kind, l) in &finals[1..] {
        assert!(
            (l - f32_loss).abs() <= 0.02 * f32_loss,
            "{kind}: {l} vs F32 {f32_loss}"
        );
    }
}

#[test]
fn clipping_uses_the_global_norm_over_mixed_storages() {
    let a = slot("F32", &Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap());
    let b = slot("F16", &Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap());
    let cfg = LowBitAdamWConfig {
        exp_avg: StateFormat::F32,
        exp_avg_sq: StateFormat::F32,
        max_grad_norm: Some(1.3),
        ..Default::default()
    };
    let mut opt = LowBitAdamW::new(vec![("a".into(), a), ("b".into(), b)], cfg).unwrap();
    let mut g = Grads::new();
    g.insert("a", Grad::F32(t(vec![3.0, 4.0], &[2])));
    g.insert("b", Grad::Scaled(q(&t(vec![0.0, 12.0], &[2]), QType::E4M3)));
    let StepOutcome::Applied { grad_norm } = opt.step(&g).unwrap() else {
        panic!("skipped")
    };
    assert_eq!(grad_norm, 13.0);
    // m after one step = (1 - beta1) * g * clip, clip = 1.3 / (13 + 1e-6)
    let clip = 1.3 / (13.0 + 1e-6);
    let m: Vec<f32> = opt
        .params()
        .iter()
        .flat_map(|p| p.exp_avg.to_vec().unwrap())
        .collect();
    let want = [3.0, 4.0, 0.0, 12.0].map(|g| (0.1 * g * clip) as f32);
    for (x, y) in m.iter().zip(want) {
        assert!((x - y).abs() <= 1e-6 * y.abs(), "{m:?} vs {want:?}");
    }
}

#[test]
fn the_norm_of_a_tensor_of_many_summation_groups_matches_float64() {
    // 3 groups of 256 blocks of 2048 and a partial block: every level of
    // the sum's order (lanes, blocks, groups, the total) runs.
    let n = 2 * 256 * 2048 + 7 * 2048 + 333;
    let g: Vec<f32> = (0..n)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
        .collect();
    let want = g
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    let w = slot("F32", &Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap());
    let cfg = LowBitAdamWConfig {
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let mut opt = LowBitAdamW::new(vec![("w".into(), w)], cfg).unwrap();
    let mut grads = Grads::new();
    grads.insert("w", Grad::F32(t(g, &[n])));
    let StepOutcome::Applied { grad_norm } = opt.step(&grads).unwrap() else {
        panic!("skipped")
    };
    assert!(
        (grad_norm - want).abs() <= 1e-6 * want,
        "{grad_norm} vs {want}"
    );
}

#[test]
fn bad_gradients_and_params_are_named_errors() {
    let s = slot(
        "F16",
        &Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
    );
    let mut opt =
        LowBitAdamW::new(vec![("w".into(), s.clone())], LowBitAdamWConfig::default()).unwrap();
    let before = snapshot(&opt);
    let mut g = Grads::new();
    g.insert(
        "w",
        Grad::F32(Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap()),
    );
    assert!(matches!(opt.step(&g).unwrap_err(), Error::GradShape { .. }));
    let mut g = Grads::new();
    g.insert(
        "v",
        Grad::F32(Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap()),
    );
    assert!(matches!(opt.step(&g).unwrap_err(), Error::UnknownParam(n) if n == "v"));
    assert_eq!(snapshot(&opt), before);
    // a gathered FP8 copy with a gradient: refused before anything changes
    let x = Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap();
    let z = WeightSlot::new(Weight::Fp8Gathered(q(&x, QType::E4M3)));
    let params = vec![("w".into(), s.clone()), ("z".into(), z)];
    let mut two = LowBitAdamW::new(params, LowBitAdamWConfig::default()).unwrap();
    let before = snapshot(&two);
    let mut g = Grads::new();
    g.insert("w", Grad::F32(x.clone()));
    g.insert("z", Grad::F32(x));
    assert!(matches!(two.step(&g).unwrap_err(), Error::Config { .. }));
    assert_eq!(snapshot(&two), before);
    assert_eq!(two.step_count(), 0);
    let e = LowBitAdamW::new(
        vec![("w".into(), s.clone()), ("w".into(), s)],
        LowBitAdamWConfig::default(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::DuplicateName(_)));
}
