//! The low-bit step's own codecs (`amp::optim::step_encode` /
//! `step_decode`, the packed conversions of the step kernels) against
//! their CPU bodies: every code decoded at several scale_inv values,
//! aligned and not; encodes of a tail and of an unaligned view; and
//! (ignored: minutes) every f32 bit pattern encoded to E4M3, E5M2 and
//! FP16. Codes must match bit for bit (FP8 NaN is 0x7F on both sides);
//! where the CPU gives an FP16 or f32 NaN, whose payload it keeps, CUDA
//! must give its documented one (0x7FFF, 0x7FFFFFFF).

use crate::util::{bits, cores, on_threads};
use amp::optim::{step_decode, step_encode};
use amp::QType;
use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use std::time::Instant;

const QTYPES: [QType; 3] = [QType::E4M3, QType::E5M2, QType::F16];

test_device!(
    decode_every_code,
    decode_every_code_cpu,
    decode_every_code_cuda
);
test_device!(encode_tail, encode_tail_cpu, encode_tail_cuda);
test_device!(
    #[ignore = "2^32 inputs: about 80 s on an H100 with 16 cores; run with --include-ignored"]
    encode_all_f32_e4m3,
    encode_all_f32_e4m3_cuda
);
test_device!(
    #[ignore = "2^32 inputs: about 80 s on an H100 with 16 cores; run with --include-ignored"]
    encode_all_f32_e5m2,
    encode_all_f32_e5m2_cuda
);
test_device!(
    #[ignore = "2^32 inputs: about 80 s on an H100 with 16 cores; run with --include-ignored"]
    encode_all_f32_f16,
    encode_all_f32_f16_cuda
);

/// Whether `cpu` is an FP16 NaN code (exponent all ones and a mantissa),
/// whose payload the CPU keeps; FP8 codes are compared exactly (both sides
/// encode NaN as 0x7F).
fn nan_code(q: QType, c: u64) -> bool {
    q == QType::F16 && c & 0x7FFF > 0x7C00
}

/// The code a CPU NaN must be on `dev`: CUDA's documented one (the CPU
/// keeps an FP16 NaN's payload; FP8 NaN is 0x7F on both), or on the CPU
/// the CPU's own.
fn nan_of(q: QType, dev: &Device) -> Option<u64> {
    match (dev.is_cpu(), q) {
        (true, _) => None,
        (false, QType::F16) => Some(0x7FFF),
        (false, _) => Some(0x7F),
    }
}

/// Counts codes that differ, where a CPU NaN must be `nan` on the device
/// (`None`: the CPU's own, on the CPU).
fn count_bad(
    what: &str,
    on_dev: &[u64],
    cpu: &[u64],
    is_nan: impl Fn(u64) -> bool,
    nan: Option<u64>,
    base: u64,
) -> u64 {
    if on_dev.len() != cpu.len() {
        println!(
            "  {what}: the device gave {} values, cpu {}",
            on_dev.len(),
            cpu.len()
        );
        return on_dev.len().max(cpu.len()) as u64;
    }
    let mut bad = 0;
    for (i, (&g, &c)) in on_dev.iter().zip(cpu).enumerate() {
        let ok = match nan {
            Some(nan) if is_nan(c) => g == nan,
            _ => g == c,
        };
        if !ok {
            if bad < 6 {
                println!(
                    "  {what}: input {:#x}: device {g:#x} cpu {c:#x}",
                    base + i as u64
                );
            }
            bad += 1;
        }
    }
    bad
}

/// Every code of each type, at scale_inv 1, 2^-7, 0.3, 3e38 and a
/// subnormal, aligned and one element into the buffer.
fn decode_every_code(dev: &Device) -> Result<()> {
    let mut bad = 0;
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
                    (!dev.is_cpu()).then_some(0x7FFF_FFFF),
                    0,
                );
            }
        }
    }
    ensure!(bad == 0, "{bad} decoded values differ");
    Ok(())
}

/// 1003 elements at a scale that is not a power of two: from an aligned
/// buffer (the groups, then a tail of 3) and one element into it (no
/// 16-byte groups: every element alone).
fn encode_tail(dev: &Device) -> Result<()> {
    let xs: Vec<f32> = (0..1004u32)
        .map(|i| f32::from_bits(i.wrapping_mul(0x9E37_79B9)))
        .collect();
    let all = Tensor::from_slice(&xs, 1004, &Device::Cpu)?;
    let mut bad = 0;
    for q in QTYPES {
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
            bad += count_bad(
                &format!("encode {q} {what}"),
                &g,
                &cpu,
                |v| nan_code(q, v),
                nan_of(q, dev),
                0,
            );
        }
    }
    ensure!(bad == 0, "{bad} codes differ");
    Ok(())
}

fn encode_all_f32_e4m3(dev: &Device) -> Result<()> {
    encode_all_f32(dev, QType::E4M3)
}
fn encode_all_f32_e5m2(dev: &Device) -> Result<()> {
    encode_all_f32(dev, QType::E5M2)
}
fn encode_all_f32_f16(dev: &Device) -> Result<()> {
    encode_all_f32(dev, QType::F16)
}

/// Every f32 bit pattern encoded to `q` at scale 1, in chunks of 2^26
/// (the CPU side on every core).
fn encode_all_f32(dev: &Device, q: QType) -> Result<()> {
    let chunk = 1usize << 26;
    let threads = cores();
    let t0 = Instant::now();
    let mut bad = 0;
    let mut xs = vec![0f32; chunk];
    for c in 0..(1usize << 32) / chunk {
        let base = (c * chunk) as u32;
        for (i, x) in xs.iter_mut().enumerate() {
            *x = f32::from_bits(base.wrapping_add(i as u32));
        }
        let g = bits(&step_encode(&Tensor::from_slice(&xs, chunk, dev)?, q, 1.0)?)?;
        let cpu = on_threads(&xs, threads, |c| {
            bits(&step_encode(
                &Tensor::from_slice(c, c.len(), &Device::Cpu)?,
                q,
                1.0,
            )?)
        })?
        .concat();
        bad += count_bad(
            &format!("encode {q}"),
            &g,
            &cpu,
            |v| nan_code(q, v),
            nan_of(q, dev),
            base as u64,
        );
    }
    println!(
        "  step encode, 2^32 f32 -> {q}: {bad} codes differ, {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    ensure!(bad == 0, "{bad} codes differ");
    Ok(())
}
