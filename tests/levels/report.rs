//! Levels O0-O3: the memory report against docs/ARCHITECTURE.md, "Levels", computed from shapes,
//! training at every level against O0, and exclusions.

use crate::common;

use amp::levels::{initialize, AmpConfig, Compute, Level};
use amp::nn::{self, LayerNorm, LayerNormMLP, Linear};
use amp::optim::AdamWConfig;
use amp::CurrentScaling;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use common::{mse, randn, randt, t};

/// A small transformer-like model: input projection, two pre-LN MLP blocks
/// with residuals, a final LayerNorm and an output head.
struct Model {
    proj: Linear,
    blocks: Vec<LayerNormMLP>,
    norm: LayerNorm,
    head: Linear,
}

impl Model {
    fn new(vb: VarBuilder, d_in: usize, d: usize, d_out: usize) -> Model {
        Model {
            proj: nn::linear(d_in, d, vb.pp("proj")).unwrap(),
            blocks: (0..2)
                .map(|i| nn::layer_norm_mlp(d, 4 * d, 1e-5, vb.pp(format!("blocks.{i}"))).unwrap())
                .collect(),
            norm: nn::layer_norm(d, 1e-5, vb.pp("norm")).unwrap(),
            head: nn::linear(d, d_out, vb.pp("head")).unwrap(),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = self.proj.forward(x).unwrap();
        for b in &self.blocks {
            h = (&h + b.forward(&h).unwrap()).unwrap();
        }
        self.head.forward(&self.norm.forward(&h).unwrap()).unwrap()
    }
}

/// Deterministic initial values for every variable, by name.
fn seed(varmap: &VarMap) {
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let s = name.bytes().map(u64::from).sum::<u64>();
        let scale = if name.ends_with("layer_norm.weight") || name == "norm.weight" {
            0.0
        } else {
            0.2
        };
        let base = if scale == 0.0 { 1.0 } else { 0.0 };
        let v: Vec<f32> = randn(var.elem_count(), s)
            .iter()
            .map(|x| base + x * scale)
            .collect();
        var.set(&t(v, var.dims())).unwrap();
    }
}

fn config(level: Level) -> AmpConfig {
    let compute = if level == Level::O0 {
        Compute::Native
    } else {
        Compute::Fp8Current {
            recipe: CurrentScaling::default(),
        }
    };
    AmpConfig {
        level,
        compute,
        ..Default::default()
    }
}

#[test]
fn memory_report_equals_the_design_table_computed_from_shapes() {
    // Two plain Linear layers with biases and a LayerNorm: known shapes.
    let (d_in, d_hid, d_out) = (16, 32, 8);
    let linear = d_in * d_hid + d_hid * d_out;
    let other = d_hid + d_out + 2 * d_in; // biases + LayerNorm weight and bias
    let (n_lin_tensors, n_other_tensors) = (2, 4);
    const META: usize = 12; // scale, scale_inv, one amax: 4 bytes each
    for level in Level::ALL {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let ln = nn::layer_norm(d_in, 1e-5, vb.pp("ln")).unwrap();
        let fc1 = nn::linear(d_in, d_hid, vb.pp("fc1")).unwrap();
        let fc2 = nn::linear(d_hid, d_out, vb.pp("fc2")).unwrap();
        let (amp, mut opt) = initialize(&varmap, AdamWConfig::default(), config(level)).unwrap();
        let x = t(randn(4 * d_in, 1), &[4, d_in]);
        let loss = {
            let _fp8 = amp.autocast();
            fc2.forward(
                &fc1.forward(&ln.forward(&x).unwrap())
                    .unwrap()
                    .relu()
                    .unwrap(),
            )
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
        };
        opt.backward_step(&loss).unwrap();
        let r = amp.memory_report(&opt).unwrap();
        let b = r.bytes;
        // Expected from docs/ARCHITECTURE.md, "Levels", per level, from the shapes alone.
        let (w, master, g, m, v, other_states, meta) = match level {
            Level::O0 => (
                4 * linear,
                0,
                4 * linear,
                4 * linear,
                4 * linear,
                8 * other,
                0,
            ),
            // O1: FP16 weights (2 scales), FP8 gradients (2 scales), F32 moments.
            Level::O1 => (
                2 * linear,
                0,
                linear,
                4 * linear,
                4 * linear,
                8 * other,
                4 * META,
            ),
            Level::O2 => (
                2 * linear,
                0,
                linear,
                linear,
                2 * linear,
                3 * other,
                (2 + 2 + 2 * n_lin_tensors + 2 * n_other_tensors) * META,
            ),
            Level::O3 => (
                linear,
                2 * linear,
                linear,
                linear,
                2 * linear,
                3 * other,
                (2 * 2 + 2 + 2 * n_lin_tensors + 2 * n_other_tensors) * META,
            ),
        };
        assert_eq!(r.linear_params, linear, "{level}");
        assert_eq!(r.other_params, other, "{level}");
        assert_eq!(
            (
                b.linear_weights,
                b.master_weights,
                b.weight_gradients,
                b.first_moments,
                b.second_moments
            ),
            (w, master, g, m, v),
            "{level}: {r}"
        );
        assert_eq!(
            (b.other_params, b.other_states, b.scaling_metadata),
            // Other parameters' states include their F32 gradients (4 B each).
            (4 * other, other_states + 4 * other, meta),
            "{level}: {r}"
        );
        let predicted = level.predicted_bytes_per_linear_param(1);
        assert_eq!(r.predicted_bytes_per_linear_param, predicted);
        // Measured per parameter = prediction + the Linear tensors' metadata.
        let slack = r.measured_bytes_per_linear_param - predicted;
        assert!(
            (0.0..0.5).contains(&slack),
            "{level}: {slack} over the prediction\n{r}"
        );
        assert!(
            b.activations_saved > 0 || level == Level::O0,
            "{level}: {r}"
        );
        assert!(r.to_json().unwrap().contains("\"weight_gradients\""));
    }
}

#[test]
fn every_level_trains_and_low_levels_stay_within_3_percent_of_o0() {
    // Same data, seed and compute (FP8, current scaling) at every level, so
    // the comparison isolates what the level stores; enough rows that the
    // loss settles near the noise floor (0.2^2 * 0.96 = 0.038) rather than
    // overfitting.
    let (d_in, d, d_out, rows) = (8, 16, 4, 512);
    let x = t(randn(rows * d_in, 61), &[rows, d_in]);
    let w_true = randt(&[d_out, d_in], 62, 0.4);
    let noise = randt(&[rows, d_out], 63, 0.2);
    let y = (x.matmul(&w_true.t().unwrap()).unwrap().sin().unwrap() + noise).unwrap();
    let mut finals = vec![];
    for level in Level::ALL {
        let varmap = VarMap::new();
        let model = Model::new(
            VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            d_in,
            d,
            d_out,
        );
        seed(&varmap);
        let adam = AdamWConfig {
            lr: 1e-2,
            weight_decay: 0.0,
            ..Default::default()
        };
        let cfg = AmpConfig {
            level,
            compute: Compute::Fp8Current {
                recipe: CurrentScaling::default(),
            },
            ..Default::default()
        };
        let (amp, mut opt) = initialize(&varmap, adam, cfg).unwrap();
        let steps = 300;
        let sched = amp::optim::WarmupCosine {
            peak: 1e-2,
            min: 1e-4,
            warmup: 20,
            total: steps,
        };
        opt.inner_mut().set_schedule(sched);
        let (mut first, mut last) = (None, 0.0);
        for _ in 0..steps {
            let loss = {
                let _fp8 = amp.autocast();
                mse(&model.forward(&x), &y)
            };
            last = loss.to_scalar::<f32>().unwrap();
            first.get_or_insert(last);
            opt.backward_step(&loss).unwrap();
        }
        let first = first.unwrap();
        assert!(last < 0.5 * first, "{level}: loss {first} -> {last}");
        finals.push(last);
    }
    for (level, f) in Level::ALL.iter().zip(&finals).skip(1) {
        assert!(
            (f - finals[0]).abs() <= 0.03 * finals[0],
            "{level}: {f} vs O0 {}: {finals:?}",
            finals[0]
        );
    }
}

#[test]
fn an_excluded_head_stays_f32_and_native() {
    let varmap = VarMap::new();
    let model = Model::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        4,
        8,
        2,
    );
    let cfg = AmpConfig {
        high_precision: vec!["head.*".into()],
        f32_moments: vec!["*.bias".into()],
        ..config(Level::O3)
    };
    let (amp, opt) = initialize(&varmap, AdamWConfig::default(), cfg).unwrap();
    assert!(!amp.is_linear("head.weight"));
    assert!(amp.is_linear("proj.weight"));
    assert!(model.head.is_high_precision());
    let head = opt
        .inner()
        .params()
        .iter()
        .find(|p| p.name == "head.weight")
        .unwrap();
    assert_eq!(head.slot.read().unwrap().kind(), "F32");
    let proj = opt
        .inner()
        .params()
        .iter()
        .find(|p| p.name == "proj.weight")
        .unwrap();
    assert_eq!(proj.slot.read().unwrap().kind(), "FP8+F16");
    let bias = opt
        .inner()
        .params()
        .iter()
        .find(|p| p.name == "proj.bias")
        .unwrap();
    assert_eq!(bias.exp_avg.format(), amp::optim::StateFormat::F32);
    // The converted F32 copy left the VarMap; the head's did not.
    let data = varmap.data().lock().unwrap();
    assert!(!data.contains_key("proj.weight") && data.contains_key("head.weight"));
    let _ = D::Minus1;
}

#[test]
fn initialize_refuses_to_run_twice_and_bad_hyperparameters() {
    let varmap = VarMap::new();
    let _model = Model::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        4,
        8,
        2,
    );
    let (_amp, _opt) = initialize(&varmap, AdamWConfig::default(), config(Level::O2)).unwrap();
    let e = initialize(&varmap, AdamWConfig::default(), config(Level::O2)).unwrap_err();
    assert!(e.to_string().contains("already initialized"), "{e}");
    let varmap2 = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap2, DType::F32, &Device::Cpu);
    let a = nn::linear(4, 4, vb.pp("a")).unwrap();
    // A second layer over the same Var shares its storage and name.
    let w = varmap2.data().lock().unwrap()["a.weight"]
        .as_tensor()
        .clone();
    let b = nn::Linear::new("b.weight", w, None).unwrap();
    assert!(a.weight_slot().same_slot(b.weight_slot()));
    assert_eq!(b.name(), "a.weight");
    let (_c, _o) = initialize(&varmap2, AdamWConfig::default(), config(Level::O3)).unwrap();
    // (a Linear tied to a weight of another name is accepted: tied.rs)
    // Bad hyperparameters leave the model unconverted (and the map free).
    let varmap4 = VarMap::new();
    let m4 = Model::new(
        VarBuilder::from_varmap(&varmap4, DType::F32, &Device::Cpu),
        4,
        8,
        2,
    );
    assert!(initialize(
        &varmap4,
        AdamWConfig {
            lr: -1.0,
            ..Default::default()
        },
        config(Level::O3)
    )
    .is_err());
    assert_eq!(m4.proj.weight_slot().read().unwrap().kind(), "F32");
    initialize(&varmap4, AdamWConfig::default(), config(Level::O3)).unwrap();
}

#[test]
fn evaluate_leaves_the_delayed_scaling_state_as_it_was() {
    let varmap = VarMap::new();
    let model = Model::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        8,
        16,
        4,
    );
    seed(&varmap);
    let cfg = AmpConfig {
        compute: Compute::Fp8Delayed {
            recipe: amp::DelayedScaling::default(),
        },
        ..config(Level::O2)
    };
    let (amp, mut opt) = initialize(&varmap, AdamWConfig::default(), cfg).unwrap();
    let x = randt(&[32, 8], 7, 1.0);
    let loss = {
        let _fp8 = amp.autocast();
        model.forward(&x).sqr().unwrap().mean_all().unwrap()
    };
    opt.backward_step(&loss).unwrap();
    // every scale and amax history of every layer
    let snapshot = || -> Vec<Vec<f32>> {
        let mut out = vec![];
        for layer in amp.linears() {
            let s = layer.scaling_state().unwrap().unwrap();
            for m in [&s.input, &s.weight, &s.grad_output] {
                out.push(m.scale().to_vec1().unwrap());
                out.push(m.amax_history().to_vec1().unwrap());
            }
        }
        out
    };
    let before = snapshot();
    let big = (&x * 50.0).unwrap(); // another amax
    let y = amp
        .evaluate(|| -> Result<Tensor, amp::levels::Error> { Ok(model.forward(&big)) })
        .unwrap();
    assert_eq!(y.dims(), [32, 4]);
    assert_eq!(snapshot(), before);
    // the same forward in a plain scope changes the state: the check can fail
    {
        let _fp8 = amp.autocast();
        model.forward(&big);
    }
    assert_ne!(snapshot(), before);
}
