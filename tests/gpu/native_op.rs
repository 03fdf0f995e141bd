//! O0's native products through the layers' op on the device
//! (`amp::nn::set_native_op_on_cuda`): a transformer block with BF16
//! activations (flash attention on CUDA) gives candle's matmul path's
//! output and gradients to BF16's rounding, and keeps less for backward.
//! On the CPU the op is the only native path, so both runs are the same.

use crate::util::{rel_err, report, Rng};
use amp::nn::{self, fp8_autocast, ComputeMode, LayerNorm, Linear};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

const D: usize = 128;

/// One native step of the block on `dev`, the op's path on CUDA or not:
/// the output and every gradient (F32), and the bytes the Linears kept.
fn step(dev: &Device, op: bool) -> Result<(Vec<Tensor>, usize)> {
    nn::set_native_op_on_cuda(op);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
    let (ln_1, qkv, proj): (LayerNorm, Linear, Linear) = (
        nn::layer_norm(D, 1e-5, vb.pp("ln_1"))?,
        nn::linear(D, 3 * D, vb.pp("qkv"))?,
        nn::linear(D, D, vb.pp("proj"))?,
    );
    let (ln_2, fc1, fc2) = (
        nn::layer_norm(D, 1e-5, vb.pp("ln_2"))?,
        nn::linear(D, 4 * D, vb.pp("fc1"))?,
        nn::linear(4 * D, D, vb.pp("fc2"))?,
    );
    let names = crate::util::seed_vars(&varmap, 700, 0.3, dev)?;
    let shape = (2, 64, D);
    let x = Tensor::from_vec(Rng(91).normal(2 * 64 * D), shape, dev)?;
    let x = Var::from_tensor(&x.to_dtype(DType::BF16)?)?;
    let r = Tensor::from_vec(Rng(92).normal(2 * 64 * D), shape, dev)?;
    let y = {
        let _scope = fp8_autocast(true, ComputeMode::Native);
        let h = nn::causal_self_attention(x.as_tensor(), &ln_1, &qkv, &proj, 2)?;
        nn::pre_norm_mlp(&h, &ln_2, &fc1, &fc2, true)?
    };
    let kept = [&qkv, &proj, &fc1, &fc2]
        .iter()
        .map(|l| l.saved_bytes())
        .sum::<std::result::Result<usize, _>>()?;
    let grads = crate::util::backward(&y, &r)?;
    let mut out = vec![y.to_dtype(DType::F32)?];
    for name in &names {
        let v = varmap.data().lock().unwrap()[name].clone();
        out.push(crate::util::g(&grads, &v)?.to_dtype(DType::F32)?);
    }
    out.push(crate::util::g(&grads, &x)?.to_dtype(DType::F32)?);
    nn::set_native_op_on_cuda(true); // the default
    Ok((out, kept))
}

fn native_op_block(dev: &Device) -> Result<()> {
    let ((graph, kept_graph), (op, kept_op)) = (step(dev, false)?, step(dev, true)?);
    anyhow::ensure!(graph.len() == op.len(), "gradients");
    let errs = graph
        .iter()
        .zip(&op)
        .map(|(g, o)| rel_err(o, g))
        .collect::<Result<Vec<_>>>()?;
    let named: Vec<(&str, f64)> = errs.iter().map(|&e| ("tensor", e)).collect();
    // BF16 products and a BF16 output: a few BF16 roundings apart
    anyhow::ensure!(
        report("native op against candle's matmul", &named, 2e-2),
        "{errs:?}"
    );
    if dev.is_cuda() {
        // candle's graph reports nothing kept; the op keeps each GEMM's
        // input and weight (BF16)
        anyhow::ensure!(kept_graph == 0 && kept_op > 0, "{kept_graph} {kept_op}");
    } else {
        anyhow::ensure!(errs.iter().all(|&e| e == 0.0), "{errs:?}");
    }
    Ok(())
}

test_device!(native_op_block, native_op_block_cpu, native_op_block_cuda);
