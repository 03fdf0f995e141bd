//! `Linear::forward_with(x, Fuse { norm, activation, residual })` (and
//! `forward_gelu`): the LayerNorm handed to the Linear's op, the GELU and
//! the residual add inside it give the values of the parts in sequence
//! (output and the gradients of the input, the LayerNorm's parameters, the
//! residual, the weight (in the GradStore or the sink) and the bias) in
//! every compute mode, F32 and BF16 activations, with and without a sink,
//! over several delayed-scaling steps. Where the residual is added in the
//! FP8 GEMM's epilogue (BF16), the output is the parts' within one
//! rounding (see `within_one_rerounding`).

use crate::common;

use amp::nn::{self, fp8_autocast, ComputeMode, Fuse, GradSink};
use candle_core::{DType, Tensor, Var};
use common::{modes, randt, residual_in_gemm, values, within_one_rerounding, DTYPE_SINK};

/// Two layers over equal but distinct weights (separate scaling state).
fn pair(name: &str, out: usize, inp: usize) -> [(nn::Linear, Var, Var); 2] {
    let w = randt(&[out, inp], 3, 0.5);
    let b = randt(&[out], 4, 0.1);
    [0, 1].map(|i| {
        let (wv, bv) = (Var::from_tensor(&w).unwrap(), Var::from_tensor(&b).unwrap());
        let layer = nn::Linear::new(
            format!("{name}{i}.weight"),
            wv.as_tensor().clone(),
            Some(bv.as_tensor().clone()),
        )
        .unwrap();
        (layer, wv, bv)
    })
}

#[test]
fn forward_gelu_checks_its_input() {
    let [(layer, _, _), _] = pair("gchk", 8, 16);
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
    let e = layer.forward_gelu(&randt(&[3, 15], 1, 1.0)).unwrap_err();
    assert!(e.to_string().contains("Linear::forward"), "{e}");
    let ints = Tensor::zeros((3, 16), DType::U32, &candle_core::Device::Cpu).unwrap();
    assert!(layer.forward_gelu(&ints).is_err(), "integer input");
}

#[test]
fn forward_with_refuses_a_residual_unlike_the_output() {
    let [(layer, _, _), _] = pair("rchk", 8, 16);
    layer.set_grad_sink(Some(GradSink::new())).unwrap();
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
    let x = randt(&[3, 16], 1, 1.0);
    for r in [
        randt(&[3, 9], 2, 1.0),
        randt(&[3, 8], 2, 1.0).to_dtype(DType::BF16).unwrap(),
    ] {
        let fuse = Fuse {
            residual: Some(&r),
            ..Default::default()
        };
        assert!(layer.forward_with(&x, fuse).is_err(), "{:?}", r.shape());
    }
}

/// An untracked input and residual, no bias, a sink: the op is still built
/// (its placeholder argument is tracked) and the sink gets the weight's
/// gradient; the residual is added after the op.
#[test]
fn an_untracked_residual_still_feeds_the_sink() {
    let w = Var::from_tensor(&randt(&[8, 16], 5, 0.5)).unwrap();
    let layer = nn::Linear::new("untracked.weight", w.as_tensor().clone(), None).unwrap();
    let sink = GradSink::new();
    layer.set_grad_sink(Some(sink.clone())).unwrap();
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
    let (x, r) = (randt(&[3, 16], 6, 1.0), randt(&[3, 8], 7, 1.0));
    let fuse = Fuse {
        activation: Some(nn::Activation::Gelu),
        residual: Some(&r),
        ..Default::default()
    };
    let y = layer.forward_with(&x, fuse).unwrap();
    let want = (&r + layer.try_forward(&nn::gelu(&x).unwrap()).unwrap()).unwrap();
    assert_eq!(values(&y), values(&want));
    sink.take().unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert!(
        sink.take().unwrap().contains_key("untracked.weight"),
        "no weight gradient in the sink"
    );
}

/// A LayerNorm over fresh Vars with fixed values: `(norm, weight, bias)`.
fn layer_norm(dim: usize) -> (nn::LayerNorm, Var, Var) {
    let w = Var::from_tensor(&randt(&[dim], 8, 0.3).affine(1.0, 1.0).unwrap()).unwrap();
    let b = Var::from_tensor(&randt(&[dim], 9, 0.1)).unwrap();
    let ln = nn::LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5).unwrap();
    (ln, w, b)
}

/// Every combination of LayerNorm, GELU and residual (`forward_gelu` for
/// GELU alone), in every mode, dtype and sink case, over three steps.
#[test]
fn forward_with_equals_the_parts_in_sequence() {
    let (d_in, d_out) = (32, 16);
    let combos = [
        (false, false, true),
        (false, true, false),
        (false, true, true),
        (true, false, false),
        (true, false, true),
        (true, true, true),
    ];
    for (m, mode) in modes().into_iter().enumerate() {
        for (c, (dtype, with_sink)) in DTYPE_SINK.into_iter().enumerate() {
            for (k, (norm, gelu, residual)) in combos.into_iter().enumerate() {
                let tag = format!("f{m}{c}{k}");
                let [(fused, wf, bf), (plain, wp, bp)] = pair(&tag, d_out, d_in);
                let lns = [layer_norm(d_in), layer_norm(d_in)];
                let sinks = [GradSink::new(), GradSink::new()];
                if with_sink {
                    fused.set_grad_sink(Some(sinks[0].clone())).unwrap();
                    plain.set_grad_sink(Some(sinks[1].clone())).unwrap();
                }
                for step in 0..3u64 {
                    let what = format!(
                        "{mode:?} {dtype:?} sink {with_sink} norm {norm} gelu {gelu} \
                         residual {residual} step {step}"
                    );
                    let input = |shape: &[usize], seed: u64, scale: f32| {
                        randt(shape, seed + step, scale).to_dtype(dtype).unwrap()
                    };
                    let x = Var::from_tensor(&input(&[3, 4, d_in], 30, 2.0)).unwrap();
                    let res = Var::from_tensor(&input(&[3, 4, d_out], 40, 1.0)).unwrap();
                    let r = input(&[3, 4, d_out], 50, 1.0);
                    let (x_t, res_t) = (x.as_tensor(), res.as_tensor());
                    let _s = fp8_autocast(true, mode.clone());
                    let y1 = match (norm, gelu, residual) {
                        (false, true, false) => fused.forward_gelu(x_t).unwrap(),
                        _ => {
                            let fuse = Fuse {
                                norm: norm.then_some(&lns[0].0),
                                activation: gelu.then_some(nn::Activation::Gelu),
                                residual: residual.then_some(res_t),
                            };
                            fused.forward_with(x_t, fuse).unwrap()
                        }
                    };
                    let mut a = x_t.clone();
                    if norm {
                        a = lns[1].0.try_forward(&a).unwrap();
                    }
                    if gelu {
                        a = nn::gelu(&a).unwrap();
                    }
                    let mut y2 = plain.try_forward(&a).unwrap();
                    if residual {
                        y2 = (res_t + y2).unwrap();
                    }
                    assert_eq!(y1.dims(), [3, 4, d_out], "{what}");
                    if residual && residual_in_gemm(&mode, dtype, with_sink) {
                        assert!(within_one_rerounding(&y1, &y2, res_t), "{what}: y");
                    } else {
                        assert_eq!(values(&y1), values(&y2), "{what}: y");
                    }
                    let g1 = (&y1 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                    let g2 = (&y2 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                    let fp8_weight_grad = with_sink && !matches!(mode, ComputeMode::Native);
                    let mut grads = vec![("dx", x_t, x_t), ("db", bf.as_tensor(), bp.as_tensor())];
                    if residual {
                        grads.push(("dres", res_t, res_t));
                    }
                    if norm {
                        grads.push(("dln_w", lns[0].1.as_tensor(), lns[1].1.as_tensor()));
                        grads.push(("dln_b", lns[0].2.as_tensor(), lns[1].2.as_tensor()));
                    }
                    if !fp8_weight_grad {
                        grads.push(("dw", wf.as_tensor(), wp.as_tensor()));
                    }
                    for (name, a, b) in grads {
                        let (ga, gb) = (g1.get(a).expect(name), g2.get(b).expect(name));
                        assert_eq!(values(ga), values(gb), "{what}: {name}");
                    }
                    if fp8_weight_grad {
                        let (s1, s2) = (sinks[0].take().unwrap(), sinks[1].take().unwrap());
                        let key = |i: usize| format!("{tag}{i}.weight");
                        assert_eq!(
                            values(&s1[&key(0)].dequantize(DType::F32).unwrap()),
                            values(&s2[&key(1)].dequantize(DType::F32).unwrap()),
                            "{what}: sink dw"
                        );
                    }
                }
            }
        }
    }
}
