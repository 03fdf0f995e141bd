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
//!   F32 all-reduce of their concatenation per bucket, divided by `N`; or
//!   with [`AmpConfig::bf16_wire`](crate::AmpConfig::bf16_wire), the
//!   concatenation in BF16 exchanged, summed in F32 in rank order, the
//!   mean gathered in BF16 ([`bf16_wire_mean`]).
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
use amp_comm::{fp8_all_reduce_bucket, shard_range, Communicator, Fp8ReduceConfig};
use amp_core::{bucket_concat, QType, ScalingTensor};
use amp_optim::{Grad, Grads};
use candle_core::{DType, Tensor};

/// How the gradients go on the wire: the F32 ones as BF16
/// (`AmpConfig::bf16_wire`), the FP8 buckets in one shot
/// (`AmpConfig::fp8_one_shot`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Wire {
    pub(crate) bf16: bool,
    pub(crate) one_shot: bool,
}

/// The mean of every rank's gradients, FP8 ones reduced in FP8, bucketed
/// (see the module docs); of a sharded weight, only this rank's slice
/// (its agreed amax pushed to `agreed`, for [`zero::poison`]).
pub(crate) fn average(
    comm: &dyn Communicator,
    grads: Grads,
    shards: &[Shard],
    cap: usize,
    wire: Wire,
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
            one_shot: wire.one_shot,
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
        for (name, g) in bucket.iter().zip(all_reduce_mean(comm, bucket, wire.bf16)?) {
            out.insert(name.0.clone(), Grad::F32(g));
        }
        stats.buckets += 1;
    }
    Ok(out)
}

/// The mean of F32 gradients over the ranks, with one all-reduce of their
/// concatenation (packed in one launch: a GPT's few hundred norm and bias
/// gradients would otherwise cost a copy launch each, after the backward).
fn all_reduce_mean(
    comm: &dyn Communicator,
    bucket: &[(String, Tensor)],
    bf16_wire: bool,
) -> Result<Vec<Tensor>> {
    let n = comm.world_size();
    let joined = match bucket {
        [(_, one)] => one.flatten_all()?,
        _ => bucket_concat(&bucket.iter().map(|(_, t)| t).collect::<Vec<_>>())?,
    };
    // (a bucket with fewer elements than ranks would make empty chunks)
    let mean = if bf16_wire && joined.elem_count() >= n {
        bf16_wire_mean(comm, &joined)?
    } else {
        (comm.all_reduce_sum(&joined)? / n as f64)?
    };
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

/// The mean over the ranks of the flat F32 `x` with BF16 on the wire:
/// `x` rounded to BF16 and exchanged (rank `r` receives every rank's part
/// `shard_range(len, r, N)`), the parts summed in F32 in rank order and
/// divided by `N`, the mean rounded to BF16, gathered and widened to F32.
/// Half the bytes of the F32 all-reduce; every rank gets the same values.
/// `x` holds at least `N` elements (no empty chunk).
pub(crate) fn bf16_wire_mean(comm: &dyn Communicator, x: &Tensor) -> Result<Tensor> {
    let (n, len) = (comm.world_size(), x.elem_count());
    let wire = x.to_dtype(DType::BF16)?;
    let chunks = (0..n)
        .map(|j| {
            let r = shard_range(len, j, n);
            wire.narrow(0, r.start, r.len())
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let parts = comm.all_to_all(&chunks)?;
    let mut sum = parts[0].to_dtype(DType::F32)?;
    for p in &parts[1..] {
        sum = (sum + p.to_dtype(DType::F32)?)?;
    }
    let ranks = Tensor::new(n as f32, sum.device())?;
    let mean = sum.broadcast_div(&ranks)?.to_dtype(DType::BF16)?;
    Ok(comm.all_gather_shards(&mean, len)?.to_dtype(DType::F32)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use amp_comm::run_ranks;
    use candle_core::Device;
    use half::bf16;

    /// Rank `r`'s value at `i`: spread over magnitudes, signs and ranks so
    /// that the BF16 roundings and the F32 sums both matter.
    fn value(r: usize, i: usize) -> f32 {
        let s = if (i + r) % 3 == 0 { -1.0 } else { 1.0 };
        s * (1.0 + i as f32 * 0.37 + r as f32 * 1.13).powf(1.7) * 1e-3
    }

    #[test]
    fn bf16_on_the_wire_is_the_rank_order_mean_of_bf16_values_rounded_once_more() {
        for n in 1..=4 {
            for len in [n, 7, 1001] {
                let out = run_ranks(n, |comm| -> Result<Vec<f32>> {
                    let x: Vec<f32> = (0..len).map(|i| value(comm.rank(), i)).collect();
                    let x = Tensor::from_vec(x, len, &Device::Cpu)?;
                    let before = comm.bytes_sent();
                    let mean = bf16_wire_mean(&comm, &x)?;
                    let sent = comm.bytes_sent() - before;
                    // two bytes an element, (N - 1) / N of them twice
                    let mine = shard_range(len, comm.rank(), n).len();
                    assert_eq!(sent as usize, 2 * (len - mine) + 2 * (n - 1) * mine);
                    Ok(mean.to_vec1()?)
                })
                .unwrap_or_else(|e| panic!("n {n} len {len}: {e}"));
                // independently: per element, the BF16 values summed in F32
                // in rank order, divided by N, rounded to BF16
                let want: Vec<f32> = (0..len)
                    .map(|i| {
                        let mut s = bf16::from_f32(value(0, i)).to_f32();
                        for r in 1..n {
                            s += bf16::from_f32(value(r, i)).to_f32();
                        }
                        bf16::from_f32(s / n as f32).to_f32()
                    })
                    .collect();
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "n {n} len {len} rank {r}"
                    );
                }
            }
        }
    }
}
