//! The forward pass of `amp::nn::Linear`: checks, the native path, and the
//! FP8 path through the autograd op.

use super::flag::flagged_by_amax;
use super::linear::Linear;
use super::linear_op::{cast, Fp8LinearOp, Plan, Role, Saved, Scaling, Source};
use super::mode::{current_mode, current_step, ComputeMode};
use super::precomputed::Precomputed;
use crate::error::{Error, Result};
use crate::gemm::{fp8_gemm_fused, fp8_gemm_with, Epilogue};
use crate::weight::Weight;
use candle_core::{DType, Tensor, Var};

impl Linear {
    fn check_input(&self, x: &Tensor, in_dim: usize) -> Result<()> {
        const OP: &str = "Linear::forward";
        if !x.dtype().is_float() {
            return Err(Error::DType {
                op: OP,
                expected: "a float dtype",
                got: x.dtype(),
            });
        }
        if x.rank() == 0 || x.dims()[x.rank() - 1] != in_dim {
            return Err(Error::Shape {
                op: OP,
                lhs: x.shape().clone(),
                rhs: (in_dim,).into(),
            });
        }
        if !x.device().same_device(self.weight.read()?.device()) {
            return Err(Error::Device {
                op: OP,
                lhs: x.device().location(),
                rhs: self.weight.read()?.device().location(),
            });
        }
        Ok(())
    }

    /// The weight, its output width and the compute mode for input `x`,
    /// after checking `x` against the weight: where every forward starts.
    pub(super) fn prepare(&self, x: &Tensor) -> Result<(Weight, usize, ComputeMode)> {
        let weight = self.weight.read()?.clone();
        let (out_dim, in_dim) = weight.shape().dims2()?;
        self.check_input(x, in_dim)?;
        Ok((weight, out_dim, self.mode()))
    }

    /// The compute mode now: native for a high-precision layer, else the
    /// scope's.
    pub(super) fn mode(&self) -> ComputeMode {
        if self.is_high_precision() {
            ComputeMode::Native
        } else {
            current_mode()
        }
    }

    /// Whether the layer runs its own op in `mode` (FP8 modes, low-bit
    /// weights) rather than candle's ops (native compute, F32 weight).
    pub(super) fn own_op(mode: &ComputeMode, weight: &Weight) -> bool {
        !matches!((mode, weight), (ComputeMode::Native, Weight::F32(_)))
    }

    /// The forward pass; see the type's docs.
    ///
    /// # Errors
    /// [`Error::Shape`] when the input's last dimension is not `in`,
    /// [`Error::DType`] for a non-float input, [`Error::Device`] when input
    /// and weight are on different devices, [`Error::Unsupported`] for a
    /// low-bit weight without a gradient sink.
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        let (weight, out_dim, mode) = self.prepare(x)?;
        let y = match (&mode, &weight) {
            (ComputeMode::Native, Weight::F32(var)) => {
                *self.saved_bytes.lock().map_err(|_| Error::Poisoned {
                    op: "Linear::forward",
                })? = 0;
                // Native compute: BF16 on CUDA (the O0 baseline on the GPU,
                // as PyTorch autocast), the input's dtype elsewhere.
                let compute = if x.device().is_cuda() && x.dtype() == DType::F32 {
                    DType::BF16
                } else {
                    x.dtype()
                };
                let w = var.as_tensor().to_dtype(compute)?;
                x.to_dtype(compute)?
                    .broadcast_matmul(&w.t()?)?
                    .to_dtype(x.dtype())?
            }
            // the op adds the bias itself
            _ => {
                return self.scaled_forward(
                    x,
                    &weight,
                    &mode,
                    out_dim,
                    super::forward_fused::OpFuse::default(),
                )
            }
        };
        match &self.bias {
            Some(b) => super::fused::bias_add(&y, b),
            None => Ok(y),
        }
    }

    /// Forward through the custom op (FP8 mode, or a low-bit weight in
    /// native mode). The op takes `x` as it is (any rank) and flattens it
    /// inside, so the graph holds one node, not two reshapes around it;
    /// with `gelu` the op's input is GELU's input (see
    /// [`forward_gelu`](Self::forward_gelu)).
    pub(super) fn scaled_forward(
        &self,
        x_nd: &Tensor,
        weight: &Weight,
        mode: &ComputeMode,
        out_dim: usize,
        fuse: super::forward_fused::OpFuse<'_>,
    ) -> Result<Tensor> {
        let super::forward_fused::OpFuse {
            gelu,
            residual,
            handoff,
            hand_out,
            residual_grad,
        } = fuse;
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
        // with a handed input the op keeps GELU's input itself (its graph
        // argument is a token)
        let gelu_z = (gelu && handoff.is_some()).then(|| x.clone());
        let x = &if gelu {
            super::fused::gelu_detached(x)?
        } else {
            x.clone()
        };
        let sink = self
            .sink
            .lock()
            .map_err(|_| Error::Poisoned {
                op: "Linear::forward",
            })?
            .clone();
        // The residual goes into the op where the weight's gradient goes to
        // the sink (the residual takes the weight's argument slot) and it is
        // tracked (else the op might not be built, and the sink not fed);
        // otherwise it is added after the op.
        let (residual, residual_after) = match residual {
            Some(r) if sink.is_some() && r.track_op() => (Some(r), None),
            r => (None, r),
        };
        // the residual's gradient to a LayerNorm reading the same tensor
        let residual_grad = match (residual, residual_grad) {
            (Some(_), Some(rg)) if rg.attach_writer()? => Some(rg),
            _ => None,
        };
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
        let (scaling, fprop, dgrad, wgrad, fmt) = match mode {
            ComputeMode::Native => (
                Scaling::Current(Default::default()),
                false,
                false,
                false,
                Default::default(),
            ),
            ComputeMode::Fp8Current(r) => {
                (Scaling::Current(r.clone()), true, true, true, r.fp8_format)
            }
            ComputeMode::Fp8Delayed(r) => {
                let o = r.override_linear_precision;
                (
                    Scaling::Delayed(r.clone()),
                    !o.fprop,
                    !o.dgrad,
                    !o.wgrad,
                    r.fp8_format,
                )
            }
        };
        let step = current_step();
        let fwd = fmt.forward();
        // Native copies where a GEMM runs natively.
        let w_native = || -> Result<Tensor> { Ok(weight.master_f32()?.to_dtype(x.dtype())?) };
        // With dgrad in FP8, the weight's cast also writes Wᵀ (dgrad's
        // K-major operand); with wgrad, x's writes xᵀ: each is kept for
        // backward in place of the row-major codes (same bytes), so the
        // backward GEMMs need no transpose.
        let (wq, wq_t) = if fprop || dgrad {
            match weight {
                // O3: the stored FP8 copy is the GEMM operand as it is.
                Weight::Fp8 { weight: w8, .. } | Weight::Fp8Gathered(w8)
                    if w8.qtype() == fwd.into() =>
                {
                    (Some(w8.clone()), None)
                }
                _ => {
                    let source = match weight {
                        Weight::F32(var) => Source::Tensor(var.as_tensor()),
                        Weight::F16(t) | Weight::Fp8 { master: t, .. } | Weight::Fp8Gathered(t) => {
                            Source::Scaled(t)
                        }
                    };
                    let (q, qt) = cast(
                        source,
                        fwd,
                        &scaling,
                        &self.scaling,
                        Role::Weight,
                        step,
                        &self.casts,
                        dgrad,
                    )?;
                    (Some(q), qt)
                }
            }
        } else {
            (None, None)
        };
        let (xq, xq_t) = if fprop || wgrad {
            let (q, qt) = cast(
                Source::Tensor(x),
                fwd,
                &scaling,
                &self.scaling,
                Role::Input,
                step,
                &self.casts,
                wgrad,
            )?;
            (Some(q), qt)
        } else {
            (None, None)
        };
        // `in_gemm`: the bias and the op's residual were added in the GEMM's
        // epilogue (BF16 activations: the bias as BF16, which cuBLASLt
        // takes, both before the output's one rounding).
        let (y, in_gemm) = match (&xq, &wq) {
            // A saturating cast hides inf: a non-finite input amax makes the
            // output NaN, never silently finite; the flag rides in x's
            // scale_inv (flag.rs).
            (Some(xq), Some(wq)) if fprop => {
                let xq = flagged_by_amax(xq)?;
                // Fast accumulation in fprop, as Transformer Engine.
                if x.dtype() == DType::BF16 && (self.bias.is_some() || residual.is_some()) {
                    let bias = match &self.bias {
                        Some(b) => Some(b.detach().reshape(out_dim)?.to_dtype(DType::BF16)?),
                        None => None,
                    };
                    let res = match residual {
                        Some(r) => Some(r.detach().reshape(((), out_dim))?),
                        None => None,
                    };
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
        let x_saved = match (xq, xq_t) {
            (_, Some(xt)) if wgrad => Saved::Fp8T(xt),
            (Some(xq), None) if wgrad => Saved::Fp8(xq),
            _ => Saved::Native(x.clone()),
        };
        let w_saved = match (wq, wq_t) {
            (_, Some(wt)) if dgrad => Saved::Fp8T(wt),
            (Some(wq), None) if dgrad => Saved::Fp8(wq),
            _ => Saved::Native(w_native()?),
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
            // with a sink the residual takes the weight's place
            (_, Some(r)) => r.clone(),
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
                .is_some_and(|b| super::fused::bias_kernel_takes(&y, b));
        let y = if in_gemm {
            y.reshape(out_dims.clone())?
        } else if epilogue {
            y
        } else {
            let y = match &self.bias {
                Some(b) => super::fused::bias_add_detached(&y, b)?,
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
            gelu,
            gelu_z,
            residual: residual.is_some(),
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
            },
            state: self.scaling.clone(),
            casts: self.casts.clone(),
            step,
            sink,
            name: self.name.clone(),
            x_dtype: x.dtype(),
            w_dtype: w_arg.dtype(),
        };
        let y = arg0.apply_op3(&w_arg, &b_arg, op)?;
        match residual_after {
            Some(r) => Ok((r + y)?),
            None => Ok(y),
        }
    }
}
