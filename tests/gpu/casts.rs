//! The casts: every code decoded, every BF16 and FP16 input and (ignored:
//! minutes) every f32 bit pattern quantized, random tensors through amax,
//! quantize, dequantize and requantize, the cast-transpose, the amax
//! history and scale updates, `read_scalars`. The device against the CPU,
//! bit for bit.

use crate::util::{bits, cores, on_threads, same, same_scaled, Rng};
use amp::{
    AmaxComputeAlgo, CurrentScaling, DelayedScaling, QType, ScaleRule, ScalingMeta, ScalingTensor,
};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

const OUT: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];
const QTYPES: [QType; 3] = [QType::E4M3, QType::E5M2, QType::F16];

test_device!(codes_decode, codes_decode_cpu, codes_decode_cuda);
test_device!(inputs_16bit, inputs_16bit_cpu, inputs_16bit_cuda);
test_device!(random_ops, random_ops_cuda);
test_device!(cast_transpose, cast_transpose_cpu, cast_transpose_cuda);
test_device!(cast_t_many, cast_t_many_cpu, cast_t_many_cuda);
test_device!(scale_updates, scale_updates_cpu, scale_updates_cuda);
test_device!(read_scalars, read_scalars_cpu, read_scalars_cuda);
test_device!(
    #[ignore = "2^32 inputs: about 40 s on an H100 with 16 cores; run with --include-ignored"]
    all_f32_to_e4m3,
    all_f32_to_e4m3_cuda
);
test_device!(
    #[ignore = "2^32 inputs: about 40 s on an H100 with 16 cores; run with --include-ignored"]
    all_f32_to_e5m2,
    all_f32_to_e5m2_cuda
);
test_device!(
    #[ignore = "2^32 inputs: about 40 s on an H100 with 16 cores; run with --include-ignored"]
    all_f32_to_f16,
    all_f32_to_f16_cuda
);

/// All 256 codes of each FP8 format and all 2^16 FP16 values, decoded to
/// every output dtype at scale_inv 1 and at non-power-of-two ones.
fn codes_decode(dev: &Device) -> Result<()> {
    let mut ok = true;
    let fp8 = Tensor::from_vec((0..=255u8).collect::<Vec<_>>(), 256, &Device::Cpu)?;
    let fp16 = Tensor::from_vec(
        (0..=u16::MAX).map(half::f16::from_bits).collect::<Vec<_>>(),
        65536,
        &Device::Cpu,
    )?;
    for qtype in QTYPES {
        let data = if qtype == QType::F16 { &fp16 } else { &fp8 };
        for scale in [1.0f32, 3.0, 2f32.powi(-20)] {
            let on = |d: &Device| -> Result<ScalingTensor> {
                let meta = ScalingMeta::new(qtype, 1, d)?.with_scale(scale)?;
                Ok(ScalingTensor::from_parts(data.to_device(d)?, meta)?)
            };
            let (g, c) = (on(dev)?, on(&Device::Cpu)?);
            for dtype in OUT {
                ok &= same(
                    &format!("decode {qtype} / {scale} -> {dtype:?}"),
                    &g.dequantize(dtype)?,
                    &c.dequantize(dtype)?,
                )?;
            }
        }
    }
    ensure!(
        ok,
        "decoded codes differ from the CPU's (see the lines above)"
    );
    Ok(())
}

/// Every BF16 and FP16 bit pattern through quantize to each storage type,
/// at several scales (powers of two and not).
fn inputs_16bit(dev: &Device) -> Result<()> {
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
        for qtype in QTYPES {
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
    ensure!(ok, "casts of 16-bit inputs differ (see the lines above)");
    Ok(())
}

/// Random tensors (odd lengths, an offset view for the unaligned path,
/// specials sprinkled in) through current-scaling quantize (amax, scale
/// rule, quantize with counts), dequantize and requantize between all types.
fn random_ops(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(0x5EED);
    let n = 1_000_003;
    for (decades, offset) in [(3.0, 0), (12.0, 0), (40.0, 1), (2.0, 3)] {
        let xs = rng.values(n, decades);
        let x_cpu = Tensor::from_vec(xs, n, &Device::Cpu)?.narrow(0, offset, n - offset)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let xc = x_cpu.to_dtype(dtype)?;
            let xg = xc.to_device(dev)?;
            // an offset view stays offset on the device: the unaligned path
            let (xc, xg) = if offset > 0 {
                (
                    xc.narrow(0, 1, n - offset - 1)?,
                    xg.narrow(0, 1, n - offset - 1)?,
                )
            } else {
                (xc, xg)
            };
            for qtype in QTYPES {
                for rule in [ScaleRule::PowerOfTwo, ScaleRule::Te] {
                    let r = CurrentScaling {
                        scale_rule: rule,
                        margin: (rng.next_u64() % 3) as u32,
                        ..Default::default()
                    };
                    let what = format!("{dtype:?} 1e±{decades} +{offset} -> {qtype} {rule:?}");
                    let (qg, ag) = ScalingTensor::quantize(&xg, qtype, &r)?;
                    let (qc, ac) = ScalingTensor::quantize(&xc, qtype, &r)?;
                    ok &= same(&format!("{what} amax"), &ag, &ac)?;
                    ok &= same_scaled(&what, &qg, &qc)?;
                    for out in OUT {
                        ok &= same(
                            &format!("{what} dequantize {out:?}"),
                            &qg.dequantize(out)?,
                            &qc.dequantize(out)?,
                        )?;
                    }
                    for to in QTYPES {
                        let (rg, rag) = qg.requantize(to, &r)?;
                        let (rc, rac) = qc.requantize(to, &r)?;
                        ok &= same(&format!("{what} requantize {to} amax"), &rag, &rac)?;
                        ok &= same_scaled(&format!("{what} requantize {to}"), &rg, &rc)?;
                    }
                }
            }
        }
    }
    ensure!(
        ok,
        "amax/quantize/dequantize/requantize differ (see the lines above)"
    );
    Ok(())
}

/// Random amax histories (zeros, NaN, inf included) through record_amax,
/// update_scale (both rules, both algorithms, several margins) and TE's
/// update_delayed over several steps.
fn scale_updates(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(99);
    for len in [1usize, 2, 16, 1024] {
        for trial in 0..6 {
            let mut hist: Vec<f32> = rng.values(len, 30.0).iter().map(|v| v.abs()).collect();
            if trial == 0 {
                hist.iter_mut().for_each(|v| *v = 0.0);
            }
            let prev = (rng.unit() * 1000.0) as f32 + 1e-3;
            let amax = rng.values(1, 30.0)[0].abs();
            for qtype in QTYPES {
                let make = |d: &Device| -> Result<ScalingMeta> {
                    Ok(ScalingMeta::from_parts(
                        qtype,
                        Tensor::new(&[prev], d)?,
                        Tensor::new(&[1.0 / prev], d)?,
                        Tensor::new(hist.as_slice(), d)?,
                    )?)
                };
                let pairs = |g: &ScalingMeta, c: &ScalingMeta, what: &str| -> Result<bool> {
                    Ok(same(
                        &format!("{what} history"),
                        g.amax_history(),
                        c.amax_history(),
                    )? & same(&format!("{what} scale"), g.scale(), c.scale())?
                        & same(&format!("{what} scale_inv"), g.scale_inv(), c.scale_inv())?)
                };
                for rule in [ScaleRule::Te, ScaleRule::PowerOfTwo] {
                    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
                        for margin in [0u32, 1, 7, 300] {
                            let (mut g, mut c) = (make(dev)?, make(&Device::Cpu)?);
                            g.record_amax(&Tensor::new(&[amax], dev)?)?;
                            c.record_amax(&Tensor::new(&[amax], &Device::Cpu)?)?;
                            g.update_scale(rule, algo, margin)?;
                            c.update_scale(rule, algo, margin)?;
                            let what =
                                format!("len {len} {qtype} {rule:?} {algo:?} margin {margin}");
                            ok &= pairs(&g, &c, &what)?;
                        }
                    }
                }
                let recipe = DelayedScaling {
                    interval: 2,
                    amax_history_len: len,
                    ..Default::default()
                };
                let (mut g, mut c) = (make(dev)?, make(&Device::Cpu)?);
                for step in 0..5 {
                    let a = rng.values(1, 10.0)[0].abs();
                    g.record_amax(&Tensor::new(&[a], dev)?)?;
                    c.record_amax(&Tensor::new(&[a], &Device::Cpu)?)?;
                    g.update_delayed(&recipe)?;
                    c.update_delayed(&recipe)?;
                    ok &= pairs(&g, &c, &format!("delayed len {len} {qtype} step {step}"))?;
                }
            }
        }
    }
    ensure!(
        ok,
        "amax histories or scale updates differ (see the lines above)"
    );
    Ok(())
}

/// The cast-transpose (`quantize_with_t`, `quantize_t`) against the CPU,
/// both outputs bit for bit: full 64 x 64 tiles, partial tiles, shapes off
/// the vector path (cols not a multiple of 8, rows not of 16), an offset
/// (unaligned) view, specials sprinkled in; and the transposed codes equal
/// to the row-major codes' transpose on the device.
fn cast_transpose(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(0xCA57);
    for (rows, cols, offset) in [
        (256usize, 768usize, 0usize),
        (192, 200, 0),
        (100, 72, 0),
        (33, 17, 0),
        (1, 1, 0),
        (128, 64, 1),
        (4160, 136, 0),
    ] {
        let n = rows * cols + offset;
        let xs = Tensor::from_vec(rng.values(n, 12.0), n, &Device::Cpu)?;
        let x_cpu = xs.narrow(0, offset, rows * cols)?.reshape((rows, cols))?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let xc = x_cpu.to_dtype(dtype)?;
            // the offset stays on the device: narrow after the copy
            let xg = xs
                .to_dtype(dtype)?
                .to_device(dev)?
                .narrow(0, offset, rows * cols)?
                .reshape((rows, cols))?;
            for qtype in [QType::E4M3, QType::E5M2] {
                let what = format!("cast-transpose {rows}x{cols}+{offset} {dtype:?} -> {qtype}");
                let meta = |d: &Device| -> Result<ScalingMeta> {
                    Ok(ScalingMeta::new(qtype, 1, d)?.with_scale(3.0)?)
                };
                let (g, gt, ga) = ScalingTensor::quantize_with_t(&xg, &meta(dev)?)?;
                let (c, ct, ca) = ScalingTensor::quantize_with_t(&xc, &meta(&Device::Cpu)?)?;
                ok &= same(&format!("{what} amax"), &ga, &ca)?;
                ok &= same_scaled(&what, &g, &c)?;
                ok &= same_scaled(&format!("{what} transposed"), &gt, &ct)?;
                ok &= same(&format!("{what} = t()"), gt.data(), g.t()?.data())?;
                let r = CurrentScaling::default();
                let (g, gt, _) = ScalingTensor::quantize_t(&xg, qtype, &r)?;
                let (c, ct, _) = ScalingTensor::quantize_t(&xc, qtype, &r)?;
                ok &= same_scaled(&format!("{what} current"), &g, &c)?;
                ok &= same_scaled(&format!("{what} current transposed"), &gt, &ct)?;
            }
        }
        // from a scaled FP16 tensor's codes (an O2 weight): the kernel
        // decodes as it reads, the CPU dequantizes then casts
        let r = CurrentScaling::default();
        let (wc, _) = ScalingTensor::quantize(&x_cpu, QType::F16, &r)?;
        let (wg, _) = ScalingTensor::quantize(
            &xs.to_device(dev)?
                .narrow(0, offset, rows * cols)?
                .reshape((rows, cols))?,
            QType::F16,
            &r,
        )?;
        ok &= same_scaled(&format!("fp16 master {rows}x{cols}+{offset}"), &wg, &wc)?;
        for qtype in [QType::E4M3, QType::E5M2] {
            let what = format!("requantize-transpose {rows}x{cols}+{offset} F16 -> {qtype}");
            let (g, gt, ga) = wg.requantize_t(qtype, &r)?;
            let (c, ct, ca) = wc.requantize_t(qtype, &r)?;
            ok &= same(&format!("{what} amax"), &ga, &ca)?;
            ok &= same_scaled(&format!("{what} current"), &g, &c)?;
            ok &= same_scaled(&format!("{what} current transposed"), &gt, &ct)?;
            let meta = |d: &Device| -> Result<ScalingMeta> {
                Ok(ScalingMeta::new(qtype, 1, d)?.with_scale(3.0)?)
            };
            let (g, gt, ga) = wg.requantize_with_t(&meta(dev)?)?;
            let (c, ct, ca) = wc.requantize_with_t(&meta(&Device::Cpu)?)?;
            ok &= same(&format!("{what} delayed amax"), &ga, &ca)?;
            ok &= same_scaled(&format!("{what} delayed"), &g, &c)?;
            ok &= same_scaled(&format!("{what} delayed transposed"), &gt, &ct)?;
        }
    }
    ensure!(ok, "cast-transpose differs (see the lines above)");
    Ok(())
}

/// `ScalingTensor::requantize_t_many` (a model's FP16 weights cast to FP8
/// with their transposes in two launches) against each tensor's own
/// `requantize_t` on the same device, bit for bit: codes, transposed codes,
/// scale, scale_inv, amax, counts. Shapes with partial tiles and columns
/// not a multiple of 8, codes at an odd offset (no vector loads), inf and
/// NaN in one tensor only, scales that differ by tensor, both FP8 targets,
/// both scale rules and a margin; an E4M3 tensor among them takes the
/// per-tensor path (its F32 copy).
fn cast_t_many(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x3a11);
    let shapes = [
        (64usize, 64usize),
        (37, 70),
        (128, 96),
        (1024, 768),
        (3, 5),
        (256, 512),
    ];
    let mut tensors = Vec::new();
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        let scale = 10f32.powi(i as i32 - 2);
        let mut v: Vec<f32> = rng
            .normal(rows * cols + 1)
            .iter()
            .map(|x| x * scale)
            .collect();
        if i == 1 {
            v[5] = f32::INFINITY;
            v[9] = f32::NAN;
        }
        let x = Tensor::from_vec(v, rows * cols + 1, dev)?;
        let (w, _) = ScalingTensor::quantize(&x, QType::F16, &CurrentScaling::default())?;
        // the tensor at offset 1 (2 bytes: no 16-byte loads) for the last shape
        let at = usize::from(i + 1 == shapes.len());
        let data = w.data().narrow(0, at, rows * cols)?.reshape((rows, cols))?;
        tensors.push(ScalingTensor::from_parts(data, w.meta().clone())?);
    }
    let e4m3 = ScalingTensor::quantize(
        &Tensor::from_vec(rng.normal(64 * 32), (64, 32), dev)?,
        QType::E4M3,
        &CurrentScaling::default(),
    )?
    .0;
    let mut all: Vec<&ScalingTensor> = tensors.iter().collect();
    all.push(&e4m3);
    let mut ok = true;
    let recipes = [
        CurrentScaling::default(),
        CurrentScaling {
            margin: 1,
            scale_rule: ScaleRule::Te,
            ..Default::default()
        },
    ];
    for r in &recipes {
        for qtype in [QType::E4M3, QType::E5M2] {
            let many = ScalingTensor::requantize_t_many(&all, qtype, r)?;
            ensure!(many.len() == all.len(), "one result per tensor");
            for (i, (t, (q, qt, amax))) in all.iter().zip(&many).enumerate() {
                let what = format!("many[{i}] {:?} -> {qtype} {:?}", t.shape(), r.scale_rule);
                let (eq, eqt, eamax) = t.requantize_t(qtype, r)?;
                ok &= same(&format!("{what} amax"), amax, &eamax)?;
                ok &= same_scaled(&what, q, &eq)?;
                ok &= same_scaled(&format!("{what} transposed"), qt, &eqt)?;
            }
        }
    }
    ensure!(ok, "requantize_t_many differs (see the lines above)");
    Ok(())
}

/// `read_scalars` on the device against the CPU: F32 and F64 one-element
/// tensors mixed, views at offsets, NaN, inf, a subnormal, and more than
/// one launch's 256 values; equal bit for bit.
fn read_scalars(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x5ca1);
    let vals = rng.values(700, 1e3);
    let mut cpu: Vec<Tensor> = Vec::new();
    for (i, v) in vals.iter().enumerate() {
        let v = match i {
            3 => f32::NAN,
            4 => f32::INFINITY,
            5 => 1e-40,
            _ => *v,
        };
        cpu.push(if i % 3 == 0 {
            Tensor::new(&[f64::from(v) * 1.000_000_1], &Device::Cpu)?
        } else if i % 3 == 1 {
            Tensor::new(&[0.0f32, v, 1.0], &Device::Cpu)?.narrow(0, 1, 1)?
        } else {
            Tensor::new(&[[v]], &Device::Cpu)?
        });
    }
    // the offset stays on the device: narrow after the copy
    let on_dev: Vec<Tensor> = cpu
        .iter()
        .enumerate()
        .map(|(i, t)| -> Result<Tensor> {
            Ok(if i % 3 == 1 {
                let full = Tensor::new(&[0.0f32, t.to_vec1::<f32>()?[0], 1.0], dev)?;
                full.narrow(0, 1, 1)?
            } else {
                t.to_device(dev)?
            })
        })
        .collect::<Result<_>>()?;
    let c = amp::kernels::read_scalars(&cpu.iter().collect::<Vec<_>>())?;
    let g = amp::kernels::read_scalars(&on_dev.iter().collect::<Vec<_>>())?;
    ensure!(
        c.len() == g.len(),
        "{} values, the CPU read {}",
        g.len(),
        c.len()
    );
    for (i, (a, b)) in c.iter().zip(&g).enumerate() {
        ensure!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "value {i}: device {b:e}, cpu {a:e}"
        );
    }
    Ok(())
}

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

fn all_f32_to_e4m3(dev: &Device) -> Result<()> {
    all_f32(dev, QType::E4M3)
}
fn all_f32_to_e5m2(dev: &Device) -> Result<()> {
    all_f32(dev, QType::E5M2)
}
fn all_f32_to_f16(dev: &Device) -> Result<()> {
    all_f32(dev, QType::F16)
}

/// All 2^32 f32 inputs through quantize (scale 1) to `qtype`, in chunks of
/// 2^26: codes, amax and counts of every chunk, the device vs the CPU.
fn all_f32(dev: &Device, qtype: QType) -> Result<()> {
    let chunk = 1usize << 26;
    let threads = cores();
    let t0 = Instant::now();
    let dev_meta = ScalingMeta::new(qtype, 1, dev)?;
    let cpu_meta = ScalingMeta::new(qtype, 1, &Device::Cpu)?;
    let (mut bad, mut bad_meta, mut sat, mut flush) = (0u64, 0u64, 0u64, 0u64);
    let mut xs = vec![0f32; chunk];
    for c in 0..(1usize << 32) / chunk {
        let base = (c * chunk) as u32;
        for (i, x) in xs.iter_mut().enumerate() {
            *x = f32::from_bits(base.wrapping_add(i as u32));
        }
        let x = Tensor::from_slice(&xs, chunk, dev)?;
        let (q, amax) = ScalingTensor::quantize_with(&x, &dev_meta)?;
        let (g_codes, g_amax, g_sat, g_flush) = cast(&q, &amax)?;
        let (c_codes, c_amax, c_sat, c_flush) = cpu_quantize(&xs, &cpu_meta, threads)?;
        for i in (0..chunk).filter(|&i| g_codes[i] != c_codes[i]) {
            if bad < 8 {
                println!(
                    "  {qtype}: x = {:#010x}: device {:#06x} cpu {:#06x}",
                    base.wrapping_add(i as u32),
                    g_codes[i],
                    c_codes[i]
                );
            }
            bad += 1;
        }
        if (g_amax, g_sat, g_flush) != (c_amax, c_sat, c_flush) {
            println!(
                "  {qtype}: chunk {c}: amax device {g_amax:#x} cpu {c_amax:#x}, saturated {g_sat} / {c_sat}, flushed {g_flush} / {c_flush}"
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
    ensure!(
        bad == 0 && bad_meta == 0,
        "{bad} codes and {bad_meta} chunks' amax/counts differ"
    );
    Ok(())
}
