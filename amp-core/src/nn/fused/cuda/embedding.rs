//! Launches of the embedding kernels (`kernels/nn.cu`): the row gather and
//! its deterministic backward (each table element's sum in one thread, in
//! token order, as candle's `index_add` adds; no atomics).

use super::nn_func;
use super::ops::store;
use crate::error::{Error, Result};
use crate::numerics::cuda::launch::{grid, view, THREADS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{DType, Layout};

/// Row partitions of the backward (a power of two): blocks per column tile,
/// each scanning every id and adding the rows of its partition.
const PARTS: u32 = 64;

fn f32_only(op: &'static str, s: &CudaStorage) -> Result<()> {
    match s.dtype() {
        DType::F32 => Ok(()),
        got => Err(Error::DType {
            op,
            expected: "F32",
            got,
        }),
    }
}

/// `table[ids[i], :]` for every id, `[ids, cols]` (NaN rows for ids past the
/// table).
pub(crate) fn embedding_fwd(
    ids: &CudaStorage,
    li: &Layout,
    table: &CudaStorage,
    lt: &Layout,
) -> Result<CudaStorage> {
    const OP: &str = "embedding";
    f32_only(OP, table)?;
    let dev = table.device().clone();
    let (rows, cols) = lt.shape().dims2()?;
    let n = li.shape().elem_count();
    let iv = view::<u32>(OP, ids, li)?;
    let tv = view::<f32>(OP, table, lt)?;
    // SAFETY: every element is written.
    let mut out = unsafe { dev.alloc::<f32>(n * cols)? };
    if n * cols > 0 {
        let f = nn_func(&dev, "embedding_fwd_f32")?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&iv)
            .arg(&tv)
            .arg(&mut out)
            .arg(&n)
            .arg(&rows)
            .arg(&cols);
        unsafe { b.launch(grid(&dev, n * cols)?) }.w()?;
    }
    Ok(store(out, &dev))
}

/// The table's gradient `[rows, cols]` from the output's `g` `[ids, cols]`,
/// each row of `g` times `scale`.
pub(crate) fn embedding_bwd(
    ids: &CudaStorage,
    li: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    rows: usize,
    scale: f32,
) -> Result<CudaStorage> {
    const OP: &str = "embedding_bwd";
    f32_only(OP, g)?;
    let dev = g.device().clone();
    let n = li.shape().elem_count();
    let cols = lg.dims().last().copied().unwrap_or(0);
    let iv = view::<u32>(OP, ids, li)?;
    let gv = view::<f32>(OP, g, lg)?;
    let mut dt = dev.alloc_zeros::<f32>(rows * cols)?;
    if n > 0 && rows > 0 && cols > 0 {
        let cfg = LaunchConfig {
            grid_dim: (cols.div_ceil(THREADS as usize) as u32, PARTS, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mask = PARTS - 1;
        let f = nn_func(&dev, "embedding_bwd_f32")?;
        let stream = dev.cuda_stream();
        let mut b = stream.launch_builder(&f);
        b.arg(&iv)
            .arg(&gv)
            .arg(&mut dt)
            .arg(&n)
            .arg(&rows)
            .arg(&cols)
            .arg(&mask)
            .arg(&scale);
        // SAFETY: ids and g hold n ids and n rows of `cols`; dt `rows` rows.
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(store(dt, &dev))
}
