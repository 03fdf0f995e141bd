//! The CUDA module of a build without the `cuda` feature: the same API,
//! every call answers [`Error::NotCompiled`]`("cuda")`. (candle's
//! `dummy_cuda_backend` habit; its `CudaStorage` stands in here.)

use crate::error::{Error, Result};
use crate::numerics::qtype::QType;
use crate::numerics::recipe::AmaxComputeAlgo;
use crate::numerics::scale::ScaleRule;
use candle_core::{CudaStorage, DType, Device, Layout, Shape};

type Inputs<'a> = &'a [(&'a CudaStorage, &'a Layout)];
type Outputs = Result<Vec<(CudaStorage, Shape)>>;

pub(crate) fn amax(_: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn quantize(
    _: QType,
    _: Option<crate::numerics::scale::FromAmax>,
    _: bool,
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) mod cast_t {
    use super::*;

    pub(crate) fn fits(_: usize, _: usize) -> bool {
        false
    }

    pub(crate) fn quantize_t(
        _: QType,
        _: Option<crate::numerics::scale::FromAmax>,
        _: bool,
        _: bool,
        _: Inputs<'_>,
    ) -> Outputs {
        Err(Error::NotCompiled("cuda"))
    }
}

pub(crate) mod cast_t_many {
    use super::*;

    pub(crate) fn requantize_t_many(
        _: QType,
        _: crate::numerics::scale::FromAmax,
        _: bool,
        _: Inputs<'_>,
    ) -> Outputs {
        Err(Error::NotCompiled("cuda"))
    }
}

pub(crate) fn dequantize(_: QType, _: DType, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn flag_scale_inv(_: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn gather_scalars(_: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn decoded_amax(_: QType, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_amax(_: QType, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_scales(_: QType, _: ScaleRule, _: u32, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_requantize(
    _: QType,
    _: QType,
    _: &[crate::numerics::bucket::Piece],
    _: usize,
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_max(_: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_flag_scale_inv(_: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_copy_from(_: &[crate::numerics::bucket::Piece], _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_column_max(_: usize, _: usize, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_scales_sent(_: crate::numerics::qtype::QType, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_mean_bound(
    _: usize,
    _: usize,
    _: f32,
    _: Option<f32>,
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_concat(_: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_decode_sum(
    _: QType,
    _: bool,
    _: f32,
    _: &[crate::numerics::bucket::Piece],
    _: crate::numerics::bucket::SumOut,
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn bucket_quantize(
    _: QType,
    _: &[crate::numerics::bucket::Piece],
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn decode_sum(_: QType, _: bool, _: f32, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn requantize(_: QType, _: QType, _: bool, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn record_amax(_: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn scale_update(
    _: ScaleRule,
    _: AmaxComputeAlgo,
    _: u32,
    _: f32,
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

/// Sets the release threshold of the CUDA device's default memory pool
/// (built without `cuda`: always [`Error::NotCompiled`]).
///
/// # Errors
/// Always, in this build.
pub fn set_pool_release_threshold(_: &Device, _: u64) -> Result<()> {
    Err(Error::NotCompiled("cuda"))
}

/// Keeps freed CUDA memory pooled (built without `cuda`: always
/// [`Error::NotCompiled`]).
///
/// # Errors
/// Always, in this build.
pub fn keep_freed_memory(_: &Device) -> Result<()> {
    Err(Error::NotCompiled("cuda"))
}

/// Stops cudarc's per-allocation events (built without `cuda`: always
/// [`Error::NotCompiled`]).
///
/// # Safety
/// Nothing to uphold in this build.
///
/// # Errors
/// Always, in this build.
pub unsafe fn skip_event_tracking(_: &Device) -> Result<bool> {
    Err(Error::NotCompiled("cuda"))
}

/// Free and total bytes of a CUDA device (built without `cuda`: always
/// [`Error::NotCompiled`]).
///
/// # Errors
/// Always, in this build.
pub fn device_memory(_: &Device) -> Result<(u64, u64)> {
    Err(Error::NotCompiled("cuda"))
}

/// Peak bytes of the CUDA memory pool (built without `cuda`: always
/// [`Error::NotCompiled`]).
///
/// # Errors
/// Always, in this build.
pub fn pool_peaks(_: &Device) -> Result<(u64, u64)> {
    Err(Error::NotCompiled("cuda"))
}

/// Resets the CUDA memory pool's peaks (built without `cuda`: always
/// [`Error::NotCompiled`]).
///
/// # Errors
/// Always, in this build.
pub fn reset_pool_peaks(_: &Device) -> Result<()> {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn block_quantize(_: &crate::numerics::block::BlockQuantize, _: Inputs<'_>) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn block_dequantize(
    _: &crate::numerics::block::BlockDequantize,
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn block_quantize_pair(
    _: &crate::numerics::block::BlockQuantizePair,
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}

pub(crate) fn block_quantize_scaled(
    _: &crate::numerics::block::BlockQuantizeScaled,
    _: Inputs<'_>,
) -> Outputs {
    Err(Error::NotCompiled("cuda"))
}
