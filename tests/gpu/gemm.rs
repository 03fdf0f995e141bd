//! The FP8 GEMM against a float64 product of the decoded inputs on the
//! same device (cuBLASLt on CUDA), its epilogue and output amax, and the
//! FP8 Linear's forward and backward against the CPU.

use crate::util::{rel_err, to_dev, Rng};
use amp::nn::{self, fp8_autocast, ComputeMode};
use amp::{
    fp8_gemm_acc, fp8_gemm_amax, fp8_gemm_fused, fp8_gemm_with, CurrentScaling, DelayedScaling,
    Epilogue, Format, QType, ScalingTensor,
};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Module, Tensor, Var};

test_device!(fp8_gemm, fp8_gemm_cuda);
test_device!(epilogue, epilogue_cuda);
test_device!(output_amax, output_amax_cuda);
test_device!(linear, linear_cuda);
test_device!(accumulate, accumulate_cuda);
test_device!(row_views, row_views_cuda);

fn quantized(
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    qtype: QType,
    dev: &Device,
) -> Result<ScalingTensor> {
    let x = Tensor::from_vec(rng.normal(rows * cols), (rows, cols), dev)?;
    Ok(ScalingTensor::quantize(&x, qtype, &CurrentScaling::default())?.0)
}

/// Shapes (aligned and not), format pairs, output dtypes, fast
/// accumulation, against a float64 product on the same device.
fn fp8_gemm(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(4242);
    let shapes = [
        (256, 512, 384),
        (100, 72, 40),
        (1024, 1024, 4096),
        (8, 16, 16),
        (333, 4096, 1000),
    ];
    let pairs = [
        (QType::E4M3, QType::E4M3),
        (QType::E5M2, QType::E4M3),
        (QType::E4M3, QType::E5M2),
        (QType::E5M2, QType::E5M2),
    ];
    for (m, k, n) in shapes {
        for (fa, fb) in pairs {
            let a = quantized(&mut rng, m, k, fa, dev)?;
            let b = quantized(&mut rng, n, k, fb, dev)?;
            // float64 reference: decoding is exact (power-of-two scales)
            let reference = a
                .dequantize(DType::F64)?
                .matmul(&b.dequantize(DType::F64)?.t()?)?;
            for out in [DType::BF16, DType::F32] {
                for fast in [false, true] {
                    let y = fp8_gemm_with(&a, &b, out, fast)?;
                    let nan = y
                        .to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .filter(|v| !v.is_finite())
                        .count();
                    let e = rel_err(&y, &reference)?;
                    // bf16 output rounding ~2e-3. F32 output: measured 1.0e-4 to
                    // 1.25e-4 without and 2.7e-4 to 3.4e-4 with fast accumulation
                    // (Hopper's FP8 tensor cores keep partial sums in less than
                    // f32; cuBLASLt promotes them to f32 now and then, or with
                    // FAST_ACCUM more rarely). The E5M2 x E5M2 fallback (decode,
                    // f32 matmul) lands at 1e-8.
                    let tol = match (out, fast) {
                        (DType::BF16, _) => 5e-3,
                        (_, false) => 5e-4,
                        (_, true) => 2e-3,
                    };
                    let pass = nan == 0 && e < tol && y.dims() == [m, n];
                    if !pass || (m, k, n) == (256, 512, 384) {
                        println!("  gemm {m}x{k}x{n} {fa} x {fb} -> {out:?} fast={fast}: rel err {e:.3e} (tol {tol:.0e}), non-finite {nan}");
                    }
                    ok &= pass;
                }
            }
        }
    }
    ensure!(ok, "FP8 GEMM out of tolerance (see the lines above)");
    Ok(())
}

/// The epilogue (`fp8_gemm_fused`: residual and BF16 bias added before the
/// BF16 output's one rounding; the residual a misaligned view): cuBLASLt's
/// epilogue at aligned shapes, the F32 product and two adds at a padded
/// one, against a float64 reference of the decoded operands plus the
/// addends, and against the CPU's result (the same inputs; only the
/// accumulation order differs).
fn epilogue(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(5151);
    for (m, k, n) in [(256, 512, 384), (8192, 1024, 3072), (100, 72, 40)] {
        let a = quantized(&mut rng, m, k, QType::E4M3, dev)?;
        let b = quantized(&mut rng, n, k, QType::E4M3, dev)?;
        let bias = Tensor::from_vec(rng.normal(n), n, dev)?.to_dtype(DType::BF16)?;
        // the residual a view one element into its buffer: not 16-byte
        // aligned, so the GEMM takes an aligned copy
        let res = (Tensor::from_vec(rng.normal(m * n + 1), m * n + 1, dev)? * 3.0)?
            .to_dtype(DType::BF16)?
            .narrow(0, 1, m * n)?
            .reshape((m, n))?;
        let product = a
            .dequantize(DType::F64)?
            .matmul(&b.dequantize(DType::F64)?.t()?)?;
        let (ac, bc) = (to_dev(&a, &Device::Cpu)?, to_dev(&b, &Device::Cpu)?);
        let (bias_c, res_c) = (bias.to_device(&Device::Cpu)?, res.to_device(&Device::Cpu)?);
        for (with_bias, with_res) in [(true, true), (true, false), (false, true)] {
            let epi = Epilogue {
                bias: with_bias.then_some(&bias),
                residual: with_res.then_some(&res),
            };
            let y = fp8_gemm_fused(&a, &b, DType::BF16, true, epi)?;
            let mut want = product.clone();
            if with_res {
                want = (want + res.to_dtype(DType::F64)?)?;
            }
            if with_bias {
                want = want.broadcast_add(&bias.to_dtype(DType::F64)?)?;
            }
            let epi_c = Epilogue {
                bias: with_bias.then_some(&bias_c),
                residual: with_res.then_some(&res_c),
            };
            let y_cpu = fp8_gemm_fused(&ac, &bc, DType::BF16, true, epi_c)?;
            let (e64, ecpu) = (rel_err(&y, &want)?, rel_err(&y, &y_cpu)?);
            let pass = e64 < 5e-3 && ecpu < 5e-3 && y.dims() == [m, n];
            println!(
                "  epilogue {m}x{k}x{n} bias {with_bias} residual {with_res}: rel err {e64:.3e} vs float64, {ecpu:.3e} vs CPU (tol 5e-3){}",
                if pass { "" } else { " FAILED" }
            );
            ok &= pass;
        }
    }
    ensure!(ok, "GEMM epilogue out of tolerance (see the lines above)");
    Ok(())
}

/// `fp8_gemm_amax` at the GPT's weight-gradient shapes (E5M2 dy x E4M3
/// x, F32 and BF16 out) and a padded one: the amax equals the bits of the
/// current-scaling cast's amax over that output, and an operand whose cast
/// saw inf gives NaN.
fn output_amax(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(6161);
    let cases = [
        (2304, 8192, 768, DType::F32),
        (768, 8192, 3072, DType::BF16),
        (100, 72, 40, DType::F32),
    ];
    for (m, k, n, out) in cases {
        let a = quantized(&mut rng, m, k, QType::E5M2, dev)?;
        let b = quantized(&mut rng, n, k, QType::E4M3, dev)?;
        let (y, amax) = fp8_gemm_amax(&a, &b, out, false)?;
        let (_, want) = ScalingTensor::quantize(&y, QType::E4M3, &CurrentScaling::default())?;
        let (got, want) = (amax.to_vec1::<f32>()?[0], want.to_vec1::<f32>()?[0]);
        let mut x = rng.normal(m * k);
        x[7] = f32::INFINITY;
        let bad = ScalingTensor::quantize(
            &Tensor::from_vec(x, (m, k), dev)?,
            QType::E5M2,
            &CurrentScaling::default(),
        )?
        .0;
        let nan = fp8_gemm_amax(&bad, &b, DType::F32, false)?
            .1
            .to_vec1::<f32>()?[0];
        let pass = got.to_bits() == want.to_bits() && nan.is_nan();
        println!(
            "  output amax {m}x{k}x{n} -> {out:?}: {got:e} vs {want:e} from the output; inf operand: {nan}{}",
            if pass { "" } else { " FAILED" }
        );
        ok &= pass;
    }
    ensure!(ok, "GEMM output amax wrong (see the lines above)");
    Ok(())
}

/// One layer, three steps of delayed scaling (HYBRID: E4M3 forward, E5M2
/// backward), on the device and on the CPU from the same data: output,
/// input gradient and weight gradient must agree to the GEMMs' rounding.
/// The loss is `sum(y * r)` for a fixed `r`, so both devices cast the same
/// output gradient (with `y`'s own gradient, the E5M2 codes of dy would
/// flip wherever the two devices' y differ by a rounding, 12-25% on that
/// element).
fn linear(dev: &Device) -> Result<()> {
    let mut rng = Rng(7);
    let (m, k, n) = (512, 768, 1024);
    let xs = rng.normal(m * k);
    let ws: Vec<f32> = rng.normal(n * k).iter().map(|v| v * 0.05).collect();
    let rs = rng.normal(m * n);
    let mut ok = true;
    let mut outs: Vec<Vec<Tensor>> = Vec::new();
    for d in [dev, &Device::Cpu] {
        let w = Var::from_tensor(&Tensor::from_vec(ws.clone(), (n, k), d)?)?;
        let layer = nn::Linear::new("fc", w.as_tensor().clone(), None)?;
        let mode = ComputeMode::Fp8Delayed(DelayedScaling {
            fp8_format: Format::Hybrid,
            ..Default::default()
        });
        let mut got = Vec::new();
        for step in 0..3 {
            let x = Var::from_tensor(
                &(Tensor::from_vec(xs.clone(), (m, k), d)? * (1.0 + step as f64))?,
            )?;
            let _scope = fp8_autocast(true, mode.clone());
            let y = layer.forward(x.as_tensor())?;
            let loss = (&y * Tensor::from_vec(rs.clone(), (m, n), d)?)?.sum_all()?;
            let grads = loss.backward()?;
            let dx = grads
                .get(x.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no dx"))?
                .clone();
            let dw = grads
                .get(w.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no dw"))?
                .clone();
            got.extend([y, dx, dw]);
        }
        outs.push(got);
    }
    for (i, (g, c)) in outs[0].iter().zip(&outs[1]).enumerate() {
        let e = rel_err(g, c)?;
        let what = ["y", "dx", "dw"][i % 3];
        println!(
            "  linear step {} {what}: rel err device vs cpu {e:.3e}",
            i / 3
        );
        ok &= e < 2e-3;
    }
    ensure!(ok, "FP8 Linear differs from the CPU (see the lines above)");
    Ok(())
}

/// `fp8_gemm_acc` (cuBLASLt's C with beta = 1) at the chunked head's
/// weight-gradient shapes (GPT's vocabulary 50,304 x width 768 over chunks
/// of 2,048 to 8,192 rows, E5M2 logit gradients x E4M3 inputs) and a
/// small one, with and without the F32 accumulator, against a float64
/// product plus the accumulator on the same device.
fn accumulate(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(0xacc);
    for (m, n, k) in [
        (50304, 768, 4096),
        (50304, 768, 2048),
        (50304, 768, 8192),
        (1024, 256, 512),
    ] {
        let a = quantized(&mut rng, m, k, QType::E5M2, dev)?;
        let b = quantized(&mut rng, n, k, QType::E4M3, dev)?;
        let acc = Tensor::from_vec(rng.normal(m * n), (m, n), dev)?;
        let product = a
            .dequantize(DType::F64)?
            .matmul(&b.dequantize(DType::F64)?.t()?)?;
        let with = (&product + acc.to_dtype(DType::F64)?)?;
        let errs = [
            ("alone", rel_err(&fp8_gemm_acc(&a, &b, None)?, &product)?),
            (
                "with acc",
                rel_err(&fp8_gemm_acc(&a, &b, Some(&acc))?, &with)?,
            ),
            // twice in a row: the second run reuses the first's plan
            ("again", rel_err(&fp8_gemm_acc(&a, &b, Some(&acc))?, &with)?),
        ];
        ok &= crate::util::report(&format!("accumulated gemm {m}x{n}, k {k}"), &errs, 5e-4);
    }
    ensure!(ok, "fp8_gemm_acc out of tolerance (see the lines above)");
    Ok(())
}

/// The chunked head's logits: an FP8 GEMM over a view of some rows of the
/// input's codes (an offset into its storage), BF16 out with fast
/// accumulation, against the same rows of the whole product and a float64
/// reference, at GPT-125M's head shape (8,192 x 768 by 50,304).
fn row_views(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(0x0ff5);
    let (rows, k, n) = (8192, 768, 50304);
    let x = quantized(&mut rng, rows, k, QType::E4M3, dev)?;
    let w = quantized(&mut rng, n, k, QType::E4M3, dev)?;
    let whole = fp8_gemm_with(&x, &w, DType::BF16, true)?;
    for chunk in [4096, 2048] {
        for start in (0..rows).step_by(chunk) {
            let part =
                ScalingTensor::from_parts(x.data().narrow(0, start, chunk)?, x.meta().clone())?;
            let y = fp8_gemm_with(&part, &w, DType::BF16, true)?;
            let reference = part
                .dequantize(DType::F64)?
                .matmul(&w.dequantize(DType::F64)?.t()?)?;
            let errs = [
                ("vs float64", rel_err(&y, &reference)?),
                (
                    "vs the whole's rows",
                    rel_err(&y, &whole.narrow(0, start, chunk)?)?,
                ),
            ];
            ok &= crate::util::report(&format!("rows {start}..+{chunk}"), &errs, 5e-3);
        }
    }
    ensure!(ok, "row views out of tolerance (see the lines above)");
    Ok(())
}
