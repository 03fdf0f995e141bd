//! Causal attention on CUDA: flash attention (head dimension 64) and the
//! materialised path (other head dimensions, or flash turned off) against
//! the CPU's F32 body, forward output and every gradient; flash against
//! the materialised GPU path at the GPT's shapes; and (`--bench`) the two
//! GPU paths' forward + backward time, with the FLOP rate of the causal
//! products (`4 * b * heads * t^2 * d` forward, 2.5 times that backward,
//! halved by the mask).
//!
//! The GPU runs its products in BF16 against F32 on the CPU, so the check
//! is a relative error (L2 over L2) within 2e-2. Where the reference is
//! exactly zero (q's and k's gradients at one row: the softmax of one score
//! is constant) the error is the GPU value's RMS, which must be BF16
//! rounding size.

use crate::fused::{backward, g, report, var};
use crate::util::Rng;
use amp::nn::fused;
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};

const TOL: f64 = 2e-2;

/// `|a - b| / |b|` (L2 norms); for an all-zero `b`, `a`'s RMS.
fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let n = b.elem_count().max(1) as f64;
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let den = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if den == 0.0 {
        num / n.sqrt()
    } else {
        num / den
    })
}

/// Separate q, k, v `[b, heads, t, d]`: GPU against CPU. `sharp` scales q
/// by 4 (peaked probabilities).
fn separate(
    rng: &mut Rng,
    dev: &Device,
    dims: [usize; 4],
    dtype: DType,
    sharp: bool,
) -> Result<bool> {
    let mk = |rng: &mut Rng| var(rng, &dims, dtype, dev);
    let ((qc, qg), (kc, kg), (vc, vg)) = (mk(rng)?, mk(rng)?, mk(rng)?);
    let (rc, rg) = mk(rng)?;
    let s = if sharp { 4.0 } else { 1.0 };
    let yc = fused::causal_attention(&(qc.as_tensor() * s)?, &kc, &vc)?;
    let yg = fused::causal_attention(&(qg.as_tensor() * s)?, &kg, &vg)?;
    let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
    let e = [
        ("y", rel_err(&yg, &yc)?),
        ("dq", rel_err(&g(&gg, &qg)?, &g(&gc, &qc)?)?),
        ("dk", rel_err(&g(&gg, &kg)?, &g(&gc, &kc)?)?),
        ("dv", rel_err(&g(&gg, &vg)?, &g(&gc, &vc)?)?),
    ];
    let path = if dims[3] == 64 {
        "flash"
    } else {
        "materialised"
    };
    Ok(report(
        &format!(
            "causal_attention {dims:?} {dtype:?}{} ({path})",
            if sharp { " sharp" } else { "" }
        ),
        &e,
        TOL,
    ))
}

/// A packed projection `[b, t, 3 * heads * hd]`: GPU against CPU.
fn packed(
    rng: &mut Rng,
    dev: &Device,
    (b, t, heads, hd): (usize, usize, usize, usize),
    dtype: DType,
) -> Result<bool> {
    let dims = [b, t, 3 * heads * hd];
    let (xc, xg) = var(rng, &dims, dtype, dev)?;
    let (rc, rg) = var(rng, &[b, t, heads * hd], dtype, dev)?;
    let yc = fused::causal_attention_qkv(&xc, heads)?;
    let yg = fused::causal_attention_qkv(&xg, heads)?;
    let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
    let e = [
        ("y", rel_err(&yg, &yc)?),
        ("dqkv", rel_err(&g(&gg, &xg)?, &g(&gc, &xc)?)?),
    ];
    Ok(report(
        &format!("causal_attention_qkv {dims:?} heads {heads} {dtype:?}"),
        &e,
        TOL,
    ))
}

/// `(y, dqkv)` of the packed attention on `dev` with flash on or off.
fn run_packed(x: &Var, r: &Tensor, heads: usize, flash: bool) -> Result<(Tensor, Tensor)> {
    fused::set_flash_attention(flash);
    let y = fused::causal_attention_qkv(x, heads);
    fused::set_flash_attention(true);
    let y = y?;
    let grads = backward(&y, r)?;
    Ok((y, g(&grads, x)?))
}

pub fn check(dev: &Device) -> Result<bool> {
    let mut rng = Rng(0xa77e_0001);
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        for dims in [
            [2usize, 3, 128, 64],
            [1, 2, 37, 64],
            [2, 2, 200, 64],
            [1, 1, 1, 64],
            [1, 2, 37, 24],
        ] {
            ok &= separate(&mut rng, dev, dims, dtype, false)?;
        }
        ok &= separate(&mut rng, dev, [1, 2, 130, 64], dtype, true)?;
        for shape in [
            (2usize, 128usize, 3usize, 64usize),
            (1, 100, 2, 64),
            (2, 65, 1, 64),
            (1, 37, 2, 12),
        ] {
            ok &= packed(&mut rng, dev, shape, dtype)?;
        }
    }
    // the GPT's shapes, flash against the materialised GPU path
    for (b, t, heads) in [(8usize, 1024usize, 12usize), (2, 1024, 16)] {
        let (_, x) = var(&mut rng, &[b, t, 3 * heads * 64], DType::BF16, dev)?;
        let (_, r) = var(&mut rng, &[b, t, heads * 64], DType::BF16, dev)?;
        let (yf, gf) = run_packed(&x, r.as_tensor(), heads, true)?;
        let (ym, gm) = run_packed(&x, r.as_tensor(), heads, false)?;
        let e = [("y", rel_err(&yf, &ym)?), ("dqkv", rel_err(&gf, &gm)?)];
        ok &= report(
            &format!(
                "flash vs materialised GPU [{b}, {t}, {}] heads {heads}",
                3 * heads * 64
            ),
            &e,
            TOL,
        );
    }
    Ok(ok)
}

/// Forward + backward of the packed attention at the GPT's shapes, flash
/// and materialised, in milliseconds (CUDA events) and causal TFLOP/s.
pub fn bench(dev: &Device) -> Result<bool> {
    let mut rng = Rng(0xa77e_0002);
    let cuda = dev.as_cuda_device()?;
    println!("attention fwd+bwd (BF16, causal):");
    for (b, t, heads) in [(8usize, 1024usize, 12usize), (8, 1024, 16), (8, 2048, 16)] {
        let (_, x) = var(&mut rng, &[b, t, 3 * heads * 64], DType::BF16, dev)?;
        let (_, r) = var(&mut rng, &[b, t, heads * 64], DType::BF16, dev)?;
        // the causal half of 4 b h t^2 d (forward), 2.5 times that backward
        let fwd_flops = 4.0 * (b * heads * t * t * 64) as f64 / 2.0;
        let mut line = format!("  b {b} t {t} heads {heads}:");
        let xd = x.as_tensor().detach();
        for flash in [true, false] {
            let fwd = crate::bench::event_ms(cuda, || {
                fused::set_flash_attention(flash);
                let y = fused::causal_attention_qkv(&xd, heads);
                fused::set_flash_attention(true);
                y?;
                Ok(())
            })?;
            let both = crate::bench::event_ms(cuda, || {
                run_packed(&x, r.as_tensor(), heads, flash)?;
                Ok(())
            })?;
            let name = if flash { "flash" } else { "materialised" };
            line += &format!(
                " {name} fwd {fwd:.3} ms ({:.0} TFLOP/s), fwd+bwd {both:.3} ms ({:.0})",
                fwd_flops / fwd / 1e9,
                3.5 * fwd_flops / both / 1e9
            );
        }
        println!("{line}");
    }
    Ok(true)
}
