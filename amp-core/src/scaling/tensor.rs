//! `ScalingTensor`: FP8 codes (or FP16 values) with their scaling metadata.

use crate::error::{Error, Result};
use crate::numerics::cast::{Amax, Dequantize, Quantize};
use crate::numerics::cast_t::QuantizeT;
use crate::numerics::counts::cast_counts;
use crate::numerics::kernel::arity;
use crate::numerics::kernel::{launch, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::recipe::CurrentScaling;
use crate::numerics::scale::FromAmax;
use crate::scaling::meta::ScalingMeta;
use candle_core::{DType, Device, Shape, Tensor};

/// A low-precision tensor: `data` holds FP8 codes (`U8`) or FP16 values
/// (`F16`); `meta` holds the scale used to make it. Its value is
/// `decode(data) * meta.scale_inv()`.
///
/// ```
/// use amp_core::{CurrentScaling, QType, ScalingTensor};
/// use candle_core::{DType, Device, Tensor};
/// let x = Tensor::new(&[0.5f32, -3.0, 96.0], &Device::Cpu)?;
/// let (q, amax) = ScalingTensor::quantize(&x, QType::E4M3, &CurrentScaling::default())?;
/// assert_eq!(amax.to_vec1::<f32>()?, [96.0]);
/// assert_eq!(q.scale_inv()?, 0.25);            // 2^floor(log2(448 / 96)) = 4
/// assert_eq!(q.dequantize(DType::F32)?.to_vec1::<f32>()?, [0.5, -3.0, 96.0]);
/// assert_eq!(q.nbytes(), 3 + 12);              // 3 codes + scale, scale_inv, amax
/// # Ok::<(), amp_core::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ScalingTensor {
    // (the scaling module's files, `requantize.rs` among them, read them)
    pub(super) data: Tensor,
    pub(super) meta: ScalingMeta,
}

/// Whether the cast-transpose kernel takes a `[rows, cols]` input to `to`
/// in one pass: FP8 targets, and on CUDA a shape its grid fits.
pub(crate) fn one_pass_t(to: QType, rows: usize, cols: usize, device: &Device) -> bool {
    to != QType::F16 && (!device.is_cuda() || crate::numerics::cuda::cast_t::fits(rows, cols))
}

/// A cast's source must be F32, F16 or BF16.
/// A given amax as the casts take it: one element, F32, shape `[1]`.
fn one_amax(op: &'static str, amax: Tensor) -> Result<Tensor> {
    if amax.elem_count() != 1 {
        return Err(Error::Shape {
            op,
            lhs: amax.shape().clone(),
            rhs: Shape::from(1usize),
        });
    }
    Ok(amax.to_dtype(DType::F32)?.reshape(1)?)
}

pub(crate) fn check_float(op: &'static str, x: &Tensor) -> Result<()> {
    match x.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => Ok(()),
        got => Err(Error::DType {
            op,
            expected: "F32, F16 or BF16",
            got,
        }),
    }
}

impl ScalingTensor {
    /// Wraps existing data; `data`'s dtype must be `meta.qtype()`'s storage
    /// dtype and both must live on one device.
    ///
    /// # Errors
    /// [`Error::DType`] or [`Error::Device`].
    pub fn from_parts(data: Tensor, meta: ScalingMeta) -> Result<Self> {
        const OP: &str = "ScalingTensor::from_parts";
        let expected = meta.qtype().storage_dtype();
        if data.dtype() != expected {
            let expected = if expected == DType::U8 { "U8" } else { "F16" };
            return Err(Error::DType {
                op: OP,
                expected,
                got: data.dtype(),
            });
        }
        if !data.device().same_device(meta.scale().device()) {
            return Err(Error::Device {
                op: OP,
                lhs: data.device().location(),
                rhs: meta.scale().device().location(),
            });
        }
        Ok(Self { data, meta })
    }

    /// Current scaling: the scale comes from `x`'s own amax by `recipe`'s rule
    /// and margin. Returns the tensor and `x`'s amax (1-element F32).
    ///
    /// A tensor without a finite non-zero amax (all zeros, or holding inf or
    /// NaN) keeps scale 1: not an error, as in both references.
    ///
    /// # Errors
    /// [`Error::DType`] unless `x` is F32, F16 or BF16.
    pub fn quantize(x: &Tensor, qtype: QType, recipe: &CurrentScaling) -> Result<(Self, Tensor)> {
        check_float("ScalingTensor::quantize", x)?;
        let [amax] =
            <[Tensor; 1]>::try_from(launch(&Amax, &[x])?).map_err(|_| arity(Amax::NAME))?;
        Self::quantize_from_amax(x, qtype, recipe, amax)
    }

    /// [`quantize`](Self::quantize) with `x`'s amax already taken (a
    /// 1-element F32 tensor, as [`fp8_gemm_amax`](crate::fp8_gemm_amax)
    /// returns with its output): one pass over `x`. An amax below `x`'s
    /// true one saturates elements (the metadata's counts show them).
    ///
    /// # Errors
    /// As [`quantize`](Self::quantize); [`Error::Shape`] for an amax that is
    /// not one element.
    pub fn quantize_from_amax(
        x: &Tensor,
        qtype: QType,
        recipe: &CurrentScaling,
        amax: Tensor,
    ) -> Result<(Self, Tensor)> {
        Self::quantize_from_amax_as(x, qtype, FromAmax::of(recipe), amax)
    }

    /// [`quantize_from_amax`](Self::quantize_from_amax) with the scale
    /// computed as `from` says (its `flag`: the scale_inv flagged by the
    /// amax, the metadata marked so).
    pub(crate) fn quantize_from_amax_as(
        x: &Tensor,
        qtype: QType,
        from: FromAmax,
        amax: Tensor,
    ) -> Result<(Self, Tensor)> {
        check_float("ScalingTensor::quantize", x)?;
        let amax = one_amax("ScalingTensor::quantize_from_amax", amax)?;
        let op = Quantize {
            qtype,
            from_amax: Some(from),
            counts: cast_counts(),
        };
        let (outs, counts) = counted(launch(&op, &[x, &amax])?, 1, op.counts, Quantize::NAME)?;
        let [data, scale, scale_inv] =
            <[Tensor; 3]>::try_from(outs).map_err(|_| arity(Quantize::NAME))?;
        Ok((
            Self::from_current(data, qtype, scale, scale_inv, &amax, counts, from.flag)?,
            amax,
        ))
    }

    /// Casts `x` with `meta`'s scale as it is (delayed scaling: one pass over
    /// `x`). Returns the tensor, whose metadata holds that scale, `x`'s amax
    /// and the cast's saturated and flushed counts, and `x`'s amax
    /// (1-element F32) for the caller to record in its history
    /// ([`ScalingMeta::record_cast`] records both).
    ///
    /// # Errors
    /// [`Error::DType`], [`Error::Device`], or [`Error::BadScale`] when the
    /// scale is not finite and positive.
    pub fn quantize_with(x: &Tensor, meta: &ScalingMeta) -> Result<(Self, Tensor)> {
        check_float("ScalingTensor::quantize_with", x)?;
        let qtype = meta.qtype();
        let op = Quantize {
            qtype,
            from_amax: None,
            counts: cast_counts(),
        };
        let (outs, counts) = counted(
            launch(&op, &[x, meta.scale()])?,
            2,
            op.counts,
            Quantize::NAME,
        )?;
        let [data, amax] = <[Tensor; 2]>::try_from(outs).map_err(|_| arity(Quantize::NAME))?;
        Self::from_cast(data, meta, amax, counts)
    }

    /// [`quantize`](Self::quantize) of a 2-D `x` that also returns the
    /// transpose: `(x, xᵀ, amax)`, one metadata for both (see
    /// [`quantize_with_t`](Self::quantize_with_t)).
    ///
    /// # Errors
    /// As [`quantize_with_t`](Self::quantize_with_t).
    pub fn quantize_t(
        x: &Tensor,
        qtype: QType,
        recipe: &CurrentScaling,
    ) -> Result<(Self, Self, Tensor)> {
        Self::quantize_t_as(x, qtype, FromAmax::of(recipe), None)
    }

    /// [`quantize_t`](Self::quantize_t) with the scale computed as `from`
    /// says, from `amax` where given (a 1-element F32 tensor, bit for bit
    /// the [`amax`](crate::amax) of `x`, as a pass that read `x` for another
    /// reason took it: the same tensors without the amax pass; an amax of
    /// another size is [`Error::Shape`]), else from a pass of its own.
    pub(crate) fn quantize_t_as(
        x: &Tensor,
        qtype: QType,
        from: FromAmax,
        amax: Option<Tensor>,
    ) -> Result<(Self, Self, Tensor)> {
        let amax = match amax {
            Some(a) => a,
            None => {
                check_float("ScalingTensor::quantize_t", x)?;
                let [a] =
                    <[Tensor; 1]>::try_from(launch(&Amax, &[x])?).map_err(|_| arity(Amax::NAME))?;
                a
            }
        };
        Self::quantize_t_from_amax_as(x, qtype, from, amax)
    }

    /// [`quantize_t_as`](Self::quantize_t_as) from a given amax.
    fn quantize_t_from_amax_as(
        x: &Tensor,
        qtype: QType,
        from: FromAmax,
        amax: Tensor,
    ) -> Result<(Self, Self, Tensor)> {
        check_float("ScalingTensor::quantize_t", x)?;
        let amax = one_amax("ScalingTensor::quantize_t_from_amax", amax)?;
        let (rows, cols) = x.dims2().map_err(|_| Error::Rank {
            op: "ScalingTensor::quantize_t",
            expected: 2,
            got: x.shape().clone(),
        })?;
        if !one_pass_t(qtype, rows, cols, x.device()) {
            let (q, amax) = Self::quantize_from_amax_as(x, qtype, from, amax)?;
            let qt = q.t()?;
            return Ok((q, qt, amax));
        }
        Self::cast_t_current(qtype, from, false, &[x, &amax], amax.clone())
    }

    /// The cast-transpose under current scaling: `op`'s outputs `[codes,
    /// codes_t, counts, scale, scale_inv]` of `inputs` (`[x, amax]`, and
    /// with `scaled` the FP16 source's scale_inv) as `(q, qᵀ, amax)`.
    pub(super) fn cast_t_current(
        qtype: QType,
        from: FromAmax,
        scaled: bool,
        inputs: &[&Tensor],
        amax: Tensor,
    ) -> Result<(Self, Self, Tensor)> {
        let op = QuantizeT {
            qtype,
            from_amax: Some(from),
            scaled,
            counts: cast_counts(),
        };
        let (outs, counts) = counted(launch(&op, inputs)?, 2, op.counts, QuantizeT::NAME)?;
        let [data, data_t, scale, scale_inv] =
            <[Tensor; 4]>::try_from(outs).map_err(|_| arity(QuantizeT::NAME))?;
        let q = Self::from_current(data, qtype, scale, scale_inv, &amax, counts, from.flag)?;
        let qt = q.with_data(data_t);
        Ok((q, qt, amax))
    }

    /// The cast-transpose with `meta`'s scale: `op`'s outputs `[codes,
    /// codes_t, amax, counts]` of `inputs` (`[x, scale]`, and with `scaled`
    /// the FP16 source's scale_inv) as `(q, qᵀ, amax)`.
    pub(super) fn cast_t_with(
        meta: &ScalingMeta,
        scaled: bool,
        inputs: &[&Tensor],
    ) -> Result<(Self, Self, Tensor)> {
        let op = QuantizeT {
            qtype: meta.qtype(),
            from_amax: None,
            scaled,
            counts: cast_counts(),
        };
        let (outs, counts) = counted(launch(&op, inputs)?, 3, op.counts, QuantizeT::NAME)?;
        let [data, data_t, amax] =
            <[Tensor; 3]>::try_from(outs).map_err(|_| arity(QuantizeT::NAME))?;
        let (q, amax) = Self::from_cast(data, meta, amax, counts)?;
        let qt = q.with_data(data_t);
        Ok((q, qt, amax))
    }

    /// Other codes (the transpose) with this tensor's metadata.
    pub(super) fn with_data(&self, data: Tensor) -> Self {
        Self {
            data,
            meta: self.meta.clone(),
        }
    }

    /// [`quantize_with`](Self::quantize_with) of a 2-D `x` that also returns
    /// the transposed codes: `(x, xᵀ, amax)`, bit for bit the cast and its
    /// [`t`](Self::t). The operands of a Linear's dgrad and wgrad GEMMs,
    /// which take their inputs K-major. For FP8 targets on CUDA one pass
    /// writes both (Transformer Engine's cast-transpose); the CPU, FP16
    /// targets and inputs of more than 4M rows cast, then transpose.
    ///
    /// # Errors
    /// As [`quantize_with`](Self::quantize_with); [`Error::Rank`] unless 2-D.
    pub fn quantize_with_t(x: &Tensor, meta: &ScalingMeta) -> Result<(Self, Self, Tensor)> {
        check_float("ScalingTensor::quantize_with_t", x)?;
        let (rows, cols) = x.dims2().map_err(|_| Error::Rank {
            op: "ScalingTensor::quantize_with_t",
            expected: 2,
            got: x.shape().clone(),
        })?;
        if !one_pass_t(meta.qtype(), rows, cols, x.device()) {
            let (q, amax) = Self::quantize_with(x, meta)?;
            let qt = q.t()?;
            return Ok((q, qt, amax));
        }
        Self::cast_t_with(meta, false, &[x, meta.scale()])
    }

    /// A current-scaling cast's outputs as a scaling tensor: the codes, the
    /// scale the kernel computed from the amax, the amax and the counts.
    pub(super) fn from_current(
        data: Tensor,
        qtype: QType,
        scale: Tensor,
        scale_inv: Tensor,
        amax: &Tensor,
        counts: Option<Tensor>,
        flagged: bool,
    ) -> Result<Self> {
        let meta =
            ScalingMeta::from_parts(qtype, scale, scale_inv, amax.clone())?.with_last_cast(counts);
        let meta = if flagged { meta.with_flag() } else { meta };
        Ok(Self { data, meta })
    }

    /// A cast's outputs as a scaling tensor: the codes, the scale they were
    /// made with (from `meta`), the input's amax and the cast's counts.
    pub(super) fn from_cast(
        data: Tensor,
        meta: &ScalingMeta,
        amax: Tensor,
        counts: Option<Tensor>,
    ) -> Result<(Self, Tensor)> {
        let meta = ScalingMeta::from_parts(
            meta.qtype(),
            meta.scale().clone(),
            meta.scale_inv().clone(),
            amax.clone(),
        )?
        .with_last_cast(counts);
        Ok((Self { data, meta }, amax))
    }

    /// The value, `decode(data) * scale_inv`, as `dtype` (F32, F16, BF16, F64).
    ///
    /// # Errors
    /// [`Error::DType`] for another dtype.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let op = Dequantize {
            qtype: self.qtype(),
            dtype,
        };
        let [out] = <[Tensor; 1]>::try_from(launch(&op, &[&self.data, self.meta.scale_inv()])?)
            .map_err(|_| arity(Dequantize::NAME))?;
        Ok(out)
    }

    /// [`dequantize`](Self::dequantize) into any float `dtype`: straight
    /// for F32, BF16 and F16 (the product `decode(code) * scale_inv`
    /// rounded once), through F32 for the others; the same values either
    /// way.
    ///
    /// # Errors
    /// Only candle's.
    pub fn decoded(&self, dtype: DType) -> Result<Tensor> {
        match dtype {
            DType::F32 | DType::BF16 | DType::F16 => self.dequantize(dtype),
            _ => Ok(self.dequantize(DType::F32)?.to_dtype(dtype)?),
        }
    }

    /// The transpose of a 2-D tensor (data copied contiguous, same scale):
    /// the GEMM operands of dgrad and wgrad.
    ///
    /// # Errors
    /// [`Error::Rank`] unless 2-D.
    pub fn t(&self) -> Result<Self> {
        if self.data.rank() != 2 {
            return Err(Error::Rank {
                op: "ScalingTensor::t",
                expected: 2,
                got: self.shape().clone(),
            });
        }
        Ok(Self {
            data: crate::numerics::transpose::transpose_2d(&self.data)?,
            meta: self.meta.clone(),
        })
    }

    /// The raw data: FP8 codes (`U8`) or FP16 values.
    pub fn data(&self) -> &Tensor {
        &self.data
    }

    /// The scaling metadata.
    pub fn meta(&self) -> &ScalingMeta {
        &self.meta
    }

    /// The storage type.
    pub fn qtype(&self) -> QType {
        self.meta.qtype()
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        self.data.shape()
    }

    /// The device.
    pub fn device(&self) -> &Device {
        self.data.device()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.data.elem_count()
    }

    /// Bytes held: data plus metadata.
    pub fn nbytes(&self) -> usize {
        self.data.elem_count() * self.data.dtype().size_in_bytes() + self.meta.nbytes()
    }

    /// `scale_inv` read to the host: for tests and reports, never in a
    /// training step.
    ///
    /// # Errors
    /// Only candle's.
    pub fn scale_inv(&self) -> Result<f32> {
        let v = self.meta.scale_inv().flatten_all()?.to_vec1::<f32>()?;
        v.first().copied().ok_or(Error::Unsupported {
            op: "ScalingTensor::scale_inv",
            what: "empty scale".into(),
        })
    }
}

/// `outs` without the counts output at `at` where the op made one
/// (`made`: it counted, numerics/counts.rs), and that output.
pub(super) fn counted(
    mut outs: Vec<Tensor>,
    at: usize,
    made: bool,
    op: &'static str,
) -> Result<(Vec<Tensor>, Option<Tensor>)> {
    if !made {
        return Ok((outs, None));
    }
    if at >= outs.len() {
        return Err(arity(op));
    }
    let counts = outs.remove(at);
    Ok((outs, Some(counts)))
}
