//! A Linear's forward through its own op: the operands cast (or taken
//! ready), the forward product with its epilogue (bias, residual), what
//! the backward keeps (FP8 codes, block tiles, or a source to cast again
//! from) and the autograd node ([`Fp8LinearOp`]) that holds it.

use super::block;
use super::fuse::OpFuse;
use super::layer_scaling::Scaling;
use super::op::{Fp8LinearOp, KeptInput, Origin, Plan, Saved};
use super::operands::Passes;
use super::switches::{self, fp8_activation_inputs, producer_amax};
use super::Linear;
use crate::error::{Error, Result};
use crate::gemm::{fp8_gemm_fused, fp8_gemm_with, Epilogue};
use crate::nn::mode::{current_step, ComputeMode};
use crate::nn::precomputed::Precomputed;
use crate::nn::selective;
use crate::scaling::block::BlockTensor;
use crate::scaling::flag::flagged_by_amax;
use crate::scaling::sink::GradSink;
use crate::scaling::tensor::ScalingTensor;
use crate::scaling::weight::Weight;
use candle_core::{DType, Tensor, Var};

impl Linear {
    /// Forward through the custom op (FP8 mode, or a low-bit weight in
    /// native mode). The op takes `x` as it is (any rank) and flattens it
    /// inside, so the graph holds one node, not two reshapes around it;
    /// with an `activation` the op's input is the activation's input (see
    /// [`forward_with`](Self::forward_with)).
    pub(super) fn scaled_forward(
        &self,
        x_nd: &Tensor,
        weight: &Weight,
        mode: &ComputeMode,
        out_dim: usize,
        fuse: OpFuse<'_>,
    ) -> Result<Tensor> {
        let OpFuse {
            activation,
            residual,
            handoff,
            hand_out,
            residual_grad,
            origin,
            input_amax,
            residual_token,
        } = fuse;
        // Under `nn::selective`, where the input's FP8 codes can be cast
        // again from a tensor kept anyway: the activation's input (the op
        // keeps it),
        // the op's graph input (candle keeps it), or what the caller names
        // (a LayerNorm's input, an attention output the attention keeps).
        let recast = selective::active();
        let origin = match (recast, origin) {
            (false, _) => None,
            (true, _) if activation.is_some() => {
                activation.map(|a| Origin::Activated(a, x_nd.clone()))
            }
            (true, Some(o)) => Some(o),
            (true, None) if handoff.is_none() => Some(Origin::Value(x_nd.clone())),
            (true, None) => None,
        };
        // the op's first argument in the graph: x, or the token standing for it
        let (arg0, handoff) = match handoff {
            Some((token, h)) => (token, Some(h)),
            None => (x_nd.clone(), None),
        };
        let in_dim = x_nd.dim(candle_core::D::Minus1)?;
        let mut out_dims = x_nd.dims().to_vec();
        let last = out_dims.len() - 1;
        out_dims[last] = out_dim;
        let x = &x_nd.detach().reshape(((), in_dim))?.contiguous()?;
        // with a handed input the op keeps the activation's input itself
        // (its graph argument is a token)
        // (as E4M3 tiles in an FP8 mode where `set_fp8_activation_inputs`
        // asks, unless `selective` keeps the input for its casts anyway)
        let fp8_z = fp8_activation_inputs() && !recast && !matches!(mode, ComputeMode::Native);
        let act_z = (activation.is_some() && handoff.is_some())
            .then(|| KeptInput::new(x, fp8_z))
            .transpose()?;
        // the activation's pass may take the amax its output's cast needs
        // (`set_producer_amax`, current scaling)
        let (x, x_amax) = match activation {
            Some(act) if producer_amax() && matches!(mode, ComputeMode::Fp8Current(_)) => {
                act.detached_amax(x)?
            }
            Some(act) => (act.detached(x)?, None),
            None => (x.clone(), input_amax),
        };
        let x = &x;
        let sink = self.op_sink(mode, weight)?;
        // The residual goes into the op where the weight's gradient goes to
        // the sink (the residual takes the weight's argument slot) and it is
        // tracked (else the op might not be built, and the sink not fed);
        // otherwise it is added after the op.
        // A handed residual (its token in the graph) is always the op's.
        let (residual, residual_after) = match residual {
            Some(r) if sink.is_some() && (r.track_op() || residual_token.is_some()) => {
                (Some(r), None)
            }
            r => (None, r),
        };
        // the residual's gradient to a LayerNorm reading the same tensor
        let residual_grad = match (residual, residual_grad) {
            (Some(_), Some(rg)) if rg.attach_writer()? => Some(rg),
            _ => None,
        };
        if hand_out.is_some() && residual_after.is_some() {
            return Err(Error::Unsupported {
                op: "Linear::forward",
                what: "a handed-on output with its residual added outside the op (no gradient sink, or an untracked residual)".into(),
            });
        }
        if residual_token.is_some() && (residual.is_none() || residual_grad.is_none()) {
            return Err(Error::Unsupported {
                op: "Linear::forward",
                what:
                    "a handed residual without a gradient sink or a LayerNorm reading its gradient"
                        .into(),
            });
        }
        if sink.is_none() && !matches!(weight, Weight::F32(_)) {
            return Err(Error::Unsupported {
                op: "Linear::forward",
                what: format!(
                    "`{}` has a {} weight but no gradient sink",
                    self.name,
                    weight.kind()
                ),
            });
        }
        let passes = Passes::of(mode);
        let step = current_step();
        let (wq, wq_t) = self.weight_operand(weight, &passes, step)?;
        let (xq, xq_t) = self.input_operand(x, x_amax.as_ref(), &passes, step)?;
        let Passes {
            scaling,
            fprop,
            dgrad,
            wgrad,
            fmt,
            block,
        } = passes;
        // Native copies where a GEMM runs natively.
        // (made once: the forward's GEMM and the copy kept for dgrad share it)
        let w_native_once = std::cell::OnceCell::new();
        let w_native = || -> Result<Tensor> {
            if let Some(w) = w_native_once.get() {
                return Ok(Tensor::clone(w));
            }
            let w = weight.native(x.dtype())?;
            Ok(w_native_once.get_or_init(|| w).clone())
        };
        // the weight's codes cast again in backward where it is stored in
        // F32 or FP16 (an O3 weight's FP8 copy is kept as it is)
        let w_origin = match weight {
            Weight::F32(var) if recast => Some(Origin::Value(var.as_tensor().clone())),
            Weight::F16(t) if recast => Some(Origin::Scaled(t.clone())),
            _ => None,
        };
        // `in_gemm`: the bias and the op's residual were added in the GEMM's
        // epilogue (BF16 activations: the bias as BF16, which cuBLASLt
        // takes, both before the output's one rounding).
        let (y, in_gemm, block_saved) = if let Some(r) = &block {
            let keep = (origin.is_none(), w_origin.is_none());
            // bias and residual in the GEMM's epilogue with BF16 activations,
            // as the per-tensor path below
            let fused = x.dtype() == DType::BF16 && (self.bias.is_some() || residual.is_some());
            let (bias, res) = match fused {
                true => self.epilogue_addends(residual, out_dim)?,
                false => (None, None),
            };
            let epi = Epilogue {
                bias: bias.as_ref(),
                residual: res.as_ref(),
            };
            // an FP16 weight's operands from one read of its codes where
            // that applies, else cast from its decoded value
            let from_codes = match weight {
                Weight::F16(t) => block::scaled_weight_operands(t, x.dtype(), r, keep.1)?,
                _ => None,
            };
            let (w_ops, w_source) = match from_codes {
                Some(ops) => (ops, None),
                None => {
                    let w = w_native()?;
                    (block::weight_operands(&w, r, keep.1)?, Some(w))
                }
            };
            let (y, x_t, w_t) =
                block::forward(x, w_ops, w_source.as_ref(), r, keep.0, epi, &self.casts)?;
            (y, fused, Some((x_t, w_t)))
        } else {
            let (y, in_gemm) = match (&xq, &wq) {
                // A saturating cast hides inf: a non-finite input amax makes the
                // output NaN, never silently finite; the flag rides in x's
                // scale_inv (flag.rs).
                (Some(xq), Some(wq)) if fprop => {
                    let xq = flagged_by_amax(xq)?;
                    // Fast accumulation in fprop, as Transformer Engine.
                    if x.dtype() == DType::BF16 && (self.bias.is_some() || residual.is_some()) {
                        let (bias, res) = self.epilogue_addends(residual, out_dim)?;
                        let epi = Epilogue {
                            bias: bias.as_ref(),
                            residual: res.as_ref(),
                        };
                        (fp8_gemm_fused(&xq, wq, DType::BF16, true, epi)?, true)
                    } else {
                        (fp8_gemm_with(&xq, wq, x.dtype(), true)?, false)
                    }
                }
                _ => (x.matmul(&w_native()?.t()?)?, false),
            };
            (y, in_gemm, None)
        };
        let (x_saved, w_saved) = match block_saved {
            Some(tiles) => kept_tiles(tiles, (origin, w_origin))?,
            None => (
                kept_operand((xq, xq_t), wgrad, origin, || Ok(x.clone()))?,
                kept_operand((wq, wq_t), dgrad, w_origin, w_native)?,
            ),
        };
        *self.saved_bytes.lock().map_err(|_| Error::Poisoned {
            op: "Linear::forward",
        })? = x_saved.nbytes() + w_saved.nbytes();
        // The op's second argument: the weight's Var when its gradient goes
        // to candle's GradStore; otherwise a tracked one-element placeholder,
        // so candle runs the backward (and feeds the sink) even when `x` is
        // plain data, as for the first layer of a model.
        let w_arg = match (weight, residual) {
            (Weight::F32(var), _) if sink.is_none() => var.as_tensor().clone(),
            // with a sink the residual (or its token) takes the weight's place
            (_, Some(r)) => residual_token.cloned().unwrap_or_else(|| r.clone()),
            _ => Var::zeros(1, DType::F32, x.device())?.as_tensor().clone(),
        };
        // without a bias the weight argument stands in (its third gradient
        // is never returned), so no placeholder is allocated per forward
        let b_arg = self.bias.clone().unwrap_or_else(|| w_arg.clone());
        let tracked = arg0.track_op() || w_arg.track_op() || b_arg.track_op();
        // The bias is added in one pass and its gradient (a column sum of
        // dy) comes from the op's backward: no graph node holds the product
        // without the bias. Where the bias kernel takes it, the op's
        // forward adds bias (and residual) into the storage it returns,
        // rather than copying a finished output into it.
        let epilogue = tracked
            && !in_gemm
            && hand_out.is_none()
            && self
                .bias
                .as_ref()
                .is_some_and(|b| crate::nn::fused::bias_kernel_takes(&y, b));
        let y = if in_gemm {
            y.reshape(out_dims.clone())?
        } else if epilogue {
            y
        } else {
            let y = match &self.bias {
                Some(b) => crate::nn::fused::bias_add_detached(&y, b)?,
                None => y,
            };
            let y = y.reshape(out_dims.clone())?;
            match residual {
                Some(r) => (r.detach() + y)?,
                None => y,
            }
        };
        let hand_out = hand_out.map(|(h, slot)| {
            *slot = Some(y.clone());
            h
        });
        if !tracked {
            if hand_out.is_some() {
                return Err(Error::Unsupported {
                    op: "Linear::forward",
                    what: "a handed-on output of an op outside the graph".into(),
                });
            }
            return Ok(match residual_after {
                Some(r) => (r + y)?,
                None => y,
            });
        }
        let op = Fp8LinearOp {
            y: Precomputed::new("amp_fp8_linear", y),
            epilogue,
            out_shape: out_dims.into(),
            has_bias: self.bias.is_some(),
            activation,
            act_z,
            residual: residual.is_some(),
            // a handed residual's value (its token is the graph argument)
            residual_value: residual_token.and(residual).map(Tensor::detach),
            residual_grad,
            handoff,
            hand_out,
            x_shape: x_nd.shape().clone(),
            x_saved,
            w_saved,
            plan: Plan {
                dgrad,
                wgrad,
                bwd_format: fmt.backward(),
                scaling,
                block,
            },
            state: self.scaling.clone(),
            casts: self.casts.clone(),
            step,
            sink,
            name: self.name.clone(),
            x_dtype: x.dtype(),
            w_dtype: w_arg.dtype(),
        };
        // a handed-on output whose bias gradient and cast would take the
        // gradient's column sums and amax: the consumer takes them in its
        // backward's pass where it can (`Handoff::want_col_stats`)
        if let Some(h) = &op.hand_out {
            let p = &op.plan;
            if op.has_bias
                && switches::producer_amax()
                && p.block.is_none()
                && (p.dgrad || p.wgrad)
                && matches!(p.scaling, Scaling::Current(_))
            {
                h.want_col_stats();
            }
        }
        let y = arg0.apply_op3(&w_arg, &b_arg, op)?;
        match residual_after {
            Some(r) => Ok((r + y)?),
            None => Ok(y),
        }
    }
}

impl Linear {
    /// The sink this forward's op feeds: the layer's, except for a native
    /// product of an F32 weight, which hands its gradient to candle's
    /// GradStore whatever sink is set, as candle's own ops did.
    fn op_sink(&self, mode: &ComputeMode, weight: &Weight) -> Result<Option<GradSink>> {
        let sink = self
            .sink
            .lock()
            .map_err(|_| Error::Poisoned {
                op: "Linear::forward",
            })?
            .clone();
        Ok(match (mode, weight) {
            (ComputeMode::Native, Weight::F32(_)) => None,
            _ => sink,
        })
    }

    /// The bias (as BF16, which cuBLASLt's epilogue takes) and the residual
    /// (2-D) for a GEMM's epilogue.
    fn epilogue_addends(
        &self,
        residual: Option<&Tensor>,
        out_dim: usize,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let bias = match &self.bias {
            Some(b) => Some(b.detach().reshape(out_dim)?.to_dtype(DType::BF16)?),
            None => None,
        };
        let res = match residual {
            Some(r) => Some(r.detach().reshape(((), out_dim))?),
            None => None,
        };
        Ok((bias, res))
    }
}

/// What the backward keeps of a per-tensor operand `(codes, transposed
/// codes)`: the codes its GEMM takes where that GEMM (`fp8`) runs in FP8
/// (the transpose where there is one), with `origin` to cast them again
/// from under `nn::selective`; else the `native` tensor.
fn kept_operand(
    (q, q_t): (Option<ScalingTensor>, Option<ScalingTensor>),
    fp8: bool,
    origin: Option<Origin>,
    native: impl FnOnce() -> Result<Tensor>,
) -> Result<Saved> {
    Ok(match (q, q_t) {
        (_, Some(t)) if fp8 => Saved::fp8(t, true, origin),
        (Some(q), None) if fp8 => Saved::fp8(q, false, origin),
        _ => Saved::Native(native()?),
    })
}

/// What the backward keeps of the block forward's tiles `(x's, W's)`:
/// under `nn::selective` the sources to cast them again from, else the
/// tiles.
fn kept_tiles(
    (x_t, w_t): (Option<BlockTensor>, Option<BlockTensor>),
    (x_from, w_from): (Option<Origin>, Option<Origin>),
) -> Result<(Saved, Saved)> {
    let x = match (x_from, x_t) {
        (Some(from), _) => Saved::BlockFrom {
            from,
            weight: false,
        },
        (None, Some(x_t)) => Saved::Block(x_t),
        (None, None) => return Err(kept_nothing()),
    };
    let w = match (w_from, w_t) {
        (Some(from), _) => Saved::BlockFrom { from, weight: true },
        (None, Some(w_t)) => Saved::Block(w_t),
        (None, None) => return Err(kept_nothing()),
    };
    Ok((x, w))
}

/// The block forward kept an operand neither as codes nor as a source:
/// never (it keeps whatever has no source).
fn kept_nothing() -> Error {
    Error::Unsupported {
        op: "Linear::forward",
        what: "a block-scaled operand with neither codes nor a source".into(),
    }
}
