//! ZeRO for O3 (DESIGN.md 4): each data-parallel rank keeps `1/N` of every
//! Linear weight's FP16 master and Adam moments (its [`shard_range`] of the
//! flat weight), and the whole FP8 copy the GEMMs read.
//!
//! A step: the FP8 weight gradient is reduce-scattered in FP8
//! ([`fp8_reduce_scatter`]: one agreed scale, F32 sums), each rank updates
//! its slice of the master and the moments, the global gradient norm sums
//! the slices' squares over the ranks, and the new FP8 copy is gathered
//! from the updated slices with one agreed scale ([`fp8_all_gather`]).
//! Persistent bytes per Linear parameter and rank: 2 + 5/N.

use crate::error::Result;
use amp_comm::{fp8_all_gather, fp8_reduce_scatter, shard_range, Communicator, Fp8ReduceConfig};
use amp_core::{QType, ScalingTensor, Weight, WeightSlot};
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

/// The slice of `value` (flat) that `rank` of `world` keeps as its FP16
/// master, or `None` when that slice would be empty (a weight with fewer
/// elements than ranks stays whole).
pub(crate) fn master_slice(
    value: &Tensor,
    rank: usize,
    world: usize,
) -> Result<Option<(ScalingTensor, Range<usize>)>> {
    let range = shard_range(value.elem_count(), rank, world);
    if range.is_empty() {
        return Ok(None);
    }
    let slice = value.flatten_all()?.narrow(0, range.start, range.len())?;
    let (master, _) =
        ScalingTensor::quantize(&slice, QType::F16, &amp_core::CurrentScaling::default())?;
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

/// After an applied step: every shard's FP8 copy gathered from the ranks'
/// updated master slices, with one agreed scale.
pub(crate) fn gather(comm: &dyn Communicator, opt: &LowBitAdamW, shards: &[Shard]) -> Result<()> {
    let cfg = Fp8ReduceConfig::default();
    for s in shards {
        let Some(p) = opt.params().iter().find(|p| p.name == s.name) else {
            return Err(crate::Error::Config {
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

/// Where a rank's slice of a sharded parameter lies, as a rank's
/// checkpoint file records it (metadata `zero_slices`, by name): the range
/// of the flat weight and the whole weight's shape.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SliceInfo {
    /// First element of the slice in the flat weight.
    pub start: usize,
    /// One past its last element.
    pub end: usize,
    /// The whole weight's shape.
    pub shape: Vec<usize>,
}

/// The slices this rank holds, by parameter name.
pub(crate) fn slices(shards: &[Shard]) -> std::collections::BTreeMap<String, SliceInfo> {
    shards
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                SliceInfo {
                    start: s.range.start,
                    end: s.range.end,
                    shape: s.shape.dims().to_vec(),
                },
            )
        })
        .collect()
}

/// What a checkpoint records of the sharding: `none`, or `rank/world`.
pub(crate) fn tag(opt: &crate::AmpOptimizer) -> String {
    if opt.shards.is_empty() {
        return "none".into();
    }
    let (rank, world) = opt.rank_and_world();
    format!("{rank}/{world}")
}

/// The file a rank of a ZeRO-sharded run writes for checkpoint `path`:
/// `ckpt.safetensors` becomes `ckpt.rank0-of-4.safetensors` (`path` itself
/// is then the index that lists the rank files, with their sizes and
/// CRC-32s; load `path`, at any world size).
pub fn shard_path(
    path: impl AsRef<std::path::Path>,
    rank: usize,
    world: usize,
) -> std::path::PathBuf {
    let path = path.as_ref();
    let stem = path
        .file_stem()
        .map_or_else(Default::default, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}-of-{world}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}-of-{world}"),
    };
    path.with_file_name(name)
}

/// A gathered FP8 copy where an optimizer parameter was expected.
pub(crate) fn not_a_param(op: &str) -> crate::Error {
    crate::Error::Config {
        field: op.into(),
        reason: "a gathered FP8 copy is not an optimizer parameter (its master slice is)".into(),
    }
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
