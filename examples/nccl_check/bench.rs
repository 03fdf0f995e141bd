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
fn time(device: &Device, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    Ok(time_both(device, iters, f)?.0)
}

/// As [`time`], with the median host time to enqueue the call (before the
/// synchronize): where it is close to the whole, the host is the limit.
fn time_both(
    device: &Device,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    for _ in 0..3 {
        f()?;
    }
    device.synchronize()?;
    let mut t = Vec::with_capacity(iters);
    let mut host = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        f()?;
        host.push(start.elapsed().as_secs_f64());
        device.synchronize()?;
        t.push(start.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    host.sort_by(f64::total_cmp);
    Ok((t[t.len() / 2], host[host.len() / 2]))
}

/// Device milliseconds of one call of `f`, from events around `reps`
/// calls enqueued back to back (the host runs ahead; after 2 warm-ups).
fn device_ms(device: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    device.synchronize()?;
    let a = amp::cuda::StreamMark::now(device)?;
    for _ in 0..reps {
        f()?;
    }
    let b = amp::cuda::StreamMark::now(device)?;
    device.synchronize()?;
    Ok(a.ms_until(&b)? / reps as f64)
}

pub fn bench(comm: &NcclComm, args: &Args) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let len = args.mib * (1 << 20) / 4;
    let dev = comm.device();
    // Freed blocks stay pooled, as in the GPT example (and PyTorch's caching
    // allocator): without it every timed call maps its outputs anew.
    amp::cuda::keep_freed_memory(dev)?;
    // As in the GPT example: no per-buffer events (candle's stream and the
    // communicator's fenced side stream are the only streams).
    // SAFETY: one host thread; the side stream fences its own work.
    unsafe { amp::cuda::skip_event_tracking(dev)? };
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
    // ... and each collective of it alone: where the wire's time goes.
    let parts: [(&str, Timed); 3] = [
        (
            "  of it: U8 all_to_all",
            Box::new(|| {
                comm.all_to_all(&chunks)?;
                Ok(())
            }),
        ),
        (
            "  of it: U8 all_gather_shards",
            Box::new(|| {
                comm.all_gather_shards(&codes.narrow(0, own.start, own.len())?, len)?;
                Ok(())
            }),
        ),
        (
            "  of it: one-element all_reduce_max",
            Box::new(|| {
                comm.all_reduce_max(&amax)?;
                Ok(())
            }),
        ),
    ];
    for (name, mut f) in parts {
        comm.barrier()?;
        let s = time(dev, args.iters, &mut f)?;
        comm.reset_bytes_sent();
        f()?;
        line(name, s, comm.bytes_sent());
    }

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
    // The buckets (E5M2 gradients, the levels' bucket cap), then in one shot
    // (`Fp8ReduceConfig::one_shot`: every rank's codes whole to every rank,
    // each rank reducing every bucket).
    let cfg = Fp8ReduceConfig {
        qtype: QType::E5M2,
        ..Default::default()
    };
    let one_shot = Fp8ReduceConfig {
        one_shot: true,
        ..cfg
    };
    for (cfg, what, tag) in [(&cfg, "", "bucketed"), (&one_shot, " one shot", "one shot")] {
        let reduce = || -> Result<()> {
            for b in &buckets {
                fp8_all_reduce_bucket(comm, b.iter().copied(), cfg)?;
            }
            Ok(())
        };
        comm.barrier()?;
        let (s, host_s) = time_both(dev, args.iters, reduce)?;
        comm.reset_bytes_sent();
        reduce()?;
        line(
            &format!(
                "fp8 bucketed{what}, {count} E5M2 gradients of {rows}x{cols} in {} bucket(s) of <= {} MiB",
                buckets.len(),
                args.bucket_mb
            ),
            s,
            comm.bytes_sent(),
        );
        println!(
            "[rank {rank}/{n}] BENCH ratios: time fp8 {tag}/f32 {:.3}; host enqueue {:.3} ms of it",
            s / f32_s,
            host_s * 1e3
        );
    }
    kernels(comm, &grads, args.iters)?;
    host_profile(comm, &grads[..1], args.iters)?;
    Ok(())
}

/// Host microseconds of each step of one fused bucket reduction of `grads`
/// (as `fp8_all_reduce_bucket` runs them on the communicator's stream),
/// averaged over `reps` reductions enqueued without a synchronize between.
fn host_profile(comm: &NcclComm, grads: &[ScalingTensor], reps: usize) -> Result<()> {
    use amp::kernels::{
        bucket_decode_sum_quantize, bucket_mean_bound, bucket_scales, bucket_scales_sent,
    };
    let (rank, n) = (comm.rank(), comm.world_size());
    let q = QType::E5M2;
    let side = comm
        .side_stream()
        .ok_or_else(|| anyhow::anyhow!("no side stream"))?;
    let mut spent = [0f64; 7];
    let names = [
        "fence in",
        "bucket_scales_sent",
        "all_to_all_gather",
        "bound+scales",
        "bucket_decode_sum_quantize",
        "all_gather_shards",
        "fence out",
    ];
    comm.barrier()?;
    for _ in 0..reps {
        let mut k = 0;
        let mut t = Instant::now();
        let mut lap = |spent: &mut [f64; 7], k: &mut usize| {
            spent[*k] += t.elapsed().as_secs_f64() * 1e6;
            *k += 1;
            t = Instant::now();
        };
        side.wait_for_compute()?;
        lap(&mut spent, &mut k);
        side.run(|| -> Result<()> {
            let codes: Vec<&Tensor> = grads.iter().map(|g| g.data()).collect();
            let sinvs: Vec<&Tensor> = grads.iter().map(|g| g.meta().scale_inv()).collect();
            let scales: Vec<&Tensor> = grads.iter().map(|g| g.meta().scale()).collect();
            let amaxes = grads
                .iter()
                .map(|g| g.meta().amax())
                .collect::<Result<Vec<_>, amp::CoreError>>()?;
            let total: usize = codes.iter().map(|c| c.elem_count()).sum();
            let flat = codes[0].flatten_all()?;
            let sent = bucket_scales_sent(&sinvs, &scales, &amaxes.iter().collect::<Vec<_>>(), q)?;
            lap(&mut spent, &mut k);
            let chunks = (0..n)
                .map(|j| {
                    let r = shard_range(total, j, n);
                    Ok(flat.narrow(0, r.start, r.len())?)
                })
                .collect::<Result<Vec<_>>>()?;
            let (got, gathered) = comm.all_to_all_gather(&chunks, &sent)?;
            lap(&mut spent, &mut k);
            let t_count = grads.len();
            let bound = bucket_mean_bound(&gathered, t_count, t_count, true)?;
            let (rscale, _) = bucket_scales(&bound, q, amp::ScaleRule::PowerOfTwo, 0)?;
            lap(&mut spent, &mut k);
            let mine = shard_range(total, rank, n);
            let pieces = [amp::kernels::Piece {
                tensor: 0,
                start: 0,
                len: mine.len(),
            }];
            let shard = bucket_decode_sum_quantize(&got, &gathered, q, true, &pieces, &rscale)?;
            lap(&mut spent, &mut k);
            let all = comm.all_gather_shards(&shard, total)?;
            let _ = all.narrow(0, 0, 1)?;
            lap(&mut spent, &mut k);
            Ok(())
        })?;
        lap(&mut spent, &mut k);
    }
    comm.device().synchronize()?;
    let line: Vec<String> = names
        .iter()
        .zip(spent)
        .map(|(n, us)| format!("{n} {:.1}", us / reps as f64))
        .collect();
    println!(
        "[rank {rank}/{n}] BENCH host us per step of a one-tensor bucket: {}",
        line.join(", ")
    );
    Ok(())
}

/// A call to time.
type Timed<'a> = Box<dyn FnMut() -> Result<()> + 'a>;

/// Device time of each bucket kernel alone over all of `grads` as one
/// bucket (no communication), beside the bytes it must move.
fn kernels(comm: &NcclComm, grads: &[ScalingTensor], reps: usize) -> Result<()> {
    use amp::kernels::{
        bucket_amax, bucket_decode_amax, bucket_decode_sum, bucket_decode_sum_quantize,
        bucket_quantize, bucket_requantize, bucket_scales,
    };
    let (rank, n) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let q = QType::E5M2;
    let codes: Vec<&Tensor> = grads.iter().map(|g| g.data()).collect();
    let sinvs: Vec<&Tensor> = grads.iter().map(|g| g.meta().scale_inv()).collect();
    let elems: usize = codes.iter().map(|c| c.elem_count()).sum();
    let amax = bucket_amax(&codes, &sinvs, q)?;
    let (scale, scale_inv) = bucket_scales(&amax, q, amp::ScaleRule::PowerOfTwo, 0)?;
    let flat = bucket_requantize(&codes, &sinvs, q, &scale, None, None, None)?;
    // decode-and-sum of this rank's chunk from 2 ranks' codes
    let chunk = elems / 2;
    let parts = [flat.narrow(0, 0, chunk)?, flat.narrow(0, chunk, chunk)?];
    let mut pieces = Vec::new();
    let mut at = 0;
    for (t, c) in codes.iter().enumerate() {
        let len = c.elem_count().min(chunk.saturating_sub(at));
        if len > 0 {
            pieces.push(amp::kernels::Piece {
                tensor: t,
                start: at,
                len,
            });
        }
        at += len;
    }
    let (sums, _) = bucket_decode_sum(&parts, &scale_inv, q, true, &pieces)?;
    let mut at = 0;
    let qpieces: Vec<amp::kernels::Piece> = pieces
        .iter()
        .map(|p| {
            let r = amp::kernels::Piece { start: at, ..*p };
            at += p.len;
            r
        })
        .collect();
    let gb = |bytes: f64, ms: f64| bytes / ms / 1e6;
    let e = elems as f64;
    let lines: [(&str, f64, Timed); 6] = [
        (
            "bucket_amax",
            e,
            Box::new(|| {
                bucket_amax(&codes, &sinvs, q)?;
                Ok(())
            }),
        ),
        (
            "bucket_requantize",
            2.0 * e,
            Box::new(|| {
                bucket_requantize(&codes, &sinvs, q, &scale, None, None, None)?;
                Ok(())
            }),
        ),
        (
            "bucket_decode_sum (2 ranks, half the elements)",
            (2.0 * 0.5 + 4.0 * 0.5) * e,
            Box::new(|| {
                bucket_decode_sum(&parts, &scale_inv, q, true, &pieces)?;
                Ok(())
            }),
        ),
        (
            "bucket_quantize (half the elements)",
            (4.0 * 0.5 + 0.5) * e,
            Box::new(|| {
                bucket_quantize(&sums, &scale, q, &qpieces)?;
                Ok(())
            }),
        ),
        (
            "bucket_decode_amax (2 ranks, half the elements)",
            e,
            Box::new(|| {
                bucket_decode_amax(&parts, &scale_inv, q, true, &pieces)?;
                Ok(())
            }),
        ),
        (
            "bucket_decode_sum_quantize (2 ranks, half the elements)",
            (1.0 + 0.5) * e,
            Box::new(|| {
                bucket_decode_sum_quantize(&parts, &scale_inv, q, true, &pieces, &scale)?;
                Ok(())
            }),
        ),
    ];
    for (name, bytes, mut f) in lines {
        let ms = device_ms(dev, reps, &mut f)?;
        println!(
            "[rank {rank}/{n}] BENCH kernel {name}: {ms:.3} ms for {elems} elements, {:.0} GB/s of its bytes",
            gb(bytes, ms)
        );
    }
    Ok(())
}
