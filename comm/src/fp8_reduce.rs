//! FP8 gradient all-reduce, each rank's codes decoded with that rank's own
//! scale, F32 accumulation, the result's scale from a bound every rank
//! computes alike; and the halves ZeRO uses ([`fp8_reduce_scatter`] and
//! [`fp8_all_gather`]).
//!
//! [`fp8_all_reduce`] on every rank:
//! 1. its gradient as FP8 codes of `qtype` with its own scale: an FP8
//!    gradient of that format as the layer cast it (no second rounding);
//!    any other cast with current scaling from its own amax (NaN counted
//!    as inf; `scale_rule`, MS-AMP's power of two by default, and
//!    `margin`);
//! 2. the codes, cut by [`shard_range`], are exchanged and every rank's
//!    scale and codes' amax gathered, in one exchange
//!    ([`all_to_all_gather`](Communicator::all_to_all_gather)): rank r
//!    receives chunk r of every rank, as `U8` (the reduce-scatter
//!    pattern), and every rank's `scale_inv` (NaN when its amax was not
//!    finite, so that its non-finite values reach every rank even where
//!    its cast saturated them) and the largest decoded value of its codes
//!    ([`bucket_scales_sent`](amp_core::bucket_scales_sent));
//! 3. rank k's chunk is decoded with rank k's `scale_inv`, the chunks
//!    summed in F32 in rank order (never in FP8), then divided by `N` when
//!    `average` is set;
//! 4. the result's scale comes from the sum of the ranks' amaxes (divided
//!    by `N` when `average`; [`bucket_mean_bound`](amp_core::bucket_mean_bound)),
//!    which no element of the result can exceed, computed by every rank
//!    from the same numbers, so bitwise identical; it quantizes each
//!    rank's chunk;
//! 5. the FP8 chunks are all-gathered ([`all_gather_shards`]).
//!
//! No rank re-rounds its codes to a shared scale before the exchange, and
//! no pass over the sums or collective agrees the result's amax: the
//! scale from the bound is up to `log2 N` binades coarser than one from
//! the result's own amax where the ranks' largest values fall apart.
//!
//! **Headroom.** MS-AMP sums FP8 on the wire, so it must scale the
//! gradient down by the world size to keep the sum from saturating. Here
//! the sum is F32 and step 4 picks a scale no element exceeds, so nothing
//! can saturate and no headroom is needed: the default `margin` is 0. A
//! `margin` can still be set (the scale is divided by `2^margin`).
//!
//! **Wire bytes** (as [`Communicator`] counts them; `L` elements, `N`
//! ranks, `s_r` = this rank's chunk): `L - s_r` bytes of codes in step 2,
//! `(N - 1) * s_r` in step 5, plus the gathered scale and amax (`8 (N -
//! 1)`). An F32 [`all_reduce`](Communicator::all_reduce) of the same
//! gradient sends `4 (L - s_r + (N - 1) s_r)`: four times the codes.
//!
//! **Non-finite gradients.** When any rank's gradient holds inf or NaN, the
//! bound (the result's amax) is inf on every rank,
//! [`Fp8Reduced::is_finite`] is false on every rank and the result is
//! meaningless: skip the step.
//!
//! **Buckets.** [`fp8_all_reduce_bucket`](crate::fp8_all_reduce_bucket)
//! runs these steps for several gradients at once: one exchange of the
//! concatenated codes with the scales and amaxes as one vector, and one
//! all-gather, each tensor bitwise the result of this function (see its
//! docs for the layout and the bytes).
//!
//! [`all_gather_shards`]: Communicator::all_gather_shards

use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::shard::shard_range;
use amp_core::{bucket_scales_sent, AmaxComputeAlgo, QType, ScaleRule, ScalingMeta, ScalingTensor};
use candle_core::{DType, Device, Shape, Tensor};
use std::ops::Range;

/// Settings of the FP8 reductions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8ReduceConfig {
    /// The format on the wire and of the result (E4M3 or E5M2; F16 works too).
    pub qtype: QType,
    /// Divide the sum by the world size (data parallelism's mean gradient).
    pub average: bool,
    /// How a scale follows from an amax.
    pub scale_rule: ScaleRule,
    /// Extra headroom: scales are divided by `2^margin` (0 needs none, see
    /// the module docs).
    pub margin: u32,
    /// [`fp8_all_reduce_bucket`](crate::fp8_all_reduce_bucket) only: every
    /// rank receives every rank's codes whole and reduces the whole bucket
    /// itself (one exchange instead of an exchange and an all-gather; the
    /// same bytes at `N = 2`, `(N - 1) L` a rank against `2 (N - 1) L / N`;
    /// each rank decodes `N` times the codes instead of `N` times a
    /// `1 / N` share of them). The same results bit for bit. Off by
    /// default.
    pub one_shot: bool,
}

impl Default for Fp8ReduceConfig {
    fn default() -> Self {
        Self {
            qtype: QType::E4M3,
            average: true,
            scale_rule: ScaleRule::PowerOfTwo,
            margin: 0,
            one_shot: false,
        }
    }
}

/// A gradient as the layers hand it over: a float tensor (F32, F16, BF16),
/// or an FP8 [`ScalingTensor`] with its own per-rank scale (the FP8
/// Linear's weight gradient).
#[derive(Debug, Clone, Copy)]
pub enum Grad<'a> {
    /// A float tensor.
    Tensor(&'a Tensor),
    /// A scaled tensor; it is decoded with its own scale first.
    Scaled(&'a ScalingTensor),
}

impl<'a> From<&'a Tensor> for Grad<'a> {
    fn from(t: &'a Tensor) -> Self {
        Self::Tensor(t)
    }
}

impl<'a> From<&'a ScalingTensor> for Grad<'a> {
    fn from(t: &'a ScalingTensor) -> Self {
        Self::Scaled(t)
    }
}

/// This rank's chunk of a reduced gradient, in F32 (what a ZeRO rank's
/// optimizer updates).
#[derive(Debug, Clone)]
pub struct ReducedShard {
    /// The chunk: 1-D F32, elements `range` of the flat sum (or mean).
    pub shard: Tensor,
    /// Which elements of the flat gradient the chunk holds.
    pub range: Range<usize>,
    /// The gradient's shape.
    pub shape: Shape,
    /// The agreed amax of the inputs: the largest of the ranks' amaxes as
    /// their casts recorded them (F32, one element, bitwise the same on
    /// every rank; inf when any rank's gradient held inf or NaN).
    pub amax: Tensor,
}

/// A reduced (or gathered) tensor in FP8, the same on every rank.
#[derive(Debug, Clone)]
pub struct Fp8Reduced {
    /// The result; its scale is bitwise the same on every rank and its
    /// metadata's amax is [`amax`](Self::amax).
    pub grad: ScalingTensor,
    /// The result's amax as its scale came from (for an all-reduce the
    /// bound of step 4, at least the result's own amax; F32, one element,
    /// the same on every rank): inf when any rank's gradient was not
    /// finite.
    pub amax: Tensor,
}

fn is_finite_amax(amax: &Tensor) -> Result<bool> {
    let v = amax.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.iter().all(|a| a.is_finite()))
}

impl ReducedShard {
    /// Whether every rank's gradient was finite (a host read of the agreed
    /// amax: once per step, as a loss scaler's check).
    ///
    /// # Errors
    /// Only candle's.
    pub fn is_finite(&self) -> Result<bool> {
        is_finite_amax(&self.amax)
    }
}

impl Fp8Reduced {
    /// Whether every rank's gradient and the result were finite (a host
    /// read of the agreed amax). False on every rank alike: skip the step.
    ///
    /// # Errors
    /// Only candle's.
    pub fn is_finite(&self) -> Result<bool> {
        is_finite_amax(&self.amax)
    }
}

/// `max |x|` of a float tensor as a 1-element F32 tensor, NaN turned into inf.
pub(crate) fn local_amax(x: &Tensor, qtype: QType) -> Result<Tensor> {
    // The amax comes from amp-core's fused cast; its codes are discarded.
    let unit = ScalingMeta::new(qtype, 1, x.device())?;
    let (_, amax) = ScalingTensor::quantize_with(x, &unit)?;
    let inf = Tensor::full(f32::INFINITY, amax.shape(), amax.device())?;
    Ok(amax.ne(&amax)?.where_cond(&inf, &amax)?)
}

/// One metadata every rank derives from the all-reduced max of `amax`;
/// its amax history holds that global amax.
fn agreed_meta<C: Communicator + ?Sized>(
    comm: &C,
    amax: &Tensor,
    cfg: &Fp8ReduceConfig,
) -> Result<ScalingMeta> {
    meta_from_global(comm.all_reduce_max(amax)?, cfg, comm.device())
}

/// The metadata of an agreed amax (`global`, one F32 element, the same on
/// every rank): the scale by `cfg`, the amax in its history.
pub(crate) fn meta_from_global(
    global: Tensor,
    cfg: &Fp8ReduceConfig,
    device: &Device,
) -> Result<ScalingMeta> {
    let mut meta = ScalingMeta::new(cfg.qtype, 1, device)?;
    meta.record_amax(&global)?;
    meta.update_scale(cfg.scale_rule, AmaxComputeAlgo::MostRecent, cfg.margin)?;
    Ok(ScalingMeta::from_parts(
        cfg.qtype,
        meta.scale().clone(),
        meta.scale_inv().clone(),
        global,
    )?)
}

/// A gradient as a float tensor: float tensors as they are, scaled ones
/// decoded with their own scale.
pub(crate) fn float_input(op: &'static str, grad: Grad<'_>) -> Result<Tensor> {
    match grad {
        Grad::Tensor(t) => match t.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => Ok(t.clone()),
            got => Err(Error::DType {
                op,
                expected: "F32, F16, BF16 or a ScalingTensor",
                got,
            }),
        },
        Grad::Scaled(s) => Ok(s.dequantize(DType::F32)?),
    }
}

/// Steps 1-3 of [`fp8_all_reduce`]: this rank's chunk
/// (`shard_range(L, rank, N)`) of the sum (or mean) of every rank's
/// `grad`, exchanged as FP8 with each rank's own scale, summed in F32; and
/// the agreed amax of the inputs (every rank's amax, as its cast recorded
/// it, gathered with the scales: the largest, NaN counted as inf). ZeRO's
/// first half.
///
/// # Errors
/// [`Error::DType`] for a gradient that is not a float tensor, and the
/// communicator's errors (every rank must call it with the same shape).
pub fn fp8_reduce_scatter<'a, C: Communicator + ?Sized>(
    comm: &C,
    grad: impl Into<Grad<'a>>,
    cfg: &Fp8ReduceConfig,
) -> Result<ReducedShard> {
    let (shard, shape, gathered) = own_scale_chunk(comm, "fp8_reduce_scatter", grad.into(), cfg)?;
    Ok(ReducedShard {
        shard,
        range: shard_range(shape.elem_count(), comm.rank(), comm.world_size()),
        shape,
        amax: amp_core::bucket_column_max(&gathered, 1, 1)?,
    })
}

/// Steps 1-3 of [`fp8_all_reduce`] for one gradient: this rank's own codes
/// exchanged (chunk `r` of every rank to rank `r`) together with every
/// rank's scale and amax (gathered, `[N, 2]`: rank `k`'s `scale_inv`,
/// NaN where its amax is not finite, and its codes' amax), and this rank's chunk
/// of the rank-order F32 sum (or mean), rank `k`'s codes decoded with rank
/// `k`'s scale; with the gradient's shape and the gathered `[N, 2]`.
fn own_scale_chunk<C: Communicator + ?Sized>(
    comm: &C,
    op: &'static str,
    grad: Grad<'_>,
    cfg: &Fp8ReduceConfig,
) -> Result<(Tensor, Shape, Tensor)> {
    let own = own_codes(op, grad, cfg)?;
    let n = comm.world_size();
    let shape = own.shape().clone();
    let len = shape.elem_count();
    let flat = own.data().flatten_all()?;
    let chunks = (0..n)
        .map(|j| {
            let r = shard_range(len, j, n);
            flat.narrow(0, r.start, r.len())
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let sent = scales_sent(&[&own])?;
    let (received, gathered) = comm.all_to_all_gather(&chunks, &sent)?;
    let scale_invs = gathered.narrow(1, 0, 1)?.flatten_all()?;
    let (sum, _) =
        crate::rank_sum::rank_order_mean(&received, &scale_invs, own.qtype(), cfg.average)?;
    Ok((sum, shape, gathered))
}

/// Steps 4-5 of [`fp8_all_reduce`] (and ZeRO's weight all-gather): every
/// rank passes its chunk (`shard_range(L, rank, N)` of a tensor of
/// `shape`, float), all agree on one scale from the chunks' amaxes, and
/// every rank gets the whole tensor as FP8 with that scale.
///
/// # Errors
/// As [`fp8_reduce_scatter`]; a chunk of the wrong length gives the
/// communicator's `InvalidArgument`.
pub fn fp8_all_gather<C: Communicator + ?Sized>(
    comm: &C,
    shard: &Tensor,
    shape: impl Into<Shape>,
    cfg: &Fp8ReduceConfig,
) -> Result<Fp8Reduced> {
    let shape = shape.into();
    let flat = shard.flatten_all()?;
    let meta = agreed_meta(comm, &local_amax(&flat, cfg.qtype)?, cfg)?;
    let (q, _) = ScalingTensor::quantize_with(&flat, &meta)?;
    let codes = comm
        .all_gather_shards(q.data(), shape.elem_count())?
        .reshape(shape)?;
    let amax = meta.amax()?;
    Ok(Fp8Reduced {
        grad: ScalingTensor::from_parts(codes, meta)?,
        amax,
    })
}

/// What each rank sends with its codes ([`bucket_scales_sent`]): its `T`
/// scale_invs (NaN where the tensor's amax is not finite) and its codes'
/// `T` amaxes (the largest decoded values), `[2T]`; gathered, `[N, 2T]`
/// holds rank `k`'s scale of tensor `t` at `[k, t]` and its amax at
/// `[k, T + t]`. One launch (it may run on the communicator's stream);
/// the tensors share one FP8 format.
pub(crate) fn scales_sent(own: &[&ScalingTensor]) -> Result<Tensor> {
    let sinv: Vec<&Tensor> = own.iter().map(|s| s.meta().scale_inv()).collect();
    let scale: Vec<&Tensor> = own.iter().map(|s| s.meta().scale()).collect();
    let amax = own
        .iter()
        .map(|s| s.meta().amax())
        .collect::<amp_core::Result<Vec<_>>>()?;
    let amax: Vec<&Tensor> = amax.iter().collect();
    let qtype = own.first().map_or(QType::E4M3, |s| s.qtype());
    Ok(bucket_scales_sent(&sinv, &scale, &amax, qtype)?)
}

/// This rank's gradient as codes of `cfg.qtype` with its own scale: an FP8
/// gradient of that format as it is; any other (a float tensor, another
/// format, decoded first) cast with current scaling from its own amax
/// (NaN counted as inf), by `cfg`'s rule and margin.
pub(crate) fn own_codes(
    op: &'static str,
    grad: Grad<'_>,
    cfg: &Fp8ReduceConfig,
) -> Result<ScalingTensor> {
    if let Grad::Scaled(s) = grad {
        if s.qtype() == cfg.qtype {
            return Ok(s.clone());
        }
    }
    let x = float_input(op, grad)?;
    let meta = meta_from_global(local_amax(&x.flatten_all()?, cfg.qtype)?, cfg, x.device())?;
    Ok(ScalingTensor::quantize_with(&x, &meta)?.0)
}

/// The sum (or, with `cfg.average`, the mean) of every rank's `grad`, as
/// FP8 with one scale shared by all ranks; FP8 on the wire, each rank's
/// codes decoded with its own scale, F32 accumulation (see the module docs
/// for the steps, bytes and headroom). Every rank must call it with a
/// gradient of the same shape.
///
/// ```
/// use amp_comm::{fp8_all_reduce, run_ranks, Fp8ReduceConfig};
/// use candle_core::{DType, Device, Tensor};
/// let out = run_ranks(2, |comm| {
///     let g = Tensor::new(&[1.0f32, -2.0, 0.5], &Device::Cpu)?;
///     let r = fp8_all_reduce(&comm, &g, &Fp8ReduceConfig::default())?; // mean
///     Ok::<_, amp_comm::Error>((r.is_finite()?, r.grad.dequantize(DType::F32)?.to_vec1::<f32>()?))
/// })?;
/// assert_eq!(out[0], (true, vec![1.0, -2.0, 0.5]));
/// assert_eq!(out[0], out[1]);
/// # Ok::<(), amp_comm::Error>(())
/// ```
///
/// # Errors
/// [`Error::DType`] for a gradient that is not a float tensor or a
/// [`ScalingTensor`], and the communicator's errors (every rank must call
/// it with the same shape).
pub fn fp8_all_reduce<'a, C: Communicator + ?Sized>(
    comm: &C,
    grad: impl Into<Grad<'a>>,
    cfg: &Fp8ReduceConfig,
) -> Result<Fp8Reduced> {
    let (sum, shape, gathered) = own_scale_chunk(comm, "fp8_all_reduce", grad.into(), cfg)?;
    // Step 4: the result's scale from the bound of the mean's amax that
    // every rank computes from the same gathered amaxes.
    let bound = amp_core::bucket_mean_bound(&gathered, 1, 1, cfg.average)?;
    let (scale, scale_inv) =
        amp_core::bucket_scales(&bound, cfg.qtype, cfg.scale_rule, cfg.margin)?;
    let meta = ScalingMeta::from_parts(cfg.qtype, scale, scale_inv, bound.clone())?;
    let (q, _) = ScalingTensor::quantize_with(&sum, &meta)?;
    // Step 5.
    let codes = comm
        .all_gather_shards(q.data(), shape.elem_count())?
        .reshape(shape)?;
    Ok(Fp8Reduced {
        grad: ScalingTensor::from_parts(codes, meta)?,
        amax: bound,
    })
}
