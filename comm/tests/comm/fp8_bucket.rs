//! The bucketed FP8 all-reduce against `fp8_all_reduce` of each tensor
//! alone, run side by side on the same ranks: bitwise the same results
//! (codes, scales, amaxes, finiteness), four collectives instead of four
//! per tensor, and the bytes of the documented formula.

use crate::rng::Rng;
use amp_comm::{
    fp8_all_reduce, fp8_all_reduce_bucket, run_ranks, shard_len, Communicator, Error,
    Fp8ReduceConfig, Fp8Reduced, Grad, ReduceOp,
};
use amp_core::{CurrentScaling, QType, ScalingTensor};
use candle_core::{DType, Device, Tensor};
use proptest::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A communicator that counts the collectives called through it.
pub(crate) struct Counting<'a, C> {
    inner: &'a C,
    calls: AtomicUsize,
}

impl<'a, C: Communicator> Counting<'a, C> {
    pub(crate) fn new(inner: &'a C) -> Self {
        Self {
            inner,
            calls: AtomicUsize::new(0),
        }
    }
    fn tick(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
    /// Collectives and bytes since the last call, and starts counting anew.
    pub(crate) fn take(&self) -> (usize, u64) {
        let out = (
            self.calls.swap(0, Ordering::Relaxed),
            self.inner.bytes_sent(),
        );
        self.inner.reset_bytes_sent();
        out
    }
}

impl<C: Communicator> Communicator for Counting<'_, C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn device(&self) -> &Device {
        self.inner.device()
    }
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> amp_comm::Result<Tensor> {
        self.tick();
        self.inner.all_reduce(x, op)
    }
    fn reduce_scatter(&self, x: &Tensor, op: ReduceOp) -> amp_comm::Result<Tensor> {
        self.tick();
        self.inner.reduce_scatter(x, op)
    }
    fn all_gather(&self, x: &Tensor) -> amp_comm::Result<Tensor> {
        self.tick();
        self.inner.all_gather(x)
    }
    fn all_gather_shards(&self, shard: &Tensor, len: usize) -> amp_comm::Result<Tensor> {
        self.tick();
        self.inner.all_gather_shards(shard, len)
    }
    fn broadcast(&self, x: &Tensor, root: usize) -> amp_comm::Result<Tensor> {
        self.tick();
        self.inner.broadcast(x, root)
    }
    fn all_to_all(&self, chunks: &[Tensor]) -> amp_comm::Result<Vec<Tensor>> {
        self.tick();
        self.inner.all_to_all(chunks)
    }
    fn barrier(&self) -> amp_comm::Result<()> {
        self.tick();
        self.inner.barrier()
    }
    fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent()
    }
    fn reset_bytes_sent(&self) {
        self.inner.reset_bytes_sent()
    }
}

/// One tensor of a bucket: its shape, its values' magnitude (`2^exp`), and
/// a value every rank's copy holds at `bad.1` on rank `bad.0` (inf, NaN).
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    pub(crate) dims: Vec<usize>,
    pub(crate) exp: i32,
    pub(crate) zero: bool,
    pub(crate) bad: Option<(usize, usize, f32)>,
    pub(crate) seed: u64,
}

impl Spec {
    pub(crate) fn new(dims: &[usize], exp: i32) -> Self {
        Self {
            dims: dims.to_vec(),
            exp,
            zero: false,
            bad: None,
            seed: 0,
        }
    }
    pub(crate) fn len(&self) -> usize {
        self.dims.iter().product()
    }
    /// Rank `rank`'s gradient: random signs, magnitudes `2^exp * [1e-3, 10)`.
    pub(crate) fn tensor(&self, t: usize, rank: usize) -> Tensor {
        let mut rng = Rng::new(self.seed ^ (t as u64 * 1_000_003 + rank as u64 * 7919 + 17));
        let scale = 2f64.powi(self.exp);
        let mut v: Vec<f32> = (0..self.len())
            .map(|_| {
                if self.zero {
                    return 0.0;
                }
                let mag = 10f64.powf(rng.unit() * 4.0 - 3.0) * scale;
                let sign = if rng.next() & 1 == 0 { 1.0 } else { -1.0 };
                (sign * mag) as f32
            })
            .collect();
        if let Some((r, i, x)) = self.bad {
            if r == rank && i < v.len() {
                v[i] = x;
            }
        }
        Tensor::from_vec(v, self.dims.as_slice(), &Device::Cpu).unwrap()
    }
}

/// Everything that must be bitwise equal: codes, dims, scale, scale_inv,
/// the result's amax, the call's amax, finiteness.
pub(crate) type Print = (Vec<u8>, Vec<usize>, u32, u32, u32, u32, bool);

pub(crate) fn print(r: &Fp8Reduced) -> Print {
    let bits = |t: &Tensor| {
        let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v.len(), 1);
        v[0].to_bits()
    };
    (
        r.grad.data().flatten_all().unwrap().to_vec1().unwrap(),
        r.grad.shape().dims().to_vec(),
        bits(r.grad.meta().scale()),
        bits(r.grad.meta().scale_inv()),
        bits(&r.grad.meta().amax().unwrap()),
        bits(&r.amax),
        r.is_finite().unwrap(),
    )
}

/// One rank's outcome: the per-tensor and the bucketed results, and the
/// collectives and bytes of each way.
struct RankOut {
    single: Vec<Print>,
    bucket: Vec<Print>,
    single_cost: (usize, u64),
    bucket_cost: (usize, u64),
}

/// The documented bytes of rank `r`: the bucket's and the separate calls'
/// (`one_shot`: the bucket's codes whole to every other rank).
fn expected_bytes(lens: &[usize], world: usize, r: usize, one_shot: bool) -> (u64, u64) {
    let (t, n) = (lens.len() as i64, world as i64);
    let l: usize = lens.iter().sum();
    let s_r = shard_len(l, r, world) as i64;
    let big_s_r: i64 = lens.iter().map(|&lt| shard_len(lt, r, world) as i64).sum();
    // the scales' and amaxes' gather (2 F32 a tensor to each other rank),
    // the codes
    let bucket = if one_shot {
        8 * (n - 1) * t + (n - 1) * l as i64
    } else {
        8 * (n - 1) * t + l as i64 + (n - 2) * s_r
    };
    let single = 8 * (n - 1) * t + l as i64 + (n - 2) * big_s_r;
    (bucket as u64, single as u64)
}

/// Runs both ways on `world` ranks and checks everything; returns the
/// finiteness of each tensor's result.
fn check(world: usize, specs: &[Spec], cfg: &Fp8ReduceConfig) -> Vec<bool> {
    check_with(world, specs, cfg, false)
}

/// [`check`], with `scaled` the gradients as scaling tensors of the
/// configured format (as the layers' sinks hold them: the bucket then runs
/// every step a bucket at a time).
fn check_with(world: usize, specs: &[Spec], cfg: &Fp8ReduceConfig, scaled: bool) -> Vec<bool> {
    let ctx = format!("N={world} scaled={scaled} {cfg:?} {specs:?}");
    let out = run_ranks(world, |comm| {
        let floats: Vec<Tensor> = (0..specs.len())
            .map(|t| specs[t].tensor(t, comm.rank()))
            .collect();
        let sts = floats
            .iter()
            .map(|f| Ok(ScalingTensor::quantize(f, cfg.qtype, &CurrentScaling::default())?.0))
            .collect::<Result<Vec<_>, Error>>()?;
        let grads: Vec<Grad> = if scaled {
            sts.iter().map(Grad::from).collect()
        } else {
            floats.iter().map(Grad::from).collect()
        };
        let counting = Counting::new(&comm);
        counting.take();
        let single = grads
            .iter()
            .map(|g| fp8_all_reduce(&counting, *g, cfg))
            .collect::<Result<Vec<_>, Error>>()?;
        let single_cost = counting.take();
        let bucket = fp8_all_reduce_bucket(&counting, grads.iter().copied(), cfg)?;
        let bucket_cost = counting.take();
        Ok::<_, Error>(RankOut {
            single: single.iter().map(print).collect(),
            bucket: bucket.iter().map(print).collect(),
            single_cost,
            bucket_cost,
        })
    })
    .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let lens: Vec<usize> = specs.iter().map(Spec::len).collect();
    let t = specs.len();
    // one shot where the bucket runs a bucket at a time (scaled inputs)
    let one_shot = cfg.one_shot && scaled && world > 1;
    let (mut total_bucket, mut total_single) = (0, 0);
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.bucket.len(), t, "{ctx}");
        for (i, (b, s)) in o.bucket.iter().zip(&o.single).enumerate() {
            assert_eq!(b, s, "{ctx}: rank {r} tensor {i}");
            assert_eq!(b, &out[0].bucket[i], "{ctx}: rank {r} tensor {i} vs rank 0");
        }
        let (want_bucket, want_single) = expected_bytes(&lens, world, r, one_shot);
        // the exchange of codes and scales (two calls here: the counting
        // communicator sends them apart; NCCL's in one group) and the
        // all-gather, for a tensor and for a bucket (no all-gather in one
        // shot)
        assert_eq!(o.single_cost, (3 * t, want_single), "{ctx}: rank {r}");
        let calls = if one_shot { 2 } else { 3 };
        assert_eq!(
            o.bucket_cost,
            (
                if t == 0 { 0 } else { calls },
                if t == 0 { 0 } else { want_bucket }
            ),
            "{ctx}: rank {r}"
        );
        total_bucket += o.bucket_cost.1;
        total_single += o.single_cost.1;
    }
    if one_shot {
        // (N - 1) L a rank: the same bytes in all at N = 2 only
        if world == 2 {
            assert_eq!(total_bucket, total_single, "{ctx}");
        }
        return out[0].bucket.iter().map(|p| p.6).collect();
    }
    // The same bytes in all; the busiest rank (0) sends no more.
    assert_eq!(total_bucket, total_single, "{ctx}");
    assert!(out[0].bucket_cost.1 <= out[0].single_cost.1, "{ctx}");
    let max = |f: fn(&RankOut) -> u64| out.iter().map(f).max().unwrap_or(0);
    assert!(
        max(|o| o.bucket_cost.1) <= max(|o| o.single_cost.1),
        "{ctx}"
    );
    out[0].bucket.iter().map(|p| p.6).collect()
}

fn configs() -> [Fp8ReduceConfig; 3] {
    [
        Fp8ReduceConfig::default(),
        Fp8ReduceConfig {
            qtype: QType::E5M2,
            average: false,
            ..Default::default()
        },
        Fp8ReduceConfig {
            margin: 2,
            ..Default::default()
        },
    ]
}

/// Tensors of odd shapes and far-apart magnitudes, some smaller than a
/// world of 4.
pub(crate) fn odd_specs() -> [Spec; 5] {
    [
        Spec::new(&[7], 0),
        Spec::new(&[1], 5),
        Spec::new(&[3, 5], -12),
        Spec::new(&[13], 9),
        Spec::new(&[2, 3, 3], -30),
    ]
}

/// A random inf or NaN (`bad`: which tensor, rank, element, NaN) planted in
/// `specs` where it lands inside the world and the tensor; each tensor's
/// expected finiteness after the reduction.
pub(crate) fn plant(
    specs: &mut [Spec],
    world: usize,
    bad: Option<(prop::sample::Index, usize, usize, bool)>,
) -> Vec<bool> {
    let mut want = vec![true; specs.len()];
    if let Some((t, rank, i, nan)) = bad {
        let t = t.index(specs.len());
        if rank < world && i < specs[t].len() {
            specs[t].bad = Some((rank, i, if nan { f32::NAN } else { f32::INFINITY }));
            want[t] = false;
        }
    }
    want
}

#[test]
fn odd_sizes_and_scales_match_the_per_tensor_reduction() {
    for world in 1..=4 {
        let specs = odd_specs();
        for cfg in configs() {
            assert_eq!(check(world, &specs, &cfg), [true; 5]);
        }
    }
}

#[test]
fn tensors_smaller_than_the_world_and_zeros() {
    for world in 1..=4 {
        let mut zero = Spec::new(&[5], 0);
        zero.zero = true;
        let mut specs = vec![
            Spec::new(&[1], 3),
            Spec::new(&[world - 1], -4),
            zero,
            Spec::new(&[world + 1], 0),
            Spec::new(&[0], 0),
            Spec::new(&[1], -20),
        ];
        for cfg in configs() {
            assert_eq!(check(world, &specs, &cfg), [true; 6], "N={world}");
        }
        let one_shot = Fp8ReduceConfig {
            one_shot: true,
            ..Default::default()
        };
        assert_eq!(check_with(world, &specs, &one_shot, true), [true; 6]);
        // A bucket of one-element tensors only.
        specs = (0..5).map(|i| Spec::new(&[1], i * 3 - 6)).collect();
        assert_eq!(check(world, &specs, &Fp8ReduceConfig::default()), [true; 5]);
        // And of one tensor.
        assert_eq!(
            check(world, &[Spec::new(&[11], 1)], &Fp8ReduceConfig::default()),
            [true]
        );
    }
}

#[test]
fn a_non_finite_value_makes_only_its_tensor_non_finite() {
    for world in 1..=4 {
        let last = world - 1;
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut specs = vec![
                Spec::new(&[9], 0),
                Spec::new(&[5], 2),
                Spec::new(&[1], -3),
                Spec::new(&[7], 1),
            ];
            specs[1].bad = Some((last, 3, bad));
            specs[2].bad = Some((0, 0, f32::NAN));
            for cfg in configs() {
                assert_eq!(
                    check(world, &specs, &cfg),
                    [true, false, false, true],
                    "N={world} {bad}"
                );
            }
            let one_shot = Fp8ReduceConfig {
                one_shot: true,
                ..Default::default()
            };
            assert_eq!(
                check_with(world, &specs, &one_shot, true),
                [true, false, false, true],
                "N={world} {bad} one shot"
            );
        }
    }
}

#[test]
fn scaled_gradients_a_bucket_at_a_time_match_per_tensor() {
    // The layers' FP8 gradients take the fused path (one launch a step for
    // the whole bucket): bitwise the per-tensor reduction too.
    for world in 1..=4 {
        let specs = odd_specs();
        for cfg in &configs() {
            assert_eq!(check_with(world, &specs, cfg, true), [true; 5]);
            // and in one shot: every rank reduces the whole bucket itself
            let one_shot = Fp8ReduceConfig {
                one_shot: true,
                ..*cfg
            };
            assert_eq!(check_with(world, &specs, &one_shot, true), [true; 5]);
        }
    }
}

#[test]
fn an_empty_bucket_sends_nothing() {
    for world in 1..=3 {
        assert!(check(world, &[], &Fp8ReduceConfig::default()).is_empty());
    }
}

#[test]
fn scaled_and_half_gradients_mix_in_one_bucket() {
    let cfg = Fp8ReduceConfig::default();
    let out = run_ranks(3, |comm| {
        let r = comm.rank();
        let a = Spec::new(&[4, 5], 3 * r as i32).tensor(0, r);
        let (st, _) = ScalingTensor::quantize(&a, QType::E4M3, &CurrentScaling::default())?;
        let b = Spec::new(&[3], -2).tensor(1, r).to_dtype(DType::BF16)?;
        let grads = [Grad::from(&st), Grad::from(&b)];
        let bucket = fp8_all_reduce_bucket(&comm, grads, &cfg)?;
        let single = [
            fp8_all_reduce(&comm, &st, &cfg)?,
            fp8_all_reduce(&comm, &b, &cfg)?,
        ];
        Ok::<_, Error>((
            bucket.iter().map(print).collect::<Vec<_>>(),
            single.iter().map(print).collect::<Vec<_>>(),
        ))
    })
    .unwrap();
    for (bucket, single) in &out {
        assert_eq!(bucket, single);
        assert_eq!(bucket, &out[0].0);
    }
}

#[test]
fn an_integer_gradient_is_refused() {
    let out = run_ranks(1, |comm| {
        let ok = Tensor::zeros(3, DType::F32, &Device::Cpu)?;
        let bad = Tensor::zeros(3, DType::U8, &Device::Cpu)?;
        Ok::<_, Error>(matches!(
            fp8_all_reduce_bucket(&comm, [&ok, &bad], &Fp8ReduceConfig::default()),
            Err(Error::DType { .. })
        ))
    })
    .unwrap();
    assert_eq!(out, [true]);
}

pub(crate) fn spec_strategy() -> impl Strategy<Value = Spec> {
    (0usize..40, -24i32..24, any::<bool>(), any::<u64>()).prop_map(|(len, exp, zero, seed)| {
        let mut s = Spec::new(&[len], exp);
        s.zero = zero && seed % 4 == 0;
        s.seed = seed;
        s
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn random_buckets_match_the_per_tensor_reduction(
        world in 1usize..=4,
        mut specs in prop::collection::vec(spec_strategy(), 1..=5),
        bad in prop::option::of((any::<prop::sample::Index>(), 0usize..4, 0usize..40, any::<bool>())),
        cfg in 0usize..3,
    ) {
        let want = plant(&mut specs, world, bad);
        let got = check(world, &specs, &configs()[cfg]);
        prop_assert_eq!(got, want);
        // scaled: the fused path; its E4M3/E5M2 cast may saturate an inf
        check_with(world, &specs, &configs()[cfg], true);
    }
}
