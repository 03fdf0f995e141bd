//! [`Stream`]: a transformer's residual stream between its blocks, handed
//! from op to op outside candle's graph where the ops can (see
//! `fused::Handoff`).
//!
//! Every block's output is the sum its last projection's op computes
//! (the residual inside the op); the next block reads it twice, in its
//! first norm and as its own residual. As a graph tensor it is kept until
//! backward by candle and its one gradient is zero-filled and added (a
//! `[batch, seq, dim]` fill and add a block). Handed, the graph carries a
//! one-element token instead: the next norm's backward leaves the whole
//! gradient (the residual's added) in the producer's handoff.

use super::fused::Handoff;
use super::precomputed::Precomputed;
use crate::error::Result;
use candle_core::{CustomOp1, Tensor};

/// A residual stream: a tensor of candle's graph, or one handed from the
/// op that produced it (its value, and the token and handoff that stand
/// for it in the graph). [`pre_norm_block_stream`](super::pre_norm_block_stream)
/// takes and gives one; [`into_tensor`](Self::into_tensor) puts a handed
/// one back into the graph. Not `Clone`: a handed stream has one consumer
/// (its handoff takes one gradient).
#[derive(Debug)]
pub struct Stream {
    value: Tensor,
    handed: Option<(Tensor, Handoff)>,
}

impl Stream {
    /// A stream from a tensor of candle's graph (an embedding's output).
    pub fn new(h: Tensor) -> Self {
        Self {
            value: h,
            handed: None,
        }
    }

    /// A handed stream: its value, token and handoff.
    pub(crate) fn handed(value: Tensor, token: Tensor, from: Handoff) -> Self {
        Self {
            value,
            handed: Some((token, from)),
        }
    }

    /// The stream's values, detached from the graph where it is handed
    /// (a differentiable use takes [`into_tensor`](Self::into_tensor)).
    pub(crate) fn value(&self) -> &Tensor {
        &self.value
    }

    /// Whether the stream is handed (its token in the graph).
    pub fn is_handed(&self) -> bool {
        self.handed.is_some()
    }

    /// The token and handoff of a handed stream.
    pub(crate) fn token(&self) -> Option<&(Tensor, Handoff)> {
        self.handed.as_ref()
    }

    /// The stream as a tensor of candle's graph: itself, or for a handed
    /// stream a copy of its value whose gradient goes back to the op that
    /// handed it.
    ///
    /// # Errors
    /// candle's.
    pub fn into_tensor(self) -> Result<Tensor> {
        let Some((token, from)) = self.handed else {
            return Ok(self.value);
        };
        let op = Unhand {
            y: Precomputed::new("amp_unhand", self.value),
            from,
        };
        Ok(token.apply_op1(op)?)
    }
}

/// A handed tensor back in the graph: the forward gives its value (from
/// its token), the backward hands the gradient to its producer.
struct Unhand {
    y: Precomputed,
    from: Handoff,
}

impl CustomOp1 for Unhand {
    fn name(&self) -> &'static str {
        "amp_unhand"
    }

    crate::nn::precomputed::precomputed_fwd!(1);

    fn bwd(
        &self,
        token: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        self.from
            .put(grad.clone())
            .map_err(candle_core::Error::wrap)?;
        Ok(Some(
            Handoff::token_grad(token).map_err(candle_core::Error::wrap)?,
        ))
    }
}
