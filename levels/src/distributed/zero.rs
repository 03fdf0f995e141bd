//! ZeRO for O3 (docs/ARCHITECTURE.md, "Data parallelism"): each
//! data-parallel rank keeps `1/N` of every Linear weight's FP16 master and
//! Adam moments (its [`shard_range`] of the flat weight), and the whole FP8
//! copy the GEMMs read.
//!
//! A step: the FP8 weight gradient is reduce-scattered in FP8
//! ([`fp8_reduce_scatter`]: one agreed scale, F32 sums), each rank updates
//! its slice of the master and the moments, the global gradient norm sums
//! the slices' squares over the ranks, and the new FP8 copy is gathered
//! from the updated slices with one agreed scale ([`fp8_all_gather`]).
//! Persistent bytes per Linear parameter and rank: 2 + 5/N.

use crate::error::{Error, Result};
use amp_comm::{fp8_all_gather, fp8_reduce_scatter, shard_range, Communicator, Fp8ReduceConfig};
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

/// This rank's slice of the mean FP8 gradient, as F32; NaN throughout when
/// any rank's gradient was not finite (so that every rank skips the step).
pub(crate) fn reduce_scatter(
    comm: &dyn Communicator,
    grad: &ScalingTensor,
    shard: &Shard,
) -> Result<Grad> {
    let cfg = Fp8ReduceConfig {
        qtype: grad.qtype(),
        ..Default::default()
    };
    let r = fp8_reduce_scatter(comm, grad, &cfg)?;
    debug_assert_eq!(r.range, shard.range);
    // amax * 0 is 0, or NaN when the agreed amax is inf: no host read
    let poison = r.amax.affine(0.0, 0.0)?;
    Ok(Grad::F32(r.shard.broadcast_add(&poison)?))
}

/// After an applied step (or a load): every shard's FP8 copy gathered from
/// the ranks' master slices, with one agreed scale.
pub(crate) fn gather(comm: &dyn Communicator, opt: &LowBitAdamW, shards: &[Shard]) -> Result<()> {
    let cfg = Fp8ReduceConfig::default();
    for s in shards {
        let Some(p) = opt.params().iter().find(|p| p.name == s.name) else {
            return Err(Error::Config {
                field: s.name.clone(),
                reason: "the optimizer lost this sharded parameter".into(),
            });
        };
        let master = p.slot.read()?.master_f32()?;
        let full = fp8_all_gather(comm, &master, s.shape.clone(), &cfg)?.grad;
        s.layer.replace(Weight::Fp8Gathered(full))?;
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
