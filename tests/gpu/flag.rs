//! The FP8 Linear's non-finite flag (`scaling/flag.rs`): a saturating cast
//! turns inf into the format's max, so an inf or NaN in a Linear's input
//! must still make its output NaN, and one in its output gradient its
//! input and weight gradients, never finite from a saturated code. Under
//! current scaling the cast kernel itself multiplies the flag into the
//! scale_inv it writes; under delayed scaling a launch of its own does.
//! Both devices, BF16 and F32 inputs, with and without a bias; a finite
//! input's values are unchanged by the flag (the GPT runs' identical
//! validation losses show it; here: every output finite).

use amp::nn::{self, fp8_autocast, ComputeMode};
use amp::{CurrentScaling, DelayedScaling, ScaleRule};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};

test_device!(non_finite_flag, non_finite_flag_cpu, non_finite_flag_cuda);

/// `m x cols` normal values with `bad` at element `at` where given.
fn values(
    m: usize,
    cols: usize,
    at: Option<(usize, f32)>,
    dev: &Device,
    dtype: DType,
) -> Result<Tensor> {
    let mut v = Tensor::randn(0f32, 1.0, (m, cols), &Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if let Some((i, bad)) = at {
        v[i] = bad;
    }
    Ok(Tensor::from_vec(v, (m, cols), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)?)
}

fn all(t: &Tensor, f: fn(f32) -> bool) -> Result<bool> {
    Ok(t.to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .all(f))
}

fn non_finite_flag(dev: &Device) -> Result<()> {
    let (m, inp, out) = (48usize, 64usize, 40usize);
    let modes = [
        ComputeMode::Fp8Current(CurrentScaling::default()),
        ComputeMode::Fp8Current(CurrentScaling {
            scale_rule: ScaleRule::Te,
            ..Default::default()
        }),
        ComputeMode::Fp8Delayed(DelayedScaling::default()),
    ];
    let mut failed = Vec::new();
    for dtype in [DType::BF16, DType::F32] {
        for bias in [true, false] {
            for mode in &modes {
                for bad in [f32::INFINITY, f32::NAN] {
                    let varmap = VarMap::new();
                    let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
                    let layer = match bias {
                        true => nn::linear(inp, out, vb.pp("fc"))?,
                        false => nn::linear_no_bias(inp, out, vb.pp("fc"))?,
                    };
                    let what = format!("{dtype:?} bias {bias} {mode:?} {bad}");
                    let _s = fp8_autocast(true, mode.clone());
                    // the input: finite, then with one bad element
                    let x = Var::from_tensor(&values(m, inp, None, dev, dtype)?)?;
                    let y = layer.forward(x.as_tensor())?;
                    if !all(&y, f32::is_finite)? {
                        failed.push(format!("{what}: finite input, output not finite"));
                    }
                    let xb = values(m, inp, Some((7 * inp + 3, bad)), dev, dtype)?;
                    if !all(&layer.forward(&xb)?, f32::is_nan)? {
                        failed.push(format!("{what}: bad input, output not all NaN"));
                    }
                    // the output gradient with one bad element
                    let rb = values(m, out, Some((5, bad)), dev, DType::F32)?;
                    let grads = (y.to_dtype(DType::F32)? * &rb)?.sum_all()?.backward()?;
                    let gx = grads
                        .get(x.as_tensor())
                        .ok_or_else(|| anyhow::anyhow!("no dx"))?;
                    if !all(gx, f32::is_nan)? {
                        failed.push(format!("{what}: bad output gradient, dx not all NaN"));
                    }
                    let w = varmap
                        .all_vars()
                        .into_iter()
                        .find(|v| v.dims().len() == 2)
                        .ok_or_else(|| anyhow::anyhow!("no weight"))?;
                    match grads.get(w.as_tensor()) {
                        Some(gw) if !all(gw, |v| !v.is_finite())? => {
                            failed.push(format!("{what}: bad output gradient, dw finite somewhere"))
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    for f in &failed {
        println!("FAIL {f}");
    }
    ensure!(
        failed.is_empty(),
        "{} flag checks failed (above)",
        failed.len()
    );
    Ok(())
}
