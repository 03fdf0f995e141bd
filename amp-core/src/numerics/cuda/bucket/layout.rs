//! The launches that move bytes: pieces copied from their tensors, and
//! tensors concatenated.

use super::{launches, Item};
use crate::error::{Error, Result};
use crate::numerics::bucket::Piece;
use crate::numerics::cuda::launch::{func, view};
use crate::numerics::kernel::arity;
use crate::numerics::stream::cuda::current_stream;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaStream, DevicePtr, DeviceRepr, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{Layout, Shape};

/// srcs (U8) -> the pieces' bytes, each from its `tensor`'s source,
/// concatenated.
pub(crate) fn bucket_copy_from(
    pieces: &[Piece],
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_copy_from";
    let Some((first, _)) = inputs.first() else {
        return Err(arity(OP));
    };
    let dev = first.device().clone();
    let stream = current_stream(&dev);
    let srcs = inputs
        .iter()
        .map(|(x, l)| view::<u8>(OP, x, l))
        .collect::<Result<Vec<_>>>()?;
    let mut bases = Vec::with_capacity(srcs.len());
    let mut guards = Vec::with_capacity(srcs.len());
    for v in &srcs {
        let (b, g) = v.device_ptr(&stream);
        bases.push((b, v.len()));
        guards.push(g);
    }
    let mut items = Vec::with_capacity(pieces.len());
    let mut total = 0;
    for p in pieces {
        let &(base, len) = bases.get(p.tensor).ok_or_else(|| arity(OP))?;
        if p.start + p.len > len {
            return Err(arity(OP));
        }
        items.push(Item {
            src: base + p.start as u64,
            len: p.len,
            out_off: total,
            aux: 0,
            t: 0,
        });
        total += p.len;
    }
    // SAFETY: every piece lies within its source, live while `guards` are.
    let out = unsafe { copy_bytes::<u8>(&dev, &stream, &items, total) };
    drop(guards);
    out
}

/// `total` elements of `T` from the bytes the items describe
/// (`bucket_copy_u8`), as one storage.
///
/// # Safety
/// Every item's `src .. src + len` bytes are readable device memory of
/// this device, live until the copy has run, and the items' output byte
/// ranges cover `total` elements of `T` without overlap.
unsafe fn copy_bytes<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    stream: &std::sync::Arc<CudaStream>,
    items: &[Item],
    total: usize,
) -> Result<Vec<(CudaStorage, Shape)>> {
    // SAFETY: the items cover every element (the caller's promise).
    let mut out = unsafe { stream.alloc::<T>(total.max(1)) }.w()?;
    let f = func(dev, "bucket_copy_u8")?;
    for (a, cfg) in launches(dev, items)? {
        let mut b = stream.launch_builder(&f);
        b.arg(&a).arg(&mut out);
        // SAFETY: the caller's promise on the inputs; outputs within `out`.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        Shape::from(total),
    )])
}

/// inputs (one dtype, each contiguous) -> their elements concatenated,
/// `bucket_copy_u8` over their bytes.
pub(crate) fn bucket_concat(
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    use candle_core::DType;
    let Some((first, _)) = inputs.first() else {
        return Err(arity("bucket_concat"));
    };
    match first.dtype() {
        DType::F32 => concat_typed::<f32>(inputs),
        DType::BF16 => concat_typed::<half::bf16>(inputs),
        DType::F16 => concat_typed::<half::f16>(inputs),
        DType::U8 => concat_typed::<u8>(inputs),
        got => Err(Error::DType {
            op: "bucket_concat",
            expected: "F32, BF16, F16 or U8",
            got,
        }),
    }
}

fn concat_typed<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_concat";
    let dev = inputs[0].0.device().clone();
    let stream = current_stream(&dev);
    let size = std::mem::size_of::<T>();
    let views = inputs
        .iter()
        .map(|(s, l)| view::<T>(OP, s, l))
        .collect::<Result<Vec<_>>>()?;
    let mut guards = Vec::with_capacity(views.len());
    let mut items = Vec::with_capacity(views.len());
    let mut total = 0;
    for v in &views {
        let (ptr, guard) = v.device_ptr(&stream);
        guards.push(guard);
        items.push(Item {
            src: ptr,
            len: v.len() * size,
            out_off: total * size,
            aux: 0,
            t: 0,
        });
        total += v.len();
    }
    // SAFETY: every item lies within its input, live while `guards` are;
    // the outputs are the inputs' elements side by side.
    let out = unsafe { copy_bytes::<T>(&dev, &stream, &items, total) };
    drop(guards);
    out
}
