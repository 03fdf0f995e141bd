//! Precision telemetry of the FP8 Linear layers. While it records
//! ([`set_telemetry`]), every FP8 cast of a Linear's input, weight and
//! output gradient, and of its weight gradient where a sink takes it,
//! leaves a record on the device: the cast's amax and scale, how many
//! elements it saturated and flushed to zero, and its relative error
//! against the tensor it was cast from; the layers' `take_telemetry` reads
//! them back, and the low-bit optimizer records its moments' casts the
//! same way. Below the layers, so that both can record. Off (the default)
//! a cast pays one thread-local read.

use crate::error::{Error, Result};
use crate::scaling::block::BlockTensor;
use crate::scaling::meta::ScalingMeta;
use crate::scaling::tensor::ScalingTensor;
use candle_core::{DType, Tensor};
use std::cell::Cell;

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
}

/// Turns recording on or off for the casts this thread runs (a forward
/// and its backward run on the thread that called them; ranks run as
/// threads each decide for their own model, and two runs in one process
/// do not switch each other's). On, a cast also computes its error
/// against its source (a dequantization and two sums): turn it on for
/// the steps to look at.
pub fn set_telemetry(on: bool) {
    ON.with(|c| c.set(on));
    // the records hold the casts' counts
    crate::numerics::counts::set_counts_for_telemetry(on);
}

/// Whether [`set_telemetry`] left recording on in this thread.
pub fn telemetry_enabled() -> bool {
    ON.try_with(Cell::get).unwrap_or(false)
}

/// The roles of a Linear's records, in the order
/// `nn::Linear::take_telemetry` returns them:
/// the input, the weight, the output gradient (the GEMMs' operands) and
/// the weight gradient as the sink keeps it.
pub const TELEMETRY_ROLES: [&str; 4] = ["input", "weight", "grad_output", "weight_grad"];

/// One cast, read back to the host.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct CastRecord {
    /// The source's amax (inf or NaN where it held one).
    pub amax: f32,
    /// The scale the codes were made with.
    pub scale: f32,
    /// Elements clamped to the format's largest value.
    pub saturated: u64,
    /// Non-zero elements that became zero.
    pub flushed: u64,
    /// Elements cast.
    pub total: u64,
    /// `|decode(codes) - source| / |source|` (L2 norms over the tensor;
    /// 0 for an all-zero source cast to zeros).
    pub rel_err: f64,
}

impl CastRecord {
    /// The record of `q` as a cast of `source` (F32 values of the same
    /// element count), measured here: the source's amax, `q`'s scale, the
    /// elements of `source` beyond the format's range at that scale
    /// (saturated), the non-zero ones `q` holds as zero (flushed), and the
    /// relative error of `q`'s values. For casts that keep no statistics
    /// of their own, such as the optimizer's moments; reads to the host.
    ///
    /// # Errors
    /// Element counts that differ; candle's.
    pub fn measure(q: &ScalingTensor, source: &Tensor) -> Result<Self> {
        let scale = q.meta().scale().flatten_all()?.to_vec1::<f32>()?;
        let scale = scale.first().copied().unwrap_or(1.0);
        Self::of_values(
            "CastRecord::measure",
            &q.dequantize(DType::F32)?,
            source,
            scale,
            Some(q.qtype().max()),
        )
    }

    /// The record of a block- or rowwise-scaled cast `b` of `source`: as
    /// [`measure`](Self::measure), `scale` the smallest of its tiles'
    /// (the one of the tile that holds the amax); nothing saturates, each
    /// tile's scale coming from its own amax (a tile holding inf or NaN
    /// decodes to NaN). Reads to the host.
    ///
    /// # Errors
    /// Element counts that differ; candle's.
    pub fn measure_block(b: &BlockTensor, source: &Tensor) -> Result<Self> {
        let scale = b
            .tile_scales()?
            .flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .filter(|s| s.is_finite() && *s > 0.0)
            .fold(0f32, f32::max);
        let scale = if scale > 0.0 { 1.0 / scale } else { 1.0 };
        Self::of_values(
            "CastRecord::measure_block",
            &b.dequantize(DType::F32)?,
            source,
            scale,
            None,
        )
    }

    /// The record of `decoded` as a cast of `source` at `scale`; `limit`:
    /// the format's largest value, where a scale beyond it saturates.
    fn of_values(
        op: &'static str,
        decoded: &Tensor,
        source: &Tensor,
        scale: f32,
        limit: Option<f32>,
    ) -> Result<Self> {
        let x = source.to_dtype(DType::F32)?.flatten_all()?;
        let back = decoded.flatten_all()?;
        if x.elem_count() != back.elem_count() {
            return Err(Error::Unsupported {
                op,
                what: format!(
                    "{} source elements for {} codes",
                    x.elem_count(),
                    back.elem_count()
                ),
            });
        }
        let (xs, bs) = (x.to_vec1::<f32>()?, back.to_vec1::<f32>()?);
        let (mut amax, mut saturated, mut flushed) = (0f32, 0u64, 0u64);
        let (mut err_sq, mut src_sq) = (0f64, 0f64);
        for (&s, &b) in xs.iter().zip(&bs) {
            amax = if s.is_nan() { s } else { amax.max(s.abs()) };
            saturated += u64::from(limit.is_some_and(|l| (s * scale).abs() > l));
            flushed += u64::from(s != 0.0 && b == 0.0);
            err_sq += (f64::from(b) - f64::from(s)).powi(2);
            src_sq += f64::from(s).powi(2);
        }
        Ok(Self {
            amax,
            scale,
            saturated,
            flushed,
            total: xs.len() as u64,
            rel_err: rel_err(err_sq, src_sq),
        })
    }
}

/// `sqrt(err_sq / src_sq)`: 0 for an all-zero source cast to zeros,
/// infinite for an all-zero source cast to anything else.
fn rel_err(err_sq: f64, src_sq: f64) -> f64 {
    if src_sq > 0.0 {
        (err_sq / src_sq).sqrt()
    } else if err_sq == 0.0 {
        0.0
    } else {
        f64::INFINITY
    }
}

/// One cast's record until read: a per-tensor cast's on the device (its
/// metadata and two sums), or a block-scaled cast's, measured when it was
/// cast ([`CastRecord::measure_block`]).
#[derive(Debug, Clone)]
pub(crate) enum Pending {
    Device {
        meta: ScalingMeta,
        total: usize,
        err_sq: Tensor,
        src_sq: Tensor,
    },
    Ready(CastRecord),
}

impl Pending {
    /// The record of `q`, cast from `source` (same element count).
    pub(crate) fn of(q: &ScalingTensor, source: &Tensor) -> Result<Self> {
        let x = source.to_dtype(DType::F32)?;
        let back = q.dequantize(DType::F32)?.reshape(x.shape())?;
        let err = (back - &x)?;
        Ok(Self::Device {
            meta: q.meta().clone(),
            total: x.elem_count(),
            err_sq: err.sqr()?.sum_all()?,
            src_sq: x.sqr()?.sum_all()?,
        })
    }

    /// The record of the block-scaled `b`, cast from `source`.
    pub(crate) fn of_block(b: &BlockTensor, source: &Tensor) -> Result<Self> {
        Ok(Self::Ready(CastRecord::measure_block(b, source)?))
    }

    /// Reads it back (host reads: telemetry, not for the training step).
    pub(crate) fn read(&self) -> Result<CastRecord> {
        let (meta, total, err_sq, src_sq) = match self {
            Self::Ready(r) => return Ok(*r),
            Self::Device {
                meta,
                total,
                err_sq,
                src_sq,
            } => (meta, total, err_sq, src_sq),
        };
        let first = |t: &Tensor| -> Result<f32> {
            t.to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?
                .first()
                .copied()
                .ok_or(Error::Unsupported {
                    op: "telemetry",
                    what: "an empty scale or amax".into(),
                })
        };
        let stats = meta.last_cast_stats()?.unwrap_or_default();
        let (e, s) = (f64::from(first(err_sq)?), f64::from(first(src_sq)?));
        Ok(CastRecord {
            amax: first(&meta.amax()?)?,
            scale: first(meta.scale())?,
            saturated: stats.saturated,
            flushed: stats.flushed,
            total: *total as u64,
            rel_err: rel_err(e, s),
        })
    }
}
