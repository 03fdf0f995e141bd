//! Launches of the block-scaled casts (`kernels/block.cu`): codes and
//! per-tile scales of a 2-D input, and their dequantize.

use super::launch::{aligned, block_func, grid, view};
use crate::error::{Error, Result};
use crate::numerics::block::{
    check_scales, dims2, fp8_of, BlockDequantize, BlockQuantize, BlockQuantizePair, Tiling,
};
use crate::numerics::kernel::{arity, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::scale::ScaleRule;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Shape};
use half::{bf16, f16};

type Outputs = Vec<(CudaStorage, Shape)>;

pub(super) fn fmt_name(q: QType) -> &'static str {
    if q == QType::E5M2 {
        "e5m2"
    } else {
        "e4m3"
    }
}

/// The kernels' code of a scale rule (`compute_scale` in codec.cuh).
pub(super) fn rule_code(rule: ScaleRule) -> i32 {
    match rule {
        ScaleRule::Te => 0,
        ScaleRule::PowerOfTwo => 1,
    }
}

/// The kernel-name spelling of an input dtype (F32, BF16, F16).
fn input_name(op: &'static str, d: DType) -> Result<&'static str> {
    match d {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        got => Err(Error::DType {
            op,
            expected: "F32, F16 or BF16",
            got,
        }),
    }
}

/// A device buffer of `n` ones (the scales of tiles no kernel visits: a
/// tensor with no columns); at least one element (the driver refuses
/// empty allocations; the shape says how many count).
fn ones(dev: &CudaDevice, n: usize) -> Result<CudaStorage> {
    let s = dev
        .cuda_stream()
        .clone_htod(vec![1f32; n.max(1)].as_slice())
        .w()?;
    Ok(CudaStorage::wrap_cuda_slice(s, dev.clone()))
}

/// `[codes, scale_inv]` of `[x]`.
pub(crate) fn block_quantize(
    k: &BlockQuantize,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Outputs> {
    const OP: &str = BlockQuantize::NAME;
    let [(x, lx)] = inputs else {
        return Err(arity(OP));
    };
    let fmt = fmt_name(k.qtype);
    fp8_of(OP, k.qtype)?;
    let (rows, cols) = dims2(OP, lx.shape())?;
    if matches!(k.tiling, Tiling::Vec128 | Tiling::Row) {
        // the tile kernel's rowwise half: 16-byte loads, one read (two for rows)
        let pair = BlockQuantizePair {
            qtype: k.qtype,
            tiling: k.tiling,
            rule: k.rule,
            margin: k.margin,
            rowwise: true,
            transposed: false,
        };
        return block_quantize_pair(&pair, inputs);
    }
    let sd = k.tiling.scale_dims(rows, cols);
    let dev = x.device().clone();
    let codes_shape = Shape::from((rows, cols));
    if rows == 0 || cols == 0 {
        let codes = dev.alloc_zeros::<u8>(1)?;
        return Ok(vec![
            (
                CudaStorage::wrap_cuda_slice(codes, dev.clone()),
                codes_shape,
            ),
            (ones(&dev, sd.0 * sd.1)?, Shape::from(sd)),
        ]);
    }
    let too_big = || Error::Unsupported {
        op: OP,
        what: format!("a [{rows}, {cols}] input (indices beyond i32)"),
    };
    let (r32, c32) = (
        i32::try_from(rows).map_err(|_| too_big())?,
        i32::try_from(cols).map_err(|_| too_big())?,
    );
    let rule = rule_code(k.rule);
    let max = k.qtype.max();
    let tname = input_name(OP, x.dtype())?;
    // SAFETY: the kernels write every code and every scale of a non-empty input.
    let mut codes = unsafe { dev.alloc::<u8>(rows * cols)? };
    let mut scale_inv = unsafe { dev.alloc::<f32>(sd.0 * sd.1)? };
    let stream = dev.cuda_stream();
    // 128 x 128 blocks (1 x 128 and rows went to the pair kernel above)
    if sd.0 > 65_535 {
        return Err(too_big());
    }
    let across = k.tiling.tiles(rows, cols).1;
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(across).map_err(|_| too_big())?,
            sd.0 as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let f = block_func(&dev, &format!("block_quantize_blocks_{tname}_{fmt}"))?;
    let ld = i32::try_from(sd.1).map_err(|_| too_big())?;
    macro_rules! go {
        ($t:ty) => {{
            let xv = view::<$t>(OP, x, lx)?;
            let per_load = 16 / std::mem::size_of::<$t>();
            let vec = i32::from(aligned(&xv, &dev) && cols % per_load == 0);
            let mut b = stream.launch_builder(&f);
            b.arg(&xv)
                .arg(&mut codes)
                .arg(&mut scale_inv)
                .arg(&r32)
                .arg(&c32)
                .arg(&ld)
                .arg(&rule)
                .arg(&k.margin)
                .arg(&max)
                .arg(&vec);
            // SAFETY: arguments match the kernel's parameters (block.cu).
            unsafe { b.launch(cfg) }.w()?;
        }};
    }
    match x.dtype() {
        DType::F32 => go!(f32),
        DType::BF16 => go!(bf16),
        _ => go!(f16),
    }
    Ok(vec![
        (
            CudaStorage::wrap_cuda_slice(codes, dev.clone()),
            codes_shape,
        ),
        (
            CudaStorage::wrap_cuda_slice(scale_inv, dev.clone()),
            Shape::from(sd),
        ),
    ])
}

/// `[y]` of `[codes, scale_inv]`.
pub(crate) fn block_dequantize(
    k: &BlockDequantize,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Outputs> {
    const OP: &str = BlockDequantize::NAME;
    let [(q, lq), (s, ls)] = inputs else {
        return Err(arity(OP));
    };
    fp8_of(OP, k.qtype)?;
    let (rows, cols) = dims2(OP, lq.shape())?;
    check_scales(OP, k.tiling, rows, cols, ls.shape())?;
    if q.dtype() != DType::U8 {
        return Err(Error::DType {
            op: OP,
            expected: "U8",
            got: q.dtype(),
        });
    }
    let dev = q.device().clone();
    let n = rows * cols;
    let (th, tw) = k.tiling.tile(cols);
    let (s_down, s_across) = k.tiling.scale_strides(rows, cols);
    let oname = match k.dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        got => {
            return Err(Error::DType {
                op: OP,
                expected: "F32, F16 or BF16",
                got,
            })
        }
    };
    let f = block_func(
        &dev,
        &format!("block_dequantize_{}_{oname}", fmt_name(k.qtype)),
    )?;
    let qv = view::<u8>(OP, q, lq)?;
    let sv = view::<f32>(OP, s, ls)?;
    let stream = dev.cuda_stream();
    let cfg = grid(&dev, n)?;
    macro_rules! go {
        ($t:ty) => {{
            // SAFETY: the kernel writes every element.
            let mut out = unsafe { dev.alloc::<$t>(n.max(1))? };
            if n > 0 {
                let mut b = stream.launch_builder(&f);
                b.arg(&qv)
                    .arg(&sv)
                    .arg(&mut out)
                    .arg(&rows)
                    .arg(&cols)
                    .arg(&th)
                    .arg(&tw)
                    .arg(&s_down)
                    .arg(&s_across);
                // SAFETY: arguments match the kernel's parameters (block.cu).
                unsafe { b.launch(cfg) }.w()?;
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        }};
    }
    let out = match k.dtype {
        DType::F32 => go!(f32),
        DType::BF16 => go!(bf16),
        _ => go!(f16),
    };
    Ok(vec![(out, lq.shape().clone())])
}

/// The requested `[codes, scale_inv]`, `[codes_t, scale_inv_t]` of `[x]`
/// (see [`BlockQuantizePair`]).
pub(crate) fn block_quantize_pair(
    k: &BlockQuantizePair,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Outputs> {
    const OP: &str = BlockQuantizePair::NAME;
    let [(x, lx)] = inputs else {
        return Err(arity(OP));
    };
    fp8_of(OP, k.qtype)?;
    k.check()?;
    let (rows, cols) = dims2(OP, lx.shape())?;
    let dev = x.device().clone();
    let sd = k.tiling.scale_dims(rows, cols);
    let sd_t = k.tiling.scale_dims(cols, rows);
    let too_big = || Error::Unsupported {
        op: OP,
        what: format!("a [{rows}, {cols}] input (indices beyond i32, or 65535 x 128 rows)"),
    };
    let (r32, c32) = (
        i32::try_from(rows).map_err(|_| too_big())?,
        i32::try_from(cols).map_err(|_| too_big())?,
    );
    let (down, across) = (rows.div_ceil(128), cols.div_ceil(128));
    if down > 65_535 {
        return Err(too_big());
    }
    let n = rows * cols;
    // SAFETY: the kernel writes every code and scale of a non-empty input;
    // an empty one gets its (empty, or all-1) scales below.
    let alloc = |len: usize| -> Result<_> { Ok(unsafe { dev.alloc::<u8>(len.max(1))? }) };
    let mut codes = if k.rowwise { Some(alloc(n)?) } else { None };
    let mut codes_t = if k.transposed { Some(alloc(n)?) } else { None };
    let mut scales = if k.rowwise {
        Some(unsafe { dev.alloc::<f32>((sd.0 * sd.1).max(1))? })
    } else {
        None
    };
    let mut scales_t = if k.transposed {
        Some(unsafe { dev.alloc::<f32>((sd_t.0 * sd_t.1).max(1))? })
    } else {
        None
    };
    if n > 0 {
        let tname = input_name(OP, x.dtype())?;
        // without xᵀ, the kernel with no shared memory (more blocks an SM)
        let kind = if k.transposed { "pair" } else { "rows" };
        // the `_fast` kernels: whole 128 x 128 tiles, 16-byte loads and
        // stores, power-of-two scales; `_fast_rows` for rows (block.cu)
        let fast_shape = rows % 128 == 0 && cols % 128 == 0 && k.rule == ScaleRule::PowerOfTwo;
        let fast_kind = match k.tiling {
            Tiling::Vec128 => "_fast",
            Tiling::Row => "_fast_rows",
            Tiling::Blk128 => "",
        };
        let func = |vec: i32| {
            let fast = if fast_shape && vec == 1 {
                fast_kind
            } else {
                ""
            };
            block_func(
                &dev,
                &format!("block_quantize_{kind}{fast}_{tname}_{}", fmt_name(k.qtype)),
            )
        };
        let rule = rule_code(k.rule);
        let max = k.qtype.max();
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
        let stream = dev.cuda_stream();
        let null = 0u64;
        // 16-byte stores of xᵀ's rows
        let vec_t = i32::from(rows % 16 == 0);
        // rows: every row's and column's amax first (bits, atomic max)
        let mut amaxes = if k.tiling == Tiling::Row {
            Some((dev.alloc_zeros::<u32>(rows)?, dev.alloc_zeros::<u32>(cols)?))
        } else {
            None
        };
        let fa = match &amaxes {
            Some(_) => Some(block_func(&dev, &format!("block_rowcol_amax_{tname}"))?),
            None => None,
        };
        macro_rules! go {
            ($t:ty) => {{
                let xv = view::<$t>(OP, x, lx)?;
                let per_load = 16 / std::mem::size_of::<$t>();
                let vec = i32::from(aligned(&xv, &dev) && cols % per_load == 0);
                if let (Some(fa), Some((ra, ca))) = (&fa, &mut amaxes) {
                    let mut b = stream.launch_builder(fa);
                    b.arg(&xv).arg(&r32).arg(&c32).arg(ra).arg(ca).arg(&vec);
                    // SAFETY: arguments match the kernel's parameters (block.cu).
                    unsafe { b.launch(cfg) }.w()?;
                }
                let f = func(vec)?;
                let mut b = stream.launch_builder(&f);
                b.arg(&xv).arg(&r32).arg(&c32);
                match (&mut codes, &mut scales) {
                    (Some(c), Some(s)) => b.arg(c).arg(s),
                    _ => b.arg(&null).arg(&null),
                };
                match (&mut codes_t, &mut scales_t) {
                    (Some(c), Some(s)) => b.arg(c).arg(s),
                    _ => b.arg(&null).arg(&null),
                };
                match &amaxes {
                    Some((ra, ca)) => b.arg(ra).arg(ca),
                    None => b.arg(&null).arg(&null),
                };
                b.arg(&rule).arg(&k.margin).arg(&max).arg(&vec).arg(&vec_t);
                // SAFETY: arguments match the kernel's parameters (block.cu).
                unsafe { b.launch(cfg) }.w()?;
            }};
        }
        match x.dtype() {
            DType::F32 => go!(f32),
            DType::BF16 => go!(bf16),
            _ => go!(f16),
        }
    }
    let wrap = |c| CudaStorage::wrap_cuda_slice(c, dev.clone());
    let mut out = Vec::new();
    // an empty input's scales: 1 (rows with no columns still have theirs)
    let fill = |s: Option<_>, len: usize| -> Result<CudaStorage> {
        if n == 0 {
            ones(&dev, len)
        } else {
            s.map(|s| CudaStorage::wrap_cuda_slice(s, dev.clone()))
                .ok_or_else(|| arity(OP))
        }
    };
    if k.rowwise {
        let c = codes.ok_or_else(|| arity(OP))?;
        out.push((wrap(c), Shape::from((rows, cols))));
        out.push((fill(scales, sd.0 * sd.1)?, Shape::from(sd)));
    }
    if k.transposed {
        let c = codes_t.ok_or_else(|| arity(OP))?;
        out.push((wrap(c), Shape::from((cols, rows))));
        out.push((fill(scales_t, sd_t.0 * sd_t.1)?, Shape::from(sd_t)));
    }
    Ok(out)
}
