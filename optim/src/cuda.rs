//! CUDA bodies of the optimizer's kernels (feature `cuda`): the fused
//! low-bit AdamW step ([`LowBitStep`]) and the helpers that the gradient
//! sum of squares (`cuda_sum_sq.rs`) shares, from `kernels/lowbit.cu` (PTX
//! built by `build.rs` with nvcc 13.0 and `-fmad=false`, embedded, loaded
//! once per device).
//!
//! # Passes of the step, and why the second one is usually empty
//! The new scale of each low-bit output comes from the amax of the whole
//! updated tensor, so no element's final code is known before every element
//! is updated. Pass 1 (`lowbit_step_*`) decodes weight, gradient and
//! moments, updates in registers, encodes every output with the scale it
//! had before the step and folds the three amaxes (one atomic per block
//! each). Pass 2 (`lowbit_fix_*`) turns the amaxes into the final scales on
//! the device, exactly as the CPU body does; a power-of-two scale moves only
//! when its amax crosses a power of two, so in most steps every final scale
//! equals the one pass 1 used and every block of pass 2 returns at once.
//! Where one moved, pass 2 recomputes the same update (the same IEEE
//! operations, so the same bits) and rewrites the streams whose scale moved.
//! A tensor of at most `ONE_BLOCK_MAX` elements takes both passes in one
//! launch of one block (`lowbit_one_*`, a barrier between them).
//!
//! So a step moves the floor's bytes (at O2: 2 + 1 + 1 + 2 read, 2 + 1 + 2
//! written, 11 a parameter) when its scales stay and 6 more per rewritten
//! stream's step otherwise; an f32 scratch, as the CPU body keeps, would
//! write and read 12 bytes more every step.
//!
//! Every stream is accessed four elements a thread at a time (4-, 8- or
//! 16-byte words, consecutive threads on consecutive words) when all are
//! 16-byte aligned, eight at a time (8- and 16-byte words) in the kernels
//! whose streams are all 1- or 2-byte codes; the kinds of the combinations
//! the levels use are compile-time constants of their own kernels
//! (`lowbit_*_2002` is FP16 weight, E4M3 gradient, E4M3 m, FP16 v), with a
//! runtime-kind kernel for the rest.
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
//! lanes, f64 sums in order in groups of 256 blocks, then the groups in
//! order), so it agrees bit for bit too.
//!
//! No host synchronization and no device-to-host copy: scales and amaxes are
//! read and written by the kernels.

pub(crate) use crate::cuda_buf::Buf;
use crate::fused::{LowBitStep, META_LEN, Q};
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
pub(crate) const THREADS: u32 = 256;
/// The step kernels hold 4 blocks of 256 threads per multiprocessor
/// (`__launch_bounds__(256, 4)`): a grid of one wave of them (this many per
/// multiprocessor of the device), a grid-stride loop over the rest, no tail
/// of a second wave.
const STEP_BLOCKS_PER_SM: usize = 4;
/// Up to this many elements the step is one launch of one block
/// (`lowbit_one_*`: 64 elements a thread at most), both passes in it: the
/// biases and LayerNorm parameters of a GPT, a launch each instead of two.
const ONE_BLOCK_MAX: usize = 16384;
/// Stream kinds (w, g, m, v) with a kernel of their own in lowbit.cu (4:
/// E4M3 square roots, `K_E4M3_SQRT`).
const FIXED_KINDS: [[i32; 4]; 6] = [
    [2, 0, 0, 2],
    [2, 0, 3, 3],
    [3, 3, 0, 2],
    [3, 3, 3, 3],
    [2, 0, 0, 4],
    [3, 3, 0, 4],
];
/// The v stream's kind where it holds E4M3 square roots.
pub(crate) const K_E4M3_SQRT: i32 = 4;
/// Scale, scale_inv and amax: the one-element outputs of each stream.
pub(crate) const META_PER_STREAM: usize = 3;

pub(crate) type Outputs = Vec<(CudaStorage, Shape)>;

pub(crate) fn func(dev: &CudaDevice, name: &str) -> amp_core::Result<CudaFunction> {
    amp_core::ensure_supported(dev)?;
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

fn grid(dev: &CudaDevice, items: usize) -> amp_core::Result<LaunchConfig> {
    let max_blocks = amp_core::multiprocessors(dev)? * STEP_BLOCKS_PER_SM;
    Ok(LaunchConfig {
        grid_dim: (
            items.div_ceil(THREADS as usize).clamp(1, max_blocks) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The device of a launch over (gradient, scale_inv) pairs and how many
/// pairs: an error for none or an odd count.
pub(crate) fn pairs_device(
    op: &'static str,
    inputs: &[(&CudaStorage, &Layout)],
) -> amp_core::Result<(CudaDevice, usize)> {
    let Some((first, _)) = inputs.first() else {
        return Err(bad(op, "no gradients"));
    };
    if inputs.len() % 2 != 0 {
        return Err(bad(op, "inputs come in (gradient, scale_inv) pairs"));
    }
    Ok((first.device().clone(), inputs.len() / 2))
}

pub(crate) fn bad(op: &'static str, what: &str) -> amp_core::Error {
    amp_core::Error::Unsupported {
        op,
        what: what.into(),
    }
}

/// A stream's kind in lowbit.cu (`K_E4M3` .. `K_F32`) and its dtype.
pub(crate) fn kind(q: Q) -> (i32, DType) {
    let k = match q {
        Some(QType::E4M3) => 0,
        Some(QType::E5M2) => 1,
        Some(QType::F16) => 2,
        None => 3,
    };
    (k, crate::multi::storage_dtype(q))
}

/// The device address of a contiguous input's first element, checked
/// against its expected dtype. The address stays valid while `s` lives.
pub(crate) fn address(
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
pub(crate) fn scalar_address(
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
pub(crate) struct Streams {
    pub data: [u64; 4],
    pub scale_inv: [u64; 4],
    pub kinds: [i32; 4],
    /// Stochastic rounding's salt of a `K_E4M3_SQRT` v stream.
    pub salt: u32,
}
// SAFETY: plain old data laid out as the C struct (8 pointers, 4 ints, a
// u32; repr(C) pads both alike).
unsafe impl DeviceRepr for Streams {}

impl Streams {
    /// Where `roots` (the rounding's salt) is given, the v stream (of
    /// storage `v`) holds E4M3 square roots: its kind and salt.
    pub(crate) fn roots(
        &mut self,
        op: &'static str,
        v: Q,
        roots: Option<u32>,
    ) -> amp_core::Result<()> {
        if let Some(salt) = roots {
            if v != Some(QType::E4M3) {
                return Err(bad(op, "square roots are stored in E4M3"));
            }
            self.kinds[3] = K_E4M3_SQRT;
            self.salt = salt;
        }
        Ok(())
    }
}

/// `Adam` of lowbit.cu.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Adam(pub [f32; 8]);
// SAFETY: 8 floats, as the C struct.
unsafe impl DeviceRepr for Adam {}

/// `Outs` of lowbit.cu.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Outs {
    pub data: [u64; 3],
    pub copy: u64,
    /// scale, scale_inv, amax of w, m, v, copy
    pub meta: [u64; 4 * META_PER_STREAM],
}
// SAFETY: 16 pointers, as the C struct.
unsafe impl DeviceRepr for Outs {}

pub(crate) fn lowbit_step(
    k: &LowBitStep<'_>,
    inputs: &[(&CudaStorage, &Layout)],
) -> amp_core::Result<Outputs> {
    const OP: &str = "lowbit_adamw_step";
    let [(w, lw), (ws, lws), (g, lg), (gs, lgs), (m, lm), (ms, lms), (v, lv), (vs, lvs), (gm, lgm), rest @ ..] =
        inputs
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
    if k.w_in_place && (k.w.is_some() || k.fp8_copy) {
        return Err(bad(OP, "only an F32 weight is updated in place"));
    }
    let dev = w.device().clone();
    let qs = [k.w, k.g, k.m, k.v];
    let mut streams = Streams {
        data: [0; 4],
        scale_inv: [0; 4],
        kinds: [0; 4],
        salt: 0,
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
    streams.roots(OP, k.v, k.v_sqrt)?;
    let gmul = scalar_address(OP, gm, lgm, &dev)?;
    let c = k.k.constants();
    // grad_mul (the last field) is read from `gmul` by the kernels
    let adam = Adam([c[0], c[1], c[2], c[3], c[4], c[5], c[6], 1.0]);
    let stream = dev.cuda_stream();
    // The copy's scale_inv before the step: only where the copy's expected
    // scale is taken from (the weight's otherwise, never read).
    let copy_si = match (k.fp8_copy, rest) {
        (true, [(cs, lcs)]) => scalar_address(OP, cs, lcs, &dev)?,
        (false, []) => streams.scale_inv[0],
        _ => return Err(bad(OP, "the FP8 copy's scale_inv goes with fp8_copy")),
    };

    // Output data (the copy last here, first in the outputs), and one
    // allocation for the 12 meta slots and the passes' 3 amax words.
    let mut bufs = Vec::with_capacity(4);
    for (i, q) in [k.w, k.m, k.v].into_iter().enumerate() {
        if i > 0 || !k.w_in_place {
            bufs.push(Buf::alloc(&dev, kind(q).1, n)?);
        }
    }
    if k.fp8_copy {
        bufs.push(Buf::alloc(&dev, DType::U8, n)?);
    }
    // SAFETY: lowbit_fix writes every meta slot of w, m, v (and of the copy
    // where there is one; without, its slots are never read); the amax
    // words are zeroed before pass 1: below for the two-launch step, by
    // lowbit_one itself otherwise.
    let mut meta = unsafe { dev.alloc::<f32>(META_LEN)? };
    if n > ONE_BLOCK_MAX {
        stream
            .memset_zeros(&mut meta.slice_mut(4 * META_PER_STREAM..4 * META_PER_STREAM + 3))
            .w()?;
    }
    let base = meta.device_ptr_mut(&stream).0;
    let mut outs = Outs {
        data: [0; 3],
        copy: 0,
        meta: [0; 4 * META_PER_STREAM],
    };
    let mut addrs = bufs.iter_mut().map(|b| b.address(&dev));
    for i in 0..3 {
        outs.data[i] = if i == 0 && k.w_in_place {
            streams.data[0]
        } else {
            addrs.next().ok_or_else(|| bad(OP, "output buffers"))?
        };
    }
    if k.fp8_copy {
        outs.copy = addrs.next().ok_or_else(|| bad(OP, "output buffers"))?;
    }
    for (i, slot) in outs.meta.iter_mut().enumerate() {
        *slot = base + 4 * i as u64;
    }
    let amax = base + 4 * (4 * META_PER_STREAM) as u64;
    let vec = i32::from(
        streams
            .data
            .iter()
            .chain(&outs.data)
            .chain(if k.fp8_copy { Some(&outs.copy) } else { None })
            .all(|a| a % 16 == 0),
    );
    let suffix = if FIXED_KINDS.contains(&streams.kinds) {
        streams.kinds.iter().map(i32::to_string).collect::<String>()
    } else {
        "any".into()
    };

    // Pass 1 (`lowbit_step_*`): update, encode with the previous scales,
    // the amaxes. Pass 2 (`lowbit_fix_*`): the final scales; rewrite the
    // streams whose scale moved. Both take the same arguments; a small
    // tensor takes both in one launch of one block (`lowbit_one_*`).
    let (passes, cfg): (&[&str], _) = if n <= ONE_BLOCK_MAX {
        (&["one"], grid(&dev, 1)?)
    } else {
        (&["step", "fix"], grid(&dev, n.div_ceil(4))?)
    };
    for pass in passes {
        let f = func(&dev, &format!("lowbit_{pass}_{suffix}"))?;
        let mut b = stream.launch_builder(&f);
        b.arg(&streams)
            .arg(&adam)
            .arg(&gmul)
            .arg(&n)
            .arg(&vec)
            .arg(&copy_si)
            .arg(&outs)
            .arg(&amax);
        // SAFETY: the pointers in `streams` address n elements of live inputs
        // of the kinds given (checked above), every output buffer n elements
        // of its kind (the weight input itself where it is updated in place,
        // an F32 stream), every meta slot one f32 and `amax` 3 zeroed words
        // of `meta`; `gmul` one f32; `vec` only where all are 16-byte
        // aligned.
        unsafe { b.launch(cfg) }.w()?;
    }

    // The copy first, as the CPU body orders them, then w (unless in
    // place), m, v, and the meta.
    let shape = lw.shape().clone();
    let mut out: Outputs = bufs
        .into_iter()
        .map(|b| (b.storage(&dev), shape.clone()))
        .collect();
    if k.fp8_copy {
        out.rotate_right(1);
    }
    out.push((
        CudaStorage::wrap_cuda_slice(meta, dev.clone()),
        Shape::from(META_LEN),
    ));
    Ok(out)
}
