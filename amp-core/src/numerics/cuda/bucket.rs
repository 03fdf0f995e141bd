//! Launches of the `bucket_*` kernels (`kernels/amp.cu`): up to
//! `BUCKET_MAX` items a launch (`blockIdx.y`), described by value in a
//! `BucketArgs`; more items take more launches into the same outputs.

use super::decode_sum::SUM_MAX;
use super::launch::{func, multiprocessors, scalar as scalar_view, view};
use crate::error::{Error, Result};
use crate::numerics::bucket::{Piece, SumOut};
use crate::numerics::kernel::arity;
use crate::numerics::qtype::QType;
use crate::numerics::scale::ScaleRule;
use crate::numerics::stream::cuda::current_stream;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{Layout, Shape};

/// Items a launch (`BUCKET_MAX`).
const ITEMS: usize = 64;
const THREADS: u32 = 256;

/// `BucketArgs` in amp.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct BucketArgs {
    src: [u64; ITEMS],
    len: [u64; ITEMS],
    out_off: [u64; ITEMS],
    aux: [u64; ITEMS],
    t: [i32; ITEMS],
}

// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl DeviceRepr for BucketArgs {}

impl BucketArgs {
    fn new() -> Self {
        Self {
            src: [0; ITEMS],
            len: [0; ITEMS],
            out_off: [0; ITEMS],
            aux: [0; ITEMS],
            t: [0; ITEMS],
        }
    }
}

/// One item: input address, length, output offset, extra, tensor.
#[derive(Clone, Copy)]
struct Item {
    src: u64,
    len: usize,
    out_off: usize,
    aux: u64,
    t: usize,
}

/// The grid of a launch of `items`: `blockIdx.y` the item, enough blocks
/// in x for the longest, about eight blocks a multiprocessor in all.
fn grid(dev: &CudaDevice, items: &[Item]) -> Result<LaunchConfig> {
    let longest = items.iter().map(|i| i.len).max().unwrap_or(0);
    let budget = (multiprocessors(dev)? * 8)
        .div_ceil(items.len().max(1))
        .max(1);
    let x = longest.div_ceil(THREADS as usize * 4).clamp(1, budget) as u32;
    Ok(LaunchConfig {
        grid_dim: (x, items.len() as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The launches for the items, `ITEMS` at a time (chunks of empty items
/// left out): the `BucketArgs` of each and its grid.
fn launches(dev: &CudaDevice, items: &[Item]) -> Result<Vec<(BucketArgs, LaunchConfig)>> {
    items
        .chunks(ITEMS)
        .filter(|c| c.iter().any(|i| i.len > 0))
        .map(|chunk| {
            let mut a = BucketArgs::new();
            for (k, i) in chunk.iter().enumerate() {
                a.src[k] = i.src;
                a.len[k] = i.len as u64;
                a.out_off[k] = i.out_off as u64;
                a.aux[k] = i.aux;
                a.t[k] = i.t as i32;
            }
            Ok((a, grid(dev, chunk)?))
        })
        .collect()
}

fn fmt_name(op: &'static str, qtype: QType) -> Result<&'static str> {
    match qtype {
        QType::E4M3 => Ok("e4m3"),
        QType::E5M2 => Ok("e5m2"),
        QType::F16 => Err(Error::Unsupported {
            op,
            what: "FP16 codes".into(),
        }),
    }
}

fn wrap_f32(s: CudaSlice<f32>, dev: &CudaDevice, n: usize) -> (CudaStorage, Shape) {
    (CudaStorage::wrap_cuda_slice(s, dev.clone()), Shape::from(n))
}

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

/// One block of a thread per item (the launches over one-element inputs).
fn one_block_of_items() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (ITEMS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Runs `launch` with the device addresses of one-element F32 `inputs`,
/// kept live (cudarc's guards) until it has queued its launches.
fn with_scalar_ptrs(
    op: &'static str,
    inputs: &[(&CudaStorage, &Layout)],
    stream: &std::sync::Arc<CudaStream>,
    launch: impl FnOnce(&[u64]) -> Result<()>,
) -> Result<()> {
    let views = inputs
        .iter()
        .map(|(s, l)| scalar_view(op, s, l))
        .collect::<Result<Vec<_>>>()?;
    let mut guards = Vec::with_capacity(views.len());
    let mut ptrs = Vec::with_capacity(views.len());
    for v in &views {
        let (p, g) = v.device_ptr(stream);
        ptrs.push(p);
        guards.push(g);
    }
    let done = launch(&ptrs);
    drop(guards);
    done
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

/// A code storage's view: `U8` for FP8, `F16` for FP16.
enum CodeView<'a> {
    U8(CudaView<'a, u8>),
    F16(CudaView<'a, half::f16>),
}

impl CodeView<'_> {
    fn new<'a>(
        op: &'static str,
        qtype: QType,
        (c, l): (&'a CudaStorage, &Layout),
    ) -> Result<CodeView<'a>> {
        Ok(if qtype == QType::F16 {
            CodeView::F16(view::<half::f16>(op, c, l)?)
        } else {
            CodeView::U8(view::<u8>(op, c, l)?)
        })
    }

    fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }

    fn ptr<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        match self {
            Self::U8(v) => v.device_ptr(stream),
            Self::F16(v) => v.device_ptr(stream),
        }
    }
}

fn code_name(qtype: QType) -> &'static str {
    match qtype {
        QType::E4M3 => "e4m3",
        QType::E5M2 => "e5m2",
        QType::F16 => "f16",
    }
}

/// chunk_0..N-1, scale_inv [T] (and scale [T] for codes) -> by `mode`:
/// sums [sum of piece lengths] and amax [T]; amax [T]; codes [sum of piece
/// lengths].
pub(crate) fn bucket_decode_sum(
    qtype: QType,
    average: bool,
    inv_n: f32,
    pieces: &[Piece],
    mode: SumOut,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_decode_sum";
    let (inputs, scale) = match mode {
        SumOut::Codes => {
            let Some(((q, lq), rest)) = inputs.split_last() else {
                return Err(arity(OP));
            };
            (rest, Some(view::<f32>(OP, q, lq)?))
        }
        SumOut::Sums | SumOut::Amax => (inputs, None),
    };
    let Some(((s, ls), chunks)) = inputs.split_last() else {
        return Err(arity(OP));
    };
    if chunks.is_empty() || chunks.len() > SUM_MAX {
        return Err(arity(OP));
    }
    let dev = s.device().clone();
    let stream = current_stream(&dev);
    // `[T]`: every rank's codes of tensor t with element t; `[N, T]`:
    // rank k's with element [k, t]
    let (tensors, s_stride): (usize, i32) = match ls.shape().dims() {
        [ranks, t] if *ranks == chunks.len() => (*t, *t as i32),
        [t] => (*t, 0),
        _ => return Err(arity(OP)),
    };
    let scale_inv = view::<f32>(OP, s, ls)?;
    let views = chunks
        .iter()
        .map(|(c, l)| view::<u8>(OP, c, l))
        .collect::<Result<Vec<_>>>()?;
    let mut ptrs = [0u64; SUM_MAX];
    let mut guards = Vec::new();
    for (k, v) in views.iter().enumerate() {
        let (p, g) = v.device_ptr(&stream);
        ptrs[k] = p;
        guards.push(g);
    }
    let mut items = Vec::with_capacity(pieces.len());
    let mut total = 0;
    for p in pieces {
        items.push(Item {
            src: 0,
            len: p.len,
            out_off: total,
            aux: p.start as u64,
            t: p.tensor,
        });
        total += p.len;
    }
    let fmt = fmt_name(OP, qtype)?;
    let ranks = chunks.len() as i32;
    let avg = i32::from(average && chunks.len() > 1);
    // The outputs of the mode: codes, or sums and amaxes, or amaxes.
    let (name, mut codes, mut sums, mut amax) = match (mode, &scale) {
        (SumOut::Codes, Some(_)) => (
            "bucket_decode_quantize",
            // SAFETY: the kernel writes every element (the pieces cover them).
            Some(unsafe { stream.alloc::<u8>(total.max(1)) }.w()?),
            None,
            None,
        ),
        (SumOut::Codes, None) => return Err(arity(OP)),
        (SumOut::Amax, _) => (
            "bucket_decode_amax",
            None,
            None,
            Some(stream.alloc_zeros::<f32>(tensors.max(1)).w()?),
        ),
        (SumOut::Sums, _) => (
            "bucket_decode_sum",
            None,
            // SAFETY: as above.
            Some(unsafe { stream.alloc::<f32>(total.max(1)) }.w()?),
            Some(stream.alloc_zeros::<f32>(tensors.max(1)).w()?),
        ),
    };
    let f = func(&dev, &format!("{name}_{fmt}"))?;
    for (a, cfg) in launches(&dev, &items)? {
        let mut b = stream.launch_builder(&f);
        b.arg(&a)
            .arg(&ptrs)
            .arg(&ranks)
            .arg(&scale_inv)
            .arg(&s_stride)
            .arg(&avg)
            .arg(&inv_n);
        // the kernel's trailing parameters, in its order
        if let (Some(scale), Some(codes)) = (&scale, &mut codes) {
            b.arg(scale).arg(codes);
        }
        if let Some(sums) = &mut sums {
            b.arg(sums);
        }
        if let Some(amax) = &mut amax {
            b.arg(amax);
        }
        // SAFETY: every chunk is live (`guards`) and holds each piece's
        // range; every output range within its output, every tensor in
        // `scale_inv`, `scale` (checked by the caller) and `amax`.
        unsafe { b.launch(cfg) }.w()?;
    }
    let out = match (codes, sums, amax) {
        (Some(codes), _, _) => vec![(
            CudaStorage::wrap_cuda_slice(codes, dev.clone()),
            Shape::from(total),
        )],
        (None, Some(sums), Some(amax)) => {
            vec![wrap_f32(sums, &dev, total), wrap_f32(amax, &dev, tensors)]
        }
        (None, None, Some(amax)) => vec![wrap_f32(amax, &dev, tensors)],
        _ => return Err(arity(OP)),
    };
    drop(guards);
    Ok(out)
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
