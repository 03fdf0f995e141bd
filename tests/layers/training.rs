//! amp::nn::Linear in use: the weight gradient handed to a sink as FP8, and
//! one MLP trained in every compute mode.

use crate::common;

use amp::nn::{self, fp8_autocast, ComputeMode, GradSink};
use amp::{CurrentScaling, DelayedScaling, Format};
use candle_core::{DType, Device, Module, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{f64s, mse, randn, randt, t};

/// Half-ulp relative error of E4M3 in its normal range.
const E4M3_EPS: f64 = 1.0 / 16.0;

#[test]
fn the_weight_gradient_goes_to_the_sink_as_fp8() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = nn::linear(16, 8, vb.pp("l")).unwrap();
    let sink = GradSink::new();
    layer.set_grad_sink(Some(sink.clone())).unwrap();
    let x = Var::from_tensor(&t(randn(4 * 16, 1), &[4, 16])).unwrap();
    let grads = {
        let _s = fp8_autocast(true, ComputeMode::Fp8Current(CurrentScaling::default()));
        layer
            .forward(x.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
    };
    let w = varmap.data().lock().unwrap()["l.weight"].clone();
    assert!(
        grads.get(w.as_tensor()).is_none(),
        "no F32 weight gradient in the GradStore"
    );
    assert!(grads.get(x.as_tensor()).is_some());
    assert!(
        grads.get(layer.bias().unwrap()).is_some(),
        "the bias keeps its F32 gradient"
    );
    let got = sink.take().unwrap();
    let g = &got["l.weight"];
    assert_eq!(g.qtype(), amp::QType::E4M3);
    assert_eq!(g.shape().dims(), [8, 16]);
    // dL/dW = sum over rows of x, for every output. Bound: each x within
    // 2^-4 of itself (E4M3), so the sum within 2^-4 sum |x|; dW's own E4M3
    // cast adds 2^-4 of the result.
    let want = f64s(&x.as_tensor().sum(0).unwrap());
    let abs = f64s(&x.as_tensor().abs().unwrap().sum(0).unwrap());
    let gv = f64s(&g.dequantize(DType::F32).unwrap());
    for (i, v) in gv.iter().enumerate() {
        let (w, a) = (want[i % 16], abs[i % 16]);
        assert!(
            (v - w).abs() <= E4M3_EPS * a + E4M3_EPS * v.abs() + 1e-6,
            "{v} vs {w}"
        );
    }
}

#[test]
fn the_same_mlp_trains_in_every_mode_to_within_8_percent_of_native() {
    // over seeds: one seed's excess moves by a few percent on its own (at
    // this noise floor every FP8 mode lands 4-6% above native on average:
    // current scaling 4.7% with E4M3 gradients, 4.6% with E5M2; delayed
    // 6.2% and 4.1%; a broken mode lands far above)
    let seeds = [0u64, 100, 200, 300];
    let k = seeds.len() as f32;
    let (mut native, mut excess) = (0.0f32, vec![0.0f32; 5]);
    for &seed in &seeds {
        let finals = mlp_finals(seed);
        assert!(
            finals[0] < 0.09,
            "native trains to the noise floor: {finals:?}"
        );
        native += finals[0] / k;
        for (e, f) in excess.iter_mut().zip(&finals) {
            *e += (f - finals[0]) / k;
        }
    }
    for e in &excess[1..] {
        assert!(
            e.abs() <= 0.08 * native,
            "mean excess over native {native}: {excess:?}"
        );
    }
}

/// The final training losses of one MLP in every mode (native first), its
/// data and initial weights drawn from `seed`.
fn mlp_finals(seed: u64) -> Vec<f32> {
    use candle_nn::Optimizer;
    let (n_in, hidden, n_out, rows) = (16, 32, 4, 256);
    let x = t(randn(rows * n_in, 51 + seed), &[rows, n_in]);
    let w_true = randt(&[n_out, n_in], 52 + seed, 0.5);
    // A smooth target plus noise: the loss settles at the noise floor
    // (variance 0.3^2 * 0.96 = 0.086), where a mode's quantization error
    // shows as a relative excess.
    let noise = randt(&[rows, n_out], 53 + seed, 0.3);
    let y = (x.matmul(&w_true.t().unwrap()).unwrap().tanh().unwrap() + noise).unwrap();
    let modes = [
        ComputeMode::Native,
        ComputeMode::Fp8Current(CurrentScaling::default()),
        ComputeMode::Fp8Current(CurrentScaling {
            fp8_format: Format::Hybrid,
            ..Default::default()
        }),
        ComputeMode::Fp8Delayed(DelayedScaling {
            fp8_format: Format::E4M3,
            amax_history_len: 16,
            ..Default::default()
        }),
        ComputeMode::Fp8Delayed(DelayedScaling {
            fp8_format: Format::Hybrid,
            amax_history_len: 16,
            ..Default::default()
        }),
    ];
    let mut finals = vec![];
    for mode in &modes {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        // Same init in every mode: seed the VarMap's values.
        let fc1 = nn::linear(n_in, hidden, vb.pp("fc1")).unwrap();
        let fc2 = nn::linear(hidden, n_out, vb.pp("fc2")).unwrap();
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let seed = seed + name.bytes().map(u64::from).sum::<u64>();
            let n = var.elem_count();
            var.set(&t(
                randn(n, seed).iter().map(|v| v * 0.3).collect(),
                var.dims(),
            ))
            .unwrap();
        }
        let mut opt = candle_nn::AdamW::new_lr(varmap.all_vars(), 1e-2).unwrap();
        let mut last = 0.0;
        for _ in 0..300 {
            let _s = fp8_autocast(true, mode.clone());
            let h = fc1.forward(&x).unwrap().relu().unwrap();
            let loss = mse(&fc2.forward(&h).unwrap(), &y);
            last = loss.to_scalar::<f32>().unwrap();
            opt.backward_step(&loss).unwrap();
        }
        finals.push(last);
    }
    finals
}

#[test]
fn a_first_layer_fed_plain_data_still_hands_its_gradient_to_the_sink() {
    let varmap = VarMap::new();
    let layer = nn::linear_no_bias(
        4,
        2,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("first"),
    )
    .unwrap();
    let sink = GradSink::new();
    layer.set_grad_sink(Some(sink.clone())).unwrap();
    let x = t(randn(3 * 4, 2), &[3, 4]); // data, not a Var
    {
        let _s = fp8_autocast(true, ComputeMode::Fp8Current(CurrentScaling::default()));
        layer
            .forward(&x)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
    }
    assert!(sink.take().unwrap().contains_key("first.weight"));
}

#[test]
fn overflow_in_fp8_casts_is_not_hidden_by_saturation() {
    let varmap = VarMap::new();
    let layer = nn::linear_no_bias(
        4,
        2,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("l"),
    )
    .unwrap();
    let sink = GradSink::new();
    layer.set_grad_sink(Some(sink.clone())).unwrap();
    let mode = ComputeMode::Fp8Current(CurrentScaling::default());
    // Forward: an infinite input gives a non-finite output, not max * w.
    let x = t(vec![1.0, f32::INFINITY, 0.5, 2.0], &[1, 4]);
    let y = {
        let _s = fp8_autocast(true, mode.clone());
        layer.forward(&x).unwrap()
    };
    assert!(y.to_vec2::<f32>().unwrap()[0]
        .iter()
        .all(|v| !v.is_finite()));
    // Backward: an infinite output gradient reaches the sink as non-finite.
    let xv = Var::from_tensor(&t(vec![1.0, 2.0, 0.5, 2.0], &[1, 4])).unwrap();
    let r = t(vec![1.0, f32::INFINITY], &[1, 2]);
    let grads = {
        let _s = fp8_autocast(true, mode);
        (layer.forward(xv.as_tensor()).unwrap() * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
    };
    let g = &sink.take().unwrap()["l.weight"];
    let amax = g.meta().amax().unwrap().to_vec1::<f32>().unwrap()[0];
    assert!(!amax.is_finite(), "the sink gradient's amax is {amax}");
    let dx: Vec<f32> = grads
        .get(xv.as_tensor())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(dx.iter().all(|v| !v.is_finite()), "{dx:?}");
}

#[test]
fn two_forwards_in_one_scope_are_one_scaling_step() {
    let layer = nn::Linear::new("w", t(vec![1.0; 4], &[1, 4]), None).unwrap();
    let recipe = ComputeMode::Fp8Delayed(DelayedScaling {
        amax_history_len: 4,
        ..Default::default()
    });
    for step in 0..3 {
        let _s = fp8_autocast(true, recipe.clone());
        for a in [1.0f32, 2.0] {
            layer.forward(&t(vec![a, 0.0, 0.0, 0.0], &[1, 4])).unwrap();
        }
        let meta = layer.scaling_state().unwrap().unwrap().input;
        let h: Vec<f32> = meta.amax_history().to_vec1().unwrap();
        // slot 0 holds the larger amax of the step's two casts; the history
        // rolled once per step (past steps' 2s moved to the end)
        assert_eq!(h[0], 2.0, "step {step}: {h:?}");
        assert_eq!(
            h.iter().filter(|&&v| v == 2.0).count(),
            step + 1,
            "step {step}: {h:?}"
        );
    }
}
