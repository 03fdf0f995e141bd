//! The block-scaled FP8 GEMM: `[m, n] = A · Bᵀ` of two [`BlockTensor`]s,
//! `a: [m, k]`, `b: [n, k]`, in the layout of [`fp8_gemm`](super::fp8_gemm)
//! (a Linear's `x · Wᵀ`), with the scales of each 128-long stretch of `k`
//! applied to that stretch's partial sum, as Hopper's block-scaled kernels
//! apply them.
//!
//! # Pairs of tilings
//! The pairs Transformer Engine's `Float8BlockScaling` and torchao's
//! rowwise recipe use, and cuBLASLt runs:
//! - `a` 1 x 128, `b` 128 x 128: fprop (`x · Wᵀ`) and dgrad (`dy · W`, with
//!   `b` = `Wᵀ`, [`BlockTensor::t`]);
//! - `a` 1 x 128, `b` 1 x 128: wgrad (`dyᵀ · x`, both tiled along the
//!   tokens);
//! - `a` 128 x 128, `b` 1 x 128: the fprop with the operands' roles swapped;
//! - rowwise both: `y[i, j] = (Σ a_ik b_jk) · sa[i] · sb[j]`.
//!
//! # Numerics
//! The reference (CPU, and CUDA where cuBLASLt cannot run the shape)
//! decodes each operand with its tiles' `scale_inv` into f32 and multiplies
//! in f32. With power-of-two scales the decoded values are exact, so the
//! result equals the per-stretch sum up to the order of the f32
//! accumulation, the only freedom the GPU has too.

use crate::error::{Error, Result};
use crate::gemm::Epilogue;
use crate::numerics::block::Tiling;
use crate::scaling::block::BlockTensor;
use candle_core::{DType, Tensor};

const OP: &str = "block_gemm";

/// Whether `block_gemm` takes operands tiled `(a, b)`.
pub fn supported_tilings(a: Tiling, b: Tiling) -> bool {
    use Tiling::*;
    matches!(
        (a, b),
        (Vec128, Blk128) | (Vec128, Vec128) | (Blk128, Vec128) | (Row, Row)
    )
}

fn check(a: &BlockTensor, b: &BlockTensor, out_dtype: DType) -> Result<()> {
    if !supported_tilings(a.tiling(), b.tiling()) {
        return Err(Error::Unsupported {
            op: OP,
            what: format!(
                "operands tiled {} x {} (1x128 x 128x128, 1x128 x 1x128, 128x128 x 1x128 or \
                 rowwise x rowwise)",
                a.tiling(),
                b.tiling()
            ),
        });
    }
    super::check_pair(
        OP,
        (a.shape(), a.device()),
        (b.shape(), b.device()),
        out_dtype,
    )
}

/// `A · Bᵀ` of two block-scaled FP8 tensors (see the module docs), returned
/// as `out_dtype` (F32, BF16 or F16).
///
/// # Errors
/// [`Error::Unsupported`] for a pair of tilings the module docs do not list,
/// [`Error::Shape`] when `k` differs, [`Error::Device`], [`Error::DType`]
/// for another output dtype; on CUDA, cuBLASLt's.
pub fn block_gemm(a: &BlockTensor, b: &BlockTensor, out_dtype: DType) -> Result<Tensor> {
    check(a, b, out_dtype)?;
    if a.device().is_cuda() {
        if let Some(y) = super::cublaslt::block_gemm(a, b, out_dtype, Epilogue::default())? {
            return Ok(y);
        }
    }
    reference(a, b, out_dtype)
}

/// `round_out((A · Bᵀ + residual) + bias)`: [`block_gemm`] with the
/// addends of [`fp8_gemm_fused`](super::fp8_gemm_fused) added before the
/// output's one rounding, in cuBLASLt's epilogue where it takes them (BF16
/// output, bias and residual, every dimension a multiple of 16), else as
/// the F32 product and the two adds.
///
/// # Errors
/// As [`block_gemm`]; [`Error::Shape`] for a bias that is not `[n]` or a
/// residual that is not `[m, n]`, [`Error::DType`] for a non-float addend,
/// [`Error::Device`] for one on another device.
pub fn block_gemm_fused(
    a: &BlockTensor,
    b: &BlockTensor,
    out_dtype: DType,
    epi: Epilogue<'_>,
) -> Result<Tensor> {
    if epi.bias.is_none() && epi.residual.is_none() {
        return block_gemm(a, b, out_dtype);
    }
    check(a, b, out_dtype)?;
    let (m, k) = (a.shape().dims()[0], a.shape().dims()[1]);
    let n = b.shape().dims()[0];
    super::check_epilogue(OP, &epi, (m, n), a.device())?;
    let bf16 = |t: Option<&Tensor>| t.is_none_or(|t| t.dtype() == DType::BF16);
    let aligned = m % 16 == 0 && n % 16 == 0 && k % 16 == 0;
    if a.device().is_cuda()
        && out_dtype == DType::BF16
        && bf16(epi.bias)
        && bf16(epi.residual)
        && aligned
    {
        if let Some(y) = super::cublaslt::block_gemm(a, b, out_dtype, epi)? {
            return Ok(y);
        }
    }
    let mut y = block_gemm(a, b, DType::F32)?;
    if let Some(r) = epi.residual {
        y = (y + r.to_dtype(DType::F32)?)?;
    }
    if let Some(bias) = epi.bias {
        y = y.broadcast_add(&bias.to_dtype(DType::F32)?)?;
    }
    Ok(y.to_dtype(out_dtype)?)
}

/// The decode-and-multiply reference (see the module docs).
pub(crate) fn reference(a: &BlockTensor, b: &BlockTensor, out_dtype: DType) -> Result<Tensor> {
    let ya = a.dequantize(DType::F32)?;
    let yb = b.dequantize(DType::F32)?;
    Ok(ya.matmul(&yb.t()?)?.to_dtype(out_dtype)?)
}
