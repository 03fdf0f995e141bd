//! `amp::nn::selective`: a transformer block's Linears keep no FP8 codes
//! (cast again in backward from tensors kept anyway) and its attention no
//! probabilities, with the gradients, and the FP8 weight gradients its
//! sinks receive, of the block that keeps them, bit for bit.

use crate::common;

use crate::recompute::named_grads;
use amp::nn::{self, fp8_autocast, selective, ComputeMode, GradSink, LayerNorm, Linear};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use common::{modes, randt};

/// A pre-LayerNorm transformer block, as the GPT example's.
struct Block {
    ln_1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln_2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

impl Block {
    fn forward(&self, h: &Tensor) -> Tensor {
        let h = nn::causal_self_attention(h, &self.ln_1, &self.qkv, &self.proj, 2).unwrap();
        nn::pre_norm_mlp(&h, &self.ln_2, &self.fc1, &self.fc2, true).unwrap()
    }

    fn linears(&self) -> [&Linear; 4] {
        [&self.qkv, &self.proj, &self.fc1, &self.fc2]
    }
}

/// A block with parameters the same in every call, its FP8 weight
/// gradients to a sink.
fn block() -> (VarMap, Block, GradSink) {
    let (d, varmap) = (16, VarMap::new());
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let b = Block {
        ln_1: nn::layer_norm(d, 1e-5, vb.pp("ln_1")).unwrap(),
        qkv: nn::linear(d, 3 * d, vb.pp("qkv")).unwrap(),
        proj: nn::linear(d, d, vb.pp("proj")).unwrap(),
        ln_2: nn::layer_norm(d, 1e-5, vb.pp("ln_2")).unwrap(),
        fc1: nn::linear(d, 4 * d, vb.pp("fc1")).unwrap(),
        fc2: nn::linear(4 * d, d, vb.pp("fc2")).unwrap(),
    };
    common::seed_varmap(&varmap, 300, 0.5);
    let sink = GradSink::new();
    for l in b.linears() {
        l.set_grad_sink(Some(sink.clone())).unwrap();
    }
    (varmap, b, sink)
}

/// Every gradient of one step (named; the sink's as F32) and the bytes
/// each Linear kept, with the block run under `selective` or not.
fn step(mode: &ComputeMode, dtype: DType, sel: bool) -> (Vec<(String, Vec<f32>)>, Vec<usize>) {
    let (varmap, b, sink) = block();
    let x = Var::from_tensor(&randt(&[2, 8, 16], 71, 1.0).to_dtype(dtype).unwrap()).unwrap();
    let r = randt(&[2, 8, 16], 72, 1.0).to_dtype(dtype).unwrap();
    let _scope = fp8_autocast(true, mode.clone());
    let y = if sel {
        selective(|| b.forward(x.as_tensor()))
    } else {
        b.forward(x.as_tensor())
    };
    let kept = b.linears().map(|l| l.saved_bytes().unwrap()).to_vec();
    let grads = (y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    (named_grads(&varmap, &grads, &x, &sink), kept)
}

#[test]
fn a_selective_block_keeps_no_codes_and_has_the_same_gradients() {
    for mode in modes() {
        for dtype in [DType::F32, DType::BF16] {
            let what = format!("{mode:?} {dtype:?}");
            let ((all, kept_all), (sel, kept_sel)) =
                (step(&mode, dtype, false), step(&mode, dtype, true));
            assert_eq!(all.len(), sel.len(), "{what}");
            for ((name, a), (_, b)) in all.iter().zip(&sel) {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(a), bits(b), "{what}: {name}");
            }
            if mode == ComputeMode::Native {
                continue;
            }
            // without: every Linear keeps its weight's codes and more
            let weights: Vec<usize> = [3, 1, 4, 4].iter().map(|k| k * 16 * 16).collect();
            assert!(
                kept_all.iter().zip(&weights).all(|(k, w)| k > w),
                "{what}: {kept_all:?}"
            );
            // qkv, fc1 and fc2 keep nothing; the projection its input's
            // codes (16 rows x 16, and their scales: 16 of them for block
            // scaling's 1 x 128 tiles of xᵀ), as the materialized
            // attention does not keep its output on the CPU
            assert_eq!([kept_sel[0], kept_sel[2], kept_sel[3]], [0; 3], "{what}");
            assert!(
                (256..=256 + 64).contains(&kept_sel[1]),
                "{what}: {kept_sel:?}"
            );
        }
    }
}
