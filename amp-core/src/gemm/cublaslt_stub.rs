//! The cuBLASLt GEMM of a build without the `cuda` feature: the same
//! signature, answering [`Error::NotCompiled`]`("cuda")`.

use crate::error::{Error, Result};
use crate::scaling::tensor::ScalingTensor;
use candle_core::{DType, Tensor};

pub(crate) fn fp8_gemm(
    _: &ScalingTensor,
    _: &ScalingTensor,
    _: DType,
    _: bool,
    _: super::Epilogue<'_>,
) -> Result<Tensor> {
    Err(Error::NotCompiled("cuda"))
}

/// Without the `cuda` feature no block-scaled GEMM runs on a device.
pub(crate) fn block_gemm(
    _: &crate::scaling::block::BlockTensor,
    _: &crate::scaling::block::BlockTensor,
    _: DType,
    _: super::Epilogue<'_>,
) -> Result<Option<Tensor>> {
    Err(Error::NotCompiled("cuda"))
}
