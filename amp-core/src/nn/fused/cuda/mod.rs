//! The CUDA launchers of the fused training ops (feature `cuda`): causal
//! softmax, cross-entropy, LayerNorm, GELU (`kernels/nn.cu`), the bias add,
//! column sums and attention layouts, the embedding, RoPE, and causal flash
//! attention (`kernels/flash.cu`). Each op's CPU body beside it is the
//! reference; nothing here reads anything back to the host.

use crate::error::Result;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::CudaFunction;
use candle_core::cuda_backend::{CudaDevice, WrapErr};

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

/// Lets `func` take `bytes` of dynamic shared memory a block where that is
/// more than the 48 KiB a kernel gets without asking (Ada allows 99 KiB
/// a block, Hopper 227: the callers stay within Ada's).
fn allow_shared_memory(func: &CudaFunction, bytes: usize) -> Result<()> {
    const DEFAULT_SMEM: usize = 48 * 1024;
    if bytes > DEFAULT_SMEM {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .w()?;
    }
    Ok(())
}

/// A flash-attention kernel `name` (`kernels/flash.cu`), loaded once per device.
fn flash_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    crate::numerics::cuda::launch::ensure_supported(dev)?;
    Ok(dev
        .get_or_load_custom_func(name, FLASH_MODULE, FLASH_PTX)?
        .into_cuda_function())
}
