//! Device timings for BENCHMARKS.md: FP8 and BF16 GEMMs at 8192^3 and the
//! GPT-350M/1.3B linear shapes, the pool release threshold's effect, and the
//! cast kernels' bandwidth over the device copy's. CUDA events around
//! back-to-back calls (outputs allocated per call, as in training).

use crate::util::Rng;
use amp::cuda::set_pool_release_threshold;
use amp::{fp8_gemm_with, CurrentScaling, QType, ScalingMeta, ScalingTensor};
use anyhow::{bail, Result};
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

const WARMUP: usize = 5;
const REPS: usize = 30;

/// Milliseconds per call of `f`, CUDA events around `REPS` back-to-back calls.
pub(crate) fn event_ms(dev: &CudaDevice, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let start = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    stream.synchronize()?;
    start.record(&stream)?;
    for _ in 0..REPS {
        f()?;
    }
    end.record(&stream)?;
    Ok(f64::from(start.elapsed_ms(&end)?) / REPS as f64)
}

/// Host-clock timing: synchronize, time one synchronized call, median (what
/// a caller that waits for each GEMM sees).
fn wall_ms(dev: &Device, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    let mut t = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        dev.synchronize()?;
        let t0 = Instant::now();
        f()?;
        dev.synchronize()?;
        t.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    t.sort_by(f64::total_cmp);
    Ok(t[REPS / 2])
}

/// Drops a result (its buffer goes back to the pool) and reports success.
pub(crate) fn done<T>(_: T) -> Result<()> {
    Ok(())
}

pub(crate) fn tflops(m: usize, n: usize, k: usize, ms: f64) -> f64 {
    2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12
}

/// `(name, m, k, n)`: 8192^3 and the GPT-350M and 1.3B Linear shapes at
/// 8192 tokens.
pub(crate) const GEMM_SHAPES: [(&str, usize, usize, usize); 9] = [
    ("8192^3", 8192, 8192, 8192),
    ("350m.qkv", 8192, 1024, 3072),
    ("350m.proj", 8192, 1024, 1024),
    ("350m.fc1", 8192, 1024, 4096),
    ("350m.fc2", 8192, 4096, 1024),
    ("1.3b.qkv", 8192, 2048, 6144),
    ("1.3b.proj", 8192, 2048, 2048),
    ("1.3b.fc1", 8192, 2048, 8192),
    ("1.3b.fc2", 8192, 8192, 2048),
];

fn gemms(dev: &Device, cuda: &CudaDevice) -> Result<()> {
    let mut rng = Rng(11);
    for (name, m, k, n) in GEMM_SHAPES {
        let x = Tensor::from_vec(rng.normal(m * k), (m, k), dev)?;
        let w = Tensor::from_vec(rng.normal(n * k), (n, k), dev)?;
        let r = CurrentScaling::default();
        let (xq, _) = ScalingTensor::quantize(&x, QType::E4M3, &r)?;
        let (wq, _) = ScalingTensor::quantize(&w, QType::E4M3, &r)?;
        let (xb, wb) = (x.to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
        drop((x, w));
        let fp8 = event_ms(cuda, || done(fp8_gemm_with(&xq, &wq, DType::BF16, false)?))?;
        let fast = event_ms(cuda, || done(fp8_gemm_with(&xq, &wq, DType::BF16, true)?))?;
        let bf16 = event_ms(cuda, || done(xb.matmul(&wb.t()?)?))?;
        println!(
            "BENCH gemm shape={name} m={m} k={k} n={n} fp8_tflops={:.1} fp8_fast_tflops={:.1} bf16_tflops={:.1} fp8_over_bf16={:.2} fp8_fast_over_bf16={:.2}",
            tflops(m, n, k, fp8),
            tflops(m, n, k, fast),
            tflops(m, n, k, bf16),
            bf16 / fp8,
            bf16 / fast
        );
        if name == "8192^3" {
            // The per-call cost a synchronizing caller sees: host clock around each
            // synchronized call, with the pool releasing at every sync
            // (CUDA's default threshold 0) and keeping freed memory.
            set_pool_release_threshold(dev, 0)?;
            let release = wall_ms(dev, || done(fp8_gemm_with(&xq, &wq, DType::BF16, false)?))?;
            set_pool_release_threshold(dev, u64::MAX)?;
            let keep = wall_ms(dev, || done(fp8_gemm_with(&xq, &wq, DType::BF16, false)?))?;
            println!(
                "BENCH pool shape=8192^3 wall_release0_tflops={:.1} wall_keep_tflops={:.1} events_tflops={:.1}",
                tflops(m, n, k, release),
                tflops(m, n, k, keep),
                tflops(m, n, k, fp8)
            );
        }
    }
    Ok(())
}

fn casts(dev: &Device, cuda: &CudaDevice) -> Result<()> {
    let n: usize = 1 << 28; // 256 Mi elements: 1 GiB of f32
    let src = cuda.alloc_zeros::<f32>(n)?;
    let mut dst = cuda.alloc_zeros::<f32>(n)?;
    let copy = event_ms(cuda, || Ok(cuda.memcpy_dtod(&src, &mut dst)?))?;
    drop((src, dst));
    let copy_gbs = 2.0 * 4.0 * n as f64 / (copy * 1e-3) / 1e9;
    println!("BENCH copy bytes={} ms={copy:.3} gbs={copy_gbs:.0}", 8 * n);
    let mut rng = Rng(5);
    let x = Tensor::from_vec(rng.normal(1 << 20), 1 << 20, dev)?.repeat(256)?;
    let xb = x.to_dtype(DType::BF16)?;
    let meta = ScalingMeta::new(QType::E4M3, 1, dev)?.with_scale(64.0)?;
    let (q, _) = ScalingTensor::quantize_with(&x, &meta)?;
    let report = |name: &str, bytes: f64, ms: f64| {
        let gbs = bytes / (ms * 1e-3) / 1e9;
        println!(
            "BENCH cast op={name} ms={ms:.3} gbs={gbs:.0} over_copy={:.2}",
            gbs / copy_gbs
        );
    };
    let nf = n as f64;
    report(
        "quantize_f32_e4m3",
        5.0 * nf,
        event_ms(cuda, || done(ScalingTensor::quantize_with(&x, &meta)?))?,
    );
    report(
        "quantize_bf16_e4m3",
        3.0 * nf,
        event_ms(cuda, || done(ScalingTensor::quantize_with(&xb, &meta)?))?,
    );
    let m16 = ScalingMeta::new(QType::F16, 1, dev)?;
    report(
        "quantize_f32_f16",
        6.0 * nf,
        event_ms(cuda, || done(ScalingTensor::quantize_with(&x, &m16)?))?,
    );
    report(
        "dequantize_e4m3_bf16",
        3.0 * nf,
        event_ms(cuda, || done(q.dequantize(DType::BF16)?))?,
    );
    report(
        "dequantize_e4m3_f32",
        5.0 * nf,
        event_ms(cuda, || done(q.dequantize(DType::F32)?))?,
    );
    // cast-transpose against the cast and the transpose it replaces
    let (rows, cols) = (n / 4096, 4096);
    let xb2 = xb.reshape((rows, cols))?;
    report(
        "cast_transpose_bf16_e4m3 (2 outputs)",
        4.0 * nf,
        event_ms(cuda, || done(ScalingTensor::quantize_with_t(&xb2, &meta)?))?,
    );
    report(
        "quantize_bf16_e4m3 then t() (2 passes)",
        5.0 * nf,
        event_ms(cuda, || {
            done(ScalingTensor::quantize_with(&xb2, &meta)?.0.t()?)
        })?,
    );
    let r = CurrentScaling::default();
    report(
        "amax+quantize_f32_e4m3 (current scaling)",
        9.0 * nf,
        event_ms(cuda, || done(ScalingTensor::quantize(&x, QType::E4M3, &r)?))?,
    );
    report(
        "requantize_e4m3_e5m2 (2 passes)",
        3.0 * nf,
        event_ms(cuda, || done(q.requantize(QType::E5M2, &r)?))?,
    );
    Ok(())
}

pub fn run(dev: &Device) -> Result<bool> {
    let Device::Cuda(cuda) = dev else {
        bail!("not a CUDA device")
    };
    gemms(dev, cuda)?;
    casts(dev, cuda)?;
    Ok(true)
}
