//! `amp::nn::recompute`: a block recomputed in backward gives the
//! gradients, and the FP8 weight gradients its sinks receive, of the block
//! run once; a variable the block reads without naming it is an error.

use crate::common;

use amp::nn::{self, fp8_autocast, recompute, ComputeMode, GradSink, LayerNorm, Linear};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{modes, randt, values};

/// `fc2(gelu(fc1(ln(x)))) + x`.
#[derive(Clone)]
struct Block {
    ln: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn new(vb: VarBuilder) -> Block {
        Block {
            ln: nn::layer_norm(8, 1e-5, vb.pp("ln")).unwrap(),
            fc1: nn::linear(8, 32, vb.pp("fc1")).unwrap(),
            fc2: nn::linear(32, 8, vb.pp("fc2")).unwrap(),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor, amp::CoreError> {
        let h = self.fc1.forward(&self.ln.forward(x)?)?;
        Ok((self.fc2.forward(&nn::gelu(&h)?)? + x)?)
    }

    fn vars(&self) -> Vec<Tensor> {
        let mut v = self.ln.vars();
        v.extend(self.fc1.vars().unwrap());
        v.extend(self.fc2.vars().unwrap());
        v
    }
}

/// Two blocks with fresh layers (their own FP8 scaling state) over
/// parameters that are the same in every call, their FP8 weight gradients
/// to one sink where `with_sinks`.
fn two_blocks(with_sinks: bool) -> (VarMap, [Block; 2], GradSink) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let blocks = [Block::new(vb.pp("a")), Block::new(vb.pp("b"))];
    common::seed_varmap(&varmap, 200, 0.5);
    let sink = GradSink::new();
    if with_sinks {
        for b in &blocks {
            b.fc1.set_grad_sink(Some(sink.clone())).unwrap();
            b.fc2.set_grad_sink(Some(sink.clone())).unwrap();
        }
    }
    (varmap, blocks, sink)
}

/// Every gradient of one step of the two blocks (recomputed with
/// `again`), by name: the `GradStore`'s, `x`'s and the sink's (as F32).
fn step(mode: &ComputeMode, with_sinks: bool, again: bool) -> Vec<(String, Vec<f32>)> {
    let (varmap, blocks, sink) = two_blocks(with_sinks);
    let x = Var::from_tensor(&randt(&[6, 8], 91, 1.0)).unwrap();
    let r = randt(&[6, 8], 92, 1.0);
    let _scope = fp8_autocast(true, mode.clone());
    let mut h = x.as_tensor().clone();
    for b in &blocks {
        h = if again {
            let blk = b.clone();
            recompute(&h, &b.vars(), move |x| blk.forward(x)).unwrap()
        } else {
            b.forward(&h).unwrap()
        };
    }
    let grads = (h * &r).unwrap().sum_all().unwrap().backward().unwrap();
    named_grads(&varmap, &grads, &x, &sink)
}

/// Every gradient of a step by name, sorted: the `GradStore`'s of
/// `varmap`'s variables, `x`'s, and the sink's (as F32, named `NAME
/// (sink)`).
pub(crate) fn named_grads(
    varmap: &VarMap,
    grads: &candle_core::backprop::GradStore,
    x: &Var,
    sink: &GradSink,
) -> Vec<(String, Vec<f32>)> {
    let mut got: Vec<(String, Vec<f32>)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(n, v)| grads.get(v.as_tensor()).map(|g| (n.clone(), values(g))))
        .collect();
    got.push(("x".into(), values(grads.get(x.as_tensor()).unwrap())));
    got.extend(sink.take().unwrap().into_iter().map(|(n, g)| {
        (
            format!("{n} (sink)"),
            values(&g.dequantize(DType::F32).unwrap()),
        )
    }));
    got.sort_by(|a, b| a.0.cmp(&b.0));
    got
}

#[test]
fn a_recomputed_block_has_the_gradients_of_the_block_run_once() {
    for mode in modes() {
        for with_sinks in [false, true] {
            let (once, again) = (
                step(&mode, with_sinks, false),
                step(&mode, with_sinks, true),
            );
            let what = format!("{mode:?}, sinks {with_sinks}");
            assert_eq!(
                once.iter().map(|g| &g.0).collect::<Vec<_>>(),
                again.iter().map(|g| &g.0).collect::<Vec<_>>(),
                "{what}: the gradients' names"
            );
            // 2 x (LayerNorm 2, biases 2, weights 2 in the store or the sink), x
            assert_eq!(once.len(), 13, "{what}: {once:?}");
            for ((name, a), (_, b)) in once.iter().zip(&again) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(b), "{what}: {name}");
            }
        }
    }
}

#[test]
fn a_variable_the_block_does_not_name_is_an_error_not_a_lost_gradient() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let block = Block::new(vb.pp("a"));
    let scale = Var::from_tensor(&Tensor::new(&[2f32], &Device::Cpu).unwrap()).unwrap();
    let x = Var::from_tensor(&randt(&[6, 8], 93, 1.0)).unwrap();
    let (b, s) = (block.clone(), scale.as_tensor().clone());
    let y = recompute(x.as_tensor(), &block.vars(), move |x| {
        Ok(b.forward(x)?.broadcast_mul(&s)?)
    })
    .unwrap();
    let err = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("not among its parameters"), "{err}");
}

#[test]
fn with_nothing_tracked_it_is_the_plain_forward() {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let block = Block::new(vb.pp("a"));
    let x = randt(&[6, 8], 94, 1.0);
    let plain = block.forward(&x).unwrap();
    let b = block.clone();
    // the parameters passed as plain tensors: nothing to backpropagate to
    let consts: Vec<Tensor> = block.vars().iter().map(Tensor::detach).collect();
    let y = recompute(&x, &consts, move |x| b.forward(x)).unwrap();
    assert_eq!(values(&plain), values(&y));
}
