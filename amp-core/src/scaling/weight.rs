//! `WeightSlot`: a parameter's storage, shared by the layer that reads it and
//! the optimizer that updates it in place.

use crate::error::{Error, Result};
use crate::scaling::tensor::ScalingTensor;
use candle_core::{DType, Shape, Tensor, Var};
use std::sync::{Arc, RwLock, RwLockReadGuard};

/// How a parameter is stored (docs/ARCHITECTURE.md, "Levels").
#[derive(Debug, Clone)]
pub enum Weight {
    /// F32, a candle `Var` (O0; embeddings, norms and biases at every level).
    F32(Var),
    /// Scaled FP16 (O1/O2): this copy is the master.
    F16(ScalingTensor),
    /// FP8 working copy with a scaled FP16 master (O3).
    Fp8 {
        /// What the GEMMs read.
        weight: ScalingTensor,
        /// What the optimizer updates.
        master: ScalingTensor,
    },
    /// FP8 working copy whose master is sharded across data-parallel ranks
    /// (O3 with ZeRO): the optimizer holds this rank's slice of the master
    /// and the copy is all-gathered after every step.
    Fp8Gathered(ScalingTensor),
}

impl Weight {
    /// The value the optimizer updates, as F32: the `Var`, the FP16 copy or
    /// the FP16 master; for a gathered FP8 copy (whose master is sharded),
    /// the FP8 values.
    ///
    /// # Errors
    /// Only candle's.
    pub fn master_f32(&self) -> Result<Tensor> {
        match self {
            Self::F32(v) => Ok(v.as_tensor().clone()),
            Self::F16(t) | Self::Fp8 { master: t, .. } | Self::Fp8Gathered(t) => {
                t.dequantize(DType::F32)
            }
        }
    }

    /// [`master_f32`](Self::master_f32) converted to `dtype` (a native
    /// GEMM's, or the block casts' source): a scaled copy decoded straight
    /// into `dtype` ([`ScalingTensor::decoded`]), the same values as
    /// decoding to F32 and converting.
    ///
    /// # Errors
    /// Only candle's.
    pub fn native(&self, dtype: DType) -> Result<Tensor> {
        match self {
            Self::F32(v) => Ok(v.as_tensor().to_dtype(dtype)?),
            Self::F16(t) | Self::Fp8 { master: t, .. } | Self::Fp8Gathered(t) => t.decoded(dtype),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        match self {
            Self::F32(v) => v.shape(),
            Self::F16(t) | Self::Fp8 { master: t, .. } | Self::Fp8Gathered(t) => t.shape(),
        }
    }

    /// The device.
    pub fn device(&self) -> &candle_core::Device {
        match self {
            Self::F32(v) => v.device(),
            Self::F16(t) | Self::Fp8 { master: t, .. } | Self::Fp8Gathered(t) => t.device(),
        }
    }

    /// Bytes held, scaling metadata included.
    pub fn nbytes(&self) -> usize {
        match self {
            Self::F32(v) => v.elem_count() * 4,
            Self::F16(t) | Self::Fp8Gathered(t) => t.nbytes(),
            Self::Fp8 { weight, master } => weight.nbytes() + master.nbytes(),
        }
    }

    /// A short name of the storage: `F32`, `F16`, `FP8+F16`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::F32(_) => "F32",
            Self::F16(_) => "F16",
            Self::Fp8 { .. } => "FP8+F16",
            Self::Fp8Gathered(_) => "FP8 (master sharded)",
        }
    }
}

/// A shared handle to a [`Weight`]; clones point at the same storage.
#[derive(Debug, Clone)]
pub struct WeightSlot(Arc<RwLock<Weight>>);

impl WeightSlot {
    /// A new slot holding `weight`.
    pub fn new(weight: Weight) -> Self {
        Self(Arc::new(RwLock::new(weight)))
    }

    pub(crate) fn downgrade(&self) -> std::sync::Weak<RwLock<Weight>> {
        Arc::downgrade(&self.0)
    }

    pub(crate) fn from_arc(arc: Arc<RwLock<Weight>>) -> Self {
        Self(arc)
    }

    /// True when both handles point at the same storage.
    pub fn same_slot(&self, other: &WeightSlot) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Reads the weight.
    ///
    /// # Errors
    /// [`Error::Poisoned`] if a writer panicked.
    pub fn read(&self) -> Result<RwLockReadGuard<'_, Weight>> {
        self.0.read().map_err(|_| Error::Poisoned {
            op: "WeightSlot::read",
        })
    }

    /// Replaces the weight; its shape must stay the same.
    ///
    /// # Errors
    /// [`Error::Shape`] when the shape changes, [`Error::Poisoned`].
    pub fn replace(&self, weight: Weight) -> Result<()> {
        let mut guard = self.0.write().map_err(|_| Error::Poisoned {
            op: "WeightSlot::replace",
        })?;
        if guard.shape() != weight.shape() {
            return Err(Error::Shape {
                op: "WeightSlot::replace",
                lhs: guard.shape().clone(),
                rhs: weight.shape().clone(),
            });
        }
        *guard = weight;
        Ok(())
    }
}
