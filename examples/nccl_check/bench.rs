//! `--bench`: the all-reduce of 256 MiB of F32 gradients, F32 path vs FP8
//! path, time and bytes on the wire; and the same bytes as the layers hand
//! them over, FP8 (E5M2) weight gradients of 1024 x 4096, reduced in
//! buckets as the levels do (`fp8_all_reduce_bucket`, `--bucket-mb`).

use crate::Args;
use amp::comm::{
    fp8_all_reduce, fp8_all_reduce_bucket, shard_range, Communicator, Fp8ReduceConfig, NcclComm,
};
use amp::{CurrentScaling, QType, ScalingTensor};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

/// Median seconds of `iters` calls of `f`, with the device synchronised
/// around each (after 3 warm-ups).
fn time(device: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    device.synchronize()?;
    let mut t = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        f()?;
        device.synchronize()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

pub fn bench(comm: &NcclComm, args: &Args) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let len = args.mib * (1 << 20) / 4;
    let dev = comm.device();
    // Freed blocks stay pooled, as in the GPT example (and PyTorch's caching
    // allocator): without it every timed call maps its outputs anew.
    amp::keep_freed_memory(dev)?;
    let g = Tensor::randn(0f32, 1e-2, len, dev)?;
    let line = |path: &str, secs: f64, bytes: u64| {
        let gb = len as f64 * 4.0 / 1e9;
        println!(
            "[rank {rank}/{n}] BENCH {path}: {:.3} ms median of {}, {bytes} bytes sent by this rank ({:.1} MiB), {:.1} GB/s of gradient",
            secs * 1e3,
            args.iters,
            bytes as f64 / (1 << 20) as f64,
            gb / secs
        );
    };
    comm.barrier()?;
    let f32_s = time(dev, args.iters, || {
        comm.all_reduce_sum(&g)?;
        Ok(())
    })?;
    comm.reset_bytes_sent();
    comm.all_reduce_sum(&g)?;
    let f32_bytes = comm.bytes_sent();
    line(
        &format!("f32 all_reduce {} MiB", args.mib),
        f32_s,
        f32_bytes,
    );

    // The FP8 path's communication alone: U8 all-to-all + all-gather of the
    // codes and the two one-element amax all-reduces (no casts).
    let codes = Tensor::zeros(len, DType::U8, dev)?;
    let amax = Tensor::zeros(1, DType::F32, dev)?;
    let chunks = (0..n)
        .map(|j| {
            let r = shard_range(len, j, n);
            Ok(codes.narrow(0, r.start, r.len())?)
        })
        .collect::<Result<Vec<_>>>()?;
    let own = shard_range(len, rank, n);
    let wire = || -> Result<()> {
        comm.all_reduce_max(&amax)?;
        comm.all_to_all(&chunks)?;
        comm.all_reduce_max(&amax)?;
        comm.all_gather_shards(&codes.narrow(0, own.start, own.len())?, len)?;
        Ok(())
    };
    comm.barrier()?;
    let wire_s = time(dev, args.iters, wire)?;
    comm.reset_bytes_sent();
    wire()?;
    line("fp8 path, communication only", wire_s, comm.bytes_sent());

    let cfg = Fp8ReduceConfig::default();
    comm.barrier()?;
    match time(dev, args.iters, || {
        fp8_all_reduce(comm, &g, &cfg)?;
        Ok(())
    }) {
        Ok(fp8_s) => {
            comm.reset_bytes_sent();
            fp8_all_reduce(comm, &g, &cfg)?;
            let fp8_bytes = comm.bytes_sent();
            line(
                &format!("fp8_all_reduce {} MiB", args.mib),
                fp8_s,
                fp8_bytes,
            );
            println!(
                "[rank {rank}/{n}] BENCH ratios: time fp8/f32 {:.3}, bytes fp8/f32 {}",
                fp8_s / f32_s,
                if f32_bytes == 0 {
                    "n/a (world of 1: nothing on the wire)".to_string()
                } else {
                    format!("{:.4}", fp8_bytes as f64 / f32_bytes as f64)
                }
            );
        }
        Err(e) => println!("[rank {rank}/{n}] BENCH fp8_all_reduce: not run: {e:#}"),
    }

    // As the levels reduce a step's weight gradients: E5M2 scaling tensors
    // of 1024 x 4096, in buckets of at most `bucket_mb` MiB of F32.
    let (rows, cols) = (1024, 4096);
    let count = (len / (rows * cols)).max(1);
    let grads = (0..count)
        .map(|i| {
            let g = g.narrow(0, (i * rows * cols) % len.max(1), (rows * cols).min(len))?;
            Ok(ScalingTensor::quantize(&g, QType::E5M2, &CurrentScaling::default())?.0)
        })
        .collect::<Result<Vec<_>>>()?;
    let cap = ((args.bucket_mb * 1048576.0 / 4.0) as usize).max(1);
    let mut buckets: Vec<Vec<&ScalingTensor>> = vec![];
    let mut elems = 0;
    for t in &grads {
        match buckets.last_mut() {
            Some(b) if elems + t.elem_count() <= cap => b.push(t),
            _ => {
                buckets.push(vec![t]);
                elems = 0;
            }
        }
        elems += t.elem_count();
    }
    let cfg = Fp8ReduceConfig {
        qtype: QType::E5M2,
        ..Default::default()
    };
    let bucketed = || -> Result<()> {
        for b in &buckets {
            fp8_all_reduce_bucket(comm, b.iter().copied(), &cfg)?;
        }
        Ok(())
    };
    comm.barrier()?;
    let bucket_s = time(dev, args.iters, bucketed)?;
    comm.reset_bytes_sent();
    bucketed()?;
    line(
        &format!(
            "fp8 bucketed, {count} E5M2 gradients of {rows}x{cols} in {} bucket(s) of <= {} MiB",
            buckets.len(),
            args.bucket_mb
        ),
        bucket_s,
        comm.bytes_sent(),
    );
    println!(
        "[rank {rank}/{n}] BENCH ratios: time fp8 bucketed/f32 {:.3}",
        bucket_s / f32_s
    );
    Ok(())
}
