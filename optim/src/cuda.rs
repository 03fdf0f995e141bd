//! CUDA bodies of the optimizer's kernels (feature `cuda`): the fused
//! low-bit AdamW step ([`LowBitStep`]) and the gradient sum of squares
//! ([`SumSq`]), from `kernels/lowbit.cu` (PTX built by `build.rs` with nvcc
//! 13.0 and `-fmad=false`, embedded, loaded once per device).
//!
//! # Passes of the step, and why two
//! The new scale of each low-bit output comes from the amax of the whole
//! updated tensor, so no element can be encoded before every element is
//! updated. Pass 1 (`lowbit_amax`) decodes weight, gradient and moments,
//! updates in registers and only folds the three amaxes (one atomic per
//! block each). Pass 2 (`lowbit_write`) turns the amaxes into scales on the
//! device, recomputes the same update (the same IEEE operations, so the same
//! bits) and writes every output. Recomputing reads the inputs twice at
//! their stored sizes (at O2: 2 + 1 + 1 + 2 bytes a parameter) where an f32
//! scratch, as the CPU body keeps, would write and read 12 bytes more: at
//! O2 the two passes move 6 + 6 + 5 = 17 bytes a parameter against a floor
//! of 11, the scratch way 35.
//!
//! # Bit-identity with the CPU body
//! Every decode is one f32 product of the decoded code and scale_inv, the
//! update is AdamStep::update's sequence of IEEE f32 operations (no
//! contraction: intrinsics with `_rn` and `-fmad=false`), the amax is the
//! integer max of `|x|`'s bits, the scale is `ScaleRule::PowerOfTwo`'s exact
//! exponent rule, and the encodes are amp-core's saturating RNE casts. So
//! all finite results agree bit for bit; only NaN payloads can differ (the
//! GPU returns 0x7FFFFFFF, x86 keeps an operand's payload). The sum of
//! squares follows the CPU's order exactly (2048-element blocks, 8 f32
//! lanes, f64 sums in order), so it agrees bit for bit too.
//!
//! No host synchronization and no device-to-host copy: scales and amaxes are
//! read and written by the kernels.

use crate::fused::{LowBitStep, SumSq, Q};
use amp_core::QType;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Shape};
use half::f16;

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/lowbit.ptx"));
const MODULE: &str = "candle_amp_optim_kernels";
const THREADS: u32 = 256;
/// At most 8 blocks of 256 threads per SM of an H100: a grid-stride loop
/// covers the rest.
const MAX_BLOCKS: usize = 132 * 8;
/// `SUMSQ_BLOCK` in lowbit.cu: the CPU body's block length.
const SUMSQ_BLOCK: usize = 2048;

type Outputs = Vec<(CudaStorage, Shape)>;

fn func(dev: &CudaDevice, name: &str) -> amp_core::Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

fn grid(items: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            items.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn bad(op: &'static str, what: &str) -> amp_core::Error {
    amp_core::Error::Unsupported {
        op,
        what: what.into(),
    }
}

/// A stream's kind in lowbit.cu (`K_E4M3` .. `K_F32`) and its dtype.
fn kind(q: Q) -> (i32, DType) {
    match q {
        Some(QType::E4M3) => (0, DType::U8),
        Some(QType::E5M2) => (1, DType::U8),
        Some(QType::F16) => (2, DType::F16),
        None => (3, DType::F32),
    }
}

/// The device address of a contiguous input's first element, checked
/// against its expected dtype. The address stays valid while `s` lives.
fn address(
    op: &'static str,
    s: &CudaStorage,
    l: &Layout,
    dtype: DType,
    dev: &CudaDevice,
) -> amp_core::Result<u64> {
    if s.dtype() != dtype {
        return Err(amp_core::Error::DType {
            op,
            expected: "the stream's storage dtype",
            got: s.dtype(),
        });
    }
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| bad(op, "non-contiguous input"))?;
    let stream = dev.cuda_stream();
    let ptr = match dtype {
        DType::U8 => {
            s.as_cuda_slice::<u8>()?
                .slice(start..end)
                .device_ptr(&stream)
                .0
        }
        DType::F16 => {
            s.as_cuda_slice::<f16>()?
                .slice(start..end)
                .device_ptr(&stream)
                .0
        }
        DType::F32 => {
            s.as_cuda_slice::<f32>()?
                .slice(start..end)
                .device_ptr(&stream)
                .0
        }
        got => {
            return Err(amp_core::Error::DType {
                op,
                expected: "U8, F16 or F32",
                got,
            })
        }
    };
    Ok(ptr)
}

/// A 1-element F32 input's address.
fn scalar_address(
    op: &'static str,
    s: &CudaStorage,
    l: &Layout,
    dev: &CudaDevice,
) -> amp_core::Result<u64> {
    if l.shape().elem_count() != 1 {
        return Err(amp_core::Error::Shape {
            op,
            lhs: Shape::from(1usize),
            rhs: l.shape().clone(),
        });
    }
    address(op, s, l, DType::F32, dev)
}

/// `Streams` of lowbit.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct Streams {
    data: [u64; 4],
    scale_inv: [u64; 4],
    kinds: [i32; 4],
}
// SAFETY: plain old data laid out as the C struct (8 pointers, 4 ints).
unsafe impl DeviceRepr for Streams {}

/// `Adam` of lowbit.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct Adam([f32; 8]);
// SAFETY: 8 floats, as the C struct.
unsafe impl DeviceRepr for Adam {}

/// `Outs` of lowbit.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct Outs {
    data: [u64; 3],
    copy: u64,
    /// w scale, w amax, m scale, m amax, v scale, v amax, copy scale, copy amax
    meta: [u64; 8],
}
// SAFETY: 12 pointers, as the C struct.
unsafe impl DeviceRepr for Outs {}

/// An output stream's data buffer.
enum Buf {
    U8(candle_core::cuda_backend::cudarc::driver::CudaSlice<u8>),
    F16(candle_core::cuda_backend::cudarc::driver::CudaSlice<f16>),
    F32(candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>),
}

impl Buf {
    fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> amp_core::Result<Self> {
        // SAFETY (all): lowbit_write writes every element.
        Ok(match dtype {
            DType::U8 => Self::U8(unsafe { dev.alloc::<u8>(n)? }),
            DType::F16 => Self::F16(unsafe { dev.alloc::<f16>(n)? }),
            _ => Self::F32(unsafe { dev.alloc::<f32>(n)? }),
        })
    }

    fn address(&mut self, dev: &CudaDevice) -> u64 {
        let stream = dev.cuda_stream();
        match self {
            Self::U8(s) => s.device_ptr_mut(&stream).0,
            Self::F16(s) => s.device_ptr_mut(&stream).0,
            Self::F32(s) => s.device_ptr_mut(&stream).0,
        }
    }

    fn storage(self, dev: &CudaDevice) -> CudaStorage {
        match self {
            Self::U8(s) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
            Self::F16(s) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
            Self::F32(s) => CudaStorage::wrap_cuda_slice(s, dev.clone()),
        }
    }
}

pub(crate) fn lowbit_step(
    k: &LowBitStep<'_>,
    inputs: &[(&CudaStorage, &Layout)],
) -> amp_core::Result<Outputs> {
    const OP: &str = "lowbit_adamw_step";
    let [(w, lw), (ws, lws), (g, lg), (gs, lgs), (m, lm), (ms, lms), (v, lv), (vs, lvs)] = inputs
    else {
        return Err(bad(OP, "wrong number of inputs"));
    };
    let n = lw.shape().elem_count();
    for l in [lg, lm, lv] {
        if l.shape().elem_count() != n {
            return Err(amp_core::Error::Shape {
                op: OP,
                lhs: lw.shape().clone(),
                rhs: l.shape().clone(),
            });
        }
    }
    let dev = w.device().clone();
    let qs = [k.w, k.g, k.m, k.v];
    let mut streams = Streams {
        data: [0; 4],
        scale_inv: [0; 4],
        kinds: [0; 4],
    };
    for (i, ((s, l), (si, lsi))) in [(w, lw), (g, lg), (m, lm), (v, lv)]
        .into_iter()
        .zip([(ws, lws), (gs, lgs), (ms, lms), (vs, lvs)])
        .enumerate()
    {
        let (kd, dtype) = kind(qs[i]);
        streams.data[i] = address(OP, s, l, dtype, &dev)?;
        streams.scale_inv[i] = scalar_address(OP, si, lsi, &dev)?;
        streams.kinds[i] = kd;
    }
    let c = k.k.constants();
    let adam = Adam([c[0], c[1], c[2], c[3], c[4], c[5], c[6], k.grad_mul]);
    let stream = dev.cuda_stream();

    // Pass 1: the amaxes.
    let mut amax = dev.alloc_zeros::<u32>(3)?;
    let f = func(&dev, "lowbit_amax")?;
    {
        let mut b = stream.launch_builder(&f);
        b.arg(&streams).arg(&adam).arg(&n).arg(&mut amax);
        // SAFETY: the pointers in `streams` address n elements of live inputs
        // of the kinds given (checked above); amax holds 3 words.
        unsafe { b.launch(grid(n)) }.w()?;
    }

    // Pass 2: scales, update again, encode.
    let mut bufs = Vec::with_capacity(4);
    for q in [k.w, k.m, k.v] {
        bufs.push(Buf::alloc(&dev, kind(q).1, n)?);
    }
    if k.fp8_copy {
        bufs.push(Buf::alloc(&dev, DType::U8, n)?);
    }
    let mut meta = Vec::with_capacity(8);
    for _ in 0..8 {
        meta.push(dev.alloc_zeros::<f32>(1)?);
    }
    let mut outs = Outs {
        data: [0; 3],
        copy: 0,
        meta: [0; 8],
    };
    for (i, b) in bufs.iter_mut().enumerate() {
        let a = b.address(&dev);
        if i < 3 {
            outs.data[i] = a;
        } else {
            outs.copy = a;
        }
    }
    for (i, s) in meta.iter_mut().enumerate() {
        outs.meta[i] = s.device_ptr_mut(&stream).0;
    }
    let f = func(&dev, "lowbit_write")?;
    {
        let mut b = stream.launch_builder(&f);
        b.arg(&streams).arg(&adam).arg(&n).arg(&amax).arg(&outs);
        // SAFETY: as pass 1; every output buffer holds n elements of its
        // kind, every meta slot one f32.
        unsafe { b.launch(grid(n)) }.w()?;
    }

    let shape = lw.shape().clone();
    let one = Shape::from(1usize);
    let mut meta = meta
        .into_iter()
        .map(|s| CudaStorage::wrap_cuda_slice(s, dev.clone()));
    let mut next = || meta.next().ok_or_else(|| bad(OP, "meta outputs"));
    let (w_scale, w_amax, m_scale, m_amax, v_scale, v_amax, c_scale, c_amax) = (
        next()?,
        next()?,
        next()?,
        next()?,
        next()?,
        next()?,
        next()?,
        next()?,
    );
    let mut bufs = bufs.into_iter().map(|b| b.storage(&dev));
    let (wd, md, vd) = (
        bufs.next().ok_or_else(|| bad(OP, "outputs"))?,
        bufs.next().ok_or_else(|| bad(OP, "outputs"))?,
        bufs.next().ok_or_else(|| bad(OP, "outputs"))?,
    );
    let mut out = Vec::with_capacity(12);
    if let Some(cd) = bufs.next() {
        out.extend([
            (cd, shape.clone()),
            (c_scale, one.clone()),
            (c_amax, one.clone()),
        ]);
    }
    out.extend([
        (wd, shape.clone()),
        (w_scale, one.clone()),
        (w_amax, one.clone()),
        (md, shape.clone()),
        (m_scale, one.clone()),
        (m_amax, one.clone()),
        (vd, shape),
        (v_scale, one.clone()),
        (v_amax, one),
    ]);
    Ok(out)
}

pub(crate) fn sum_sq(k: &SumSq, inputs: &[(&CudaStorage, &Layout)]) -> amp_core::Result<Outputs> {
    const OP: &str = "grad_sum_sq";
    let [(g, lg), (gs, lgs)] = inputs else {
        return Err(bad(OP, "wrong number of inputs"));
    };
    let dev = g.device().clone();
    let n = lg.shape().elem_count();
    let (kd, dtype) = kind(k.g);
    let gp = address(OP, g, lg, dtype, &dev)?;
    let sp = scalar_address(OP, gs, lgs, &dev)?;
    let chunks = n.div_ceil(SUMSQ_BLOCK);
    let stream = dev.cuda_stream();
    let mut partials = dev.alloc_zeros::<f64>(chunks.max(1))?;
    let mut total = dev.alloc_zeros::<f64>(1)?;
    if chunks > 0 {
        let threads = chunks * 8;
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(THREADS as usize) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = func(&dev, "sumsq_partials")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&gp).arg(&kd).arg(&sp).arg(&n).arg(&mut partials);
        // SAFETY: gp addresses n elements of kind kd; partials holds one f64
        // per block of SUMSQ_BLOCK elements.
        unsafe { b.launch(cfg) }.w()?;
        let f = func(&dev, "sumsq_total")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&partials).arg(&chunks).arg(&mut total);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: partials holds `chunks` f64, total one.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(total, dev),
        Shape::from(1usize),
    )])
}
