//! The casts' amaxes taken from their tensors' producers
//! (`amp::nn::set_producer_amax`): the output gradient's from the bias
//! gradient's column sums, the input's from the GELU the Linear applies to
//! it or from the LayerNorm handed to it (`Fuse::norm`). A Linear's output
//! and gradients (input, weight, bias; the LayerNorm's too) bit for bit
//! those of the separate passes on the same device,
//! under current scaling, for BF16 and F32 activations, rows that take the
//! 8-column path and odd ones that do not, and an output gradient holding
//! inf (the flagged cast); with Transformer Engine's scale rule too (a
//! power-of-two scale hides an amax off by a power of two).

use crate::util::same;
use amp::nn::{self, fp8_autocast, Activation, ComputeMode, Fuse};
use amp::{CurrentScaling, ScaleRule};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

test_device!(producer_amax, producer_amax_cpu, producer_amax_cuda);

/// What the Linear applies to its input inside its op.
#[derive(Clone, Copy, Debug)]
enum Before {
    Nothing,
    Gelu,
    /// The LayerNorm, handed to the op.
    Norm,
}

/// The output and the gradients of `sum(layer(before(x)) * r)` with the
/// switch at `fused`: y, x's gradient, then the variables' (the layer's,
/// the LayerNorm's) in name order.
#[allow(clippy::too_many_arguments)]
fn grads(
    layer: &nn::Linear,
    norm: &nn::LayerNorm,
    varmap: &VarMap,
    x: &Var,
    r: &Tensor,
    rule: ScaleRule,
    before: Before,
    fused: bool,
) -> Result<Vec<(String, Tensor)>> {
    let was = nn::producer_amax();
    nn::set_producer_amax(fused);
    let store = {
        let recipe = CurrentScaling {
            scale_rule: rule,
            ..Default::default()
        };
        let _s = fp8_autocast(true, ComputeMode::Fp8Current(recipe));
        let y = match before {
            Before::Gelu => layer.forward_with(
                x.as_tensor(),
                Fuse {
                    activation: Some(Activation::Gelu),
                    ..Default::default()
                },
            )?,
            Before::Norm => layer.forward_with(
                x.as_tensor(),
                Fuse {
                    norm: Some(norm),
                    ..Default::default()
                },
            )?,
            Before::Nothing => layer.forward(x.as_tensor())?,
        };
        let loss = (y.to_dtype(DType::F32)? * r)?.sum_all()?;
        loss.backward().map(|g| (y, g))
    };
    nn::set_producer_amax(was);
    let (y, store) = store?;
    let mut out = vec![("y".to_string(), y)];
    if let Some(g) = store.get(x.as_tensor()) {
        out.push(("x".to_string(), g.clone()));
    }
    let vars = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned varmap"))?
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect::<std::collections::BTreeMap<_, _>>();
    for (name, var) in vars {
        if let Some(g) = store.get(var.as_tensor()) {
            out.push((name, g.clone()));
        }
    }
    Ok(out)
}

fn producer_amax(dev: &Device) -> Result<()> {
    // the switch is process-wide: the CPU and CUDA runs of this body one
    // at a time, so that each run's "apart" pass has it off
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut ok = true;
    for (m, inp, out, dtype, poison) in [
        (64usize, 128usize, 48usize, DType::BF16, false),
        (33, 40, 17, DType::BF16, false),
        (64, 128, 48, DType::F32, false),
        (40, 64, 24, DType::BF16, true),
    ] {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
        let layer = nn::linear(inp, out, vb.pp("fc"))?;
        let norm = nn::layer_norm(inp, 1e-5, vb.pp("ln"))?;
        // a bias that is not zero, so its gradient path is the layer's own
        for var in varmap.all_vars() {
            if var.dims().len() == 1 {
                var.set(&Tensor::randn(0f32, 0.1, var.dims(), &Device::Cpu)?.to_device(dev)?)?;
            }
        }
        let x = Tensor::randn(0f32, 1.0, (m, inp), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let x = Var::from_tensor(&x)?;
        let mut r = Tensor::randn(0f32, 1.0, (m, out), &Device::Cpu)?;
        if poison {
            let mut v = r.flatten_all()?.to_vec1::<f32>()?;
            v[5] = f32::INFINITY;
            r = Tensor::from_vec(v, (m, out), &Device::Cpu)?;
        }
        let r = r.to_device(dev)?;
        for rule in [ScaleRule::PowerOfTwo, ScaleRule::Te] {
            for before in [Before::Nothing, Before::Gelu, Before::Norm] {
                let apart = grads(&layer, &norm, &varmap, &x, &r, rule, before, false)?;
                let fused = grads(&layer, &norm, &varmap, &x, &r, rule, before, true)?;
                let want = if matches!(before, Before::Norm) { 6 } else { 4 };
                ensure!(
                    apart.len() == fused.len() && apart.len() == want,
                    "the output, and x's and every variable's gradient ({before:?})"
                );
                for ((name, a), (_, f)) in apart.iter().zip(&fused) {
                    let what = format!(
                        "{m}x{inp}->{out} {dtype:?} inf {poison} {rule:?} {before:?}: {name}"
                    );
                    ok &= same(&what, f, a)?;
                }
            }
        }
    }
    ensure!(
        ok,
        "the fused pass changed a gradient (see the lines above)"
    );
    Ok(())
}
