//! LayerNorm, LayerNormLinear and LayerNormMLP: the same forward as the
//! unfused composition, gradients that reach every parameter.

use crate::common;

use amp::nn::{self, fp8_autocast, ComputeMode};
use amp::CurrentScaling;
use candle_core::{DType, Device, Module, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{randn, t};

#[test]
fn layer_norm_matches_the_formula_and_candles_fused_op() {
    let x = t(randn(6 * 10, 1), &[2, 3, 10]);
    let w = t(randn(10, 2), &[10]);
    let b = t(randn(10, 3), &[10]);
    let ln = nn::LayerNorm::new(w.clone(), b.clone(), 1e-5).unwrap();
    let fused = ln.forward(&x).unwrap(); // nothing tracked: candle's fused op
    let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
    let (wv, bv): (Vec<f32>, Vec<f32>) = (w.to_vec1().unwrap(), b.to_vec1().unwrap());
    let got: Vec<f32> = fused.flatten_all().unwrap().to_vec1().unwrap();
    for (row, out) in xs.chunks(10).zip(got.chunks(10)) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / 10.0;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 10.0;
        for i in 0..10 {
            let want = (row[i] as f64 - mean) / (var + 1e-5).sqrt() * wv[i] as f64 + bv[i] as f64;
            assert!((out[i] as f64 - want).abs() < 1e-5, "{} vs {want}", out[i]);
        }
    }
    // The differentiable path gives the same values.
    let xv = Var::from_tensor(&x).unwrap();
    let tracked: Vec<f32> = ln
        .forward(xv.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for (a, b) in tracked.iter().zip(&got) {
        assert!((a - b).abs() < 1e-5);
    }
}

#[test]
fn gradients_reach_every_parameter_of_the_fused_modules() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let lnl = nn::layer_norm_linear(16, 8, true, 1e-5, vb.pp("qkv")).unwrap();
    let mlp = nn::layer_norm_mlp(8, 32, 1e-5, vb.pp("mlp")).unwrap();
    let x = t(randn(4 * 16, 5), &[4, 16]);
    for mode in [
        ComputeMode::Native,
        ComputeMode::Fp8Current(CurrentScaling::default()),
    ] {
        let _s = fp8_autocast(true, mode.clone());
        let loss = mlp
            .forward(&lnl.forward(&x).unwrap())
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{mode:?}: no gradient for {name}"));
            let n = g
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(n > 0.0 && n.is_finite(), "{mode:?}: {name} gradient {n}");
        }
    }
}

#[test]
fn fused_modules_compute_the_unfused_composition() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mlp = nn::layer_norm_mlp(8, 24, 1e-5, vb.pp("mlp")).unwrap();
    let x = t(randn(3 * 8, 6), &[3, 8]);
    for mode in [
        ComputeMode::Native,
        ComputeMode::Fp8Current(CurrentScaling::default()),
    ] {
        let _s = fp8_autocast(true, mode);
        let fused: Vec<f32> = mlp
            .forward(&x)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let h = nn::gelu(&mlp.fc1.forward(&mlp.norm.forward(&x).unwrap()).unwrap()).unwrap();
        let unfused: Vec<f32> = mlp
            .fc2
            .forward(&h)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(fused, unfused);
    }
    let e = mlp.forward(&t(vec![0.0; 5], &[1, 5])).unwrap_err();
    assert!(e.to_string().contains("incompatible shapes"), "{e}");
}
