//! Pre-LayerNorm causal self-attention with its residual as one call (TE's
//! `MultiheadAttention` block): every tensor between the LayerNorm and the
//! output projection is handed from op to op outside candle's graph.

use super::forward_fused::Fuse;
use super::fused;
use super::linear::Linear;
use super::norm::LayerNorm;
use crate::error::Result;
use candle_core::Tensor;

/// `h + proj(causal_attention_qkv(qkv(norm(h)), heads))`. Where both
/// Linears run their own ops (FP8 modes, low-bit weights) the LayerNorm's
/// output, the projection's q, k, v and the attention's output are handed
/// between the ops (see [`Fuse::norm`]): candle neither keeps them until
/// backward nor zero-fills and adds a gradient for each, and the residual
/// is added inside the output projection's op (see
/// [`Linear::forward_with`]). Otherwise the same parts in sequence. The
/// values are those of the parts in sequence either way.
///
/// # Errors
/// As the parts': [`Linear::forward_with`],
/// [`causal_attention_qkv`](fused::causal_attention_qkv).
pub fn causal_self_attention(
    h: &Tensor,
    norm: &LayerNorm,
    qkv: &Linear,
    proj: &Linear,
    heads: usize,
) -> Result<Tensor> {
    let normed = Fuse {
        norm: Some(norm),
        ..Default::default()
    };
    if qkv.runs_own_op()? && proj.runs_own_op()? {
        let (x, token, from) = qkv.forward_handing(h, normed)?;
        let (y, token, from) = fused::causal_attention_handed(&x, &token, &from, heads)?;
        drop(x);
        return proj.forward_from(&y, token, from, Some(h));
    }
    let y = fused::causal_attention_qkv(&qkv.forward_with(h, normed)?, heads)?;
    proj.forward_with(
        &y,
        Fuse {
            residual: Some(h),
            ..Default::default()
        },
    )
}
