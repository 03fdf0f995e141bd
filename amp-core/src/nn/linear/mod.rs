//! `amp::nn::Linear`: a drop-in for `candle_nn::Linear` whose matrix
//! products run in FP8 inside an [`fp8_autocast`](super::fp8_autocast) scope.
//!
//! One concept in this file: the layer, its constructors (from tensors, a
//! weight slot or a `VarBuilder`), and its forward paths: the checks, the
//! native path, the FP8 path through its autograd op ([`op`]). The fused
//! forms that take a LayerNorm before, GELU on the input or a residual
//! after into that op, and the handing of tensors to and from it, are in
//! `fuse.rs`; the op's backward in `op.rs`, what it keeps for it in
//! `saved.rs`; which passes a mode runs in
//! FP8 and the weight's and input's GEMM operands in `operands.rs`, the
//! weights' casts made ahead in `ahead.rs`; the per-layer scaling state
//! (TE's `fp8_meta`) in `layer_scaling.rs`; the table that finds a layer
//! again from its weight in `registry.rs`; the switches a run sets once
//! (FP8 activation inputs, the native op on CUDA) in `switches.rs`.

mod ahead;
mod block;
mod fuse;
mod head_loss;
mod layer_scaling;
pub(crate) mod op;
mod operands;
mod registry;
mod saved;
mod switches;

use super::mode::{current_mode, current_step, ComputeMode};
use super::precomputed::Precomputed;
use super::selective;
use crate::error::{Error, Result};
use crate::gemm::{fp8_gemm_fused, fp8_gemm_with, Epilogue};
use crate::scaling::flag::flagged_by_amax;
use crate::scaling::sink::GradSink;
use crate::scaling::weight::{Weight, WeightSlot};
use candle_core::{DType, Module, Tensor, TensorId, Var};
use fuse::OpFuse;
use layer_scaling::{LastCasts, Scaling, SharedScaling};
use op::{Fp8LinearOp, KeptInput, Origin, Plan, Saved};
use operands::Passes;
use registry::LinearParts;
use std::sync::{Arc, Mutex};

pub use ahead::cast_weights_ahead;
pub use fuse::Fuse;
pub use layer_scaling::LayerScaling;
pub use switches::{
    fp8_activation_inputs, loss_chunk_rows, native_op_on_cuda, producer_amax,
    set_fp8_activation_inputs, set_loss_chunk_rows, set_native_op_on_cuda, set_producer_amax,
    set_weight_casts_ahead, weight_casts_ahead, DEFAULT_LOSS_CHUNK_ROWS,
};

/// A linear layer `y = x · Wᵀ + b` with `W: [out, in]`, as `candle_nn::Linear`.
///
/// Outside an FP8 scope (or with a native mode) an F32 weight's product is
/// native: on the CPU in the input's dtype through the layer's op, as in
/// the FP8 modes; on CUDA candle's matmul in BF16. In an FP8 mode: fprop
/// casts the input and weight to E4M3 (forward format), dgrad and wgrad
/// cast the output gradient to the backward format (E5M2 under HYBRID),
/// each GEMM accumulates in f32; the input is kept for backward as FP8
/// only. The weight gradient goes to the layer's [`GradSink`] as E4M3 if
/// one is set, else to candle's `GradStore`.
///
/// ```
/// use amp_core::nn::{self, fp8_autocast, ComputeMode};
/// use amp_core::CurrentScaling;
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let layer = nn::linear(64, 32, vb.pp("fc"))?;
/// let x = Tensor::randn(0f32, 1.0, (8, 64), &Device::Cpu)?;
/// let native = layer.forward(&x)?;
/// let fp8 = {
///     let _scope = fp8_autocast(true, ComputeMode::Fp8Current(CurrentScaling::default()));
///     layer.forward(&x)?
/// };
/// let rel = ((&fp8 - &native)?.sqr()?.sum_all()?.to_scalar::<f32>()?
///     / native.sqr()?.sum_all()?.to_scalar::<f32>()?).sqrt();
/// assert!(rel < 0.1, "{rel}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Linear {
    pub(super) name: String,
    pub(super) weight: WeightSlot,
    pub(super) bias: Option<Tensor>,
    pub(super) scaling: SharedScaling,
    pub(super) sink: Arc<Mutex<Option<GradSink>>>,
    pub(super) saved_bytes: Arc<Mutex<usize>>,
    pub(super) high_precision: Arc<std::sync::atomic::AtomicBool>,
    pub(super) casts: LastCasts,
    pub(super) ahead: ahead::SharedAhead,
}

impl Linear {
    /// A layer over an existing weight `[out, in]` (a `Var`'s tensor keeps
    /// its identity, so candle's `GradStore` finds it) and optional bias.
    /// `name` names the weight in sinks and reports (`<prefix>.weight`).
    ///
    /// # Errors
    /// [`Error::Rank`] unless the weight is 2-D.
    pub fn new(name: impl Into<String>, weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        if weight.rank() != 2 {
            return Err(Error::Rank {
                op: "Linear::new",
                expected: 2,
                got: weight.shape().clone(),
            });
        }
        if weight.is_variable() {
            // A second layer over the same Var shares the first one's slot,
            // scaling state, sink and name: one weight, one storage.
            if let Some(mut existing) = registered_linear(weight.id()) {
                existing.bias = bias;
                return Ok(existing);
            }
            let layer = Self::from_slot(
                name,
                WeightSlot::new(Weight::F32(Var::from_tensor(&weight)?)),
                bias,
            );
            registry::register(weight.id(), layer.parts());
            return Ok(layer);
        }
        Ok(Self::from_slot(
            name,
            WeightSlot::new(Weight::F32(Var::from_tensor(&weight)?)),
            bias,
        ))
    }

    fn parts(&self) -> LinearParts {
        LinearParts {
            name: self.name.clone(),
            weight: self.weight.downgrade(),
            scaling: Arc::downgrade(&self.scaling),
            sink: Arc::downgrade(&self.sink),
            saved_bytes: Arc::downgrade(&self.saved_bytes),
            high_precision: Arc::downgrade(&self.high_precision),
            casts: Arc::downgrade(&self.casts),
            ahead: Arc::downgrade(&self.ahead),
        }
    }

    /// The layer again from its registered parts (without its bias, which
    /// lives in the `VarMap`).
    pub(crate) fn from_parts(p: &LinearParts) -> Option<Self> {
        Some(Self {
            name: p.name.clone(),
            weight: WeightSlot::from_arc(p.weight.upgrade()?),
            bias: None,
            scaling: p.scaling.upgrade()?,
            sink: p.sink.upgrade()?,
            saved_bytes: p.saved_bytes.upgrade()?,
            high_precision: p.high_precision.upgrade()?,
            casts: p.casts.upgrade()?,
            ahead: p.ahead.upgrade()?,
        })
    }

    /// A layer over a shared weight slot (any storage).
    pub fn from_slot(name: impl Into<String>, weight: WeightSlot, bias: Option<Tensor>) -> Self {
        Self {
            name: name.into(),
            weight,
            bias,
            scaling: Arc::default(),
            sink: Arc::default(),
            saved_bytes: Arc::default(),
            high_precision: Arc::default(),
            casts: Arc::default(),
            ahead: Arc::default(),
        }
    }

    /// The weight's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The weight slot (shared: the levels engine converts its storage).
    pub fn weight_slot(&self) -> &WeightSlot {
        &self.weight
    }

    /// The bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The tensors of this layer whose gradients candle's `GradStore`
    /// collects: the weight while it is an F32 `Var` (O0, or kept in high
    /// precision), and the bias. What [`recompute`](super::recompute)
    /// needs to be told a block reads; weights in FP16 or FP8 send their
    /// gradients to the sink instead.
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn vars(&self) -> Result<Vec<Tensor>> {
        let mut vars = Vec::with_capacity(2);
        if let Weight::F32(w) = &*self.weight.read()? {
            vars.push(w.as_tensor().clone());
        }
        vars.extend(self.bias.clone());
        Ok(vars)
    }

    /// Sends this layer's weight gradients to `sink` (or, with `None`, to
    /// candle's `GradStore`).
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn set_grad_sink(&self, sink: Option<GradSink>) -> Result<()> {
        *self.sink.lock().map_err(|_| Error::Poisoned {
            op: "Linear::set_grad_sink",
        })? = sink;
        Ok(())
    }

    /// Keeps this layer out of FP8 (the output head, say): it computes
    /// natively inside any scope.
    pub fn set_high_precision(&self, on: bool) {
        self.high_precision
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the layer is kept out of FP8.
    pub fn is_high_precision(&self) -> bool {
        self.high_precision
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The delayed-scaling state (input, weight, output-gradient metas), once
    /// a delayed-scaling forward has run.
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn scaling_state(&self) -> Result<Option<LayerScaling>> {
        Ok(self
            .scaling
            .lock()
            .map_err(|_| Error::Poisoned {
                op: "Linear::scaling_state",
            })?
            .clone())
    }

    /// What the layer's last FP8 casts of its input, weight and output
    /// gradient saturated and flushed (any FP8 mode; `None` for a role not
    /// cast yet, or cast without counting: casts count while their thread
    /// asked, [`set_cast_counts`](crate::set_cast_counts), or records
    /// telemetry). A host read: telemetry, not for the training step.
    ///
    /// # Errors
    /// [`Error::Poisoned`]; candle's.
    pub fn last_cast_stats(&self) -> Result<[Option<crate::CastStats>; 3]> {
        let metas = self
            .casts
            .lock()
            .map_err(|_| Error::Poisoned {
                op: "Linear::last_cast_stats",
            })?
            .metas
            .clone();
        let mut out = [None; 3];
        for (o, m) in out.iter_mut().zip(metas.iter()) {
            if let Some(m) = m {
                *o = m.last_cast_stats()?;
            }
        }
        Ok(out)
    }

    /// The telemetry records of this layer's last casts while telemetry
    /// recorded ([`set_telemetry`](super::set_telemetry)), per role of
    /// [`TELEMETRY_ROLES`](super::TELEMETRY_ROLES) (`None` for a role not
    /// cast since the last take: a layer out of FP8, or the weight
    /// gradient without a sink), read back and cleared. Host reads:
    /// telemetry, not for the training step.
    ///
    /// # Errors
    /// [`Error::Poisoned`]; candle's.
    pub fn take_telemetry(&self) -> Result<[Option<super::CastRecord>; 4]> {
        let records = std::mem::take(
            &mut self
                .casts
                .lock()
                .map_err(|_| Error::Poisoned {
                    op: "Linear::take_telemetry",
                })?
                .records,
        );
        let mut out = [None; 4];
        for (o, r) in out.iter_mut().zip(records.iter()) {
            if let Some(r) = r {
                *o = Some(r.read()?);
            }
        }
        Ok(out)
    }

    /// Replaces the delayed-scaling state (checkpoints).
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn set_scaling_state(&self, state: Option<LayerScaling>) -> Result<()> {
        *self.scaling.lock().map_err(|_| Error::Poisoned {
            op: "Linear::set_scaling_state",
        })? = state;
        Ok(())
    }

    /// Bytes this layer kept for backward in its last forward (input and
    /// weight as saved, scales included); 0 after a native forward of an F32
    /// weight, whose saved tensors are candle's.
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn saved_bytes(&self) -> Result<usize> {
        Ok(*self.saved_bytes.lock().map_err(|_| Error::Poisoned {
            op: "Linear::saved_bytes",
        })?)
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.try_forward(x).map_err(candle_core::Error::wrap)
    }
}

// The forward pass of `amp::nn::Linear`: checks, the native path, and the
// FP8 path through the autograd op.

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
        self.prepare_for(x, None)
    }

    /// [`prepare`](Self::prepare) for an input that `activation` takes
    /// first (SwiGLU's is twice the layer's width).
    pub(super) fn prepare_for(
        &self,
        x: &Tensor,
        activation: Option<crate::nn::Activation>,
    ) -> Result<(Weight, usize, ComputeMode)> {
        let weight = self.weight.read()?.clone();
        let (out_dim, in_dim) = weight.shape().dims2()?;
        let in_dim = activation.map_or(in_dim, |a| a.input_width(in_dim));
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

    /// Whether the layer runs its own op in `mode` on `x` rather than
    /// candle's ops: in the FP8 modes and for low-bit weights, and on the
    /// CPU for native products of an F32 weight too (the op's fused forms
    /// take the LayerNorm before, the activation, the residual and the
    /// hand-offs: the same values, 11% faster and 30% less kept for the
    /// tiny GPT at O0; BENCHMARKS.md "O0 through the layers' op"). On CUDA
    /// the same for 16-bit inputs (1.72x the tokens/s of candle's graph at
    /// 350M) unless [`set_native_op_on_cuda`] turns it off; F32 inputs
    /// there stay candle's matmul.
    pub(super) fn own_op(mode: &ComputeMode, weight: &Weight, x: &Tensor) -> bool {
        match (mode, weight) {
            (ComputeMode::Native, Weight::F32(_)) => {
                !x.device().is_cuda() || (native_op_on_cuda() && x.dtype() != DType::F32)
            }
            _ => true,
        }
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
            (ComputeMode::Native, Weight::F32(var)) if !Self::own_op(&mode, &weight, x) => {
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
            _ => return self.scaled_forward(x, &weight, &mode, out_dim, OpFuse::default()),
        };
        match &self.bias {
            Some(b) => super::fused::bias_add(&y, b),
            None => Ok(y),
        }
    }

    /// Forward through the custom op (FP8 mode, or a low-bit weight in
    /// native mode). The op takes `x` as it is (any rank) and flattens it
    /// inside, so the graph holds one node, not two reshapes around it;
    /// with an `activation` the op's input is the activation's input (see
    /// [`forward_with`](Self::forward_with)).
    fn scaled_forward(
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
        let sink = self
            .sink
            .lock()
            .map_err(|_| Error::Poisoned {
                op: "Linear::forward",
            })?
            .clone();
        // a native product of an F32 weight hands its gradient to candle's
        // GradStore whatever sink is set, as candle's own ops did
        let sink = match (mode, weight) {
            (ComputeMode::Native, Weight::F32(_)) => None,
            _ => sink,
        };
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
            let w = weight.master_f32()?.to_dtype(x.dtype())?;
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
            let bias = match &self.bias {
                Some(b) if fused => Some(b.detach().reshape(out_dim)?.to_dtype(DType::BF16)?),
                _ => None,
            };
            let res = match residual {
                Some(r) if fused => Some(r.detach().reshape(((), out_dim))?),
                _ => None,
            };
            let epi = Epilogue {
                bias: bias.as_ref(),
                residual: res.as_ref(),
            };
            let (y, x_t, w_t) = block::forward(x, &w_native()?, r, keep, epi, &self.casts)?;
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
            (y, in_gemm, None)
        };
        let (x_saved, w_saved) = match block_saved {
            // under `nn::selective`, cast again in backward where a source is kept
            Some((x_t, w_t)) => (
                match (origin, x_t) {
                    (Some(from), _) => Saved::BlockFrom {
                        from,
                        weight: false,
                    },
                    (None, Some(x_t)) => Saved::Block(x_t),
                    (None, None) => return Err(kept_nothing()),
                },
                match (w_origin, w_t) {
                    (Some(from), _) => Saved::BlockFrom { from, weight: true },
                    (None, Some(w_t)) => Saved::Block(w_t),
                    (None, None) => return Err(kept_nothing()),
                },
            ),
            None => (
                match (xq, xq_t) {
                    (_, Some(xt)) if wgrad => Saved::fp8(xt, true, origin),
                    (Some(xq), None) if wgrad => Saved::fp8(xq, false, origin),
                    _ => Saved::Native(x.clone()),
                },
                match (wq, wq_t) {
                    (_, Some(wt)) if dgrad => Saved::fp8(wt, true, w_origin),
                    (Some(wq), None) if dgrad => Saved::fp8(wq, false, w_origin),
                    _ => Saved::Native(w_native()?),
                },
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

/// The block forward kept an operand neither as codes nor as a source:
/// never (it keeps whatever has no source).
fn kept_nothing() -> Error {
    Error::Unsupported {
        op: "Linear::forward",
        what: "a block-scaled operand with neither codes nor a source".into(),
    }
}

// Building Linear layers from a `VarBuilder`, as `candle_nn::linear` does.

/// A linear layer with bias from a `VarBuilder`, initialized as
/// `candle_nn::linear` (weight `<prefix>.weight`, bias `<prefix>.bias`).
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn linear(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    linear_b(in_dim, out_dim, true, vb)
}

/// [`linear`] without bias.
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: candle_nn::VarBuilder) -> Result<Linear> {
    linear_b(in_dim, out_dim, false, vb)
}

/// [`linear`] with or without bias.
///
/// # Errors
/// candle's, from the `VarBuilder`.
pub fn linear_b(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: candle_nn::VarBuilder,
) -> Result<Linear> {
    let w = vb.get_with_hints(
        (out_dim, in_dim),
        "weight",
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
    )?;
    let b = if bias {
        let bound = 1.0 / (in_dim as f64).sqrt();
        Some(vb.get_with_hints(
            out_dim,
            "bias",
            candle_nn::Init::Uniform {
                lo: -bound,
                up: bound,
            },
        )?)
    } else {
        None
    };
    let name = if vb.prefix().is_empty() {
        "weight".to_string()
    } else {
        format!("{}.weight", vb.prefix())
    };
    Linear::new(name, w, b)
}

/// The Linear layer built from the `Var` with this tensor id, if it lives.
pub fn registered_linear(id: TensorId) -> Option<Linear> {
    registry::table()
        .lock()
        .ok()?
        .get(&id)
        .and_then(Linear::from_parts)
}
