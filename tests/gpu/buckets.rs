//! The bucketed FP8 reduction's kernels (`amp::kernels::bucket_*`,
//! `amp::kernels::decode_sum`)
//! on the device against their CPU bodies, bit for bit: several tensors of
//! odd lengths (one with a NaN code, one empty), both FP8 formats, pieces
//! at odd offsets, 1 to 5 ranks' chunks, with and without averaging; a
//! requantize also on a [`SideStream`].

use crate::util::{same, Rng};
use amp::cuda::SideStream;
use amp::kernels::{
    bucket_amax, bucket_column_max, bucket_concat, bucket_copy, bucket_copy_from,
    bucket_decode_amax, bucket_decode_sum, bucket_decode_sum_quantize, bucket_flag_scale_inv,
    bucket_max, bucket_mean_bound, bucket_quantize, bucket_requantize, bucket_scales,
    bucket_scales_sent, decode_sum, Piece,
};
use amp::{CurrentScaling, QType, ScaleRule, ScalingTensor};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};

/// `same`, every NaN counted as one (the CPU's and the GPU's NaNs carry
/// other payloads: x86 keeps an operand's, CUDA makes its own).
fn same_nan(what: &str, on_dev: &Tensor, cpu: &Tensor) -> Result<bool> {
    let canon = |t: &Tensor| -> Result<Tensor> {
        let t = t.to_device(&Device::Cpu)?.flatten_all()?;
        let v: Vec<f32> = t.to_vec1::<f32>()?;
        let v: Vec<f32> = v
            .into_iter()
            .map(|x| if x.is_nan() { f32::NAN } else { x })
            .collect();
        Ok(Tensor::new(v, &Device::Cpu)?)
    };
    same(what, &canon(on_dev)?, &canon(cpu)?)
}

fn refs(v: &[Tensor]) -> Vec<&Tensor> {
    v.iter().collect()
}

test_device!(bucket_kernels, bucket_kernels_cpu, bucket_kernels_cuda);

/// A scaling tensor of `n` random values of `decades` decades (the first
/// code NaN with `nan`), on the CPU and on `dev`.
fn scaled(
    rng: &mut Rng,
    n: usize,
    qtype: QType,
    nan: bool,
    dev: &Device,
) -> Result<(ScalingTensor, ScalingTensor)> {
    let mut xs = rng.values(n, 6.0);
    if nan && n > 0 {
        xs[0] = f32::NAN;
    }
    let x = Tensor::from_vec(xs, n, &Device::Cpu)?;
    let (c, _) = ScalingTensor::quantize(&x, qtype, &CurrentScaling::default())?;
    let g = ScalingTensor::from_parts(c.data().to_device(dev)?, {
        let m = c.meta();
        amp::ScalingMeta::from_parts(
            qtype,
            m.scale().to_device(dev)?,
            m.scale_inv().to_device(dev)?,
            m.amax_history().to_device(dev)?,
        )?
    })?;
    Ok((c, g))
}

fn bucket_kernels(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(0xB0C4E7);
    // None off CUDA.
    let side = SideStream::new(dev)?;
    for qtype in [QType::E4M3, QType::E5M2] {
        let lens = [1001usize, 7, 0, 65_537, 3];
        let mut cpu = Vec::new();
        let mut gpu = Vec::new();
        for (i, &n) in lens.iter().enumerate() {
            let (c, g) = scaled(&mut rng, n, qtype, i == 1, dev)?;
            cpu.push(c);
            gpu.push(g);
        }
        let codes = |v: &[ScalingTensor]| v.iter().map(|t| t.data().clone()).collect::<Vec<_>>();
        let sinvs = |v: &[ScalingTensor]| {
            v.iter()
                .map(|t| t.meta().scale_inv().clone())
                .collect::<Vec<_>>()
        };
        let (cc, cs, gc, gs) = (codes(&cpu), sinvs(&cpu), codes(&gpu), sinvs(&gpu));
        let what = format!("{qtype}");
        let ac = bucket_amax(&refs(&cc), &refs(&cs), qtype)?;
        let ag = bucket_amax(&refs(&gc), &refs(&gs), qtype)?;
        ok &= same(&format!("{what} bucket_amax"), &ag, &ac)?;
        for rule in [ScaleRule::PowerOfTwo, ScaleRule::Te] {
            let (sc, sic) = bucket_scales(&ac, qtype, rule, 1)?;
            let (sg, sig) = bucket_scales(&ag, qtype, rule, 1)?;
            ok &= same(&format!("{what} {rule:?} bucket_scales"), &sg, &sc)?;
            ok &= same(&format!("{what} {rule:?} bucket_scales inv"), &sig, &sic)?;
            let pieces = [
                Piece {
                    tensor: 3,
                    start: 17,
                    len: 40_000,
                },
                Piece {
                    tensor: 0,
                    start: 0,
                    len: 1001,
                },
                Piece {
                    tensor: 4,
                    start: 1,
                    len: 2,
                },
                Piece {
                    tensor: 1,
                    start: 0,
                    len: 7,
                },
            ];
            let (mc, mg) = (bucket_max(&sc, &sic)?, bucket_max(&sg, &sig)?);
            ok &= same(&format!("{what} {rule:?} bucket_max"), &mg, &mc)?;
            for p in [None, Some(&pieces[..])] {
                for pad in [None, Some(50_000)] {
                    let rc = bucket_requantize(&refs(&cc), &refs(&cs), qtype, &sc, p, None, pad)?;
                    let rg = bucket_requantize(&refs(&gc), &refs(&gs), qtype, &sg, p, None, pad)?;
                    let w = format!("{what} {rule:?} bucket_requantize {} {pad:?}", p.is_some());
                    ok &= same(&w, &rg, &rc)?;
                    // The same launch on a side stream, fenced both ways.
                    if let Some(side) = &side {
                        let rs = side.run(|| {
                            bucket_requantize(&refs(&gc), &refs(&gs), qtype, &sg, p, None, pad)
                        })?;
                        ok &= same(&format!("{w} on a side stream"), &rs, &rc)?;
                    }
                }
            }
            // chunks: N ranks' codes of one length, pieces at odd offsets
            for ranks in 1..=5usize {
                let len = 30_011;
                let chunks: Vec<Tensor> = (0..ranks)
                    .map(|r| {
                        let v: Vec<u8> = (0..len).map(|i| ((i * 7 + r * 13) % 256) as u8).collect();
                        Tensor::from_vec(v, len, &Device::Cpu)
                    })
                    .collect::<candle_core::Result<_>>()?;
                let gchunks = chunks
                    .iter()
                    .map(|c| c.to_device(dev))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                let dp = [
                    Piece {
                        tensor: 2,
                        start: 3,
                        len: 20_000,
                    },
                    Piece {
                        tensor: 0,
                        start: 20_003,
                        len: 10_000,
                    },
                ];
                for average in [false, true] {
                    let w = format!("{what} {rule:?} {ranks} ranks avg {average}");
                    let (sumc, amc) = bucket_decode_sum(&chunks, &sic, qtype, average, &dp)?;
                    let (sumg, amg) = bucket_decode_sum(&gchunks, &sig, qtype, average, &dp)?;
                    ok &= same(&format!("{w} bucket_decode_sum"), &sumg, &sumc)?;
                    ok &= same(&format!("{w} bucket_decode_sum amax"), &amg, &amc)?;
                    let qp = [
                        Piece {
                            tensor: 2,
                            start: 0,
                            len: 20_000,
                        },
                        Piece {
                            tensor: 0,
                            start: 20_000,
                            len: 10_000,
                        },
                    ];
                    let qc = bucket_quantize(&sumc, &sc, qtype, &qp)?;
                    let qg = bucket_quantize(&sumg, &sg, qtype, &qp)?;
                    ok &= same(&format!("{w} bucket_quantize"), &qg, &qc)?;
                    // The two passes without F32 sums: the amaxes and the
                    // codes of bucket_decode_sum + bucket_quantize, also with
                    // pieces whose codes land at odd offsets.
                    let odd = [
                        Piece {
                            tensor: 1,
                            start: 1,
                            len: 19_999,
                        },
                        Piece {
                            tensor: 2,
                            start: 20_000,
                            len: 10_001,
                        },
                    ];
                    for pieces in [&dp[..], &odd[..]] {
                        let (sums, amaxes) =
                            bucket_decode_sum(&chunks, &sic, qtype, average, pieces)?;
                        let mut at = 0;
                        let renumbered: Vec<Piece> = pieces
                            .iter()
                            .map(|p| {
                                at += p.len;
                                Piece {
                                    start: at - p.len,
                                    ..*p
                                }
                            })
                            .collect();
                        let codes = bucket_quantize(&sums, &sc, qtype, &renumbered)?;
                        let ag = bucket_decode_amax(&gchunks, &sig, qtype, average, pieces)?;
                        let cg = bucket_decode_sum_quantize(
                            &gchunks, &sig, qtype, average, pieces, &sg,
                        )?;
                        let cc =
                            bucket_decode_sum_quantize(&chunks, &sic, qtype, average, pieces, &sc)?;
                        let w = format!("{w} pieces at {}", pieces[0].start);
                        ok &= same(&format!("{w} bucket_decode_amax"), &ag, &amaxes)?;
                        ok &= same(&format!("{w} bucket_decode_sum_quantize"), &cg, &codes)?;
                        ok &= same(
                            &format!("{w} bucket_decode_sum_quantize (CPU)"),
                            &cc,
                            &codes,
                        )?;
                    }
                    let s1 = sic.narrow(0, 0, 1)?;
                    let (dc, dac) = decode_sum(&chunks, &s1, qtype, average)?;
                    let (dg, dag) = decode_sum(&gchunks, &s1.to_device(dev)?, qtype, average)?;
                    ok &= same(&format!("{w} decode_sum"), &dg, &dc)?;
                    ok &= same(&format!("{w} decode_sum amax"), &dag, &dac)?;
                    // Each rank's own scales ([N, T]: rank r's times
                    // 2^(r % 3)), the last rank's first one NaN (its
                    // non-finite flag), as the all-reduce decodes them.
                    let si = sic.to_vec1::<f32>()?;
                    let t = si.len();
                    let per: Vec<f32> = (0..ranks)
                        .flat_map(|r| {
                            si.iter().enumerate().map(move |(i, s)| {
                                if ranks > 1 && r == ranks - 1 && i == 0 {
                                    f32::NAN
                                } else {
                                    s * (1u32 << (r % 3)) as f32
                                }
                            })
                        })
                        .collect();
                    let pc = Tensor::from_vec(per, (ranks, t), &Device::Cpu)?;
                    let pg = pc.to_device(dev)?;
                    let w = format!("{w} own scales");
                    let (sumc, amc) = bucket_decode_sum(&chunks, &pc, qtype, average, &dp)?;
                    let (sumg, amg) = bucket_decode_sum(&gchunks, &pg, qtype, average, &dp)?;
                    ok &= same_nan(&format!("{w} bucket_decode_sum"), &sumg, &sumc)?;
                    ok &= same(&format!("{w} bucket_decode_sum amax"), &amg, &amc)?;
                    let ag = bucket_decode_amax(&gchunks, &pg, qtype, average, &dp)?;
                    ok &= same(&format!("{w} bucket_decode_amax"), &ag, &amc)?;
                    let cc = bucket_decode_sum_quantize(&chunks, &pc, qtype, average, &dp, &sc)?;
                    let cg = bucket_decode_sum_quantize(&gchunks, &pg, qtype, average, &dp, &sg)?;
                    ok &= same(&format!("{w} bucket_decode_sum_quantize"), &cg, &cc)?;
                    let col = pc.narrow(1, 2, 1)?.flatten_all()?;
                    let (dc, dac) = decode_sum(&chunks, &col, qtype, average)?;
                    let (dg, dag) = decode_sum(&gchunks, &col.to_device(dev)?, qtype, average)?;
                    ok &= same_nan(&format!("{w} decode_sum"), &dg, &dc)?;
                    ok &= same_nan(&format!("{w} decode_sum amax"), &dag, &dac)?;
                }
            }
        }
    }
    // ZeRO's chunks cut straight from several tensors' codes, and the
    // agreed amaxes of a gathered [N, 2T] (NaN counted as inf).
    let srcs: Vec<Tensor> = (0..3usize)
        .map(|t| {
            let v: Vec<u8> = (0..1000 + 77 * t)
                .map(|i| ((i * 31 + t) % 256) as u8)
                .collect();
            Tensor::new(v, &Device::Cpu)
        })
        .collect::<candle_core::Result<_>>()?;
    let gsrcs = srcs
        .iter()
        .map(|c| c.to_device(dev))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let cut = [
        Piece {
            tensor: 2,
            start: 5,
            len: 900,
        },
        Piece {
            tensor: 0,
            start: 0,
            len: 1000,
        },
        Piece {
            tensor: 1,
            start: 1076,
            len: 1,
        },
    ];
    let (cc, cg) = (
        bucket_copy_from(&refs(&srcs), &cut)?,
        bucket_copy_from(&refs(&gsrcs), &cut)?,
    );
    ok &= same("bucket_copy_from", &cg, &cc)?;
    let m: Vec<f32> = (0..5 * 8)
        .map(|i| match i % 11 {
            4 => f32::NAN,
            7 => f32::INFINITY,
            _ => (i as f32) * 0.25,
        })
        .collect();
    let mc = Tensor::from_vec(m, (5, 8), &Device::Cpu)?;
    let (xc, xg) = (
        bucket_column_max(&mc, 4, 4)?,
        bucket_column_max(&mc.to_device(dev)?, 4, 4)?,
    );
    ok &= same("bucket_column_max", &xg, &xc)?;
    for average in [false, true] {
        let (bc, bg) = (
            bucket_mean_bound(&mc, 4, 4, average)?,
            bucket_mean_bound(&mc.to_device(dev)?, 4, 4, average)?,
        );
        ok &= same(&format!("bucket_mean_bound avg {average}"), &bg, &bc)?;
    }
    // What a rank sends: flagged scale_invs and its codes' exact amaxes,
    // for each format (amaxes finite, inf, NaN, zero, and above the
    // format's range at the scale: saturated).
    for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
        let vals = |d: &Device, f: &dyn Fn(usize) -> f32| -> Result<Vec<Tensor>> {
            Ok((0..70)
                .map(|i| Tensor::new(&[f(i)], d))
                .collect::<candle_core::Result<Vec<_>>>()?)
        };
        let amax = |i: usize| match i % 9 {
            2 => f32::INFINITY,
            4 => f32::NAN,
            6 => 0.0,
            _ => 0.37 * (i as f32 + 1.0),
        };
        let scale = |i: usize| {
            if i % 5 == 0 {
                1e6
            } else {
                2f32.powi((i % 7) as i32)
            }
        };
        let sent = |d: &Device| -> Result<Tensor> {
            let (si, sc, am) = (
                vals(d, &|i| 1.0 / scale(i))?,
                vals(d, &scale)?,
                vals(d, &amax)?,
            );
            Ok(bucket_scales_sent(
                &refs(&si),
                &refs(&sc),
                &refs(&am),
                qtype,
            )?)
        };
        let (sc, sg) = (sent(&Device::Cpu)?, sent(dev)?);
        ok &= same_nan(&format!("bucket_scales_sent {qtype:?}"), &sg, &sc)?;
    }
    // The scales a rank sends: scale_inv, NaN where the amax is not finite.
    let sinvs: Vec<f32> = (0..70).map(|i| 2f32.powi(i % 9 - 4)).collect();
    let amaxes: Vec<f32> = (0..70)
        .map(|i| match i % 7 {
            3 => f32::INFINITY,
            5 => f32::NAN,
            _ => i as f32,
        })
        .collect();
    let one = |v: f32, d: &Device| Tensor::new(&[v], d);
    let flags = |d: &Device| -> Result<Tensor> {
        let s = sinvs
            .iter()
            .map(|&v| one(v, d))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let a = amaxes
            .iter()
            .map(|&v| one(v, d))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(bucket_flag_scale_inv(&refs(&s), &refs(&a))?)
    };
    let (fc, fg) = (flags(&Device::Cpu)?, flags(dev)?);
    ok &= same_nan("bucket_flag_scale_inv", &fg, &fc)?;
    let v = fc.to_vec1::<f32>()?;
    ensure!(
        v.iter().enumerate().all(|(i, x)| match i % 7 {
            3 | 5 => x.is_nan(),
            _ => *x == sinvs[i],
        }),
        "bucket_flag_scale_inv: {v:?}"
    );
    ensure!(ok, "the bucket kernels differ from the CPU");
    Ok(())
}

test_device!(bucket_copies, bucket_copies_cpu, bucket_copies_cuda);

/// `bucket_concat` (every dtype it takes, parts at odd offsets into a
/// larger tensor, so that few line up for 16-byte copies, more than one
/// launch of parts) against `Tensor::cat`, and `bucket_copy`'s pieces at
/// odd offsets against the bytes cut on the host.
fn bucket_copies(dev: &Device) -> Result<()> {
    let mut ok = true;
    let mut rng = Rng(0xC0_9135);
    let base = Tensor::from_vec(rng.values(300_017, 3.0), 300_017, &Device::Cpu)?;
    let cuts = (0..70usize).map(|i| {
        (
            i * 4_111 + i % 7,
            (i * i * 37) % 3_001 + usize::from(i == 3) * 100_000,
        )
    });
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::U8] {
        let host = match dtype {
            DType::U8 => base.abs()?.affine(60.0, 0.0)?.to_dtype(DType::U8)?,
            _ => base.to_dtype(dtype)?,
        };
        let on_dev = host.to_device(dev)?;
        let parts_c: Vec<Tensor> = cuts
            .clone()
            .map(|(s, l)| host.narrow(0, s, l))
            .collect::<candle_core::Result<_>>()?;
        let parts_d: Vec<Tensor> = cuts
            .clone()
            .map(|(s, l)| on_dev.narrow(0, s, l))
            .collect::<candle_core::Result<_>>()?;
        let want = Tensor::cat(&parts_c, 0)?;
        let got = bucket_concat(&refs(&parts_d))?;
        ok &= same(&format!("bucket_concat {dtype:?}"), &got, &want)?;
        // a 2-D part is taken flat
        let two = on_dev.narrow(0, 5, 12)?.reshape((3, 4))?;
        let got = bucket_concat(&[&two, &parts_d[1]])?;
        let want = Tensor::cat(&[&host.narrow(0, 5, 12)?, &parts_c[1]], 0)?;
        ok &= same(&format!("bucket_concat {dtype:?} 2-D"), &got, &want)?;
    }
    ensure!(
        bucket_concat(&[]).is_err()
            && bucket_concat(&[&base, &base.to_dtype(DType::BF16)?]).is_err(),
        "bucket_concat took no parts or mixed dtypes"
    );
    let bytes = base.abs()?.affine(60.0, 0.0)?.to_dtype(DType::U8)?;
    let pieces: Vec<Piece> = cuts
        .clone()
        .enumerate()
        .map(|(t, (start, len))| Piece {
            tensor: t,
            start,
            len,
        })
        .collect();
    let want = Tensor::cat(
        &cuts
            .map(|(s, l)| bytes.narrow(0, s, l))
            .collect::<candle_core::Result<Vec<_>>>()?,
        0,
    )?;
    let got = bucket_copy(&bytes.to_device(dev)?, &pieces)?;
    ok &= same("bucket_copy", &got, &want)?;
    ensure!(ok, "the bucket copies differ from the CPU's");
    Ok(())
}
