//! Device timings of the block-scaled FP8 path (BENCHMARKS.md): the
//! block-scaled and rowwise GEMMs beside the per-tensor FP8 GEMM and BF16
//! at 8192^3 and the GPT linear shapes, and the block casts' bandwidth
//! over the device copy's. CUDA events around back-to-back calls, as
//! `bench.rs`.

use crate::bench::{done, event_ms, tflops, GEMM_SHAPES};
use crate::util::Rng;
use amp::{
    block_gemm, fp8_gemm_with, BlockTensor, CurrentScaling, QType, ScaleRule, ScalingTensor, Tiling,
};
use anyhow::{bail, Result};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};

fn q(x: &Tensor, t: Tiling) -> Result<BlockTensor> {
    Ok(BlockTensor::quantize(
        x,
        QType::E4M3,
        t,
        ScaleRule::PowerOfTwo,
    )?)
}

fn gemms(dev: &Device, cuda: &CudaDevice) -> Result<()> {
    let mut rng = Rng(12);
    for (name, m, k, n) in GEMM_SHAPES {
        let x = Tensor::from_vec(rng.normal(m * k), (m, k), dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::from_vec(rng.normal(n * k), (n, k), dev)?.to_dtype(DType::BF16)?;
        let r = CurrentScaling::default();
        let (xq, _) = ScalingTensor::quantize(&x, QType::E4M3, &r)?;
        let (wq, _) = ScalingTensor::quantize(&w, QType::E4M3, &r)?;
        let per_tensor = event_ms(cuda, || done(fp8_gemm_with(&xq, &wq, DType::BF16, false)?))?;
        drop((xq, wq));
        let bf16 = event_ms(cuda, || done(x.matmul(&w.t()?)?))?;
        let mut line = format!(
            "BENCH block_gemm shape={name} m={m} k={k} n={n} bf16_tflops={:.1} per_tensor_tflops={:.1}",
            tflops(m, n, k, bf16),
            tflops(m, n, k, per_tensor)
        );
        for (label, ta, tb) in [
            ("1x128_128x128", Tiling::Vec128, Tiling::Blk128),
            ("1x128_1x128", Tiling::Vec128, Tiling::Vec128),
            ("128x128_1x128", Tiling::Blk128, Tiling::Vec128),
            ("rowwise", Tiling::Row, Tiling::Row),
        ] {
            let (a, b) = (q(&x, ta)?, q(&w, tb)?);
            let ms = event_ms(cuda, || done(block_gemm(&a, &b, DType::BF16)?))?;
            line += &format!(
                " {label}_tflops={:.1} {label}_over_per_tensor={:.2}",
                tflops(m, n, k, ms),
                per_tensor / ms
            );
        }
        println!("{line}");
    }
    Ok(())
}

fn casts(dev: &Device, cuda: &CudaDevice) -> Result<()> {
    let (rows, cols) = (1usize << 16, 4096usize); // 2^28 elements
    let n = rows * cols;
    let src = cuda.alloc_zeros::<u8>(3 * n)?;
    let mut dst = cuda.alloc_zeros::<u8>(3 * n)?;
    // a copy of as many bytes as a BF16 -> E4M3 cast moves (read 2, write 1)
    let copy = event_ms(cuda, || Ok(cuda.memcpy_dtod(&src, &mut dst)?))?;
    drop((src, dst));
    let copy_gbs = 2.0 * 3.0 * n as f64 / (copy * 1e-3) / 1e9;
    let mut rng = Rng(6);
    let x = Tensor::from_vec(rng.normal(1 << 20), 1 << 20, dev)?
        .repeat(256)?
        .reshape((rows, cols))?
        .to_dtype(DType::BF16)?;
    let nf = n as f64;
    for (label, t) in [
        ("1x128", Tiling::Vec128),
        ("128x128", Tiling::Blk128),
        ("rowwise", Tiling::Row),
    ] {
        let ms = event_ms(cuda, || done(q(&x, t)?))?;
        let scales = 4.0 * (t.scale_dims(rows, cols).0 * t.scale_dims(rows, cols).1) as f64;
        let gbs = (3.0 * nf + scales) / (ms * 1e-3) / 1e9;
        println!(
            "BENCH block_cast op=quantize_bf16_e4m3_{label} ms={ms:.3} gbs={gbs:.0} over_copy={:.2}",
            gbs / copy_gbs
        );
    }
    // a Linear's activations: 1 x 128 casts of x and of xᵀ from one read
    let both = (true, true);
    let r = ScaleRule::PowerOfTwo;
    let ms = event_ms(cuda, || {
        done(BlockTensor::quantize_pair(
            &x,
            QType::E4M3,
            Tiling::Vec128,
            r,
            both,
        )?)
    })?;
    let gbs = 4.0 * nf / (ms * 1e-3) / 1e9;
    println!(
        "BENCH block_cast op=quantize_pair_bf16_e4m3_1x128 (codes and transposed codes) ms={ms:.3} gbs={gbs:.0} over_copy={:.2}",
        gbs / copy_gbs
    );
    let ms = event_ms(cuda, || {
        done(BlockTensor::quantize_pair(
            &x,
            QType::E4M3,
            Tiling::Row,
            r,
            both,
        )?)
    })?;
    let gbs = 4.0 * nf / (ms * 1e-3) / 1e9;
    println!(
        "BENCH block_cast op=quantize_pair_bf16_e4m3_rowwise (codes and transposed codes, two reads) ms={ms:.3} gbs={gbs:.0} over_copy={:.2}",
        gbs / copy_gbs
    );
    let ms = event_ms(cuda, || done(q(&x.t()?.contiguous()?, Tiling::Vec128)?))?;
    let gbs = 3.0 * nf / (ms * 1e-3) / 1e9;
    println!(
        "BENCH block_cast op=transpose_then_quantize_bf16_e4m3_1x128 (what the pair replaces) ms={ms:.3} gbs={gbs:.0} over_copy={:.2}",
        gbs / copy_gbs
    );
    let qx = q(&x, Tiling::Vec128)?;
    let ms = event_ms(cuda, || done(qx.dequantize(DType::BF16)?))?;
    let gbs = 3.0 * nf / (ms * 1e-3) / 1e9;
    println!(
        "BENCH block_cast op=dequantize_e4m3_bf16_1x128 ms={ms:.3} gbs={gbs:.0} over_copy={:.2}",
        gbs / copy_gbs
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
