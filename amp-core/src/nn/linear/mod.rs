//! `amp::nn::Linear`: a drop-in for `candle_nn::Linear` whose matrix
//! products run in FP8 inside an [`fp8_autocast`](super::fp8_autocast) scope.
//!
//! One concept in this file: the layer, its constructors (from tensors, a
//! weight slot or a `VarBuilder`), its checks and its native path. The
//! forward through the layer's own autograd op ([`op`]) is in
//! `forward.rs`; the fused forms that take a LayerNorm before, GELU on the
//! input or a residual after into that op, and the handing of tensors to
//! and from it, in `fuse.rs`; the op's backward in `op.rs`, what it keeps
//! for it in `saved.rs`; which passes a mode runs in FP8 and the weight's
//! and input's GEMM operands in `operands.rs`, the weights' casts made
//! ahead in `ahead.rs`; the head and its cross-entropy over chunks of
//! rows in `head_loss.rs`; the per-layer scaling state (TE's `fp8_meta`)
//! in `layer_scaling.rs`; the table that finds a layer again from its
//! weight in `registry.rs`; the switches a run sets once (FP8 activation
//! inputs, the native op on CUDA, the loss's chunks) in `switches.rs`.

mod ahead;
mod block;
mod forward;
mod fuse;
mod head_loss;
mod layer_scaling;
pub(crate) mod op;
mod operands;
mod registry;
mod saved;
mod switches;

use super::mode::{current_mode, ComputeMode};
use crate::error::{Error, Result};
use crate::scaling::sink::GradSink;
use crate::scaling::weight::{Weight, WeightSlot};
use candle_core::{DType, Module, Tensor, TensorId, Var};
use fuse::OpFuse;
use layer_scaling::{LastCasts, SharedScaling};
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
