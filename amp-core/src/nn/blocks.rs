//! The two halves of a pre-LayerNorm transformer block as one call each
//! (TE's `MultiheadAttention` and `LayerNormMLP`, with the residual) and
//! the output head with its loss: every tensor between the parts is handed
//! from op to op outside candle's graph; and Transformer Engine's composite
//! modules `LayerNormLinear` (LayerNorm then an FP8 Linear) and
//! `LayerNormMLP` (LayerNorm, fc1, GELU, fc2).

use super::fused::{self, Activation};
use super::linear::{linear_b, Fuse, Linear};
use super::norm::{layer_norm, rms_norm, LayerNorm};
use super::stream::Stream;
use crate::error::Result;
use candle_core::{Module, Tensor};

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
    if qkv.runs_own_op(h)? && proj.runs_own_op(h)? {
        let res_grad = fused::ResidualGrad::default();
        let (x, token, from) = qkv.forward_handing(h, normed, Some(res_grad.clone()))?;
        let (y, token, from, kept) = fused::causal_attention_handed(&x, &token, &from, heads)?;
        drop(x);
        return proj.forward_from(
            &y,
            (token, from),
            None,
            (Some(h), None),
            Some(res_grad),
            kept,
        );
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

/// Llama's attention half-block: `h + proj(attention(rope(q), rope(k),
/// v))`, with q, k and v side by side in one projection of `norm(h)`
/// (`[batch, seq, (heads + 2 kv_heads) * head_dim]`: q's heads, then k's,
/// then v's), rotary positions on q and k ([`fused::rope`], `cos` and
/// `sin` `[positions, head_dim / 2]`, the first `seq` rows taken) and
/// grouped-query attention where `kv_heads < heads`
/// ([`fused::rope_attention_qkv`]: one op from the projection's rows to the
/// attention's). Where both Linears run their own ops every tensor between
/// the norm and the output projection is handed from op to op, as in
/// [`causal_self_attention`]; otherwise the parts in sequence.
///
/// # Errors
/// [`Error::Shape`](crate::Error::Shape) when the projection's width is
/// not `(heads + 2 kv_heads) * head_dim` or `kv_heads` does not divide
/// `heads`; as the parts'.
pub fn rope_self_attention(
    h: &Tensor,
    norm: &LayerNorm,
    qkv: &Linear,
    proj: &Linear,
    heads: (usize, usize),
    tables: (&Tensor, &Tensor),
) -> Result<Tensor> {
    let normed = Fuse {
        norm: Some(norm),
        ..Default::default()
    };
    if qkv.runs_own_op(h)? && proj.runs_own_op(h)? {
        let res_grad = fused::ResidualGrad::default();
        let (x, token, from) = qkv.forward_handing(h, normed, Some(res_grad.clone()))?;
        let (y, token, to) = fused::rope_attention_handed(&x, &token, &from, heads, tables)?;
        drop(x);
        return proj.forward_from(
            &y,
            (token, to),
            None,
            (Some(h), None),
            Some(res_grad),
            false,
        );
    }
    let y = fused::rope_attention_qkv(&qkv.forward_with(h, normed)?, heads, tables)?;
    proj.forward_with(
        &y,
        Fuse {
            residual: Some(h),
            ..Default::default()
        },
    )
}

/// `h + fc2(gelu(fc1(norm(h))))` (`residual` true) or `fc2(gelu(fc1(norm(
/// h))))`: [`pre_norm_mlp_with`] with GELU.
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
    pre_norm_mlp_with(h, norm, fc1, fc2, residual, Activation::Gelu)
}

/// `h + fc2(act(fc1(norm(h))))` (`residual` true) or `fc2(act(fc1(norm(
/// h))))`, `act` GELU or SwiGLU (then fc1's output is twice fc2's input:
/// gate, then up). Where both Linears run their own ops the norm's output
/// and fc1's output are handed between the ops (fc2's op keeps the
/// activation's input for its backward, as the unfused activation would),
/// the activation and the residual applied inside fc2's op (the residual's
/// gradient added in the norm's backward, as in
/// [`causal_self_attention`]); otherwise the parts in sequence. The values
/// are those of the parts in sequence either way (within one rounding
/// where the residual is added in the GEMM's epilogue).
///
/// # Errors
/// As [`Linear::forward_with`].
pub fn pre_norm_mlp_with(
    h: &Tensor,
    norm: &LayerNorm,
    fc1: &Linear,
    fc2: &Linear,
    residual: bool,
    act: Activation,
) -> Result<Tensor> {
    let normed = Fuse {
        norm: Some(norm),
        ..Default::default()
    };
    let res = residual.then_some(h);
    if fc1.runs_own_op(h)? && fc2.runs_own_op(h)? {
        let res_grad = res.map(|_| fused::ResidualGrad::default());
        let (m, token, from) = fc1.forward_handing(h, normed, res_grad.clone())?;
        return fc2.forward_from(&m, (token, from), Some(act), (res, None), res_grad, false);
    }
    let m = fc1.forward_with(h, normed)?;
    fc2.forward_with(
        &m,
        Fuse {
            activation: Some(act),
            residual: res,
            ..Default::default()
        },
    )
}

/// The attention of a [`pre_norm_block`]: GPT's causal attention over
/// `heads` heads ([`causal_self_attention`]), or Llama's with rotary
/// positions and grouped-query heads ([`rope_self_attention`]: `(heads,
/// kv_heads)` and the `(cos, sin)` tables).
#[derive(Debug, Clone, Copy)]
pub enum BlockAttention<'a> {
    /// [`causal_self_attention`]'s.
    Causal {
        /// Attention heads.
        heads: usize,
    },
    /// [`rope_self_attention`]'s.
    Rope {
        /// Query heads and key-value heads.
        heads: (usize, usize),
        /// The rotary tables `(cos, sin)`, `[positions, head_dim / 2]`.
        tables: (&'a Tensor, &'a Tensor),
    },
}

/// A whole pre-LayerNorm block, `m = h + proj(attention(qkv(norm_1(h))))`
/// then `m + fc2(act(fc1(norm_2(m))))`: the attention half
/// ([`causal_self_attention`] or [`rope_self_attention`]) then
/// [`pre_norm_mlp_with`] with its residual, and where all four Linears run
/// their own ops with the residuals inside them, `m` too is handed from op
/// to op: the projection's op hands it to `norm_2` and to `fc2`'s op (its
/// residual), so candle neither keeps it nor zero-fills and adds its one
/// gradient (a `[batch, seq, dim]` fill and add a block); `norm_2`'s
/// backward gives `m`'s whole gradient (the residual's added, as within
/// each half) to the projection's op. The values are those of the two
/// calls.
///
/// # Errors
/// As the two halves'.
pub fn pre_norm_block(
    h: &Tensor,
    attention: (&LayerNorm, &Linear, &Linear, BlockAttention<'_>),
    mlp: (&LayerNorm, &Linear, &Linear, Activation),
) -> Result<Tensor> {
    block(Stream::new(h.clone()), attention, mlp, false)?.into_tensor()
}

/// [`pre_norm_block`] on a [`Stream`]: a handed stream's token is the
/// graph's input (the first norm's backward gives the stream's whole
/// gradient back to its producer), and the output is handed on where the
/// four Linears run their own ops with the residuals inside them (else a
/// stream of the graph, the parts run as [`pre_norm_block`] runs them).
/// Chained from block to block, candle zero-fills and adds no gradient of
/// the residual stream; [`linear_cross_entropy_stream`] ends the chain.
/// The values are those of [`pre_norm_block`].
///
/// # Errors
/// As [`pre_norm_block`].
pub fn pre_norm_block_stream(
    h: Stream,
    attention: (&LayerNorm, &Linear, &Linear, BlockAttention<'_>),
    mlp: (&LayerNorm, &Linear, &Linear, Activation),
) -> Result<Stream> {
    block(h, attention, mlp, true)
}

/// The block of [`pre_norm_block_stream`]; `hand_out`: hand the output on
/// where the parts allow.
fn block(
    h: Stream,
    (norm_1, qkv, proj, attention): (&LayerNorm, &Linear, &Linear, BlockAttention<'_>),
    (norm_2, fc1, fc2, act): (&LayerNorm, &Linear, &Linear, Activation),
    hand_out: bool,
) -> Result<Stream> {
    let x = h.value();
    let tracked = match h.token() {
        Some((token, _)) => token.track_op(),
        None => x.track_op(),
    };
    // every part its own op, the two residuals inside the ops (which hand
    // on the first), and a graph to hand along
    let own = tracked
        && norm_1.can_hand(x)
        && norm_2.can_hand(x)
        && qkv.runs_own_op(x)?
        && proj.takes_residual(x)?
        && fc1.runs_own_op(x)?
        && fc2.takes_residual(x)?;
    if !own {
        let h = h.into_tensor()?;
        let m = match attention {
            BlockAttention::Causal { heads } => {
                causal_self_attention(&h, norm_1, qkv, proj, heads)?
            }
            BlockAttention::Rope { heads, tables } => {
                rope_self_attention(&h, norm_1, qkv, proj, heads, tables)?
            }
        };
        return Ok(Stream::new(pre_norm_mlp_with(
            &m, norm_2, fc1, fc2, true, act,
        )?));
    }
    let x_from = h.token().cloned();
    let x_token = x_from.as_ref().map(|(token, _)| token.clone());
    // the attention half, its output handed on
    let normed_1 = Fuse {
        norm: Some(norm_1),
        ..Default::default()
    };
    let res_1 = fused::ResidualGrad::default();
    let (q, token, from) = qkv.forward_handing_from(x, x_from, normed_1, Some(res_1.clone()))?;
    let (y, token, from, kept) = match attention {
        BlockAttention::Causal { heads } => {
            fused::causal_attention_handed(&q, &token, &from, heads)?
        }
        BlockAttention::Rope { heads, tables } => {
            let (y, token, to) = fused::rope_attention_handed(&q, &token, &from, heads, tables)?;
            (y, token, to, false)
        }
    };
    drop(q);
    let residual_1 = (Some(x), x_token.as_ref());
    let (m, m_token, m_from) =
        proj.forward_from_handing(&y, (token, from), None, residual_1, Some(res_1), kept)?;
    drop(y);
    // the MLP half on the handed stream: norm_2 takes m's token, fc2 adds
    // m's value with its token standing for it in the graph
    let normed_2 = Fuse {
        norm: Some(norm_2),
        ..Default::default()
    };
    let res_2 = fused::ResidualGrad::default();
    let (z, token, from) = fc1.forward_handing_from(
        &m,
        Some((m_token.clone(), m_from)),
        normed_2,
        Some(res_2.clone()),
    )?;
    let residual_2 = (Some(&m), Some(&m_token));
    if hand_out {
        let (out, out_token, out_from) =
            fc2.forward_from_handing(&z, (token, from), Some(act), residual_2, Some(res_2), false)?;
        return Ok(Stream::handed(out, out_token, out_from));
    }
    let out = fc2.forward_from(&z, (token, from), Some(act), residual_2, Some(res_2), false)?;
    Ok(Stream::new(out))
}

/// `cross_entropy(head(norm(h)), targets)` (`norm` optional): where the
/// head runs its own op the normalised input and the logits are handed
/// between the ops, so the logits (a GPT's largest activation) never
/// become a graph tensor with a zero-filled gradient of their size, and
/// the head's op returns a token instead of a copy of them. Otherwise the
/// parts in sequence; the values are the same either way.
///
/// Where the head runs per-tensor FP8 and there are at least
/// [`loss_chunk_rows`](super::loss_chunk_rows) rows, the head and the loss
/// run over chunks of rows and make both of the head's gradients in the
/// forward (docs/ARCHITECTURE.md, "The head's loss over chunks of rows"):
/// evaluate inside [`inference`](super::inference) (as
/// `AmpContext::evaluate` does), or the forward does the gradients'
/// products for nothing.
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
    linear_cross_entropy_stream(Stream::new(h.clone()), norm, head, targets)
}

/// [`linear_cross_entropy`] of a [`Stream`]: a handed stream goes to the
/// norm as a token (its gradient back to the op that handed it) where the
/// head runs its own op after a norm; otherwise the stream is put back
/// into the graph first. The values are [`linear_cross_entropy`]'s.
///
/// # Errors
/// As [`linear_cross_entropy`].
pub fn linear_cross_entropy_stream(
    h: Stream,
    norm: Option<&LayerNorm>,
    head: &Linear,
    targets: &Tensor,
) -> Result<Tensor> {
    let takes_handed = match norm {
        Some(n) => n.can_hand(h.value()) && head.runs_own_op(h.value())?,
        None => false,
    };
    if h.is_handed() && !takes_handed {
        return linear_cross_entropy(&h.into_tensor()?, norm, head, targets);
    }
    let mut x_from = h.token().cloned();
    let h = h.value();
    let normed = Fuse {
        norm,
        ..Default::default()
    };
    if head.runs_own_op(h)? {
        // large logits: made, lost and differentiated a chunk of rows at a time
        if let Some(loss) = head.chunked_cross_entropy(h, &mut x_from, norm, targets)? {
            return Ok(loss);
        }
        let (logits, token, from) = head.forward_handing_from(h, x_from, normed, None)?;
        return fused::cross_entropy_handed(&logits, &token, &from, targets);
    }
    fused::cross_entropy(&head.forward_with(h, normed)?, targets)
}

/// LayerNorm followed by an FP8 Linear (TE's `LayerNormLinear`); the
/// normalised output is what the Linear casts to FP8.
#[derive(Debug, Clone)]
pub struct LayerNormLinear {
    /// The normalisation (`<prefix>.layer_norm`).
    pub norm: LayerNorm,
    /// The projection (`<prefix>.linear`).
    pub linear: Linear,
}

/// A [`LayerNormLinear`] from a `VarBuilder`.
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn layer_norm_linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    eps: f64,
    vb: candle_nn::VarBuilder,
) -> Result<LayerNormLinear> {
    Ok(LayerNormLinear {
        norm: layer_norm(in_dim, eps, vb.pp("layer_norm"))?,
        linear: linear_b(in_dim, out_dim, bias, vb.pp("linear"))?,
    })
}

impl Module for LayerNormLinear {
    /// `linear(norm(x))`, the normalised output handed to the Linear's op
    /// ([`Fuse::norm`](super::Fuse::norm)): not kept for backward.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let fuse = super::Fuse {
            norm: Some(&self.norm),
            ..Default::default()
        };
        self.linear
            .forward_with(x, fuse)
            .map_err(candle_core::Error::wrap)
    }
}

/// LayerNorm, fc1, GELU (tanh approximation, TE's `gelu`: [`fused::gelu`]),
/// fc2 (TE's `LayerNormMLP`); or RMSNorm and SwiGLU (TE's
/// `LayerNormMLP(activation="swiglu", normalization="RMSNorm")`, Llama's
/// MLP: [`layer_norm_mlp_with`]); both GEMMs in FP8 inside a scope.
///
/// [`fused::gelu`]: super::fused::gelu
#[derive(Debug, Clone)]
pub struct LayerNormMLP {
    /// The normalisation (`<prefix>.layer_norm`).
    pub norm: LayerNorm,
    /// The activation between fc1 and fc2.
    pub activation: Activation,
    /// Up projection (`<prefix>.fc1`).
    pub fc1: Linear,
    /// Down projection (`<prefix>.fc2`).
    pub fc2: Linear,
}

/// A [`LayerNormMLP`] `dim -> hidden -> dim` from a `VarBuilder`.
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn layer_norm_mlp(
    dim: usize,
    hidden: usize,
    eps: f64,
    vb: candle_nn::VarBuilder,
) -> Result<LayerNormMLP> {
    Ok(LayerNormMLP {
        norm: layer_norm(dim, eps, vb.pp("layer_norm"))?,
        activation: Activation::Gelu,
        fc1: linear_b(dim, hidden, true, vb.pp("fc1"))?,
        fc2: linear_b(hidden, dim, true, vb.pp("fc2"))?,
    })
}

/// The form of a [`LayerNormMLP`] (TE's `normalization`, `activation` and
/// `bias` arguments).
#[derive(Debug, Clone, Copy)]
pub struct MlpForm {
    /// RMSNorm instead of LayerNorm.
    pub rms: bool,
    /// The activation (with SwiGLU fc1 is `dim -> 2 hidden`).
    pub activation: Activation,
    /// Biases on fc1 and fc2.
    pub bias: bool,
}

impl MlpForm {
    /// Llama's: RMSNorm, SwiGLU, no biases.
    pub fn llama() -> Self {
        Self {
            rms: true,
            activation: Activation::SwiGlu,
            bias: false,
        }
    }
}

/// A [`LayerNormMLP`] `dim -> hidden -> dim` of `form` from a
/// `VarBuilder` (`<prefix>.layer_norm`, `<prefix>.fc1`, `<prefix>.fc2`).
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn layer_norm_mlp_with(
    dim: usize,
    hidden: usize,
    eps: f64,
    form: MlpForm,
    vb: candle_nn::VarBuilder,
) -> Result<LayerNormMLP> {
    let norm = if form.rms {
        rms_norm(dim, eps, vb.pp("layer_norm"))?
    } else {
        layer_norm(dim, eps, vb.pp("layer_norm"))?
    };
    let fc1_out = form.activation.input_width(hidden);
    Ok(LayerNormMLP {
        norm,
        activation: form.activation,
        fc1: linear_b(dim, fc1_out, form.bias, vb.pp("fc1"))?,
        fc2: linear_b(hidden, dim, form.bias, vb.pp("fc2"))?,
    })
}

impl Module for LayerNormMLP {
    /// `fc2(act(fc1(norm(x))))` through [`pre_norm_mlp_with`]:
    /// the tensors between the parts handed op to op.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        pre_norm_mlp_with(x, &self.norm, &self.fc1, &self.fc2, false, self.activation)
            .map_err(candle_core::Error::wrap)
    }
}
