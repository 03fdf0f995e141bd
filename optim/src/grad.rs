//! Gradients as they arrive: F32 tensors (from candle's backward) or FP8
//! scaling tensors (from the FP8 Linear's sink).

use crate::adamw::flat;
use crate::error::Result;
use amp_core::ScalingTensor;
use candle_core::{DType, Shape, Tensor};
use std::collections::HashMap;

/// One parameter's gradient.
#[derive(Debug, Clone)]
pub enum Grad {
    /// A full-precision gradient.
    F32(Tensor),
    /// A scaled low-precision gradient, decoded during the step.
    Scaled(ScalingTensor),
}

impl Grad {
    /// The shape.
    pub fn shape(&self) -> &Shape {
        match self {
            Self::F32(t) => t.shape(),
            Self::Scaled(t) => t.shape(),
        }
    }

    /// False when the gradient held inf or NaN before it was cast: a
    /// saturating FP8 cast turns inf into max, so a scaled gradient keeps its
    /// input's amax in its metadata and that is checked too.
    ///
    /// # Errors
    /// Only candle's.
    pub fn source_is_finite(&self) -> Result<bool> {
        match self {
            Self::F32(_) => Ok(true),
            Self::Scaled(t) => Ok(t
                .meta()
                .amax()?
                .to_vec1::<f32>()?
                .iter()
                .all(|a| a.is_finite())),
        }
    }

    /// The value as an F32 tensor.
    ///
    /// # Errors
    /// Only candle's.
    pub fn to_f32(&self) -> Result<Tensor> {
        match self {
            Self::F32(t) => Ok(t.to_dtype(DType::F32)?),
            Self::Scaled(t) => Ok(t.dequantize(DType::F32)?),
        }
    }

    /// The values as a flat F32 vector, decoded on the fly.
    ///
    /// # Errors
    /// Only candle's.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        match self {
            Self::F32(t) => flat(t),
            Self::Scaled(t) => flat(&t.dequantize(DType::F32)?),
        }
    }
}

/// Gradients by parameter name.
#[derive(Debug, Clone, Default)]
pub struct Grads(pub HashMap<String, Grad>);

impl Grads {
    /// No gradients.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a parameter's gradient.
    pub fn insert(&mut self, name: impl Into<String>, grad: Grad) {
        self.0.insert(name.into(), grad);
    }

    /// Adds a gradient, summing (in F32) with one already there.
    ///
    /// # Errors
    /// candle's, on shapes that differ.
    pub fn merge(&mut self, name: impl Into<String>, grad: Grad) -> Result<()> {
        let name = name.into();
        let grad = match self.0.remove(&name) {
            None => grad,
            Some(prev) => Grad::F32((prev.to_f32()? + grad.to_f32()?)?),
        };
        self.0.insert(name, grad);
        Ok(())
    }

    /// Adds every gradient of `more` to this one's (gradient accumulation
    /// over micro-batches): F32 sums stay F32; the sum of two scaled
    /// gradients is taken in F32 and re-encoded in their format with a
    /// fresh current scale (as the layers' sink sums a weight used twice),
    /// NaN when either held inf or NaN before its cast, so that the step
    /// still sees it; a scaled and an F32 gradient sum to F32.
    ///
    /// # Errors
    /// candle's, on shapes that differ.
    pub fn accumulate(&mut self, more: Grads) -> Result<()> {
        for (name, grad) in more.0 {
            let sum = match (self.0.remove(&name), grad) {
                (None, g) => g,
                (Some(Grad::Scaled(a)), Grad::Scaled(b)) => {
                    // amax * 0: 0, or NaN when a source was not finite
                    let poison = a
                        .meta()
                        .amax()?
                        .maximum(&b.meta().amax()?)?
                        .affine(0.0, 0.0)?;
                    let sum = (a.dequantize(DType::F32)? + b.dequantize(DType::F32)?)?
                        .broadcast_add(&poison)?;
                    let recipe = amp_core::CurrentScaling::default();
                    Grad::Scaled(ScalingTensor::quantize(&sum, a.qtype(), &recipe)?.0)
                }
                (Some(prev), g) => Grad::F32((prev.to_f32()? + g.to_f32()?)?),
            };
            self.0.insert(name, sum);
        }
        Ok(())
    }

    /// A parameter's gradient.
    pub fn get(&self, name: &str) -> Option<&Grad> {
        self.0.get(name)
    }
}
