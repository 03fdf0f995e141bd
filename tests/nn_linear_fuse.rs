//! `Linear::forward_gelu(z)` and `forward_with(x, Fuse { gelu, residual })`:
//! the GELU and the residual add inside the Linear's op give the values of
//! the parts in sequence (output and the gradients of the input, the
//! residual, the weight (in the GradStore or the sink) and the bias) in
//! every compute mode, F32 and BF16 activations, over several
//! delayed-scaling steps.

mod common;

use amp::nn::{self, fp8_autocast, ComputeMode, Fuse, GradSink};
use amp::DelayedScaling;
use candle_core::{DType, Tensor, Var};
use common::randt;

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

fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn forward_gelu_equals_gelu_then_forward() {
    let modes = [
        ComputeMode::Native,
        ComputeMode::Fp8Current(Default::default()),
        ComputeMode::Fp8Delayed(DelayedScaling {
            amax_history_len: 4,
            ..Default::default()
        }),
    ];
    for (m, mode) in modes.into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let [(fused, wf, bf), (plain, wp, bp)] = pair(&format!("g{m}{dtype:?}"), 24, 40);
            for step in 0..3u64 {
                let what = format!("{mode:?} {dtype:?} step {step}");
                let z =
                    Var::from_tensor(&randt(&[2, 5, 40], 10 + step, 2.0).to_dtype(dtype).unwrap())
                        .unwrap();
                let r = randt(&[2, 5, 24], 20 + step, 1.0).to_dtype(dtype).unwrap();
                let _s = fp8_autocast(true, mode.clone());
                let y1 = fused.forward_gelu(z.as_tensor()).unwrap();
                let y2 = plain
                    .try_forward(&nn::gelu(z.as_tensor()).unwrap())
                    .unwrap();
                assert_eq!(y1.dims(), [2, 5, 24], "{what}");
                assert_eq!(values(&y1), values(&y2), "{what}: y");
                let g1 = (&y1 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (&y2 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                for (name, a, b) in [
                    ("dz", z.as_tensor(), z.as_tensor()),
                    ("dw", wf.as_tensor(), wp.as_tensor()),
                    ("db", bf.as_tensor(), bp.as_tensor()),
                ] {
                    let (ga, gb) = (g1.get(a), g2.get(b));
                    let (ga, gb) = (ga.expect(name), gb.expect(name));
                    assert_eq!(values(ga), values(gb), "{what}: {name}");
                }
            }
        }
    }
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

/// Every combination of GELU and residual, with and without a sink (with
/// one, the residual takes the weight's place in the op).
#[test]
fn forward_with_equals_the_parts_in_sequence() {
    let modes = [
        ComputeMode::Native,
        ComputeMode::Fp8Current(Default::default()),
        ComputeMode::Fp8Delayed(DelayedScaling {
            amax_history_len: 4,
            ..Default::default()
        }),
    ];
    for (m, mode) in modes.into_iter().enumerate() {
        for (c, (gelu, with_sink)) in [(false, true), (true, true), (true, false)]
            .into_iter()
            .enumerate()
        {
            let [(fused, wf, bf), (plain, wp, bp)] = pair(&format!("r{m}{c}"), 16, 32);
            let sinks = [GradSink::new(), GradSink::new()];
            if with_sink {
                fused.set_grad_sink(Some(sinks[0].clone())).unwrap();
                plain.set_grad_sink(Some(sinks[1].clone())).unwrap();
            }
            for step in 0..3u64 {
                let what = format!("{mode:?} gelu {gelu} sink {with_sink} step {step}");
                let x = Var::from_tensor(&randt(&[3, 4, 32], 30 + step, 2.0)).unwrap();
                let res = Var::from_tensor(&randt(&[3, 4, 16], 40 + step, 1.0)).unwrap();
                let r = randt(&[3, 4, 16], 50 + step, 1.0);
                let _s = fp8_autocast(true, mode.clone());
                let fuse = Fuse {
                    gelu,
                    residual: Some(res.as_tensor()),
                    ..Default::default()
                };
                let y1 = fused.forward_with(x.as_tensor(), fuse).unwrap();
                let a = if gelu {
                    nn::gelu(x.as_tensor()).unwrap()
                } else {
                    x.as_tensor().clone()
                };
                let y2 = (res.as_tensor() + plain.try_forward(&a).unwrap()).unwrap();
                assert_eq!(values(&y1), values(&y2), "{what}: y");
                let g1 = (&y1 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (&y2 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let mut pairs = vec![
                    ("dx", x.as_tensor(), x.as_tensor()),
                    ("dres", res.as_tensor(), res.as_tensor()),
                    ("db", bf.as_tensor(), bp.as_tensor()),
                ];
                let fp8_weight_grad = with_sink && !matches!(mode, ComputeMode::Native);
                if !fp8_weight_grad {
                    pairs.push(("dw", wf.as_tensor(), wp.as_tensor()));
                }
                for (name, a, b) in pairs {
                    match (g1.get(a), g2.get(b)) {
                        (Some(ga), Some(gb)) => {
                            assert_eq!(values(ga), values(gb), "{what}: {name}")
                        }
                        other => panic!("{what}: {name}: {:?}", other.0.is_some()),
                    }
                }
                if fp8_weight_grad {
                    let (s1, s2) = (sinks[0].take().unwrap(), sinks[1].take().unwrap());
                    let key = |i: usize| format!("r{m}{c}{i}.weight");
                    let (d1, d2) = (&s1[&key(0)], &s2[&key(1)]);
                    assert_eq!(
                        values(&d1.dequantize(DType::F32).unwrap()),
                        values(&d2.dequantize(DType::F32).unwrap()),
                        "{what}: sink dw"
                    );
                }
            }
        }
    }
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
        gelu: true,
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

/// `Fuse { norm }`: the LayerNorm's output handed to the Linear's op gives
/// the values of `forward(&norm(h))`: output and the gradients of the
/// input, both LayerNorm parameters, the weight (GradStore or sink) and
/// the bias, over delayed-scaling steps, F32 and BF16 inputs.
#[test]
fn a_handed_layer_norm_equals_norm_then_forward() {
    let modes = [
        ComputeMode::Native,
        ComputeMode::Fp8Current(Default::default()),
        ComputeMode::Fp8Delayed(DelayedScaling {
            amax_history_len: 4,
            ..Default::default()
        }),
    ];
    let ln_w = randt(&[32], 8, 0.3).affine(1.0, 1.0).unwrap();
    let ln_b = randt(&[32], 9, 0.1);
    for (m, mode) in modes.into_iter().enumerate() {
        for (c, (dtype, with_sink)) in
            [(DType::F32, true), (DType::BF16, true), (DType::F32, false)]
                .into_iter()
                .enumerate()
        {
            let [(fused, wf, bf), (plain, wp, bp)] = pair(&format!("n{m}{c}"), 16, 32);
            let norms = [0, 1].map(|_| {
                let (w, b) = (
                    Var::from_tensor(&ln_w).unwrap(),
                    Var::from_tensor(&ln_b).unwrap(),
                );
                let ln = nn::LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5);
                (ln.unwrap(), w, b)
            });
            let sinks = [GradSink::new(), GradSink::new()];
            if with_sink {
                fused.set_grad_sink(Some(sinks[0].clone())).unwrap();
                plain.set_grad_sink(Some(sinks[1].clone())).unwrap();
            }
            for step in 0..3u64 {
                let what = format!("{mode:?} {dtype:?} sink {with_sink} step {step}");
                let h =
                    Var::from_tensor(&randt(&[2, 3, 32], 60 + step, 2.0).to_dtype(dtype).unwrap())
                        .unwrap();
                let r = randt(&[2, 3, 16], 70 + step, 1.0).to_dtype(dtype).unwrap();
                let _s = fp8_autocast(true, mode.clone());
                let fuse = Fuse {
                    norm: Some(&norms[0].0),
                    ..Default::default()
                };
                let y1 = fused.forward_with(h.as_tensor(), fuse).unwrap();
                let y2 = plain
                    .try_forward(&norms[1].0.try_forward(h.as_tensor()).unwrap())
                    .unwrap();
                assert_eq!(y1.dims(), [2, 3, 16], "{what}");
                assert_eq!(values(&y1), values(&y2), "{what}: y");
                let g1 = (&y1 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (&y2 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let fp8_weight_grad = with_sink && !matches!(mode, ComputeMode::Native);
                let mut pairs = vec![
                    ("dh", h.as_tensor(), h.as_tensor()),
                    ("dln_w", norms[0].1.as_tensor(), norms[1].1.as_tensor()),
                    ("dln_b", norms[0].2.as_tensor(), norms[1].2.as_tensor()),
                    ("db", bf.as_tensor(), bp.as_tensor()),
                ];
                if !fp8_weight_grad {
                    pairs.push(("dw", wf.as_tensor(), wp.as_tensor()));
                }
                for (name, a, b) in pairs {
                    let (ga, gb) = (g1.get(a).expect(name), g2.get(b).expect(name));
                    assert_eq!(values(ga), values(gb), "{what}: {name}");
                }
                if fp8_weight_grad {
                    let (s1, s2) = (sinks[0].take().unwrap(), sinks[1].take().unwrap());
                    let key = |i: usize| format!("n{m}{c}{i}.weight");
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
