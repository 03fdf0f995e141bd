//! The index of a ZeRO-sharded checkpoint and the names of its rank files.
//!
//! Each rank `r` of a sharded O3 run of `N` ranks writes its file
//! [`shard_path`]`(path, r, N)`; once every rank has
//! written its file, rank 0 writes the index at `path` itself. The index is
//! a safetensors file without tensors; its metadata holds
//!
//! - `format`: `candle-amp-checkpoint-index`, `version`: `1`;
//! - `level`, `step`: those of the save;
//! - `world`: `N`;
//! - `files`: a JSON list, in rank order, of `{"file", "bytes", "crc32"}`:
//!   each rank file's name (beside the index), its size and the CRC-32
//!   (IEEE) of its bytes.
//!
//! A load checks every rank file it reads against its entry, so a missing,
//! truncated, corrupt or foreign file (of another save, step or world size)
//! is an error naming it. The index is written last: a save interrupted
//! after some rank files leaves the old index, whose sizes and checksums no
//! longer match those files (an error, never a silent mix of two saves).
//! Every rank file also carries its save's id (metadata `save_id`, one
//! random id a save, rank 0's): rank files found without their index load
//! only when all ranks read files of one save.

use super::header::Metadata;
use super::{err, write_atomic, Part, INDEX_FORMAT, VERSION};
use crate::error::Result;
use crate::level::Level;
use safetensors::tensor::{SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The file a rank of a ZeRO-sharded run writes for checkpoint `path`:
/// `ckpt.safetensors` becomes `ckpt.rank0-of-4.safetensors` (`path` itself
/// is then the index that lists the rank files, with their sizes and
/// CRC-32s; load `path`, at any world size).
pub fn shard_path(path: impl AsRef<Path>, rank: usize, world: usize) -> PathBuf {
    let path = path.as_ref();
    let stem = path
        .file_stem()
        .map_or_else(Default::default, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}-of-{world}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}-of-{world}"),
    };
    path.with_file_name(name)
}

/// One rank's file, as the index records it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileEntry {
    /// Its name, in the index's directory.
    pub file: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The CRC-32 of its bytes.
    pub crc32: u32,
}

/// The index of a sharded checkpoint.
#[derive(Debug, Clone)]
pub(crate) struct Index {
    /// The level of the save.
    pub level: Level,
    /// The step of the save.
    pub step: u64,
    /// The number of ranks that saved it.
    pub world: usize,
    /// Each rank's file, in rank order.
    pub files: Vec<FileEntry>,
}

impl Index {
    /// The index in `bytes` (read from `path`), or `None` when they hold
    /// anything else.
    ///
    /// # Errors
    /// [`crate::error::Error::Checkpoint`] for an index with missing or bad fields.
    pub(crate) fn parse(path: &Path, bytes: &[u8]) -> Result<Option<Self>> {
        let Ok((_, header)) = SafeTensors::read_metadata(bytes) else {
            return Ok(None);
        };
        let meta = Metadata::new(path, header.metadata().clone().unwrap_or_default());
        if meta.get("format") != Some(INDEX_FORMAT) {
            return Ok(None);
        }
        meta.check_version()?;
        let number = |k: &str| -> Result<u64> {
            meta.field(k)?
                .parse()
                .map_err(|_| err(path, format!("metadata `{k}` is not a number")))
        };
        let index = Self {
            level: meta.level()?,
            step: number("step")?,
            world: usize::try_from(number("world")?)
                .map_err(|_| err(path, "metadata `world` is out of range"))?,
            files: serde_json::from_str(meta.field("files")?)
                .map_err(|e| err(path, format!("metadata `files`: {e}")))?,
        };
        if index.world == 0 || index.files.len() != index.world {
            return Err(err(
                path,
                format!(
                    "the index lists {} file(s) for {} rank(s)",
                    index.files.len(),
                    index.world
                ),
            ));
        }
        for f in &index.files {
            // a plain name beside the index, nothing elsewhere
            if Path::new(&f.file).file_name().and_then(|n| n.to_str()) != Some(f.file.as_str()) {
                return Err(err(
                    path,
                    format!("index entry `{}` is not a file name", f.file),
                ));
            }
        }
        Ok(Some(index))
    }

    /// Rank `rank`'s file of the index at `path`, read and checked against
    /// its entry.
    ///
    /// # Errors
    /// [`crate::error::Error::Checkpoint`] naming the file: missing, unreadable,
    /// or of another size or checksum than the index records.
    pub(crate) fn read_file(&self, path: &Path, rank: usize) -> Result<Part> {
        let entry = self
            .files
            .get(rank)
            .ok_or_else(|| err(path, format!("the index has no file for rank {rank}")))?;
        let file = path.with_file_name(&entry.file);
        let whose = format!(
            "rank {rank}'s file of the {}-rank checkpoint {}",
            self.world,
            path.display()
        );
        let bytes = std::fs::read(&file).map_err(|e| err(&file, format!("{e} ({whose})")))?;
        if bytes.len() as u64 != entry.bytes {
            return Err(err(
                &file,
                format!(
                    "{} bytes, the index records {}: truncated, or of another save ({whose})",
                    bytes.len(),
                    entry.bytes
                ),
            ));
        }
        let crc32 = crc32fast::hash(&bytes);
        if crc32 != entry.crc32 {
            return Err(err(
                &file,
                format!(
                    "CRC-32 {crc32:08x}, the index records {:08x}: corrupt, or of another save ({whose})",
                    entry.crc32
                ),
            ));
        }
        Ok(Part {
            path: file,
            bytes,
            rank,
            world: self.world,
        })
    }

    /// Writes the index at `path`, atomically.
    pub(crate) fn write(&self, path: &Path) -> Result<()> {
        let files = serde_json::to_string(&self.files).map_err(|e| err(path, e.to_string()))?;
        let metadata = HashMap::from([
            ("format".to_string(), INDEX_FORMAT.to_string()),
            ("version".to_string(), VERSION.to_string()),
            ("level".to_string(), self.level.to_string()),
            ("step".to_string(), self.step.to_string()),
            ("world".to_string(), self.world.to_string()),
            ("files".to_string(), files),
        ]);
        let bytes = safetensors::tensor::serialize(
            std::iter::empty::<(String, TensorView<'_>)>(),
            Some(metadata),
        )
        .map_err(|e| err(path, e.to_string()))?;
        write_atomic(path, &bytes, false)
    }
}
