//! The two halves of a pre-LayerNorm transformer block as one call each
//! (TE's `MultiheadAttention` and `LayerNormMLP`, with the residual) and
//! the output head with its loss: every tensor between the parts is handed
//! from op to op outside candle's graph.

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
/// [`Linear::forward_with`]), its gradient carried to the LayerNorm's
/// backward, which adds it to `h`'s (one gradient for `h` in candle's graph,
/// not two). Otherwise the same parts in sequence. The values are those of
/// the parts in sequence either way (with BF16 activations in an FP8 mode,
/// within the second rounding that the GEMM's epilogue saves, see
/// [`Linear::forward_with`]).
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
        let res_grad = fused::ResidualGrad::default();
        let (x, token, from) = qkv.forward_handing(h, normed, Some(res_grad.clone()))?;
        let (y, token, from) = fused::causal_attention_handed(&x, &token, &from, heads)?;
        drop(x);
        return proj.forward_from(&y, (token, from), false, Some(h), Some(res_grad));
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

/// `h + fc2(gelu(fc1(norm(h))))` (`residual` true) or `fc2(gelu(fc1(norm(
/// h))))`. Where both Linears run their own ops the LayerNorm's output and
/// fc1's output are handed between the ops (fc2's op keeps GELU's input
/// for its backward, as the unfused GELU would), the GELU and the residual
/// applied inside fc2's op (the residual's gradient added in the
/// LayerNorm's backward, as in [`causal_self_attention`]); otherwise the
/// parts in sequence. The values are those of the parts in sequence either
/// way (within one rounding where the residual is added in the GEMM's
/// epilogue).
///
/// # Errors
/// As [`Linear::forward_with`].
pub fn pre_norm_mlp(
    h: &Tensor,
    norm: &LayerNorm,
    fc1: &Linear,
    fc2: &Linear,
    residual: bool,
) -> Result<Tensor> {
    let normed = Fuse {
        norm: Some(norm),
        ..Default::default()
    };
    let res = residual.then_some(h);
    if fc1.runs_own_op()? && fc2.runs_own_op()? {
        let res_grad = res.map(|_| fused::ResidualGrad::default());
        let (m, token, from) = fc1.forward_handing(h, normed, res_grad.clone())?;
        return fc2.forward_from(&m, (token, from), true, res, res_grad);
    }
    let m = fc1.forward_with(h, normed)?;
    fc2.forward_with(
        &m,
        Fuse {
            gelu: true,
            residual: res,
            ..Default::default()
        },
    )
}

/// `cross_entropy(head(norm(h)), targets)` (`norm` optional): where the
/// head runs its own op the normalised input and the logits are handed
/// between the ops, so the logits (a GPT's largest activation) never
/// become a graph tensor with a zero-filled gradient of their size, and
/// the head's op returns a token instead of a copy of them. Otherwise the
/// parts in sequence; the values are the same either way.
///
/// # Errors
/// As [`Linear::forward_with`] and
/// [`cross_entropy`](fused::cross_entropy).
pub fn linear_cross_entropy(
    h: &Tensor,
    norm: Option<&LayerNorm>,
    head: &Linear,
    targets: &Tensor,
) -> Result<Tensor> {
    let normed = Fuse {
        norm,
        ..Default::default()
    };
    if head.runs_own_op()? {
        let (logits, token, from) = head.forward_handing(h, normed, None)?;
        return fused::cross_entropy_handed(&logits, &token, &from, targets);
    }
    fused::cross_entropy(&head.forward_with(h, normed)?, targets)
}
