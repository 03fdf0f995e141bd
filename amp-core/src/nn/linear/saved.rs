//! What a Linear's op keeps for its backward: the GEMM operands as FP8
//! codes (transposed where the backward GEMM takes them K-major) or their
//! sources to cast again (`nn::selective`), block-scaled operands, and an
//! activation's input (as it is, or as E4M3 tiles).

use crate::error::{Error, Result};
use crate::scaling::meta::ScalingMeta;
use crate::scaling::tensor::ScalingTensor;
use candle_core::{DType, Tensor};

/// An activation's input the op keeps for the activation's backward: as
/// it is, or (`nn::set_fp8_activation_inputs`, in an FP8 mode) as E4M3
/// codes with one power-of-two scale per 1 x 128 tile (COAT's FP8
/// activations, with DeepSeek-V3's tiles): a byte an element, decoded in
/// backward.
#[derive(Debug, Clone)]
pub(crate) enum KeptInput {
    /// The input itself.
    Plain(Tensor),
    /// Its tile-scaled E4M3 codes and its dtype.
    Fp8(crate::scaling::block::BlockTensor, candle_core::DType),
}

impl KeptInput {
    /// `z` as kept: FP8 where `fp8`, else as it is.
    pub(crate) fn new(z: &Tensor, fp8: bool) -> Result<Self> {
        if !fp8 {
            return Ok(Self::Plain(z.clone()));
        }
        let q = crate::scaling::block::BlockTensor::quantize(
            z,
            crate::numerics::qtype::QType::E4M3,
            crate::numerics::block::Tiling::Vec128,
            crate::numerics::scale::ScaleRule::PowerOfTwo,
        )?;
        Ok(Self::Fp8(q, z.dtype()))
    }

    /// The input, decoded where kept in FP8.
    pub(crate) fn value(&self) -> Result<Tensor> {
        match self {
            Self::Plain(z) => Ok(z.clone()),
            Self::Fp8(q, dtype) => q.dequantize(*dtype),
        }
    }
}

/// A tensor kept for backward: FP8, or native where that GEMM is overridden.
#[derive(Debug, Clone)]
pub(crate) enum Saved {
    Fp8(ScalingTensor),
    /// FP8, kept transposed (the cast-transpose's second output): the
    /// K-major operand its backward GEMM takes.
    Fp8T(ScalingTensor),
    Native(Tensor),
    /// Block-scaled FP8 (`ComputeMode::Fp8Block`): the backward GEMM's
    /// operand as it takes it (`xᵀ` or `Wᵀ`, see `linear/block.rs`).
    Block(crate::scaling::block::BlockTensor),
    /// A block-scaled operand cast again in backward from `from` (under
    /// `nn::selective`): the input's `xᵀ` (`weight` false) or the weight's
    /// `Wᵀ`, the same cast as the forward's, so the same codes.
    BlockFrom {
        from: Origin,
        weight: bool,
    },
    /// FP8 codes cast again in backward (`nn::selective`): from a tensor
    /// kept anyway, with the forward cast's metadata (its scale), as
    /// [`Saved::Fp8T`] (`transposed`) or [`Saved::Fp8`].
    Recast {
        from: Origin,
        meta: ScalingMeta,
        transposed: bool,
    },
}

/// What an FP8 operand is cast from again in backward: each a tensor that
/// stays alive until then without the op keeping it (see `nn::selective`).
#[derive(Debug, Clone)]
pub(crate) enum Origin {
    /// The value itself (any rank; flattened to rows of its last dimension).
    Value(Tensor),
    /// An activation's input: the operand is its output.
    Activated(crate::nn::Activation, Tensor),
    /// A LayerNorm's input: the operand is the LayerNorm's output.
    Norm(crate::nn::LayerNorm, Tensor),
    /// A weight stored scaled (FP16).
    Scaled(ScalingTensor),
}

impl Origin {
    /// The operand's high-precision value again, as 2-D rows in `dtype`
    /// (what the forward cast: a weight's master converted as the forward
    /// converted it).
    fn value(&self, dtype: DType) -> Result<Tensor> {
        let rows = |t: &Tensor| -> Result<Tensor> {
            let last = t.dim(candle_core::D::Minus1)?;
            Ok(t.detach().reshape(((), last))?.contiguous()?)
        };
        let v = match self {
            // decoded straight into `dtype`, as `Weight::native`
            Self::Scaled(w) => return w.decoded(dtype),
            Self::Value(t) => rows(t)?,
            Self::Activated(act, z) => act.detached(&rows(z)?)?,
            Self::Norm(ln, x) => rows(&ln.recomputed(x)?)?,
        };
        Ok(v.to_dtype(dtype)?)
    }

    /// The operand's codes again, cast with `meta`'s scale (the cast the
    /// forward ran: current scaling's scale from the same amax, delayed
    /// scaling's from the same state), carrying `meta` itself; nothing is
    /// recorded.
    fn recast(&self, meta: &ScalingMeta, transposed: bool) -> Result<ScalingTensor> {
        let rows = |t: &Tensor| -> Result<Tensor> {
            let last = t.dim(candle_core::D::Minus1)?;
            Ok(t.detach().reshape(((), last))?.contiguous()?)
        };
        let (q, qt, _) = match self {
            Self::Scaled(w) => w.requantize_with_t(meta)?,
            Self::Value(t) => ScalingTensor::quantize_with_t(&rows(t)?, meta)?,
            Self::Activated(act, z) => {
                let g = act.detached(&rows(z)?)?;
                ScalingTensor::quantize_with_t(&g, meta)?
            }
            Self::Norm(ln, x) => ScalingTensor::quantize_with_t(&rows(&ln.recomputed(x)?)?, meta)?,
        };
        let codes = if transposed { qt } else { q };
        ScalingTensor::from_parts(codes.data().clone(), meta.clone())
    }
}

impl Saved {
    /// FP8 codes as kept (`transposed`: the cast-transpose's second
    /// output), or to be cast again from `origin` with their metadata.
    pub(crate) fn fp8(q: ScalingTensor, transposed: bool, origin: Option<Origin>) -> Self {
        match origin {
            Some(from) => Self::Recast {
                meta: q.meta().clone(),
                from,
                transposed,
            },
            None if transposed => Self::Fp8T(q),
            None => Self::Fp8(q),
        }
    }

    /// Bytes kept (a recast operand's are its source's, kept anyway, and
    /// its scale's: counted as none).
    pub(crate) fn nbytes(&self) -> usize {
        match self {
            Self::Fp8(t) | Self::Fp8T(t) => t.nbytes(),
            Self::Native(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Self::Block(t) => t.nbytes(),
            Self::Recast { .. } | Self::BlockFrom { .. } => 0,
        }
    }

    /// Kept (or to be recast) transposed.
    pub(crate) fn is_fp8_t(&self) -> bool {
        matches!(
            self,
            Self::Fp8T(_)
                | Self::Recast {
                    transposed: true,
                    ..
                }
        )
    }

    /// The block-scaled operand, as kept or cast again (`dtype`: the
    /// forward's input dtype, which its operands were cast from).
    pub(crate) fn block_operand(
        &self,
        r: &crate::numerics::recipe::TileRecipe,
        dtype: DType,
    ) -> Result<std::borrow::Cow<'_, crate::scaling::block::BlockTensor>> {
        use std::borrow::Cow;
        match self {
            Self::Block(t) => Ok(Cow::Borrowed(t)),
            Self::BlockFrom { from, weight } => {
                let v = from.value(dtype)?;
                Ok(Cow::Owned(if *weight {
                    super::block::dgrad_operand(&v, r)?
                } else {
                    super::block::wgrad_operand(&v, r)?
                }))
            }
            _ => Err(block_alone()),
        }
    }

    /// As kept, with a recast operand cast again.
    pub(crate) fn resolved(&self) -> Result<std::borrow::Cow<'_, Saved>> {
        use std::borrow::Cow;
        Ok(match self {
            Self::Recast {
                from,
                meta,
                transposed,
            } => {
                let q = from.recast(meta, *transposed)?;
                Cow::Owned(if *transposed {
                    Self::Fp8T(q)
                } else {
                    Self::Fp8(q)
                })
            }
            kept => Cow::Borrowed(kept),
        })
    }
}

/// A block-scaled operand saved without the block plan (and so the other
/// operand not block-scaled): never made by the forward.
pub(crate) fn block_alone() -> Error {
    Error::Unsupported {
        op: "amp_fp8_linear backward",
        what: "a block-scaled operand without the block recipe".into(),
    }
}
