//! Rotary position embeddings (`amp::nn::rope`) against candle's composed
//! ops in float64 (forward and `x`'s gradient), the tables of
//! `amp::nn::rope_tables` against the formula computed here in f64 (with
//! and without Llama 3's scaling), and the errors of bad input.

use crate::common;

use amp::nn::{rope, rope_tables, RopeScaling};
use candle_core::{DType, Device, Tensor, Var, D};
use common::randt;

type R<T> = Result<T, Box<dyn std::error::Error>>;

/// `‖a − b‖ / ‖b‖` in f64.
fn rel(a: &Tensor, b: &Tensor) -> R<f64> {
    let (a, b) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let den = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(num / den.max(1e-300))
}

/// RoPE composed of candle's ops on F64 `x` `[b, s, h, d]`: the halves
/// `x1`, `x2` and the tables broadcast over batch and heads, then
/// `cat(x1 cos - x2 sin, x2 cos + x1 sin)`.
fn reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> R<Tensor> {
    let (_, seq, _, d) = x.dims4()?;
    let half = d / 2;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let table = |t: &Tensor| t.to_dtype(DType::F64)?.reshape((1, seq, 1, half));
    let (c, s) = (table(cos)?, table(sin)?);
    let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
    let y2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
    Ok(Tensor::cat(&[y1, y2], D::Minus1)?)
}

/// The fused op's forward and `x`'s gradient of `sum(rope(x) * g)` against
/// the F64 composition, for every float dtype the CPU takes, on odd sizes
/// and a batch of several sequences (the position is the row's second
/// index, not its first); the tables get no gradient.
#[test]
fn rope_matches_the_f64_composition() -> R<()> {
    // the dtype's tolerance: F32 math, the result rounded to the dtype
    let cases = [
        (DType::F32, 1e-6),
        (DType::F64, 1e-6),
        (DType::F16, 2e-3),
        (DType::BF16, 1e-2),
    ];
    for (dtype, tol) in cases {
        for (b, s, h, d) in [
            (1usize, 5usize, 3usize, 6usize),
            (3, 7, 2, 16),
            (1, 1, 1, 2),
        ] {
            let what = format!("{dtype:?} [{b}, {s}, {h}, {d}]");
            let (cos, sin) = rope_tables(s, d, 10_000.0, None, &Device::Cpu)?;
            let cos = Var::from_tensor(&cos)?;
            let x = Var::from_tensor(&randt(&[b, s, h, d], 11 + d as u64, 1.0).to_dtype(dtype)?)?;
            let x64 = Var::from_tensor(&x.to_dtype(DType::F64)?)?;
            let g = randt(&[b, s, h, d], 29 + s as u64, 1.0);

            let y = rope(&x, &cos, &sin)?;
            assert_eq!((y.dims(), y.dtype()), (x.dims(), dtype), "{what}");
            let want = reference(&x64, &cos, &sin)?;
            let e = rel(&y, &want)?;
            assert!(e < tol, "{what}: forward error {e:e}");

            let grads = (y.to_dtype(DType::F32)? * &g)?.sum_all()?.backward()?;
            let dx = grads.get(&x).ok_or("no gradient for x")?;
            assert_eq!((dx.dims(), dx.dtype()), (x.dims(), dtype), "{what}");
            assert!(grads.get(&cos).is_none(), "{what}: a gradient for cos");
            let grads64 = (want * g.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
            let dx64 = grads64.get(&x64).ok_or("no reference gradient")?;
            let e = rel(dx, dx64)?;
            assert!(e < tol, "{what}: gradient error {e:e}");
        }
    }
    Ok(())
}

/// Position 0 (cos 1, sin 0) is the identity, bit for bit; a strided `x`
/// (heads-major, transposed) gives the bits of its contiguous copy.
#[test]
fn rope_keeps_position_zero_and_takes_strided_input() -> R<()> {
    let (cos, sin) = rope_tables(4, 8, 10_000.0, None, &Device::Cpu)?;
    let x = randt(&[2, 4, 3, 8], 3, 1.0);
    let y = rope(&x, &cos, &sin)?;
    let bits = |t: &Tensor| -> R<Vec<u32>> {
        Ok(t.flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    };
    assert_eq!(bits(&y.narrow(1, 0, 1)?)?, bits(&x.narrow(1, 0, 1)?)?);
    let heads_major = randt(&[2, 3, 4, 8], 4, 1.0);
    let strided = heads_major.transpose(1, 2)?;
    assert!(!strided.is_contiguous());
    assert_eq!(
        bits(&rope(&strided, &cos, &sin)?)?,
        bits(&rope(&strided.contiguous()?, &cos, &sin)?)?
    );
    Ok(())
}

/// Wrong ranks, an odd head dimension, tables of the wrong shape or dtype,
/// a non-float `x`: errors, never a panic.
#[test]
fn rope_refuses_bad_input() -> R<()> {
    let dev = Device::Cpu;
    let (cos, sin) = rope_tables(5, 6, 10_000.0, None, &dev)?;
    let x = randt(&[2, 5, 3, 6], 1, 1.0);
    rope(&x, &cos, &sin)?;
    let odd = randt(&[2, 5, 3, 5], 1, 1.0);
    let (c2, s2) = (cos.narrow(1, 0, 2)?, sin.narrow(1, 0, 2)?);
    let e = rope(&odd, &c2, &s2)
        .err()
        .ok_or("odd head dimension accepted")?;
    assert!(e.to_string().contains("rope"), "{e}");
    let short = cos.narrow(0, 0, 4)?;
    assert!(rope(&x, &short, &sin).is_err(), "cos of 4 positions for 5");
    assert!(rope(&x, &cos, &sin.narrow(1, 0, 2)?).is_err(), "sin [5, 2]");
    assert!(rope(&x, &cos.t()?, &sin).is_err(), "cos [3, 5]");
    assert!(
        rope(&x, &cos.flatten_all()?, &sin).is_err(),
        "cos of rank 1"
    );
    assert!(rope(&x.get(0)?, &cos, &sin).is_err(), "x of rank 3");
    let c64 = cos.to_dtype(DType::F64)?;
    assert!(rope(&x, &c64, &sin).is_err(), "F64 cos");
    let xu = Tensor::zeros((2, 5, 3, 6), DType::U32, &dev)?;
    assert!(rope(&xu, &cos, &sin).is_err(), "U32 x");

    assert!(rope_tables(5, 7, 10_000.0, None, &dev).is_err(), "odd dim");
    assert!(rope_tables(5, 0, 10_000.0, None, &dev).is_err(), "dim 0");
    assert!(rope_tables(5, 6, 0.0, None, &dev).is_err(), "theta 0");
    assert!(
        rope_tables(5, 6, f64::NAN, None, &dev).is_err(),
        "theta NaN"
    );
    let bad = RopeScaling {
        factor: 8.0,
        low_freq_factor: 4.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let e = rope_tables(5, 6, 10_000.0, Some(&bad), &dev)
        .err()
        .ok_or("high_freq_factor == low_freq_factor accepted")?;
    assert!(e.to_string().contains("high_freq_factor"), "{e}");
    let zero = RopeScaling { factor: 0.0, ..bad };
    assert!(
        rope_tables(5, 6, 1e4, Some(&zero), &dev).is_err(),
        "factor 0"
    );
    Ok(())
}

/// `cos`, `sin` `[seq, head_dim / 2]` at `(t, i)`, as f64.
fn at(table: &Tensor, t: usize, i: usize) -> R<f64> {
    Ok(f64::from(table.get(t)?.get(i)?.to_scalar::<f32>()?))
}

/// Without scaling: `cos(t theta^(-2i/d))`, `sin(...)` at a few points.
#[test]
fn rope_tables_match_the_formula() -> R<()> {
    let (seq, d, theta) = (40usize, 10usize, 10_000.0f64);
    let (cos, sin) = rope_tables(seq, d, theta, None, &Device::Cpu)?;
    assert_eq!((cos.dims(), cos.dtype()), (&[seq, d / 2][..], DType::F32));
    assert_eq!(sin.dims(), [seq, d / 2]);
    for (t, i) in [(0usize, 0usize), (1, 0), (1, 4), (7, 2), (39, 1), (39, 4)] {
        let angle = t as f64 / theta.powf(2.0 * i as f64 / d as f64);
        assert!(
            (at(&cos, t, i)? - angle.cos()).abs() < 1e-7,
            "cos ({t}, {i})"
        );
        assert!(
            (at(&sin, t, i)? - angle.sin()).abs() < 1e-7,
            "sin ({t}, {i})"
        );
    }
    Ok(())
}

/// Llama 3.2's scaling (factor 32, low 1, high 4, 8192 positions, theta
/// 500000, head dimension 64) against the rule written here from the
/// wavelengths: below 8192 / 4 kept, above 8192 / 1 divided by 32, between
/// them a blend. Every regime occurs; the config's JSON deserializes.
#[test]
fn rope_tables_apply_llama3_scaling() -> R<()> {
    let json = r#"{"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#;
    let scaling: RopeScaling = serde_json::from_str(json)?;
    assert_eq!(
        scaling,
        RopeScaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    );
    let (d, theta) = (64usize, 500_000.0f64);
    let seq = 5000;
    let (cos, sin) = rope_tables(seq, d, theta, Some(&scaling), &Device::Cpu)?;
    let (cos0, _) = rope_tables(seq, d, theta, None, &Device::Cpu)?;
    let mut regimes = [0usize; 3];
    for i in 0..d / 2 {
        let f = (-(2.0 * i as f64 / d as f64) * theta.ln()).exp();
        let wavelength = std::f64::consts::TAU / f;
        let (kept, slow) = (8192.0 / 4.0, 8192.0 / 1.0);
        let scaled = if wavelength < kept {
            regimes[0] += 1;
            f
        } else if wavelength > slow {
            regimes[2] += 1;
            f / 32.0
        } else {
            regimes[1] += 1;
            // 0 at the slow end (f / 32), 1 at the kept end (f)
            let w = (8192.0 / wavelength - 1.0) / 3.0;
            f * (w + (1.0 - w) / 32.0)
        };
        for t in [1usize, 17, 1000, 4999] {
            let angle = t as f64 * scaled;
            let (c, s) = (at(&cos, t, i)?, at(&sin, t, i)?);
            assert!((c - angle.cos()).abs() < 2e-7, "cos ({t}, {i}): {c}");
            assert!((s - angle.sin()).abs() < 2e-7, "sin ({t}, {i}): {s}");
        }
        let changed = at(&cos, 4999, i)? != at(&cos0, 4999, i)?;
        assert_eq!(changed, wavelength >= kept, "pair {i}: scaled or not");
    }
    assert_eq!(regimes, [15, 3, 14], "pairs kept, blended, divided");
    Ok(())
}

/// `rope_attention_qkv` (one op: split, RoPE, grouped-query attention,
/// rows) against the same parts as graph ops: the output and the packed
/// projection's gradient.
#[test]
fn rope_attention_matches_its_parts() -> R<()> {
    for (heads, kv) in [(4usize, 2usize), (2, 2), (4, 1)] {
        let (b, t, hd) = (2usize, 7usize, 8usize);
        let width = (heads + 2 * kv) * hd;
        let x = Var::from_tensor(&randt(&[b, t, width], 71, 1.0))?;
        let g = randt(&[b, t, heads * hd], 72, 1.0);
        let (cos, sin) = rope_tables(9, hd, 10_000.0, None, &Device::Cpu)?;
        let y = amp::nn::fused::rope_attention_qkv(x.as_tensor(), (heads, kv), (&cos, &sin))?;
        let (c, s) = (cos.narrow(0, 0, t)?, sin.narrow(0, 0, t)?);
        let part = |start: usize, n: usize| -> R<Tensor> {
            Ok(x.as_tensor()
                .narrow(2, start * hd, n * hd)?
                .reshape((b, t, n, hd))?)
        };
        let first = |z: Tensor| -> R<Tensor> { Ok(z.transpose(1, 2)?.contiguous()?) };
        let q = first(rope(&part(0, heads)?, &c, &s)?)?;
        let k = first(rope(&part(heads, kv)?, &c, &s)?)?;
        let v = first(part(heads + kv, kv)?)?;
        let want = amp::nn::causal_attention(&q, &k, &v)?
            .transpose(1, 2)?
            .reshape((b, t, heads * hd))?;
        let what = format!("{heads} heads, {kv} kv heads");
        assert!(rel(&y, &want)? < 1e-6, "{what}: y");
        let gy = (&y * &g)?.sum_all()?.backward()?;
        let gw = (&want * &g)?.sum_all()?.backward()?;
        let (dy, dw) = (gy.get(&x).ok_or("no dx")?, gw.get(&x).ok_or("no dx")?);
        assert!(rel(dy, dw)? < 1e-6, "{what}: dx {}", rel(dy, dw)?);
    }
    let x = randt(&[1, 3, 40], 1, 1.0);
    let (cos, sin) = rope_tables(3, 8, 10_000.0, None, &Device::Cpu)?;
    let bad = amp::nn::fused::rope_attention_qkv(&x, (3, 2), (&cos, &sin));
    assert!(bad.is_err(), "2 kv heads do not divide 3");
    // (2, 1) heads of x [1, 3, 40]: a head dimension of 10. Tables of too
    // few positions, of another width, or not F32, are refused before any
    // work; its own tables are taken.
    let (cos, sin) = rope_tables(3, 10, 10_000.0, None, &Device::Cpu)?;
    let ok = amp::nn::fused::rope_attention_qkv(&x, (2, 1), (&cos, &sin));
    assert!(ok.is_ok(), "the input with its own tables: {ok:?}");
    let short = rope_tables(2, 10, 10_000.0, None, &Device::Cpu)?;
    let bad = amp::nn::fused::rope_attention_qkv(&x, (2, 1), (&short.0, &short.1));
    assert!(bad.is_err(), "tables of 2 positions for 3");
    let wide = rope_tables(3, 8, 10_000.0, None, &Device::Cpu)?;
    let bad = amp::nn::fused::rope_attention_qkv(&x, (2, 1), (&wide.0, &wide.1));
    assert!(bad.is_err(), "tables for a head dimension of 8");
    let half = (cos.to_dtype(DType::BF16)?, sin.to_dtype(DType::BF16)?);
    let bad = amp::nn::fused::rope_attention_qkv(&x, (2, 1), (&half.0, &half.1));
    assert!(bad.is_err(), "BF16 tables");
    Ok(())
}
