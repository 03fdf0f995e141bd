//! The Linear's GEMMs under block scaling (`ComputeMode::Fp8Block`,
//! Transformer Engine's `Float8BlockScaling`) and rowwise scaling
//! (`ComputeMode::Fp8Rowwise`, torchao's recipe: every tile below a whole
//! row along the reduced dimension): every operand cast with one scale per
//! tile, as TE and DeepSeek-V3 lay them out:
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
//! source is its master in high precision (F32, or the FP16 master
//! decoded, O3's on one rank included; an FP16 master's 128 x 128 blocks
//! and their transpose, or its rowwise pair, come from its codes on CUDA
//! without a decode pass, the same operands: [`scaled_weight_operands`]; O3 across ranks, whose master is
//! sharded, decodes the gathered per-tensor E4M3 weight, and its codes
//! recast per block lose nothing: every block's power-of-two scale is at
//! least the tensor's). The weight gradient leaves in F32, to the sink
//! (which keeps it per tensor, as under the other recipes) or to candle.
//!
//! Rowwise scaling runs the same three GEMMs with whole-row tiles; its
//! pairs (`x` and `xᵀ`, `W` and `Wᵀ`, `dy` and `dyᵀ`) read the source
//! twice: every row's and column's amax first, then both casts.
//!
//! A tile holding an inf or a NaN keeps a NaN scale (`numerics/block.rs`),
//! so the products it enters are NaN rather than finite from saturated
//! codes: overflow still reaches the loss scaler, which skips the step.

use crate::error::Result;
use crate::gemm::block::{block_gemm, block_gemm_fused};
use crate::gemm::Epilogue;
use crate::nn::linear::layer_scaling::{record_block, LastCasts, Role};
use crate::numerics::block::Tiling;
use crate::numerics::recipe::TileRecipe;
use crate::numerics::transpose::transpose_2d;
use crate::scaling::block::BlockTensor;
use crate::scaling::telemetry::telemetry_enabled;
use crate::scaling::tensor::ScalingTensor;
use candle_core::{DType, Tensor};

fn fmt(r: &TileRecipe, fwd: bool) -> crate::numerics::qtype::QType {
    if fwd {
        r.fp8_format.forward().into()
    } else {
        r.fp8_format.backward().into()
    }
}

fn cast(t: &Tensor, r: &TileRecipe, fwd: bool, tiling: Tiling) -> Result<BlockTensor> {
    BlockTensor::quantize(&t.contiguous()?, fmt(r, fwd), tiling, r.rule)
}

/// The casts of `t` in `tiling` and of `tᵀ` in the wgrad tiling that are
/// `wanted`: from one read of `t` where both are 1 x 128 (two where both
/// are rows), else one cast each (`tᵀ` through the tiled transpose).
fn cast_pair(
    t: &Tensor,
    r: &TileRecipe,
    fwd: bool,
    tiling: Tiling,
    wanted: (bool, bool),
) -> Result<(Option<BlockTensor>, Option<BlockTensor>)> {
    let t = t.contiguous()?;
    if tiling == r.wgrad && matches!(tiling, Tiling::Vec128 | Tiling::Row) {
        return BlockTensor::quantize_pair(&t, fmt(r, fwd), tiling, r.rule, wanted);
    }
    let a = wanted.0.then(|| cast(&t, r, fwd, tiling)).transpose()?;
    let b = wanted
        .1
        .then(|| cast(&transpose_2d(&t)?, r, fwd, r.wgrad))
        .transpose()?;
    Ok((a, b))
}

/// The error of a cast that did not return what was asked of it.
fn missing() -> crate::error::Error {
    crate::error::Error::Unsupported {
        op: "block Linear",
        what: "a block cast returned no operand".into(),
    }
}

/// The weight's operands from `w` `[out, in]` in high precision: `W` for
/// fprop and, where kept (`keep_t`), `Wᵀ` for dgrad.
pub(crate) fn weight_operands(
    w: &Tensor,
    r: &TileRecipe,
    keep_t: bool,
) -> Result<(BlockTensor, Option<BlockTensor>)> {
    match r.weight {
        Tiling::Blk128 => {
            let wq = cast(w, r, true, Tiling::Blk128)?;
            let w_t = keep_t.then(|| wq.t()).transpose()?;
            Ok((wq, w_t))
        }
        // W and Wᵀ in the same tiles: one read of W where they pair
        t => {
            let w = w.contiguous()?;
            let (wq, w_t) = if matches!(t, Tiling::Vec128 | Tiling::Row) {
                BlockTensor::quantize_pair(&w, fmt(r, true), t, r.rule, (true, keep_t))?
            } else {
                (Some(cast(&w, r, true, t)?), None)
            };
            Ok((wq.ok_or_else(missing)?, w_t))
        }
    }
}

/// [`weight_operands`] of a scaled FP16 weight's value in `dtype` from its
/// codes (`BlockTensor::of_scaled`: the same operands, no decode pass),
/// where that applies: 128 x 128 weight blocks (one read) or rows (two),
/// whole tiles on CUDA, telemetry off (it compares a cast with its
/// decoded source).
pub(crate) fn scaled_weight_operands(
    w: &ScalingTensor,
    dtype: DType,
    r: &TileRecipe,
    keep_t: bool,
) -> Result<Option<(BlockTensor, Option<BlockTensor>)>> {
    if !matches!(r.weight, Tiling::Blk128 | Tiling::Row) || telemetry_enabled() {
        return Ok(None);
    }
    match BlockTensor::of_scaled(w, dtype, fmt(r, true), r.weight, r.rule, (true, keep_t))? {
        Some((Some(wq), w_t)) => Ok(Some((wq, w_t))),
        Some((None, _)) => Err(missing()),
        None => Ok(None),
    }
}

/// fprop: `y = x · Wᵀ` in `x`'s dtype (with `epi`'s addends, see
/// [`block_gemm_fused`]) from the weight's operands `(W, Wᵀ)`
/// ([`weight_operands`]; `w_source`, its high-precision value, for
/// telemetry), and the operands backward takes: the wgrad operand `xᵀ`
/// where kept (`keep_x`) and `Wᵀ` as given. `x` is `[tokens, in]`, read
/// once for both of its 1 x 128 casts.
pub(crate) fn forward(
    x: &Tensor,
    (wq, w_t): (BlockTensor, Option<BlockTensor>),
    w_source: Option<&Tensor>,
    r: &TileRecipe,
    keep_x: bool,
    epi: Epilogue<'_>,
    casts: &LastCasts,
) -> Result<(Tensor, Option<BlockTensor>, Option<BlockTensor>)> {
    let (xq, x_t) = cast_pair(x, r, true, r.input, (true, keep_x))?;
    let xq = xq.ok_or_else(missing)?;
    record_block(casts, Role::Input as usize, &xq, x)?;
    if let Some(w) = w_source {
        record_block(casts, Role::Weight as usize, &wq, w)?;
    }
    let y = block_gemm_fused(&xq, &wq, x.dtype(), epi)?;
    Ok((y, x_t, w_t))
}

/// wgrad's `xᵀ` from `x` `[tokens, in]`: tiled along the tokens.
pub(crate) fn wgrad_operand(x: &Tensor, r: &TileRecipe) -> Result<BlockTensor> {
    cast_pair(x, r, true, r.input, (false, true))?
        .1
        .ok_or_else(missing)
}

/// dgrad's `Wᵀ` from `w` `[out, in]` (cast again in backward under
/// `nn::selective`): the 128 x 128 blocks transposed, or the cast of `Wᵀ`
/// in the weight's tiling.
pub(crate) fn dgrad_operand(w: &Tensor, r: &TileRecipe) -> Result<BlockTensor> {
    match r.weight {
        Tiling::Blk128 => cast(w, r, true, Tiling::Blk128)?.t(),
        t if matches!(t, Tiling::Vec128 | Tiling::Row) => {
            BlockTensor::quantize_pair(&w.contiguous()?, fmt(r, true), t, r.rule, (false, true))?
                .1
                .ok_or_else(missing)
        }
        t => cast(&transpose_2d(&w.contiguous()?)?, r, true, t),
    }
}

/// dgrad (when `need_dx`, in `x_dtype`) and wgrad (F32) from `dy`
/// `[tokens, out]` and the forward's `xᵀ` and `Wᵀ`; `dy` is read once for
/// both of its 1 x 128 casts.
pub(crate) fn backward(
    dy: &Tensor,
    (x_t, w_t): (&BlockTensor, &BlockTensor),
    r: &TileRecipe,
    need_dx: bool,
    x_dtype: DType,
    casts: &LastCasts,
) -> Result<(Option<Tensor>, Tensor)> {
    let (dyq, dy_t) = cast_pair(dy, r, false, r.grad, (need_dx, true))?;
    let slot = Role::GradOutput as usize;
    match (&dyq, &dy_t) {
        (Some(q), _) => record_block(casts, slot, q, dy)?,
        // wgrad alone: dyᵀ's cast, against dyᵀ (only while telemetry records)
        (None, Some(t)) if telemetry_enabled() => {
            record_block(casts, slot, t, &transpose_2d(&dy.contiguous()?)?)?
        }
        _ => {}
    }
    let dx = match dyq {
        Some(dyq) => Some(block_gemm(&dyq, w_t, x_dtype)?),
        None => None,
    };
    let dw = block_gemm(&dy_t.ok_or_else(missing)?, x_t, DType::F32)?;
    Ok((dx, dw))
}
