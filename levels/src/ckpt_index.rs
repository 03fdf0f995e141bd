//! The index of a ZeRO-sharded checkpoint, the collective save that writes
//! it, and the agreement of a group's ranks on a checkpoint operation.
//!
//! Each rank `r` of a sharded O3 run of `N` ranks writes its file
//! [`shard_path`](crate::shard_path)`(path, r, N)`; once every rank has
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

use crate::checkpoint::{err, write_atomic, VERSION};
use crate::ckpt_header::Metadata;
use crate::ckpt_reshard::Part;
use crate::context::{AmpContext, AmpOptimizer};
use crate::error::Result;
use crate::Level;
use amp_comm::Communicator;
use candle_core::{Device, Tensor};
use safetensors::tensor::{SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// The `format` of an index.
pub(crate) const INDEX_FORMAT: &str = "candle-amp-checkpoint-index";

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
    /// [`crate::Error::Checkpoint`] for an index with missing or bad fields.
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
    /// [`crate::Error::Checkpoint`] naming the file: missing, unreadable,
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
    fn write(&self, path: &Path) -> Result<()> {
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

/// The collective save of a sharded run: each rank writes its file, the
/// ranks exchange sizes and checksums, rank 0 writes the index.
///
/// # Errors
/// [`crate::Error::Checkpoint`] on every rank when any rank's file or the
/// index could not be written.
pub(crate) fn save_sharded(ctx: &AmpContext, path: &Path, opt: &AmpOptimizer) -> Result<()> {
    let Some(comm) = &opt.comm else {
        return Err(err(path, "a sharded optimizer without its group"));
    };
    let comm = comm.0.as_ref();
    let (rank, world) = (comm.rank(), comm.world_size());
    let name = |r: usize| -> Result<String> {
        let file = crate::shard_path(path, r, world);
        file.file_name()
            .and_then(|n| n.to_str())
            .map(String::from)
            .ok_or_else(|| err(&file, "not a UTF-8 file name"))
    };
    let written = name(rank).and_then(|file| {
        let target = path.with_file_name(&file);
        let bytes = ctx.checkpoint_bytes(&target, opt)?;
        write_atomic(&target, &bytes, false)?;
        Ok(FileEntry {
            file,
            bytes: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        })
    });
    let entry = agree(comm, path, written, |r| {
        format!("rank {r} could not write its file, so the index was not written")
    })?;
    // every rank's [size (8 bytes), crc32 (4 bytes)], little-endian
    let mut mine = [0u8; 12];
    mine[..8].copy_from_slice(&entry.bytes.to_le_bytes());
    mine[8..].copy_from_slice(&entry.crc32.to_le_bytes());
    let mut files = Vec::with_capacity(world);
    for (r, m) in exchange(comm, &mine)?.iter().enumerate() {
        let (Ok(size), Ok(crc)) = (
            <[u8; 8]>::try_from(&m[..8.min(m.len())]),
            <[u8; 4]>::try_from(m.get(8..).unwrap_or_default()),
        ) else {
            return Err(err(path, format!("rank {r} sent a malformed file entry")));
        };
        files.push(FileEntry {
            file: name(r)?,
            bytes: u64::from_le_bytes(size),
            crc32: u32::from_le_bytes(crc),
        });
    }
    let index = Index {
        level: ctx.level(),
        step: opt.inner().step_count(),
        world,
        files,
    };
    let wrote = if rank == 0 { index.write(path) } else { Ok(()) };
    agree(comm, path, wrote, |r| {
        format!("rank {r} could not write the index")
    })
}

/// Every rank's `bytes` (all of one length), in rank order.
fn exchange(comm: &dyn Communicator, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let t = Tensor::from_slice(bytes, bytes.len(), comm.device())?;
    Ok(comm.all_gather(&t)?.to_device(&Device::Cpu)?.to_vec2()?)
}

/// How much of a failed rank's error message the others receive.
const MESSAGE_BYTES: usize = 512;

/// `local`, this rank's outcome of a checkpoint operation on `path`, once
/// every rank of the group has reported its own: this rank's error, or the
/// first failed rank's (its message, up to 512 bytes, after `failed(rank)`
/// saying what it could not do), or `local`'s value when all succeeded.
/// Every rank calls it, so that none is left waiting in a later collective.
///
/// # Errors
/// As described; the communicator's when the group is broken.
pub(crate) fn agree<T>(
    comm: &dyn Communicator,
    path: &Path,
    local: Result<T>,
    failed: impl Fn(usize) -> String,
) -> Result<T> {
    // [ok, message bytes (zero-padded)]
    let mut mine = vec![0u8; 1 + MESSAGE_BYTES];
    match &local {
        Ok(_) => mine[0] = 1,
        Err(e) => {
            let msg = e.to_string();
            let mut end = msg.len().min(MESSAGE_BYTES);
            while !msg.is_char_boundary(end) {
                end -= 1;
            }
            mine[1..=end].copy_from_slice(&msg.as_bytes()[..end]);
        }
    }
    let all = exchange(comm, &mine);
    let value = local?;
    let all = all?;
    match all.iter().position(|m| m.first() != Some(&1)) {
        Some(r) => {
            let msg = all[r].get(1..).unwrap_or_default();
            let msg = String::from_utf8_lossy(msg);
            Err(err(
                path,
                format!("{}: {}", failed(r), msg.trim_end_matches('\0')),
            ))
        }
        None => Ok(value),
    }
}
