//! A checkpoint file's metadata, read and checked: the format and version,
//! the level, the counters, the loss scaler, and what the file holds of a
//! ZeRO-sharded run (its tag and its slices, as a save records them).

use super::{err, FORMAT, INDEX_FORMAT, VERSION};
use crate::distributed;
use crate::error::Result;
use crate::level::Level;
use crate::optimizer::AmpOptimizer;
use amp_optim::LossScaler;
use safetensors::tensor::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Counters far beyond any run are corrupt (and would overflow).
const MAX_COUNT: u64 = 1 << 53;

/// What a checkpoint file's metadata says.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    /// The level it was saved at.
    pub level: Level,
    /// The optimizer's step counter.
    pub step: u64,
    /// Its skipped steps (0 in checkpoints from before it was saved).
    pub skipped: u64,
    /// A sharded save's id, the same in all its rank files (none in a
    /// whole checkpoint, or one from before it was saved).
    pub save_id: Option<String>,
    /// The loss scaler.
    pub scaler: LossScaler,
    /// Each parameter's own step counter, by name.
    pub param_steps: BTreeMap<String, u64>,
    /// Each delayed-scaling meta's update counter, and each layer's
    /// `used` flags.
    pub layer_meta: BTreeMap<String, u64>,
    /// The ZeRO tag: `none`, or `rank/world` of the rank that wrote it.
    pub zero: String,
    /// The parameters stored as ZeRO slices, by name (empty unless sharded).
    pub slices: BTreeMap<String, SliceInfo>,
}

/// Parses `bytes`, read from `path`, and checks its metadata.
///
/// # Errors
/// [`crate::error::Error::Checkpoint`] naming `path` and what is wrong.
pub(crate) fn read_header<'a>(path: &Path, bytes: &'a [u8]) -> Result<(SafeTensors<'a>, Header)> {
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| err(path, format!("not a readable safetensors file: {e}")))?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| err(path, e.to_string()))?;
    let meta = Metadata::new(path, header.metadata().clone().unwrap_or_default());
    let field = |k: &str| meta.field(k);
    if field("format")? == INDEX_FORMAT {
        return Err(err(
            path,
            "the index of a sharded checkpoint, not one of its rank files",
        ));
    }
    if field("format")? != FORMAT {
        return Err(err(path, "not a candle-amp checkpoint"));
    }
    meta.check_version()?;
    if let Some(want) = meta.get("data_crc32") {
        let mut tensors = st.tensors();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let got = data_crc32(tensors.iter().map(|(k, v)| (k.as_str(), v.data())));
        if want != got.to_string() {
            return Err(err(
                path,
                format!(
                    "the tensors' CRC-32 is {got}, the file says {want}: the file is corrupt \
                     (nothing was loaded)"
                ),
            ));
        }
    }
    let level = meta.level()?;
    let count = |what: &str, v: u64| -> Result<u64> {
        if v > MAX_COUNT {
            Err(err(path, format!("metadata `{what}`: {v} is out of range")))
        } else {
            Ok(v)
        }
    };
    let step: u64 = count(
        "step",
        field("step")?
            .parse()
            .map_err(|_| err(path, "metadata `step` is not a number"))?,
    )?;
    let skipped: u64 = match meta.get("skipped") {
        None => 0,
        Some(v) => count(
            "skipped",
            v.parse()
                .map_err(|_| err(path, "metadata `skipped` is not a number"))?,
        )?,
    };
    let scaler: LossScaler = serde_json::from_str(field("scaler")?)
        .map_err(|e| err(path, format!("metadata `scaler`: {e}")))?;
    check_scaler(&scaler).map_err(|reason| err(path, format!("metadata `scaler`: {reason}")))?;
    let param_steps: BTreeMap<String, u64> = serde_json::from_str(field("param_steps")?)
        .map_err(|e| err(path, format!("metadata `param_steps`: {e}")))?;
    let layer_meta: BTreeMap<String, u64> = serde_json::from_str(field("layer_meta")?)
        .map_err(|e| err(path, format!("metadata `layer_meta`: {e}")))?;
    for (k, v) in param_steps.iter().chain(&layer_meta) {
        count(k, *v)?;
    }
    let slices = match meta.get("zero_slices") {
        Some(s) => serde_json::from_str(s)
            .map_err(|e| err(path, format!("metadata `zero_slices`: {e}")))?,
        None => BTreeMap::new(),
    };
    let header = Header {
        level,
        step,
        skipped,
        save_id: meta.get("save_id").map(String::from),
        scaler,
        param_steps,
        layer_meta,
        zero: meta.get("zero").unwrap_or("none").to_string(),
        slices,
    };
    Ok((st, header))
}

/// Where a rank's slice of a sharded parameter lies, as a rank's
/// checkpoint file records it (metadata `zero_slices`, by name): the range
/// of the flat weight and the whole weight's shape.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SliceInfo {
    /// First element of the slice in the flat weight.
    pub start: usize,
    /// One past its last element.
    pub end: usize,
    /// The whole weight's shape.
    pub shape: Vec<usize>,
}

/// The slices `opt` holds, by parameter name (empty unless ZeRO).
pub(crate) fn slices(opt: &AmpOptimizer) -> BTreeMap<String, SliceInfo> {
    distributed::shards(opt)
        .iter()
        .map(|s| {
            (
                s.name.clone(),
                SliceInfo {
                    start: s.range.start,
                    end: s.range.end,
                    shape: s.shape.dims().to_vec(),
                },
            )
        })
        .collect()
}

/// What a checkpoint records of `opt`'s sharding (metadata `zero`): `none`,
/// or `rank/world`.
pub(crate) fn zero_tag(opt: &AmpOptimizer) -> String {
    if distributed::shards(opt).is_empty() {
        return "none".into();
    }
    let (rank, world) = opt.rank_and_world();
    format!("{rank}/{world}")
}

/// A safetensors header's metadata, read with errors naming the file.
pub(crate) struct Metadata<'a> {
    map: HashMap<String, String>,
    path: &'a Path,
}

impl<'a> Metadata<'a> {
    /// `map`, read from `path`.
    pub(crate) fn new(path: &'a Path, map: HashMap<String, String>) -> Self {
        Self { map, path }
    }

    /// Entry `k`, if there is one.
    pub(crate) fn get(&self, k: &str) -> Option<&str> {
        self.map.get(k).map(String::as_str)
    }

    /// Entry `k`.
    ///
    /// # Errors
    /// [`crate::error::Error::Checkpoint`] when it is missing.
    pub(crate) fn field(&self, k: &str) -> Result<&str> {
        self.get(k)
            .ok_or_else(|| err(self.path, format!("metadata `{k}` missing")))
    }

    /// Checks that this build reads the format version.
    ///
    /// # Errors
    /// [`crate::error::Error::Checkpoint`] for another version.
    pub(crate) fn check_version(&self) -> Result<()> {
        let version = self.field("version")?;
        if version != VERSION {
            return Err(err(
                self.path,
                format!("format version {version}, this build reads {VERSION}"),
            ));
        }
        Ok(())
    }

    /// The level it was saved at.
    ///
    /// # Errors
    /// [`crate::error::Error::Checkpoint`] when missing or not a level.
    pub(crate) fn level(&self) -> Result<Level> {
        self.field("level")?
            .parse()
            .map_err(|e: String| err(self.path, format!("metadata `level`: {e}")))
    }
}

/// A loaded loss scaler must be usable: a valid rule, a finite positive
/// scale, a growth tracker below the interval.
fn check_scaler(s: &LossScaler) -> std::result::Result<(), String> {
    s.config.validate().map_err(|e| e.to_string())?;
    if !(s.scale > 0.0 && s.scale.is_finite()) {
        return Err(format!("scale {} is not finite and positive", s.scale));
    }
    if let amp_optim::LossScaling::Dynamic {
        growth_interval, ..
    } = s.config
    {
        if s.growth_tracker >= growth_interval {
            return Err(format!(
                "growth tracker {} is not below the interval {growth_interval}",
                s.growth_tracker
            ));
        }
    }
    Ok(())
}

/// The CRC-32 (IEEE) of a checkpoint's tensors: each name's bytes, then
/// its data, in name order (metadata `data_crc32`; files from before it
/// was saved have none and are not checked).
pub(crate) fn data_crc32<'a>(tensors: impl Iterator<Item = (&'a str, &'a [u8])>) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for (name, data) in tensors {
        h.update(name.as_bytes());
        h.update(data);
    }
    h.finalize()
}
