//! AdamW against a float64 reference, and LowBitAdamW with F32 states equal
//! to AdamW bit for bit.

use crate::common;

use amp::optim::{AdamW, AdamWConfig, Grad, Grads, LowBitAdamW, LowBitAdamWConfig, StateFormat};
use amp::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::Optimizer;
use common::{randn, t};

/// PyTorch's single-tensor AdamW in f64.
struct RefAdamW {
    cfg: AdamWConfig,
    p: Vec<f64>,
    m: Vec<f64>,
    v: Vec<f64>,
    t: i32,
}

impl RefAdamW {
    fn step(&mut self, g: &[f64]) {
        let c = self.cfg;
        self.t += 1;
        let bc1 = 1.0 - c.beta1.powi(self.t);
        let bc2 = 1.0 - c.beta2.powi(self.t);
        for (((p, m), v), &g) in self.p.iter_mut().zip(&mut self.m).zip(&mut self.v).zip(g) {
            *p *= 1.0 - c.lr * c.weight_decay;
            *m += (1.0 - c.beta1) * (g - *m);
            *v = *v * c.beta2 + (1.0 - c.beta2) * g * g;
            let denom = v.sqrt() / bc2.sqrt() + c.eps;
            *p -= c.lr / bc1 * *m / denom;
        }
    }
}

/// A loss whose gradient with respect to `w` is exactly `r`.
fn linear_loss(w: &Var, r: &[f32]) -> Tensor {
    let r = Tensor::from_slice(r, w.shape(), &Device::Cpu).unwrap();
    (w.as_tensor() * r).unwrap().sum_all().unwrap()
}

#[test]
fn adamw_matches_float64_pytorch_rule_for_50_steps() {
    let n = 1000;
    let cfg = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.05,
        ..Default::default()
    };
    let p0 = randn(n, 1);
    let w = Var::from_slice(&p0, n, &Device::Cpu).unwrap();
    let mut opt = AdamW::new(vec![w.clone()], cfg).unwrap();
    let mut r = RefAdamW {
        cfg,
        p: p0.iter().map(|&x| x as f64).collect(),
        m: vec![0.0; n],
        v: vec![0.0; n],
        t: 0,
    };
    let mut worst = 0f64;
    for step in 0..50 {
        let g: Vec<f32> = randn(n, 100 + step)
            .iter()
            .map(|x| x * 10f32.powi((step % 5) as i32 - 2))
            .collect();
        opt.backward_step(&linear_loss(&w, &g)).unwrap();
        r.step(&g.iter().map(|&x| x as f64).collect::<Vec<_>>());
        let got = w.as_tensor().to_vec1::<f32>().unwrap();
        // Relative to each value, floored at the tensor's RMS: once a value
        // shrinks far below the others, f32's absolute rounding from the
        // steps when it was large dominates, in any f32 implementation.
        let rms = (r.p.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt();
        for (a, b) in got.iter().zip(&r.p) {
            worst = worst.max((*a as f64 - b).abs() / b.abs().max(rms));
        }
    }
    assert!(worst < 1e-6, "max relative difference {worst:e}");
    assert_eq!(opt.step_count(), 50);
}

#[test]
fn lowbit_adamw_with_f32_states_is_adamw_bit_for_bit() {
    let n = 257;
    let cfg = AdamWConfig {
        lr: 3e-3,
        ..Default::default()
    };
    let p0 = randn(n, 3);
    let a = Var::from_slice(&p0, n, &Device::Cpu).unwrap();
    let mut ref_opt = AdamW::new(vec![a.clone()], cfg).unwrap();
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &Device::Cpu);
    let b = vb.get(n, "w").unwrap();
    b.flatten_all().unwrap();
    varmap.data().lock().unwrap()["w"]
        .set(&Tensor::from_slice(&p0, n, &Device::Cpu).unwrap())
        .unwrap();
    let lcfg = LowBitAdamWConfig {
        adam: cfg,
        exp_avg: StateFormat::F32,
        exp_avg_sq: StateFormat::F32,
        ..Default::default()
    };
    let mut opt = LowBitAdamW::from_varmap(&varmap, lcfg).unwrap();
    let bvar = varmap.data().lock().unwrap()["w"].clone();
    for step in 0..20 {
        let g = randn(n, 50 + step);
        ref_opt.backward_step(&linear_loss(&a, &g)).unwrap();
        opt.backward_step(&linear_loss(&bvar, &g)).unwrap();
    }
    let x: Vec<u32> = a
        .as_tensor()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let y: Vec<u32> = bvar
        .as_tensor()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(x, y);
}

#[test]
fn bad_hyperparameters_are_named() {
    let w = Var::new(&[1.0f32], &Device::Cpu).unwrap();
    for (cfg, field) in [
        (
            AdamWConfig {
                lr: -1.0,
                ..Default::default()
            },
            "lr",
        ),
        (
            AdamWConfig {
                beta1: 1.0,
                ..Default::default()
            },
            "beta1",
        ),
        (
            AdamWConfig {
                beta2: -0.1,
                ..Default::default()
            },
            "beta2",
        ),
        (
            AdamWConfig {
                eps: f64::NAN,
                ..Default::default()
            },
            "eps",
        ),
        (
            AdamWConfig {
                weight_decay: -1.0,
                ..Default::default()
            },
            "weight_decay",
        ),
    ] {
        let e = AdamW::new(vec![w.clone()], cfg).unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    }
}

#[test]
fn a_parameter_without_a_gradient_keeps_its_own_step_count() {
    // PyTorch keeps `step` per parameter: the bias correction of a parameter
    // that missed a step uses its own count.
    let zero = || Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
    let a = WeightSlot::new(Weight::F32(Var::from_tensor(&zero()).unwrap()));
    let (b16, _) =
        ScalingTensor::quantize(&zero(), QType::F16, &CurrentScaling::default()).unwrap();
    let b = WeightSlot::new(Weight::F16(b16));
    let cfg = LowBitAdamWConfig {
        exp_avg: StateFormat::F32,
        exp_avg_sq: StateFormat::F32,
        ..Default::default()
    };
    let mut opt = LowBitAdamW::new(vec![("a".into(), a), ("b".into(), b.clone())], cfg).unwrap();
    let g = || Grad::F32(t(vec![1.0, -2.0, 0.5], &[3]));
    for with_b in [true, false, true] {
        let mut grads = Grads::new();
        grads.insert("a", g());
        if with_b {
            grads.insert("b", g());
        }
        opt.step(&grads).unwrap();
    }
    let steps: Vec<u64> = opt.params().iter().map(|p| p.step).collect();
    assert_eq!(steps, [3, 2]);
    assert_eq!(opt.step_count(), 3);
    // b's second update used bias correction of step 2: with a constant
    // gradient every Adam step moves by lr * sign(g) (m̂ / sqrt(v̂) = ±1).
    let bv: Vec<f32> = b.read().unwrap().master_f32().unwrap().to_vec1().unwrap();
    for (x, s) in bv.iter().zip([-1.0f32, 1.0, -1.0]) {
        assert!((x - 2.0 * 1e-3 * s).abs() < 2e-6, "{bv:?}");
    }
}
