//! The fused training ops (`amp::nn::fused`), causal attention and the
//! half-blocks on the device against their CPU bodies: forward outputs and
//! every gradient.
//!
//! - Cross-entropy, LayerNorm, RMSNorm, GELU, SwiGLU: F32 and BF16, on shapes that take the
//!   16-byte path and odd ones that do not. CPU and CUDA agree to rounding
//!   (their exp/ln/tanh differ in the last bit): F32 within 1e-5, BF16
//!   within 1e-2. The bias gradient (a column sum in the kernels' order)
//!   bit for bit, the embedding (a gather, a sum in token order) with a
//!   relative error of 0.
//! - Attention (grouped-query too): flash attention (head dimensions 64, 80, 96, 128) and the materialised
//!   path (other head dimensions, or flash turned off) against the CPU's
//!   F32 body; flash against the materialised GPU path at the GPT's
//!   shapes. The GPU runs its products in BF16 against F32 on the CPU, so
//!   within 2e-2. Where the reference is exactly zero (q's and k's
//!   gradients at one row: the softmax of one score is constant) the error
//!   is the device value's RMS, which must be BF16 rounding size.
//! - Llama's attention of a packed projection (`rope_attention_qkv`:
//!   RoPE and grouped-query heads; on the device the flash kernels read
//!   the turned rows in place and sum the groups' dK, dV themselves)
//!   against the CPU's split path, within 2e-2, and against the same
//!   heads split on the device (RoPE, then `causal_attention` with the
//!   key/value heads repeated): the output bit for bit, the gradients
//!   within 1e-2 (RoPE's transpose and back, and the group's dK, dV summed
//!   in F32 registers against a sum of BF16 per-head gradients).
//! - The half-blocks (`nn::causal_self_attention`, `nn::pre_norm_mlp`) in
//!   an FP8 mode with the weights' gradients in a sink: the tensors handed
//!   between their ops, the bias and residual in the GEMM's epilogue, the
//!   residual's gradient added in the LayerNorm's backward. Within 1e-1:
//!   the two devices' GEMMs round differently, and a rounding that moves an
//!   E5M2 gradient code moves that element by up to 25% (measured: 1e-3 to
//!   3.7e-2). A lost bias, residual or residual gradient is an error of
//!   order one.
//! - The head's loss over chunks of rows (`nn::set_loss_chunk_rows`;
//!   the weight gradient summed over the chunks in cuBLASLt's F32
//!   accumulator where the shapes are multiples of 16, else by an add):
//!   against the whole logits on the device and against the chunked path
//!   on the CPU, loss within 1e-3, gradients within 1e-1 (E5M2 codes, as
//!   above). A lost chunk of the weight gradient is an error of order one.

use crate::util::{backward, g, rel_err, report, same, var, Rng};
use amp::nn::{self, fp8_autocast, fused, ComputeMode, GradSink};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var};

test_device!(pointwise, pointwise_cuda);
test_device!(bias_grad, bias_grad_cuda);
test_device!(gelu_col_sums, gelu_col_sums_cuda);
test_device!(embedding, embedding_cuda);
test_device!(attention, attention_cuda);
test_device!(flash_vs_materialised, flash_vs_materialised_cuda);
test_device!(rope_attention, rope_attention_cuda);
test_device!(half_blocks, half_blocks_cuda);
test_device!(chunked_head, chunked_head_cpu, chunked_head_cuda);
test_device!(chunked_head_gpt, chunked_head_gpt_cuda);

fn tol(dtype: DType) -> f64 {
    if dtype == DType::BF16 {
        1e-2
    } else {
        1e-5
    }
}

/// Cross-entropy (loss and dlogits), and LayerNorm and GELU on the same
/// shapes (except the vocabulary-wide one).
fn pointwise(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x5eed_f00d);
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        // LayerNorm's rows in registers (up to 2,048 BF16 or 1,024 F32
        // columns on the 16-byte path: 768, 1024, 2048) and read again
        // (4096, and 101 off the 16-byte path)
        for (rows, cols) in [
            (64usize, 768usize),
            (37, 50304),
            (33, 101),
            (9, 1024),
            (5, 2048),
            (3, 4096),
        ] {
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
            let yc = fused::rms_norm(&xc, &wc, 1e-5)?;
            let yg = fused::rms_norm(&xg, &wg, 1e-5)?;
            let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
            let e = [
                ("y", rel_err(&yg, &yc)?),
                ("dx", rel_err(&g(&gg, &xg)?, &g(&gc, &xc)?)?),
                ("dw", rel_err(&g(&gg, &wg)?, &g(&gc, &wc)?)?),
            ];
            ok &= report(&format!("rms_norm {dtype:?} {rows}x{cols}"), &e, tol(dtype));
            if cols % 2 == 0 {
                let (yc, yg) = (fused::swiglu(&xc)?, fused::swiglu(&xg)?);
                let (rc2, rg2) = (rc.narrow(1, 0, cols / 2)?, rg.narrow(1, 0, cols / 2)?);
                let (gc, gg) = (backward(&yc, &rc2)?, backward(&yg, &rg2)?);
                let e = [
                    ("y", rel_err(&yg, &yc)?),
                    ("dx", rel_err(&g(&gg, &xg)?, &g(&gc, &xc)?)?),
                ];
                ok &= report(&format!("swiglu {dtype:?} {rows}x{cols}"), &e, tol(dtype));
            }
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
    ensure!(ok, "fused ops out of tolerance (see the lines above)");
    Ok(())
}

/// The bias gradient (a column sum, the CPU in the kernels' order): bit
/// for bit, on the 8-columns-a-thread path (cols % 8 == 0) and the other.
fn bias_grad(dev: &Device) -> Result<()> {
    let mut rng = Rng(0xb1a5);
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        for (rows, cols) in [(8192usize, 768usize), (1000, 3072), (33, 101)] {
            let (xc, xg) = var(&mut rng, &[rows, cols], dtype, dev)?;
            let (bc, bg) = var(&mut rng, &[cols], DType::F32, dev)?;
            let (rc, rg) = var(&mut rng, &[rows, cols], dtype, dev)?;
            let (yc, yg) = (fused::bias_add(&xc, &bc)?, fused::bias_add(&xg, &bg)?);
            let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
            ok &= same(
                &format!("bias_add {dtype:?} {rows}x{cols} db"),
                &g(&gg, &bg)?,
                &g(&gc, &bc)?,
            )?;
        }
    }
    ensure!(ok, "bias gradients differ (see the lines above)");
    Ok(())
}

/// GELU's backward with its column sums and amax in one pass
/// (`Activation::backward_with_col_sums`) bit for bit the separate kernels
/// on the same device (GELU's backward through the graph, a bias's
/// gradient, `amax`), on the 16-byte path (the GPT's 4096-wide MLP, and 64
/// rows a chunk or one) and off it (12 columns: two kernels), F32 and BF16.
fn gelu_col_sums(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x9e1b);
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        for (rows, cols) in [(8192usize, 4096usize), (100, 24), (77, 12)] {
            let (_, zv) = var(&mut rng, &[rows, cols], dtype, dev)?;
            let (_, dy) = var(&mut rng, &[rows, cols], dtype, dev)?;
            let dy = dy.as_tensor().detach();
            let Some((dz, sums, amax)) =
                nn::Activation::Gelu.backward_with_col_sums(zv.as_tensor(), &dy)?
            else {
                anyhow::bail!("no fused GELU backward for {dtype:?}");
            };
            let sep = g(&backward(&fused::gelu(zv.as_tensor())?, &dy)?, &zv)?;
            let b = Var::zeros(cols, DType::F32, dev)?;
            let db = g(&backward(&fused::bias_add(&sep.detach(), &b)?, &sep)?, &b)?;
            let what = format!("gelu col sums {dtype:?} {rows}x{cols}");
            ok &= same(&format!("{what} dz"), &dz, &sep)?;
            ok &= same(&format!("{what} sums"), &sums, &db)?;
            ok &= same(&format!("{what} amax"), &amax, &amp::kernels::amax(&sep)?)?;
        }
    }
    ensure!(
        ok,
        "GELU's fused bias gradient differs (see the lines above)"
    );
    Ok(())
}

/// The embedding: a gather and a sum in token order, so a relative
/// error of 0.
fn embedding(dev: &Device) -> Result<()> {
    let mut rng = Rng(0xe3b0);
    let mut ok = true;
    // 16384 ids: the most the sorting backward takes; 20000 ids, or
    // 300000 rows (keys past 32 bits), the scanning one
    let shapes = [
        (50304usize, 768usize, 8192usize),
        (37, 101, 1000),
        (1031, 64, 16384),
        (1031, 64, 20000),
        (300_000, 8, 16384),
    ];
    for (rows, cols, n) in shapes {
        let (tc, tg) = var(&mut rng, &[rows, cols], DType::F32, dev)?;
        // skewed ids: many repeats of a few rows, as text has
        let ids: Vec<u32> = (0..n)
            .map(|i| ((i * i * 7919 + i) % rows.min(if i % 3 == 0 { 17 } else { rows })) as u32)
            .collect();
        let ic = Tensor::from_vec(ids.clone(), (2, n / 2), &Device::Cpu)?;
        let ig = ic.to_device(dev)?;
        let (rc, rg) = var(&mut rng, &[2, n / 2, cols], DType::F32, dev)?;
        let yc = fused::embedding(&ic, &tc)?;
        let yg = fused::embedding(&ig, &tg)?;
        let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
        // the table's gradient from rows with a scale (data parallelism's
        // mean over 3 ranks: the products rounded apart on both sides)
        // (every 97th id past the table: it adds nothing)
        let past: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                if i % 97 == 5 {
                    (rows + i % 3) as u32
                } else {
                    r
                }
            })
            .collect();
        let flat_c = Tensor::from_vec(past, n, &Device::Cpu)?;
        let flat_g = flat_c.to_device(dev)?;
        let (rows_c, rows_g) = (rc.reshape((n, cols))?, rg.reshape((n, cols))?);
        let third = (1.0 / 3.0f64) as f32;
        let sc = fused::embedding_grad(&flat_c, &rows_c, rows, third)?;
        let sg = fused::embedding_grad(&flat_g, &rows_g, rows, third)?;
        let e = [
            ("y", rel_err(&yg, &yc)?),
            ("dtable", rel_err(&g(&gg, &tg)?, &g(&gc, &tc)?)?),
            ("dtable / 3", rel_err(&sg, &sc)?),
        ];
        ok &= report(&format!("embedding {rows}x{cols}, {n} ids"), &e, 0.0);
    }
    ensure!(ok, "embedding differs (see the lines above)");
    Ok(())
}

const ATTENTION_TOL: f64 = 2e-2;
/// The head dimensions flash attention is built for.
const FLASH_HEAD_DIMS: [usize; 4] = [64, 80, 96, 128];

/// `|a - b| / |b|` (L2 norms); for an all-zero `b`, `a`'s RMS.
fn rel_err_or_rms(a: &Tensor, b: &Tensor) -> Result<f64> {
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

/// Separate q, k, v `[b, heads, t, d]`: the device against the CPU.
/// `sharp` scales q by 4 (peaked probabilities).
fn separate(
    rng: &mut Rng,
    dev: &Device,
    dims: [usize; 4],
    dtype: DType,
    sharp: bool,
) -> Result<bool> {
    separate_gqa(rng, dev, dims, dims[1], dtype, sharp)
}

/// [`separate`] with `kv_heads` key and value heads (grouped-query
/// attention where fewer than q's).
fn separate_gqa(
    rng: &mut Rng,
    dev: &Device,
    dims: [usize; 4],
    kv_heads: usize,
    dtype: DType,
    sharp: bool,
) -> Result<bool> {
    let mk = |rng: &mut Rng| var(rng, &dims, dtype, dev);
    let kv_dims = [dims[0], kv_heads, dims[2], dims[3]];
    let mkv = |rng: &mut Rng| var(rng, &kv_dims, dtype, dev);
    let ((qc, qg), (kc, kg), (vc, vg)) = (mk(rng)?, mkv(rng)?, mkv(rng)?);
    let (rc, rg) = mk(rng)?;
    let s = if sharp { 4.0 } else { 1.0 };
    let yc = fused::causal_attention(&(qc.as_tensor() * s)?, &kc, &vc)?;
    let yg = fused::causal_attention(&(qg.as_tensor() * s)?, &kg, &vg)?;
    let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
    let e = [
        ("y", rel_err_or_rms(&yg, &yc)?),
        ("dq", rel_err_or_rms(&g(&gg, &qg)?, &g(&gc, &qc)?)?),
        ("dk", rel_err_or_rms(&g(&gg, &kg)?, &g(&gc, &kc)?)?),
        ("dv", rel_err_or_rms(&g(&gg, &vg)?, &g(&gc, &vc)?)?),
    ];
    let path = if FLASH_HEAD_DIMS.contains(&dims[3]) {
        "flash"
    } else {
        "materialised"
    };
    Ok(report(
        &format!(
            "causal_attention {dims:?} kv heads {kv_heads} {dtype:?}{} ({path})",
            if sharp { " sharp" } else { "" }
        ),
        &e,
        ATTENTION_TOL,
    ))
}

/// A packed projection `[b, t, 3 * heads * hd]`: the device against the CPU.
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
        ("y", rel_err_or_rms(&yg, &yc)?),
        ("dqkv", rel_err_or_rms(&g(&gg, &xg)?, &g(&gc, &xc)?)?),
    ];
    Ok(report(
        &format!("causal_attention_qkv {dims:?} heads {heads} {dtype:?}"),
        &e,
        ATTENTION_TOL,
    ))
}

/// Separate and packed attention, flash and materialised shapes, F32 and
/// BF16, against the CPU.
fn attention(dev: &Device) -> Result<()> {
    let mut rng = Rng(0xa77e_0001);
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        for dims in [
            [2usize, 3, 128, 64],
            [1, 2, 37, 64],
            [2, 2, 200, 64],
            [1, 1, 1, 64],
            [1, 2, 37, 24],
            [2, 2, 200, 96],
            [1, 3, 100, 80],
            [2, 1, 130, 128],
            [1, 1, 1, 128],
        ] {
            ok &= separate(&mut rng, dev, dims, dtype, false)?;
        }
        for hd in [64, 128] {
            ok &= separate(&mut rng, dev, [1, 2, 130, hd], dtype, true)?;
        }
        // grouped-query attention: flash and materialised
        for (dims, kv) in [
            ([2usize, 8, 130, 64], 2usize),
            ([1, 4, 37, 128], 1),
            ([1, 6, 50, 24], 3),
        ] {
            ok &= separate_gqa(&mut rng, dev, dims, kv, dtype, false)?;
        }
        for shape in [
            (2usize, 128usize, 3usize, 64usize),
            (1, 100, 2, 64),
            (2, 65, 1, 64),
            (1, 37, 2, 12),
            (2, 128, 3, 96),
            (1, 77, 2, 80),
            (1, 100, 2, 128),
        ] {
            ok &= packed(&mut rng, dev, shape, dtype)?;
        }
    }
    ensure!(ok, "attention out of tolerance (see the lines above)");
    Ok(())
}

/// Llama's packed attention with RoPE and `kv` key/value heads: the device
/// against the CPU, and against the heads split on the device.
fn rope_packed(
    rng: &mut Rng,
    dev: &Device,
    (b, t, heads, kv, hd): (usize, usize, usize, usize, usize),
    dtype: DType,
) -> Result<bool> {
    let w = (heads + 2 * kv) * hd;
    let (xc, xg) = var(rng, &[b, t, w], dtype, dev)?;
    let (rc, rg) = var(rng, &[b, t, heads * hd], dtype, dev)?;
    let (cc, sc) = nn::rope_tables(t, hd, 500_000.0, None, &Device::Cpu)?;
    let (cg, sg) = (cc.to_device(dev)?, sc.to_device(dev)?);
    let yc = fused::rope_attention_qkv(&xc, (heads, kv), (&cc, &sc))?;
    let yg = fused::rope_attention_qkv(&xg, (heads, kv), (&cg, &sg))?;
    let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
    let (dc, dg) = (g(&gc, &xc)?, g(&gg, &xg)?);
    let what = format!("rope_attention_qkv [{b}, {t}, {w}] heads {heads} kv {kv} {dtype:?}");
    let e = [
        ("y", rel_err_or_rms(&yg, &yc)?),
        ("dqkv", rel_err_or_rms(&dg, &dc)?),
    ];
    let mut ok = report(&what, &e, ATTENTION_TOL);
    // The same heads split on the device.
    let x = xg.as_tensor();
    let part = |s: usize, n: usize| x.narrow(2, s * hd, n * hd)?.reshape((b, t, n, hd));
    let first = |z: Tensor| z.transpose(1, 2)?.contiguous();
    let (q, k, v) = (
        Var::from_tensor(&first(fused::rope(&part(0, heads)?, &cg, &sg)?)?)?,
        Var::from_tensor(&first(fused::rope(&part(heads, kv)?, &cg, &sg)?)?)?,
        Var::from_tensor(&first(part(heads + kv, kv)?)?)?,
    );
    let ys = fused::causal_attention(&q, &k, &v)?
        .transpose(1, 2)?
        .reshape((b, t, heads * hd))?;
    ok &= same(&format!("{what} y, split"), &yg, &ys)?;
    let gs = backward(&ys, rg.as_tensor())?;
    // dq of the split heads is before RoPE's transpose: compare the
    // packed gradient's q part turned forward again.
    let dq = dg.narrow(2, 0, heads * hd)?.reshape((b, t, heads, hd))?;
    let dq = first(fused::rope(&dq, &cg, &sg)?)?;
    let dq_split = g(&gs, &q)?;
    let e = [
        ("dq", rel_err_or_rms(&dq, &dq_split)?),
        (
            "dk",
            rel_err_or_rms(
                &first(fused::rope(
                    &dg.narrow(2, heads * hd, kv * hd)?.reshape((b, t, kv, hd))?,
                    &cg,
                    &sg,
                )?)?,
                &g(&gs, &k)?,
            )?,
        ),
        (
            "dv",
            rel_err_or_rms(
                &first(
                    dg.narrow(2, (heads + kv) * hd, kv * hd)?
                        .reshape((b, t, kv, hd))?,
                )?,
                &g(&gs, &v)?,
            )?,
        ),
    ];
    ok &= report(&format!("{what} vs split"), &e, 1e-2);
    Ok(ok)
}

/// Llama's packed attention (flash head dimensions, one that is not, and
/// groups of 1, 2 and 4), F32 and BF16, against the CPU.
fn rope_attention(dev: &Device) -> Result<()> {
    let mut rng = Rng(0xa77e_0005);
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        for shape in [
            (2usize, 130usize, 8usize, 2usize, 64usize),
            (1, 100, 4, 4, 64),
            (1, 257, 8, 2, 64),
            (2, 77, 6, 3, 128),
            (1, 65, 4, 1, 80),
            (1, 50, 4, 2, 96),
            (1, 37, 4, 2, 24),
        ] {
            ok &= rope_packed(&mut rng, dev, shape, dtype)?;
        }
    }
    ensure!(ok, "rope attention out of tolerance (see the lines above)");
    Ok(())
}

/// `(y, dqkv)` of the packed attention with flash on or off.
fn run_packed(x: &Var, r: &Tensor, heads: usize, flash: bool) -> Result<(Tensor, Tensor)> {
    fused::set_flash_attention(flash);
    let y = fused::causal_attention_qkv(x, heads);
    fused::set_flash_attention(true);
    let y = y?;
    let grads = backward(&y, r)?;
    Ok((y, g(&grads, x)?))
}

/// The GPT's shapes, flash against the materialised path on the device.
fn flash_vs_materialised(dev: &Device) -> Result<()> {
    let mut rng = Rng(0xa77e_0003);
    let mut ok = true;
    // 125M, 350M (head dimension 64), 760M (96), 2.7B (80), 6.7B (128)
    for (b, t, heads, hd) in [
        (8usize, 1024usize, 12usize, 64usize),
        (2, 1024, 16, 64),
        (2, 1024, 16, 96),
        (1, 1024, 32, 80),
        (1, 1024, 32, 128),
    ] {
        let (_, x) = var(&mut rng, &[b, t, 3 * heads * hd], DType::BF16, dev)?;
        let (_, r) = var(&mut rng, &[b, t, heads * hd], DType::BF16, dev)?;
        let (yf, gf) = run_packed(&x, r.as_tensor(), heads, true)?;
        let (ym, gm) = run_packed(&x, r.as_tensor(), heads, false)?;
        let e = [
            ("y", rel_err_or_rms(&yf, &ym)?),
            ("dqkv", rel_err_or_rms(&gf, &gm)?),
        ];
        ok &= report(
            &format!(
                "flash vs materialised [{b}, {t}, {}] heads {heads}",
                3 * heads * hd
            ),
            &e,
            ATTENTION_TOL,
        );
    }
    ensure!(
        ok,
        "flash differs from the materialised path (see the lines above)"
    );
    Ok(())
}

/// One device's half-block: `(ln, first, second, vars, sink)`, vars in the
/// order LayerNorm weight, bias, first weight, bias, second weight, bias.
type Half = (nn::LayerNorm, nn::Linear, nn::Linear, Vec<Var>, GradSink);

fn halves(rng: &mut Rng, d: usize, mlp: bool, dev: &Device) -> Result<(Half, Half)> {
    let wide = if mlp { 4 * d } else { 3 * d };
    let (w2_out, w2_in) = if mlp { (d, wide) } else { (d, d) };
    let dims: [&[usize]; 6] = [&[d], &[d], &[wide, d], &[wide], &[w2_out, w2_in], &[d]];
    let mut cpu = Vec::new();
    let mut on_dev = Vec::new();
    for (i, dims) in dims.iter().enumerate() {
        let (c, g) = var(rng, dims, DType::F32, dev)?;
        // LayerNorm weight near 1, weights small, biases of the output's
        // size (a lost bias or residual moves the output by far more than
        // the tolerance)
        let fix = |v: &Var| -> Result<Var> {
            let t = match i {
                0 => (v.as_tensor() * 0.1)?.affine(1.0, 1.0)?,
                2 | 4 => (v.as_tensor() * 0.1)?,
                _ => (v.as_tensor() * 0.5)?,
            };
            Ok(Var::from_tensor(&t)?)
        };
        cpu.push(fix(&c)?);
        on_dev.push(fix(&g)?);
    }
    let build = |v: Vec<Var>, tag: &str| -> Result<Half> {
        let t = |i: usize| v[i].as_tensor().clone();
        let ln = nn::LayerNorm::new(t(0), t(1), 1e-5)?;
        let a = nn::Linear::new(format!("{tag}.a.weight"), t(2), Some(t(3)))?;
        let b = nn::Linear::new(format!("{tag}.b.weight"), t(4), Some(t(5)))?;
        let sink = GradSink::new();
        a.set_grad_sink(Some(sink.clone()))?;
        b.set_grad_sink(Some(sink.clone()))?;
        Ok((ln, a, b, v, sink))
    };
    Ok((build(cpu, "cpu")?, build(on_dev, "dev")?))
}

fn run_half(half: &Half, h: &Tensor, mlp: bool, heads: usize) -> Result<Tensor> {
    let (ln, a, b, _, _) = half;
    Ok(if mlp {
        nn::pre_norm_mlp(h, ln, a, b, true)?
    } else {
        nn::causal_self_attention(h, ln, a, b, heads)?
    })
}

/// Both half-blocks, F32 and BF16 activations, FP8 current scaling; the
/// MLP also with its activation input kept as E4M3 tiles
/// (`nn::set_fp8_activation_inputs`).
fn half_blocks(dev: &Device) -> Result<()> {
    let mut rng = Rng(0xb10c);
    let mut ok = true;
    let (d, heads) = (128, 2);
    for dtype in [DType::F32, DType::BF16] {
        for (mlp, fp8_act) in [(false, false), (true, false), (true, true)] {
            nn::set_fp8_activation_inputs(fp8_act);
            let (hc, hg) = halves(&mut rng, d, mlp, dev)?;
            let (xc, xg) = var(&mut rng, &[2, 48, d], dtype, dev)?;
            let r = Tensor::from_vec(rng.normal(2 * 48 * d), (2, 48, d), &Device::Cpu)?;
            let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
            let yc = run_half(&hc, xc.as_tensor(), mlp, heads)?;
            let yg = run_half(&hg, xg.as_tensor(), mlp, heads)?;
            let (sc, sg) = (backward(&yc, &r)?, backward(&yg, &r.to_device(dev)?)?);
            let mut errs = vec![
                ("y", rel_err(&yg, &yc)?),
                ("dh", rel_err(&g(&sg, &xg)?, &g(&sc, &xc)?)?),
            ];
            let names = ["dln_w", "dln_b", "da_bias", "db_bias"];
            for (name, i) in names.into_iter().zip([0, 1, 3, 5]) {
                errs.push((name, rel_err(&g(&sg, &hg.3[i])?, &g(&sc, &hc.3[i])?)?));
            }
            let (wc, wg) = (hc.4.take()?, hg.4.take()?);
            for part in ["a", "b"] {
                let dq = |m: &std::collections::HashMap<String, amp::ScalingTensor>, tag: &str| {
                    m.get(&format!("{tag}.{part}.weight"))
                        .ok_or_else(|| anyhow::anyhow!("no sink gradient for {part}"))?
                        .dequantize(DType::F32)
                        .map_err(anyhow::Error::from)
                };
                let name = if part == "a" { "dw_a" } else { "dw_b" };
                errs.push((name, rel_err(&dq(&wg, "dev")?, &dq(&wc, "cpu")?)?));
            }
            nn::set_fp8_activation_inputs(false);
            let what = format!(
                "{} {dtype:?}{}",
                if mlp {
                    "pre_norm_mlp"
                } else {
                    "causal_self_attention"
                },
                if fp8_act { " FP8 activation input" } else { "" }
            );
            ok &= report(&what, &errs, 1e-1);
        }
    }
    ensure!(ok, "half-blocks out of tolerance (see the lines above)");
    Ok(())
}

/// Loss, dh and the sink's dw of `linear_cross_entropy` on `dev` with
/// logits chunked at `chunk` rows (0: whole), F32 LayerNorm and head
/// built from `vars` (LayerNorm weight, bias, head weight).
fn head_loss(vars: &[Var], h: &Var, t: &Tensor, chunk: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let ln = nn::LayerNorm::new(
        vars[0].as_tensor().clone(),
        vars[1].as_tensor().clone(),
        1e-5,
    )?;
    let head = nn::Linear::new("head.weight", vars[2].as_tensor().clone(), None)?;
    let sink = GradSink::new();
    head.set_grad_sink(Some(sink.clone()))?;
    nn::set_loss_chunk_rows(chunk);
    let loss = nn::linear_cross_entropy(h.as_tensor(), Some(&ln), &head, t);
    nn::set_loss_chunk_rows(nn::DEFAULT_LOSS_CHUNK_ROWS);
    let loss = loss?;
    let grads = loss.backward()?;
    // which path ran: a second backward names what went with the first
    crate::common::head_path_ran(&loss, chunk).map_err(anyhow::Error::msg)?;
    let dw = sink
        .take()?
        .remove("head.weight")
        .ok_or_else(|| anyhow::anyhow!("no sink gradient for the head"))?
        .dequantize(DType::F32)?;
    Ok((loss, g(&grads, h)?, dw))
}

/// The head's loss over chunks of 64 rows (4 chunks of 256 BF16 rows) at
/// a vocabulary that takes cuBLASLt's accumulator (1024) and one that
/// does not (1000), FP8 current scaling.
fn chunked_head(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x4ead);
    let mut ok = true;
    let (d, rows) = (128, 256);
    for vocab in [1024, 1000] {
        let mut cpu = Vec::new();
        let mut on_dev = Vec::new();
        for (i, dims) in [&[d][..], &[d], &[vocab, d]].into_iter().enumerate() {
            let (c, gv) = var(&mut rng, dims, DType::F32, dev)?;
            let fix = |v: &Var| -> Result<Var> {
                let t = match i {
                    0 => (v.as_tensor() * 0.1)?.affine(1.0, 1.0)?,
                    _ => (v.as_tensor() * 0.1)?,
                };
                Ok(Var::from_tensor(&t)?)
            };
            cpu.push(fix(&c)?);
            on_dev.push(fix(&gv)?);
        }
        let (xc, xg) = var(&mut rng, &[2, rows / 2, d], DType::BF16, dev)?;
        let t: Vec<u32> = (0..rows as u32)
            .map(|i| (i * 37 + 11) % vocab as u32)
            .collect();
        let tc = Tensor::from_vec(t, (2, rows / 2), &Device::Cpu)?;
        let tg = tc.to_device(dev)?;
        let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
        // 64 rows a chunk
        let chunk = 64;
        let (lc, dhc, dwc) = head_loss(&cpu, &xc, &tc, chunk)?;
        let (lg, dhg, dwg) = head_loss(&on_dev, &xg, &tg, chunk)?;
        let (lw, dhw, dww) = head_loss(&on_dev, &xg, &tg, 0)?;
        let errs = [
            ("loss vs cpu", rel_err(&lg, &lc)?),
            ("loss vs whole", rel_err(&lg, &lw)?),
            ("dh vs cpu", rel_err(&dhg, &dhc)?),
            ("dh vs whole", rel_err(&dhg, &dhw)?),
            ("dw vs cpu", rel_err(&dwg, &dwc)?),
            ("dw vs whole", rel_err(&dwg, &dww)?),
        ];
        ok &= report(
            &format!("chunked head, vocabulary {vocab}"),
            &errs[2..],
            1e-1,
        );
        ok &= report(
            &format!("chunked head loss, vocabulary {vocab}"),
            &errs[..2],
            1e-3,
        );
    }
    ensure!(
        ok,
        "the chunked head out of tolerance (see the lines above)"
    );
    Ok(())
}

/// The head's loss at GPT-125M's shape (8,192 BF16 rows of width 768,
/// vocabulary 50,304), in chunks of 4,096 and 2,048 rows against the whole
/// logits on the same device: the shapes the example trains with (the
/// small test above cannot meet cuBLASLt's choices for these).
fn chunked_head_gpt(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x125);
    let (d, rows, vocab) = (768, 8192, 50304);
    let mut vars = Vec::new();
    for (i, dims) in [&[d][..], &[d], &[vocab, d]].into_iter().enumerate() {
        let (_, gv) = var(&mut rng, dims, DType::F32, dev)?;
        let t = match i {
            0 => (gv.as_tensor() * 0.1)?.affine(1.0, 1.0)?,
            _ => (gv.as_tensor() * 0.05)?,
        };
        vars.push(Var::from_tensor(&t)?);
    }
    let (_, xg) = var(&mut rng, &[8, rows / 8, d], DType::BF16, dev)?;
    let t: Vec<u32> = (0..rows as u32)
        .map(|i| (i * 7919 + 13) % vocab as u32)
        .collect();
    let tg = Tensor::from_vec(t, (8, rows / 8), &Device::Cpu)?.to_device(dev)?;
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
    let (lw, dhw, dww) = head_loss(&vars, &xg, &tg, 0)?;
    let mut ok = true;
    for chunk in [8192, 4096, 2048] {
        let (l, dh, dw) = head_loss(&vars, &xg, &tg, chunk)?;
        let errs = [
            ("loss", rel_err(&l, &lw)?),
            ("dh", rel_err(&dh, &dhw)?),
            ("dw", rel_err(&dw, &dww)?),
        ];
        // the logits' gradient is cast with its bound's scale, not its amax's
        ok &= report(
            &format!("GPT head, chunks of {chunk} rows vs whole"),
            &errs,
            1e-1,
        );
        // the rows' losses come from the same logits through the same sums
        // (the chunks' fused forward-and-backward kernel included)
        ok &= errs[0].1 == 0.0;
    }
    ensure!(
        ok,
        "the chunked head at GPT's shape out of tolerance (see above)"
    );
    Ok(())
}
