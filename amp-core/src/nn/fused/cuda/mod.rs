//! The CUDA launchers of the fused training ops (feature `cuda`): causal
//! softmax, cross-entropy, LayerNorm, GELU (`kernels/nn.cu`), the bias add,
//! column sums and attention layouts, the embedding, RoPE, and causal flash
//! attention (`kernels/flash.cu`). Each op's CPU body beside it is the
//! reference; nothing here reads anything back to the host.

use crate::error::Result;
use candle_core::cuda_backend::cudarc::driver::CudaFunction;
use candle_core::cuda_backend::CudaDevice;

pub(crate) mod embedding;
pub(crate) mod flash;
pub(crate) mod layout;
pub(crate) mod ops;
pub(crate) mod rope;

/// The PTX built from `kernels/nn.cu` (the fused training ops).
const NN_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/nn.ptx"));
/// Its name in candle's module cache.
const NN_MODULE: &str = "candle_amp_nn_kernels";

/// The PTX built from `kernels/flash.cu` (causal flash attention).
const FLASH_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));
/// Its name in candle's module cache.
const FLASH_MODULE: &str = "candle_amp_flash_kernels";

/// A fused training op's kernel `name` (`kernels/nn.cu`), loaded once per device.
fn nn_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    crate::numerics::cuda::launch::ensure_supported(dev)?;
    Ok(dev
        .get_or_load_custom_func(name, NN_MODULE, NN_PTX)?
        .into_cuda_function())
}

/// A flash-attention kernel `name` (`kernels/flash.cu`), loaded once per device.
fn flash_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    crate::numerics::cuda::launch::ensure_supported(dev)?;
    Ok(dev
        .get_or_load_custom_func(name, FLASH_MODULE, FLASH_PTX)?
        .into_cuda_function())
}
