//! [`fp8_all_reduce_bucket`]: [`fp8_all_reduce`](crate::fp8_all_reduce) of
//! several gradients at once, with two exchanges per bucket instead of two
//! per tensor (the layout, the steps and the bytes on the wire are
//! documented on the function).

use crate::bucket_cast::{cat_nonempty, fused, inputs, metas_of, own_all};
use crate::communicator::Communicator;
use crate::error::Result;
use crate::fp8_reduce::scales_sent;
use crate::fp8_reduce::{Fp8ReduceConfig, Fp8Reduced, Grad};
use crate::rank_sum::rank_order_mean;
use crate::shard::shard_range;
use amp_core::{
    bucket_concat, bucket_decode_sum_quantize, bucket_mean_bound, bucket_scales, Piece,
    ScalingTensor,
};
use candle_core::Tensor;

const OP: &str = "fp8_all_reduce_bucket";

/// `fp8_all_reduce` of every gradient of a bucket, with one exchange of
/// the codes with the ranks' scales and one all-gather for the whole
/// bucket: the same bytes as the separate calls summed over the ranks, in
/// 2 exchanges instead of `2 T`.
///
/// Element `t` of the result is bitwise what
/// [`fp8_all_reduce`](crate::fp8_all_reduce)`(comm, grads[t], cfg)` returns
/// (codes, scale, `scale_inv`, amaxes, [`Fp8Reduced::is_finite`]): each
/// tensor keeps its own scales, and a non-finite value in one tensor
/// makes only that one non-finite. Every rank must pass the same number of
/// gradients, in the same order, with the same shapes; an empty bucket
/// returns an empty vector without communicating.
///
/// ```
/// use amp_comm::{fp8_all_reduce_bucket, run_ranks, Communicator, Fp8ReduceConfig};
/// use candle_core::{DType, Device, Tensor};
/// let out = run_ranks(2, |comm| {
///     let a = Tensor::new(&[1.0f32, -2.0, 0.5], &Device::Cpu)?;
///     let b = Tensor::new(&[1000.0f32 * (comm.rank() as f32 + 1.0)], &Device::Cpu)?;
///     let r = fp8_all_reduce_bucket(&comm, [&a, &b], &Fp8ReduceConfig::default())?; // means
///     r.iter()
///         .map(|r| Ok(r.grad.dequantize(DType::F32)?.to_vec1::<f32>()?))
///         .collect::<Result<Vec<_>, amp_comm::Error>>()
/// })?;
/// // b: the casts round 1000 and 2000 to 1024 and 2048, their mean is 1536.
/// assert_eq!(out[0], [vec![1.0, -2.0, 0.5], vec![1536.0]]);
/// assert_eq!(out[0], out[1]);
/// # Ok::<(), amp_comm::Error>(())
/// ```
///
/// # Layout
/// The bucket is the concatenation of its tensors, flat and in the order
/// given (`T` tensors of `L_t` elements, tensor `t` at offset
/// `o_t = L_0 + .. + L_(t-1)`, `L = L_0 + .. + L_(T-1)` elements in all).
/// The bucket, not each tensor, is cut by [`shard_range`]: rank `r` owns
/// elements `shard_range(L, r, N)` of it, a range that may begin or end
/// inside a tensor and may span several (a bucket boundary inside a
/// tensor). This is the layout the [`Communicator`]'s `all_to_all` and
/// `all_gather_shards` already take, so nothing is padded, and the ranks
/// share the work evenly (per-tensor chunks would give rank 0 one element
/// more of every tensor whose length `N` does not divide, and every
/// one-element tensor).
///
/// # Steps (each rank)
/// 1. each tensor's codes with this rank's own scale (an FP8 gradient of
///    the configured format as it is, anything else cast from its own
///    amax), concatenated (a bucket of one tensor without a copy), and the
///    `[2T]` vector this rank sends ([`bucket_scales_sent`](amp_core::bucket_scales_sent): each
///    `scale_inv`, NaN where the tensor's amax is not finite, and each
///    tensor's codes' amax);
/// 2. the codes and that vector are exchanged in **one** exchange
///    (`all_to_all_gather`: rank `r` receives elements `shard_range(L, r,
///    N)` of every rank's codes, and every rank's vector, `[N, 2T]`);
/// 3. each tensor's scale comes from the bound of its mean's amax, the
///    sum of the ranks' amaxes over `N` ([`bucket_mean_bound`](amp_core::bucket_mean_bound)), the same
///    on every rank;
/// 4. each tensor's part of the codes is decoded, rank `k`'s with rank
///    `k`'s scale of that tensor, summed in F32 in rank order, divided by
///    `N` when `average` is set, and quantized with the tensor's scale
///    (one pass, [`bucket_decode_sum_quantize`](amp_core::bucket_decode_sum_quantize));
/// 5. the codes of this rank's range are all-gathered (**one**
///    `all_gather_shards` of `L` elements) and cut back into tensors.
///
/// **Bitwise equality with `fp8_all_reduce`.** Decoding, the rank-order sum,
/// the division and the casts are elementwise, with the same scales and
/// the same operands in the same order for every element whichever rank
/// owns it, and the bounds come from the same gathered values. So for
/// every tensor, codes, scale, `scale_inv` and amax are bitwise those of
/// `fp8_all_reduce` of that tensor alone, and a non-finite value in one
/// tensor makes only that tensor's result non-finite.
///
/// # Wire bytes
/// As the [`Communicator`] counts them, with `b` bytes a code (1 for FP8)
/// and `s_r = shard_len(L, r, N)`, rank `r` sends
///
/// `8 (N - 1) T` (the scales and amaxes) `+ b (L + (N - 2) s_r)` (the
/// codes: `L - s_r` in step 2, `(N - 1) s_r` in step 5),
///
/// and nothing when `N = 1`. The `T` separate calls send, on rank `r`,
/// `8 (N - 1) T + b (L + (N - 2) S_r)` with
/// `S_r = shard_len(L_0, r, N) + .. + shard_len(L_(T-1), r, N)`. Summed
/// over the ranks both come to the same bytes: the bucket moves them,
/// spread more evenly, in 2 exchanges instead of `2 T` (3 and `3 T` on a
/// backend that sends the scales apart). Rank 0 sends no more codes in
/// the bucket (`ceil(L / N) <= S_0`); another rank may send a little more
/// than its per-tensor share.
///
/// # Errors
/// [`Error::DType`](crate::Error::DType) for a gradient that is not a float tensor or a
/// [`ScalingTensor`], and the communicator's errors.
pub fn fp8_all_reduce_bucket<'a, C, G>(
    comm: &C,
    grads: impl IntoIterator<Item = G>,
    cfg: &Fp8ReduceConfig,
) -> Result<Vec<Fp8Reduced>>
where
    C: Communicator + ?Sized,
    G: Into<Grad<'a>>,
{
    let (inputs, shapes) = inputs(OP, grads)?;
    if inputs.is_empty() {
        return Ok(Vec::new());
    }
    let (n, rank) = (comm.world_size(), comm.rank());
    // Each tensor's range in the bucket.
    let mut spans = Vec::with_capacity(inputs.len());
    let mut total = 0;
    for x in &inputs {
        spans.push(total..total + x.elem_count());
        total += x.elem_count();
    }
    let mine = shard_range(total, rank, n);
    // Per tensor, its part of this rank's range (chunk coordinates).
    let pieces: Vec<Piece> = spans
        .iter()
        .enumerate()
        .filter_map(|(t, s)| {
            let (lo, hi) = (s.start.max(mine.start), s.end.min(mine.end));
            (lo < hi).then(|| Piece {
                tensor: t,
                start: lo - mine.start,
                len: hi - lo,
            })
        })
        .collect();
    // Step 2: one exchange; rank r gets elements `shard_range(L, r, N)` of
    // every rank's codes, and every rank's `[2T]` scales and amaxes.
    let exchange = |codes: &Tensor, sent: &Tensor| -> Result<(Vec<Tensor>, Tensor)> {
        let chunks = (0..n)
            .map(|j| {
                let r = shard_range(total, j, n);
                codes.narrow(0, r.start, r.len())
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        comm.all_to_all_gather(&chunks, sent)
    };
    let t_count = inputs.len();
    let fast = fused(&inputs, cfg, n);
    // One shot (`cfg.one_shot`, on the fused path): every tensor whole is
    // this rank's piece of a bucket every rank receives whole.
    let one_shot = cfg.one_shot && fast.is_some() && n > 1;
    let (mine, pieces) = if one_shot {
        let whole: Vec<Piece> = spans
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .map(|(t, s)| Piece {
                tensor: t,
                start: s.start,
                len: s.len(),
            })
            .collect();
        (0..total, whole)
    } else {
        (mine, pieces)
    };
    // The fused path launches only the bucket kernels and the collectives,
    // so it may run on the communicator's own stream.
    let side = comm.side_stream().filter(|_| fast.is_some());
    let body = || -> Result<Vec<Fp8Reduced>> {
        // Step 1: each tensor's codes with this rank's own scale (the
        // layers' FP8 gradients as they are), and the `[2T]` scales (NaN
        // where an amax is not finite) and amaxes this rank sends.
        let own: Vec<ScalingTensor> = match &fast {
            Some((scaled, _)) => scaled.iter().map(|s| (*s).clone()).collect(),
            None => own_all(&inputs, cfg)?,
        };
        let qtype = cfg.qtype;
        let sent = scales_sent(&own.iter().collect::<Vec<_>>())?;
        let codes = match &fast {
            // a bucket at a time (one launch each): concatenated unless one
            Some(_) => {
                let codes_in: Vec<&Tensor> = own.iter().map(|s| s.data()).collect();
                match codes_in.as_slice() {
                    [one] if one.is_contiguous() => one.flatten_all()?,
                    _ => bucket_concat(&codes_in)?,
                }
            }
            None => {
                let flat = own
                    .iter()
                    .map(|s| s.data().flatten_all())
                    .collect::<candle_core::Result<Vec<_>>>()?;
                cat_nonempty(&flat, &flat[0])?
            }
        };
        // Step 2 (one shot: every rank's codes whole, to every rank).
        let (received, gathered) = if one_shot {
            comm.all_to_all_gather(&vec![codes.clone(); n], &sent)?
        } else {
            exchange(&codes, &sent)?
        };
        // Step 3: each tensor's result scale from the bound of its mean's
        // amax, the same on every rank (no agreement needed).
        let bound = bucket_mean_bound(&gathered, t_count, t_count, cfg.average)?;
        let (rscale, rscale_inv) = bucket_scales(&bound, qtype, cfg.scale_rule, cfg.margin)?;
        let result_metas = metas_of(qtype, &rscale, &rscale_inv, &bound, t_count)?;
        // Step 4: this rank's pieces decoded (rank k's codes of tensor t
        // with the gathered [k, t]), summed, cast with the result scales.
        let shard = match &fast {
            Some(_) if pieces.is_empty() => codes.narrow(0, mine.start, 0)?,
            Some(_) => bucket_decode_sum_quantize(
                &received,
                &gathered,
                qtype,
                cfg.average,
                &pieces,
                &rscale,
            )?,
            None => {
                let out_codes = pieces
                    .iter()
                    .map(|p| {
                        let parts = received
                            .iter()
                            .map(|c| c.narrow(0, p.start, p.len))
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        let column = gathered.narrow(1, p.tensor, 1)?.flatten_all()?;
                        let (sum, _) = rank_order_mean(&parts, &column, qtype, cfg.average)?;
                        Ok(ScalingTensor::quantize_with(&sum, &result_metas[p.tensor])?
                            .0
                            .data()
                            .clone())
                    })
                    .collect::<Result<Vec<_>>>()?;
                cat_nonempty(&out_codes, &codes)?
            }
        };
        let result_global = bound;

        // Step 5: one all-gather of the bucket, cut back into tensors; each
        // tensor's amax the bound its scale came from (one shot: the
        // whole bucket is this rank's already).
        let gathered = if one_shot {
            shard
        } else {
            comm.all_gather_shards(&shard, total)?
        };
        let amaxes = result_global;
        spans
            .into_iter()
            .zip(shapes)
            .zip(result_metas)
            .enumerate()
            .map(|(t, ((span, shape), result_meta))| {
                let codes = gathered.narrow(0, span.start, span.len())?.reshape(shape)?;
                let amax = amaxes.narrow(0, t, 1)?;
                Ok(Fp8Reduced {
                    grad: ScalingTensor::from_parts(codes, result_meta)?,
                    amax,
                })
            })
            .collect()
    };
    match side {
        Some(side) => side.run(body),
        None => body(),
    }
}
