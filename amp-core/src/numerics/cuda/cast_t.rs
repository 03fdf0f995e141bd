//! Launch of the cast-transpose kernels (`kernels/cast_t.cu`): x [rows,
//! cols] to FP8 codes row-major and transposed in one pass, with amax and
//! the saturated and flushed counts.

use super::launch::{aligned, cast_t_func, scalar, view, Current, THREADS};
use crate::error::{Error, Result};
use crate::numerics::kernel::arity;
use crate::numerics::qtype::QType;
use crate::numerics::scale::FromAmax;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout, Shape};
use half::{bf16, f16};

/// The kernels' tile edge (`TT` in cast_t.cu).
const TILE: usize = 64;

/// Whether the kernel takes a `[rows, cols]` input: its grid has one block
/// per tile, at most 65535 tile rows, and the kernel indexes with `int`.
pub(crate) fn fits(rows: usize, cols: usize) -> bool {
    // a tile's first row and column (`int` in the kernel) stay in range
    let max = i32::MAX as usize - TILE;
    rows.div_ceil(TILE) <= 65_535 && rows <= max && cols <= max
}

/// The kernels' name of an FP8 target; FP16 is refused (the transposed
/// casts write FP8 codes only).
pub(crate) fn fp8_name(op: &'static str, qtype: QType) -> Result<&'static str> {
    match qtype {
        QType::E4M3 => Ok("e4m3"),
        QType::E5M2 => Ok("e5m2"),
        QType::F16 => Err(Error::Unsupported {
            op,
            what: "a transposed FP16 cast (FP8 targets only)".into(),
        }),
    }
}

/// `[codes, codes_t, amax, counts]` of inputs `[x (2-D), scale]`; with
/// `from_amax`, `[codes, codes_t, counts, scale, scale_inv]` of `[x, amax]`;
/// without `counted` no counts.
/// `scaled`: x is an FP16 scaling tensor's data and a third input its
/// scale_inv; the kernel casts the dequantized values.
///
/// # Errors
/// [`Error::Unsupported`] for a non-FP8 target, a shape [`fits`] refuses
/// or a non-contiguous input; [`Error::DType`]; the driver's.
pub(crate) fn quantize_t(
    qtype: QType,
    from_amax: Option<FromAmax>,
    scaled: bool,
    counted: bool,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "quantize_t";
    let ((x, lx), (s, ls), pre) = match inputs {
        [x, s] if !scaled => (x, s, None),
        [x, s, (p, lp)] if scaled => (x, s, Some(scalar(OP, p, lp)?)),
        _ => return Err(arity(OP)),
    };
    if scaled && x.dtype() != DType::F16 {
        return Err(Error::DType {
            op: OP,
            expected: "F16 codes",
            got: x.dtype(),
        });
    }
    let (rows, cols) = lx.shape().dims2()?;
    let fmt = fp8_name(OP, qtype)?;
    if !fits(rows, cols) {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("a [{rows}, {cols}] input (at most 65535 x 64 rows)"),
        });
    }
    let scale = scalar(OP, s, ls)?;
    let dev = x.device();
    let cur = Current::new(dev, qtype, from_amax)?;
    let go = |name: &str| format!("quantize_t_{name}_{fmt}");
    let pre = pre.as_ref();
    match x.dtype() {
        DType::F32 => launch(
            dev,
            &go("f32"),
            pre,
            view::<f32>(OP, x, lx)?,
            &scale,
            cur,
            rows,
            cols,
            counted,
        ),
        DType::BF16 => launch(
            dev,
            &go("bf16"),
            pre,
            view::<bf16>(OP, x, lx)?,
            &scale,
            cur,
            rows,
            cols,
            counted,
        ),
        DType::F16 => launch(
            dev,
            &go(if scaled { "f16s" } else { "f16" }),
            pre,
            view::<f16>(OP, x, lx)?,
            &scale,
            cur,
            rows,
            cols,
            counted,
        ),
        got => Err(Error::DType {
            op: OP,
            expected: "F32, F16 or BF16",
            got,
        }),
    }
}

#[allow(clippy::too_many_arguments)]
fn launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    name: &str,
    pre: Option<&CudaView<'_, f32>>,
    xv: CudaView<'_, T>,
    scale: &CudaView<'_, f32>,
    mut cur: Option<Current>,
    rows: usize,
    cols: usize,
    counted: bool,
) -> Result<Vec<(CudaStorage, Shape)>> {
    let n = rows * cols;
    // SAFETY (both): the kernel writes every element of both.
    let mut out: CudaSlice<u8> = unsafe { dev.alloc::<u8>(n)? };
    let mut out_t: CudaSlice<u8> = unsafe { dev.alloc::<u8>(n)? };
    // with the amax as input the kernel need not fold it again (null)
    let mut amax = match cur {
        Some(_) => None,
        None => Some(dev.alloc_zeros::<f32>(1)?),
    };
    let null = 0u64;
    let mut counts = counted.then(|| dev.alloc_zeros::<i64>(2)).transpose()?;
    let vec = cols % 8 == 0
        && rows % 16 == 0
        && aligned(&xv, dev)
        && aligned(&out.slice(..), dev)
        && aligned(&out_t.slice(..), dev);
    let (r, c, v) = (rows as i32, cols as i32, i32::from(vec));
    // at least one block, also for an empty input: it writes the scale
    // (current scaling) where there is nothing to cast
    let cfg = LaunchConfig {
        grid_dim: (
            cols.div_ceil(TILE).max(1) as u32,
            rows.div_ceil(TILE).max(1) as u32,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    {
        let f = cast_t_func(dev, name)?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&xv);
        match pre {
            Some(p) => b.arg(p),
            None => b.arg(&null),
        };
        Current::push_scale(&cur, &mut b, scale);
        b.arg(&mut out).arg(&mut out_t);
        b.arg(&r).arg(&c).arg(&v);
        match &mut amax {
            Some(a) => b.arg(a),
            None => b.arg(&null),
        };
        match &mut counts {
            Some(c) => b.arg(c),
            None => b.arg(&null),
        };
        Current::push_tail(&mut cur, &mut b, scale);
        unsafe { b.launch(cfg) }.w()?;
    }
    let wrap = |s, shape: Shape| (CudaStorage::wrap_cuda_slice(s, dev.clone()), shape);
    let mut outputs = vec![
        wrap(out, Shape::from((rows, cols))),
        wrap(out_t, Shape::from((cols, rows))),
    ];
    outputs.extend(amax.map(|a| {
        (
            CudaStorage::wrap_cuda_slice(a, dev.clone()),
            Shape::from(1usize),
        )
    }));
    outputs.extend(counts.map(|c| {
        (
            CudaStorage::wrap_cuda_slice(c, dev.clone()),
            Shape::from(2usize),
        )
    }));
    outputs.extend(Current::outputs(cur, dev));
    Ok(outputs)
}
