//! FP8 all-reduce: the result against the exact sum, scales bitwise equal on
//! every rank, the bytes on the wire, non-finite gradients, scaled inputs,
//! and the ZeRO halves.

use crate::rng::Rng;
use amp_comm::{
    fp8_all_gather, fp8_all_reduce, fp8_reduce_scatter, run_ranks, shard_range, Communicator,
    Error, Fp8ReduceConfig, Fp8Reduced,
};
use amp_core::{CurrentScaling, QType, ScaleRule, ScalingTensor};
use candle_core::{DType, Device, Tensor};

/// One round-to-nearest cast of a normal value errs by at most this much,
/// relative: 2^-(mantissa bits + 1).
const E4M3_REL: f64 = 1.0 / 16.0;
/// The same for E5M2 (2 mantissa bits).
const E5M2_REL: f64 = 1.0 / 8.0;
/// Relative slack for the F32 sum and the division by N (a few f32 ulps).
const F32_REL: f64 = 1e-6;

const SIZES: [usize; 3] = [1, 7, 1001];

fn rel(q: QType) -> f64 {
    match q {
        QType::E4M3 => E4M3_REL,
        _ => E5M2_REL,
    }
}

fn min_subnormal(q: QType) -> f64 {
    match q {
        QType::E4M3 => 2f64.powi(-9),
        _ => 2f64.powi(-16),
    }
}

fn cpu(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
}

/// Values on the format's grid times 2^-k, the largest being `max * 2^-k`
/// (on rank 0), so the agreed scale is 2^k and the first cast is exact.
fn exact_input(q: QType, rank: usize, len: usize) -> Vec<f32> {
    let fmt = q.fp8().unwrap();
    let k = if q == QType::E4M3 { 5 } else { 10 };
    let unit = 2f32.powi(-k);
    let mut rng = Rng::new(rank as u64 * 7919 + len as u64);
    let mut v: Vec<f32> = (0..len)
        .map(|_| loop {
            let x = fmt.decode(rng.next() as u8);
            if x.is_finite() && x.abs() >= 0.125 {
                break x * unit;
            }
        })
        .collect();
    if rank == 0 {
        v[len / 2] = -q.max() * unit;
    }
    v
}

/// Gradient-like values: random signs, magnitudes from 1e-3 to 10.
fn random_input(rank: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng::new(1000 + rank as u64);
    (0..len)
        .map(|_| {
            let mag = 10f64.powf(rng.unit() * 4.0 - 3.0);
            let sign = if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
            (sign * mag) as f32
        })
        .collect()
}

fn decoded(r: &Fp8Reduced) -> Vec<f32> {
    r.grad
        .dequantize(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// What must be bitwise equal on every rank: codes, scale, scale_inv, amaxes.
fn fingerprint(r: &Fp8Reduced) -> (Vec<u8>, u32, u32, u32, u32) {
    let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0].to_bits();
    (
        r.grad.data().flatten_all().unwrap().to_vec1().unwrap(),
        bits(r.grad.meta().scale()),
        bits(r.grad.meta().scale_inv()),
        bits(&r.grad.meta().amax().unwrap()),
        bits(&r.amax),
    )
}

#[test]
fn exact_inputs_give_one_rounding_of_the_exact_sum() {
    for q in [QType::E4M3, QType::E5M2] {
        let cfg = Fp8ReduceConfig {
            qtype: q,
            average: false,
            ..Default::default()
        };
        for world in 1..=4 {
            for len in SIZES {
                let exact: Vec<f64> = (0..len)
                    .map(|i| (0..world).map(|r| exact_input(q, r, len)[i] as f64).sum())
                    .collect();
                let sum: Vec<f32> = exact.iter().map(|&s| s as f32).collect();
                assert!(
                    exact.iter().zip(&sum).all(|(a, b)| *a == *b as f64),
                    "inputs not exact"
                );
                let (want, _) =
                    ScalingTensor::quantize(&cpu(&sum), q, &CurrentScaling::default()).unwrap();
                let want_values = want
                    .dequantize(DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let out = run_ranks(world, |comm| {
                    let g = cpu(&exact_input(q, comm.rank(), len));
                    fp8_all_reduce(&comm, &g, &cfg)
                })
                .unwrap();
                for (r, res) in out.iter().enumerate() {
                    let ctx = format!("{q} N={world} len={len} rank {r}");
                    assert!(res.is_finite().unwrap(), "{ctx}");
                    // one rounding of the exact sum at the result's scale,
                    // which comes from a bound of the sum's amax: never
                    // finer than the sum's own (nothing saturates), the
                    // same for one rank
                    let (at_scale, _) =
                        ScalingTensor::quantize_with(&cpu(&sum), res.grad.meta()).unwrap();
                    let at_scale = at_scale
                        .dequantize(DType::F32)
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap();
                    let got = decoded(res);
                    for (g, w) in got.iter().zip(&at_scale) {
                        assert_eq!(g.to_bits(), w.to_bits(), "{ctx}");
                    }
                    let (got_si, want_si) =
                        (res.grad.scale_inv().unwrap(), want.scale_inv().unwrap());
                    assert!(got_si >= want_si, "{ctx}: {got_si} < {want_si}");
                    if world == 1 {
                        for (g, w) in got.iter().zip(&want_values) {
                            assert_eq!(g.to_bits(), w.to_bits(), "{ctx}");
                        }
                        assert_eq!(got_si, want_si, "{ctx}");
                    }
                    assert_eq!(fingerprint(res), fingerprint(&out[0]), "{ctx}");
                }
            }
        }
    }
}

#[test]
fn random_gradients_stay_within_the_rounding_bound() {
    for q in [QType::E4M3, QType::E5M2] {
        for average in [false, true] {
            let cfg = Fp8ReduceConfig {
                qtype: q,
                average,
                ..Default::default()
            };
            for world in 1..=4 {
                let len = 1001;
                let inputs: Vec<Vec<f32>> = (0..world).map(|r| random_input(r, len)).collect();
                let amax = inputs.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
                let scale1 = ScaleRule::PowerOfTwo.compute(amax, 1.0, q.max(), 0) as f64;
                let out = run_ranks(world, |comm| {
                    fp8_all_reduce(&comm, &cpu(&inputs[comm.rank()]), &cfg)
                })
                .unwrap();
                let n = world as f64;
                let div = if average { n } else { 1.0 };
                let h2 = min_subnormal(q) * out[0].grad.scale_inv().unwrap() as f64;
                let got = decoded(&out[0]);
                let u = rel(q);
                for i in 0..len {
                    let exact: f64 = inputs.iter().map(|x| x[i] as f64).sum::<f64>() / div;
                    let abs_sum: f64 =
                        inputs.iter().map(|x| (x[i] as f64).abs()).sum::<f64>() / div;
                    // First cast on every rank, then the cast of the F32 result.
                    let first = u * abs_sum + n * min_subnormal(q) / scale1 / 2.0 / div;
                    let bound = first + u * (exact.abs() + first) + h2 / 2.0 + F32_REL * abs_sum;
                    let err = (got[i] as f64 - exact).abs();
                    assert!(
                        err <= bound,
                        "{q} avg={average} N={world} [{i}]: got {} exact {exact} err {err} > {bound}",
                        got[i]
                    );
                }
                for (r, res) in out.iter().enumerate() {
                    assert_eq!(fingerprint(res), fingerprint(&out[0]), "rank {r}");
                }
            }
        }
    }
}

#[test]
fn fp8_sends_a_quarter_of_the_f32_all_reduce() {
    let len = 100_003;
    for world in 1..=4 {
        let out = run_ranks(world, |comm| {
            let g = cpu(&random_input(comm.rank(), len));
            fp8_all_reduce(&comm, &g, &Fp8ReduceConfig::default())?;
            let fp8 = comm.bytes_sent();
            comm.reset_bytes_sent();
            comm.all_reduce_sum(&g)?;
            Ok::<_, Error>((fp8, comm.bytes_sent()))
        })
        .unwrap();
        let (n, l) = (world as u64, len as u64);
        for (r, (fp8, f32_bytes)) in out.into_iter().enumerate() {
            let own = (len / world + usize::from(r < len % world)) as u64;
            let data = l - own + (n - 1) * own;
            // The scale's and the amax's gather (8 bytes to each other
            // rank).
            let scalars = 8 * (n - 1);
            let _ = r;
            assert_eq!(f32_bytes, 4 * data, "N={world} rank {r}");
            assert_eq!(fp8, data + scalars, "N={world} rank {r}");
            if world > 1 {
                let ratio = fp8 as f64 / f32_bytes as f64;
                assert!(
                    (0.25..0.2501).contains(&ratio),
                    "N={world} rank {r}: {ratio}"
                );
            }
        }
    }
}

#[test]
fn a_non_finite_gradient_on_one_rank_is_seen_by_every_rank() {
    let out = run_ranks(3, |comm| {
        let mut flags = Vec::new();
        for (bad_rank, bad) in [
            (1, f32::NAN),
            (2, f32::INFINITY),
            (0, f32::NEG_INFINITY),
            (9, 0.0),
        ] {
            let mut g = random_input(comm.rank(), 7);
            if comm.rank() == bad_rank {
                g[3] = bad;
            }
            for q in [QType::E4M3, QType::E5M2] {
                let cfg = Fp8ReduceConfig {
                    qtype: q,
                    ..Default::default()
                };
                flags.push(fp8_all_reduce(&comm, &cpu(&g), &cfg)?.is_finite()?);
            }
        }
        Ok::<_, Error>(flags)
    })
    .unwrap();
    for flags in out {
        assert_eq!(
            flags,
            [false, false, false, false, false, false, true, true]
        );
    }
}

#[test]
fn scaled_gradients_with_per_rank_scales_are_accepted() {
    let cfg = Fp8ReduceConfig::default();
    let out = run_ranks(3, |comm| {
        let r = comm.rank();
        let g: Vec<f32> = random_input(r, 1001)
            .iter()
            .map(|x| x * (1 << (3 * r)) as f32)
            .collect();
        let (st, _) = ScalingTensor::quantize(&cpu(&g), QType::E4M3, &CurrentScaling::default())?;
        let from_scaled = fp8_all_reduce(&comm, &st, &cfg)?;
        let from_f32 = fp8_all_reduce(&comm, &st.dequantize(DType::F32)?, &cfg)?;
        Ok::<_, Error>((
            st.scale_inv()?,
            fingerprint(&from_scaled),
            fingerprint(&from_f32),
        ))
    })
    .unwrap();
    assert_ne!(out[0].0, out[2].0, "the ranks' own scales should differ");
    for (_, scaled, f32_path) in &out {
        assert_eq!(scaled, f32_path);
        assert_eq!(scaled, &out[0].1);
    }
}

#[test]
fn zero_halves_shard_and_gather() {
    let shape = (7, 143);
    let len = 7 * 143;
    let w = random_input(42, len);
    let (want, _) =
        ScalingTensor::quantize(&cpu(&w), QType::E4M3, &CurrentScaling::default()).unwrap();
    let want = fingerprint_tensor(&want);
    for world in 1..=4 {
        let out = run_ranks(world, |comm| {
            let r = comm.rank();
            let range = shard_range(len, r, world);
            let gathered =
                fp8_all_gather(&comm, &cpu(&w[range.clone()]), shape, &Default::default())?;
            let g = Tensor::from_slice(&random_input(r, len), shape, &Device::Cpu)?;
            let shard = fp8_reduce_scatter(&comm, &g, &Default::default())?;
            let full = fp8_all_reduce(&comm, &g, &Default::default())?;
            let full = full.grad.dequantize(DType::F32)?.flatten_all()?;
            let mine = full.narrow(0, range.start, range.len())?.to_vec1::<f32>()?;
            Ok::<_, Error>((
                gathered.grad.shape().dims().to_vec(),
                fingerprint_tensor(&gathered.grad),
                shard.range == range && shard.shard.dims() == [range.len()],
                shard.shard.to_vec1::<f32>()?,
                mine,
                shard.is_finite()?,
            ))
        })
        .unwrap();
        for (r, (dims, fp, range_ok, shard, mine, finite)) in out.into_iter().enumerate() {
            assert_eq!(dims, [7, 143]);
            assert_eq!(
                fp, want,
                "N={world} rank {r}: gather = one cast of the whole tensor"
            );
            assert!(range_ok && finite, "N={world} rank {r}");
            // The F32 shard, cast once, is the all-reduce's chunk.
            for (s, m) in shard.iter().zip(&mine) {
                assert!((s - m).abs() <= E4M3_REL as f32 * s.abs() + 1e-3, "{s} {m}");
            }
        }
    }
}

fn fingerprint_tensor(t: &ScalingTensor) -> (Vec<u8>, f32) {
    (
        t.data().flatten_all().unwrap().to_vec1().unwrap(),
        t.scale_inv().unwrap(),
    )
}
