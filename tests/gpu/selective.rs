//! `amp::nn::selective` on the device: a transformer block (flash
//! attention on CUDA, head dimension 64) gives the gradients of the block
//! that keeps its FP8 codes, bit for bit, with the codes cast again by the
//! device's cast-transpose from the forward's scales; on CUDA no Linear
//! keeps codes (flash attention keeps the projection's input).

use crate::util::Rng;
use amp::nn::{self, fp8_autocast, selective, ComputeMode, GradSink, LayerNorm, Linear};
use amp::{CurrentScaling, DelayedScaling};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

struct Block {
    ln_1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln_2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

const D: usize = 128;

/// One step of the block on `dev` (BF16 activations), under `selective`
/// or not: every gradient (the sink's dequantized) as F32 bits, and the
/// bytes each Linear kept.
fn step(dev: &Device, mode: &ComputeMode, sel: bool) -> Result<(Vec<Vec<u32>>, Vec<usize>)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
    let b = Block {
        ln_1: nn::layer_norm(D, 1e-5, vb.pp("ln_1"))?,
        qkv: nn::linear(D, 3 * D, vb.pp("qkv"))?,
        proj: nn::linear(D, D, vb.pp("proj"))?,
        ln_2: nn::layer_norm(D, 1e-5, vb.pp("ln_2"))?,
        fc1: nn::linear(D, 4 * D, vb.pp("fc1"))?,
        fc2: nn::linear(4 * D, D, vb.pp("fc2"))?,
    };
    let names = crate::util::seed_vars(&varmap, 500, 0.5, dev)?;
    let sink = GradSink::new();
    let linears = [&b.qkv, &b.proj, &b.fc1, &b.fc2];
    for l in linears {
        l.set_grad_sink(Some(sink.clone()))?;
    }
    let shape = (2, 64, D);
    let x = Tensor::from_vec(Rng(81).normal(2 * 64 * D), shape, dev)?;
    let x = Var::from_tensor(&x.to_dtype(DType::BF16)?)?;
    let r = Tensor::from_vec(Rng(82).normal(2 * 64 * D), shape, dev)?;
    let _scope = fp8_autocast(true, mode.clone());
    let forward = || -> Result<Tensor> {
        let h = nn::causal_self_attention(x.as_tensor(), &b.ln_1, &b.qkv, &b.proj, 2)?;
        Ok(nn::pre_norm_mlp(&h, &b.ln_2, &b.fc1, &b.fc2, true)?)
    };
    let y = if sel { selective(forward)? } else { forward()? };
    let kept = linears
        .iter()
        .map(|l| l.saved_bytes())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let loss = y.to_dtype(DType::F32)?.mul(&r)?.sum_all()?;
    let grads = loss.backward()?;
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        Ok(v.iter().map(|f| f.to_bits()).collect())
    };
    let mut got = Vec::new();
    for name in &names {
        let v = varmap.data().lock().unwrap()[name].clone();
        if let Some(g) = grads.get(v.as_tensor()) {
            got.push(bits(g)?);
        }
    }
    got.push(bits(grads.get(x.as_tensor()).expect("x's gradient"))?);
    let mut sunk: Vec<_> = sink.take()?.into_iter().collect();
    sunk.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, g) in sunk {
        got.push(bits(&g.dequantize(DType::F32)?)?);
    }
    Ok((got, kept))
}

fn selective_block(dev: &Device) -> Result<()> {
    let modes = [
        ComputeMode::Fp8Current(CurrentScaling::default()),
        ComputeMode::Fp8Delayed(DelayedScaling {
            amax_history_len: 4,
            ..Default::default()
        }),
    ];
    for mode in modes {
        let ((all, kept_all), (sel, kept_sel)) =
            (step(dev, &mode, false)?, step(dev, &mode, true)?);
        anyhow::ensure!(all.len() == sel.len(), "{mode:?}: gradients");
        for (i, (a, s)) in all.iter().zip(&sel).enumerate() {
            anyhow::ensure!(a == s, "{mode:?}: gradient {i} differs under selective");
        }
        anyhow::ensure!(kept_all.iter().all(|&k| k > 0), "{kept_all:?}");
        // CUDA: flash attention keeps its output, so the projection keeps
        // no codes either; the CPU's materialized attention does not
        let proj = usize::from(!dev.is_cuda());
        anyhow::ensure!(
            kept_sel
                .iter()
                .enumerate()
                .all(|(i, &k)| (k == 0) == (i != 1 || proj == 0)),
            "{mode:?}: {kept_sel:?}"
        );
    }
    Ok(())
}

test_device!(selective_block, selective_block_cpu, selective_block_cuda);
