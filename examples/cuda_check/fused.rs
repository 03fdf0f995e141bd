//! The fused training ops (`amp::nn::fused`) on CUDA against their CPU
//! bodies: forward outputs and every gradient, F32 and BF16, on shapes
//! that take the 16-byte path and odd ones that do not. CPU and CUDA agree
//! to rounding (their exp/ln/tanh differ in the last bit), so the check is
//! a relative error: F32 within 1e-5, BF16 within 1e-2. The attention's
//! checks are in `attention.rs`.

use crate::util::{rel_err, same, Rng};
use amp::nn::fused;
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};

pub(crate) fn var(rng: &mut Rng, dims: &[usize], dtype: DType, dev: &Device) -> Result<(Var, Var)> {
    let n = dims.iter().product();
    let t = Tensor::from_vec(rng.normal(n), dims, &Device::Cpu)?.to_dtype(dtype)?;
    Ok((Var::from_tensor(&t)?, Var::from_tensor(&t.to_device(dev)?)?))
}

pub(crate) fn g(s: &candle_core::backprop::GradStore, v: &Var) -> Result<Tensor> {
    s.get(v)
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no gradient"))
}

/// The gradients of `sum(y * r)` (a loss whose dy is `r` on any device).
pub(crate) fn backward(y: &Tensor, r: &Tensor) -> Result<candle_core::backprop::GradStore> {
    Ok((y.to_dtype(DType::F32)? * r.to_dtype(DType::F32)?)?
        .sum_all()?
        .backward()?)
}

pub(crate) fn report(what: &str, errs: &[(&str, f64)], tol: f64) -> bool {
    let ok = errs.iter().all(|(_, e)| *e <= tol);
    let list: Vec<String> = errs.iter().map(|(n, e)| format!("{n} {e:.2e}")).collect();
    println!(
        "  {what}: {} (tolerance {tol:.0e}) {}",
        list.join(", "),
        if ok { "ok" } else { "FAIL" }
    );
    ok
}

fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        1e-2
    } else {
        1e-5
    }
}

pub fn check(dev: &Device) -> Result<bool> {
    let mut rng = Rng(0x5eed_f00d);
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        for (rows, cols) in [(64usize, 768usize), (37, 50304), (33, 101)] {
            // cross-entropy: loss and dlogits
            let (xc, xg) = var(&mut rng, &[rows, cols], dtype, dev)?;
            let t: Vec<u32> = (0..rows).map(|i| ((i * 7919) % cols) as u32).collect();
            let (tc, tg) = (
                Tensor::new(t.as_slice(), &Device::Cpu)?,
                Tensor::new(t.as_slice(), dev)?,
            );
            let (lc, lg) = (
                fused::cross_entropy(&xc, &tc)?,
                fused::cross_entropy(&xg, &tg)?,
            );
            let (gc, gg) = (lc.backward()?, lg.backward()?);
            let e = [
                ("loss", rel_err(&lg, &lc)?),
                ("dx", rel_err(&g(&gg, &xg)?, &g(&gc, &xc)?)?),
            ];
            ok &= report(
                &format!("cross_entropy {dtype:?} {rows}x{cols}"),
                &e,
                tol(dtype),
            );
            // LayerNorm and GELU on the same shape (wide rows only)
            if cols > 50000 {
                continue;
            }
            let (wc, wg) = var(&mut rng, &[cols], DType::F32, dev)?;
            let (bc, bg) = var(&mut rng, &[cols], DType::F32, dev)?;
            let (rc, rg) = var(&mut rng, &[rows, cols], dtype, dev)?;
            let yc = fused::layer_norm(&xc, &wc, &bc, 1e-5)?;
            let yg = fused::layer_norm(&xg, &wg, &bg, 1e-5)?;
            let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
            let e = [
                ("y", rel_err(&yg, &yc)?),
                ("dx", rel_err(&g(&gg, &xg)?, &g(&gc, &xc)?)?),
                ("dw", rel_err(&g(&gg, &wg)?, &g(&gc, &wc)?)?),
                ("db", rel_err(&g(&gg, &bg)?, &g(&gc, &bc)?)?),
            ];
            ok &= report(
                &format!("layer_norm {dtype:?} {rows}x{cols}"),
                &e,
                tol(dtype),
            );
            let yc = fused::gelu(&xc)?;
            let yg = fused::gelu(&xg)?;
            let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
            let e = [
                ("y", rel_err(&yg, &yc)?),
                ("dx", rel_err(&g(&gg, &xg)?, &g(&gc, &xc)?)?),
            ];
            ok &= report(&format!("gelu {dtype:?} {rows}x{cols}"), &e, tol(dtype));
        }
    }
    // the bias gradient (a column sum, the CPU in the kernels' order): bit
    // for bit, on the 8-columns-a-thread path (cols % 8 == 0) and the other
    for dtype in [DType::F32, DType::BF16] {
        for (rows, cols) in [(8192usize, 768usize), (1000, 3072), (33, 101)] {
            let (xc, xg) = var(&mut rng, &[rows, cols], dtype, dev)?;
            let (bc, bg) = var(&mut rng, &[cols], DType::F32, dev)?;
            let (rc, rg) = var(&mut rng, &[rows, cols], dtype, dev)?;
            let (yc, yg) = (fused::bias_add(&xc, &bc)?, fused::bias_add(&xg, &bg)?);
            let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
            let what = format!("bias_add {dtype:?} {rows}x{cols}");
            let same_db = same(&format!("{what} db"), &g(&gg, &bg)?, &g(&gc, &bc)?)?;
            println!(
                "  {what}: db {}",
                if same_db { "identical" } else { "DIFFERENT" }
            );
            ok &= same_db;
        }
    }
    // the embedding: a gather and a sum in token order, so bit for bit
    for (rows, cols, n) in [(50304usize, 768usize, 8192usize), (37, 101, 1000)] {
        let (tc, tg) = var(&mut rng, &[rows, cols], DType::F32, dev)?;
        // skewed ids: many repeats of a few rows, as text has
        let ids: Vec<u32> = (0..n)
            .map(|i| ((i * i * 7919 + i) % rows.min(if i % 3 == 0 { 17 } else { rows })) as u32)
            .collect();
        let ic = Tensor::from_vec(ids, (2, n / 2), &Device::Cpu)?;
        let ig = ic.to_device(dev)?;
        let (rc, rg) = var(&mut rng, &[2, n / 2, cols], DType::F32, dev)?;
        let yc = fused::embedding(&ic, &tc)?;
        let yg = fused::embedding(&ig, &tg)?;
        let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
        let e = [
            ("y", rel_err(&yg, &yc)?),
            ("dtable", rel_err(&g(&gg, &tg)?, &g(&gc, &tc)?)?),
        ];
        ok &= report(&format!("embedding {rows}x{cols}, {n} ids"), &e, 0.0);
    }
    Ok(ok)
}
