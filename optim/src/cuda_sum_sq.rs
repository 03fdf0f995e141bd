//! CUDA body of the gradient sum of squares ([`SumSq`]), from
//! `kernels/lowbit.cu`: per 2048-element block 8 f32 lanes, the lanes in
//! f64 in order, groups of 256 blocks in order, the groups in order (the
//! CPU body's order, so the same bits); two launches (the groups' sums
//! added by the last group's block; one launch for a tensor of one CUDA
//! block of element blocks), no host read.

use crate::cuda::{address, bad, func, kind, pairs_device, scalar_address, Outputs, THREADS};
use crate::fused::{SumSq, SumSqMany};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
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

/// `ManyDesc` of sumsq_many.cuh.
#[repr(C)]
#[derive(Clone, Copy)]
struct ManyDesc {
    g: u64,
    si: u64,
    n: u64,
    vec: i32,
    _pad: i32,
    partials: u64,
    groups: u64,
    total: u64,
    counter: u64,
    block0: u64,
    group0: u64,
}
// SAFETY: plain old data laid out as the C struct.
unsafe impl DeviceRepr for ManyDesc {}

/// [`SumSqMany`]: every gradient's sums of squares in two launches, each
/// gradient's CUDA blocks those of its own [`sum_sq`] (so its bits): one
/// scratch buffer holds every gradient's partials, group sums and counter.
pub(crate) fn sum_sq_many(
    k: &SumSqMany,
    inputs: &[(&CudaStorage, &Layout)],
) -> amp_core::Result<Outputs> {
    const OP: &str = "grad_sum_sq_many";
    let (dev, count) = pairs_device(OP, inputs)?;
    let stream = dev.cuda_stream();
    let (kd, dtype) = kind(k.g);
    // Per gradient: (chunks, CUDA blocks of partials, groups with a launch
    // of their own); the scratch: partials, then group sums (f64), then
    // counters (u32, two to an f64 slot).
    let mut plan = Vec::with_capacity(count);
    let (mut n_partials, mut n_groups, mut n_counters) = (0usize, 0usize, 0usize);
    let (mut blocks, mut group_blocks) = (0u64, 0u64);
    for pair in inputs.chunks(2) {
        let [(_, lg), _] = pair else {
            return Err(bad(OP, "inputs come in (gradient, scale_inv) pairs"));
        };
        let n = lg.shape().elem_count();
        if n == 0 {
            return Err(bad(OP, "gradients of at least one element"));
        }
        let chunks = n.div_ceil(SUMSQ_BLOCK);
        let cuda_blocks = chunks.div_ceil(SUMSQ_CHUNKS);
        let groups = if cuda_blocks > 1 {
            chunks.div_ceil(SUMSQ_GROUP)
        } else {
            0
        };
        plan.push((n, chunks, cuda_blocks, groups, blocks, group_blocks));
        if cuda_blocks > 1 {
            n_partials += chunks;
        }
        if groups > 1 {
            n_groups += groups;
            n_counters += 1;
        }
        blocks += cuda_blocks as u64;
        group_blocks += groups as u64;
    }
    // SAFETY: every total is written by the last launch that covers its
    // gradient (one CUDA block of partials, or its groups' last block).
    let mut out = unsafe { dev.alloc::<f64>(count)? };
    let out_base = out.device_ptr_mut(&stream).0;
    // SAFETY: each partial, group sum and counter is written (a counter
    // zeroed by its gradient's first block of partials) before it is read.
    let mut scratch =
        unsafe { dev.alloc::<f64>((n_partials + n_groups + n_counters.div_ceil(2)).max(1))? };
    let base = scratch.device_ptr_mut(&stream).0;
    let (mut p_at, mut g_at, mut c_at) = (0u64, 0u64, 0u64);
    let counters = base + 8 * (n_partials + n_groups) as u64;
    let mut descs = Vec::with_capacity(count);
    for (i, (pair, &(n, chunks, cuda_blocks, groups, block0, group0))) in
        inputs.chunks(2).zip(&plan).enumerate()
    {
        let [(g, lg), (gs, lgs)] = pair else {
            return Err(bad(OP, "inputs come in (gradient, scale_inv) pairs"));
        };
        let gp = address(OP, g, lg, dtype, &dev)?;
        let total = out_base + 8 * i as u64;
        let partials = if cuda_blocks > 1 {
            let p = base + 8 * p_at;
            p_at += chunks as u64;
            p
        } else {
            total
        };
        let (group_sums, counter) = if groups > 1 {
            let gsum = base + 8 * (n_partials as u64 + g_at);
            g_at += groups as u64;
            let c = counters + 4 * c_at;
            c_at += 1;
            (gsum, c)
        } else {
            (total, 0)
        };
        descs.push(ManyDesc {
            g: gp,
            si: scalar_address(OP, gs, lgs, &dev)?,
            n: n as u64,
            vec: i32::from(gp % 16 == 0),
            _pad: 0,
            partials,
            groups: group_sums,
            total,
            counter,
            block0,
            group0,
        });
    }
    let d = stream.clone_htod(&descs).w()?;
    let count_arg = count as i32;
    let f = func(&dev, &format!("sumsq_partials_many_{kd}"))?;
    let mut b = stream.launch_builder(&f);
    b.arg(&d).arg(&count_arg).arg(&blocks);
    let cfg = |grid: u64, threads: u32| LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: each descriptor addresses a live gradient of n elements of
    // kind kd (16-byte words only where aligned), its scale_inv, and its
    // own partials (or total), group sums and counter; `blocks` CUDA
    // blocks in all, each gradient's as its own launch's.
    unsafe { b.launch(cfg(blocks, PARTIALS_THREADS)) }.w()?;
    if group_blocks > 0 {
        let f = func(&dev, "sumsq_groups_many")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&d).arg(&count_arg).arg(&group_blocks);
        // SAFETY: as above; the partials were written by the launch before.
        unsafe { b.launch(cfg(group_blocks, THREADS)) }.w()?;
    }
    drop(scratch);
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from(count),
    )])
}
