//! The Linear's GEMMs under block scaling (`ComputeMode::Fp8Block`,
//! Transformer Engine's `Float8BlockScaling`): every operand cast with one
//! scale per tile, as TE and DeepSeek-V3 lay them out:
//!
//! | GEMM | `a` (tiles along the reduced dim) | `b` |
//! |---|---|---|
//! | fprop `y = x · Wᵀ` | `x` 1 x 128 along the features | `W` 128 x 128 (or 1 x 128) |
//! | dgrad `dx = dy · W` | `dy` 1 x 128 along the outputs | `Wᵀ`: the blocks transposed (exact), or a 1 x 128 cast of `Wᵀ` |
//! | wgrad `dW = dyᵀ · x` | `dyᵀ` 1 x 128 along the tokens | `xᵀ` 1 x 128 along the tokens |
//!
//! A 1 x 128 tile of `x` is a 128 x 1 tile of `xᵀ`: the wgrad operand is a
//! cast of its own from the high-precision `x` (as TE's "columnwise" copy,
//! not a transpose of the forward's codes, which would quantize twice),
//! made in the forward and kept for backward instead of `x`. The weight's
//! source is its master in high precision (F32, or an FP16 or FP8 stored
//! weight decoded: an O3 weight's per-tensor E4M3 codes recast per block
//! lose nothing, every tile scale being a power of two at least the
//! tensor's). The weight gradient leaves in F32, to the sink (which keeps
//! it per tensor, as under the other recipes) or to candle.
//!
//! A non-finite input, weight or output gradient makes every scale of its
//! operand NaN ([`BlockTensor::flagged`]), so the products are NaN rather
//! than finite from saturated codes: overflow still skips the step.

use crate::error::Result;
use crate::gemm::block::block_gemm;
use crate::numerics::block::Tiling;
use crate::numerics::recipe::Float8BlockScaling;
use crate::scaling::block::BlockTensor;
use candle_core::{DType, Tensor};

fn cast(t: &Tensor, r: &Float8BlockScaling, fwd: bool, tiling: Tiling) -> Result<BlockTensor> {
    let fmt = if fwd {
        r.fp8_format.forward()
    } else {
        r.fp8_format.backward()
    };
    BlockTensor::quantize(&t.contiguous()?, fmt.into(), tiling, r.scale_rule())?.flagged()
}

/// fprop: `y = x · Wᵀ` in `x`'s dtype, and the operands backward takes
/// where it keeps them (`keep`: the input's, the weight's): the wgrad
/// operand `xᵀ` and the dgrad operand `Wᵀ`. `x` is `[tokens, in]`, `w`
/// `[out, in]` in high precision.
pub(crate) fn forward(
    x: &Tensor,
    w: &Tensor,
    r: &Float8BlockScaling,
    keep: (bool, bool),
) -> Result<(Tensor, Option<BlockTensor>, Option<BlockTensor>)> {
    let xq = cast(x, r, true, r.input_tiling())?;
    let wq = cast(w, r, true, r.weight_tiling())?;
    let y = block_gemm(&xq, &wq, x.dtype())?;
    drop(xq);
    let x_t = keep.0.then(|| wgrad_operand(x, r)).transpose()?;
    let w_t = keep.1.then(|| dgrad_operand(w, Some(wq), r)).transpose()?;
    Ok((y, x_t, w_t))
}

/// wgrad's `xᵀ` from `x` `[tokens, in]`: 1 x 128 along the tokens.
pub(crate) fn wgrad_operand(x: &Tensor, r: &Float8BlockScaling) -> Result<BlockTensor> {
    cast(&x.t()?, r, true, Tiling::Vec128)
}

/// dgrad's `Wᵀ` from `w` `[out, in]`: the fprop cast's blocks transposed
/// (cast here when not given), or a 1 x 128 cast of `Wᵀ`.
pub(crate) fn dgrad_operand(
    w: &Tensor,
    fprop: Option<BlockTensor>,
    r: &Float8BlockScaling,
) -> Result<BlockTensor> {
    match r.weight_tiling() {
        Tiling::Blk128 => match fprop {
            Some(wq) => wq.t(),
            None => cast(w, r, true, Tiling::Blk128)?.t(),
        },
        t => cast(&w.t()?, r, true, t),
    }
}

/// dgrad (when `need_dx`, in `x_dtype`) and wgrad (F32) from `dy`
/// `[tokens, out]` and the forward's `xᵀ` and `Wᵀ`.
pub(crate) fn backward(
    dy: &Tensor,
    (x_t, w_t): (&BlockTensor, &BlockTensor),
    r: &Float8BlockScaling,
    need_dx: bool,
    x_dtype: DType,
) -> Result<(Option<Tensor>, Tensor)> {
    let dx = if need_dx {
        let dyq = cast(dy, r, false, r.grad_tiling())?;
        Some(block_gemm(&dyq, w_t, x_dtype)?)
    } else {
        None
    };
    let dy_t = cast(&dy.t()?, r, false, Tiling::Vec128)?;
    let dw = block_gemm(&dy_t, x_t, DType::F32)?;
    Ok((dx, dw))
}
