//! amp::nn::Linear: FP8 forward and gradients against a float64 reference
//! within bounds derived from the formats, finite differences, delayed
//! scaling step by step, saturation telemetry, the gradient sink, training,
//! and bad inputs.

use crate::common;

use amp::nn::{self, fp8_autocast, ComputeMode};
use amp::{
    AmaxComputeAlgo, CurrentScaling, DelayedScaling, Float8BlockScaling, Format,
    OverrideLinearPrecision,
};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{f64s, randn, t};

/// Half-ulp relative error of a format in its normal range.
const E4M3_EPS: f64 = 1.0 / 16.0;
const E5M2_EPS: f64 = 1.0 / 8.0;

/// `C = A · Bᵀ` and `|A| · |B|ᵀ` in f64, A: [m, k], B: [n, k].
fn matmul_t(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for l in 0..k {
                c[i * n + j] += a[i * k + l] * b[j * k + l];
                abs[i * n + j] += (a[i * k + l] * b[j * k + l]).abs();
            }
        }
    }
    (c, abs)
}

fn transpose(a: &[f64], r: usize, c: usize) -> Vec<f64> {
    (0..r * c).map(|i| a[(i % r) * c + i / r]).collect()
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// `||got - want|| <= (ea + eb + ea·eb) · || |A||B|ᵀ || + slack`: each
/// product of two quantized operands is off by at most that relative
/// amount; `slack` covers elements in the subnormal range.
fn check(what: &str, got: &Tensor, want: &[f64], abs: &[f64], ea: f64, eb: f64) {
    let g = f64s(got);
    let err: Vec<f64> = g.iter().zip(want).map(|(a, b)| a - b).collect();
    let bound = (ea + eb + ea * eb) * norm(abs) * 1.001;
    assert!(
        norm(&err) <= bound,
        "{what}: error {:e} > bound {bound:e}",
        norm(&err)
    );
    assert!(
        norm(&err) > 0.0,
        "{what}: FP8 must differ from the reference"
    );
}

#[test]
fn fp8_forward_and_gradients_within_the_format_bounds() {
    let modes = [
        (
            "current HYBRID",
            ComputeMode::Fp8Current(CurrentScaling::default()),
            E5M2_EPS,
        ),
        (
            "current E4M3",
            ComputeMode::Fp8Current(CurrentScaling {
                fp8_format: Format::E4M3,
                ..Default::default()
            }),
            E4M3_EPS,
        ),
        (
            "delayed HYBRID",
            ComputeMode::Fp8Delayed(DelayedScaling {
                amax_history_len: 4,
                ..Default::default()
            }),
            E5M2_EPS,
        ),
        (
            "block E4M3",
            ComputeMode::Fp8Block(Float8BlockScaling::default()),
            E4M3_EPS,
        ),
        (
            "rowwise E4M3",
            ComputeMode::Fp8Rowwise(Default::default()),
            E4M3_EPS,
        ),
        (
            "rowwise HYBRID",
            ComputeMode::Fp8Rowwise(amp::Float8RowwiseScaling {
                fp8_format: Format::Hybrid,
                ..Default::default()
            }),
            E5M2_EPS,
        ),
        (
            "block HYBRID, 1x128 weights",
            ComputeMode::Fp8Block(Float8BlockScaling {
                fp8_format: Format::Hybrid,
                w_block_scaling_dim: 1,
                ..Default::default()
            }),
            E5M2_EPS,
        ),
    ];
    for (dims, out) in [
        (vec![1usize, 16], 8usize),
        (vec![7, 33], 17),
        (vec![2, 5, 24], 12),
        (vec![64, 128], 48),
        (vec![130, 260], 140),
    ] {
        let inp = *dims.last().unwrap();
        let m: usize = dims[..dims.len() - 1].iter().product();
        for (name, mode, eps_g) in &modes {
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
            let layer = nn::linear_no_bias(inp, out, vb.pp("fc")).unwrap();
            let w = layer.weight_slot().read().unwrap().master_f32().unwrap();
            let x = Var::from_tensor(&t(randn(m * inp, 3), &dims)).unwrap();
            let r = t(randn(m * out, 4), &[m * out]);
            // Two steps so delayed scaling has a history.
            let mut grads = None;
            let mut y = None;
            for _ in 0..2 {
                let _s = fp8_autocast(true, mode.clone());
                let yy = layer.forward(x.as_tensor()).unwrap();
                let loss = (yy.flatten_all().unwrap() * &r).unwrap().sum_all().unwrap();
                grads = Some(loss.backward().unwrap());
                y = Some(yy);
            }
            let (y, grads) = (y.unwrap(), grads.unwrap());
            let (xs, ws, rs) = (f64s(x.as_tensor()), f64s(&w), f64s(&r));
            let what = |g: &str| format!("{name} {dims:?}->{out} {g}");
            // fprop: y = x · Wᵀ
            let (want, abs) = matmul_t(&xs, &ws, m, inp, out);
            check(&what("fprop"), &y, &want, &abs, E4M3_EPS, E4M3_EPS);
            // dgrad: dx = dy · W = dy · (Wᵀ)ᵀ
            let (want, abs) = matmul_t(&rs, &transpose(&ws, out, inp), m, out, inp);
            check(
                &what("dgrad"),
                grads.get(x.as_tensor()).unwrap(),
                &want,
                &abs,
                *eps_g,
                E4M3_EPS,
            );
            // wgrad: dW = dyᵀ · x
            let (want, abs) = matmul_t(
                &transpose(&rs, m, out),
                &transpose(&xs, m, inp),
                out,
                m,
                inp,
            );
            let wvar = varmap.data().lock().unwrap()["fc.weight"].clone();
            check(
                &what("wgrad"),
                grads.get(wvar.as_tensor()).unwrap(),
                &want,
                &abs,
                *eps_g,
                E4M3_EPS,
            );
        }
    }
}

/// d(loss)/d(param) by central differences, loss = sum(y * r).
fn finite_diff(f: &dyn Fn(&Tensor) -> f64, p: &Tensor) -> Vec<f64> {
    let v: Vec<f32> = p.flatten_all().unwrap().to_vec1().unwrap();
    (0..v.len())
        .map(|i| {
            let h = 1e-2f32;
            let mut a = v.clone();
            a[i] += h;
            let mut b = v.clone();
            b[i] -= h;
            let (fa, fb) = (f(&t(a, p.dims())), f(&t(b, p.dims())));
            (fa - fb) / (2.0 * h as f64)
        })
        .collect()
}

#[test]
fn native_gradients_match_finite_differences() {
    // Native mode through candle's ops, and through our op with every GEMM
    // overridden to native precision (the same numbers, another code path).
    let overridden = ComputeMode::Fp8Delayed(DelayedScaling {
        override_linear_precision: OverrideLinearPrecision {
            fprop: true,
            dgrad: true,
            wgrad: true,
        },
        ..Default::default()
    });
    for mode in [ComputeMode::Native, overridden] {
        let w0 = t(randn(5 * 6, 7), &[5, 6]);
        let x0 = t(randn(3 * 6, 8), &[3, 6]);
        let r = t(randn(15, 9), &[3, 5]);
        let loss_of = |x: &Tensor, w: &Tensor| -> f64 {
            let layer = nn::Linear::new("w", w.clone(), None).unwrap();
            let _s = fp8_autocast(true, mode.clone());
            let y = layer.forward(x).unwrap();
            (y * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let wv = Var::from_tensor(&w0).unwrap();
        let xv = Var::from_tensor(&x0).unwrap();
        let layer = nn::Linear::new("w", wv.as_tensor().clone(), None).unwrap();
        let grads = {
            let _s = fp8_autocast(true, mode.clone());
            (layer.forward(xv.as_tensor()).unwrap() * &r)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
        };
        let fd_w = finite_diff(&|w| loss_of(&x0, w), &w0);
        let fd_x = finite_diff(&|x| loss_of(x, &w0), &x0);
        for (got, want) in [
            (grads.get(wv.as_tensor()).unwrap(), fd_w),
            (grads.get(xv.as_tensor()).unwrap(), fd_x),
        ] {
            for (a, b) in f64s(got).iter().zip(&want) {
                assert!(
                    (a - b).abs() <= 1e-3 * (1.0 + b.abs()),
                    "{mode:?}: {a} vs {b}"
                );
            }
        }
    }
}

fn scale_of(m: &amp::ScalingMeta) -> f32 {
    m.scale().to_vec1::<f32>().unwrap()[0]
}

#[test]
fn delayed_scaling_uses_te_scales_step_by_step() {
    // The input of step s has amax a_s; the scale used at step s comes from
    // amaxes up to s - 1 (TE: history rolled once per step; its first step
    // at the initial scale of 1, not our default's own amax).
    let amaxes = [1.0f32, 2.0, 4.0, 0.5, 0.25];
    let cases: [(DelayedScaling, [f32; 5]); 4] = [
        // window of 2 (current slot + 1 past), max
        (
            DelayedScaling {
                amax_history_len: 2,
                calibrate_first_step: false, // TE's first step: scale 1
                ..Default::default()
            },
            [1.0, 448.0, 224.0, 112.0, 112.0],
        ),
        // most recent only
        (
            DelayedScaling {
                amax_history_len: 2,
                amax_compute_algo: AmaxComputeAlgo::MostRecent,
                calibrate_first_step: false, // TE's first step: scale 1
                ..Default::default()
            },
            [1.0, 448.0, 224.0, 112.0, 896.0],
        ),
        // margin 1 halves every computed scale
        (
            DelayedScaling {
                amax_history_len: 1,
                margin: 1,
                calibrate_first_step: false, // TE's first step: scale 1
                ..Default::default()
            },
            [1.0, 224.0, 112.0, 56.0, 448.0],
        ),
        // interval 2: recomputed at updates 0, 2 (steps 2 and 4)
        (
            DelayedScaling {
                amax_history_len: 1,
                interval: 2,
                calibrate_first_step: false, // TE's first step: scale 1
                ..Default::default()
            },
            [1.0, 448.0, 448.0, 112.0, 112.0],
        ),
    ];
    for (recipe, want) in cases {
        let layer = nn::Linear::new("w", t(vec![1.0; 4], &[1, 4]), None).unwrap();
        let mut used = vec![];
        for a in amaxes {
            let _s = fp8_autocast(true, ComputeMode::Fp8Delayed(recipe.clone()));
            let x = t(vec![a, -a / 2.0, 0.0, a / 4.0], &[1, 4]);
            layer.forward(&x).unwrap();
            used.push(scale_of(&layer.scaling_state().unwrap().unwrap().input));
        }
        assert_eq!(used, want, "{recipe:?}");
    }
}

#[test]
fn a_calibrated_first_step_takes_its_own_amax_then_follows_te() {
    // as the TE test above (history of 2, max), with `calibrate_first_step`:
    // step 1 scales by its own amax (448 / 1) instead of 1, the rest as TE
    let recipe = DelayedScaling {
        amax_history_len: 2,
        calibrate_first_step: true,
        ..Default::default()
    };
    let layer = nn::Linear::new("w", t(vec![1.0; 4], &[1, 4]), None).unwrap();
    let mut used = vec![];
    for a in [1.0f32, 2.0, 4.0, 0.5, 0.25] {
        let _s = fp8_autocast(true, ComputeMode::Fp8Delayed(recipe.clone()));
        let x = t(vec![a, -a / 2.0, 0.0, a / 4.0], &[1, 4]);
        layer.forward(&x).unwrap();
        used.push(scale_of(&layer.scaling_state().unwrap().unwrap().input));
    }
    assert_eq!(used, [448.0, 448.0, 224.0, 112.0, 112.0]);
}

#[test]
fn saturation_is_counted_not_silent() {
    // casts count while their thread asks (or records telemetry)
    amp::set_cast_counts(true);
    let layer = nn::Linear::new("w", t(vec![0.5; 8], &[2, 4]), None).unwrap();
    let recipe = ComputeMode::Fp8Delayed(DelayedScaling {
        amax_history_len: 1,
        ..Default::default()
    });
    for x in [vec![1.0f32, 0.5, -1.0, 0.25], vec![1.0, 100.0, -1.0, 1e-9]] {
        let _s = fp8_autocast(true, recipe.clone());
        layer.forward(&t(x, &[1, 4])).unwrap();
    }
    // Step 2 ran with scale 448 / 1: the outlier 100 saturated, 1e-9 flushed.
    let state = layer.scaling_state().unwrap().unwrap();
    let stats = state.input.last_cast_stats().unwrap().unwrap();
    assert_eq!((stats.saturated, stats.flushed), (1, 1));
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let layer = nn::Linear::new("w", t(vec![1.0; 12], &[3, 4]), None).unwrap();
    for mode in [
        ComputeMode::Native,
        ComputeMode::Fp8Current(CurrentScaling::default()),
    ] {
        let _s = fp8_autocast(true, mode);
        let e = layer.forward(&t(vec![1.0; 10], &[2, 5])).unwrap_err();
        assert!(e.to_string().contains("incompatible shapes"), "{e}");
        let e = layer
            .forward(&Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("dtype"), "{e}");
        let e = layer
            .forward(&Tensor::new(3f32, &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("incompatible shapes"), "{e}");
    }
    assert!(nn::Linear::new("w", t(vec![1.0; 4], &[4]), None).is_err());
    // A low-bit weight without a sink has nowhere to put its gradient.
    let (w16, _) = amp::ScalingTensor::quantize(
        &t(vec![1.0; 12], &[3, 4]),
        amp::QType::F16,
        &CurrentScaling::default(),
    )
    .unwrap();
    let low = nn::Linear::from_slot("w", amp::WeightSlot::new(amp::Weight::F16(w16)), None);
    assert!(low.forward(&t(vec![1.0; 4], &[1, 4])).is_err());
}

#[test]
fn output_gradients_use_the_backward_format_of_the_recipe() {
    for (format, want) in [
        (Format::Hybrid, amp::QType::E5M2),
        (Format::E4M3, amp::QType::E4M3),
    ] {
        let layer = nn::Linear::new("w", t(vec![0.5; 8], &[2, 4]), None).unwrap();
        let x = Var::from_tensor(&t(vec![1.0, 2.0, 3.0, 4.0], &[1, 4])).unwrap();
        let recipe = DelayedScaling {
            fp8_format: format,
            amax_history_len: 2,
            ..Default::default()
        };
        {
            let _s = fp8_autocast(true, ComputeMode::Fp8Delayed(recipe));
            layer
                .forward(x.as_tensor())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
        }
        let s = layer.scaling_state().unwrap().unwrap();
        assert_eq!(s.input.qtype(), amp::QType::E4M3);
        assert_eq!(s.weight.qtype(), amp::QType::E4M3);
        assert_eq!(s.grad_output.qtype(), want, "{format:?}");
        // the backward recorded its amax (dy = 1 everywhere)
        assert_eq!(
            s.grad_output.amax().unwrap().to_vec1::<f32>().unwrap(),
            [1.0]
        );
    }
}

/// Casts count their saturated and flushed elements only while their
/// thread asks (`set_cast_counts`) or records telemetry: otherwise the
/// metadata has no counts, and the codes are the same.
#[test]
fn casts_count_only_when_asked() {
    let layer = nn::Linear::new("w", t(vec![0.5; 8], &[2, 4]), None).unwrap();
    let x = t(vec![1000.0, 1e-4, 1.0, -2.0], &[1, 4]);
    let run = || {
        let _s = fp8_autocast(true, ComputeMode::Fp8Current(CurrentScaling::default()));
        let y = layer.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        (y, layer.last_cast_stats().unwrap()[0])
    };
    amp::set_cast_counts(false);
    let (quiet, none) = run();
    assert_eq!(none, None, "no counts unless asked");
    amp::set_cast_counts(true);
    let (counted, some) = run();
    assert_eq!(some.map(|s| (s.saturated, s.flushed)), Some((0, 1)));
    assert_eq!(quiet, counted, "the same output either way");
    amp::set_cast_counts(false);
    nn::set_telemetry(true);
    let (_, by_telemetry) = run();
    nn::set_telemetry(false);
    assert!(by_telemetry.is_some(), "telemetry counts");
    assert!(!amp::cast_counts(), "telemetry off: counting off again");
}

#[test]
fn current_scaling_telemetry_is_kept_per_layer() {
    amp::set_cast_counts(true);
    let layer = nn::Linear::new("w", t(vec![0.5; 8], &[2, 4]), None).unwrap();
    assert_eq!(layer.last_cast_stats().unwrap(), [None, None, None]);
    // Current scaling fits the scale to the amax: nothing saturates, but a
    // value 2^-20 below the amax falls under E4M3's range and is flushed.
    let x = Var::from_tensor(&t(vec![1000.0, 1e-4, 1.0, -2.0], &[1, 4])).unwrap();
    {
        let _s = fp8_autocast(true, ComputeMode::Fp8Current(CurrentScaling::default()));
        layer
            .forward(x.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
    }
    let [input, weight, grad] = layer.last_cast_stats().unwrap();
    let input = input.unwrap();
    assert_eq!((input.saturated, input.flushed), (0, 1));
    assert_eq!(weight.unwrap().saturated, 0);
    assert!(grad.is_some(), "the backward's cast is recorded too");
}

/// Under block scaling an outlier costs only its own tile: the rows of the
/// output away from it keep the format's precision, where one scale per
/// tensor loses them; an inf in the input makes its row's outputs NaN.
#[test]
fn block_scaling_keeps_an_outlier_in_its_tile() {
    let (m, inp, out) = (16usize, 256usize, 32usize);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = nn::linear_no_bias(inp, out, vb.pp("fc")).unwrap();
    // seeded (the default init is not): the thresholds below hold for any
    // draw by a wide margin, and this keeps the run the same on every machine
    for var in varmap.all_vars() {
        var.set(&t(
            randn(var.elem_count(), 9)
                .iter()
                .map(|v| v * 0.06)
                .collect(),
            var.dims(),
        ))
        .unwrap();
    }
    let w = layer.weight_slot().read().unwrap().master_f32().unwrap();
    let mut xv: Vec<f32> = randn(m * inp, 8).iter().map(|v| v * 1e-3).collect();
    xv[3] = 1e3; // row 0, tile 0
    let x = t(xv.clone(), &[m, inp]);
    let (want, _) = matmul_t(&f64s(&x), &f64s(&w), m, inp, out);
    let rel_err_rest = |mode: ComputeMode| {
        let _s = fp8_autocast(true, mode);
        let y = f64s(&layer.forward(&x).unwrap());
        // rows 1.. only: the outlier's row shares its tile with it
        let err: Vec<f64> = y[out..]
            .iter()
            .zip(&want[out..])
            .map(|(a, b)| a - b)
            .collect();
        norm(&err) / norm(&want[out..])
    };
    let block = rel_err_rest(ComputeMode::Fp8Block(Float8BlockScaling::default()));
    let tensor = rel_err_rest(ComputeMode::Fp8Current(CurrentScaling {
        fp8_format: Format::E4M3,
        ..Default::default()
    }));
    assert!(block < 0.05, "block: {block}");
    assert!(tensor > 4.0 * block, "per tensor {tensor} vs block {block}");
    // an inf in row 2: that row's outputs NaN, never finite from a
    // saturated code; the rows after it as finite as before
    xv[2 * inp + 188] = f32::INFINITY;
    let _s = fp8_autocast(true, ComputeMode::Fp8Block(Float8BlockScaling::default()));
    let y = f64s(&layer.forward(&t(xv, &[m, inp])).unwrap());
    assert!(
        y[2 * out..3 * out].iter().all(|v| v.is_nan()),
        "inf input: NaN row"
    );
    assert!(
        y[3 * out..].iter().all(|v| v.is_finite()),
        "other rows finite"
    );
}
