//! Exporting a trained model as plain safetensors for inference elsewhere:
//! the weights alone, in F32 or BF16, from the masters (gathered from the
//! ranks where ZeRO slices them), written by rank 0.

use super::{err, write_atomic};
use crate::context::AmpOptimizer;
use crate::distributed::{self, zero};
use crate::error::Result;
use candle_core::DType;
use safetensors::tensor::{Dtype, TensorView};
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
    let (rank, _) = opt.rank_and_world();
    let group = distributed::group(opt);
    let mut out = BTreeMap::new();
    for p in opt.inner().params() {
        let mut v = p.slot.read()?.master_f32()?;
        let shard = group.and_then(|g| Some((g, g.shards().iter().find(|s| s.name == p.name)?)));
        if let Some((group, s)) = shard {
            v = zero::gather_master(group.comm(), &v, s)?;
        }
        if rank != 0 {
            continue;
        }
        let (bytes, dt) = match dtype {
            ExportDType::F32 => (
                v.flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect::<Vec<u8>>(),
                Dtype::F32,
            ),
            ExportDType::BF16 => (
                v.flatten_all()?
                    .to_dtype(DType::BF16)?
                    .to_vec1::<half::bf16>()?
                    .iter()
                    .flat_map(|x| x.to_bits().to_le_bytes())
                    .collect(),
                Dtype::BF16,
            ),
        };
        out.insert(p.name.clone(), (bytes, dt, v.dims().to_vec()));
    }
    if rank != 0 {
        return Ok(());
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
