//! Launch of the RoPE kernel (`kernels/nn_rope.cuh`): one thread per pair
//! `(x[i], x[i + half])` of a row, forward (`sign` +1) and backward (-1).

use super::nn_func;
use super::ops::{store, suffix, with_float};
use crate::error::{Error, Result};
use crate::numerics::cuda::launch::{grid, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{DType, Layout};

/// `x` `[batch, seq, heads, 2 half]` rotated by `(cos, sign * sin)` (F32
/// `[seq, half]`), `(seq, heads, half)` given; only the first `rot` heads
/// of each position turn, the others are copied.
pub(crate) fn rope(
    (x, lx): (&CudaStorage, &Layout),
    (cos, lc): (&CudaStorage, &Layout),
    (sin, ls): (&CudaStorage, &Layout),
    (seq, heads, half): (usize, usize, usize),
    rot: usize,
    sign: f32,
) -> Result<CudaStorage> {
    const OP: &str = "rope";
    let dev = x.device().clone();
    let n = lx.shape().elem_count();
    let pairs = n / 2;
    let cv = view::<f32>(OP, cos, lc)?;
    let sv = view::<f32>(OP, sin, ls)?;
    if cv.len() != seq * half || sv.len() != seq * half {
        return Err(Error::Shape {
            op: OP,
            lhs: lx.shape().clone(),
            rhs: lc.shape().clone(),
        });
    }
    let stream = dev.cuda_stream();
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<T>(n)? };
        if pairs > 0 {
            let f = nn_func(&dev, &format!("rope_{}", suffix(x.dtype())))?;
            let mut b = stream.launch_builder(&f);
            b.arg(&xv)
                .arg(&cv)
                .arg(&sv)
                .arg(&mut out)
                .arg(&pairs)
                .arg(&half)
                .arg(&heads)
                .arg(&rot)
                .arg(&seq);
            b.arg(&sign);
            // SAFETY: x and out hold 2 * pairs elements, the tables seq * half.
            unsafe { b.launch(grid(&dev, pairs)?) }.w()?;
        }
        Ok(store(out, &dev))
    })
}
