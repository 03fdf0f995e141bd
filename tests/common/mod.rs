//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test binary uses a different subset

use amp::levels::AmpOptimizer;
use amp::nn::ComputeMode;
use amp::{DelayedScaling, Fp8Format};
use candle_core::{DType, Device, Tensor};

/// Every finite non-negative value of `format`, sorted, computed in f64 from
/// the bit fields (an independent model, not the crate's tables).
pub fn positive_values(format: Fp8Format) -> Vec<(f64, u8)> {
    let (mant, bias, has_inf) = match format {
        Fp8Format::E4M3 => (3u32, 7i32, false),
        Fp8Format::E5M2 => (2, 15, true),
    };
    let mut out = Vec::new();
    for code in 0u8..0x80 {
        let e = (code as u32 >> mant) as i32;
        let m = (code as u32 & ((1 << mant) - 1)) as f64;
        let e_max = (1i32 << (7 - mant)) - 1;
        if (has_inf && e == e_max) || (!has_inf && code == 0x7F) {
            continue;
        }
        let v = if e == 0 {
            m * 2f64.powi(1 - bias - mant as i32)
        } else {
            (1.0 + m / (1 << mant) as f64) * 2f64.powi(e - bias)
        };
        out.push((v, code));
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// Round-to-nearest-even with saturation and canonical NaN, in f64.
pub fn model_encode(values: &[(f64, u8)], x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = (x as f64).abs();
    let (max, max_code) = values[values.len() - 1];
    if a >= max {
        return max_code | sign;
    }
    let i = values.partition_point(|&(v, _)| v <= a); // values[i-1] <= a < values[i]
    let (lo, lo_code) = values[i - 1];
    let (hi, hi_code) = values[i];
    let code = if a - lo < hi - a {
        lo_code
    } else if a - lo > hi - a {
        hi_code
    } else if lo_code & 1 == 0 {
        lo_code
    } else {
        hi_code
    };
    code | sign
}

/// Relative Frobenius-norm error of `got` against `want`.
pub fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// A deterministic normal-ish sample (sum of uniforms from xorshift), so that
/// tests need no RNG crate and fail reproducibly.
pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| ((0..4).map(|_| next()).sum::<f64>() - 2.0) as f32 * 1.7)
        .collect()
}

/// The mean squared error of `pred` against `target`.
pub fn mse(pred: &Tensor, target: &Tensor) -> Tensor {
    pred.sub(target)
        .and_then(|d| d.sqr())
        .and_then(|d| d.mean_all())
        .expect("shapes match")
}

/// A CPU F32 tensor of `shape` from `v`.
pub fn t(v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape, &Device::Cpu).expect("shape matches the data")
}

/// A tensor's values as f64, flattened.
pub fn f64s(x: &Tensor) -> Vec<f64> {
    x.flatten_all()
        .and_then(|x| x.to_dtype(DType::F64))
        .and_then(|x| x.to_vec1())
        .expect("float tensor")
}

/// [`randn`] times `scale`, as a tensor of `shape`.
pub fn randt(shape: &[usize], seed: u64, scale: f32) -> Tensor {
    let n = shape.iter().product();
    t(randn(n, seed).iter().map(|v| v * scale).collect(), shape)
}

/// Sets every variable of `varmap`, in name order, to [`randt`] of seed
/// `seed + i` times `scale`: the same initial values in every run that
/// builds the same model.
pub fn seed_varmap(varmap: &candle_nn::VarMap, seed: u64, scale: f32) {
    let data = varmap.data().lock().expect("varmap lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let v = &data[name];
        v.set(&randt(v.dims(), seed + i as u64, scale))
            .expect("a variable set to its own shape");
    }
}

/// The compute modes a fused layer is checked in: native, MS-AMP current
/// scaling, TE delayed scaling (a history of 4), TE block scaling,
/// torchao's rowwise scaling.
pub fn modes() -> [ComputeMode; 5] {
    [
        ComputeMode::Native,
        ComputeMode::Fp8Current(Default::default()),
        ComputeMode::Fp8Delayed(DelayedScaling {
            amax_history_len: 4,
            ..Default::default()
        }),
        ComputeMode::Fp8Block(Default::default()),
        ComputeMode::Fp8Rowwise(Default::default()),
    ]
}

/// Activation dtype and whether the weights' gradients go to a sink: the
/// cases of the fused-layer tests.
pub const DTYPE_SINK: [(DType, bool); 4] = [
    (DType::F32, true),
    (DType::BF16, true),
    (DType::F32, false),
    (DType::BF16, false),
];

/// A tensor's values as f32, flattened (any float dtype).
pub fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Whether a BF16 FP8-GEMM output with its residual added in the GEMM's
/// epilogue (`round(p + r)`, one rounding) agrees with the parts in sequence
/// (`round(r + round(p))`): the two differ by the second rounding, at most
/// one unit in the last place of `round(p)` and of the sum, so by
/// `2^-6 (|parts| + |r|)` per element. Any other difference (a missing
/// bias or residual, a wrong row) is far above that.
pub fn within_one_rerounding(fused: &Tensor, parts: &Tensor, residual: &Tensor) -> bool {
    let (f, p, r) = (values(fused), values(parts), values(residual));
    f.len() == p.len()
        && p.len() == r.len()
        && f.iter()
            .zip(&p)
            .zip(&r)
            .all(|((f, p), r)| (f - p).abs() <= (p.abs() + r.abs()) / 64.0)
}

/// Where the fused path adds the residual in the FP8 GEMM's epilogue: BF16
/// activations, an FP8 mode, the residual taken into the op (a sink).
pub fn residual_in_gemm(mode: &ComputeMode, dtype: DType, with_sink: bool) -> bool {
    dtype == DType::BF16 && with_sink && !matches!(mode, ComputeMode::Native)
}

/// The F32 master value of every parameter, by name.
pub fn masters(opt: &AmpOptimizer) -> Vec<(String, Vec<f32>)> {
    opt.inner()
        .params()
        .iter()
        .map(|p| {
            (
                p.name.clone(),
                p.slot
                    .read()
                    .unwrap()
                    .master_f32()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            )
        })
        .collect()
}

/// Which path ran for a loss from `nn::linear_cross_entropy` backpropagated
/// once: a second backward is an error naming what went with the first
/// (the chunked op's gradients for `chunk > 0`, else the separate loss
/// op's logits). `Err` says what the second backward said instead.
pub fn head_path_ran(loss: &Tensor, chunk: usize) -> Result<(), String> {
    let again = loss
        .backward()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    let went = if chunk > 0 {
        "its gradients went"
    } else {
        "its logits went"
    };
    if again.contains(went) {
        Ok(())
    } else {
        Err(format!("chunk {chunk}: expected \"{went}\", got: {again}"))
    }
}
