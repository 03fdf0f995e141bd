//! CUDA body of the gradient sum of squares ([`SumSq`]), from
//! `kernels/lowbit.cu`: per 2048-element block 8 f32 lanes, the lanes in
//! f64 in order, groups of 256 blocks in order, the groups in order (the
//! CPU body's order, so the same bits); two launches (the groups' sums
//! added by the last group's block; one launch for a tensor of one CUDA
//! block of element blocks), no host read.

use crate::cuda::{address, bad, func, kind, scalar_address, Outputs, THREADS};
use crate::fused::SumSq;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Shape};

/// `SUMSQ_BLOCK` in lowbit.cu: the CPU body's block length.
const SUMSQ_BLOCK: usize = 2048;
/// `SUMSQ_GROUP`: blocks' sums per group (the CPU body's `SUMSQ_GROUP`).
const SUMSQ_GROUP: usize = 256;
/// `SUMSQ_CHUNKS`: element blocks per CUDA block of `sumsq_partials`.
const SUMSQ_CHUNKS: usize = 4;
/// Threads of a `sumsq_partials` block: one warp (8 lanes per element block).
const PARTIALS_THREADS: u32 = 32;

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
    let groups = chunks.div_ceil(SUMSQ_GROUP);
    let stream = dev.cuda_stream();
    // The last launch writes the total; with no elements there is none,
    // and the total is a zero fill.
    let mut total = if chunks == 0 {
        dev.alloc_zeros::<f64>(1)?
    } else {
        // SAFETY: written by the last of the launches below (chunks > 0).
        unsafe { dev.alloc::<f64>(1)? }
    };
    let blocks = |b: usize| LaunchConfig {
        grid_dim: (b as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let warps = |b: usize| LaunchConfig {
        block_dim: (PARTIALS_THREADS, 1, 1),
        ..blocks(b)
    };
    // One element block: its partial is the group's sum and the total
    // (several in one CUDA block: that block adds them); one group: its sum
    // is the total (0.0 + s is s for the s here, sums of
    // squares: +0 or more, or NaN). So a small tensor takes one launch,
    // not two, with the same bits.
    // SAFETY (both): sumsq_partials writes one partial per element block
    // (the lane-0 thread of each), sumsq_groups one sum per group; neither
    // is read before it is written.
    // A tensor of one CUDA block of sumsq_partials (at most SUMSQ_CHUNKS
    // element blocks) has its total written by that block, as
    // sumsq_groups would add it.
    let mut partials = (chunks > SUMSQ_CHUNKS)
        .then(|| unsafe { dev.alloc::<f64>(chunks) })
        .transpose()?;
    let mut group_sums = (groups > 1)
        .then(|| unsafe { dev.alloc::<f64>(groups) })
        .transpose()?;
    // SAFETY: zeroed by sumsq_partials before sumsq_groups counts in it.
    let mut counter = (groups > 1)
        .then(|| unsafe { dev.alloc::<u32>(1) })
        .transpose()?;
    let null = 0u64;
    if chunks > 0 {
        let f = func(&dev, &format!("sumsq_partials_{kd}"))?;
        let mut b = stream.launch_builder(&f);
        let vec = i32::from(gp % 16 == 0);
        b.arg(&gp).arg(&sp).arg(&n).arg(&vec);
        match partials.as_mut() {
            Some(p) => b.arg(p),
            None => b.arg(&mut total),
        };
        match counter.as_mut() {
            Some(c) => b.arg(c),
            None => b.arg(&null),
        };
        // SAFETY: gp addresses n elements of kind kd (16-byte words only
        // where it is 16-byte aligned, and only words wholly before n);
        // partials holds one f64 per block of SUMSQ_BLOCK elements; each
        // CUDA block covers SUMSQ_CHUNKS of them and reads no element at or
        // past n.
        unsafe { b.launch(warps(chunks.div_ceil(SUMSQ_CHUNKS))) }.w()?;
    }
    if let Some(partials) = &partials {
        let f = func(&dev, "sumsq_groups")?;
        let mut b = stream.launch_builder(&f);
        b.arg(partials).arg(&chunks);
        match (group_sums.as_mut(), counter.as_mut()) {
            // the last block to finish adds the groups' sums into total
            (Some(g), Some(c)) => b.arg(g).arg(&mut total).arg(c),
            // one group: its sum is the total
            _ => b.arg(&mut total).arg(&null).arg(&null),
        };
        // SAFETY: partials holds `chunks` f64, group_sums one per group,
        // total one, counter one u32 zeroed by the launch before.
        unsafe { b.launch(blocks(groups)) }.w()?;
    }
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(total, dev),
        Shape::from(1usize),
    )])
}
