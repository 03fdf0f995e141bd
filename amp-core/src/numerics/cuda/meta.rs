//! Launches of the metadata kernels: record an amax, update a scale.

use super::launch::{func, one_block, scalar, view};
use crate::error::Result;
use crate::numerics::kernel::arity;
use crate::numerics::recipe::AmaxComputeAlgo;
use crate::numerics::scale::ScaleRule;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Shape};

type Outputs = Vec<(CudaStorage, Shape)>;

/// history, amax -> history with slot 0 = max(slot 0, amax), NaN-propagating.
pub(crate) fn record_amax(inputs: &[(&CudaStorage, &Layout)]) -> Result<Outputs> {
    const OP: &str = "record_amax";
    let [(h, lh), (a, la)] = inputs else {
        return Err(arity(OP));
    };
    let dev = h.device().clone();
    let history = view::<f32>(OP, h, lh)?;
    let amax = scalar(OP, a, la)?;
    let len = lh.shape().elem_count() as i32;
    // SAFETY: the kernel writes every slot.
    let mut out = unsafe { dev.alloc::<f32>(lh.shape().elem_count())? };
    let f = func(&dev, "record_amax")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&history).arg(&amax).arg(&mut out).arg(&len);
    unsafe { b.launch(one_block()) }.w()?;
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(out, dev),
        lh.shape().clone(),
    )])
}

/// scale_inv, amax -> scale_inv * (amax * 0 + 1) (scaling/flag.rs).
pub(crate) fn flag_scale_inv(inputs: &[(&CudaStorage, &Layout)]) -> Result<Outputs> {
    const OP: &str = "flag_scale_inv";
    let [(s, ls), (a, la)] = inputs else {
        return Err(arity(OP));
    };
    let dev = s.device().clone();
    let scale_inv = scalar(OP, s, ls)?;
    let amax = scalar(OP, a, la)?;
    // SAFETY: the kernel writes the one element.
    let mut out = unsafe { dev.alloc::<f32>(1)? };
    let f = func(&dev, "flag_scale_inv")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&scale_inv).arg(&amax).arg(&mut out);
    unsafe { b.launch(one_block()) }.w()?;
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(out, dev),
        ls.shape().clone(),
    )])
}

/// history, scale -> rolled history, scale, scale_inv (meta.rs's ScaleUpdate).
pub(crate) fn scale_update(
    rule: ScaleRule,
    algo: AmaxComputeAlgo,
    margin: u32,
    max: f32,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Outputs> {
    const OP: &str = "scale_update";
    let (h, lh, s) = match inputs {
        [(h, lh), (s, ls)] => (h, lh, Some((s, ls))),
        [(h, lh)] => (h, lh, None),
        _ => return Err(arity(OP)),
    };
    let dev = h.device().clone();
    let history = view::<f32>(OP, h, lh)?;
    // the previous scale, or null: 1
    let scale = s.map(|(s, ls)| scalar(OP, s, ls)).transpose()?;
    let len = lh.shape().elem_count() as i32;
    // SAFETY: the kernel writes every slot and both scalars.
    let mut out = unsafe { dev.alloc::<f32>(lh.shape().elem_count())? };
    let mut new_scale = unsafe { dev.alloc::<f32>(1)? };
    let mut new_scale_inv = unsafe { dev.alloc::<f32>(1)? };
    let algo: i32 = match algo {
        AmaxComputeAlgo::Max => 0,
        AmaxComputeAlgo::MostRecent => 1,
    };
    let rule: i32 = match rule {
        ScaleRule::Te => 0,
        ScaleRule::PowerOfTwo => 1,
    };
    let f = func(&dev, "scale_update")?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    let null = 0u64;
    b.arg(&history);
    match &scale {
        Some(v) => b.arg(v),
        None => b.arg(&null),
    };
    b.arg(&mut out)
        .arg(&mut new_scale)
        .arg(&mut new_scale_inv)
        .arg(&len)
        .arg(&algo)
        .arg(&rule)
        .arg(&margin)
        .arg(&max);
    unsafe { b.launch(one_block()) }.w()?;
    let one = Shape::from(1usize);
    Ok(vec![
        (
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            lh.shape().clone(),
        ),
        (
            CudaStorage::wrap_cuda_slice(new_scale, dev.clone()),
            one.clone(),
        ),
        (CudaStorage::wrap_cuda_slice(new_scale_inv, dev), one),
    ])
}
