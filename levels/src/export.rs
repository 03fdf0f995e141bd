//! Exporting a trained model as plain safetensors for inference elsewhere.

use crate::checkpoint::{err, write_atomic};
use crate::context::{AmpContext, AmpOptimizer};
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

impl AmpContext {
    /// Writes the model's weights as a plain safetensors file for inference
    /// elsewhere: every parameter under its own name (as the model's
    /// `VarBuilder` named it), in `dtype`, from the master copy where there
    /// is one; no optimizer state, no scales. In a data-parallel group every
    /// rank calls it (ZeRO slices are gathered) and rank 0 writes.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] on I/O errors.
    pub fn export(
        &self,
        path: impl AsRef<Path>,
        opt: &AmpOptimizer,
        dtype: ExportDType,
    ) -> Result<()> {
        let path = path.as_ref();
        let (rank, _) = opt.rank_and_world();
        let mut out = BTreeMap::new();
        for p in opt.inner().params() {
            let mut v = p.slot.read()?.master_f32()?;
            if let (Some(s), Some(comm)) = (opt.shards.iter().find(|s| s.name == p.name), &opt.comm)
            {
                v = crate::zero::gather_master(comm.0.as_ref(), &v, s)?;
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
}
