//! Moving a bucket's codes between tensors: the pieces copied out of one
//! tensor or gathered from several, and whole tensors concatenated.

use super::*;
use crate::error::{Error, Result};
use crate::numerics::kernel::{arity, launch, slice, Kernel};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape, Tensor};

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
