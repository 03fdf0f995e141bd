//! A bucket's rank sums: each rank's codes decoded with its own scale
//! and summed in F32 in rank order, with each tensor's amax, written as
//! F32 or, in a second pass, straight to codes.

use super::*;
use crate::error::{Error, Result};
use crate::numerics::cast::quantize_slice;
use crate::numerics::decode_sum::DecodeSum;
use crate::numerics::kernel::{arity, launch, scalar, slice, Kernel};
use crate::numerics::qtype::QType;
use candle_core::{CpuStorage, CudaStorage, Layout, Shape, Tensor};

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
