//! Launches of the embedding kernels (`kernels/nn.cu`): the row gather and
//! its deterministic backward (each table element's sum in one thread, in
//! token order, as candle's `index_add` adds; no atomics): the ids sorted
//! by row in one block, then a block per row's run of tokens and column
//! tile; past [`SORT_MAX`] ids, every block scans every id.

use super::nn_func;
use super::ops::store;
use crate::error::{Error, Result};
use crate::numerics::cuda::launch::{grid, view, THREADS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{DType, Layout};

/// Row partitions of the backward without the sort (a power of two):
/// blocks per column tile, each scanning every id and adding the rows of
/// its partition.
const PARTS: u32 = 64;
/// `EMB_SORT_MAX`: most ids the backward sorts (in one block's shared
/// memory); more take the scanning kernel.
const SORT_MAX: usize = 16384;
/// `EMB_SORT_THREADS`: the sorting block's threads.
const SORT_THREADS: u32 = 1024;

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
    if n == 0 || rows == 0 || cols == 0 {
        return Ok(store(dt, &dev));
    }
    let stream = dev.cuda_stream();
    let log = n.next_power_of_two().trailing_zeros();
    if n <= SORT_MAX && ((rows as u64 + 1) << log) <= 1u64 << 32 {
        // through a sort (kernels/nn_embedding.cuh): the keys
        // (row << log) | token fit 32 bits
        let rows32 = rows as u32;
        // SAFETY: embedding_sort writes all n keys.
        let mut sorted = unsafe { dev.alloc::<u32>(n)? };
        let sort = nn_func(&dev, "embedding_sort")?;
        // 64 KiB at most
        let smem = 4usize << log;
        super::allow_shared_memory(&sort, smem)?;
        let mut b = stream.launch_builder(&sort);
        b.arg(&iv).arg(&n).arg(&rows32).arg(&log).arg(&mut sorted);
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (SORT_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: ids holds n ids; sorted n keys; the block's shared
        // memory holds 2^log keys.
        unsafe { b.launch(one) }.w()?;
        let sums = nn_func(&dev, "embedding_bwd_sorted_f32")?;
        let mut b = stream.launch_builder(&sums);
        b.arg(&sorted)
            .arg(&gv)
            .arg(&mut dt)
            .arg(&n)
            .arg(&cols)
            .arg(&rows32)
            .arg(&log)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, cols.div_ceil(THREADS as usize) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: sorted holds n keys whose tokens are below n (g's rows)
        // and whose rows below `rows` are dt's; g holds n rows of `cols`.
        unsafe { b.launch(cfg) }.w()?;
        return Ok(store(dt, &dev));
    }
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(THREADS as usize) as u32, PARTS, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mask = PARTS - 1;
    let f = nn_func(&dev, "embedding_bwd_f32")?;
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
    Ok(store(dt, &dev))
}
