//! The low-bit step's own codecs (`amp::step_encode` / `amp::step_decode`,
//! the packed conversions of the step kernels) against their CPU bodies:
//! every f32 bit pattern (2^32, streamed in chunks, the CPU side on every
//! core) encoded to E4M3, E5M2 and FP16, and every code decoded at several
//! scale_inv values, aligned and not. Codes must match bit for bit (FP8 NaN
//! is 0x7F on both sides); where the CPU gives an FP16 or f32 NaN, whose
//! payload it keeps, CUDA must give its documented one (0x7FFF,
//! 0x7FFFFFFF).

use crate::util::{bits, on_threads};
use amp::optim::{step_decode, step_encode};
use amp::QType;
use anyhow::Result;
use candle_core::{Device, Tensor};
use std::time::Instant;

const QTYPES: [QType; 3] = [QType::E4M3, QType::E5M2, QType::F16];

/// Whether `cpu` is an FP16 NaN code (exponent all ones and a mantissa),
/// whose payload the CPU keeps; FP8 codes are compared exactly (both sides
/// encode NaN as 0x7F).
fn nan_code(q: QType, c: u64) -> bool {
    q == QType::F16 && c & 0x7FFF > 0x7C00
}

/// Counts codes that differ, where a CPU NaN must be CUDA's `nan`.
fn count_bad(
    what: &str,
    gpu: &[u64],
    cpu: &[u64],
    is_nan: impl Fn(u64) -> bool,
    nan: u64,
    base: u64,
) -> u64 {
    if gpu.len() != cpu.len() {
        println!(
            "  {what}: cuda gave {} values, cpu {}",
            gpu.len(),
            cpu.len()
        );
        return gpu.len().max(cpu.len()) as u64;
    }
    let mut bad = 0;
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        let ok = if is_nan(c) { g == nan } else { g == c };
        if !ok {
            if bad < 6 {
                println!(
                    "  {what}: input {:#x}: cuda {g:#x} cpu {c:#x}",
                    base + i as u64
                );
            }
            bad += 1;
        }
    }
    bad
}

/// The CPU encode of `xs` in `threads` parts, as bits.
fn cpu_encode(xs: &[f32], q: QType, threads: usize) -> Result<Vec<u64>> {
    let parts = on_threads(xs, threads, |c| {
        bits(&step_encode(
            &Tensor::from_slice(c, c.len(), &Device::Cpu)?,
            q,
            1.0,
        )?)
    })?;
    Ok(parts.concat())
}

pub fn check(dev: &Device, chunk_log2: u32) -> Result<bool> {
    anyhow::ensure!(
        (2..=32).contains(&chunk_log2),
        "--chunk-log2 {chunk_log2}: the sweep's chunk must be 2^2 to 2^32 elements"
    );
    let mut ok = decodes(dev)?;
    let chunk = 1usize << chunk_log2;
    let threads = std::thread::available_parallelism().map_or(16, |n| n.get());
    for q in QTYPES {
        let t0 = Instant::now();
        let nan = if q == QType::F16 { 0x7FFF } else { 0x7F };
        let differ = |what: String, g: &[u64], cpu: &[u64], base: u64| {
            count_bad(&what, g, cpu, |v| nan_code(q, v), nan, base)
        };
        let mut bad = 0;
        let mut xs = vec![0f32; chunk];
        for c in 0..(1usize << 32) / chunk {
            let base = (c * chunk) as u32;
            for (i, x) in xs.iter_mut().enumerate() {
                *x = f32::from_bits(base.wrapping_add(i as u32));
            }
            let g = bits(&step_encode(&Tensor::from_slice(&xs, chunk, dev)?, q, 1.0)?)?;
            let cpu = cpu_encode(&xs, q, threads)?;
            bad += differ(format!("encode {q}"), &g, &cpu, base as u64);
        }
        // 1003 elements at a scale that is not a power of two: from an
        // aligned buffer (the groups, then a tail of 3) and one element
        // into it (no 16-byte groups: every element alone)
        let xs: Vec<f32> = (0..1004u32)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B9)))
            .collect();
        let all = Tensor::from_slice(&xs, 1004, &Device::Cpu)?;
        for (what, x) in [
            ("tail", all.narrow(0, 0, 1003)?),
            ("unaligned", all.narrow(0, 1, 1003)?),
        ] {
            // `to_device` keeps the view's offset: the tail case copies first
            let on_dev = if what == "tail" {
                x.copy()?.to_device(dev)?
            } else {
                x.to_device(dev)?
            };
            let g = bits(&step_encode(&on_dev, q, 0.3)?)?;
            let cpu = bits(&step_encode(&x, q, 0.3)?)?;
            bad += differ(format!("encode {q} {what}"), &g, &cpu, 0);
        }
        println!(
            "  step encode, 2^32 f32 -> {q}: {bad} codes differ, {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        ok &= bad == 0;
    }
    Ok(ok)
}

/// Every code of each type, at scale_inv 1, 2^-7, 0.3, 3e38 and a
/// subnormal, aligned and one element into the buffer.
fn decodes(dev: &Device) -> Result<bool> {
    let mut ok = true;
    for q in QTYPES {
        let codes = if q == QType::F16 {
            let all: Vec<half::f16> = (0..=u16::MAX)
                .chain(0..3)
                .map(half::f16::from_bits)
                .collect();
            Tensor::from_vec(all, 65539, &Device::Cpu)?
        } else {
            Tensor::from_vec(
                (0..=u8::MAX).chain(0..3).collect::<Vec<u8>>(),
                259,
                &Device::Cpu,
            )?
        };
        let n = codes.dim(0)?;
        let mut bad = 0;
        for si in [1.0f32, 2f32.powi(-7), 0.3, 3e38, 1e-40] {
            for (what, c) in [
                ("aligned", codes.clone()),
                ("unaligned", codes.narrow(0, 1, n - 1)?),
            ] {
                let g = bits(&step_decode(&c.to_device(dev)?, q, si)?)?;
                let cpu = step_decode(&c, q, si)?;
                let is_nan = |v: u64| f32::from_bits(v as u32).is_nan();
                bad += count_bad(
                    &format!("decode {q} x {si} {what}"),
                    &g,
                    &bits(&cpu)?,
                    is_nan,
                    0x7FFF_FFFF,
                    0,
                );
            }
        }
        println!("  step decode, every {q} code: {bad} values differ");
        ok &= bad == 0;
    }
    Ok(ok)
}
