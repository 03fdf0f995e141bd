//! ZeRO's bucketed halves against the per-tensor ones, side by side on the
//! same ranks: `fp8_reduce_scatter_bucket` bitwise `fp8_reduce_scatter` of
//! each tensor (F32 shard, range, shape, agreed amax) and
//! `fp8_all_gather_bucket` bitwise `fp8_all_gather` (codes, scales,
//! amaxes), in two collectives a bucket instead of two a tensor.

use crate::fp8_bucket::{odd_specs, plant, print, spec_strategy, Counting, Print, Spec};
use amp_comm::{
    fp8_all_gather, fp8_all_gather_bucket, fp8_reduce_scatter, fp8_reduce_scatter_bucket,
    run_ranks, Communicator, Error, Fp8ReduceConfig, Grad, ReducedShard,
};
use amp_core::{CurrentScaling, QType, ScalingTensor};
use candle_core::{DType, Shape, Tensor};
use proptest::prelude::*;

/// What must be bitwise equal of a reduce-scatter's shard.
type ShardPrint = (Vec<u32>, std::ops::Range<usize>, Vec<usize>, u32);

fn shard_print(r: &ReducedShard) -> ShardPrint {
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    let amax = bits(&r.amax);
    assert_eq!(amax.len(), 1);
    (
        bits(&r.shard),
        r.range.clone(),
        r.shape.dims().to_vec(),
        amax[0],
    )
}

struct RankOut {
    scatter: (Vec<ShardPrint>, Vec<ShardPrint>),
    gather: (Vec<Print>, Vec<Print>),
    calls: [usize; 4],
}

/// Both ways on `world` ranks, with the gradients as F32 tensors or, with
/// `scaled`, as E5M2 scaling tensors (as the layers' sinks hold them).
fn check(world: usize, specs: &[Spec], cfg: &Fp8ReduceConfig, scaled: bool) -> Vec<bool> {
    let ctx = format!("N={world} scaled={scaled} {cfg:?} {specs:?}");
    let out = run_ranks(world, |comm| {
        let floats: Vec<Tensor> = (0..specs.len())
            .map(|t| specs[t].tensor(t, comm.rank()))
            .collect();
        let sts = floats
            .iter()
            .map(|f| Ok(ScalingTensor::quantize(f, QType::E5M2, &CurrentScaling::default())?.0))
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
            .map(|g| fp8_reduce_scatter(&counting, *g, cfg))
            .collect::<Result<Vec<_>, Error>>()?;
        let c0 = counting.take().0;
        let bucket = fp8_reduce_scatter_bucket(&counting, grads.iter().copied(), cfg)?;
        let c1 = counting.take().0;
        let shards: Vec<Tensor> = bucket.iter().map(|r| r.shard.clone()).collect();
        let shapes: Vec<Shape> = bucket.iter().map(|r| r.shape.clone()).collect();
        let gathered_single = shards
            .iter()
            .zip(&shapes)
            .map(|(s, sh)| fp8_all_gather(&counting, s, sh.clone(), cfg))
            .collect::<Result<Vec<_>, Error>>()?;
        let c2 = counting.take().0;
        let gathered = fp8_all_gather_bucket(&counting, &shards, &shapes, cfg)?;
        let c3 = counting.take().0;
        // ZeRO's FP16 master slices: a bucket at a time where the
        // configured format is E4M3, bitwise the per-tensor gather of
        // their F32 values either way
        let masters = shards
            .iter()
            .map(|s| Ok(ScalingTensor::quantize(s, QType::F16, &CurrentScaling::default())?.0))
            .collect::<Result<Vec<_>, Error>>()?;
        let from_masters = fp8_all_gather_bucket(&counting, &masters, &shapes, cfg)?;
        let per_master = masters
            .iter()
            .zip(&shapes)
            .map(|(m, sh)| fp8_all_gather(&counting, &m.dequantize(DType::F32)?, sh.clone(), cfg))
            .collect::<Result<Vec<_>, Error>>()?;
        counting.take();
        for (t, (a, b)) in from_masters.iter().zip(&per_master).enumerate() {
            assert_eq!(print(a), print(b), "rank {} master {t}", comm.rank());
        }
        Ok::<_, Error>(RankOut {
            scatter: (
                single.iter().map(shard_print).collect(),
                bucket.iter().map(shard_print).collect(),
            ),
            gather: (
                gathered_single.iter().map(print).collect(),
                gathered.iter().map(print).collect(),
            ),
            calls: [c0, c1, c2, c3],
        })
    })
    .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let t = specs.len();
    let per_bucket = if t == 0 { 0 } else { 2 };
    for (r, o) in out.iter().enumerate() {
        assert_eq!(o.scatter.0, o.scatter.1, "{ctx}: rank {r} reduce-scatter");
        assert_eq!(o.gather.0, o.gather.1, "{ctx}: rank {r} all-gather");
        assert_eq!(o.gather.1, out[0].gather.1, "{ctx}: rank {r} vs rank 0");
        assert_eq!(
            o.calls,
            [2 * t, per_bucket, 2 * t, per_bucket],
            "{ctx}: rank {r}"
        );
    }
    // Finite where the agreed input amax is.
    out[0]
        .scatter
        .1
        .iter()
        .map(|p| f32::from_bits(p.3).is_finite())
        .collect()
}

fn configs() -> [Fp8ReduceConfig; 2] {
    [
        Fp8ReduceConfig::default(),
        Fp8ReduceConfig {
            qtype: QType::E5M2,
            average: false,
            margin: 1,
            ..Default::default()
        },
    ]
}

#[test]
fn odd_sizes_and_tensors_smaller_than_the_world_match_per_tensor() {
    for world in 1..=4 {
        let specs = odd_specs();
        for cfg in &configs() {
            for scaled in [false, true] {
                assert_eq!(check(world, &specs, cfg, scaled), [true; 5]);
            }
        }
    }
}

#[test]
fn an_empty_bucket_sends_nothing() {
    for world in 1..=3 {
        assert!(check(world, &[], &Fp8ReduceConfig::default(), false).is_empty());
    }
}

#[test]
fn a_shard_of_the_wrong_length_is_refused() {
    let out = run_ranks(2, |comm| {
        let shard = Tensor::zeros(3, candle_core::DType::F32, comm.device())?;
        Ok::<_, Error>(matches!(
            fp8_all_gather_bucket(
                &comm,
                &[shard],
                &[Shape::from(4)],
                &Fp8ReduceConfig::default()
            ),
            Err(Error::InvalidArgument { .. })
        ))
    })
    .unwrap();
    assert_eq!(out, [true, true]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn random_buckets_match_per_tensor(
        world in 1usize..=4,
        mut specs in prop::collection::vec(spec_strategy(), 1..=5),
        bad in prop::option::of((any::<prop::sample::Index>(), 0usize..4, 0usize..40, any::<bool>())),
        cfg in 0usize..2,
        scaled in any::<bool>(),
    ) {
        let want = plant(&mut specs, world, bad);
        let got = check(world, &specs, &configs()[cfg], scaled);
        // (the E5M2 cast of a scaled gradient may saturate an inf)
        if !scaled {
            prop_assert_eq!(got, want);
        }
    }
}
