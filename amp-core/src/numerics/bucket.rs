//! The per-tensor steps of a bucketed FP8 reduction, a whole bucket in one
//! launch each instead of one launch per tensor (issue 21: with one launch
//! per tensor, a 350M GPT's 96 weight gradients cost a few thousand small
//! kernels a step). Each is bit for bit its one-tensor op, and its CPU
//! body is made of those ops:
//! [`bucket_amax`] (`ScalingTensor::decoded_amax`, NaN counted as inf),
//! [`bucket_scales`] (`ScalingMeta::for_current_amax`),
//! [`bucket_requantize`] (`ScalingTensor::requantize_with`, concatenated),
//! [`bucket_decode_sum`] ([`decode_sum`](crate::decode_sum) of each piece,
//! concatenated, with each tensor's amax), [`bucket_quantize`]
//! (`ScalingTensor::quantize_with` of each piece, concatenated), and the
//! pair that does the last two without the F32 sums in memory:
//! [`bucket_decode_amax`] (the amaxes alone) and
//! [`bucket_decode_sum_quantize`] (the codes of the sums).

use crate::error::{Error, Result};
use crate::numerics::cast::quantize_slice;
use crate::numerics::decode_sum::DecodeSum;
use crate::numerics::kernel::{arity, launch, scalar, slice, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::requantize::{DecodedAmax, Requantize};
use crate::numerics::scale::ScaleRule;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape, Tensor};

/// One piece of a bucket: the tensor it belongs to, where it starts in the
/// input it is read from, and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index of its tensor (for the per-tensor scale vectors).
    pub tensor: usize,
    /// First element in the input.
    pub start: usize,
    /// Elements.
    pub len: usize,
}

fn f32_one(v: f32) -> (CpuStorage, Layout) {
    (CpuStorage::F32(vec![v]), Layout::contiguous(1))
}

fn u8s(v: &[u8]) -> (CpuStorage, Layout) {
    (CpuStorage::U8(v.to_vec()), Layout::contiguous(v.len()))
}

/// Elements `start..start + len` of a code storage (U8 or F16), as a
/// storage of their own.
fn codes_range(
    c: &CpuStorage,
    l: &Layout,
    start: usize,
    len: usize,
) -> Result<(CpuStorage, Layout)> {
    const OP: &str = "bucket codes";
    let out = match c {
        CpuStorage::U8(_) => CpuStorage::U8(
            slice::<u8>(OP, c, l)?
                .get(start..start + len)
                .ok_or_else(|| arity(OP))?
                .to_vec(),
        ),
        CpuStorage::F16(_) => CpuStorage::F16(
            slice::<half::f16>(OP, c, l)?
                .get(start..start + len)
                .ok_or_else(|| arity(OP))?
                .to_vec(),
        ),
        other => {
            return Err(Error::DType {
                op: OP,
                expected: "U8 or F16",
                got: other.dtype(),
            })
        }
    };
    Ok((out, Layout::contiguous(len)))
}

fn fp8(op: &'static str, qtype: QType) -> Result<()> {
    match qtype.fp8() {
        Some(_) => Ok(()),
        None => Err(Error::Unsupported {
            op,
            what: "FP16 codes".into(),
        }),
    }
}

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

/// Of a bucket decode's `scale_inv` for `ranks` chunks: the number of
/// tensors, and whether each rank has its own scales (`[N, T]`: rank `k`'s
/// codes of tensor `t` decoded with element `[k, t]`) or all share them
/// (`[T]`).
fn scale_layout(shape: &Shape, ranks: usize) -> Result<(usize, bool)> {
    match shape.dims() {
        [t] => Ok((*t, false)),
        [n, t] if *n == ranks => Ok((*t, true)),
        _ => Err(Error::Unsupported {
            op: BucketDecodeSum::NAME,
            what: format!("scales of shape {shape:?} for {ranks} chunks"),
        }),
    }
}

/// What a bucket decode-and-sum launch makes of the sums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SumOut {
    /// The sums (F32, the pieces concatenated) and each tensor's amax.
    Sums,
    /// Each tensor's amax only: the sums are not stored.
    Amax,
    /// The sums quantized with each piece's tensor's scale (one more input,
    /// `scale [T]`), the codes concatenated: no F32 sums in memory.
    Codes,
}

/// chunk_0..N-1 (U8), scale_inv [T] or [N, T] (and scale [T] for [`SumOut::Codes`])
/// -> by `out`: sums [sum of piece lengths] and amax [T] (0 for a tensor
/// without a piece, NaN as inf); amax [T]; codes [sum of piece lengths].
pub(crate) struct BucketDecodeSum {
    pub qtype: QType,
    pub average: bool,
    pub pieces: Vec<Piece>,
    pub out: SumOut,
}

impl Kernel for BucketDecodeSum {
    const NAME: &'static str = "bucket_decode_sum";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        fp8(Self::NAME, self.qtype)?;
        let (inputs, scale) = match self.out {
            SumOut::Codes => {
                let Some(((q, lq), rest)) = inputs.split_last() else {
                    return Err(arity(Self::NAME));
                };
                (rest, Some(slice::<f32>(Self::NAME, q, lq)?))
            }
            SumOut::Sums | SumOut::Amax => (inputs, None),
        };
        let Some(((s, ls), chunks)) = inputs.split_last() else {
            return Err(arity(Self::NAME));
        };
        let scale_inv = slice::<f32>(Self::NAME, s, ls)?;
        let (tensors, per_rank) = scale_layout(ls.shape(), chunks.len())?;
        let codes = chunks
            .iter()
            .map(|(c, l)| slice::<u8>(Self::NAME, c, l))
            .collect::<Result<Vec<_>>>()?;
        let op = DecodeSum {
            qtype: self.qtype,
            average: self.average,
        };
        let mut sums = Vec::new();
        let mut coded = Vec::new();
        let mut amax = vec![0f32; tensors];
        for p in &self.pieces {
            let parts: Vec<(CpuStorage, Layout)> = codes
                .iter()
                .map(|c| {
                    c.get(p.start..p.start + p.len)
                        .map(u8s)
                        .ok_or_else(|| arity(Self::NAME))
                })
                .collect::<Result<_>>()?;
            // tensor t's scale for every rank, or each rank's own
            let si: Vec<f32> = if per_rank {
                (0..chunks.len())
                    .map(|k| scale_inv.get(k * tensors + p.tensor).copied())
                    .collect::<Option<_>>()
                    .ok_or_else(|| arity(Self::NAME))?
            } else {
                vec![*scale_inv.get(p.tensor).ok_or_else(|| arity(Self::NAME))?]
            };
            let si = (CpuStorage::F32(si.clone()), Layout::contiguous(si.len()));
            let mut args: Vec<(&CpuStorage, &Layout)> = parts.iter().map(|(c, l)| (c, l)).collect();
            args.push((&si.0, &si.1));
            let r = op.cpu(&args)?;
            let [(CpuStorage::F32(v), _), (a, la)] = r.as_slice() else {
                return Err(arity(Self::NAME));
            };
            let a = scalar(Self::NAME, a, &Layout::contiguous(la.clone()))?;
            amax[p.tensor] = if a.is_nan() { f32::INFINITY } else { a };
            match scale {
                // the codes `bucket_quantize` makes of the stored sums
                Some(scale) => {
                    let sc = *scale.get(p.tensor).ok_or_else(|| arity(Self::NAME))?;
                    let (CpuStorage::U8(c), _, _) = quantize_slice(self.qtype, v, sc) else {
                        return Err(arity(Self::NAME));
                    };
                    coded.extend_from_slice(&c);
                }
                None => sums.extend_from_slice(v),
            }
        }
        let (n, t) = (sums.len(), amax.len());
        Ok(match self.out {
            SumOut::Sums => vec![
                (CpuStorage::F32(sums), Shape::from(n)),
                (CpuStorage::F32(amax), Shape::from(t)),
            ],
            SumOut::Amax => vec![(CpuStorage::F32(amax), Shape::from(t))],
            SumOut::Codes => {
                let n = coded.len();
                vec![(CpuStorage::U8(coded), Shape::from(n))]
            }
        })
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        let chunks = inputs
            .len()
            .saturating_sub(1 + usize::from(self.out == SumOut::Codes));
        crate::numerics::cuda::bucket_decode_sum(
            self.qtype,
            self.average,
            DecodeSum::inv_n(chunks),
            &self.pieces,
            self.out,
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

fn check_lists(op: &'static str, codes: &[&Tensor], scale_invs: &[&Tensor]) -> Result<()> {
    if codes.is_empty() || codes.len() != scale_invs.len() {
        return Err(Error::Unsupported {
            op,
            what: format!(
                "{} code tensors with {} scales",
                codes.len(),
                scale_invs.len()
            ),
        });
    }
    Ok(())
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

/// For each piece, the rank-order sum of `chunks`' codes (one flat `U8`
/// tensor a rank, the piece at `start` in each) decoded with element
/// `piece.tensor` of `scale_inv` (`[T]`, every rank alike) or rank `k`'s
/// with element `[k, piece.tensor]` (`[N, T]`, each rank's own scales),
/// divided by the number of chunks when `average`; the sums concatenated
/// (F32), and each tensor's amax of its piece (a vector of `T`; 0 for a
/// tensor without a piece, NaN counted as inf), in one launch: bit for bit
/// [`decode_sum`](crate::decode_sum) of each piece with those scales.
///
/// # Errors
/// [`Error::Unsupported`] for FP16, no chunk or more than 64, a piece
/// outside the chunks or naming no tensor.
pub fn bucket_decode_sum(
    chunks: &[Tensor],
    scale_inv: &Tensor,
    qtype: QType,
    average: bool,
    pieces: &[Piece],
) -> Result<(Tensor, Tensor)> {
    let [s, a] = <[Tensor; 2]>::try_from(decode_launch(
        chunks,
        scale_inv,
        qtype,
        average,
        pieces,
        SumOut::Sums,
        None,
    )?)
    .map_err(|_| arity(BucketDecodeSum::NAME))?;
    Ok((s, a))
}

/// The amaxes of [`bucket_decode_sum`] alone, without storing the sums:
/// a vector of `T`, bit for bit its second output, reading
/// the codes once and writing nothing else. With
/// [`bucket_decode_sum_quantize`] after it, the two passes make what
/// `bucket_decode_sum` and [`bucket_quantize`] make, without the F32 sums
/// in memory (4 bytes an element written and read again).
///
/// # Errors
/// As [`bucket_decode_sum`].
pub fn bucket_decode_amax(
    chunks: &[Tensor],
    scale_inv: &Tensor,
    qtype: QType,
    average: bool,
    pieces: &[Piece],
) -> Result<Tensor> {
    let [a] = <[Tensor; 1]>::try_from(decode_launch(
        chunks,
        scale_inv,
        qtype,
        average,
        pieces,
        SumOut::Amax,
        None,
    )?)
    .map_err(|_| arity(BucketDecodeSum::NAME))?;
    Ok(a)
}

/// The sums of [`bucket_decode_sum`] quantized with element `piece.tensor`
/// of `scale` to `qtype`, the codes concatenated, in one launch that never
/// stores the sums: bit for bit [`bucket_quantize`] of `bucket_decode_sum`'s
/// sums (pieces renumbered to where each starts in the sums), since each
/// code is made from the same F32 value.
///
/// # Errors
/// As [`bucket_decode_sum`], and for a `scale` without a piece's tensor.
pub fn bucket_decode_sum_quantize(
    chunks: &[Tensor],
    scale_inv: &Tensor,
    qtype: QType,
    average: bool,
    pieces: &[Piece],
    scale: &Tensor,
) -> Result<Tensor> {
    if let Some(p) = pieces.iter().find(|p| p.tensor >= scale.elem_count()) {
        return Err(Error::Unsupported {
            op: BucketDecodeSum::NAME,
            what: format!(
                "{} scales for a piece of tensor {}",
                scale.elem_count(),
                p.tensor
            ),
        });
    }
    let [c] = <[Tensor; 1]>::try_from(decode_launch(
        chunks,
        scale_inv,
        qtype,
        average,
        pieces,
        SumOut::Codes,
        Some(scale),
    )?)
    .map_err(|_| arity(BucketDecodeSum::NAME))?;
    Ok(c)
}

/// The checks and the launch of the three bucket decode-and-sum entries
/// (`scale` with [`SumOut::Codes`] only).
fn decode_launch(
    chunks: &[Tensor],
    scale_inv: &Tensor,
    qtype: QType,
    average: bool,
    pieces: &[Piece],
    out: SumOut,
    scale: Option<&Tensor>,
) -> Result<Vec<Tensor>> {
    const OP: &str = BucketDecodeSum::NAME;
    fp8(OP, qtype)?;
    let len = chunks.first().map_or(0, Tensor::elem_count);
    let tensors = scale_layout(scale_inv.shape(), chunks.len())?.0;
    if chunks.is_empty()
        || chunks.len() > crate::numerics::decode_sum::MAX_RANKS
        || chunks.iter().any(|c| c.elem_count() != len)
        || pieces
            .iter()
            .any(|p| p.start + p.len > len || p.tensor >= tensors)
    {
        return Err(Error::Unsupported {
            op: OP,
            what: format!(
                "{} chunks of {len} codes, {tensors} tensors and pieces {pieces:?}",
                chunks.len()
            ),
        });
    }
    let mut inputs: Vec<&Tensor> = chunks.iter().collect();
    inputs.push(scale_inv);
    inputs.extend(scale);
    let op = BucketDecodeSum {
        qtype,
        average,
        pieces: pieces.to_vec(),
        out,
    };
    launch(&op, &inputs)
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

/// The bytes of `pieces` of `src` (flat `U8`; `start` within it)
/// concatenated, in one launch: ZeRO's gathered slices back into tensor
/// order. A piece's `tensor` is not read.
///
/// # Errors
/// [`Error::Unsupported`] for a piece outside `src`.
pub fn bucket_copy(src: &Tensor, pieces: &[Piece]) -> Result<Tensor> {
    // one source: every piece reads it, whatever its tensor
    let pieces: Vec<Piece> = pieces.iter().map(|p| Piece { tensor: 0, ..*p }).collect();
    bucket_copy_from(&[src], &pieces)
}

/// srcs (U8, flat) -> the pieces' bytes, each from source `tensor`
/// (`start` within it), concatenated.
pub(crate) struct BucketCopyFrom {
    pub pieces: Vec<Piece>,
}

impl Kernel for BucketCopyFrom {
    const NAME: &'static str = "bucket_copy_from";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let srcs = inputs
            .iter()
            .map(|(c, l)| slice::<u8>(Self::NAME, c, l))
            .collect::<Result<Vec<_>>>()?;
        let mut out = Vec::new();
        for p in &self.pieces {
            let src = srcs.get(p.tensor).ok_or_else(|| arity(Self::NAME))?;
            out.extend_from_slice(
                src.get(p.start..p.start + p.len)
                    .ok_or_else(|| arity(Self::NAME))?,
            );
        }
        let n = out.len();
        Ok(vec![(CpuStorage::U8(out), Shape::from(n))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_copy_from(&self.pieces, inputs)
    }
}

/// The bytes of `pieces` concatenated, piece `p` read from
/// `srcs[p.tensor]` (flat `U8`; `start` within it), in one launch: a
/// bucket's codes cut into the ranks' chunks straight from the layers'
/// gradients (ZeRO's reduce-scatter).
///
/// # Errors
/// [`Error::Unsupported`] for no source, or a piece naming no source or
/// outside its source.
pub fn bucket_copy_from(srcs: &[&Tensor], pieces: &[Piece]) -> Result<Tensor> {
    const OP: &str = BucketCopyFrom::NAME;
    let bad = |p: &Piece| {
        srcs.get(p.tensor)
            .is_none_or(|s| p.start + p.len > s.elem_count())
    };
    if srcs.is_empty() || pieces.iter().any(bad) {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("pieces {pieces:?} of {} sources", srcs.len()),
        });
    }
    let op = BucketCopyFrom {
        pieces: pieces.to_vec(),
    };
    let [c] = <[Tensor; 1]>::try_from(launch(&op, srcs)?).map_err(|_| arity(OP))?;
    Ok(c)
}

/// Columns `start..start + count` of the one input `m` (`[N, C]` F32),
/// each folded over the rows in row order from 0 by `f` (NaN passed as
/// inf): the CPU bodies of the column kernels.
fn fold_columns(
    name: &'static str,
    inputs: &[(&CpuStorage, &Layout)],
    start: usize,
    count: usize,
    f: impl Fn(f32, f32) -> f32,
) -> Result<Vec<f32>> {
    let [(m, lm)] = inputs else {
        return Err(arity(name));
    };
    let [rows, cols] = lm.shape().dims() else {
        return Err(arity(name));
    };
    let v = slice::<f32>(name, m, lm)?;
    Ok((start..start + count)
        .map(|c| {
            (0..*rows).fold(0f32, |acc, r| {
                let x = v[r * cols + c];
                f(acc, if x.is_nan() { f32::INFINITY } else { x })
            })
        })
        .collect())
}

/// m [N, C] (F32) -> [count]: the largest of column `start + c` over the
/// rows, NaN counted as inf.
pub(crate) struct BucketColumnMax {
    pub start: usize,
    pub count: usize,
}

impl Kernel for BucketColumnMax {
    const NAME: &'static str = "bucket_column_max";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let out = fold_columns(Self::NAME, inputs, self.start, self.count, |acc, x| {
            if x > acc {
                x
            } else {
                acc
            }
        })?;
        Ok(vec![(CpuStorage::F32(out), Shape::from(self.count))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_column_max(self.start, self.count, inputs)
    }
}

/// The largest of columns `start..start + count` of `m` (`[N, C]` F32,
/// values at least 0: amaxes, every rank's in a row) over the rows, NaN
/// counted as inf, as one `[count]` vector in one launch (that follows a
/// [`SideStream`](crate::SideStream)): the agreed amaxes of gathered
/// ones.
///
/// # Errors
/// [`Error::Unsupported`] unless `m` is 2-D with the columns.
pub fn bucket_column_max(m: &Tensor, start: usize, count: usize) -> Result<Tensor> {
    const OP: &str = BucketColumnMax::NAME;
    match m.dims() {
        [_, c] if start + count <= *c && count > 0 => {}
        _ => {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("columns {start}..{} of {:?}", start + count, m.shape()),
            })
        }
    }
    let op = BucketColumnMax { start, count };
    let [c] = <[Tensor; 1]>::try_from(launch(&op, &[m])?).map_err(|_| arity(OP))?;
    Ok(c)
}

/// scale_inv_0..T-1, scale_0..T-1, amax_0..T-1 -> [2T].
pub(crate) struct BucketScalesSent {
    pub qtype: QType,
}

impl Kernel for BucketScalesSent {
    const NAME: &'static str = "bucket_scales_sent";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let t = inputs.len() / 3;
        if t == 0 || inputs.len() != 3 * t {
            return Err(arity(Self::NAME));
        }
        let one = |k: usize| -> Result<f32> {
            let (s, l) = inputs[k];
            scalar(Self::NAME, s, l)
        };
        let mut out = vec![0f32; 2 * t];
        for i in 0..t {
            let (s, sc, m) = (one(i)?, one(t + i)?, one(2 * t + i)?);
            let flag = m * 0.0 + 1.0;
            out[i] = s * flag;
            // the code quantize casts the amax to, decoded
            let d = match (quantize_slice(self.qtype, &[m], sc).0, self.qtype.fp8()) {
                (CpuStorage::U8(c), Some(format)) => {
                    let mut d = [0f32];
                    format.decode_scaled_slice(&c, s, &mut d)?;
                    d[0]
                }
                (CpuStorage::F16(c), None) => c[0].to_f32() * s,
                _ => return Err(arity(Self::NAME)),
            };
            out[t + i] = d * flag;
        }
        Ok(vec![(CpuStorage::F32(out), Shape::from(2 * t))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_scales_sent(self.qtype, inputs)
    }
}

/// What a rank sends with its FP8 codes of `T` tensors, as one `[2T]`
/// vector in one launch (that follows a [`SideStream`](crate::SideStream)):
/// each tensor's `scale_inv` where its amax is finite and NaN where it is
/// not (`scale_inv * (amax * 0 + 1)`), then each tensor's largest decoded
/// value, `decode(cast(amax * scale)) * scale_inv` (NaN where the amax is
/// not finite): the exact amax of codes cast from values at most `amax`
/// with `scale` (casting to nearest is monotonic), without a pass over
/// them.
///
/// # Errors
/// [`Error::Unsupported`] for no tensor or lists of different lengths;
/// candle's for a value that is not one F32.
pub fn bucket_scales_sent(
    scale_invs: &[&Tensor],
    scales: &[&Tensor],
    amaxes: &[&Tensor],
    qtype: QType,
) -> Result<Tensor> {
    const OP: &str = BucketScalesSent::NAME;
    check_lists(OP, scale_invs, scales)?;
    check_lists(OP, scale_invs, amaxes)?;
    let mut inputs: Vec<&Tensor> = scale_invs.to_vec();
    inputs.extend_from_slice(scales);
    inputs.extend_from_slice(amaxes);
    let [c] = <[Tensor; 1]>::try_from(launch(&BucketScalesSent { qtype }, &inputs)?)
        .map_err(|_| arity(OP))?;
    Ok(c)
}

/// m [N, C] (F32) -> [count]: a bound of the mean's amax per column.
pub(crate) struct BucketMeanBound {
    pub start: usize,
    pub count: usize,
    pub factor: f32,
    pub inv_n: Option<f32>,
}

impl Kernel for BucketMeanBound {
    const NAME: &'static str = "bucket_mean_bound";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let sums = fold_columns(Self::NAME, inputs, self.start, self.count, |acc, x| acc + x)?;
        let out = sums
            .into_iter()
            .map(|sum| {
                let b = sum * self.factor;
                match self.inv_n {
                    Some(inv) => b * inv + 0.0,
                    None => b,
                }
            })
            .collect();
        Ok(vec![(CpuStorage::F32(out), Shape::from(self.count))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_mean_bound(
            self.start,
            self.count,
            self.factor,
            self.inv_n,
            inputs,
        )
    }
}

/// A bound of the amax of the ranks' mean (or sum) of each tensor, from
/// their codes' amaxes alone, in one launch: `m` is `[N, C]` with rank
/// `r`'s amax of tensor `c` at `[r, start + c]` (the largest decoded value,
/// [`bucket_scales_sent`]); the result, `[count]`, is their sum in rank
/// order (NaN counted as inf), divided by `N` when `average` as
/// [`decode_sum`](crate::decode_sum) divides. Every element of the decoded
/// mean is at most this bound, rounding included (f32 addition and the
/// division are monotonic), so a scale from it never saturates; it costs
/// up to `log2 N` binades of range against the mean's own amax where the
/// ranks' largest values fall apart.
///
/// # Errors
/// [`Error::Unsupported`] unless `m` is 2-D with the columns.
pub fn bucket_mean_bound(m: &Tensor, start: usize, count: usize, average: bool) -> Result<Tensor> {
    const OP: &str = BucketMeanBound::NAME;
    let rows = match m.dims() {
        [r, c] if start + count <= *c && count > 0 => *r,
        _ => {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("columns {start}..{} of {:?}", start + count, m.shape()),
            })
        }
    };
    let op = BucketMeanBound {
        start,
        count,
        factor: 1.0,
        inv_n: (average && rows > 1).then(|| crate::numerics::decode_sum::DecodeSum::inv_n(rows)),
    };
    let [c] = <[Tensor; 1]>::try_from(launch(&op, &[m])?).map_err(|_| arity(OP))?;
    Ok(c)
}

/// inputs (one dtype) -> their elements concatenated.
pub(crate) struct BucketConcat;

fn concat_cpu<T: candle_core::WithDType>(
    inputs: &[(&CpuStorage, &Layout)],
) -> Result<(CpuStorage, Shape)> {
    let mut out: Vec<T> = Vec::new();
    for (c, l) in inputs {
        out.extend_from_slice(slice::<T>(BucketConcat::NAME, c, l)?);
    }
    let n = out.len();
    Ok((T::to_cpu_storage_owned(out), Shape::from(n)))
}

impl Kernel for BucketConcat {
    const NAME: &'static str = "bucket_concat";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let Some((first, _)) = inputs.first() else {
            return Err(arity(Self::NAME));
        };
        Ok(vec![match first.dtype() {
            DType::F32 => concat_cpu::<f32>(inputs)?,
            DType::BF16 => concat_cpu::<half::bf16>(inputs)?,
            DType::F16 => concat_cpu::<half::f16>(inputs)?,
            DType::U8 => concat_cpu::<u8>(inputs)?,
            got => {
                return Err(Error::DType {
                    op: Self::NAME,
                    expected: "F32, BF16, F16 or U8",
                    got,
                })
            }
        }])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_concat(inputs)
    }
}

/// The elements of `parts` (one dtype: F32, BF16, F16 or U8; any shapes)
/// flat and concatenated, in one launch per 64 parts on CUDA where
/// `Tensor::cat` launches one copy per part: a bucket of a few hundred
/// small F32 gradients (norms, biases) packed for one all-reduce.
///
/// # Errors
/// [`Error::Unsupported`] for no parts or parts of different dtypes or
/// devices; [`Error::DType`] for another dtype.
pub fn bucket_concat(parts: &[&Tensor]) -> Result<Tensor> {
    const OP: &str = BucketConcat::NAME;
    let Some(first) = parts.first() else {
        return Err(Error::Unsupported {
            op: OP,
            what: "no tensors".into(),
        });
    };
    if let Some(odd) = parts
        .iter()
        .find(|p| p.dtype() != first.dtype() || !p.device().same_device(first.device()))
    {
        return Err(Error::Unsupported {
            op: OP,
            what: format!(
                "{:?} on {:?} beside {:?} on {:?}",
                odd.dtype(),
                odd.device().location(),
                first.dtype(),
                first.device().location()
            ),
        });
    }
    let flat = parts
        .iter()
        .map(|p| p.flatten_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let refs: Vec<&Tensor> = flat.iter().collect();
    let [c] = <[Tensor; 1]>::try_from(launch(&BucketConcat, &refs)?).map_err(|_| arity(OP))?;
    Ok(c)
}

/// a [T], b [T] (F32) -> their elementwise maximum (neither holds NaN:
/// agreed amaxes count NaN as inf).
pub(crate) struct BucketMax;

impl Kernel for BucketMax {
    const NAME: &'static str = "bucket_max";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(a, la), (b, lb)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let (a, b) = (
            slice::<f32>(Self::NAME, a, la)?,
            slice::<f32>(Self::NAME, b, lb)?,
        );
        if a.len() != b.len() {
            return Err(arity(Self::NAME));
        }
        let out: Vec<f32> = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| if y > x { y } else { x })
            .collect();
        Ok(vec![(CpuStorage::F32(out), la.shape().clone())])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_max(inputs)
    }
}

/// The elementwise maximum of two amax vectors (F32, one element a tensor,
/// no NaN), in one launch that follows a [`SideStream`](crate::SideStream)
/// (where `Tensor::maximum` would run on candle's stream).
///
/// # Errors
/// [`Error::Unsupported`] for vectors of different lengths; candle's.
pub fn bucket_max(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.elem_count() != b.elem_count() {
        return Err(Error::Unsupported {
            op: BucketMax::NAME,
            what: format!("{} and {} amaxes", a.elem_count(), b.elem_count()),
        });
    }
    let [c] = <[Tensor; 1]>::try_from(launch(&BucketMax, &[a, b])?)
        .map_err(|_| arity(BucketMax::NAME))?;
    Ok(c)
}
