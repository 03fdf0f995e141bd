//! Block-scaled casts on CUDA against the CPU bodies bit for bit (every
//! tiling, format and input dtype, tails, zero, NaN and inf tiles), and the
//! block-scaled GEMM (cuBLASLt's 1x128 / 128x128 / rowwise scale modes)
//! against a float64 product of the decoded operands, with scales that
//! differ from tile to tile by up to 2^24.

use crate::util::{same, Rng};
use amp::{
    block_gemm, block_gemm_fused, BlockTensor, CurrentScaling, Epilogue, QType, ScaleRule,
    ScalingTensor, Tiling,
};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

test_device!(block_casts, block_casts_cuda);
test_device!(block_gemm_f64, block_gemm_cuda);
test_device!(block_epilogue, block_epilogue_cuda);
test_device!(block_scaled_weight, block_scaled_weight_cuda);

/// `[rows, cols]` normal values times 2^(-12..12), the power changing every
/// 97 elements (so tiles get scales far apart), and with `specials` a zero
/// 1 x 128 tile, a NaN and an infinity.
fn spread(rng: &mut Rng, rows: usize, cols: usize, specials: bool) -> Vec<f32> {
    let mut v: Vec<f32> = rng
        .normal(rows * cols)
        .into_iter()
        .enumerate()
        .map(|(i, x)| x * 2f32.powi(((i / 97) % 25) as i32 - 12))
        .collect();
    if specials && rows * cols > 600 {
        v[..128.min(cols)].iter_mut().for_each(|x| *x = 0.0);
        v[300] = f32::NAN;
        v[rows * cols - 1] = f32::INFINITY;
    }
    v
}

// (144, 300) and (272, 200): xᵀ's 16-byte stores (rows % 16 == 0) beside
// element loads and a short last tile of 16-byte loads.
const SHAPES: [(usize, usize); 8] = [
    (1, 1),
    (3, 129),
    (130, 257),
    (256, 1024),
    (1000, 4096),
    (7, 5000),
    (144, 300),
    (272, 200),
];
const TILINGS: [Tiling; 3] = [Tiling::Vec128, Tiling::Blk128, Tiling::Row];

fn block_casts(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(77);
    for (rows, cols) in SHAPES {
        let x = Tensor::from_vec(
            spread(&mut rng, rows, cols, true),
            (rows, cols),
            &Device::Cpu,
        )?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let xd = x.to_dtype(dtype)?;
            for tiling in TILINGS {
                for qtype in [QType::E4M3, QType::E5M2] {
                    for rule in [ScaleRule::PowerOfTwo, ScaleRule::Te] {
                        let what = format!("[{rows}, {cols}] {dtype:?} {tiling} {qtype} {rule:?}");
                        let cpu = BlockTensor::quantize(&xd, qtype, tiling, rule)?;
                        let gpu = BlockTensor::quantize(&xd.to_device(dev)?, qtype, tiling, rule)?;
                        ok &= same(&format!("{what} codes"), gpu.data(), cpu.data())?;
                        ok &= same(&format!("{what} scales"), gpu.scale_inv(), cpu.scale_inv())?;
                        if tiling != Tiling::Blk128 && rule == ScaleRule::PowerOfTwo {
                            let both = (true, true);
                            let (c1, c2) =
                                BlockTensor::quantize_pair(&xd, qtype, tiling, rule, both)?;
                            let (g1, g2) = BlockTensor::quantize_pair(
                                &xd.to_device(dev)?,
                                qtype,
                                tiling,
                                rule,
                                both,
                            )?;
                            for (g, c, part) in
                                [(g1, c1, "pair rowwise"), (g2, c2, "pair transposed")]
                            {
                                let (Some(g), Some(c)) = (g, c) else {
                                    anyhow::bail!("{what} {part}: missing")
                                };
                                ok &= same(&format!("{what} {part} codes"), g.data(), c.data())?;
                                ok &= same(
                                    &format!("{what} {part} scales"),
                                    g.scale_inv(),
                                    c.scale_inv(),
                                )?;
                            }
                        }
                        for out in [DType::F32, DType::BF16, DType::F16] {
                            ok &= same(
                                &format!("{what} dequantize {out:?}"),
                                &gpu.dequantize(out)?,
                                &cpu.dequantize(out)?,
                            )?;
                        }
                    }
                }
            }
        }
    }
    ensure!(ok, "block-scaled casts differ from the CPU");
    Ok(())
}

fn block_gemm_f64(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(78);
    let pairs = [
        (Tiling::Vec128, Tiling::Blk128),
        (Tiling::Vec128, Tiling::Vec128),
        (Tiling::Blk128, Tiling::Vec128),
        (Tiling::Row, Tiling::Row),
    ];
    // (m, k, n): aligned, unaligned, a k that is not a multiple of 128
    for (m, k, n) in [
        (256, 512, 384),
        (1024, 4096, 1024),
        (100, 72, 40),
        (333, 1000, 200),
        (128, 136, 256),
    ] {
        let xa = Tensor::from_vec(spread(&mut rng, m, k, false), (m, k), &Device::Cpu)?;
        let xb = Tensor::from_vec(spread(&mut rng, n, k, false), (n, k), &Device::Cpu)?;
        for (ta, tb) in pairs {
            for qa in [QType::E4M3, QType::E5M2] {
                let a = BlockTensor::quantize(&xa, qa, ta, ScaleRule::PowerOfTwo)?;
                let b = BlockTensor::quantize(&xb, QType::E4M3, tb, ScaleRule::PowerOfTwo)?;
                // decoding is exact (power-of-two scales): f64 from the CPU's decode
                let want = a
                    .dequantize(DType::F32)?
                    .to_dtype(DType::F64)?
                    .matmul(&b.dequantize(DType::F32)?.to_dtype(DType::F64)?.t()?)?;
                let top = want.abs()?.max_all()?.to_scalar::<f64>()?;
                let (ad, bd) = (to_dev(&a, dev)?, to_dev(&b, dev)?);
                // F32: Hopper's FP8 tensor cores keep partial sums in less
                // than f32 (measured 1e-4 to 2.2e-4 of max |y| here, as the
                // per-tensor GEMM's); a scale in the wrong place is off by
                // up to 2^24
                for (out, tol) in [(DType::F32, 1e-3), (DType::BF16, 8e-3)] {
                    let y = block_gemm(&ad, &bd, out)?;
                    let y = y.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
                    let worst = (&y - &want)?.abs()?.max_all()?.to_scalar::<f64>()? / top;
                    let pass = worst <= tol;
                    println!(
                        "  {m}x{k}x{n} {ta} {qa} x {tb} e4m3 -> {out:?}: max err {worst:.2e} of max |y| {}",
                        if pass { "ok" } else { "FAIL" }
                    );
                    ok &= pass;
                }
            }
        }
    }
    ensure!(ok, "block-scaled GEMM beyond tolerance");
    Ok(())
}

fn to_dev(t: &BlockTensor, dev: &Device) -> Result<BlockTensor> {
    Ok(BlockTensor::from_parts(
        t.data().to_device(dev)?,
        t.scale_inv().to_device(dev)?,
        t.qtype(),
        t.tiling(),
    )?)
}

/// The BF16 bias and residual in cuBLASLt's epilogue against the CPU's F32
/// product and adds (one rounding each; the accumulation order differs).
fn block_epilogue(dev: &Device) -> Result<()> {
    let mut rng = Rng(79);
    let mut ok = true;
    for (m, k, n) in [(256, 512, 384), (1024, 1024, 3072)] {
        let xa = Tensor::from_vec(rng.normal(m * k), (m, k), &Device::Cpu)?;
        let xb = Tensor::from_vec(rng.normal(n * k), (n, k), &Device::Cpu)?;
        let bias = Tensor::from_vec(rng.normal(n), n, &Device::Cpu)?.to_dtype(DType::BF16)?;
        let res =
            Tensor::from_vec(rng.normal(m * n), (m, n), &Device::Cpu)?.to_dtype(DType::BF16)?;
        let a = BlockTensor::quantize(&xa, QType::E4M3, Tiling::Vec128, ScaleRule::PowerOfTwo)?;
        let b = BlockTensor::quantize(&xb, QType::E4M3, Tiling::Blk128, ScaleRule::PowerOfTwo)?;
        let epi = |bias, residual| Epilogue { bias, residual };
        let want = block_gemm_fused(&a, &b, DType::BF16, epi(Some(&bias), Some(&res)))?;
        let (bd, rd) = (bias.to_device(dev)?, res.to_device(dev)?);
        let y = block_gemm_fused(
            &to_dev(&a, dev)?,
            &to_dev(&b, dev)?,
            DType::BF16,
            epi(Some(&bd), Some(&rd)),
        )?;
        let f = |t: &Tensor| {
            t.to_device(&Device::Cpu)
                .and_then(|t| t.to_dtype(DType::F64))
        };
        let top = f(&want)?.abs()?.max_all()?.to_scalar::<f64>()?;
        let worst = (f(&y)? - f(&want)?)?.abs()?.max_all()?.to_scalar::<f64>()? / top;
        let pass = worst <= 8e-3;
        println!(
            "  epilogue {m}x{k}x{n}: max err {worst:.2e} of max |y| {}",
            if pass { "ok" } else { "FAIL" }
        );
        ok &= pass;
    }
    ensure!(ok, "block GEMM epilogue beyond tolerance");
    Ok(())
}

/// A scaled FP16 weight's 128 x 128 blocks and its transpose's from one
/// read of its codes, and its rowwise pair from two (`BlockTensor::
/// of_scaled`), against the casts of its decoded value (and the blocks'
/// `t()`), bit for bit: BF16 and F32 values, both formats and rules, a NaN
/// tile, an inf that saturates the FP16 copy, a zero tile; shapes and
/// rules the kernels refuse give `None`.
fn block_scaled_weight(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(79);
    for (rows, cols) in [(128, 128), (256, 1024), (384, 640), (1024, 256)] {
        let mut v = spread(&mut rng, rows, cols, true);
        v[cols + 5] = f32::INFINITY; // saturates the FP16 copy's scale
        v[(rows / 2) * cols + cols - 1] = 0.0;
        let x = Tensor::from_vec(v, (rows, cols), dev)?;
        let (w, _) = ScalingTensor::quantize(&x, QType::F16, &CurrentScaling::default())?;
        for dtype in [DType::BF16, DType::F32] {
            for qtype in [QType::E4M3, QType::E5M2] {
                for rule in [ScaleRule::PowerOfTwo, ScaleRule::Te] {
                    let what = format!("[{rows}, {cols}] {dtype:?} {qtype} {rule:?}");
                    let want =
                        BlockTensor::quantize(&w.dequantize(dtype)?, qtype, Tiling::Blk128, rule)?;
                    let want_t = want.t()?;
                    let blocks = |wanted| {
                        BlockTensor::of_scaled(&w, dtype, qtype, Tiling::Blk128, rule, wanted)
                    };
                    let Some((Some(got), Some(got_t))) = blocks((true, true))? else {
                        anyhow::bail!("{what}: the one-read path did not run");
                    };
                    ok &= same_cast(&what, &got, &want)?;
                    ok &= same_cast(&format!("{what} transposed"), &got_t, &want_t)?;
                    // only the transpose
                    let Some((None, Some(t_only))) = blocks((false, true))? else {
                        anyhow::bail!("{what}: the transpose alone did not run");
                    };
                    ok &= same_cast(&format!("{what} transposed alone"), &t_only, &want_t)?;
                    // rows: the pair of the decoded value (power-of-two scales only)
                    let rows_of =
                        BlockTensor::of_scaled(&w, dtype, qtype, Tiling::Row, rule, (true, true))?;
                    if rule != ScaleRule::PowerOfTwo {
                        ensure!(
                            rows_of.is_none(),
                            "{what}: rows under {rule:?} took the kernels"
                        );
                        continue;
                    }
                    let (Some(c1), Some(c2)) = BlockTensor::quantize_pair(
                        &w.dequantize(dtype)?,
                        qtype,
                        Tiling::Row,
                        rule,
                        (true, true),
                    )?
                    else {
                        anyhow::bail!("{what}: the decoded pair is missing");
                    };
                    let Some((Some(g1), Some(g2))) = rows_of else {
                        anyhow::bail!("{what}: the rows from the codes did not run");
                    };
                    ok &= same_cast(&format!("{what} rows"), &g1, &c1)?;
                    ok &= same_cast(&format!("{what} rows transposed"), &g2, &c2)?;
                }
            }
        }
    }
    // not whole tiles: the caller casts the decoded value
    let x = Tensor::from_vec(spread(&mut rng, 130, 256, false), (130, 256), dev)?;
    let (w, _) = ScalingTensor::quantize(&x, QType::F16, &CurrentScaling::default())?;
    let r = BlockTensor::of_scaled(
        &w,
        DType::BF16,
        QType::E4M3,
        Tiling::Blk128,
        ScaleRule::PowerOfTwo,
        (true, true),
    )?;
    ensure!(
        r.is_none(),
        "a [130, 256] weight took the whole-tile kernel"
    );
    ensure!(
        ok,
        "the one-read weight blocks differ from the cast of the decoded value"
    );
    Ok(())
}

/// Whether two casts' codes and scales agree bit for bit (`same` on each).
fn same_cast(what: &str, got: &BlockTensor, want: &BlockTensor) -> Result<bool> {
    let codes = same(&format!("{what} codes"), got.data(), want.data())?;
    let scales = same(&format!("{what} scales"), got.scale_inv(), want.scale_inv())?;
    Ok(codes && scales)
}
