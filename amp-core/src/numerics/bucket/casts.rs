//! A bucket's casts, one launch for all its tensors: the decoded amaxes,
//! the scales from them, the requantize, the quantize and the flagging of
//! each tensor's `scale_inv`.

use super::*;
use crate::error::{Error, Result};
use crate::numerics::cast::quantize_slice;
use crate::numerics::kernel::{arity, launch, scalar, slice, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::requantize::{DecodedAmax, Requantize};
use crate::numerics::scale::ScaleRule;
use candle_core::{CpuStorage, CudaStorage, Layout, Shape, Tensor};

/// codes_0..T-1, scale_inv_0..T-1 -> amax [T], NaN as inf.
pub(crate) struct BucketAmax {
    pub qtype: QType,
}

impl Kernel for BucketAmax {
    const NAME: &'static str = "bucket_amax";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let t = inputs.len() / 2;
        if t == 0 || inputs.len() != 2 * t {
            return Err(arity(Self::NAME));
        }
        let op = DecodedAmax { qtype: self.qtype };
        let mut out = Vec::with_capacity(t);
        for i in 0..t {
            let a = op.cpu(&[inputs[i], inputs[t + i]])?;
            let (CpuStorage::F32(v), _) = &a[0] else {
                return Err(arity(Self::NAME));
            };
            out.push(if v[0].is_nan() { f32::INFINITY } else { v[0] });
        }
        Ok(vec![(CpuStorage::F32(out), Shape::from(t))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_amax(self.qtype, inputs)
    }
}

/// amax [T] -> scale [T], scale_inv [T].
pub(crate) struct BucketScales {
    pub qtype: QType,
    pub rule: ScaleRule,
    pub margin: u32,
}

impl Kernel for BucketScales {
    const NAME: &'static str = "bucket_scales";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(a, la)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let amax = slice::<f32>(Self::NAME, a, la)?;
        let scale: Vec<f32> = amax
            .iter()
            .map(|&a| self.rule.compute(a, 1.0, self.qtype.max(), self.margin))
            .collect();
        let inv = scale.iter().map(|s| 1.0 / s).collect();
        let shape = la.shape().clone();
        Ok(vec![
            (CpuStorage::F32(scale), shape.clone()),
            (CpuStorage::F32(inv), shape),
        ])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_scales(self.qtype, self.rule, self.margin, inputs)
    }
}

/// codes_0..T-1 (of `from`), scale_inv_0..T-1, scale [T] -> codes of
/// `to` of the pieces (`start` within the piece's tensor), concatenated.
/// `from` and `to` the same FP8 format, or FP16 to E4M3.
pub(crate) struct BucketRequantize {
    pub from: QType,
    pub to: QType,
    pub pieces: Vec<Piece>,
    /// Zeros after the codes up to this length, if it is longer.
    pub pad_to: usize,
}

impl Kernel for BucketRequantize {
    const NAME: &'static str = "bucket_requantize";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        fp8(Self::NAME, self.to)?;
        let Some(((s, ls), rest)) = inputs.split_last() else {
            return Err(arity(Self::NAME));
        };
        let t = rest.len() / 2;
        if t == 0 || rest.len() != 2 * t {
            return Err(arity(Self::NAME));
        }
        let scale = slice::<f32>(Self::NAME, s, ls)?;
        let op = Requantize {
            from: self.from,
            to: self.to,
            counts: false,
        };
        let mut out = Vec::new();
        for p in &self.pieces {
            let (c, l) = rest.get(p.tensor).ok_or_else(|| arity(Self::NAME))?;
            let part = codes_range(c, l, p.start, p.len)?;
            let sc = f32_one(*scale.get(p.tensor).ok_or_else(|| arity(Self::NAME))?);
            let r = op.cpu(&[(&part.0, &part.1), rest[t + p.tensor], (&sc.0, &sc.1)])?;
            let (CpuStorage::U8(c), _) = &r[0] else {
                return Err(arity(Self::NAME));
            };
            out.extend_from_slice(c);
        }
        if out.len() < self.pad_to {
            out.resize(self.pad_to, 0);
        }
        let n = out.len();
        Ok(vec![(CpuStorage::U8(out), Shape::from(n))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_requantize(
            self.from,
            self.to,
            &self.pieces,
            self.pad_to,
            inputs,
        )
    }
}

/// values (F32), scale [T] -> codes [sum of piece lengths].
pub(crate) struct BucketQuantize {
    pub qtype: QType,
    pub pieces: Vec<Piece>,
}

impl Kernel for BucketQuantize {
    const NAME: &'static str = "bucket_quantize";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        fp8(Self::NAME, self.qtype)?;
        let [(x, lx), (s, ls)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let x = slice::<f32>(Self::NAME, x, lx)?;
        let scale = slice::<f32>(Self::NAME, s, ls)?;
        let mut out = Vec::new();
        for p in &self.pieces {
            let xs = x
                .get(p.start..p.start + p.len)
                .ok_or_else(|| arity(Self::NAME))?;
            let sc = *scale.get(p.tensor).ok_or_else(|| arity(Self::NAME))?;
            let (CpuStorage::U8(c), _, _) = quantize_slice(self.qtype, xs, sc) else {
                return Err(arity(Self::NAME));
            };
            out.extend_from_slice(&c);
        }
        let n = out.len();
        Ok(vec![(CpuStorage::U8(out), Shape::from(n))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_quantize(self.qtype, &self.pieces, inputs)
    }
}

/// The amax of each tensor's value, `max |decode(codes) * scale_inv|` with
/// NaN counted as inf, as one F32 vector, in one launch: bit for bit each
/// `ScalingTensor::decoded_amax` with NaN mapped to inf. `codes[t]` (codes
/// of `qtype`: `U8` for FP8, `F16` for FP16) with its 1-element
/// `scale_invs[t]`.
///
/// # Errors
/// [`Error::Unsupported`] for no tensor or lists of different lengths;
/// [`Error::DType`] for codes of another dtype.
pub fn bucket_amax(codes: &[&Tensor], scale_invs: &[&Tensor], qtype: QType) -> Result<Tensor> {
    check_lists(BucketAmax::NAME, codes, scale_invs)?;
    let mut inputs: Vec<&Tensor> = codes.to_vec();
    inputs.extend_from_slice(scale_invs);
    let [a] = <[Tensor; 1]>::try_from(launch(&BucketAmax { qtype }, &inputs)?)
        .map_err(|_| arity(BucketAmax::NAME))?;
    Ok(a)
}

/// Current scaling's scale and scale_inv for each amax of `amax` (a
/// vector), in one launch: element `t` bit for bit those of
/// [`ScalingMeta::for_current_amax`](crate::ScalingMeta::for_current_amax)
/// of amax `t`.
///
/// # Errors
/// Only candle's.
pub fn bucket_scales(
    amax: &Tensor,
    qtype: QType,
    rule: ScaleRule,
    margin: u32,
) -> Result<(Tensor, Tensor)> {
    let [s, si] = <[Tensor; 2]>::try_from(launch(
        &BucketScales {
            qtype,
            rule,
            margin,
        },
        &[amax],
    )?)
    .map_err(|_| arity(BucketScales::NAME))?;
    Ok((s, si))
}

/// Every tensor's value (`codes[t]` of `qtype` with `scale_invs[t]`, as in
/// [`bucket_amax`]) re-cast with element `t` of `scale` to `to` (`None`:
/// the same format; FP16 codes go to E4M3 only), in one launch: the codes
/// of `pieces` (each a range of its tensor, `start` within it)
/// concatenated, or with `None` of every tensor whole, in order; bit for
/// bit each `ScalingTensor::requantize_with`; with `pad_to`, zeros after
/// the codes up to that length (for a collective's even chunks).
///
/// # Errors
/// As [`bucket_amax`]; a piece outside its tensor; another pair of formats.
pub fn bucket_requantize(
    codes: &[&Tensor],
    scale_invs: &[&Tensor],
    qtype: QType,
    scale: &Tensor,
    pieces: Option<&[Piece]>,
    to: Option<QType>,
    pad_to: Option<usize>,
) -> Result<Tensor> {
    const OP: &str = BucketRequantize::NAME;
    check_lists(OP, codes, scale_invs)?;
    if !matches!((qtype, to), (_, None) | (QType::F16, Some(QType::E4M3))) && to != Some(qtype) {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("{qtype} to {to:?}"),
        });
    }
    let pieces = match pieces {
        Some(p) => p.to_vec(),
        None => codes
            .iter()
            .enumerate()
            .map(|(t, c)| Piece {
                tensor: t,
                start: 0,
                len: c.elem_count(),
            })
            .collect(),
    };
    if pieces.iter().any(|p| {
        codes
            .get(p.tensor)
            .is_none_or(|c| p.start + p.len > c.elem_count())
    }) {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("pieces {pieces:?} outside their tensors"),
        });
    }
    let mut inputs: Vec<&Tensor> = codes.to_vec();
    inputs.extend_from_slice(scale_invs);
    inputs.push(scale);
    let op = BucketRequantize {
        from: qtype,
        to: to.unwrap_or(qtype),
        pieces,
        pad_to: pad_to.unwrap_or(0),
    };
    let [c] = <[Tensor; 1]>::try_from(launch(&op, &inputs)?).map_err(|_| arity(OP))?;
    Ok(c)
}

/// Each piece of `values` (F32, flat) cast with element `piece.tensor` of
/// `scale` to `qtype`, the codes concatenated, in one launch: bit for bit
/// each [`ScalingTensor::quantize_with`](crate::ScalingTensor::quantize_with).
///
/// # Errors
/// [`Error::Unsupported`] for FP16 or a piece outside `values`.
pub fn bucket_quantize(
    values: &Tensor,
    scale: &Tensor,
    qtype: QType,
    pieces: &[Piece],
) -> Result<Tensor> {
    const OP: &str = BucketQuantize::NAME;
    fp8(OP, qtype)?;
    if pieces
        .iter()
        .any(|p| p.start + p.len > values.elem_count() || p.tensor >= scale.elem_count())
    {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("pieces {pieces:?} of {} values", values.elem_count()),
        });
    }
    let op = BucketQuantize {
        qtype,
        pieces: pieces.to_vec(),
    };
    let [c] = <[Tensor; 1]>::try_from(launch(&op, &[values, scale])?).map_err(|_| arity(OP))?;
    Ok(c)
}

/// scale_inv_0..T-1, amax_0..T-1 (one element each) -> [T].
pub(crate) struct BucketFlagScaleInv;

impl Kernel for BucketFlagScaleInv {
    const NAME: &'static str = "bucket_flag_scale_inv";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let t = inputs.len() / 2;
        if t == 0 || inputs.len() != 2 * t {
            return Err(arity(Self::NAME));
        }
        let out = (0..t)
            .map(|i| {
                let (s, ls) = inputs[i];
                let (a, la) = inputs[t + i];
                Ok(scalar(Self::NAME, s, ls)? * (scalar(Self::NAME, a, la)? * 0.0 + 1.0))
            })
            .collect::<Result<Vec<f32>>>()?;
        Ok(vec![(CpuStorage::F32(out), Shape::from(t))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_flag_scale_inv(inputs)
    }
}

/// Each tensor's `scale_invs[t]` where its `amaxes[t]` is finite and NaN
/// where it is not (`scale_inv * (amax * 0 + 1)` in f32), as one `[T]`
/// vector, in one launch (that follows a
/// [`SideStream`](crate::SideStream)): the scales a rank sends with its
/// own codes, a non-finite source carried by its scale to every rank that
/// decodes them.
///
/// # Errors
/// [`Error::Unsupported`] for no tensor or lists of different lengths;
/// candle's for a scale or amax that is not one F32.
pub fn bucket_flag_scale_inv(scale_invs: &[&Tensor], amaxes: &[&Tensor]) -> Result<Tensor> {
    check_lists(BucketFlagScaleInv::NAME, scale_invs, amaxes)?;
    let mut inputs: Vec<&Tensor> = scale_invs.to_vec();
    inputs.extend_from_slice(amaxes);
    let [c] = <[Tensor; 1]>::try_from(launch(&BucketFlagScaleInv, &inputs)?)
        .map_err(|_| arity(BucketFlagScaleInv::NAME))?;
    Ok(c)
}
