//! `Linear::forward_gelu(z)`: the GELU inside the Linear's op gives the
//! values of `forward(&gelu(z))` (output and the gradients of z, weight and
//! bias) in every compute mode, F32 and BF16 activations, over several
//! delayed-scaling steps; the GELU output is no graph node.

mod common;

use amp::nn::{self, fp8_autocast, ComputeMode};
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
