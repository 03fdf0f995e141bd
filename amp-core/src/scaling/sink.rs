//! `GradSink`: where FP8 Linear layers hand their weight gradients, as FP8
//! scaling tensors, instead of candle's `GradStore`.

use crate::error::{Error, Result};
use crate::numerics::recipe::CurrentScaling;
use crate::scaling::tensor::ScalingTensor;
use candle_core::DType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Weight gradients by layer weight name (`<layer prefix>.weight`); clones
/// share the same store. Two gradients for one name (a weight used twice)
/// are summed in f32 and re-encoded.
#[derive(Debug, Clone, Default)]
pub struct GradSink(Arc<Mutex<HashMap<String, ScalingTensor>>>);

impl GradSink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a gradient.
    ///
    /// # Errors
    /// [`Error::Poisoned`]; candle's on a shape mismatch when summing.
    pub fn add(&self, name: &str, grad: ScalingTensor) -> Result<()> {
        let mut map = self.0.lock().map_err(|_| Error::Poisoned {
            op: "GradSink::add",
        })?;
        let grad = match map.remove(name) {
            None => grad,
            Some(prev) => {
                let sum = (prev.dequantize(DType::F32)? + grad.dequantize(DType::F32)?)?;
                ScalingTensor::quantize(&sum, grad.qtype(), &CurrentScaling::default())?.0
            }
        };
        map.insert(name.to_string(), grad);
        Ok(())
    }

    /// Takes every gradient out, leaving the sink empty.
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn take(&self) -> Result<HashMap<String, ScalingTensor>> {
        let mut map = self.0.lock().map_err(|_| Error::Poisoned {
            op: "GradSink::take",
        })?;
        Ok(std::mem::take(&mut *map))
    }

    /// Bytes held by the gradients now in the sink.
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn nbytes(&self) -> Result<usize> {
        let map = self.0.lock().map_err(|_| Error::Poisoned {
            op: "GradSink::nbytes",
        })?;
        Ok(map.values().map(ScalingTensor::nbytes).sum())
    }
}
