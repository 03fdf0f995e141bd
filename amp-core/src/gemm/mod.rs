//! The FP8 GEMM reference (CPU): what the cuBLASLt GEMM is tested against.
//!
//! # Layout
//! `fp8_gemm(a, b)` takes `a` as `[m, k]` and `b` as `[n, k]`, both
//! row-major with `k` contiguous, and returns `[m, n] = A · Bᵀ` with
//! `A = decode(a) · a.scale_inv` and `B = decode(b) · b.scale_inv`. This is
//! a Linear layer's `x · Wᵀ` with `W` stored `[out, in]`, and it is the only
//! layout Hopper's FP8 tensor cores take: in cuBLASLt's column-major terms
//! the call is `D = op(A) · op(B)` with `transa = T`, `transb = N` ("TN"),
//! `A` = our `b` (k × n, transposed) and `B` = our `a` (k × m), so both
//! operands have `k` as their leading dimension.
//!
//! # Numerics
//! The codes are decoded without scaling (every product of two FP8 values is
//! exact in f32), multiplied and summed in f32, and the sum is multiplied
//! once by `a.scale_inv * b.scale_inv`, as cuBLASLt applies its scale
//! pointers. Only the order of the f32 accumulation may differ between
//! devices.
//!
//! # Devices
//! On CUDA the GEMM runs in cuBLASLt (feature `cuda`; see `cublaslt.rs`
//! for padding, scale pointers and the plan cache), except E5M2 x E5M2,
//! which cuBLASLt lacks: that pair takes the decode-and-matmul path on the
//! device. `fast_accum` ([`fp8_gemm_with`]) is cuBLASLt's FAST_ACCUM (Hopper
//! folds partial sums into F32 less often), which Transformer Engine uses
//! for fprop; it changes nothing on the CPU.
//!
//! # Epilogue
//! [`fp8_gemm_fused`] adds a residual `[m, n]` and a bias `[n]` to the
//! scaled product before the output's one rounding:
//! `round((A · Bᵀ · α + residual) + bias)`, the sums in f32, each addend
//! taken as the value of its own dtype. On CUDA with BF16 output, a BF16
//! bias and residual and no padding this is cuBLASLt's epilogue (beta = 1
//! on the residual as C, `CUBLASLT_EPILOGUE_BIAS`: cuBLASLt takes only a
//! BF16 bias with BF16 output), so neither addend costs a pass over the
//! output; otherwise the F32 product and the same two adds in f32.
//!
//! # Block scaling
//! [`block::block_gemm`] is the same product of two
//! [`BlockTensor`](crate::BlockTensor)s (one scale per 1 x 128 tile, 128 x
//! 128 block or row), through cuBLASLt's scale modes on CUDA
//! (`cublaslt_block.rs`).
//!
//! # The output's amax
//! [`fp8_gemm_amax`] also returns `max |y|` (amp-core's amax: NaN
//! propagates), NaN where either operand's cast saw a non-finite value (its
//! metadata's amax), as the FP8 Linear's flag makes its outputs, from one
//! amax pass over the output. cuBLASLt's `AMAX_D_POINTER` was tried: on the
//! H100 with CUDA 13.0 it refused F32 output (the GPT's weight gradients),
//! and with BF16 output it may take the amax before D's rounding.

use crate::error::{Error, Result};
use crate::numerics::cast::Dequantize;
use crate::numerics::kernel::arity;
use crate::numerics::kernel::{launch, Kernel};
use crate::numerics::qtype::QType;
use crate::scaling::tensor::ScalingTensor;
use candle_core::{DType, Tensor};

pub(crate) mod block;
#[cfg(feature = "cuda")]
mod cublaslt;
#[cfg(not(feature = "cuda"))]
#[path = "cublaslt_stub.rs"]
mod cublaslt;
#[cfg(feature = "cuda")]
mod cublaslt_block;
#[cfg(feature = "cuda")]
mod plan;

const OP: &str = "fp8_gemm";

/// The operand checks of every GEMM here (see [`fp8_gemm`]'s errors).
fn check_operands(a: &ScalingTensor, b: &ScalingTensor, out_dtype: DType) -> Result<()> {
    for t in [a, b] {
        if t.qtype().fp8().is_none() {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("operand of type {}: FP8 only", t.qtype()),
            });
        }
        if t.shape().rank() != 2 {
            return Err(Error::Rank {
                op: OP,
                expected: 2,
                got: t.shape().clone(),
            });
        }
    }
    check_pair(
        OP,
        (a.shape(), a.device()),
        (b.shape(), b.device()),
        out_dtype,
    )
}

/// What every GEMM here checks of its two 2-D operands `[m, k]`, `[n, k]`:
/// the same `k`, one device, an F32, BF16 or F16 output.
pub(crate) fn check_pair(
    op: &'static str,
    (sa, da): (&candle_core::Shape, &candle_core::Device),
    (sb, db): (&candle_core::Shape, &candle_core::Device),
    out_dtype: DType,
) -> Result<()> {
    if sa.dims()[1] != sb.dims()[1] {
        return Err(Error::Shape {
            op,
            lhs: sa.clone(),
            rhs: sb.clone(),
        });
    }
    if !da.same_device(db) {
        return Err(Error::Device {
            op,
            lhs: da.location(),
            rhs: db.location(),
        });
    }
    if !matches!(out_dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::DType {
            op,
            expected: "F32, BF16 or F16",
            got: out_dtype,
        });
    }
    Ok(())
}

/// The addends of an epilogue: a bias `[n]` and a residual `[m, n]`, of a
/// float dtype, on `device`.
pub(crate) fn check_epilogue(
    op: &'static str,
    epi: &Epilogue<'_>,
    (m, n): (usize, usize),
    device: &candle_core::Device,
) -> Result<()> {
    let checks = [(epi.bias, vec![n]), (epi.residual, vec![m, n])];
    for (t, want) in checks.iter().filter_map(|(t, w)| t.map(|t| (t, w))) {
        if t.dims() != want.as_slice() {
            return Err(Error::Shape {
                op,
                lhs: t.shape().clone(),
                rhs: want.clone().into(),
            });
        }
        if !t.dtype().is_float() {
            return Err(Error::DType {
                op,
                expected: "a float bias or residual",
                got: t.dtype(),
            });
        }
        if !t.device().same_device(device) {
            return Err(Error::Device {
                op,
                lhs: device.location(),
                rhs: t.device().location(),
            });
        }
    }
    Ok(())
}

/// `A · Bᵀ` of two FP8 tensors, `a: [m, k]`, `b: [n, k]`, accumulated in f32,
/// returned as `out_dtype` (F32, BF16 or F16). See the module docs for the
/// layout.
///
/// # Errors
/// [`Error::Unsupported`] for FP16 operands, [`Error::Rank`] unless both are
/// 2-D, [`Error::Shape`] when `k` differs, [`Error::Device`],
/// [`Error::DType`] for another output dtype.
pub fn fp8_gemm(a: &ScalingTensor, b: &ScalingTensor, out_dtype: DType) -> Result<Tensor> {
    fp8_gemm_with(a, b, out_dtype, false)
}

/// [`fp8_gemm`] with the choice of fast accumulation (see the module docs).
///
/// # Errors
/// As [`fp8_gemm`]; on CUDA also cuBLASLt's, and [`Error::NotCompiled`]
/// for CUDA tensors in a build without the `cuda` feature.
pub fn fp8_gemm_with(
    a: &ScalingTensor,
    b: &ScalingTensor,
    out_dtype: DType,
    fast_accum: bool,
) -> Result<Tensor> {
    check_operands(a, b, out_dtype)?;
    gemm_checked(a, b, out_dtype, fast_accum)
}

/// [`fp8_gemm_with`] on operands [`check_operands`] accepted.
fn gemm_checked(
    a: &ScalingTensor,
    b: &ScalingTensor,
    out_dtype: DType,
    fast_accum: bool,
) -> Result<Tensor> {
    let both_e5m2 = a.qtype() == QType::E5M2 && b.qtype() == QType::E5M2;
    if a.device().is_cuda() && !both_e5m2 {
        return cublaslt::fp8_gemm(a, b, out_dtype, fast_accum, Default::default());
    }
    let unit = Tensor::ones(1, DType::F32, a.device())?;
    let decode = |t: &ScalingTensor| -> Result<Tensor> {
        let op = Dequantize {
            qtype: t.qtype(),
            dtype: DType::F32,
        };
        let [v] = <[Tensor; 1]>::try_from(launch(&op, &[t.data(), &unit])?)
            .map_err(|_| arity(Dequantize::NAME))?;
        Ok(v)
    };
    let alpha = (a.meta().scale_inv() * b.meta().scale_inv())?;
    let acc = decode(a)?.matmul(&decode(b)?.t()?)?;
    Ok(acc.broadcast_mul(&alpha)?.to_dtype(out_dtype)?)
}

/// What [`fp8_gemm_fused`] adds to the scaled product before rounding.
#[derive(Debug, Clone, Copy, Default)]
pub struct Epilogue<'a> {
    /// `[n]`, added to every row (a Linear's bias).
    pub bias: Option<&'a Tensor>,
    /// `[m, n]`, added to the product (a residual stream).
    pub residual: Option<&'a Tensor>,
}

/// `round_out((A · Bᵀ · α + residual) + bias)` (see the module docs'
/// Epilogue): [`fp8_gemm_with`] with the residual and the bias added before
/// the one rounding to `out_dtype`.
///
/// # Errors
/// As [`fp8_gemm_with`]; [`Error::Shape`] for a bias that is not `[n]` or
/// a residual that is not `[m, n]`, [`Error::DType`] for a non-float
/// addend, [`Error::Device`] for one on another device.
pub fn fp8_gemm_fused(
    a: &ScalingTensor,
    b: &ScalingTensor,
    out_dtype: DType,
    fast_accum: bool,
    epi: Epilogue<'_>,
) -> Result<Tensor> {
    if epi.bias.is_none() && epi.residual.is_none() {
        return fp8_gemm_with(a, b, out_dtype, fast_accum);
    }
    check_operands(a, b, out_dtype)?;
    let (m, n) = (a.shape().dims()[0], b.shape().dims()[0]);
    check_epilogue(OP, &epi, (m, n), a.device())?;
    let both_e5m2 = a.qtype() == QType::E5M2 && b.qtype() == QType::E5M2;
    let in_lt = |t: Option<&Tensor>| t.is_none_or(|t| t.dtype() == DType::BF16);
    if a.device().is_cuda()
        && !both_e5m2
        && out_dtype == DType::BF16
        && in_lt(epi.bias)
        && in_lt(epi.residual)
        && m % 16 == 0
        && n % 16 == 0
        && a.shape().dims()[1] % 16 == 0
    {
        return cublaslt::fp8_gemm(a, b, out_dtype, fast_accum, epi);
    }
    // the product in f32, then the addends in the epilogue's order
    let mut y = gemm_checked(a, b, DType::F32, fast_accum)?;
    if let Some(r) = epi.residual {
        y = (y + r.to_dtype(DType::F32)?)?;
    }
    if let Some(bias) = epi.bias {
        y = y.broadcast_add(&bias.to_dtype(DType::F32)?)?;
    }
    Ok(y.to_dtype(out_dtype)?)
}

/// `A · Bᵀ · α + acc` in F32: [`fp8_gemm`]'s F32 product with `acc`
/// (`[m, n]` F32) added before the output is written (on CUDA cuBLASLt's
/// C with beta = 1 where no operand needs padding, else a separate add);
/// without `acc` the product alone. Sums over chunks of `k` (a weight
/// gradient over chunks of tokens) stay in F32.
///
/// # Errors
/// As [`fp8_gemm`]; [`Error::Shape`] or [`Error::DType`] for an `acc`
/// that is not `[m, n]` F32.
pub fn fp8_gemm_acc(a: &ScalingTensor, b: &ScalingTensor, acc: Option<&Tensor>) -> Result<Tensor> {
    let Some(acc) = acc else {
        return fp8_gemm_with(a, b, DType::F32, false);
    };
    check_operands(a, b, DType::F32)?;
    let (m, n) = (a.shape().dims()[0], b.shape().dims()[0]);
    let epi = Epilogue {
        bias: None,
        residual: Some(acc),
    };
    check_epilogue(OP, &epi, (m, n), a.device())?;
    if acc.dtype() != DType::F32 {
        return Err(Error::DType {
            op: OP,
            expected: "an F32 accumulator",
            got: acc.dtype(),
        });
    }
    let both_e5m2 = a.qtype() == QType::E5M2 && b.qtype() == QType::E5M2;
    if a.device().is_cuda()
        && !both_e5m2
        && m % 16 == 0
        && n % 16 == 0
        && a.shape().dims()[1] % 16 == 0
    {
        return cublaslt::fp8_gemm(a, b, DType::F32, false, epi);
    }
    Ok((gemm_checked(a, b, DType::F32, false)? + acc)?)
}

/// [`fp8_gemm_with`] and the output's amax: `(y, amax)`, `amax` a 1-element
/// F32 tensor, `max |y|` times `a`'s and `b`'s non-finite flags (see the
/// module docs).
///
/// # Errors
/// As [`fp8_gemm_with`].
pub fn fp8_gemm_amax(
    a: &ScalingTensor,
    b: &ScalingTensor,
    out_dtype: DType,
    fast_accum: bool,
) -> Result<(Tensor, Tensor)> {
    let y = fp8_gemm_with(a, b, out_dtype, fast_accum)?;
    let [amax] = <[Tensor; 1]>::try_from(launch(&crate::numerics::cast::Amax, &[&y])?)
        .map_err(|_| arity(crate::numerics::cast::Amax::NAME))?;
    let amax = crate::scaling::flag::flagged(&amax, &a.meta().amax()?)?;
    Ok((y, crate::scaling::flag::flagged(&amax, &b.meta().amax()?)?))
}
