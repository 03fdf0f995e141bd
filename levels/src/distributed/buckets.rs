//! A step's gradients averaged over the ranks in buckets
//! (docs/ARCHITECTURE.md, "Data parallelism"): consecutive gradients, in a
//! fixed order every rank shares, are packed up to [`AmpConfig::bucket_mb`](
//! crate::AmpConfig::bucket_mb) of F32-equivalent bytes, and each bucket is
//! reduced with a handful of collectives instead of a handful per tensor.
//!
//! - FP8 weight gradients: [`fp8_all_reduce_bucket`] (bitwise the
//!   per-tensor [`fp8_all_reduce`](amp_comm::fp8_all_reduce));
//! - FP8 gradients of ZeRO-sharded weights (O3): [`fp8_reduce_scatter_bucket`]
//!   (bitwise the per-tensor reduce-scatter), each rank keeping its slices;
//! - F32 gradients (embeddings, norms, biases, F32 Linear weights): one
//!   F32 all-reduce of their concatenation per bucket, divided by `N`.
//!
//! The order is the reverse of the names' order (in a GPT the last
//! layers' gradients, which the backward produces first, lead). A tensor
//! larger than the cap is a bucket of its own; a bucket boundary never
//! falls inside a tensor; gradients of different FP8 formats never share
//! a bucket.

use super::plan::plan;
use super::zero::{self, Shard};
use crate::comm_stats::CommStats;
use crate::error::{Error, Result};
use amp_comm::{fp8_all_reduce_bucket, Communicator, Fp8ReduceConfig};
use amp_core::{bucket_concat, QType, ScalingTensor};
use amp_optim::{Grad, Grads};
use candle_core::Tensor;

/// The mean of every rank's gradients, FP8 ones reduced in FP8, bucketed
/// (see the module docs); of a sharded weight, only this rank's slice
/// (its agreed amax pushed to `agreed`, for [`zero::poison`]).
pub(crate) fn average(
    comm: &dyn Communicator,
    grads: Grads,
    shards: &[Shard],
    cap: usize,
    stats: &mut CommStats,
    agreed: &mut Vec<Tensor>,
) -> Result<Grads> {
    let mut names: Vec<String> = grads.0.keys().cloned().collect();
    names.sort_unstable_by(|a, b| b.cmp(a));
    let mut grads = grads.0;
    let mut out = Grads::new();
    let (mut whole, mut sharded, mut dense) = (vec![], vec![], vec![]);
    for name in names {
        let shard = shards.iter().find(|s| s.name == name);
        match (grads.remove(&name), shard) {
            (Some(Grad::Scaled(t)), Some(shard)) => sharded.push((name, t, shard)),
            (Some(Grad::Scaled(t)), None) => whole.push((name, t)),
            (Some(Grad::F32(_)), Some(_)) => {
                return Err(Error::Config {
                    field: name,
                    reason: "a sharded weight needs its FP8 gradient from the layer's sink".into(),
                })
            }
            (Some(Grad::F32(t)), None) => dense.push((name, t)),
            (None, _) => {}
        }
    }
    let key = |t: &ScalingTensor| (t.elem_count(), t.qtype());
    let items: Vec<(usize, QType)> = whole.iter().map(|(_, t)| key(t)).collect();
    for run in plan(&items, cap) {
        let bucket = &whole[run];
        let cfg = Fp8ReduceConfig {
            qtype: bucket[0].1.qtype(),
            ..Default::default()
        };
        let reduced = fp8_all_reduce_bucket(comm, bucket.iter().map(|(_, t)| t), &cfg)?;
        for ((name, _), r) in bucket.iter().zip(reduced) {
            out.insert(name.clone(), Grad::Scaled(r.grad));
        }
        stats.buckets += 1;
    }
    let items: Vec<(usize, QType)> = sharded.iter().map(|(_, t, _)| key(t)).collect();
    for run in plan(&items, cap) {
        let bucket = &sharded[run];
        let grads: Vec<(&ScalingTensor, &Shard)> = bucket.iter().map(|(_, t, s)| (t, *s)).collect();
        for ((name, _, _), r) in bucket.iter().zip(zero::reduce_scatter(comm, &grads)?) {
            out.insert(name.clone(), zero::slice_grad(r, agreed));
        }
        stats.buckets += 1;
    }
    let items: Vec<(usize, ())> = dense.iter().map(|(_, t)| (t.elem_count(), ())).collect();
    for run in plan(&items, cap) {
        let bucket = &dense[run];
        for (name, g) in bucket.iter().zip(all_reduce_mean(comm, bucket)?) {
            out.insert(name.0.clone(), Grad::F32(g));
        }
        stats.buckets += 1;
    }
    Ok(out)
}

/// The mean of F32 gradients over the ranks, with one all-reduce of their
/// concatenation (packed in one launch: a GPT's few hundred norm and bias
/// gradients would otherwise cost a copy launch each, after the backward).
fn all_reduce_mean(comm: &dyn Communicator, bucket: &[(String, Tensor)]) -> Result<Vec<Tensor>> {
    let n = comm.world_size();
    let joined = match bucket {
        [(_, one)] => one.flatten_all()?,
        _ => bucket_concat(&bucket.iter().map(|(_, t)| t).collect::<Vec<_>>())?,
    };
    let mean = (comm.all_reduce_sum(&joined)? / n as f64)?;
    let mut offset = 0;
    bucket
        .iter()
        .map(|(_, t)| {
            let len = t.elem_count();
            let g = mean.narrow(0, offset, len)?.reshape(t.shape())?;
            offset += len;
            Ok(g)
        })
        .collect()
}
