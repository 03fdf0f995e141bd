//! Launches of the fused training ops (`kernels/nn.cu`): causal softmax,
//! cross-entropy, LayerNorm and GELU, forward and backward. Inputs are
//! contiguous F32 or BF16 rows (the callers in `nn::fused` make them so);
//! nothing here reads anything back to the host.

use super::nn_func;
use crate::error::{Error, Result};
pub(super) use crate::nn::fused::cpu::chunking;
use crate::numerics::cuda::launch::{aligned, grid, view, THREADS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Layout};

/// Rows per block of the warp-per-row kernels.
const ROWS_PER_BLOCK: usize = THREADS as usize / 32;
/// Threads of the block-per-row cross-entropy kernels (`CE_THREADS`).
const CE_THREADS: u32 = 256;

/// A float storage as a typed view, to `$body` with `$t` the element type.
macro_rules! with_float {
    ($op:expr, $s:expr, |$t:ident| $body:expr) => {
        match $s.dtype() {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            got => Err(Error::DType {
                op: $op,
                expected: "F32 or BF16",
                got,
            }),
        }
    };
}
pub(super) use with_float;

pub(super) fn suffix(d: DType) -> &'static str {
    if d == DType::BF16 {
        "bf16"
    } else {
        "f32"
    }
}

/// Whether rows of `cols` elements of `T` and every base allow 16-byte loads.
pub(super) fn vec_ok<T>(cols: usize, views: &[&CudaView<'_, T>], dev: &CudaDevice) -> i32 {
    let pack = 16 / std::mem::size_of::<T>();
    i32::from(cols % pack == 0 && views.iter().all(|v| aligned(v, dev)))
}

fn warp_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ROWS_PER_BLOCK).max(1) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn block_rows(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.max(1) as u32, 1, 1),
        block_dim: (CE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn cols_i32(op: &'static str, cols: usize) -> Result<i32> {
    i32::try_from(cols).map_err(|_| Error::Unsupported {
        op,
        what: format!("rows of {cols} elements"),
    })
}

/// The row geometry of `lx`: `(cols, rows, elements, cols as i32)` (the
/// last dimension is a row).
pub(super) fn row_geometry(op: &'static str, lx: &Layout) -> Result<(usize, usize, usize, i32)> {
    let cols = lx.dims().last().copied().unwrap_or(1);
    let n = lx.shape().elem_count();
    Ok((cols, n / cols.max(1), n, cols_i32(op, cols)?))
}

pub(super) fn store<T: CudaDType + DeviceRepr>(
    s: candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    dev: &CudaDevice,
) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(s, dev.clone())
}

/// `softmax(scale * s)` over the last dim with the causal mask (row `r` is
/// query `r % cols`), or its backward `scale * p * (dp - sum(p dp))`.
pub(crate) fn causal_softmax(
    s: &CudaStorage,
    ls: &Layout,
    dp: Option<(&CudaStorage, &Layout)>,
    scale: f32,
) -> Result<CudaStorage> {
    const OP: &str = "causal_softmax";
    let dev = s.device().clone();
    let cols = ls.dims().last().copied().unwrap_or(1);
    let n = ls.shape().elem_count();
    let rows = n / cols.max(1);
    let c = cols_i32(OP, cols)?;
    let stream = dev.cuda_stream();
    with_float!(OP, s, |T| {
        let sv = view::<T>(OP, s, ls)?;
        // SAFETY: the kernel writes every element of every row.
        let mut out = unsafe { dev.alloc::<T>(n)? };
        match dp {
            None => {
                let vec = vec_ok(cols, &[&sv], &dev);
                let f = nn_func(&dev, &format!("causal_softmax_fwd_{}", suffix(s.dtype())))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&sv)
                    .arg(&mut out)
                    .arg(&rows)
                    .arg(&c)
                    .arg(&scale)
                    .arg(&vec);
                unsafe { b.launch(warp_rows(rows)) }.w()?;
            }
            Some((g, lg)) => {
                let gv = view::<T>(OP, g, lg)?;
                let vec = vec_ok(cols, &[&sv, &gv], &dev);
                let f = nn_func(&dev, &format!("causal_softmax_bwd_{}", suffix(s.dtype())))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&sv).arg(&gv).arg(&mut out).arg(&rows).arg(&c);
                b.arg(&scale).arg(&vec);
                unsafe { b.launch(warp_rows(rows)) }.w()?;
            }
        }
        Ok(store(out, &dev))
    })
}

/// Per row `[lse - x[t], lse]` (F32 `[rows, 2]`).
pub(crate) fn cross_entropy_fwd(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy";
    let dev = x.device().clone();
    let (cols, rows, _, c) = row_geometry(OP, lx)?;
    let tv = view::<u32>(OP, t, lt)?;
    let stream = dev.cuda_stream();
    let mut out = unsafe { dev.alloc::<f32>(2 * rows)? };
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        let vec = vec_ok(cols, &[&xv], &dev);
        let f = nn_func(&dev, &format!("cross_entropy_fwd_{}", suffix(x.dtype())))?;
        let mut b = stream.launch_builder(&f);
        b.arg(&xv).arg(&tv).arg(&mut out).arg(&c).arg(&vec);
        unsafe { b.launch(block_rows(rows)) }.w()?;
        Ok::<_, Error>(())
    })?;
    Ok(store(out, &dev))
}

/// `g * (softmax(x) - onehot(t))` per row, `gl` holding `[g, lse]` per row.
pub(crate) fn cross_entropy_bwd(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
    gl: &CudaStorage,
    lg: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "cross_entropy_bwd";
    let dev = x.device().clone();
    let (cols, rows, _, c) = row_geometry(OP, lx)?;
    let tv = view::<u32>(OP, t, lt)?;
    let gv = view::<f32>(OP, gl, lg)?;
    let stream = dev.cuda_stream();
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<T>(rows * cols)? };
        let vec = vec_ok(cols, &[&xv], &dev);
        let f = nn_func(&dev, &format!("cross_entropy_bwd_{}", suffix(x.dtype())))?;
        let mut b = stream.launch_builder(&f);
        b.arg(&xv).arg(&tv).arg(&gv).arg(&mut out).arg(&c).arg(&vec);
        unsafe { b.launch(block_rows(rows)) }.w()?;
        Ok(store(out, &dev))
    })
}

/// [`cross_entropy_fwd`] and then [`cross_entropy_bwd`] with `g = 1` in
/// one launch: the pairs `[rows, 2]` and the logits' gradient.
pub(crate) fn cross_entropy_fwd_bwd(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "cross_entropy_fwd_bwd";
    let dev = x.device().clone();
    let (cols, rows, _, c) = row_geometry(OP, lx)?;
    let tv = view::<u32>(OP, t, lt)?;
    let stream = dev.cuda_stream();
    // SAFETY: thread 0 of each row's block writes both of its values.
    let mut pairs = unsafe { dev.alloc::<f32>(2 * rows)? };
    let dx = with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<T>(rows * cols)? };
        let vec = vec_ok(cols, &[&xv], &dev);
        let f = nn_func(
            &dev,
            &format!("cross_entropy_fwd_bwd_{}", suffix(x.dtype())),
        )?;
        let mut b = stream.launch_builder(&f);
        b.arg(&xv)
            .arg(&tv)
            .arg(&mut pairs)
            .arg(&mut out)
            .arg(&c)
            .arg(&vec);
        unsafe { b.launch(block_rows(rows)) }.w()?;
        Ok(store(out, &dev))
    })?;
    Ok((store(pairs, &dev), dx))
}

/// Packs a lane at most in the register-held LayerNorm kernels
/// (`layer_norm_*_r{P}`): rows of up to 32 x 8 packs (2,048 BF16 or 1,024
/// F32 columns) take them, wider ones the kernels that read the row again.
const NORM_MAX_PACKS: usize = 8;

/// The register-held kernels' `P` for rows of `cols` elements of `T` on the
/// 16-byte path: the smallest of 1, 2, 4, 8 packs a lane that covers a row.
fn norm_packs<T>(cols: usize) -> Option<usize> {
    let per_round = 32 * (16 / std::mem::size_of::<T>());
    let p = cols.div_ceil(per_round).max(1).next_power_of_two();
    (p <= NORM_MAX_PACKS).then_some(p)
}

/// LayerNorm forward, `(x - mean) * rstd * w + third` per row, or with
/// `dx` its input gradient for `third` = dy, plus `res` (x's shape and
/// dtype: a residual's gradient) where given; `rms`: RMSNorm (the mean
/// taken as 0). With `dx`, `stats` (2 F32 a row, where given) receives
/// each row's mean and rstd as [`layer_norm_dwdb`] computes them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm(
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (third, l3): (&CudaStorage, &Layout),
    eps: f32,
    dx: bool,
    rms: bool,
    res: Option<(&CudaStorage, &Layout)>,
    stats: Option<&mut CudaSlice<f32>>,
) -> Result<CudaStorage> {
    const OP: &str = "layer_norm";
    let rms = i32::from(rms);
    let dev = x.device().clone();
    let (cols, rows, n, c) = row_geometry(OP, lx)?;
    let wv = view::<f32>(OP, w, lw)?;
    let stream = dev.cuda_stream();
    if let Some(s) = &stats {
        if s.len() < 2 * rows {
            return Err(Error::LengthMismatch {
                op: OP,
                src: 2 * rows,
                dst: s.len(),
            });
        }
    }
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<T>(n)? };
        let sfx = suffix(x.dtype());
        if dx {
            let gv = view::<T>(OP, third, l3)?;
            let rv = match res {
                Some((r, lr)) if lr.shape() == lx.shape() => Some(view::<T>(OP, r, lr)?),
                Some((_, lr)) => {
                    return Err(Error::Shape {
                        op: OP,
                        lhs: lx.shape().clone(),
                        rhs: lr.shape().clone(),
                    })
                }
                None => None,
            };
            let mut views = vec![&xv, &gv];
            views.extend(rv.as_ref());
            let vec = vec_ok(cols, &views, &dev);
            // null pointers where there is no residual gradient or no
            // statistics to keep
            let (rp, _guard) = match &rv {
                Some(r) => {
                    let (p, g) = r.device_ptr(&stream);
                    (p, Some(g))
                }
                None => (0, None),
            };
            let (sp, _sguard) = match stats {
                Some(s) => {
                    let (p, g) = s.device_ptr_mut(&stream);
                    (p, Some(g))
                }
                None => (0, None),
            };
            let reg = norm_packs::<T>(cols).filter(|_| vec == 1 && aligned(&wv, &dev));
            let f = match reg {
                Some(p) => nn_func(&dev, &format!("layer_norm_dx_r{p}_{sfx}"))?,
                None => nn_func(&dev, &format!("layer_norm_dx_{sfx}"))?,
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&wv).arg(&gv).arg(&rp).arg(&mut out).arg(&sp);
            b.arg(&rows).arg(&c).arg(&eps);
            if reg.is_none() {
                b.arg(&vec);
            }
            b.arg(&rms);
            unsafe { b.launch(warp_rows(rows)) }.w()?;
        } else {
            let bv = view::<f32>(OP, third, l3)?;
            let vec = vec_ok(cols, &[&xv], &dev);
            let reg = norm_packs::<T>(cols)
                .filter(|_| vec == 1 && aligned(&wv, &dev) && aligned(&bv, &dev));
            let f = match reg {
                Some(p) => nn_func(&dev, &format!("layer_norm_fwd_r{p}_{sfx}"))?,
                None => nn_func(&dev, &format!("layer_norm_fwd_{sfx}"))?,
            };
            let mut b = stream.launch_builder(&f);
            b.arg(&xv)
                .arg(&wv)
                .arg(&bv)
                .arg(&mut out)
                .arg(&rows)
                .arg(&c)
                .arg(&eps);
            if reg.is_none() {
                b.arg(&vec);
            }
            b.arg(&rms);
            unsafe { b.launch(warp_rows(rows)) }.w()?;
        }
        Ok(store(out, &dev))
    })
}

/// LayerNorm forward of `(x, w, b)` (as [`layer_norm`]) and `max |y|` of
/// its stored outputs (1-element F32, bits as the amax kernel takes them):
/// one pass where the rows take the register-held kernel, else the
/// forward, then the amax kernel.
pub(crate) fn layer_norm_amax(
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
    eps: f32,
    rms: bool,
) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "layer_norm_amax";
    let dev = x.device().clone();
    let (cols, rows, n, c) = row_geometry(OP, lx)?;
    let wv = view::<f32>(OP, w, lw)?;
    let bv = view::<f32>(OP, b, lb)?;
    let stream = dev.cuda_stream();
    let reg = with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        let vec = vec_ok(cols, &[&xv], &dev);
        Ok::<_, Error>(
            norm_packs::<T>(cols).filter(|_| vec == 1 && aligned(&wv, &dev) && aligned(&bv, &dev)),
        )
    })?;
    let Some(p) = reg else {
        let y = layer_norm((x, lx), (w, lw), (b, lb), eps, false, rms, None, None)?;
        let layout = Layout::contiguous(lx.shape().clone());
        let mut out = crate::numerics::cuda::amax(&[(&y, &layout)])?;
        let (amax, _) = out.pop().ok_or(Error::Unsupported {
            op: OP,
            what: "an amax output".into(),
        })?;
        return Ok((y, amax));
    };
    let rms = i32::from(rms);
    let mut amax = dev.alloc_zeros::<f32>(1)?;
    let y = with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<T>(n)? };
        let f = nn_func(
            &dev,
            &format!("layer_norm_fwd_amax_r{p}_{}", suffix(x.dtype())),
        )?;
        let mut bld = stream.launch_builder(&f);
        bld.arg(&xv)
            .arg(&wv)
            .arg(&bv)
            .arg(&mut out)
            .arg(&rows)
            .arg(&c)
            .arg(&eps)
            .arg(&rms)
            .arg(&mut amax);
        unsafe { bld.launch(warp_rows(rows)) }.w()?;
        Ok::<_, Error>(store(out, &dev))
    })?;
    Ok((y, store(amax, &dev)))
}

/// Room for the row statistics (mean, rstd) of `rows` rows, which the
/// input gradient's kernel fills for [`layer_norm_dwdb`].
pub(crate) fn row_stats_buffer(dev: &CudaDevice, rows: usize) -> Result<CudaSlice<f32>> {
    // SAFETY: the kernel that takes it writes every row's pair before a
    // reader runs (the same stream).
    Ok(unsafe { dev.alloc::<f32>(2 * rows.max(1))? })
}

/// LayerNorm weight and bias gradients, F32 `[2, cols]` (`dw`, then `db`):
/// row statistics (`stats` where the input gradient's kernel already
/// wrote them, else a pass of their own), per-chunk partial sums, then the
/// chunks summed in order.
pub(crate) fn layer_norm_dwdb(
    x: &CudaStorage,
    lx: &Layout,
    dy: &CudaStorage,
    ldy: &Layout,
    eps: f32,
    rms: bool,
    stats: Option<CudaSlice<f32>>,
) -> Result<CudaStorage> {
    const OP: &str = "layer_norm_bwd";
    let rms = i32::from(rms);
    let dev = x.device().clone();
    let (cols, rows, _, c) = row_geometry(OP, lx)?;
    let (chunks, per_chunk) = chunking(rows);
    let chunks_i = chunks as i32;
    let stream = dev.cuda_stream();
    let given = stats.filter(|s| s.len() >= 2 * rows);
    let fresh = given.is_none();
    let mut stats = match given {
        Some(s) => s,
        None => row_stats_buffer(&dev, rows)?,
    };
    // SAFETY: every element of each is written by the kernel that fills it.
    let mut part = unsafe { dev.alloc::<f32>(2 * chunks * cols)? };
    let mut out = unsafe { dev.alloc::<f32>(2 * cols)? };
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        let gv = view::<T>(OP, dy, ldy)?;
        let vec = vec_ok(cols, &[&xv], &dev);
        let sfx = suffix(x.dtype());
        if fresh {
            let f = nn_func(&dev, &format!("layer_norm_stats_{sfx}"))?;
            let mut b = stream.launch_builder(&f);
            b.arg(&xv)
                .arg(&mut stats)
                .arg(&rows)
                .arg(&c)
                .arg(&eps)
                .arg(&vec)
                .arg(&rms);
            unsafe { b.launch(warp_rows(rows)) }.w()?;
        }
        // 8 columns a thread where rows are whole 16-byte words of both
        let wide = cols % 8 == 0 && vec_ok(8, &[&xv, &gv], &dev) == 1;
        let name = if wide {
            "layer_norm_dwdb_part_v"
        } else {
            "layer_norm_dwdb_part"
        };
        let f = nn_func(&dev, &format!("{name}_{sfx}"))?;
        let mut b = stream.launch_builder(&f);
        b.arg(&xv)
            .arg(&gv)
            .arg(&stats)
            .arg(&mut part)
            .arg(&rows)
            .arg(&c);
        b.arg(&per_chunk);
        let cfg = chunk_cfg(if wide { cols / 8 } else { cols }, chunks);
        unsafe { b.launch(cfg) }.w()?;
        Ok::<_, Error>(())
    })?;
    sum_chunks(&dev, "layer_norm_dwdb_sum", &part, &mut out, c, chunks_i)?;
    Ok(store(out, &dev))
}

/// The partial-sum kernels' grid: 32 columns by one row chunk per block of
/// (32, 8) threads.
pub(super) fn chunk_cfg(cols: usize, chunks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(32) as u32, chunks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    }
}

/// The chunks' partials summed in order by `kernel` into `out`.
pub(super) fn sum_chunks(
    dev: &CudaDevice,
    kernel: &str,
    part: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    cols: i32,
    chunks: i32,
) -> Result<()> {
    let f = nn_func(dev, kernel)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(part).arg(out).arg(&cols).arg(&chunks);
    unsafe { b.launch(grid(dev, cols as usize)?) }.w()?;
    Ok(())
}

/// GELU (tanh form) of `x`, or with `dy` its backward `dy * gelu'(x)`.
pub(crate) fn gelu(
    x: &CudaStorage,
    lx: &Layout,
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    const OP: &str = "gelu";
    let dev = x.device().clone();
    let n = lx.shape().elem_count();
    let stream = dev.cuda_stream();
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        let pack = 16 / std::mem::size_of::<T>();
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<T>(n)? };
        match dy {
            None => {
                let vec = vec_ok(pack, &[&xv], &dev);
                let f = nn_func(&dev, &format!("gelu_fwd_{}", suffix(x.dtype())))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&xv).arg(&mut out).arg(&n).arg(&vec);
                unsafe { b.launch(grid(&dev, n.div_ceil(pack))?) }.w()?;
            }
            Some((g, lg)) => {
                let gv = view::<T>(OP, g, lg)?;
                let vec = vec_ok(pack, &[&xv, &gv], &dev);
                let f = nn_func(&dev, &format!("gelu_bwd_{}", suffix(x.dtype())))?;
                let mut b = stream.launch_builder(&f);
                b.arg(&xv).arg(&gv).arg(&mut out).arg(&n).arg(&vec);
                unsafe { b.launch(grid(&dev, n.div_ceil(pack))?) }.w()?;
            }
        }
        Ok(store(out, &dev))
    })
}

/// GELU of `x` and, from the same pass, `max |y|` of the stored outputs
/// (F32 `[1]`, as the `amax` kernel takes it).
pub(crate) fn gelu_amax(x: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, CudaStorage)> {
    const OP: &str = "gelu";
    let dev = x.device().clone();
    let n = lx.shape().elem_count();
    let stream = dev.cuda_stream();
    let mut amax = dev.alloc_zeros::<f32>(1)?;
    let y = with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        let pack = 16 / std::mem::size_of::<T>();
        // SAFETY: every element is written.
        let mut out = unsafe { dev.alloc::<T>(n)? };
        let vec = vec_ok(pack, &[&xv], &dev);
        let f = nn_func(&dev, &format!("gelu_fwd_amax_{}", suffix(x.dtype())))?;
        let mut b = stream.launch_builder(&f);
        b.arg(&xv).arg(&mut out).arg(&n).arg(&vec).arg(&mut amax);
        // SAFETY: n elements in and out, one amax (F32 bits as u32).
        unsafe { b.launch(grid(&dev, n.div_ceil(pack))?) }.w()?;
        Ok(store(out, &dev))
    })?;
    Ok((y, store(amax, &dev)))
}

/// SwiGLU of rows `[rows, 2 f]` to `[rows, f]`, or with `dy` (`[rows, f]`)
/// its gradient `[rows, 2 f]`.
pub(crate) fn swiglu(
    x: &CudaStorage,
    lx: &Layout,
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<CudaStorage> {
    const OP: &str = "swiglu";
    let dev = x.device().clone();
    let n = lx.shape().elem_count();
    let f = lx.dims().last().copied().unwrap_or(0) / 2;
    let rows = n / (2 * f).max(1);
    let stream = dev.cuda_stream();
    with_float!(OP, x, |T| {
        let xv = view::<T>(OP, x, lx)?;
        let sfx = suffix(x.dtype());
        // 16-byte packs of a half-row (the gate's and the up's columns
        // both start at a multiple of the pack when F is one); outputs are
        // fresh allocations, aligned
        let pack = 16 / std::mem::size_of::<T>();
        match dy {
            None => {
                let vec = vec_ok(f, &[&xv], &dev);
                let cfg = grid(&dev, ((rows * f) / if vec == 1 { pack } else { 1 }).max(1))?;
                // SAFETY: every element is written.
                let mut out = unsafe { dev.alloc::<T>(rows * f)? };
                let k = nn_func(&dev, &format!("swiglu_fwd_{sfx}"))?;
                let mut b = stream.launch_builder(&k);
                b.arg(&xv).arg(&mut out).arg(&rows).arg(&f).arg(&vec);
                unsafe { b.launch(cfg) }.w()?;
                Ok(store(out, &dev))
            }
            Some((g, lg)) => {
                let gv = view::<T>(OP, g, lg)?;
                let vec = vec_ok(f, &[&xv, &gv], &dev);
                let cfg = grid(&dev, ((rows * f) / if vec == 1 { pack } else { 1 }).max(1))?;
                // SAFETY: every element is written.
                let mut out = unsafe { dev.alloc::<T>(n)? };
                let k = nn_func(&dev, &format!("swiglu_bwd_{sfx}"))?;
                let mut b = stream.launch_builder(&k);
                b.arg(&xv)
                    .arg(&gv)
                    .arg(&mut out)
                    .arg(&rows)
                    .arg(&f)
                    .arg(&vec);
                unsafe { b.launch(cfg) }.w()?;
                Ok(store(out, &dev))
            }
        }
    })
}
