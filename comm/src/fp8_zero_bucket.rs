//! ZeRO's two FP8 halves for a bucket of tensors sharded one by one:
//! [`fp8_reduce_scatter_bucket`] and [`fp8_all_gather_bucket`], each
//! bitwise the per-tensor [`fp8_reduce_scatter`](crate::fp8_reduce_scatter)
//! and [`fp8_all_gather`](crate::fp8_all_gather) of every tensor, in two
//! collectives for the whole bucket instead of two per tensor.
//!
//! # Layout
//! Unlike [`fp8_all_reduce_bucket`](crate::fp8_all_reduce_bucket), which
//! cuts the concatenated bucket, these keep ZeRO's per-tensor shards (the
//! optimizer holds slice `shard_range(L_t, r, N)` of every weight `t`, and
//! sharded checkpoints store those slices): the chunk rank `r` owns is
//! the concatenation, in bucket order, of its slice of every tensor,
//! `S_r = shard_len(L_0, r, N) + .. + shard_len(L_(T-1), r, N)` elements.
//! A bucket boundary never falls inside a tensor.

use crate::bucket_cast::{agreed_metas, cat_nonempty, fused, inputs, metas_of, own_all, Input};
use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::fp8_reduce::{scales_sent, Fp8ReduceConfig, Fp8Reduced, Grad, ReducedShard};
use crate::rank_sum::rank_order_mean;
use crate::shard::{shard_len, shard_range};
use amp_core::{
    bucket_amax, bucket_column_max, bucket_copy, bucket_copy_from, bucket_decode_sum,
    bucket_requantize, bucket_scales, Piece, QType, ScalingTensor,
};
use candle_core::{DType, Shape, Tensor};

/// Where each tensor's slice of rank `r` lies in `r`'s chunk: offsets in
/// bucket order, and the chunk's length.
fn chunk_offsets(lens: &[usize], r: usize, n: usize) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(lens.len());
    let mut at = 0;
    for &l in lens {
        offsets.push(at);
        at += shard_len(l, r, n);
    }
    (offsets, at)
}

/// [`fp8_reduce_scatter`](crate::fp8_reduce_scatter) of every gradient of
/// a bucket: element `t` is bitwise what it returns for `grads[t]` (the
/// shard `shard_range(L_t, rank, N)` of the rank-order F32 mean, each
/// rank's codes decoded with its own scale, its range, shape and agreed
/// amax), with one gather of the scales and amaxes and one `all_to_all`
/// for the bucket (see the module docs for the layout). Every rank passes
/// the same shapes in the same order; an empty bucket returns an empty
/// vector without communicating. The layers' FP8 gradients are sent as
/// they are (cut into the ranks' chunks in one launch; a bucket of one
/// tensor without a copy).
///
/// Bytes sent by rank `r`: `8 (N - 1) T` for the scales and amaxes (`2 T`
/// F32 values gathered) and `S - S_r` bytes of codes (`S` = all `L_t`
/// summed): the codes of the per-tensor calls, scales in one message
/// instead of `T`.
///
/// # Errors
/// [`Error::DType`] for a gradient that is not a float tensor or a
/// [`ScalingTensor`], and the communicator's errors.
pub fn fp8_reduce_scatter_bucket<'a, C, G>(
    comm: &C,
    grads: impl IntoIterator<Item = G>,
    cfg: &Fp8ReduceConfig,
) -> Result<Vec<ReducedShard>>
where
    C: Communicator + ?Sized,
    G: Into<Grad<'a>>,
{
    let (inputs, shapes) = inputs("fp8_reduce_scatter_bucket", grads)?;
    if inputs.is_empty() {
        return Ok(Vec::new());
    }
    let (n, rank) = (comm.world_size(), comm.rank());
    let lens: Vec<usize> = shapes.iter().map(Shape::elem_count).collect();
    if let Some((scaled, qtype)) = fused(&inputs, cfg, n) {
        // Bucket kernels and collectives only: on the communicator's stream.
        let body = || reduce_scatter_fused(comm, &scaled, qtype, &shapes, cfg);
        return match comm.side_stream() {
            Some(side) => side.run(body),
            None => body(),
        };
    }
    // Each tensor's codes with this rank's own scale; the scales (NaN
    // where an amax is not finite) and the amaxes gathered as one vector.
    let own = own_all(&inputs, cfg)?;
    let codes = own
        .iter()
        .map(|s| s.data().flatten_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let t_count = own.len();
    let sent = scales_sent(&own.iter().collect::<Vec<_>>())?;
    let chunks = (0..n)
        .map(|j| {
            let parts = codes
                .iter()
                .zip(&lens)
                .map(|(c, &l)| {
                    let r = shard_range(l, j, n);
                    Ok(c.narrow(0, r.start, r.len())?)
                })
                .collect::<Result<Vec<_>>>()?;
            cat_nonempty(&parts, &codes[0])
        })
        .collect::<Result<Vec<_>>>()?;
    let (received, scale_invs) = comm.all_to_all_gather(&chunks, &sent)?;
    let agreed = bucket_column_max(&scale_invs, t_count, t_count)?;
    let (offsets, _) = chunk_offsets(&lens, rank, n);
    (0..t_count)
        .map(|t| {
            let range = shard_range(lens[t], rank, n);
            let parts = received
                .iter()
                .map(|c| c.narrow(0, offsets[t], range.len()))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let column = scale_invs.narrow(1, t, 1)?.flatten_all()?;
            Ok(ReducedShard {
                shard: rank_order_mean(&parts, &column, own[t].qtype(), cfg.average)?.0,
                range,
                shape: shapes[t].clone(),
                amax: agreed.narrow(0, t, 1)?,
            })
        })
        .collect()
}

/// [`fp8_reduce_scatter_bucket`] of the layers' FP8 gradients, every step
/// a bucket at a time (`amp_core::bucket_*`): the codes re-cast straight
/// into the chunks' order (rank-major), one decode-and-sum for this rank's
/// slices; bit for bit the general path.
fn reduce_scatter_fused<C: Communicator + ?Sized>(
    comm: &C,
    scaled: &[&ScalingTensor],
    qtype: QType,
    shapes: &[Shape],
    cfg: &Fp8ReduceConfig,
) -> Result<Vec<ReducedShard>> {
    let (n, rank) = (comm.world_size(), comm.rank());
    let lens: Vec<usize> = shapes.iter().map(Shape::elem_count).collect();
    let codes_in: Vec<&Tensor> = scaled.iter().map(|s| s.data()).collect();
    let sent = scales_sent(scaled)?;
    let pieces: Vec<Piece> = (0..n)
        .flat_map(|j| {
            lens.iter().enumerate().map(move |(t, &l)| {
                let r = shard_range(l, j, n);
                Piece {
                    tensor: t,
                    start: r.start,
                    len: r.len(),
                }
            })
        })
        .filter(|p| p.len > 0)
        .collect();
    // The chunks in rank order: one tensor's codes are already in it.
    let codes = match codes_in.as_slice() {
        [one] if one.is_contiguous() => one.flatten_all()?,
        _ => bucket_copy_from(&codes_in, &pieces)?,
    };
    let mut at = 0;
    let chunks = (0..n)
        .map(|j| {
            let len = chunk_offsets(&lens, j, n).1;
            let c = codes.narrow(0, at, len);
            at += len;
            c
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let (received, scale_invs) = comm.all_to_all_gather(&chunks, &sent)?;
    let t = lens.len();
    let agreed = bucket_column_max(&scale_invs, t, t)?;
    let (offsets, mine) = chunk_offsets(&lens, rank, n);
    let mut at = 0;
    let mut slices = Vec::with_capacity(lens.len());
    for &l in &lens {
        let range = shard_range(l, rank, n);
        slices.push((at, range.clone()));
        at += range.len();
    }
    let decode: Vec<Piece> = lens
        .iter()
        .enumerate()
        .map(|(t, &l)| Piece {
            tensor: t,
            start: offsets[t],
            len: shard_len(l, rank, n),
        })
        .collect();
    // rank k's codes of tensor t decoded with the gathered [k, t] (the
    // amaxes in columns T.. are not read)
    let sums = if mine == 0 {
        None
    } else {
        Some(bucket_decode_sum(&received, &scale_invs, qtype, cfg.average, &decode)?.0)
    };
    slices
        .into_iter()
        .zip(shapes)
        .enumerate()
        .map(|(t, ((at, range), shape))| {
            let shard = match &sums {
                Some(s) => s.narrow(0, at, range.len())?,
                // nothing of this bucket on this rank: an empty view
                None => agreed.narrow(0, 0, 0)?,
            };
            Ok(ReducedShard {
                shard,
                range,
                shape: shape.clone(),
                amax: agreed.narrow(0, t, 1)?,
            })
        })
        .collect()
}

/// [`fp8_all_gather`](crate::fp8_all_gather) of every tensor of a bucket:
/// `shards[t]` is this rank's slice of tensor `t` (read flat,
/// `shard_len(L_t, rank, N)` elements: a float tensor, F32, F16 or BF16,
/// or a [`ScalingTensor`] such as ZeRO's FP16 master slices) and
/// `shapes[t]` its whole shape; element `t` of the result is bitwise what
/// `fp8_all_gather` of the slice's value returns, with one amax all-reduce
/// and one [`all_gather`](Communicator::all_gather) for the bucket. Each
/// rank's chunk is padded to the longest rank's, `S_0` (at most `T` bytes
/// more than the per-tensor calls send). Scaling tensors all of the
/// configured format, or all FP16 with E4M3 configured, take a bucket at a
/// time (`amp_core::bucket_*`: the amaxes, the scales, the cast and the
/// reordering of the gathered slices in one launch each).
///
/// # Errors
/// [`Error::InvalidArgument`] when the lengths do not match; [`Error::DType`]
/// for a slice that is neither; the communicator's errors.
pub fn fp8_all_gather_bucket<'a, C, G>(
    comm: &C,
    shards: impl IntoIterator<Item = G>,
    shapes: &[Shape],
    cfg: &Fp8ReduceConfig,
) -> Result<Vec<Fp8Reduced>>
where
    C: Communicator + ?Sized,
    G: Into<Grad<'a>>,
{
    const OP: &str = "fp8_all_gather_bucket";
    let (shards, _) = inputs(OP, shards)?;
    if shards.len() != shapes.len() {
        return Err(Error::InvalidArgument {
            op: OP,
            what: format!("{} shards for {} shapes", shards.len(), shapes.len()),
        });
    }
    if shards.is_empty() {
        return Ok(Vec::new());
    }
    let (n, rank) = (comm.world_size(), comm.rank());
    let lens: Vec<usize> = shapes.iter().map(Shape::elem_count).collect();
    for (t, (s, &l)) in shards.iter().zip(&lens).enumerate() {
        if s.elem_count() != shard_len(l, rank, n) {
            return Err(Error::InvalidArgument {
                op: OP,
                what: format!(
                    "shard {t} has {} elements, rank {rank} of {n} holds {} of {l}",
                    s.elem_count(),
                    shard_len(l, rank, n)
                ),
            });
        }
    }
    let widest = chunk_offsets(&lens, 0, n).1;
    let offsets: Vec<Vec<usize>> = (0..n).map(|r| chunk_offsets(&lens, r, n).0).collect();
    if let Some((scaled, from)) = gather_fused(&shards, cfg) {
        // Bucket kernels and collectives only: on the communicator's stream.
        let body = || gather_fused_body(comm, &scaled, from, &lens, shapes, cfg);
        return match comm.side_stream() {
            Some(side) => side.run(body),
            None => body(),
        };
    }
    let pad = |chunk: Tensor| -> Result<Tensor> {
        Ok(if chunk.elem_count() < widest {
            let pad = Tensor::zeros(widest - chunk.elem_count(), DType::U8, comm.device())?;
            Tensor::cat(&[&chunk, &pad], 0)?
        } else {
            chunk
        })
    };
    // The amax of an empty slice is 0, as `fp8_all_gather` takes it.
    let zero = Tensor::zeros(1, DType::F32, comm.device())?;
    let amaxes = shards
        .iter()
        .map(|s| {
            Ok(if s.elem_count() == 0 {
                zero.clone()
            } else {
                s.amax()?
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let (metas, _) = agreed_metas(comm, &amaxes, cfg)?;
    let codes = shards
        .iter()
        .zip(&metas)
        .filter(|(s, _)| s.elem_count() > 0)
        .map(|(s, m)| s.cast(m))
        .collect::<Result<Vec<_>>>()?;
    let chunk = match codes.first() {
        Some(first) => pad(cat_nonempty(&codes, first)?)?,
        None => Tensor::zeros(widest, DType::U8, comm.device())?,
    };
    let gathered = comm.all_gather(&chunk)?;
    metas
        .into_iter()
        .enumerate()
        .map(|(t, meta)| {
            let parts = (0..n)
                .map(|r| {
                    let len = shard_len(lens[t], r, n);
                    Ok(gathered.get(r)?.narrow(0, offsets[r][t], len)?)
                })
                .collect::<Result<Vec<_>>>()?;
            let whole = cat_nonempty(&parts, &parts[0])?.reshape(shapes[t].clone())?;
            let amax = meta.amax()?;
            Ok(Fp8Reduced {
                grad: ScalingTensor::from_parts(whole, meta)?,
                amax,
            })
        })
        .collect()
}

/// The gather a bucket at a time (see [`gather_fused`]): bucket kernels
/// and collectives only, so it may run on the communicator's stream.
fn gather_fused_body<C: Communicator + ?Sized>(
    comm: &C,
    scaled: &[&ScalingTensor],
    from: QType,
    lens: &[usize],
    shapes: &[Shape],
    cfg: &Fp8ReduceConfig,
) -> Result<Vec<Fp8Reduced>> {
    let n = comm.world_size();
    let widest = chunk_offsets(lens, 0, n).1;
    let offsets: Vec<Vec<usize>> = (0..n).map(|r| chunk_offsets(lens, r, n).0).collect();
    let codes_in: Vec<&Tensor> = scaled.iter().map(|s| s.data()).collect();
    let sinv_in: Vec<&Tensor> = scaled.iter().map(|s| s.meta().scale_inv()).collect();
    let amax = bucket_amax(&codes_in, &sinv_in, from)?;
    let global = comm.all_reduce_max_no_nan(&amax)?;
    let (scale, scale_inv) = bucket_scales(&global, cfg.qtype, cfg.scale_rule, cfg.margin)?;
    // This rank's slices re-cast and padded with zeros to the widest chunk
    // (all zeros where it holds none).
    let chunk = bucket_requantize(
        &codes_in,
        &sinv_in,
        from,
        &scale,
        None,
        Some(cfg.qtype),
        Some(widest),
    )?;
    let gathered = comm.all_gather(&chunk)?.flatten_all()?;
    let pieces: Vec<Piece> = lens
        .iter()
        .enumerate()
        .flat_map(|(t, &l)| {
            let offsets = &offsets;
            (0..n).map(move |r| Piece {
                tensor: t,
                start: r * widest + offsets[r][t],
                len: shard_len(l, r, n),
            })
        })
        .filter(|p| p.len > 0)
        .collect();
    let whole = bucket_copy(&gathered, &pieces)?;
    let metas = metas_of(cfg.qtype, &scale, &scale_inv, &global, lens.len())?;
    let mut at = 0;
    lens.iter()
        .zip(shapes)
        .zip(metas)
        .map(|((&l, shape), meta)| {
            let codes = whole.narrow(0, at, l)?.reshape(shape.clone())?;
            at += l;
            let amax = meta.amax()?;
            Ok(Fp8Reduced {
                grad: ScalingTensor::from_parts(codes, meta)?,
                amax,
            })
        })
        .collect()
}

/// The slices and their format when the gather can run a bucket at a
/// time: every slice a scaling tensor of the configured FP8 format, or
/// every one FP16 with E4M3 configured.
fn gather_fused<'i>(
    shards: &'i [Input],
    cfg: &Fp8ReduceConfig,
) -> Option<(Vec<&'i ScalingTensor>, QType)> {
    let scaled = shards
        .iter()
        .map(|x| match x {
            Input::Scaled(s) => Some(s),
            Input::Float(_) => None,
        })
        .collect::<Option<Vec<_>>>()?;
    let from = scaled.first()?.qtype();
    let ok = scaled.iter().all(|s| s.qtype() == from)
        && ((from == cfg.qtype && from != QType::F16)
            || (from == QType::F16 && cfg.qtype == QType::E4M3));
    ok.then_some((scaled, from))
}
