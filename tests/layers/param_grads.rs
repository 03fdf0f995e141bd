//! `nn::collect_param_grads`: inside it the layers' ops hand the gradients
//! of the `Var`s they take (a Linear's bias, an F32 weight without a sink,
//! a LayerNorm's weight and bias) to the collection instead of candle's
//! `GradStore`; put back (`ParamGrads::insert_into`) they are the values
//! a plain backward gives, in every compute mode, F32 and BF16, with and
//! without sinks, a layer applied twice (its gradients summed) included.

use crate::common;

use amp::nn::{self, fp8_autocast, ComputeMode, GradSink};
use candle_core::Var;
use common::{modes, randt, values, DTYPE_SINK};

#[test]
fn collected_parameter_gradients_equal_candles() {
    let d = 16;
    for (m, mode) in modes().into_iter().enumerate() {
        for (c, (dtype, with_sink)) in DTYPE_SINK.into_iter().enumerate() {
            // two layers of equal values (delayed scaling changes a
            // layer's state with each step): one for each backward
            let layers = |side: &str| {
                let var = |shape: &[usize], seed: u64, scale: f32| {
                    Var::from_tensor(&randt(shape, seed, scale)).unwrap()
                };
                let vars = [
                    Var::from_tensor(&randt(&[d], 1, 0.3).affine(1.0, 1.0).unwrap()).unwrap(),
                    var(&[d], 2, 0.1),
                    var(&[d, d], 3, 0.3),
                    var(&[d], 4, 0.1),
                ];
                let t = |i: usize| vars[i].as_tensor().clone();
                let ln = nn::LayerNorm::new(t(0), t(1), 1e-5).unwrap();
                let name = format!("pg{m}{c}{side}.fc.weight");
                let fc = nn::Linear::new(name, t(2), Some(t(3))).unwrap();
                if with_sink {
                    fc.set_grad_sink(Some(GradSink::new())).unwrap();
                }
                (vars, ln, fc)
            };
            let (a, b) = (layers("a"), layers("b"));
            let what = format!("{mode:?} {dtype:?} sink {with_sink}");
            let x = Var::from_tensor(&randt(&[2, 5, d], 7, 1.0).to_dtype(dtype).unwrap()).unwrap();
            let r = randt(&[2, 5, d], 8, 1.0).to_dtype(dtype).unwrap();
            let loss = |(_, ln, fc): &(_, nn::LayerNorm, nn::Linear)| {
                let _s = fp8_autocast(true, mode.clone());
                // the LayerNorm, then the Linear applied twice
                let h = ln.try_forward(x.as_tensor()).unwrap();
                let y = fc.try_forward(&fc.try_forward(&h).unwrap()).unwrap();
                (y * &r).unwrap().sum_all().unwrap()
            };
            let plain = loss(&a).backward().unwrap();
            let (store, params) = nn::collect_param_grads(|| loss(&b).backward());
            let mut store = store.unwrap();
            let handed = params.len();
            assert!(handed > 0, "{what}: nothing handed over");
            // on the CPU the Linear runs its own op in every mode
            assert!(
                store.get(b.0[3].as_tensor()).is_none(),
                "{what}: the bias's gradient went to candle's store"
            );
            params.insert_into(&mut store).unwrap();
            let fp8_weight = with_sink && !matches!(mode, ComputeMode::Native);
            for (i, (va, vb)) in a.0.iter().zip(&b.0).enumerate() {
                if fp8_weight && i == 2 {
                    continue;
                }
                let (ga, gb) = (plain.get(va.as_tensor()), store.get(vb.as_tensor()));
                let (ga, gb) = (ga.expect("plain grad"), gb.expect("collected grad"));
                assert_eq!(values(ga), values(gb), "{what}: parameter {i}");
            }
            assert_eq!(
                values(plain.get(x.as_tensor()).expect("dx plain")),
                values(store.get(x.as_tensor()).expect("dx collected")),
                "{what}: dx"
            );
        }
    }
}
