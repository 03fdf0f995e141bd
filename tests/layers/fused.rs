//! The fused training ops (`amp::nn::fused`) against candle's composed ops
//! in float64: forward values and every gradient, and their errors.

use amp::nn::fused;
use candle_core::{backprop::GradStore, DType, Device, Tensor, Var, D};

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn randn(dims: &[usize], seed: u64) -> R<Tensor> {
    // a reproducible normal-ish tensor (candle's CPU generator is unseeded)
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            let mut u = 0f64;
            for _ in 0..4 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                u += (s >> 11) as f64 / (1u64 << 53) as f64;
            }
            ((u - 2.0) * 1.7) as f32
        })
        .collect();
    Ok(Tensor::from_vec(v, dims, &Device::Cpu)?)
}

fn rel(a: &Tensor, b: &Tensor) -> R<f64> {
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let den = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(num / den.max(1e-300))
}

fn grad(g: &GradStore, v: &Var) -> R<Tensor> {
    Ok(g.get(v).ok_or("no gradient")?.clone())
}

/// The same values as an F32 `Var` (for the fused op) and an F64 one.
fn pair(dims: &[usize], seed: u64) -> R<(Var, Var)> {
    let t = randn(dims, seed)?;
    Ok((
        Var::from_tensor(&t)?,
        Var::from_tensor(&t.to_dtype(DType::F64)?)?,
    ))
}

#[test]
fn cross_entropy_matches_candle_in_f64() -> R<()> {
    for (rows, cols) in [(1usize, 1usize), (7, 5), (64, 257)] {
        let (x, x64) = pair(&[rows, cols], rows as u64)?;
        let t: Vec<u32> = (0..rows).map(|i| ((i * 31) % cols) as u32).collect();
        let t = Tensor::new(t.as_slice(), &Device::Cpu)?;
        let loss = fused::cross_entropy(&x, &t)?;
        let ref_loss = candle_nn::loss::cross_entropy(&x64, &t)?;
        assert!(rel(&loss, &ref_loss)? < 1e-6, "{rows}x{cols} loss");
        let (g, g64) = (loss.backward()?, ref_loss.backward()?);
        let e = rel(&grad(&g, &x)?, &grad(&g64, &x64)?)?;
        assert!(e < 1e-5, "{rows}x{cols} dx {e}");
    }
    Ok(())
}

/// `[batch, seq, classes]` logits with `[batch, seq]` targets: the same
/// loss and gradient bits as the flattened call (one op either way).
#[test]
fn cross_entropy_takes_leading_dims_as_rows() -> R<()> {
    let x = Var::from_tensor(&randn(&[3, 5, 11], 7)?)?;
    let t: Vec<u32> = (0..15).map(|i| ((i * 7) % 11) as u32).collect();
    let t = Tensor::from_vec(t, (3, 5), &Device::Cpu)?;
    let loss = fused::cross_entropy(x.as_tensor(), &t)?;
    let flat = Var::from_tensor(&x.as_tensor().reshape((15, 11))?)?;
    let loss2 = fused::cross_entropy(flat.as_tensor(), &t.flatten_all()?)?;
    assert_eq!(
        loss.to_scalar::<f32>()?.to_bits(),
        loss2.to_scalar::<f32>()?.to_bits()
    );
    let g = loss.backward()?.get(&x).ok_or("no gradient")?.clone();
    let g2 = loss2.backward()?.get(&flat).ok_or("no gradient")?.clone();
    assert_eq!(g.dims(), [3, 5, 11]);
    let bits = |t: &Tensor| -> R<Vec<u32>> {
        Ok(t.flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    };
    assert_eq!(bits(&g)?, bits(&g2)?);
    // targets must have the logits' leading dimensions, not just their count
    let e = fused::cross_entropy(x.as_tensor(), &t.flatten_all()?)
        .err()
        .ok_or("[15] targets for [3, 5, 11] logits accepted")?;
    assert!(e.to_string().contains("[3, 5, 11]"), "{e}");
    Ok(())
}

#[test]
fn cross_entropy_refuses_bad_input_and_keeps_nan() -> R<()> {
    let x = randn(&[4, 10], 1)?;
    let t = Tensor::new(&[0u32, 9, 3, 10], &Device::Cpu)?;
    let e = fused::cross_entropy(&x, &t)
        .err()
        .ok_or("target 10 accepted")?;
    assert!(e.to_string().contains("outside the 10 classes"), "{e}");
    let t = Tensor::new(&[0u32, 1, 2], &Device::Cpu)?;
    assert!(
        fused::cross_entropy(&x, &t).is_err(),
        "3 targets for 4 rows"
    );
    assert!(
        fused::cross_entropy(&x.flatten_all()?, &t).is_err(),
        "rank 1"
    );
    let tf = Tensor::new(&[0f32, 1.0, 2.0, 3.0], &Device::Cpu)?;
    assert!(fused::cross_entropy(&x, &tf).is_err(), "float targets");
    // no rows: an error, not a NaN or an out-of-bounds read
    let empty = Tensor::zeros((0, 10), DType::F32, &Device::Cpu)?;
    let none = Tensor::zeros(0, DType::U32, &Device::Cpu)?;
    assert!(fused::cross_entropy(&empty, &none).is_err(), "no rows");
    // integer targets of other dtypes are taken
    let t8 = Tensor::new(&[0u8, 1, 2, 3], &Device::Cpu)?;
    assert!(fused::cross_entropy(&x, &t8)?
        .to_scalar::<f32>()?
        .is_finite());
    // a NaN logit makes the loss NaN, never a finite number
    let mut v = x.flatten_all()?.to_vec1::<f32>()?;
    v[13] = f32::NAN;
    let xn = Tensor::from_vec(v, (4, 10), &Device::Cpu)?;
    assert!(fused::cross_entropy(&xn, &t8)?.to_scalar::<f32>()?.is_nan());
    Ok(())
}

/// softmax(q kᵀ / sqrt(d) + causal mask) v, composed in float64.
fn attention_ref(q: &Tensor, k: &Tensor, v: &Tensor) -> R<Tensor> {
    let (_, _, t, d) = q.dims4()?;
    let mask: Vec<f64> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
    let s = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(&mask)?;
    Ok(candle_nn::ops::softmax(&s, D::Minus1)?.matmul(v)?)
}

#[test]
fn causal_attention_matches_composed_f64() -> R<()> {
    for dims in [[1usize, 1, 1, 4], [2, 3, 17, 8], [1, 2, 64, 16]] {
        let ((q, q64), (k, k64), (v, v64)) = (pair(&dims, 1)?, pair(&dims, 2)?, pair(&dims, 3)?);
        let r = randn(&dims, 4)?;
        let y = fused::causal_attention(&q, &k, &v)?;
        let y64 = attention_ref(&q64, &k64, &v64)?;
        assert!(rel(&y, &y64)? < 1e-5, "{dims:?} y");
        let g = (&y * &r)?.sum_all()?.backward()?;
        let g64 = (&y64 * r.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
        for (name, a, b) in [("dq", &q, &q64), ("dk", &k, &k64), ("dv", &v, &v64)] {
            let e = rel(&grad(&g, a)?, &grad(&g64, b)?)?;
            assert!(e < 1e-5, "{dims:?} {name} {e}");
        }
    }
    // untracked inputs: the same output, no graph
    let q = randn(&[1, 1, 5, 4], 9)?;
    let y = fused::causal_attention(&q, &q, &q)?;
    assert!(!y.track_op());
    // the first query sees only the first key: its output is v[0]
    let v0 = q.narrow(2, 0, 1)?;
    assert!(rel(&y.narrow(2, 0, 1)?, &v0)? < 1e-6);
    Ok(())
}

#[test]
fn causal_attention_refuses_mismatched_inputs() -> R<()> {
    let q = randn(&[1, 2, 8, 4], 1)?;
    let k = randn(&[1, 2, 7, 4], 2)?;
    assert!(fused::causal_attention(&q, &k, &q).is_err(), "seq 8 vs 7");
    assert!(
        fused::causal_attention(&q.flatten_all()?, &q, &q).is_err(),
        "rank 1"
    );
    let qh = q.to_dtype(DType::BF16)?;
    assert!(
        fused::causal_attention(&qh, &q, &q).is_err(),
        "mixed dtypes"
    );
    let qi = q.to_dtype(DType::U32)?;
    assert!(
        fused::causal_attention(&qi, &qi, &qi).is_err(),
        "integer inputs"
    );
    Ok(())
}

#[test]
fn layer_norm_matches_composed_f64() -> R<()> {
    for (rows, cols) in [(1usize, 1usize), (5, 3), (33, 96)] {
        let (x, x64) = pair(&[rows, cols], 5)?;
        let (w, w64) = pair(&[cols], 6)?;
        let (b, b64) = pair(&[cols], 7)?;
        let r = randn(&[rows, cols], 8)?;
        let y = fused::layer_norm(&x, &w, &b, 1e-5)?;
        let c = x64.broadcast_sub(&x64.mean_keepdim(D::Minus1)?)?;
        let var = c.sqr()?.mean_keepdim(D::Minus1)?;
        let y64 = c
            .broadcast_div(&(var + 1e-5)?.sqrt()?)?
            .broadcast_mul(&w64)?
            .broadcast_add(&b64)?;
        assert!(rel(&y, &y64)? < 1e-5, "{rows}x{cols} y");
        let g = (&y * &r)?.sum_all()?.backward()?;
        let g64 = (&y64 * r.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
        if cols == 1 {
            // one column: x - mean is 0, so y = b, dx = 0 and dw = 0 exactly
            for (name, a) in [("dx", &x), ("dw", &w)] {
                let m = grad(&g, a)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_eq!(m, 0.0, "{rows}x1 {name}");
            }
            assert!(
                rel(&grad(&g, &b)?, &grad(&g64, &b64)?)? < 1e-6,
                "{rows}x1 db"
            );
            continue;
        }
        for (name, a, b) in [("dx", &x, &x64), ("dw", &w, &w64), ("db", &b, &b64)] {
            let e = rel(&grad(&g, a)?, &grad(&g64, b)?)?;
            assert!(e < 1e-4, "{rows}x{cols} {name} {e}");
        }
    }
    let x = randn(&[2, 4], 1)?;
    let w = randn(&[3], 2)?;
    assert!(fused::layer_norm(&x, &w, &w, 1e-5).is_err(), "width 4 vs 3");
    let w = randn(&[4], 2)?;
    let wh = w.to_dtype(DType::BF16)?;
    assert!(fused::layer_norm(&x, &wh, &w, 1e-5).is_err(), "BF16 weight");
    Ok(())
}

#[test]
fn gelu_matches_candle_in_f64() -> R<()> {
    let (x, x64) = pair(&[3, 41], 11)?;
    let r = randn(&[3, 41], 12)?;
    let y = fused::gelu(&x)?;
    let y64 = x64.gelu()?;
    assert!(rel(&y, &y64)? < 1e-6);
    let g = (&y * &r)?.sum_all()?.backward()?;
    let g64 = (&y64 * r.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
    assert!(rel(&grad(&g, &x)?, &grad(&g64, &x64)?)? < 1e-6);
    let xb = x.to_dtype(DType::BF16)?;
    assert!(rel(&fused::gelu(&xb)?, &y64)? < 1e-2, "BF16");
    assert!(fused::gelu(&x.to_dtype(DType::U8)?).is_err());
    Ok(())
}

#[test]
fn attention_from_fused_projection_matches_split_heads() -> R<()> {
    let (b, t, heads, hd) = (2usize, 9usize, 3usize, 4usize);
    let d = heads * hd;
    let (qkv, qkv64) = pair(&[b, t, 3 * d], 21)?;
    let r = randn(&[b, t, d], 22)?.to_dtype(DType::F64)?;
    let y = fused::causal_attention_qkv(&qkv, heads)?;
    let split = |i: usize| -> R<Tensor> {
        Ok(qkv64
            .narrow(2, i * d, d)?
            .reshape((b, t, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let y64 = attention_ref(&split(0)?, &split(1)?, &split(2)?)?
        .transpose(1, 2)?
        .reshape((b, t, d))?;
    assert!(rel(&y, &y64)? < 1e-5, "y");
    let g = (y.to_dtype(DType::F64)? * &r)?.sum_all()?.backward()?;
    let g64 = (&y64 * &r)?.sum_all()?.backward()?;
    let e = rel(&grad(&g, &qkv)?, &grad(&g64, &qkv64)?)?;
    assert!(e < 1e-5, "dqkv {e}");
    assert!(
        fused::causal_attention_qkv(&qkv, 5).is_err(),
        "36 is not 3 x 5 heads"
    );
    assert!(
        fused::causal_attention_qkv(&qkv.flatten_all()?, 3).is_err(),
        "rank 1"
    );
    Ok(())
}

/// GELU's backward with its column sums and amax
/// (`Activation::backward_with_col_sums`): the gradient bit for bit
/// GELU's own backward, the sums those of a bias added to its input
/// (`bias_add`'s gradient), the amax `amax`'s, in F32 and BF16; none for
/// SwiGLU or F16.
#[test]
fn gelu_backward_with_col_sums_is_the_separate_ops() -> R<()> {
    for dtype in [DType::F32, DType::BF16] {
        let z = Var::from_tensor(&randn(&[70, 24], 41)?.to_dtype(dtype)?)?;
        let dy = randn(&[70, 24], 42)?.to_dtype(dtype)?;
        let (dz, sums, amax) = amp::nn::Activation::Gelu
            .backward_with_col_sums(z.as_tensor(), &dy)?
            .ok_or("no fused GELU backward")?;
        let g = (fused::gelu(&z)?.to_dtype(DType::F32)? * dy.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        let sep = grad(&g, &z)?;
        let bits = |t: &Tensor| -> R<Vec<u32>> {
            Ok(t.to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|v| v.to_bits())
                .collect())
        };
        assert_eq!(bits(&dz)?, bits(&sep)?, "{dtype:?} dz");
        let b = Var::zeros(24, DType::F32, &Device::Cpu)?;
        let y = fused::bias_add(&sep.detach(), &b)?;
        let gb = (y.to_dtype(DType::F32)? * sep.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        assert_eq!(bits(&sums)?, bits(&grad(&gb, &b)?)?, "{dtype:?} sums");
        assert_eq!(
            bits(&amax)?,
            bits(&amp::kernels::amax(&sep)?)?,
            "{dtype:?} amax"
        );
    }
    let z = randn(&[4, 8], 43)?;
    assert!(amp::nn::Activation::SwiGlu
        .backward_with_col_sums(&z, &randn(&[4, 4], 44)?)?
        .is_none());
    let h = z.to_dtype(DType::F16)?;
    assert!(amp::nn::Activation::Gelu
        .backward_with_col_sums(&h, &h)?
        .is_none());
    Ok(())
}

#[test]
fn bias_add_sums_the_bias_gradient_over_rows() -> R<()> {
    let x = Var::from_tensor(&randn(&[2, 3, 5], 31)?)?;
    let b = Var::from_tensor(&randn(&[5], 32)?)?;
    let y = fused::bias_add(&x, &b)?;
    assert!(rel(&y, &x.broadcast_add(&b)?)? < 1e-7);
    let r = randn(&[2, 3, 5], 33)?;
    let g = (&y * &r)?.sum_all()?.backward()?;
    assert!(
        rel(&grad(&g, &b)?, &r.sum((0, 1))?)? < 1e-6,
        "db = column sums"
    );
    assert!(rel(&grad(&g, &x)?, &r)? < 1e-7, "dx = dy");
    // F64 keeps its precision (candle's path)
    let x64 = (Tensor::ones((2, 5), DType::F64, &Device::Cpu)? + 1e-12)?;
    let b64 = b.to_dtype(DType::F64)?;
    let kept = ((fused::bias_add(&x64, &b)? - b64.broadcast_as((2, 5))?)? - 1.0)?;
    let kept = kept.min_all()?.to_scalar::<f64>()?;
    assert!(
        (kept - 1e-12).abs() < 1e-15,
        "F64 lost its low bits: {kept}"
    );
    assert!(
        fused::bias_add(&x, &randn(&[4], 1)?).is_err(),
        "width 5 vs 4"
    );
    Ok(())
}

#[test]
fn embedding_matches_index_select_bit_for_bit_with_repeated_ids() -> R<()> {
    let dev = Device::Cpu;
    let table = Var::from_tensor(&randn(&[12, 6], 21)?)?;
    // repeated ids (3 x 4, 7 x 3), every row of a [2, 9] batch
    let ids = Tensor::from_vec(
        vec![3u32, 7, 3, 0, 10, 7, 3, 1, 3, 7, 5, 5, 2, 9, 8, 4, 6, 0],
        (2, 9),
        &dev,
    )?;
    let w = randn(&[2, 9, 6], 22)?;
    let ours = fused::embedding(&ids, table.as_tensor())?;
    let theirs = table
        .index_select(&ids.flatten_all()?, 0)?
        .reshape((2, 9, 6))?;
    assert_eq!(ours.dims(), &[2, 9, 6]);
    assert_eq!(
        ours.flatten_all()?.to_vec1::<f32>()?,
        theirs.flatten_all()?.to_vec1::<f32>()?
    );
    let g_ours = grad(&(ours * &w)?.sum_all()?.backward()?, &table)?;
    let g_theirs = grad(&(theirs * &w)?.sum_all()?.backward()?, &table)?;
    // the same additions in the same order: the same bits
    assert_eq!(
        g_ours.flatten_all()?.to_vec1::<f32>()?,
        g_theirs.flatten_all()?.to_vec1::<f32>()?
    );
    // row 11, which no id names, gets exact zeros
    assert!(g_ours.get(11)?.to_vec1::<f32>()?.iter().all(|&x| x == 0.0));
    Ok(())
}

#[test]
fn embedding_refuses_bad_ids_and_tables() -> R<()> {
    let dev = Device::Cpu;
    let table = randn(&[5, 3], 23)?;
    let ids = Tensor::from_vec(vec![0u32, 5], 2, &dev)?;
    let e = fused::embedding(&ids, &table).unwrap_err().to_string();
    assert!(e.contains("id 5") && e.contains("5 rows"), "{e}");
    let f_ids = Tensor::from_vec(vec![0f32, 1.0], 2, &dev)?;
    assert!(fused::embedding(&f_ids, &table).is_err());
    let ok_ids = Tensor::from_vec(vec![0u32, 1], 2, &dev)?;
    assert!(fused::embedding(&ok_ids, &table.flatten_all()?).is_err());
    // other float tables: candle's path, same values
    let t16 = table.to_dtype(DType::F16)?;
    let y = fused::embedding(&ok_ids, &t16)?;
    assert_eq!(y.dtype(), DType::F16);
    assert_eq!(y.dims(), &[2, 3]);
    Ok(())
}

#[test]
fn rms_norm_matches_composed_f64() -> R<()> {
    // (one column: dx is 1 - xhat² ~ eps / x², all cancellation; not checked)
    for (rows, cols) in [(1usize, 7usize), (5, 3), (33, 96)] {
        let (x, x64) = pair(&[rows, cols], 15)?;
        let (w, w64) = pair(&[cols], 16)?;
        let r = randn(&[rows, cols], 17)?;
        let y = fused::rms_norm(&x, &w, 1e-5)?;
        let ms = x64.sqr()?.mean_keepdim(D::Minus1)?;
        let y64 = x64
            .broadcast_div(&(ms + 1e-5)?.sqrt()?)?
            .broadcast_mul(&w64)?;
        assert!(rel(&y, &y64)? < 1e-5, "{rows}x{cols} y");
        let g = (&y * &r)?.sum_all()?.backward()?;
        let g64 = (&y64 * r.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
        for (name, a, b) in [("dx", &x, &x64), ("dw", &w, &w64)] {
            let e = rel(&grad(&g, a)?, &grad(&g64, b)?)?;
            assert!(e < 1e-4, "{rows}x{cols} {name} {e}");
        }
    }
    // the layer: the fused op while training, candle's kernel for inference
    let w = Var::from_tensor(&randn(&[12], 3)?.affine(0.2, 1.0)?)?;
    let layer = amp::nn::RmsNorm::new_rms(w.as_tensor().clone(), 1e-6)?;
    assert!(layer.is_rms() && layer.vars().len() == 1);
    let x = randn(&[4, 12], 4)?;
    let trained = layer.try_forward(Var::from_tensor(&x)?.as_tensor())?;
    let inferred = layer.try_forward(&x)?;
    assert!(rel(&trained, &inferred)? < 1e-6);
    assert!(
        fused::rms_norm(&x, &randn(&[11], 5)?, 1e-6).is_err(),
        "width 12 vs 11"
    );
    Ok(())
}

#[test]
fn swiglu_matches_composed_f64() -> R<()> {
    for dims in [vec![1usize, 2], vec![3, 5, 14], vec![7, 64]] {
        let (x, x64) = pair(&dims, 21)?;
        let f = dims[dims.len() - 1] / 2;
        let mut out = dims.clone();
        *out.last_mut().ok_or("rank 0")? = f;
        let r = randn(&out, 22)?;
        let y = fused::swiglu(&x)?;
        let last = dims.len() - 1;
        let (a, b) = (x64.narrow(last, 0, f)?, x64.narrow(last, f, f)?);
        let y64 = (candle_nn::ops::silu(&a)? * b)?;
        assert!(rel(&y, &y64)? < 1e-6, "{dims:?} y");
        let g = (&y * &r)?.sum_all()?.backward()?;
        let g64 = (&y64 * r.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
        let e = rel(&grad(&g, &x)?, &grad(&g64, &x64)?)?;
        assert!(e < 1e-6, "{dims:?} dx {e}");
        // BF16: the F32 math rounded once
        let yh = fused::swiglu(&x.to_dtype(DType::BF16)?)?;
        assert_eq!(yh.dtype(), DType::BF16);
        assert!(rel(&yh, &y64)? < 1e-2, "{dims:?} BF16 y");
    }
    assert!(fused::swiglu(&randn(&[2, 3], 1)?).is_err(), "odd width");
    let xi = randn(&[2, 4], 1)?.to_dtype(DType::U32)?;
    assert!(fused::swiglu(&xi).is_err(), "integer input");
    Ok(())
}

/// Grouped-query attention against the float64 reference on key and value
/// heads repeated for each group.
#[test]
fn grouped_query_attention_matches_composed_f64() -> R<()> {
    for (b, h, kvh, t, d) in [
        (1usize, 4usize, 1usize, 9usize, 8usize),
        (2, 6, 2, 17, 4),
        (1, 2, 2, 5, 4),
    ] {
        let (q, q64) = pair(&[b, h, t, d], 31)?;
        let (k, k64) = pair(&[b, kvh, t, d], 32)?;
        let (v, v64) = pair(&[b, kvh, t, d], 33)?;
        let r = randn(&[b, h, t, d], 34)?;
        let y = fused::causal_attention(&q, &k, &v)?;
        let rep = |x: &Tensor| -> R<Tensor> {
            let heads: Vec<Tensor> = (0..h)
                .map(|i| x.narrow(1, i / (h / kvh), 1))
                .collect::<Result<_, _>>()?;
            Ok(Tensor::cat(&heads, 1)?)
        };
        let y64 = attention_ref(&q64, &rep(&k64)?, &rep(&v64)?)?;
        let what = format!("b{b} h{h} kv{kvh} t{t} d{d}");
        assert!(rel(&y, &y64)? < 1e-5, "{what} y");
        let g = (&y * &r)?.sum_all()?.backward()?;
        let g64 = (&y64 * r.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
        for (name, a, b) in [("dq", &q, &q64), ("dk", &k, &k64), ("dv", &v, &v64)] {
            let e = rel(&grad(&g, a)?, &grad(&g64, b)?)?;
            assert!(e < 1e-5, "{what} {name} {e}");
        }
    }
    let q = randn(&[1, 4, 8, 4], 1)?;
    let k3 = randn(&[1, 3, 8, 4], 2)?;
    assert!(
        fused::causal_attention(&q, &k3, &k3).is_err(),
        "4 heads over 3"
    );
    let k2 = randn(&[1, 2, 8, 4], 3)?;
    assert!(
        fused::causal_attention(&q, &k2, &k3).is_err(),
        "k and v differ"
    );
    Ok(())
}
