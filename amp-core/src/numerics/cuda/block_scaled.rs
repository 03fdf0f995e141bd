//! Launches of the block-scaled casts from a scaled FP16 source
//! (`kernels/block.cu`, "SCALED_BLOCKS" and "SCALED_ROWS"): an O1/O2
//! weight's operands from its codes and scale_inv, without a decode pass.

use super::block::{fmt_name, rule_code};
use super::launch::{aligned, block_func, view};
use crate::error::{Error, Result};
use crate::numerics::block::{dims2, fp8_of, BlockQuantizeScaled, Tiling};
use crate::numerics::kernel::{arity, Kernel};
use crate::numerics::scale::ScaleRule;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Shape};
use half::f16;

type Outputs = Vec<(CudaStorage, Shape)>;

/// The requested `[codes, scale_inv]`, `[codes_t, scale_inv_t]` of a
/// scaled FP16 `[q, scale_inv]` (see [`BlockQuantizeScaled`]): whole
/// 128 x 128 tiles of a contiguous, 16-byte aligned input only.
pub(crate) fn block_quantize_scaled(
    k: &BlockQuantizeScaled,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Outputs> {
    const OP: &str = BlockQuantizeScaled::NAME;
    let [(q, lq), (s, ls)] = inputs else {
        return Err(arity(OP));
    };
    fp8_of(OP, k.qtype)?;
    let (rows, cols) = dims2(OP, lq.shape())?;
    let unsupported = |what: String| Error::Unsupported { op: OP, what };
    if q.dtype() != DType::F16 || ls.shape().elem_count() != 1 {
        return Err(unsupported(format!(
            "{:?} codes with {} scales (an FP16 tensor with one scale)",
            q.dtype(),
            ls.shape().elem_count()
        )));
    }
    let round = match k.dtype {
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        d => return Err(unsupported(format!("a {d:?} value (BF16 or F32)"))),
    };
    let (down, across) = (rows / 128, cols / 128);
    if rows % 128 != 0 || cols % 128 != 0 || rows == 0 || cols == 0 || down > 65_535 {
        return Err(unsupported(format!(
            "a [{rows}, {cols}] input (whole 128 x 128 tiles)"
        )));
    }
    let too_big = || unsupported(format!("a [{rows}, {cols}] input (indices beyond i32)"));
    let (r32, c32) = (
        i32::try_from(rows).map_err(|_| too_big())?,
        i32::try_from(cols).map_err(|_| too_big())?,
    );
    let dev = q.device().clone();
    let qv = view::<f16>(OP, q, lq)?;
    if !aligned(&qv, &dev) {
        return Err(unsupported("codes not 16-byte aligned".into()));
    }
    let sv = view::<f32>(OP, s, ls)?;
    let (ld, ld_t) = (across.div_ceil(4) * 4, down.div_ceil(4) * 4);
    let (ld32, ldt32) = (
        i32::try_from(ld).map_err(|_| too_big())?,
        i32::try_from(ld_t).map_err(|_| too_big())?,
    );
    let n = rows * cols;
    if k.tiling == Tiling::Row {
        return scaled_rows(k, (&qv, &sv), (rows, cols), &dev);
    }
    if k.tiling != Tiling::Blk128 {
        return Err(unsupported(format!("{} tiles (128x128 or rows)", k.tiling)));
    }
    // SAFETY: the kernel writes every code and every scale of what it makes.
    let alloc_u8 = || -> Result<_> { Ok(unsafe { dev.alloc::<u8>(n)? }) };
    let alloc_f32 = |len: usize| -> Result<_> { Ok(unsafe { dev.alloc::<f32>(len)? }) };
    let mut codes = if k.rowwise { Some(alloc_u8()?) } else { None };
    let mut scales = if k.rowwise {
        Some(alloc_f32(down * ld)?)
    } else {
        None
    };
    let mut codes_t = if k.transposed {
        Some(alloc_u8()?)
    } else {
        None
    };
    let mut scales_t = if k.transposed {
        Some(alloc_f32(across * ld_t)?)
    } else {
        None
    };
    let f = block_func(
        &dev,
        &format!("block_quantize_scaled_blocks_{}_{round}", fmt_name(k.qtype)),
    )?;
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(across).map_err(|_| too_big())?,
            down as u32,
            1,
        ),
        // PAIR_THREADS in block.cu
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    let (rule, max, margin, null) = (rule_code(k.rule), k.qtype.max(), 0u32, 0u64);
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&qv).arg(&sv).arg(&r32).arg(&c32);
    match (&mut codes, &mut scales) {
        (Some(c), Some(s)) => b.arg(c).arg(s),
        _ => b.arg(&null).arg(&null),
    };
    b.arg(&ld32);
    match (&mut codes_t, &mut scales_t) {
        (Some(c), Some(s)) => b.arg(c).arg(s),
        _ => b.arg(&null).arg(&null),
    };
    b.arg(&ldt32).arg(&rule).arg(&margin).arg(&max);
    // SAFETY: arguments match the kernel's parameters (block.cu).
    unsafe { b.launch(cfg) }.w()?;
    Ok(made(
        &dev,
        [
            (codes, scales, (rows, cols), (down, ld)),
            (codes_t, scales_t, (cols, rows), (across, ld_t)),
        ],
    ))
}

/// A cast's codes and scales if made, with their shapes.
type Made = (
    Option<CudaSlice<u8>>,
    Option<CudaSlice<f32>>,
    (usize, usize),
    (usize, usize),
);

/// A cast's codes and scales as outputs, each pair that was made with the
/// shapes of its codes and scales, in order.
fn made(dev: &CudaDevice, parts: [Made; 2]) -> Outputs {
    let mut out = Vec::new();
    for (codes, scales, cs, ss) in parts {
        if let (Some(c), Some(s)) = (codes, scales) {
            out.push((
                CudaStorage::wrap_cuda_slice(c, dev.clone()),
                Shape::from(cs),
            ));
            out.push((
                CudaStorage::wrap_cuda_slice(s, dev.clone()),
                Shape::from(ss),
            ));
        }
    }
    out
}

type Scaled<'a> = (
    &'a candle_core::cuda_backend::cudarc::driver::CudaView<'a, f16>,
    &'a candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>,
);

/// The rowwise pair of a scaled FP16 `[rows, cols]` (whole 128 x 128
/// tiles, aligned; checked by the caller): every row's and column's amax
/// from the codes, then the `_fast_rows` pair (block.cu, "SCALED_ROWS").
fn scaled_rows(
    k: &BlockQuantizeScaled,
    (qv, sv): Scaled<'_>,
    (rows, cols): (usize, usize),
    dev: &CudaDevice,
) -> Result<Outputs> {
    const OP: &str = BlockQuantizeScaled::NAME;
    if k.rule != ScaleRule::PowerOfTwo {
        return Err(Error::Unsupported {
            op: OP,
            what: "rows with a rule other than the power of two".into(),
        });
    }
    let round = if k.dtype == DType::BF16 {
        "bf16"
    } else {
        "f32"
    };
    let (r32, c32) = (rows as i32, cols as i32);
    let n = rows * cols;
    let mut row_amax = dev.alloc_zeros::<u32>(rows)?;
    let mut col_amax = dev.alloc_zeros::<u32>(cols)?;
    // SAFETY: the pair kernel writes every code and scale it is given.
    let mut codes = if k.rowwise {
        Some(unsafe { dev.alloc::<u8>(n)? })
    } else {
        None
    };
    let mut scales = if k.rowwise {
        Some(unsafe { dev.alloc::<f32>(rows)? })
    } else {
        None
    };
    let mut codes_t = if k.transposed {
        Some(unsafe { dev.alloc::<u8>(n)? })
    } else {
        None
    };
    let mut scales_t = if k.transposed {
        Some(unsafe { dev.alloc::<f32>(cols)? })
    } else {
        None
    };
    let cfg = LaunchConfig {
        grid_dim: ((cols / 128) as u32, (rows / 128) as u32, 1),
        // PAIR_THREADS in block.cu
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let fa = block_func(dev, &format!("block_rowcol_amax_scaled_{round}"))?;
    let mut b = stream.launch_builder(&fa);
    b.arg(qv)
        .arg(sv)
        .arg(&r32)
        .arg(&c32)
        .arg(&mut row_amax)
        .arg(&mut col_amax);
    // SAFETY: arguments match the kernel's parameters (block.cu).
    unsafe { b.launch(cfg) }.w()?;
    let f = block_func(
        dev,
        &format!("block_quantize_pair_scaled_{round}_{}", fmt_name(k.qtype)),
    )?;
    let (null, max) = (0u64, k.qtype.max());
    let mut b = stream.launch_builder(&f);
    b.arg(qv).arg(sv).arg(&r32).arg(&c32);
    match (&mut codes, &mut scales) {
        (Some(c), Some(s)) => b.arg(c).arg(s),
        _ => b.arg(&null).arg(&null),
    };
    match (&mut codes_t, &mut scales_t) {
        (Some(c), Some(s)) => b.arg(c).arg(s),
        _ => b.arg(&null).arg(&null),
    };
    b.arg(&row_amax).arg(&col_amax).arg(&max);
    // SAFETY: arguments match the kernel's parameters (block.cu).
    unsafe { b.launch(cfg) }.w()?;
    Ok(made(
        dev,
        [
            (codes, scales, (rows, cols), (rows, 1)),
            (codes_t, scales_t, (cols, rows), (cols, 1)),
        ],
    ))
}
