//! `Linear::forward_with` and the crate's handing of tensors to and from
//! the layer's op (`fused::Handoff`): the layer with its neighbours (a
//! LayerNorm before, an activation on its input, a residual after) applied
//! inside its op.

use super::op::Origin;
use super::switches::producer_amax;
use super::Linear;
use crate::error::{Error, Result};
use crate::nn::fused::{Handoff, ResidualGrad};
use crate::nn::mode::ComputeMode;
use crate::nn::norm::LayerNorm;
use crate::nn::Activation;
use crate::scaling::weight::Weight;
use candle_core::Tensor;

/// A handed tensor's token and its handoff.
pub(super) type Handed = (Tensor, Handoff);

/// What [`Linear::forward_with`] applies inside the layer's op.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fuse<'a> {
    /// An activation on the input: the layer computes `act(x) Wᵀ + b`
    /// (GELU, tanh form; or SwiGLU, whose input is twice the layer's
    /// width).
    pub activation: Option<Activation>,
    /// A tensor added to the output (a residual stream).
    pub residual: Option<&'a Tensor>,
    /// A LayerNorm on the input first (TE's `LayerNormLinear`): its output
    /// goes to the Linear's op outside candle's graph (the graph carries a
    /// one-element token), so it is neither kept until backward nor given
    /// a zero-filled gradient; the LayerNorm's parameters get their
    /// gradients as usual. Not combined with an activation (then the parts
    /// run in sequence).
    pub norm: Option<&'a LayerNorm>,
}

/// What the op applies, as [`scaled_forward`](Linear::scaled_forward)
/// takes it: `x` is the op's value; with `handoff` the graph carries its
/// token instead.
#[derive(Default)]
pub(super) struct OpFuse<'a> {
    pub activation: Option<Activation>,
    pub residual: Option<&'a Tensor>,
    pub handoff: Option<Handed>,
    /// Hand the output on: the op's graph output is a token, the output
    /// itself is left in the slot; the op's backward takes its gradient
    /// from the handoff.
    pub hand_out: Option<(Handoff, &'a mut Option<Tensor>)>,
    /// Where the op that takes `residual` leaves its gradient for the
    /// LayerNorm handoff reading the same tensor (see `ResidualGrad`).
    pub residual_grad: Option<ResidualGrad>,
    /// Under `nn::selective`, what a handed input can be computed again
    /// from in backward (without it the op keeps its FP8 codes).
    pub origin: Option<Origin>,
    /// The input's amax, taken by the pass that produced it (a handed
    /// LayerNorm's, `set_producer_amax`): its cast takes no pass of its
    /// own. Without an activation only (an activation's own amax wins).
    pub input_amax: Option<Tensor>,
    /// With `residual`: the residual is a handed tensor (`residual` its
    /// value) whose token stands for it in the graph; its gradient goes to
    /// `residual_grad`, which must have a reader.
    pub residual_token: Option<&'a Tensor>,
}

impl Linear {
    /// A residual must have the output's shape and the input's dtype.
    fn check_residual(&self, x: &Tensor, out_dim: usize, residual: Option<&Tensor>) -> Result<()> {
        if let Some(r) = residual {
            let mut dims = x.dims().to_vec();
            if let Some(last) = dims.last_mut() {
                *last = out_dim;
            }
            if r.dims() != dims.as_slice() {
                return Err(Error::Shape {
                    op: "Linear::forward_with",
                    lhs: dims.into(),
                    rhs: r.shape().clone(),
                });
            }
            if r.dtype() != x.dtype() {
                return Err(Error::DType {
                    op: "Linear::forward_with",
                    expected: "a residual of the input's dtype",
                    got: r.dtype(),
                });
            }
        }
        Ok(())
    }

    /// LayerNorm of `x` for the op: handed (`(out, Some((token, handoff)),
    /// amax)`) where `hand` holds and the LayerNorm can hand it, else run
    /// in the graph (`(out, None, None)`). A handed output comes with its
    /// amax from the LayerNorm's own pass where the op's cast can take it:
    /// current scaling and `set_producer_amax`.
    /// With `x_from` (`x` handed from another op: its token and handoff)
    /// the LayerNorm must hand, or it is an error.
    pub(super) fn normed(
        norm: Option<&LayerNorm>,
        x: &Tensor,
        hand: bool,
        (res_grad, x_from): (Option<ResidualGrad>, Option<Handed>),
        mode: &ComputeMode,
    ) -> Result<(Option<Tensor>, Option<Handed>, Option<Tensor>)> {
        let Some(ln) = norm else {
            return match x_from {
                None => Ok((None, None, None)),
                Some(_) => Err(handed_input_unused()),
            };
        };
        let handed_in = x_from.is_some();
        if hand {
            let want_amax = producer_amax() && matches!(mode, ComputeMode::Fp8Current(_));
            if let Some((out, amax, token, h)) = ln.try_handoff(x, res_grad, want_amax, x_from)? {
                return Ok((Some(out), Some((token, h)), amax));
            }
        }
        if handed_in {
            return Err(handed_input_unused());
        }
        Ok((Some(ln.try_forward(x)?), None, None))
    }

    /// A handed LayerNorm's output as `nn::selective` computes it again:
    /// from the LayerNorm's input, which its backward keeps.
    fn norm_origin(
        norm: Option<&LayerNorm>,
        x: &Tensor,
        handoff: &Option<Handed>,
    ) -> Option<Origin> {
        match (norm, handoff) {
            (Some(ln), Some(_)) => Some(Origin::Norm(ln.clone(), x.clone())),
            _ => None,
        }
    }

    /// `self.forward(&gelu(z))` (the tanh GELU of [`fused::gelu`]); see
    /// [`forward_with`](Self::forward_with).
    ///
    /// [`fused::gelu`]: crate::nn::fused::gelu
    ///
    /// # Errors
    /// As [`try_forward`](Self::try_forward).
    pub fn forward_gelu(&self, z: &Tensor) -> Result<Tensor> {
        self.forward_with(
            z,
            Fuse {
                activation: Some(Activation::Gelu),
                ..Default::default()
            },
        )
    }

    /// The layer with `fuse`'s neighbours applied inside its op:
    /// `residual + self.forward(&act(x))` (each part optional). With an
    /// activation, wherever the layer runs its own op (FP8 modes, low-bit
    /// weights) its output is no graph tensor: candle neither keeps it
    /// until backward (only the FP8 codes the GEMMs take are kept) nor
    /// zero-fills and adds a gradient for it, and the op's backward applies
    /// the activation's backward to dgrad. With `residual` (same shape and dtype as
    /// the output), where the weight's gradient goes to a sink (O1-O3) and
    /// the residual is tracked, the sum is the op's output and the residual
    /// its second argument, whose gradient is the output's: no add node, whose inputs candle would
    /// keep and whose second gradient it would zero-fill and add. The
    /// output and gradients have the values of the parts in sequence (the
    /// same kernels in the same order; `r + y` is `y + r`), except that
    /// with BF16 activations in an FP8 mode the residual is added in the
    /// GEMM's epilogue ([`fp8_gemm_fused`](crate::fp8_gemm_fused)) before
    /// the output's one rounding, where the parts round the product first:
    /// the two differ by that second rounding. Elsewhere (native compute
    /// with an F32 weight, no sink for the residual) the parts run in
    /// sequence.
    ///
    /// # Errors
    /// As [`try_forward`](Self::try_forward); [`Error::Shape`] or
    /// [`Error::DType`] for a residual unlike the output.
    pub fn forward_with(&self, x: &Tensor, fuse: Fuse<'_>) -> Result<Tensor> {
        let act = fuse.activation;
        let (weight, out_dim, mode) = self.prepare_for(x, act)?;
        self.check_residual(x, out_dim, fuse.residual)?;
        let own_op = Self::own_op(&mode, &weight, x);
        let (normed, handoff, input_amax) =
            Self::normed(fuse.norm, x, own_op && act.is_none(), (None, None), &mode)?;
        let origin = Self::norm_origin(fuse.norm, x, &handoff);
        let x = normed.as_ref().unwrap_or(x);
        // the op decides whether it takes the residual (it adds it outside
        // itself where it cannot)
        let y = match (own_op, act) {
            (true, _) => {
                let op_fuse = OpFuse {
                    activation: act,
                    residual: fuse.residual,
                    handoff,
                    hand_out: None,
                    residual_grad: None,
                    origin,
                    input_amax,
                    residual_token: None,
                };
                return self.scaled_forward(x, &weight, &mode, out_dim, op_fuse);
            }
            (false, Some(a)) => self.try_forward(&a.apply(x)?)?,
            (false, None) => self.try_forward(x)?,
        };
        match fuse.residual {
            Some(r) => Ok((r + y)?),
            None => Ok(y),
        }
    }

    /// Whether the layer runs its own op on `x` in the current mode (see
    /// `own_op`): the condition for handing tensors to and from it.
    pub(crate) fn runs_own_op(&self, x: &Tensor) -> Result<bool> {
        Ok(Self::own_op(&self.mode(), &*self.weight.read()?, x))
    }

    /// Whether the layer's op on `x` takes a tracked residual inside it
    /// (its own op, with the weight's gradient going to a sink): the
    /// condition for handing on an output that has a residual.
    pub(crate) fn takes_residual(&self, x: &Tensor) -> Result<bool> {
        let mode = self.mode();
        let weight = self.weight.read()?;
        let sink = self
            .sink
            .lock()
            .map_err(|_| Error::Poisoned {
                op: "Linear::takes_residual",
            })?
            .is_some();
        let native_f32 = matches!((&mode, &*weight), (ComputeMode::Native, Weight::F32(_)));
        Ok(Self::own_op(&mode, &weight, x) && sink && !native_f32)
    }

    /// [`forward_with`](Self::forward_with) whose output is handed on:
    /// `(out, token, handoff)` (see `fused::Handoff`); a handed LayerNorm
    /// adds `res_grad`'s gradient (see `ResidualGrad`) to its input's. The
    /// caller checks [`runs_own_op`](Self::runs_own_op) first.
    pub(crate) fn forward_handing(
        &self,
        x: &Tensor,
        fuse: Fuse<'_>,
        res_grad: Option<ResidualGrad>,
    ) -> Result<(Tensor, Tensor, Handoff)> {
        self.forward_handing_from(x, None, fuse, res_grad)
    }

    /// [`forward_handing`](Self::forward_handing) of an `x` that is itself
    /// handed from another op where `x_from` is given (its token and
    /// handoff): `fuse.norm` takes it, and the norm's backward leaves `x`'s
    /// gradient in that handoff (an error where the norm cannot hand).
    pub(crate) fn forward_handing_from(
        &self,
        x: &Tensor,
        x_from: Option<Handed>,
        fuse: Fuse<'_>,
        res_grad: Option<ResidualGrad>,
    ) -> Result<(Tensor, Tensor, Handoff)> {
        let (weight, out_dim, mode) = self.prepare(x)?;
        if fuse.activation.is_some() || fuse.residual.is_some() {
            return Err(Error::Unsupported {
                op: "Linear::forward_handing",
                what: "an activation or a residual on a handed-on output".into(),
            });
        }
        let (normed, handoff, input_amax) =
            Self::normed(fuse.norm, x, true, (res_grad, x_from), &mode)?;
        let origin = Self::norm_origin(fuse.norm, x, &handoff);
        let x = normed.as_ref().unwrap_or(x);
        let out = Handoff::default();
        let mut value = None;
        let op_fuse = OpFuse {
            handoff,
            hand_out: Some((out.clone(), &mut value)),
            origin,
            input_amax,
            ..Default::default()
        };
        let token = self.scaled_forward(x, &weight, &mode, out_dim, op_fuse)?;
        let value = value.ok_or(Error::Unsupported {
            op: "Linear::forward_handing",
            what: "no output handed".into(),
        })?;
        Ok((value, token, out))
    }

    /// The layer on a tensor handed from another op (`token` stands for
    /// `x` in the graph, `from` takes its gradient), `activation` on it and
    /// `residual` added as in [`forward_with`](Self::forward_with) (with
    /// `residual_token`, a handed residual: see `forward_from_handing`), its
    /// gradient left in `res_grad` where a reader is attached (see
    /// `ResidualGrad`); the caller checks [`runs_own_op`](Self::runs_own_op)
    /// first. `kept`: the op that handed `x` keeps it until its backward
    /// (so `nn::selective` casts it again rather than keep its codes).
    pub(crate) fn forward_from(
        &self,
        x: &Tensor,
        handed: Handed,
        activation: Option<Activation>,
        residual: (Option<&Tensor>, Option<&Tensor>),
        res_grad: Option<ResidualGrad>,
        kept: bool,
    ) -> Result<Tensor> {
        self.on_handed(x, handed, activation, residual, (res_grad, kept), None)
    }

    /// [`forward_from`](Self::forward_from) whose output is handed on:
    /// `(out, token, handoff)`; `activation` and `residual` as there, or with
    /// `residual_token` a handed residual (its value, and the token that
    /// stands for it in the graph), whose gradient goes to `res_grad`
    /// (with a reader attached: an error otherwise). The caller checks
    /// [`runs_own_op`](Self::runs_own_op) first.
    pub(crate) fn forward_from_handing(
        &self,
        x: &Tensor,
        handed: Handed,
        activation: Option<Activation>,
        residual: (Option<&Tensor>, Option<&Tensor>),
        res_grad: Option<ResidualGrad>,
        kept: bool,
    ) -> Result<(Tensor, Tensor, Handoff)> {
        let out = Handoff::default();
        let mut value = None;
        let token = self.on_handed(
            x,
            handed,
            activation,
            residual,
            (res_grad, kept),
            Some((out.clone(), &mut value)),
        )?;
        let value = value.ok_or(Error::Unsupported {
            op: "Linear::forward_from_handing",
            what: "no output handed".into(),
        })?;
        Ok((value, token, out))
    }

    /// The op of [`forward_from`](Self::forward_from) and
    /// [`forward_from_handing`](Self::forward_from_handing) (`hand_out`).
    fn on_handed(
        &self,
        x: &Tensor,
        (token, from): Handed,
        activation: Option<Activation>,
        (residual, residual_token): (Option<&Tensor>, Option<&Tensor>),
        (res_grad, kept): (Option<ResidualGrad>, bool),
        hand_out: Option<(Handoff, &mut Option<Tensor>)>,
    ) -> Result<Tensor> {
        let (weight, out_dim, mode) = self.prepare_for(x, activation)?;
        self.check_residual(x, out_dim, residual)?;
        let op_fuse = OpFuse {
            activation,
            residual,
            residual_token,
            handoff: Some((token, from)),
            hand_out,
            residual_grad: res_grad,
            origin: kept.then(|| Origin::Value(x.clone())),
            ..Default::default()
        };
        self.scaled_forward(x, &weight, &mode, out_dim, op_fuse)
    }
}

/// A handed input that the call could not take (no LayerNorm to take it,
/// or one that cannot hand).
fn handed_input_unused() -> Error {
    Error::Unsupported {
        op: "Linear::forward_handing_from",
        what: "a handed input needs a LayerNorm that hands (fused kernels, a tracked graph)".into(),
    }
}
