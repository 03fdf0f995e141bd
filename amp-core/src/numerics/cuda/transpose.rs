//! The launch of the 2-D transpose of 1- or 2-byte elements
//! (`kernels/cast_t.cu`, beside the cast-transpose): 32 x 32 tiles through
//! shared memory.

use super::launch::{cast_t_func, view};
use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::DType;
use candle_core::Layout;

fn dim_i32(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Unsupported {
        op: "transpose_2d",
        what: format!("rows of {n} elements"),
    })
}

/// The transpose of a contiguous 2-D tensor of 1- or 2-byte elements.
pub(crate) fn transpose_2d(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    const OP: &str = "transpose_2d";
    let dev = s.device().clone();
    let (rows, cols) = l.shape().dims2()?;
    let (r, c) = (dim_i32(rows)?, dim_i32(cols)?);
    let cfg = LaunchConfig {
        grid_dim: (
            cols.div_ceil(32).max(1) as u32,
            rows.div_ceil(32).max(1) as u32,
            1,
        ),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    macro_rules! go {
        ($t:ty, $name:expr) => {{
            let v = view::<$t>(OP, s, l)?;
            // SAFETY: every element is written.
            let mut out = unsafe { dev.alloc::<$t>(rows * cols)? };
            let f = cast_t_func(&dev, $name)?;
            let mut b = stream.launch_builder(&f);
            b.arg(&v).arg(&mut out).arg(&r).arg(&c);
            unsafe { b.launch(cfg) }.w()?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }};
    }
    match s.dtype() {
        DType::U8 => go!(u8, "transpose_u8"),
        DType::F16 => go!(half::f16, "transpose_u16"),
        DType::BF16 => go!(half::bf16, "transpose_u16"),
        got => Err(Error::DType {
            op: OP,
            expected: "U8, F16 or BF16",
            got,
        }),
    }
}
