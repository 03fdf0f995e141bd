//! Launch of `decode_sum_<fmt>` (`kernels/amp.cu`): the chunks' addresses
//! passed by value, as `gather_scalars` passes its scalars.

use super::launch::{func, grid, view};
use crate::error::{Error, Result};
use crate::numerics::kernel::arity;
use crate::numerics::qtype::QType;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Shape};

/// Most chunks one launch sums (`SUM_MAX` in amp.cu).
pub(crate) const SUM_MAX: usize = 64;

/// chunks, scale_inv (1 element, or one a chunk) -> sum, amax; `inv_n`
/// the averaging factor.
pub(crate) fn decode_sum(
    qtype: QType,
    average: bool,
    inv_n: f32,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "decode_sum";
    let Some(((s, ls), chunks)) = inputs.split_last() else {
        return Err(arity(OP));
    };
    let name = match qtype {
        QType::E4M3 => "decode_sum_e4m3",
        QType::E5M2 => "decode_sum_e5m2",
        QType::F16 => {
            return Err(Error::Unsupported {
                op: OP,
                what: "FP16 codes".into(),
            })
        }
    };
    if chunks.is_empty() || chunks.len() > SUM_MAX {
        return Err(arity(OP));
    }
    let dev = s.device().clone();
    let stream = dev.cuda_stream();
    let shape = chunks[0].1.shape().clone();
    let n = shape.elem_count();
    // one scale for every chunk, or one a chunk (rank k's at element k)
    let s_stride: i32 = match ls.shape().elem_count() {
        1 => 0,
        k if k == chunks.len() => 1,
        _ => {
            return Err(Error::Shape {
                op: OP,
                lhs: Shape::from(chunks.len()),
                rhs: ls.shape().clone(),
            })
        }
    };
    let scale_inv = view::<f32>(OP, s, ls)?;
    // `SumPtrs` in amp.cu
    let mut ptrs = [0u64; SUM_MAX];
    let mut views = Vec::with_capacity(chunks.len());
    for (c, l) in chunks {
        if l.shape().elem_count() != n {
            return Err(Error::Shape {
                op: OP,
                lhs: shape.clone(),
                rhs: l.shape().clone(),
            });
        }
        views.push(view::<u8>(OP, c, l)?);
    }
    let mut guards = Vec::with_capacity(views.len());
    for (k, v) in views.iter().enumerate() {
        let (p, g) = v.device_ptr(&stream);
        ptrs[k] = p;
        guards.push(g);
    }
    // SAFETY: every element is written by the launch below.
    let mut out = unsafe { dev.alloc::<f32>(n)? };
    let mut amax = dev.alloc_zeros::<f32>(1)?;
    if n > 0 {
        let f = func(&dev, name)?;
        let ranks = chunks.len() as i32;
        let avg = i32::from(average && chunks.len() > 1);
        let mut b = stream.launch_builder(&f);
        b.arg(&ptrs)
            .arg(&ranks)
            .arg(&scale_inv)
            .arg(&s_stride)
            .arg(&avg)
            .arg(&inv_n)
            .arg(&mut out)
            .arg(&n)
            .arg(&mut amax);
        // SAFETY: `ranks` pointers to live chunks of `n` codes (held by
        // `guards`), `out` of `n` F32, a zeroed one-element amax.
        unsafe { b.launch(grid(&dev, n)?) }.w()?;
    }
    drop(guards);
    Ok(vec![
        (CudaStorage::wrap_cuda_slice(out, dev.clone()), shape),
        (CudaStorage::wrap_cuda_slice(amax, dev), Shape::from(1usize)),
    ])
}
