//! Exhaustive cast checks: every f32 bit pattern (2^32, streamed in chunks,
//! the CPU side on every core) and every BF16 and FP16 input.

use crate::util::{bits, on_threads, same_scaled, Rng};
use amp::{QType, ScalingMeta, ScalingTensor};
use anyhow::Result;
use candle_core::{Device, Tensor};
use std::time::Instant;

/// Codes (as bits), amax bits, saturated and flushed counts of one cast.
type Cast = (Vec<u64>, u32, u64, u64);

/// One cast's codes as bits, amax bits and counts.
fn cast(q: &ScalingTensor, amax: &Tensor) -> Result<Cast> {
    let stats = q.meta().last_cast_stats()?.unwrap_or_default();
    Ok((
        bits(q.data())?,
        amax.flatten_all()?.to_vec1::<f32>()?[0].to_bits(),
        stats.saturated,
        stats.flushed,
    ))
}

/// The CPU result of quantizing one chunk, computed in `threads` parts:
/// codes as bits, amax bits (max over the parts: the kernel's own rule),
/// saturated and flushed counts.
fn cpu_quantize(xs: &[f32], meta: &ScalingMeta, threads: usize) -> Result<Cast> {
    let parts = on_threads(xs, threads, |c| {
        let x = Tensor::from_slice(c, c.len(), &Device::Cpu)?;
        let (q, amax) = ScalingTensor::quantize_with(&x, meta)?;
        cast(&q, &amax)
    })?;
    let mut out = (Vec::with_capacity(xs.len()), 0u32, 0u64, 0u64);
    for (codes, amax, sat, flush) in parts {
        out.0.extend(codes);
        out.1 = out.1.max(amax);
        out.2 += sat;
        out.3 += flush;
    }
    Ok(out)
}

/// All 2^32 f32 inputs through quantize (scale 1) to E4M3, E5M2 and FP16:
/// codes, amax and counts of every chunk, CUDA vs CPU.
pub fn all_f32(dev: &Device, chunk_log2: u32) -> Result<bool> {
    let chunk = 1usize << chunk_log2;
    let chunks = (1usize << 32) / chunk;
    let threads = std::thread::available_parallelism().map_or(16, |n| n.get());
    let mut ok = true;
    for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
        let t0 = Instant::now();
        let gpu_meta = ScalingMeta::new(qtype, 1, dev)?;
        let cpu_meta = ScalingMeta::new(qtype, 1, &Device::Cpu)?;
        let (mut bad, mut bad_meta, mut sat, mut flush) = (0u64, 0u64, 0u64, 0u64);
        let mut xs = vec![0f32; chunk];
        for c in 0..chunks {
            let base = (c * chunk) as u32;
            for (i, x) in xs.iter_mut().enumerate() {
                *x = f32::from_bits(base.wrapping_add(i as u32));
            }
            let x = Tensor::from_slice(&xs, chunk, dev)?;
            let (q, amax) = ScalingTensor::quantize_with(&x, &gpu_meta)?;
            let (g_codes, g_amax, g_sat, g_flush) = cast(&q, &amax)?;
            let (c_codes, c_amax, c_sat, c_flush) = cpu_quantize(&xs, &cpu_meta, threads)?;
            for i in (0..chunk).filter(|&i| g_codes[i] != c_codes[i]) {
                if bad < 8 {
                    println!(
                        "  {qtype}: x = {:#010x}: cuda {:#06x} cpu {:#06x}",
                        base.wrapping_add(i as u32),
                        g_codes[i],
                        c_codes[i]
                    );
                }
                bad += 1;
            }
            if (g_amax, g_sat, g_flush) != (c_amax, c_sat, c_flush) {
                println!(
                    "  {qtype}: chunk {c}: amax cuda {g_amax:#x} cpu {c_amax:#x}, saturated {} / {c_sat}, flushed {} / {c_flush}",
                    g_sat, g_flush
                );
                bad_meta += 1;
            }
            sat += c_sat;
            flush += c_flush;
        }
        println!(
            "2^32 f32 -> {qtype}: {bad} codes differ, {bad_meta} chunks with differing amax/counts (saturated {sat}, flushed {flush} in all), {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        ok &= bad == 0 && bad_meta == 0;
    }
    Ok(ok)
}

/// Every BF16 and FP16 bit pattern through quantize to each storage type,
/// at several scales (powers of two and not).
pub fn all_16bit_inputs(dev: &Device) -> Result<bool> {
    let mut ok = true;
    let bf: Vec<half::bf16> = (0..=u16::MAX).map(half::bf16::from_bits).collect();
    let hf: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
    let inputs = [
        Tensor::from_vec(bf, 65536, &Device::Cpu)?,
        Tensor::from_vec(hf, 65536, &Device::Cpu)?,
    ];
    let mut rng = Rng(17);
    for x in &inputs {
        let xg = x.to_device(dev)?;
        for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
            for scale in [
                1.0f32,
                448.0 / 3.0,
                2f32.powi(-10),
                3e4,
                (rng.unit() * 100.0) as f32 + 1e-3,
            ] {
                let mg = ScalingMeta::new(qtype, 1, dev)?.with_scale(scale)?;
                let mc = ScalingMeta::new(qtype, 1, &Device::Cpu)?.with_scale(scale)?;
                let (qg, _) = ScalingTensor::quantize_with(&xg, &mg)?;
                let (qc, _) = ScalingTensor::quantize_with(x, &mc)?;
                ok &= same_scaled(&format!("{:?} -> {qtype} x {scale}", x.dtype()), &qg, &qc)?;
            }
        }
    }
    println!(
        "all 2^16 BF16 and FP16 inputs x 3 types x 5 scales: {}",
        if ok { "identical" } else { "DIFFER" }
    );
    Ok(ok)
}
