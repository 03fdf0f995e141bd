//! `amp::nn::Linear`: a drop-in for `candle_nn::Linear` whose matrix
//! products run in FP8 inside an [`fp8_autocast`](super::fp8_autocast) scope.

use super::linear_op::{LastCasts, LayerScaling, SharedScaling};
use super::registry::LinearParts;
use super::sink::GradSink;
use crate::error::{Error, Result};
use crate::weight::{Weight, WeightSlot};
use candle_core::{Module, Tensor, Var};
use std::sync::{Arc, Mutex};

/// A linear layer `y = x · Wᵀ + b` with `W: [out, in]`, as `candle_nn::Linear`.
///
/// Outside an FP8 scope (or with a native mode) an F32 weight runs candle's
/// own matmul. In an FP8 mode: fprop casts the input and weight to E4M3
/// (forward format), dgrad and wgrad cast the output gradient to the
/// backward format (E5M2 under HYBRID), each GEMM accumulates in f32; the
/// input is kept for backward as FP8 only. The weight gradient goes to the
/// layer's [`GradSink`] as E4M3 if one is set, else to candle's `GradStore`.
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
            if let Some(mut existing) = super::registry::registered_linear(weight.id()) {
                existing.bias = bias;
                return Ok(existing);
            }
            let layer = Self::from_slot(
                name,
                WeightSlot::new(Weight::F32(Var::from_tensor(&weight)?)),
                bias,
            );
            super::registry::register(weight.id(), layer.parts());
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
    /// cast yet). A host read: telemetry, not for the training step.
    ///
    /// # Errors
    /// [`Error::Poisoned`]; candle's.
    pub fn last_cast_stats(&self) -> Result<[Option<crate::CastStats>; 3]> {
        let casts = self
            .casts
            .lock()
            .map_err(|_| Error::Poisoned {
                op: "Linear::last_cast_stats",
            })?
            .clone();
        let mut out = [None; 3];
        for (o, m) in out.iter_mut().zip(casts.iter()) {
            if let Some(m) = m {
                *o = m.last_cast_stats()?;
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
