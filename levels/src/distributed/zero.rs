//! ZeRO for O3 (docs/ARCHITECTURE.md, "Data parallelism"): each
//! data-parallel rank keeps `1/N` of every Linear weight's FP16 master and
//! Adam moments (its [`shard_range`] of the flat weight), and the whole FP8
//! copy the GEMMs read.
//!
//! A step: the FP8 weight gradients are reduce-scattered in FP8, a bucket
//! at a time ([`fp8_reduce_scatter_bucket`]: one agreed scale per weight,
//! F32 sums), each rank updates its slice of the master and the moments,
//! the global gradient norm sums the slices' squares over the ranks, and
//! the new FP8 copies are gathered from the updated slices, a bucket at a
//! time, with one agreed scale per weight ([`fp8_all_gather_bucket`]).
//! Persistent bytes per Linear parameter and rank: 2 + 5/N.

use super::plan::plan;
use crate::comm_stats::CommStats;
use crate::error::{Error, Result};
use amp_comm::{
    fp8_all_gather_bucket, fp8_reduce_scatter_bucket, shard_range, Communicator, Fp8ReduceConfig,
    Grad as CommGrad, ReducedShard,
};
use amp_core::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use amp_optim::{Grad, LowBitAdamW};
use candle_core::{Shape, Tensor};
use std::ops::Range;

/// One Linear weight sharded across the ranks.
#[derive(Debug, Clone)]
pub(crate) struct Shard {
    /// The parameter's name (the optimizer's, for its slice).
    pub name: String,
    /// The layer's slot: the gathered FP8 copy.
    pub layer: WeightSlot,
    /// This rank's elements of the flat weight.
    pub range: Range<usize>,
    /// The whole weight's shape.
    pub shape: Shape,
}

/// Linear weight `name` (F32 `value`, the layer's `slot`) stored for
/// `rank` of `world`: the layer's slot set to the whole FP8 copy, and the
/// optimizer's slot holding this rank's slice of the FP16 master, with the
/// shard that records it; `None` (nothing changed) with one rank or where
/// this rank's slice would be empty (a weight with fewer elements than
/// ranks stays whole).
pub(crate) fn split(
    name: &str,
    value: &Tensor,
    slot: &WeightSlot,
    (rank, world): (usize, usize),
) -> Result<Option<(Shard, WeightSlot)>> {
    match master_slice(value, rank, world)? {
        Some((master, range)) if world > 1 => {
            let fp8 = ScalingTensor::quantize(value, QType::E4M3, &CurrentScaling::default())?.0;
            slot.replace(Weight::Fp8Gathered(fp8))?;
            let shard = Shard {
                name: name.to_string(),
                layer: slot.clone(),
                range,
                shape: value.shape().clone(),
            };
            Ok(Some((shard, WeightSlot::new(Weight::F16(master)))))
        }
        _ => Ok(None),
    }
}

/// The slice of `value` (flat) that `rank` of `world` keeps as its FP16
/// master, or `None` when that slice would be empty.
fn master_slice(
    value: &Tensor,
    rank: usize,
    world: usize,
) -> Result<Option<(ScalingTensor, Range<usize>)>> {
    let range = shard_range(value.elem_count(), rank, world);
    if range.is_empty() {
        return Ok(None);
    }
    let slice = value.flatten_all()?.narrow(0, range.start, range.len())?;
    let (master, _) = ScalingTensor::quantize(&slice, QType::F16, &CurrentScaling::default())?;
    Ok(Some((master, range)))
}

/// This rank's slice of each gradient of a bucket, averaged over the
/// ranks in FP8 ([`fp8_reduce_scatter_bucket`]), as the reduction leaves
/// it (on the communicator's stream; [`slice_grad`] makes the optimizer's
/// gradient of it).
///
/// # Errors
/// The communicator's.
pub(crate) fn reduce_scatter(
    comm: &dyn Communicator,
    bucket: &[(&ScalingTensor, &Shard)],
) -> Result<Vec<ReducedShard>> {
    let Some((first, _)) = bucket.first() else {
        return Ok(Vec::new());
    };
    let cfg = Fp8ReduceConfig {
        qtype: first.qtype(),
        ..Default::default()
    };
    let reduced = fp8_reduce_scatter_bucket(comm, bucket.iter().map(|(g, _)| *g), &cfg)?;
    for (r, (_, shard)) in reduced.iter().zip(bucket) {
        debug_assert_eq!(r.range, shard.range);
    }
    Ok(reduced)
}

/// The optimizer's gradient of one reduced slice (its F32 values), with
/// the agreed amax to push to `agreed`: inf when a rank's gradient was not
/// finite, which [`poison`] turns into a non-finite squared norm on every
/// rank, so that every rank skips the step (a slice may hold no element of
/// the non-finite values). Candle ops: only once candle's stream has
/// waited for the reduction's.
pub(crate) fn slice_grad(r: ReducedShard, agreed: &mut Vec<Tensor>) -> Grad {
    agreed.push(r.amax);
    Grad::F32(r.shard)
}

/// `part_sq` (this rank's part of the squared norm, one F32) plus 0, or
/// NaN when an `agreed` amax is inf (a rank's gradient was not finite): a
/// few launches a step where adding the 0-or-NaN to every slice would
/// cost two per weight and a pass over the gradients.
///
/// # Errors
/// Candle's.
pub(crate) fn poison(part_sq: &Tensor, agreed: &[Tensor]) -> Result<Tensor> {
    if agreed.is_empty() {
        return Ok(part_sq.clone());
    }
    let refs: Vec<&Tensor> = agreed.iter().collect();
    // agreed amaxes hold no NaN (counted as inf) and are at least 0: the
    // F64 sum is finite unless one is inf
    let zero_or_nan = amp_core::gather_scalars(&refs)?
        .sum_all()?
        .affine(0.0, 0.0)?
        .to_dtype(candle_core::DType::F32)?;
    Ok(part_sq.flatten_all()?.broadcast_add(&zero_or_nan)?)
}

/// A sharded weight's master slice, for the gather.
enum Master {
    Scaled(ScalingTensor),
    F32(Tensor),
}

/// How many times a gradient bucket's elements a gather bucket holds.
/// The gathers follow the step's outcome read, with nothing to overlap:
/// each bucket's host time (a few dozen driver calls) is the device's idle
/// time, so they are few and large. A gather bucket holds its codes twice
/// for a moment (gathered, then copied into tensor order) beside the
/// weights it replaces: at the default cap (100 MiB of F32, 25 MiB of
/// FP8 codes a gradient bucket) up to 400 MiB of codes.
pub(crate) const GATHER_CAP_FACTOR: usize = 16;

/// Every shard's FP8 weight gathered from the ranks' updated master
/// slices in `opt`, in buckets of at most `cap` elements
/// ([`fp8_all_gather_bucket`]: one agreed scale per weight).
///
/// # Errors
/// The communicator's; a shard the optimizer does not hold.
pub(crate) fn gather(
    comm: &dyn Communicator,
    opt: &LowBitAdamW,
    shards: &[Shard],
    cap: usize,
    stats: &mut CommStats,
) -> Result<()> {
    let cfg = Fp8ReduceConfig::default();
    let items: Vec<(usize, ())> = shards.iter().map(|s| (s.shape.elem_count(), ())).collect();
    for run in plan(&items, cap) {
        let bucket = &shards[run];
        // The FP16 master slices as they are (their codes re-cast in one
        // pass); any other master as F32.
        let mut masters = Vec::with_capacity(bucket.len());
        for s in bucket {
            let Some(p) = opt.params().iter().find(|p| p.name == s.name) else {
                return Err(Error::Config {
                    field: s.name.clone(),
                    reason: "the optimizer lost this sharded parameter".into(),
                });
            };
            masters.push(match &*p.slot.read()? {
                Weight::F16(t) => Master::Scaled(t.clone()),
                other => Master::F32(other.master_f32()?),
            });
        }
        let shapes: Vec<Shape> = bucket.iter().map(|s| s.shape.clone()).collect();
        let grads = masters.iter().map(|m| match m {
            Master::Scaled(t) => CommGrad::Scaled(t),
            Master::F32(t) => CommGrad::Tensor(t),
        });
        let full = fp8_all_gather_bucket(comm, grads, &shapes, &cfg)?;
        for (s, f) in bucket.iter().zip(full) {
            s.layer.replace(Weight::Fp8Gathered(f.grad))?;
        }
        stats.buckets += 1;
    }
    Ok(())
}

/// The whole F32 master of a sharded parameter, gathered from the ranks
/// (every rank calls it).
pub(crate) fn gather_master(
    comm: &dyn Communicator,
    slice: &Tensor,
    shard: &Shard,
) -> Result<Tensor> {
    let full = comm.all_gather_shards(slice, shard.shape.elem_count())?;
    Ok(full.reshape(shard.shape.clone())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn an_infinite_agreed_amax_poisons_the_norm_and_nothing_else_does() -> Result<()> {
        let dev = Device::Cpu;
        let part = Tensor::new(&[6.25f32], &dev)?;
        let amax = |v: f32| Tensor::new(&[v], &dev);
        let finite = [amax(0.0)?, amax(3.0e38)?, amax(1.5)?];
        let kept = poison(&part, &finite)?.to_vec1::<f32>()?;
        assert_eq!(kept, [6.25]);
        assert_eq!(poison(&part, &[])?.to_vec1::<f32>()?, [6.25]);
        let bad = [amax(1.0)?, amax(f32::INFINITY)?];
        assert!(poison(&part, &bad)?.to_vec1::<f32>()?[0].is_nan());
        Ok(())
    }
}
