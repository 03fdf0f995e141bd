//! The bucket casts' launches: amax, scales, requantize and quantize of
//! pieces, the non-finite flag in `scale_inv`.

use super::{
    code_name, fmt_name, launches, one_block_of_items, with_scalar_ptrs, wrap_f32, BucketArgs,
    CodeView, Item, ITEMS, THREADS,
};
use crate::error::{Error, Result};
use crate::numerics::bucket::Piece;
use crate::numerics::cuda::launch::{func, view};
use crate::numerics::kernel::arity;
use crate::numerics::qtype::QType;
use crate::numerics::scale::ScaleRule;
use crate::numerics::stream::cuda::current_stream;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Shape};

/// codes_0..T-1, scale_inv_0..T-1 -> amax [T] (NaN as inf).
pub(crate) fn bucket_amax(
    qtype: QType,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_amax";
    let t = inputs.len() / 2;
    if t == 0 || inputs.len() != 2 * t {
        return Err(arity(OP));
    }
    let dev = inputs[0].0.device().clone();
    let stream = current_stream(&dev);
    let codes = inputs[..t]
        .iter()
        .map(|x| CodeView::new(OP, qtype, *x))
        .collect::<Result<Vec<_>>>()?;
    let sinv = inputs[t..]
        .iter()
        .map(|(s, l)| view::<f32>(OP, s, l))
        .collect::<Result<Vec<_>>>()?;
    let mut guards = Vec::new();
    let mut items = Vec::with_capacity(t);
    for (i, (c, s)) in codes.iter().zip(&sinv).enumerate() {
        let (cp, g1) = c.ptr(&stream);
        let (sp, g2) = s.device_ptr(&stream);
        guards.push(g1);
        guards.push(g2);
        items.push(Item {
            src: cp,
            len: c.len(),
            out_off: 0,
            aux: sp,
            t: i,
        });
    }
    let mut amax = stream.alloc_zeros::<f32>(t).w()?;
    let name = format!("bucket_amax_{}", code_name(qtype));
    let f = func(&dev, &name)?;
    for (a, cfg) in launches(&dev, &items)? {
        let mut b = stream.launch_builder(&f);
        b.arg(&a).arg(&mut amax);
        // SAFETY: every item's codes and scale_inv are live (`guards`).
        unsafe { b.launch(cfg) }.w()?;
    }
    drop(guards);
    Ok(vec![wrap_f32(amax, &dev, t)])
}

/// amax [T] -> scale [T], scale_inv [T].
pub(crate) fn bucket_scales(
    qtype: QType,
    rule: ScaleRule,
    margin: u32,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_scales";
    let [(a, la)] = inputs else {
        return Err(arity(OP));
    };
    let dev = a.device().clone();
    let n = la.shape().elem_count();
    let amax = view::<f32>(OP, a, la)?;
    let stream = current_stream(&dev);
    // SAFETY: the kernel writes every element.
    let mut scale = unsafe { stream.alloc::<f32>(n) }.w()?;
    let mut inv = unsafe { stream.alloc::<f32>(n) }.w()?;
    if n > 0 {
        let rule: i32 = match rule {
            ScaleRule::Te => 0,
            ScaleRule::PowerOfTwo => 1,
        };
        let (count, max) = (n as i32, qtype.max());
        let f = func(&dev, "bucket_scales")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&amax)
            .arg(&mut scale)
            .arg(&mut inv)
            .arg(&count)
            .arg(&rule)
            .arg(&margin)
            .arg(&max);
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(THREADS), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: n amaxes in, n scales and scale_invs out.
        unsafe { b.launch(cfg) }.w()?;
    }
    let shape = la.shape().clone();
    Ok(vec![
        (
            CudaStorage::wrap_cuda_slice(scale, dev.clone()),
            shape.clone(),
        ),
        (CudaStorage::wrap_cuda_slice(inv, dev), shape),
    ])
}

/// codes_0..T-1, scale_inv_0..T-1, scale [T] -> codes of the pieces
/// (each a range of its tensor's codes), concatenated.
pub(crate) fn bucket_requantize(
    from: QType,
    to: QType,
    pieces: &[Piece],
    pad_to: usize,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_requantize";
    let Some(((s, ls), rest)) = inputs.split_last() else {
        return Err(arity(OP));
    };
    let t = rest.len() / 2;
    if t == 0 || rest.len() != 2 * t {
        return Err(arity(OP));
    }
    let name = match (from, to) {
        (QType::F16, QType::E4M3) => "bucket_requantize_f16_e4m3".to_string(),
        (a, b) if a == b => format!("bucket_requantize_{}", fmt_name(OP, a)?),
        _ => {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("{from} to {to}"),
            })
        }
    };
    let code_bytes = if from == QType::F16 { 2 } else { 1 };
    let dev = s.device().clone();
    let stream = current_stream(&dev);
    let scale = view::<f32>(OP, s, ls)?;
    let codes = rest[..t]
        .iter()
        .map(|x| CodeView::new(OP, from, *x))
        .collect::<Result<Vec<_>>>()?;
    let sinv = rest[t..]
        .iter()
        .map(|(s, l)| view::<f32>(OP, s, l))
        .collect::<Result<Vec<_>>>()?;
    let mut guards = Vec::new();
    let mut bases = Vec::with_capacity(t);
    for (c, s) in codes.iter().zip(&sinv) {
        let (cp, g1) = c.ptr(&stream);
        let (sp, g2) = s.device_ptr(&stream);
        guards.push(g1);
        guards.push(g2);
        bases.push((cp, sp, c.len()));
    }
    let mut items = Vec::with_capacity(pieces.len());
    let mut total = 0;
    for p in pieces {
        let &(cp, sp, len) = bases.get(p.tensor).ok_or_else(|| arity(OP))?;
        if p.start + p.len > len {
            return Err(arity(OP));
        }
        items.push(Item {
            src: cp + (p.start * code_bytes) as u64,
            len: p.len,
            out_off: total,
            aux: sp,
            t: p.tensor,
        });
        total += p.len;
    }
    let len = total.max(pad_to);
    // SAFETY: the items cover every element up to `total`, zeros the rest.
    let mut out = unsafe { stream.alloc::<u8>(len.max(1)) }.w()?;
    if len > total {
        stream.memset_zeros(&mut out.slice_mut(total..len)).w()?;
    }
    let f = func(&dev, &name)?;
    for (a, cfg) in launches(&dev, &items)? {
        let mut b = stream.launch_builder(&f);
        b.arg(&a).arg(&scale).arg(&mut out);
        // SAFETY: every item's codes and scale_inv are live (`guards`), its
        // output range within `out`.
        unsafe { b.launch(cfg) }.w()?;
    }
    drop(guards);
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from(len),
    )])
}

/// scale_inv_0..T-1, amax_0..T-1 (one element each) -> [T]:
/// scale_inv_t * (amax_t * 0 + 1).
pub(crate) fn bucket_flag_scale_inv(
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_flag_scale_inv";
    let t = inputs.len() / 2;
    if t == 0 || inputs.len() != 2 * t {
        return Err(arity(OP));
    }
    let dev = inputs[0].0.device().clone();
    let stream = current_stream(&dev);
    // SAFETY: the launches write every element.
    let mut out = unsafe { stream.alloc::<f32>(t) }.w()?;
    let f = func(&dev, OP)?;
    with_scalar_ptrs(OP, inputs, &stream, |ptrs| {
        for (c, chunk) in (0..t).collect::<Vec<_>>().chunks(ITEMS).enumerate() {
            let mut a = BucketArgs::new();
            for (k, &i) in chunk.iter().enumerate() {
                a.src[k] = ptrs[i];
                a.aux[k] = ptrs[t + i];
                a.len[k] = 1;
                a.t[k] = (c * ITEMS + k) as i32;
            }
            let count = chunk.len() as i32;
            let mut b = stream.launch_builder(&f);
            b.arg(&a).arg(&count).arg(&mut out);
            // SAFETY: every pointer is a live one-element F32; t < T.
            unsafe { b.launch(one_block_of_items()) }.w()?;
        }
        Ok(())
    })?;
    Ok(vec![wrap_f32(out, &dev, t)])
}

/// values (F32), scale [T] -> codes [sum of piece lengths].
pub(crate) fn bucket_quantize(
    qtype: QType,
    pieces: &[Piece],
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_quantize";
    let [(x, lx), (s, ls)] = inputs else {
        return Err(arity(OP));
    };
    let dev = x.device().clone();
    let stream = current_stream(&dev);
    let values = view::<f32>(OP, x, lx)?;
    let scale = view::<f32>(OP, s, ls)?;
    let (base, guard) = values.device_ptr(&stream);
    let mut items = Vec::with_capacity(pieces.len());
    let mut total = 0;
    for p in pieces {
        let src = base + (p.start * 4) as u64;
        items.push(Item {
            src,
            len: p.len,
            out_off: total,
            aux: 0,
            t: p.tensor,
        });
        total += p.len;
    }
    // SAFETY: the pieces cover every element.
    let mut out = unsafe { stream.alloc::<u8>(total.max(1)) }.w()?;
    let name = format!("bucket_quantize_{}", fmt_name(OP, qtype)?);
    let f = func(&dev, &name)?;
    for (a, cfg) in launches(&dev, &items)? {
        let mut b = stream.launch_builder(&f);
        b.arg(&a).arg(&scale).arg(&mut out);
        // SAFETY: every piece lies within `values` (live, `guard`), every
        // output range within `out`.
        unsafe { b.launch(cfg) }.w()?;
    }
    drop(guard);
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from(total),
    )])
}
