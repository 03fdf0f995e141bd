//! Checkpoints in safetensors: every weight, master weight, moment and
//! scaling meta (scale, scale_inv, amax history), the layers' delayed-scaling
//! state, the loss scaler, the step counter and the config. FP8 tensors are
//! stored as `F8_E4M3` / `F8_E5M2`. Writes are atomic; loads validate every
//! tensor before anything changes.
//!
//! Names: a parameter `p` is stored as `p` (its working storage), `p.__master`
//! (O3), `p.__exp_avg`, `p.__exp_avg_sq` (`p.__exp_avg_sq_root` where the
//! second moment is stored as square roots, [`root_name`]); a scaled tensor `t` adds
//! `t.__scale`, `t.__scale_inv`, `t.__amax_history`; a layer's delayed-scaling
//! metas are `w.__fp8_meta.{input,weight,grad_output}` with the same
//! suffixes.
//!
//! A ZeRO-sharded O3 run writes one file per rank (its slice of each
//! Linear weight's master and moments, flat, named in the metadata
//! `zero_slices` with its range and the whole shape; every replicated
//! tensor in full) and an index at the path itself ([`index`]).
//! Loading at the saved world size reads each rank's own file, bit-exact;
//! at another world size or level the loader decodes every rank's slices,
//! concatenates them in range order and re-encodes this run's part
//! ([`reshard`]).
//!
//! This root holds what every part shares: the format's names, the error
//! helper [`err`], the file of a checkpoint as read ([`Part`]) and the
//! atomic write. The parts, each importing only this root and the parts
//! listed below it:
//!
//! - [`api`]: `AmpContext::{save, load, export}`, the entry points;
//! - [`export`]: plain safetensors of the weights for inference;
//! - [`load`]: which files a load reads, the ranks' agreement, applying;
//! - [`save`]: a file's bytes, the whole save and the sharded one;
//! - [`reshard`]: staging from files of another sharding;
//! - [`stage`]: staging from a file of this run's sharding ([`stage::Staged`]);
//! - [`reader`]: tensors read and checked against what the run holds;
//! - [`index`]: the index of a sharded checkpoint and its rank files' names;
//! - [`agree`]: the ranks' agreement on the outcome of an operation;
//! - [`header`]: a file's metadata, read and checked.

pub(crate) mod agree;
pub(crate) mod api;
pub(crate) mod export;
pub(crate) mod header;
pub(crate) mod index;
pub(crate) mod load;
pub(crate) mod reader;
pub(crate) mod reshard;
pub(crate) mod save;
pub(crate) mod stage;
#[cfg(test)]
mod tests;

use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The `format` of a checkpoint file.
pub(crate) const FORMAT: &str = "candle-amp-checkpoint";
/// The `format` of the index of a sharded checkpoint.
pub(crate) const INDEX_FORMAT: &str = "candle-amp-checkpoint-index";
/// The format version this build writes and reads.
pub(crate) const VERSION: &str = "1";

/// Where a moment stored as square roots (`State::Sqrt`, FP8 moments) is
/// saved: `p.__exp_avg_sq` becomes `p.__exp_avg_sq_root`, a name of its
/// own, so that no reader takes the roots for the values.
pub(crate) fn root_name(name: &str) -> String {
    format!("{name}_root")
}
/// A layer's delayed-scaling metas, in order.
pub(crate) const ROLES: [&str; 3] = ["input", "weight", "grad_output"];

/// [`Error::Checkpoint`] naming `path`.
pub(crate) fn err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// A gathered FP8 copy where an optimizer parameter was expected (`op`:
/// save or load).
pub(crate) fn not_a_param(op: &str) -> Error {
    Error::Config {
        field: op.into(),
        reason: "a gathered FP8 copy is not an optimizer parameter (its master slice is)".into(),
    }
}

/// One file of a checkpoint, read.
pub(crate) struct Part {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// The rank that saved it.
    pub rank: usize,
    /// The number of ranks of the save (1: a whole checkpoint).
    pub world: usize,
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, fsync,
/// rename. `fail_before_rename` simulates a crash (tests).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], fail_before_rename: bool) -> Result<()> {
    // A temporary name of this process and call, beside the target (same
    // file system, so the rename is atomic).
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp.{}.{n}", std::process::id()));
    let io = |e: std::io::Error| err(path, e.to_string());
    let written = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    if fail_before_rename {
        // A crash here would leave the temporary file; the target is untouched.
        return Err(err(path, "interrupted before rename (simulated)"));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // Persist the rename itself; not every platform can open a directory.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    remove_stale_temps(path);
    Ok(())
}

/// Removes the temporary files that earlier saves to `path` left behind
/// when they were killed between writing and renaming
/// (`<path minus extension>.tmp.<pid>.<n>`): those of this process, and
/// those of processes that no longer run (where that can be told: Linux's
/// `/proc`). A temporary file of a save still running elsewhere stays.
/// Best effort: a file that cannot be removed is left.
fn remove_stale_temps(path: &Path) {
    let Some(stem) = path
        .with_extension("")
        .file_name()
        .map(|s| s.to_os_string())
    else {
        return;
    };
    let prefix = format!("{}.tmp.", stem.to_string_lossy());
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let me = std::process::id();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let mut parts = rest.split('.');
        let (Some(pid), Some(seq), None) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (Ok(pid), Ok(_)) = (pid.parse::<u32>(), seq.parse::<u64>()) else {
            continue;
        };
        let gone = pid == me
            || (cfg!(target_os = "linux") && !Path::new(&format!("/proc/{pid}")).exists());
        if gone {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
