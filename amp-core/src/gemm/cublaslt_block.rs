//! The block-scaled FP8 GEMM on CUDA through cuBLASLt's scale modes
//! (CUDA 12.9 or newer, compute capability 9.0).
//!
//! The operands are those of the per-tensor GEMM (`cublaslt.rs`: "TN",
//! cuBLASLt's A is our `b`, its B our `a`, codes padded with zeros to
//! multiples of 16), each with a scale mode instead of one scalar:
//! - 1 x 128 tiles: `VEC128_32F`, the scales `[tiles along k][rows]` with
//!   the rows contiguous;
//! - 128 x 128 blocks: `BLK128x128_32F`, `[row blocks][tiles along k
//!   padded to a multiple of 4]`, the tiles contiguous (the padding holds
//!   1s: cuBLASLt does not say whether it reads them);
//! - rowwise: `OUTER_VEC_32F`, one scale per row of each operand.
//!
//! The block casts store their scales in these layouts, so the GEMM takes
//! them as they are; rows padded to 16 get scale 1 beside their zero
//! codes.
//!
//! cuBLASLt multiplies by the scales (our `scale_inv`). It takes 1x128 x
//! 128x128, 128x128 x 1x128 and 1x128 x 1x128 (two 128 x 128 operands are
//! refused, as `block_gemm` does), without fast accumulation (refused
//! with these modes), with F32, BF16 or F16 output. A `k` that is not a
//! multiple of 128 makes a short last tile, as on the CPU; padding `k`
//! to 16 adds no tile.

use super::cublaslt::{address, pad, Planned};
use super::plan::{context, OP};
use crate::error::{Error, Result};
use crate::gemm::Epilogue;
use crate::numerics::block::Tiling;
use crate::numerics::format::Fp8Format;
use crate::scaling::block::BlockTensor;
use candle_core::cuda_backend::cudarc::cublaslt::sys;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{DType, Device, Tensor};

/// cuBLASLt's scale mode of an operand tiled so.
fn mode(t: Tiling) -> u8 {
    use sys::cublasLtMatmulMatrixScale_t as M;
    (match t {
        Tiling::Vec128 => M::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
        Tiling::Blk128 => M::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
        Tiling::Row => M::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F,
    }) as u8
}

/// `t` `[r, c]` extended with ones to `[r, cols]` (`dim` 1) or `[rows, c]`
/// (`dim` 0).
fn pad_ones(t: &Tensor, dim: usize, to: usize) -> Result<Tensor> {
    let (r, c) = t.dims2()?;
    let have = if dim == 0 { r } else { c };
    if have >= to {
        return Ok(t.clone());
    }
    let shape = if dim == 0 { (to - r, c) } else { (r, to - c) };
    let ones = Tensor::ones(shape, DType::F32, t.device())?;
    Ok(Tensor::cat(&[t, &ones], dim)?)
}

/// An operand's scales for `rows_p` padded rows: the stored layout is
/// cuBLASLt's (`numerics/block.rs`), so only padded rows add ones (scale
/// 1 for zero codes). 16-byte aligned: cuBLASLt refuses less.
fn gemm_scales(
    q: &BlockTensor,
    rows_p: usize,
    stream: &std::sync::Arc<CudaStream>,
) -> Result<Tensor> {
    let s = q.scale_inv();
    let t = match q.tiling() {
        Tiling::Vec128 => pad_ones(s, 1, rows_p)?,
        Tiling::Blk128 => s.clone(),
        Tiling::Row => pad_ones(s, 0, rows_p)?,
    };
    let t = t.contiguous()?;
    if address(&t, stream)? % 16 == 0 {
        Ok(t)
    } else {
        Ok(t.force_contiguous()?)
    }
}

/// The block-scaled GEMM in cuBLASLt, or `None` where it has no kernel for
/// the operands (E5M2 x E5M2): the caller then runs the reference.
/// Operands as `block_gemm` checked them; an epilogue (a BF16 bias through
/// `CUBLASLT_EPILOGUE_BIAS`, a BF16 residual as C with beta 1) only with
/// BF16 output and `m`, `n`, `k` multiples of 16 (the caller checks).
pub(crate) fn block_gemm(
    a: &BlockTensor,
    b: &BlockTensor,
    out: DType,
    epi: Epilogue<'_>,
) -> Result<Option<Tensor>> {
    let (Some(fa), Some(fb)) = (a.qtype().fp8(), b.qtype().fp8()) else {
        return Ok(None);
    };
    if fa == Fp8Format::E5M2 && fb == Fp8Format::E5M2 {
        return Ok(None);
    }
    let Device::Cuda(dev) = a.device() else {
        return Err(Error::UnsupportedDevice {
            op: OP,
            device: a.device().location(),
        });
    };
    let (m, k) = a.shape().dims2()?;
    let n = b.shape().dims2()?.0;
    if m == 0 || n == 0 || k == 0 {
        return Ok(None);
    }
    let (ad, bd) = (pad(a.data())?, pad(b.data())?);
    let (mp, np) = (ad.dims2()?.0, bd.dims2()?.0);
    let ctx = context(dev)?;
    let mut ctx = ctx.lock().map_err(|_| Error::Poisoned { op: OP })?;
    let stream = ctx.stream.clone();
    // cuBLASLt's A is our b, its B our a.
    let (sa, sb) = (gemm_scales(b, np, &stream)?, gemm_scales(a, mp, &stream)?);
    let scales = (address(&sa, &stream)?, address(&sb, &stream)?);
    let g = Planned {
        ad: &ad,
        bd: &bd,
        mn: (m, n),
        k,
        formats: (fa, fb),
        out,
        // cuBLASLt refuses fast accumulation with the block scale modes
        fast: false,
        modes: [mode(b.tiling()), mode(a.tiling())],
        scales,
    };
    let y = g.launch(&mut ctx, dev, epi)?;
    // the scales stay alive until the GEMM is queued on the stream
    drop((sa, sb));
    Ok(Some(y))
}
