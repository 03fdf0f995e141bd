//! Exporting a trained model as plain safetensors for inference elsewhere:
//! the weights alone, in F32 or BF16, from the masters (gathered from the
//! ranks where ZeRO slices them), written by rank 0.

use super::save::raw;
use super::{err, write_atomic};
use crate::distributed::{self, zero};
use crate::error::Result;
use crate::optimizer::AmpOptimizer;
use candle_core::DType;
use candle_core::Tensor;
use safetensors::tensor::TensorView;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The dtype of an exported model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDType {
    /// F32.
    F32,
    /// BF16.
    BF16,
}

/// Writes `opt`'s weights at `path` as `dtype`
/// ([`AmpContext::export`](crate::context::AmpContext::export)): every rank
/// of a group calls it, rank 0 writes.
///
/// # Errors
/// [`crate::error::Error::Checkpoint`] on I/O errors.
pub(crate) fn export(path: &Path, opt: &AmpOptimizer, dtype: ExportDType) -> Result<()> {
    match weights(opt, dtype)? {
        Some(w) => write_tensors(path, &w),
        None => Ok(()),
    }
}

/// `opt`'s weights under their names in `dtype`, from the masters
/// (gathered from the ranks where ZeRO slices them): every rank of a group
/// calls it, rank 0 gets them (`None` elsewhere).
///
/// # Errors
/// The communicator's; candle's.
pub(crate) fn weights(
    opt: &AmpOptimizer,
    dtype: ExportDType,
) -> Result<Option<Vec<(String, Tensor)>>> {
    let (rank, _) = opt.rank_and_world();
    let group = distributed::group(opt);
    let mut out = Vec::new();
    for p in opt.inner().params() {
        let mut v = p.slot.read()?.master_f32()?;
        let shard = group.and_then(|g| Some((g, g.shards().iter().find(|s| s.name == p.name)?)));
        if let Some((group, s)) = shard {
            v = zero::gather_master(group.comm(), &v, s)?;
        }
        if rank != 0 {
            continue;
        }
        let v = match dtype {
            ExportDType::F32 => v,
            ExportDType::BF16 => v.to_dtype(DType::BF16)?,
        };
        out.push((p.name.clone(), v));
    }
    Ok((rank == 0).then_some(out))
}

/// `tensors` as one safetensors file at `path`, written atomically
/// (temporary file, fsync, rename), with the metadata `transformers`
/// looks for (`format: pt`): F32, BF16 and F16 as they are, any other
/// dtype as F32. For exports in other layouts (the GPT example's Hugging
/// Face directory).
///
/// # Errors
/// [`crate::error::Error::Checkpoint`] on I/O errors; candle's.
pub fn write_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let mut out = BTreeMap::new();
    for (name, t) in tensors {
        let (bytes, dt, _) = raw(t, None)?;
        out.insert(name.clone(), (bytes, dt, t.dims().to_vec()));
    }
    let views = out
        .iter()
        .map(|(k, (b, d, s))| {
            Ok((
                k.clone(),
                TensorView::new(*d, s.clone(), b).map_err(|e| err(path, e.to_string()))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors::tensor::serialize(views, Some(metadata))
        .map_err(|e| err(path, e.to_string()))?;
    write_atomic(path, &bytes, false)
}
