//! The checkpoint's entry points on [`AmpContext`]: [`save`](AmpContext::save),
//! [`load`](AmpContext::load), [`export`](AmpContext::export), each calling
//! down into its part of the module.

use super::export::ExportDType;
use super::{export, load, save};
use crate::context::AmpContext;
use crate::error::Result;
use crate::optimizer::AmpOptimizer;
use std::path::Path;

impl AmpContext {
    /// Saves the model's parameters and the optimizer's whole state.
    ///
    /// In a data-parallel group every rank calls it: the replicas are
    /// identical, so rank 0 writes `path` and the others write nothing.
    /// At O3 with ZeRO each rank writes its own slice to a file of this
    /// save (`ckpt.rank<r>-of-<N>.<save id>.safetensors`;
    /// [`shard_files`](super::index::shard_files) lists them), and once all
    /// are written rank 0 writes a small index at `path` itself (one atomic
    /// rename): the world size, the step and each rank file's name, size
    /// and CRC-32 ([`load`](Self::load) reads it back at any world size and
    /// level). Only then are the files of the checkpoint it replaced
    /// removed, so a save that fails or is killed at any point leaves the
    /// previous checkpoint loadable.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](crate::error::Error::Checkpoint) on I/O errors, on
    /// every rank of a sharded run when any rank's write fails (the index
    /// is then not written), and while the last step's outcome is pending
    /// ([`AmpOptimizer::resolve`] first).
    pub fn save(&self, path: impl AsRef<Path>, opt: &AmpOptimizer) -> Result<()> {
        save::save(self, path.as_ref(), opt)
    }

    /// Loads a checkpoint into this (initialized) model and optimizer.
    /// Everything is validated first (header, every tensor's presence,
    /// dtype and shape, no extra tensor, the level); on any error nothing
    /// changes.
    ///
    /// A checkpoint of the same level and world size resumes bit-exactly;
    /// one of another level is converted (re-encoded in this level's
    /// storage). A ZeRO-sharded checkpoint (the index at `path` and its
    /// rank files beside it) loads at any world size and level: each rank
    /// reads every rank file (checked against the index's sizes and
    /// CRC-32s), decodes the saved slices to F32, concatenates them in
    /// range order and takes what it holds (its own range when this run is
    /// sharded, the whole tensor otherwise), re-encoded in this run's
    /// storage with fresh scales: lossy only by that re-encoding. The
    /// replicated parameters are read as stored where this run stores them
    /// alike. A sharded run also loads a whole checkpoint this way.
    ///
    /// In a data-parallel group every rank calls it, and they agree before
    /// anything changes: a file that one rank cannot read fails every rank.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](crate::error::Error::Checkpoint) naming the file and
    /// what is wrong, on every rank of a group.
    pub fn load(&self, path: impl AsRef<Path>, opt: &mut AmpOptimizer) -> Result<()> {
        load::load(self, path.as_ref(), opt)
    }

    /// Writes the model's weights as a plain safetensors file for inference
    /// elsewhere: every parameter under its own name (as the model's
    /// `VarBuilder` named it), in `dtype`, from the master copy where there
    /// is one; no optimizer state, no scales. In a data-parallel group every
    /// rank calls it (ZeRO slices are gathered) and rank 0 writes.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](crate::error::Error::Checkpoint) on I/O errors.
    pub fn export(
        &self,
        path: impl AsRef<Path>,
        opt: &AmpOptimizer,
        dtype: ExportDType,
    ) -> Result<()> {
        export::export(path.as_ref(), opt, dtype)
    }

    /// What [`export`](Self::export) writes, as tensors: the weights under
    /// their names in `dtype`, from the masters. In a data-parallel group
    /// every rank calls it (ZeRO slices are gathered) and rank 0 gets them;
    /// the others get `None`. For exports in other layouts.
    ///
    /// # Errors
    /// The communicator's; candle's.
    pub fn export_weights(
        &self,
        opt: &AmpOptimizer,
        dtype: ExportDType,
    ) -> Result<Option<Vec<(String, candle_core::Tensor)>>> {
        export::weights(opt, dtype)
    }
}
