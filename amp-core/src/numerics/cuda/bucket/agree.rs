//! The launches of what the ranks agree on: the scales and amaxes sent,
//! the mean's bound, column maxima, the elementwise max.

use super::{fmt_name, one_block_of_items, with_scalar_ptrs, wrap_f32, BucketArgs, ITEMS, THREADS};
use crate::error::Result;
use crate::numerics::cuda::launch::{func, view};
use crate::numerics::kernel::arity;
use crate::numerics::qtype::QType;
use crate::numerics::stream::cuda::current_stream;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Shape};

/// a [T], b [T] -> max(a, b) [T].
pub(crate) fn bucket_max(inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_max";
    let [(a, la), (b, lb)] = inputs else {
        return Err(arity(OP));
    };
    let dev = a.device().clone();
    let stream = current_stream(&dev);
    let n = la.shape().elem_count();
    let (va, vb) = (view::<f32>(OP, a, la)?, view::<f32>(OP, b, lb)?);
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { stream.alloc::<f32>(n.max(1)) }.w()?;
    if n > 0 {
        let count = n as i32;
        let f = func(&dev, "bucket_max")?;
        let mut bl = stream.launch_builder(&f);
        bl.arg(&va).arg(&vb).arg(&mut out).arg(&count);
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(THREADS), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: n elements in each input and the output.
        unsafe { bl.launch(cfg) }.w()?;
    }
    Ok(vec![wrap_f32(out, &dev, n)])
}

/// scale_inv_0..T-1, scale_0..T-1, amax_0..T-1 (one element each) ->
/// [2T]: the flagged scale_invs, then the largest decoded values.
pub(crate) fn bucket_scales_sent(
    qtype: QType,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_scales_sent";
    let t = inputs.len() / 3;
    if t == 0 || inputs.len() != 3 * t {
        return Err(arity(OP));
    }
    let dev = inputs[0].0.device().clone();
    let stream = current_stream(&dev);
    // SAFETY: the launches write every element.
    let mut out = unsafe { stream.alloc::<f32>(2 * t) }.w()?;
    let fmt = match qtype {
        QType::F16 => "f16",
        q => fmt_name(OP, q)?,
    };
    let f = func(&dev, &format!("bucket_scales_sent_{fmt}"))?;
    let total = t as i32;
    with_scalar_ptrs(OP, inputs, &stream, |ptrs| {
        for (c, chunk) in (0..t).collect::<Vec<_>>().chunks(ITEMS).enumerate() {
            let mut a = BucketArgs::new();
            for (k, &i) in chunk.iter().enumerate() {
                a.src[k] = ptrs[i];
                a.out_off[k] = ptrs[t + i];
                a.aux[k] = ptrs[2 * t + i];
                a.len[k] = 1;
                a.t[k] = (c * ITEMS + k) as i32;
            }
            let count = chunk.len() as i32;
            let mut b = stream.launch_builder(&f);
            b.arg(&a).arg(&count).arg(&total).arg(&mut out);
            // SAFETY: every pointer is a live one-element F32; t < T.
            unsafe { b.launch(one_block_of_items()) }.w()?;
        }
        Ok(())
    })?;
    Ok(vec![wrap_f32(out, &dev, 2 * t)])
}

/// m [N, C] -> [count]: the bounds of `bucket_mean_bound`.
pub(crate) fn bucket_mean_bound(
    start: usize,
    count: usize,
    factor: f32,
    inv_n: Option<f32>,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_mean_bound";
    let [(m, lm)] = inputs else {
        return Err(arity(OP));
    };
    let [rows, cols] = lm.shape().dims() else {
        return Err(arity(OP));
    };
    let dev = m.device().clone();
    let stream = current_stream(&dev);
    let v = view::<f32>(OP, m, lm)?;
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { stream.alloc::<f32>(count.max(1)) }.w()?;
    let (r, c, st, n) = (*rows as i32, *cols as i32, start as i32, count as i32);
    let (avg, inv) = (i32::from(inv_n.is_some()), inv_n.unwrap_or(1.0));
    let f = func(&dev, OP)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&v)
        .arg(&r)
        .arg(&c)
        .arg(&st)
        .arg(&n)
        .arg(&factor)
        .arg(&avg)
        .arg(&inv)
        .arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: ((count as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: rows x cols values in, count out, start + count <= cols
    // (checked by the caller).
    unsafe { b.launch(cfg) }.w()?;
    Ok(vec![wrap_f32(out, &dev, count)])
}

/// m [N, C] -> [count]: column maxima from `start`, NaN as inf.
pub(crate) fn bucket_column_max(
    start: usize,
    count: usize,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_column_max";
    let [(m, lm)] = inputs else {
        return Err(arity(OP));
    };
    let [rows, cols] = lm.shape().dims() else {
        return Err(arity(OP));
    };
    let dev = m.device().clone();
    let stream = current_stream(&dev);
    let v = view::<f32>(OP, m, lm)?;
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { stream.alloc::<f32>(count.max(1)) }.w()?;
    let (r, c, st, n) = (*rows as i32, *cols as i32, start as i32, count as i32);
    let f = func(&dev, OP)?;
    let mut b = stream.launch_builder(&f);
    b.arg(&v).arg(&r).arg(&c).arg(&st).arg(&n).arg(&mut out);
    let cfg = LaunchConfig {
        grid_dim: ((count as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: rows x cols values in, count out, start + count <= cols
    // (checked by the caller).
    unsafe { b.launch(cfg) }.w()?;
    Ok(vec![wrap_f32(out, &dev, count)])
}
