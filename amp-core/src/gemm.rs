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
//! On CUDA the GEMM runs in cuBLASLt (feature `cuda`; see the CUDA module
//! for padding, scale pointers and the plan cache), except E5M2 x E5M2,
//! which cuBLASLt lacks: that pair takes the decode-and-matmul path on the
//! device. `fast_accum` ([`fp8_gemm_with`]) is cuBLASLt's FAST_ACCUM (Hopper
//! folds partial sums into F32 less often), which Transformer Engine uses
//! for fprop; it changes nothing on the CPU.

use crate::cast::{arity, Dequantize};
use crate::error::{Error, Result};
use crate::kernel::{launch, Kernel};
use crate::qtype::QType;
use crate::tensor::ScalingTensor;
use candle_core::{DType, Tensor};

const OP: &str = "fp8_gemm";

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
    if a.shape().dims()[1] != b.shape().dims()[1] {
        return Err(Error::Shape {
            op: OP,
            lhs: a.shape().clone(),
            rhs: b.shape().clone(),
        });
    }
    if !a.device().same_device(b.device()) {
        return Err(Error::Device {
            op: OP,
            lhs: a.device().location(),
            rhs: b.device().location(),
        });
    }
    if !matches!(out_dtype, DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::DType {
            op: OP,
            expected: "F32, BF16 or F16",
            got: out_dtype,
        });
    }
    let both_e5m2 = a.qtype() == QType::E5M2 && b.qtype() == QType::E5M2;
    if a.device().is_cuda() && !both_e5m2 {
        return crate::cuda::fp8_gemm(a, b, out_dtype, fast_accum);
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
