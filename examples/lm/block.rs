//! A model's pre-norm block as both examples run it: its two halves as
//! `amp::nn::pre_norm_block` takes them, on a tensor (what full
//! recomputation reruns) or on the residual stream (handed from block to
//! block where the block can).

use crate::recompute::CoreResult;
use amp::nn::{self, Activation, BlockAttention, LayerNorm, Linear, Stream};
use candle_core::Tensor;

/// The attention half: its norm, projections and attention.
pub type AttentionHalf<'a> = (&'a LayerNorm, &'a Linear, &'a Linear, BlockAttention<'a>);
/// The MLP half: its norm, projections and activation.
pub type MlpHalf<'a> = (&'a LayerNorm, &'a Linear, &'a Linear, Activation);

/// A pre-norm block given by its two halves.
pub trait PreNormBlock {
    /// The block's halves.
    fn parts(&self) -> (AttentionHalf<'_>, MlpHalf<'_>);

    /// `h` through the block: attention then MLP, each with its residual
    /// (`amp::nn::pre_norm_block`: at the FP8 levels every tensor between
    /// the first norm and the MLP's down projection, the stream between
    /// the halves included, handed from op to op outside candle's graph,
    /// each residual added inside its projection's op).
    fn forward(&self, h: &Tensor) -> CoreResult<Tensor> {
        let (attention, mlp) = self.parts();
        nn::pre_norm_block(h, attention, mlp)
    }

    /// [`forward`](Self::forward) on a residual stream, the output handed
    /// on where the block can (`amp::nn::pre_norm_block_stream`).
    fn forward_stream(&self, h: Stream) -> CoreResult<Stream> {
        let (attention, mlp) = self.parts();
        nn::pre_norm_block_stream(h, attention, mlp)
    }
}
