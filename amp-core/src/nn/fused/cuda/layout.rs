//! Launches of the row and layout kernels (`kernels/nn.cu`): the bias add
//! and its column sums, the 2-D transpose of FP8 or FP16 operands, and
//! the attention's rows-to-heads and heads-to-rows moves with their BF16
//! conversion.

use super::nn_func;
use super::ops::{chunk_cfg, chunking, cols_i32, store, suffix, sum_chunks, vec_ok, with_float};
use crate::error::{Error, Result};
use crate::numerics::cuda::launch::{aligned, grid, view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{DType, Layout};

/// `x + b` with `b` (F32) broadcast over the rows of `x`.
pub(crate) fn bias_add(
    x: &CudaStorage,
    lx: &Layout,
    bias: &CudaStorage,
    lb: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "bias_add";
    let dev = x.device().clone();
    let cols = lx.dims().last().copied().unwrap_or(1).max(1);
    let n = lx.shape().elem_count();
    let c = cols_i32(OP, cols)?;
    let bv = view::<f32>(OP, bias, lb)?;
    let stream = dev.cuda_stream();
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        let pack = 16 / std::mem::size_of::<T>();
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<T>(n)? };
        let vec = vec_ok(cols, &[&xv], &dev);
        let f = nn_func(&dev, &format!("bias_add_{}", suffix(x.dtype())))?;
        let mut b = stream.launch_builder(&f);
        b.arg(&xv).arg(&bv).arg(&mut out).arg(&n).arg(&c).arg(&vec);
        unsafe { b.launch(grid(&dev, n.div_ceil(pack))?) }.w()?;
        Ok(store(out, &dev))
    })
}

/// The sums over the rows of `x`, F32 `[cols]`, in a fixed order.
pub(crate) fn col_sum(x: &CudaStorage, lx: &Layout) -> Result<CudaStorage> {
    col_sums(x, lx, false)
}

/// [`col_sum`] and, read in the same pass, `max |x|` (as the `amax`
/// kernel takes it): F32 `[cols + 1]`, the sums then the amax.
pub(crate) fn col_sum_amax(x: &CudaStorage, lx: &Layout) -> Result<CudaStorage> {
    col_sums(x, lx, true)
}

fn col_sums(x: &CudaStorage, lx: &Layout, amax: bool) -> Result<CudaStorage> {
    const OP: &str = "col_sum";
    let dev = x.device().clone();
    let cols = lx.dims().last().copied().unwrap_or(1).max(1);
    let rows = lx.shape().elem_count() / cols;
    let c = cols_i32(OP, cols)?;
    let (chunks, per_chunk) = chunking(rows);
    let chunks_i = chunks as i32;
    let stream = dev.cuda_stream();
    // SAFETY: every element of each is written by the kernel that fills it
    // (the amax's, after `cols`, starts at 0: the kernel takes maxima).
    let mut part = unsafe { dev.alloc::<f32>(chunks * cols)? };
    let mut out = match amax {
        true => dev.alloc_zeros::<f32>(cols + 1)?,
        false => unsafe { dev.alloc::<f32>(cols)? },
    };
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        // 8 columns a thread where rows are whole 16-byte words
        let wide = cols % 8 == 0 && vec_ok(8, &[&xv], &dev) == 1;
        let name = match (amax, wide) {
            (false, false) => "col_sum_part",
            (false, true) => "col_sum_part_v",
            (true, false) => "col_sum_amax_part",
            (true, true) => "col_sum_amax_part_v",
        };
        let f = nn_func(&dev, &format!("{name}_{}", suffix(x.dtype())))?;
        let cfg = chunk_cfg(if wide { cols / 8 } else { cols }, chunks);
        if amax {
            let mut at = out.slice_mut(cols..cols + 1);
            let mut b = stream.launch_builder(&f);
            b.arg(&xv)
                .arg(&mut part)
                .arg(&rows)
                .arg(&c)
                .arg(&per_chunk)
                .arg(&mut at);
            // SAFETY: rows x cols in, chunks x cols partials and the one
            // amax (F32 bits as u32) out.
            unsafe { b.launch(cfg) }.w()?;
        } else {
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&mut part).arg(&rows).arg(&c).arg(&per_chunk);
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok::<_, Error>(())
    })?;
    sum_chunks(&dev, "col_sum_final", &part, &mut out, c, chunks_i)?;
    Ok(store(out, &dev))
}

/// `dx = dy * gelu'(x)` and [`col_sum_amax`] of `dx` in one pass over
/// `x` and `dy` (same shape and dtype): `(dx, [cols + 1])`, each with the
/// bits of `gelu` backward then `col_sum_amax`. `None` where the rows are
/// not whole 16-byte words (the separate kernels then).
pub(crate) fn gelu_bwd_col_sum_amax(
    x: &CudaStorage,
    lx: &Layout,
    dy: &CudaStorage,
    ldy: &Layout,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    const OP: &str = "gelu_bwd_col_sum_amax";
    if x.dtype() != dy.dtype() || lx.shape() != ldy.shape() {
        return Err(Error::Shape {
            op: OP,
            lhs: lx.shape().clone(),
            rhs: ldy.shape().clone(),
        });
    }
    let dev = x.device().clone();
    let cols = lx.dims().last().copied().unwrap_or(1).max(1);
    let n = lx.shape().elem_count();
    let rows = n / cols;
    let c = cols_i32(OP, cols)?;
    let (chunks, per_chunk) = chunking(rows);
    let stream = dev.cuda_stream();
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        let gv = view::<T>(OP, dy, ldy)?;
        if cols % 8 != 0 || vec_ok(8, &[&xv, &gv], &dev) != 1 || n == 0 {
            return Ok(None);
        }
        // SAFETY: every element of dx and of the partials is written; the
        // amax (after `cols`) starts at 0: the kernel takes maxima.
        let mut dx = unsafe { dev.alloc::<T>(n)? };
        let mut part = unsafe { dev.alloc::<f32>(chunks * cols)? };
        let mut out = dev.alloc_zeros::<f32>(cols + 1)?;
        let f = nn_func(
            &dev,
            &format!("gelu_bwd_col_sum_amax_part_v_{}", suffix(x.dtype())),
        )?;
        {
            let mut at = out.slice_mut(cols..cols + 1);
            let mut b = stream.launch_builder(&f);
            b.arg(&xv)
                .arg(&gv)
                .arg(&mut dx)
                .arg(&mut part)
                .arg(&rows)
                .arg(&c)
                .arg(&per_chunk)
                .arg(&mut at);
            // SAFETY: rows x cols of x and dy in (16-byte words), of dx
            // out (a fresh allocation: 16-byte aligned); chunks x cols
            // partials and the one amax out.
            unsafe { b.launch(chunk_cfg(cols / 8, chunks)) }.w()?;
        }
        sum_chunks(&dev, "col_sum_final", &part, &mut out, c, chunks as i32)?;
        Ok(Some((store(dx, &dev), store(out, &dev))))
    })
}

/// An attention layout: rows `[b, t, s, h, d]` (`s` parts side by side)
/// and heads `[b, h, t, d]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub b: usize,
    pub t: usize,
    pub s: usize,
    pub h: usize,
    pub d: usize,
}

impl Heads {
    fn args(&self, op: &'static str) -> Result<[i32; 5]> {
        Ok([
            cols_i32(op, self.b)?,
            cols_i32(op, self.t)?,
            cols_i32(op, self.s)?,
            cols_i32(op, self.h)?,
            cols_i32(op, self.d)?,
        ])
    }

    fn per_part(&self) -> usize {
        self.b * self.h * self.t * self.d
    }
}

/// Part `which` of the rows `src` as BF16 heads.
pub(crate) fn rows_to_heads(
    src: &CudaStorage,
    l: &Layout,
    hl: Heads,
    which: usize,
) -> Result<CudaStorage> {
    const OP: &str = "rows_to_heads";
    let dev = src.device().clone();
    let a = hl.args(OP)?;
    let w = cols_i32(OP, which)?;
    let n = hl.per_part();
    let stream = dev.cuda_stream();
    with_float!(OP, src, |T| {
        let sv = view::<T>(OP, src, l)?;
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<half::bf16>(n)? };
        let vec = i32::from(hl.d % 8 == 0 && aligned(&sv, &dev));
        let f = nn_func(&dev, &format!("rows_to_heads_{}", suffix(src.dtype())))?;
        let mut b = stream.launch_builder(&f);
        b.arg(&sv).arg(&mut out);
        for v in &a {
            b.arg(v);
        }
        b.arg(&w).arg(&vec);
        unsafe { b.launch(grid(&dev, if vec != 0 { n / 8 } else { n })?) }.w()?;
        Ok(store(out, &dev))
    })
}

/// BF16 heads, one per part, into rows of `dtype` (F32 or BF16).
pub(crate) fn heads_to_rows(
    parts: &[(&CudaStorage, &Layout)],
    hl: Heads,
    dtype: DType,
) -> Result<CudaStorage> {
    const OP: &str = "heads_to_rows";
    let Some((first, _)) = parts.first() else {
        return Err(Error::Unsupported {
            op: OP,
            what: "no parts".into(),
        });
    };
    let dev = first.device().clone();
    let a = hl.args(OP)?;
    let n = hl.per_part();
    let stream = dev.cuda_stream();
    macro_rules! go {
        ($t:ty) => {{
            // SAFETY: the parts together write every element.
            let mut out = unsafe { dev.alloc::<$t>(n * parts.len())? };
            for (which, (p, lp)) in parts.iter().enumerate() {
                let pv = view::<half::bf16>(OP, p, lp)?;
                let vec = i32::from(hl.d % 8 == 0 && aligned(&pv, &dev));
                let f = nn_func(&dev, &format!("heads_to_rows_{}", suffix(dtype)))?;
                let w = cols_i32(OP, which)?;
                let mut b = stream.launch_builder(&f);
                b.arg(&pv).arg(&mut out);
                for v in &a {
                    b.arg(v);
                }
                b.arg(&w).arg(&vec);
                unsafe { b.launch(grid(&dev, if vec != 0 { n / 8 } else { n })?) }.w()?;
            }
            Ok(store(out, &dev))
        }};
    }
    match dtype {
        DType::F32 => go!(f32),
        DType::BF16 => go!(half::bf16),
        got => Err(Error::DType {
            op: OP,
            expected: "F32 or BF16",
            got,
        }),
    }
}
