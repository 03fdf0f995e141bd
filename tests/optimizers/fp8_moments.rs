//! Both Adam moments in FP8 (`StateFormat::E4M3Sqrt` for the second): the
//! stored second moment follows float64 AdamW's as it decays (stochastic
//! rounding), a root below the codes never becomes a division by zero, and
//! a small model trains as with F32 moments.

use crate::common;

use amp::optim::{
    AdamWConfig, Grad, Grads, LowBitAdamW, LowBitAdamWConfig, State, StateFormat, StepOutcome,
};
use amp::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use candle_core::{DType, Device, Tensor, Var};
use common::{mse, randn, randt, t};

fn fp8_moments(adam: AdamWConfig) -> LowBitAdamWConfig {
    LowBitAdamWConfig {
        adam,
        exp_avg: StateFormat::E4M3,
        exp_avg_sq: StateFormat::E4M3Sqrt,
        ..Default::default()
    }
}

fn f32_slot(x: &Tensor) -> WeightSlot {
    WeightSlot::new(Weight::F32(Var::from_tensor(x).unwrap()))
}

fn step(opt: &mut LowBitAdamW, g: Vec<f32>) {
    let n = g.len();
    let mut grads = Grads::new();
    grads.insert("w", Grad::F32(t(g, &[n])));
    assert!(matches!(
        opt.step(&grads).unwrap(),
        StepOutcome::Applied { .. }
    ));
}

#[test]
fn a_decaying_second_moment_follows_float64() {
    // Large gradients for 20 steps, then small ones: float64's v decays by
    // beta2 a step. Rounded to nearest, an E4M3 root could never fall (a
    // step moves it by 0.05%, under half the codes' spacing); rounded
    // stochastically it follows the reference on average.
    let n = 4096;
    let adam = AdamWConfig {
        lr: 1e-6,
        weight_decay: 0.0,
        ..Default::default()
    };
    let s = f32_slot(&Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap());
    let mut opt = LowBitAdamW::new(vec![("w".into(), s)], fp8_moments(adam)).unwrap();
    let noise = randn(n, 9);
    let mut v_ref = vec![0f64; n];
    let check = |opt: &LowBitAdamW, v_ref: &[f64], when: &str| {
        let p = &opt.params()[0];
        assert_eq!(p.exp_avg_sq.format(), StateFormat::E4M3Sqrt);
        let v = p.exp_avg_sq.to_vec().unwrap();
        let (ours, reference): (f64, f64) = v
            .iter()
            .zip(v_ref)
            .map(|(&a, &b)| ((a as f64).sqrt(), b.sqrt()))
            .fold((0.0, 0.0), |(x, y), (a, b)| (x + a, y + b));
        let ratio = ours / reference;
        assert!(
            (0.97..1.03).contains(&ratio),
            "{when}: mean root {:e} vs float64 {:e}",
            ours / n as f64,
            reference / n as f64
        );
    };
    for k in 0..2000 {
        let scale = if k < 20 { 1.0 } else { 0.01 };
        let g: Vec<f32> = noise.iter().map(|&x| scale * (1.0 + 0.5 * x)).collect();
        for (v, &g) in v_ref.iter_mut().zip(&g) {
            *v = adam.beta2 * *v + (1.0 - adam.beta2) * (g as f64) * (g as f64);
        }
        step(&mut opt, g);
        if k == 19 {
            check(&opt, &v_ref, "after the large gradients");
        }
    }
    // v fell to about a tenth of its peak
    check(&opt, &v_ref, "2000 steps later");
}

#[test]
fn a_root_below_the_codes_never_becomes_a_division_by_zero() {
    // Element 0 sees one huge gradient, then nothing: its root sets v's
    // scale for hundreds of steps while m's scale falls with m. Element 1's
    // steady tiny gradient has an m the codes hold and a root 10^7 below
    // element 0's, beyond E4M3's range: it stores as the smallest code, not
    // as zero, so its update stays under the learning rate instead of
    // m / eps.
    let lr = 1e-3;
    let adam = AdamWConfig {
        lr,
        weight_decay: 0.0,
        ..Default::default()
    };
    let s = f32_slot(&Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap());
    let mut opt = LowBitAdamW::new(vec![("w".into(), s.clone())], fp8_moments(adam)).unwrap();
    let mut last = 0f32;
    for k in 0..100 {
        step(&mut opt, vec![if k == 0 { 1e4 } else { 0.0 }, 1e-4]);
        let w = s
            .read()
            .unwrap()
            .master_f32()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let moved = (w[1] - last).abs();
        assert!(
            moved <= lr as f32,
            "step {k}: the tiny element moved by {moved:e}"
        );
        last = w[1];
    }
    let p = &opt.params()[0];
    let m = p.exp_avg.to_vec().unwrap();
    let v = p.exp_avg_sq.to_vec().unwrap();
    assert!(m[1] > 0.0, "m of the tiny element is held: {m:?}");
    assert!(v[1] > 0.0, "its root stores as the smallest code: {v:?}");
    assert!(last < 0.0, "and it still moves against its gradient");
}

#[test]
fn a_small_model_trains_with_fp8_moments_as_with_f32_ones() {
    // y = x · W*ᵀ + noise, fitted from the same start with F32 moments and
    // with both moments in FP8, on F32, FP16 and FP8 (O3) weights.
    let (n_in, n_out, rows) = (16, 8, 128);
    let x = t(randn(rows * n_in, 31), &[rows, n_in]);
    let w_true = randt(&[n_out, n_in], 32, 0.5);
    let noise = randt(&[rows, n_out], 33, 0.5);
    let y = (x.matmul(&w_true.t().unwrap()).unwrap() + noise).unwrap();
    let init = randt(&[n_out, n_in], 34, 0.1);
    let q = |x: &Tensor, qtype| {
        ScalingTensor::quantize(x, qtype, &CurrentScaling::default())
            .unwrap()
            .0
    };
    let adam = AdamWConfig {
        lr: 0.02,
        weight_decay: 0.0,
        ..Default::default()
    };
    let fit = |kind: &str, cfg: LowBitAdamWConfig| -> f32 {
        let s = WeightSlot::new(match kind {
            "F32" => Weight::F32(Var::from_tensor(&init).unwrap()),
            "F16" => Weight::F16(q(&init, QType::F16)),
            _ => Weight::Fp8 {
                weight: q(&init, QType::E4M3),
                master: q(&init, QType::F16),
            },
        });
        let mut opt = LowBitAdamW::new(vec![("w".into(), s.clone())], cfg).unwrap();
        for _ in 0..300 {
            let wv = Var::from_tensor(&s.read().unwrap().master_f32().unwrap()).unwrap();
            let loss = mse(&x.matmul(&wv.as_tensor().t().unwrap()).unwrap(), &y);
            let g = loss.backward().unwrap().remove(wv.as_tensor()).unwrap();
            let mut grads = Grads::new();
            grads.insert("w", Grad::F32(g));
            opt.step(&grads).unwrap();
        }
        let w = s.read().unwrap().master_f32().unwrap();
        mse(&x.matmul(&w.t().unwrap()).unwrap(), &y)
            .to_scalar::<f32>()
            .unwrap()
    };
    let reference = fit(
        "F32",
        LowBitAdamWConfig {
            adam,
            exp_avg: StateFormat::F32,
            exp_avg_sq: StateFormat::F32,
            ..Default::default()
        },
    );
    for kind in ["F32", "F16", "FP8"] {
        let l = fit(kind, fp8_moments(adam));
        assert!(
            (l - reference).abs() <= 0.02 * reference,
            "{kind} weights, FP8 moments: {l} vs F32 moments {reference}"
        );
    }
    // the states are what the format says: one byte an element, the root
    let s = f32_slot(&init);
    let mut opt = LowBitAdamW::new(vec![("w".into(), s)], fp8_moments(adam)).unwrap();
    let mut grads = Grads::new();
    grads.insert("w", Grad::F32(randt(&[n_out, n_in], 35, 1.0)));
    opt.step(&grads).unwrap();
    let State::Sqrt(roots) = &opt.params()[0].exp_avg_sq else {
        panic!("a root state")
    };
    assert_eq!(roots.qtype(), QType::E4M3);
    assert_eq!(opt.params()[0].exp_avg_sq.nbytes(), n_out * n_in + 12);
}

#[test]
fn moment_telemetry_measures_each_moment_against_its_f32_value() {
    let n = 3000;
    let adam = AdamWConfig {
        lr: 1e-3,
        ..Default::default()
    };
    let s = f32_slot(&randt(&[n], 41, 0.1));
    let mut opt = LowBitAdamW::new(vec![("w".into(), s)], fp8_moments(adam)).unwrap();
    let g = |seed| {
        randn(n, seed)
            .iter()
            .map(|x| x * 0.01)
            .collect::<Vec<f32>>()
    };
    // off: nothing recorded
    step(&mut opt, g(42));
    assert!(opt.take_moment_telemetry().is_empty());
    amp::nn::set_telemetry(true);
    step(&mut opt, g(43));
    step(&mut opt, g(44));
    amp::nn::set_telemetry(false);
    let records = opt.take_moment_telemetry();
    assert_eq!(records.len(), 2);
    for (r, want_step) in records.iter().zip([2, 3]) {
        assert_eq!((r.name.as_str(), r.step), ("w", want_step));
        for (what, c) in [("m", r.exp_avg), ("roots", r.exp_avg_sq)] {
            assert_eq!(c.total, n as u64, "{what}");
            assert_eq!(c.saturated, 0, "{what}");
            assert!(c.amax > 0.0 && c.scale > 0.0, "{what}: {c:?}");
            assert!(c.amax * c.scale <= 448.0, "{what}: {c:?}");
        }
        // round to nearest: at most half of E4M3's spacing, 2^-4
        assert!(
            r.exp_avg.rel_err > 0.0 && r.exp_avg.rel_err < 1.0 / 16.0,
            "{r:?}"
        );
        // stochastic rounding: within one spacing, 2^-3
        assert!(
            r.exp_avg_sq.rel_err > 0.0 && r.exp_avg_sq.rel_err < 1.0 / 8.0,
            "{r:?}"
        );
    }
    assert!(opt.take_moment_telemetry().is_empty(), "taking empties");
}
