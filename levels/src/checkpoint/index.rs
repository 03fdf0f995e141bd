//! The index of a ZeRO-sharded checkpoint and the names of its rank files.
//!
//! Each rank `r` of a sharded O3 run of `N` ranks writes its file under a
//! name of this save ([`generation_path`]: `ckpt.rank<r>-of-<N>.<id>.safetensors`,
//! the save's id in it); once every rank has written its file, rank 0
//! writes the index at `path` itself (one atomic rename), and only then
//! are the files of the checkpoint it replaced removed
//! ([`remove_superseded`]): a save that fails or is killed at any point
//! leaves the previous checkpoint whole. Saves before this scheme used
//! [`shard_path`] names, which a load without an index still reads. The index is
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
//! is an error naming it. Every rank file also carries its save's id (metadata `save_id`, one
//! random id a save, rank 0's): rank files found without their index load
//! only when all ranks read files of one save.

use super::header::Metadata;
use super::{err, write_atomic, Part, INDEX_FORMAT, VERSION};
use crate::error::Result;
use crate::level::Level;
use safetensors::tensor::{SafeTensors, TensorView};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The name a rank's file of a ZeRO-sharded checkpoint at `path` had
/// before saves wrote each generation under its own names
/// (`ckpt.safetensors` -> `ckpt.rank0-of-4.safetensors`): a load of
/// `path` without an index reads this rank's file there. A save now
/// writes names of the save (`ckpt.rank0-of-4.<save id>.safetensors`),
/// which [`shard_files`] lists.
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
/// Rank `rank`'s file of save `id` (16 hex digits) of a `world`-rank
/// checkpoint at `path`: `ckpt.safetensors` -> `ckpt.rank1-of-4.<id>.safetensors`.
/// Each save writes new names, so the files of the checkpoint it replaces
/// stay whole until the new index has replaced the old one.
pub(crate) fn generation_path(path: &Path, rank: usize, world: usize, id: &str) -> PathBuf {
    let plain = shard_path(path, rank, world);
    let name = match path.extension() {
        Some(ext) => {
            let stem = plain.file_stem().map(|s| s.to_string_lossy().into_owned());
            format!(
                "{}.{id}.{}",
                stem.unwrap_or_default(),
                ext.to_string_lossy()
            )
        }
        None => format!(
            "{}.{id}",
            plain
                .file_name()
                .map(|s| s.to_string_lossy())
                .unwrap_or_default()
        ),
    };
    path.with_file_name(name)
}

/// The rank files of the sharded checkpoint whose index is at `path`, in
/// rank order, as its index names them.
///
/// # Errors
/// [`Error::Checkpoint`](crate::error::Error::Checkpoint) when `path`
/// cannot be read or is not the index of a sharded checkpoint.
pub fn shard_files(path: impl AsRef<Path>) -> Result<Vec<PathBuf>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| err(path, e.to_string()))?;
    let index = Index::parse(path, &bytes)?
        .ok_or_else(|| err(path, "not the index of a sharded checkpoint"))?;
    Ok(index
        .files
        .iter()
        .map(|f| path.with_file_name(&f.file))
        .collect())
}

/// What a file beside checkpoint `path` is to its sharded saves, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RankName {
    /// Rank `rank`'s file of a `world`-rank save: a generation's
    /// (`<stem>.rank<r>-of-<N>.<id><.ext>`) or a [`shard_path`] name.
    File { rank: usize, world: usize },
    /// A temporary file of a killed save of one (`...tmp.<pid>.<n>`).
    Temp { pid: u32 },
}

/// Every file of the directory of `path` whose name is a [`RankName`] of
/// it, with what it is. Unreadable directories and names yield nothing.
fn rank_names(path: &Path) -> Vec<(PathBuf, String, RankName)> {
    let Some(stem) = path
        .with_extension("")
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
    else {
        return Vec::new();
    };
    let ext = path.extension().map(|e| e.to_string_lossy().into_owned());
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let prefix = format!("{stem}.rank");
    let is_id = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit());
    let is_ext = |s: &str| ext.as_deref() == Some(s);
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        // `<r>-of-<N>`, then the rest split on dots
        let mut parts = rest.split('.');
        let Some((r, n)) = parts.next().and_then(|p| p.split_once("-of-")) else {
            continue;
        };
        let (Ok(rank), Ok(world)) = (r.parse::<usize>(), n.parse::<usize>()) else {
            continue;
        };
        let tail: Vec<&str> = parts.collect();
        let kind = match tail.as_slice() {
            [] if ext.is_none() => Some(RankName::File { rank, world }),
            [e] if is_ext(e) => Some(RankName::File { rank, world }),
            [id] if ext.is_none() && is_id(id) => Some(RankName::File { rank, world }),
            [id, e] if is_id(id) && is_ext(e) => Some(RankName::File { rank, world }),
            [.., "tmp", pid, seq] if seq.parse::<u64>().is_ok() => {
                pid.parse().ok().map(|pid| RankName::Temp { pid })
            }
            _ => None,
        };
        if let Some(kind) = kind {
            out.push((entry.path(), name, kind));
        }
    }
    out
}

/// Without an index at `path`: this rank's file of a `world`-rank save,
/// found by its name (a generation's, or the [`shard_path`] of saves
/// before generations). `None` when there is none.
///
/// # Errors
/// [`Error::Checkpoint`](crate::error::Error::Checkpoint) when several
/// saves' files are there for this rank (only an index tells which one).
pub(crate) fn find_rank_file(path: &Path, rank: usize, world: usize) -> Result<Option<PathBuf>> {
    let mut found: Vec<(PathBuf, String)> = rank_names(path)
        .into_iter()
        .filter(|(_, _, kind)| *kind == RankName::File { rank, world })
        .map(|(file, name, _)| (file, name))
        .collect();
    found.sort();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop().map(|(file, _)| file)),
        _ => Err(err(
            path,
            format!(
                "no index, and {} saves' files for rank {rank} of {world} ({}): \
                 only an index tells which one to load",
                found.len(),
                found
                    .iter()
                    .map(|(_, name)| name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// After `index` has been written at `path`: removes the rank files of the
/// saves it replaced (`<stem>.rank<r>-of-<N>[.<id>]<.ext>` not in the
/// index) and the temporary files killed saves of them left (`.tmp.<pid>.<n>`,
/// of this process or of one that no longer runs). Best effort: a file
/// that cannot be removed stays, and is tried again by the next save.
pub(crate) fn remove_superseded(path: &Path, index: &Index) {
    let me = std::process::id();
    for (file, name, kind) in rank_names(path) {
        let remove = match kind {
            RankName::File { .. } => !index.files.iter().any(|f| f.file == name),
            RankName::Temp { pid } => {
                pid == me
                    || (cfg!(target_os = "linux") && !Path::new(&format!("/proc/{pid}")).exists())
            }
        };
        if remove {
            let _ = std::fs::remove_file(file);
        }
    }
}

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
