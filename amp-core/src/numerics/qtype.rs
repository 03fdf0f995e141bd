//! What a [`ScalingTensor`](crate::scaling::tensor::ScalingTensor) stores: FP8 codes or FP16 values.

use crate::numerics::format::{Fp8Format, F16_MAX};
use candle_core::DType;

/// The storage type of a scaled tensor (MS-AMP's `qtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum QType {
    /// FP8 E4M3 codes in a `U8` tensor.
    E4M3,
    /// FP8 E5M2 codes in a `U8` tensor.
    E5M2,
    /// IEEE FP16 values in an `F16` tensor.
    F16,
}

impl QType {
    /// Largest finite value of the format.
    pub const fn max(self) -> f32 {
        match self {
            Self::E4M3 => Fp8Format::E4M3.max(),
            Self::E5M2 => Fp8Format::E5M2.max(),
            Self::F16 => F16_MAX,
        }
    }

    /// The FP8 format, if this is one.
    pub const fn fp8(self) -> Option<Fp8Format> {
        match self {
            Self::E4M3 => Some(Fp8Format::E4M3),
            Self::E5M2 => Some(Fp8Format::E5M2),
            Self::F16 => None,
        }
    }

    /// The candle dtype that holds the data: `U8` for FP8 codes, `F16` for FP16.
    pub const fn storage_dtype(self) -> DType {
        match self {
            Self::E4M3 | Self::E5M2 => DType::U8,
            Self::F16 => DType::F16,
        }
    }
}

impl From<Fp8Format> for QType {
    fn from(f: Fp8Format) -> Self {
        match f {
            Fp8Format::E4M3 => Self::E4M3,
            Fp8Format::E5M2 => Self::E5M2,
        }
    }
}

impl std::fmt::Display for QType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::E4M3 => "E4M3",
            Self::E5M2 => "E5M2",
            Self::F16 => "F16",
        })
    }
}
