//! Launch of the batched cast-transpose of FP16 scaling tensors
//! (`kernels/cast_t.cu`, `decoded_amax_many_f16` and
//! `quantize_t_many_f16s_*`): a model's Linear weights to their FP8 GEMM
//! operands, both layouts, in two launches for all of them instead of two
//! (and two zero fills) per weight. The host's share of a 350M GPT's
//! forward was about 22 us a launch (BENCHMARKS.md), so launches, not
//! bytes, are what this saves.

use super::cast_t::{fits, fp8_name};
use super::launch::{cast_t_func, scalar, view, THREADS};
use crate::error::{Error, Result};
use crate::numerics::kernel::arity;
use crate::numerics::qtype::QType;
use crate::numerics::scale::{FromAmax, ScaleRule};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{DType, Layout, Shape};
use half::f16;

/// The kernels' tile edge (`TT` in cast_t.cu).
const TILE: usize = 64;
/// Elements a block of the amax pass covers at least (32 loads of 8 per
/// thread): a 1024 x 4096 weight takes 128 blocks.
const AMAX_ELEMS_PER_BLOCK: usize = THREADS as usize * 8 * 32;

/// `ManyT` of cast_t.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct ManyT {
    x: u64,
    pre: u64,
    amax: u64,
    out: u64,
    out_t: u64,
    counts: u64,
    scale: u64,
    scale_inv: u64,
    rows: i32,
    cols: i32,
    vec: i32,
    tiles_x: i32,
    block0: u64,
    ablock0: u64,
    avec: i32,
    _pad: i32,
}
// SAFETY: plain old data laid out as the C struct.
unsafe impl DeviceRepr for ManyT {}

/// [`RequantizeTMany`](crate::numerics::cast_t::RequantizeTMany)'s CUDA
/// body: inputs `(F16 codes [rows, cols], scale_inv)` pairs, outputs per
/// tensor `codes, codes_t, scale, scale_inv`, then the amaxes `[T]` and
/// with `counted` the counts `[T, 2]`.
///
/// # Errors
/// [`Error::Unsupported`] for a non-FP8 target, an empty tensor, a shape
/// [`fits`] refuses or more than 2^31 - 1 blocks in one launch;
/// [`Error::DType`]; the driver's.
pub(crate) fn requantize_t_many(
    qtype: QType,
    from: FromAmax,
    counted: bool,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "requantize_t_many";
    if inputs.is_empty() || inputs.len() % 2 != 0 {
        return Err(arity(OP));
    }
    let fmt = fp8_name(OP, qtype)?;
    let count = inputs.len() / 2;
    let dev = inputs[0].0.device().clone();
    let stream = dev.cuda_stream();
    // SAFETY (all four kinds): each tensor's codes, codes_t, scale and
    // scale_inv are written by its blocks of the second launch (the scale
    // pair by its first tile's block).
    let mut outs = Vec::with_capacity(count);
    let mut amax = dev.alloc_zeros::<f32>(count)?;
    let mut counts = counted
        .then(|| dev.alloc_zeros::<i64>(2 * count))
        .transpose()?;
    let amax_base = amax.device_ptr_mut(&stream).0;
    // null: the kernels count nothing
    let counts_base = counts.as_mut().map_or(0, |c| c.device_ptr_mut(&stream).0);
    let mut descs = Vec::with_capacity(count);
    let (mut blocks, mut ablocks) = (0u64, 0u64);
    for (i, pair) in inputs.chunks_exact(2).enumerate() {
        let [(x, lx), (p, lp)] = pair else {
            return Err(arity(OP));
        };
        if x.dtype() != DType::F16 {
            return Err(Error::DType {
                op: OP,
                expected: "F16 codes",
                got: x.dtype(),
            });
        }
        let (rows, cols) = lx.shape().dims2()?;
        let n = rows * cols;
        if n == 0 || !fits(rows, cols) {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("a [{rows}, {cols}] tensor (non-empty, at most 65535 x 64 rows)"),
            });
        }
        let xv = view::<f16>(OP, x, lx)?;
        let pv = scalar(OP, p, lp)?;
        let (xp, _g) = xv.device_ptr(&stream);
        let (pp, _h) = pv.device_ptr(&stream);
        let mut out = unsafe { dev.alloc::<u8>(n)? };
        let mut out_t = unsafe { dev.alloc::<u8>(n)? };
        let mut scale = unsafe { dev.alloc::<f32>(1)? };
        let mut scale_inv = unsafe { dev.alloc::<f32>(1)? };
        let op = out.device_ptr_mut(&stream).0;
        let otp = out_t.device_ptr_mut(&stream).0;
        let sp = scale.device_ptr_mut(&stream).0;
        let sip = scale_inv.device_ptr_mut(&stream).0;
        let (tiles_x, tiles_y) = (cols.div_ceil(TILE), rows.div_ceil(TILE));
        // quantize_t's vector condition, so that full tiles take the same path
        let vec = cols % 8 == 0 && rows % 16 == 0 && xp % 16 == 0 && op % 16 == 0 && otp % 16 == 0;
        descs.push(ManyT {
            x: xp,
            pre: pp,
            amax: amax_base + 4 * i as u64,
            out: op,
            out_t: otp,
            counts: if counted {
                counts_base + 16 * i as u64
            } else {
                0
            },
            scale: sp,
            scale_inv: sip,
            rows: rows as i32,
            cols: cols as i32,
            vec: i32::from(vec),
            tiles_x: tiles_x as i32,
            block0: blocks,
            ablock0: ablocks,
            avec: i32::from(xp % 16 == 0),
            _pad: 0,
        });
        blocks += (tiles_x * tiles_y) as u64;
        ablocks += n.div_ceil(AMAX_ELEMS_PER_BLOCK) as u64;
        outs.push((out, out_t, scale, scale_inv, rows, cols));
    }
    if blocks > i32::MAX as u64 || ablocks > i32::MAX as u64 {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("{blocks} tiles in one launch"),
        });
    }
    let d = stream.clone_htod(&descs).w()?;
    let cfg = |grid: u64| LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let count_arg = count as i32;
    {
        let f = cast_t_func(&dev, "decoded_amax_many_f16")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&d).arg(&count_arg).arg(&ablocks);
        // SAFETY: each descriptor addresses a live F16 tensor of rows x cols
        // elements (16-byte loads only where avec says it is aligned), its
        // scale_inv and its own zeroed amax; `ablocks` blocks in all.
        unsafe { b.launch(cfg(ablocks)) }.w()?;
    }
    {
        let f = cast_t_func(&dev, &format!("quantize_t_many_f16s_{fmt}"))?;
        let rule = match from.rule {
            ScaleRule::Te => 0i32,
            ScaleRule::PowerOfTwo => 1,
        } | (i32::from(from.flag) << 1);
        let max = qtype.max();
        let mut b = stream.launch_builder(&f);
        b.arg(&d)
            .arg(&count_arg)
            .arg(&rule)
            .arg(&from.margin)
            .arg(&max);
        // SAFETY: as above, and each tensor's outputs hold rows x cols codes
        // in both layouts, its scale pair one f32 each, its counts two
        // zeroed; the amaxes were written by the launch before; one block
        // per tile, `blocks` in all.
        unsafe { b.launch(cfg(blocks)) }.w()?;
    }
    // the descriptors are read by the launches above (stream-ordered free)
    drop(d);
    let wrap = |s, shape: Shape| (CudaStorage::wrap_cuda_slice(s, dev.clone()), shape);
    let mut result = Vec::with_capacity(count * 4 + 2);
    for (out, out_t, scale, scale_inv, rows, cols) in outs {
        result.push(wrap(out, Shape::from((rows, cols))));
        result.push(wrap(out_t, Shape::from((cols, rows))));
        result.push((
            CudaStorage::wrap_cuda_slice(scale, dev.clone()),
            Shape::from(1usize),
        ));
        result.push((
            CudaStorage::wrap_cuda_slice(scale_inv, dev.clone()),
            Shape::from(1usize),
        ));
    }
    result.push((
        CudaStorage::wrap_cuda_slice(amax, dev.clone()),
        Shape::from(count),
    ));
    if let Some(counts) = counts {
        result.push((
            CudaStorage::wrap_cuda_slice(counts, dev.clone()),
            Shape::from((count, 2)),
        ));
    }
    Ok(result)
}
