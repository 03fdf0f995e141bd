//! Optimizer states (Adam moments) in F32 or a scaled low-bit format.

use crate::adamw::flat;
use crate::error::Result;
use amp_core::{CurrentScaling, QType, ScalingTensor};
use candle_core::{DType, Device, Shape, Tensor};

/// The storage of one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum StateFormat {
    /// Plain F32.
    F32,
    /// FP8 E4M3 with a per-tensor power-of-two scale.
    E4M3,
    /// FP8 E5M2 with a per-tensor power-of-two scale.
    E5M2,
    /// FP16 with a per-tensor power-of-two scale.
    F16,
}

impl StateFormat {
    fn qtype(self) -> Option<QType> {
        match self {
            Self::F32 => None,
            Self::E4M3 => Some(QType::E4M3),
            Self::E5M2 => Some(QType::E5M2),
            Self::F16 => Some(QType::F16),
        }
    }
}

/// One moment of one parameter.
#[derive(Debug, Clone)]
pub enum State {
    /// F32 values.
    F32(Tensor),
    /// Scaled low-bit values; the scale is re-chosen from the amax at every
    /// write, so the state never saturates.
    Scaled(ScalingTensor),
}

impl State {
    /// All zeros in `format`.
    ///
    /// # Errors
    /// Only candle's.
    pub fn zeros(format: StateFormat, shape: &Shape, device: &Device) -> Result<Self> {
        Self::encode(format, &Tensor::zeros(shape, DType::F32, device)?)
    }

    /// Stores `values` (F32) in `format`.
    ///
    /// # Errors
    /// Only candle's.
    pub fn encode(format: StateFormat, values: &Tensor) -> Result<Self> {
        Ok(match format.qtype() {
            None => Self::F32(values.clone()),
            Some(qtype) => {
                Self::Scaled(ScalingTensor::quantize(values, qtype, &CurrentScaling::default())?.0)
            }
        })
    }

    /// The values as a flat F32 vector (decoded on the fly).
    ///
    /// # Errors
    /// Only candle's.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        match self {
            Self::F32(t) => flat(t),
            Self::Scaled(t) => flat(&t.dequantize(DType::F32)?),
        }
    }

    /// The storage format.
    pub fn format(&self) -> StateFormat {
        match self {
            Self::F32(_) => StateFormat::F32,
            Self::Scaled(t) => match t.qtype() {
                QType::E4M3 => StateFormat::E4M3,
                QType::E5M2 => StateFormat::E5M2,
                QType::F16 => StateFormat::F16,
            },
        }
    }

    /// Bytes held, scale included.
    pub fn nbytes(&self) -> usize {
        match self {
            Self::F32(t) => t.elem_count() * 4,
            Self::Scaled(t) => t.nbytes(),
        }
    }
}
