//! Saving a checkpoint: the bytes of one file (a whole checkpoint, or one
//! rank's file of a ZeRO-sharded run), written by rank 0 alone for a whole
//! checkpoint, or by every rank, with the index last, for a sharded one.

use super::agree::{agree, exchange};
use super::header::data_crc32;
use super::header::{slices, zero_tag};
use super::index::{generation_path, remove_superseded, FileEntry, Index};
use super::{err, not_a_param, root_name, write_atomic, FORMAT, ROLES, VERSION};
use crate::context::AmpContext;
use crate::distributed::{self, Group};
use crate::error::Result;
use crate::optimizer::AmpOptimizer;
use amp_core::{QType, ScalingMeta, ScalingTensor, Weight};
use amp_optim::State;
use candle_core::{DType, Tensor};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Saves the model's parameters and the optimizer's whole state at `path`
/// ([`AmpContext::save`]): at O3 with ZeRO every rank its file and rank 0
/// the index; otherwise rank 0 the whole checkpoint.
///
/// # Errors
/// [`crate::error::Error::Checkpoint`] on I/O errors, on every rank of a
/// sharded run when any rank's write fails.
pub(crate) fn save(ctx: &AmpContext, path: &Path, opt: &AmpOptimizer) -> Result<()> {
    if opt.inner().has_pending() {
        // its counters may still count a skipped step as applied
        return Err(err(
            path,
            "the last step's outcome is still on the device: call \
             `AmpOptimizer::resolve` before saving",
        ));
    }
    if let Some(group) = distributed::group(opt).filter(|g| !g.shards().is_empty()) {
        return save_sharded(ctx, path, opt, group);
    }
    if opt.rank_and_world().0 != 0 {
        return Ok(());
    }
    save_whole(ctx, path, opt, false)
}

/// Writes the whole checkpoint at `path`; `fail_before_rename` simulates a
/// crash before the rename (tests).
pub(crate) fn save_whole(
    ctx: &AmpContext,
    path: &Path,
    opt: &AmpOptimizer,
    fail_before_rename: bool,
) -> Result<()> {
    write_atomic(path, &file_bytes(ctx, path, opt, None)?, fail_before_rename)
}

/// The checkpoint file's bytes (`path` names it in errors); a rank file of
/// a sharded save carries the save's id (metadata `save_id`).
fn file_bytes(
    ctx: &AmpContext,
    path: &Path,
    opt: &AmpOptimizer,
    save_id: Option<&str>,
) -> Result<Vec<u8>> {
    let mut out = BTreeMap::new();
    for p in opt.inner().params() {
        match &*p.slot.read()? {
            Weight::Fp8Gathered(_) => return Err(not_a_param("save")),
            Weight::F32(v) => put(&mut out, p.name.clone(), v.as_tensor(), None)?,
            Weight::F16(t) => put_scaled(&mut out, &p.name, t)?,
            Weight::Fp8 { weight, master } => {
                put_scaled(&mut out, &p.name, weight)?;
                put_scaled(&mut out, &format!("{}.__master", p.name), master)?;
            }
        }
        put_state(&mut out, &format!("{}.__exp_avg", p.name), &p.exp_avg)?;
        put_state(&mut out, &format!("{}.__exp_avg_sq", p.name), &p.exp_avg_sq)?;
    }
    let mut layer_meta = BTreeMap::new();
    for layer in ctx.linears() {
        if let Some(s) = layer.scaling_state()? {
            for (role, m) in ROLES.iter().zip([&s.input, &s.weight, &s.grad_output]) {
                let name = format!("{}.__fp8_meta.{role}", layer.name());
                put_meta(&mut out, &name, m)?;
                layer_meta.insert(name, m.updates());
            }
            layer_meta.insert(
                format!("{}.__fp8_meta.used", layer.name()),
                u64::from(s.used().iter().fold(0u8, |a, &u| a * 2 + u8::from(u))),
            );
        }
    }
    let json = |v: &dyn erased::Json| v.json().map_err(|e| err(path, e));
    let mut metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("version".to_string(), VERSION.to_string()),
        ("level".to_string(), ctx.level().to_string()),
        ("step".to_string(), opt.inner().step_count().to_string()),
        (
            "skipped".to_string(),
            opt.inner().skipped_count().to_string(),
        ),
        ("config".to_string(), json(ctx.config())?),
        ("adam".to_string(), json(&opt.inner().config().adam)?),
        ("scaler".to_string(), json(opt.inner().scaler())?),
        ("layer_meta".to_string(), json(&layer_meta)?),
        ("zero".to_string(), zero_tag(opt)),
        (
            "param_steps".to_string(),
            json(
                &opt.inner()
                    .params()
                    .iter()
                    .map(|p| (p.name.clone(), p.step))
                    .collect::<BTreeMap<_, _>>(),
            )?,
        ),
    ]);
    if let Some(id) = save_id {
        metadata.insert("save_id".to_string(), id.to_string());
    }
    if !distributed::shards(opt).is_empty() {
        // which tensors are slices, and where they lie (resharding)
        metadata.insert("zero_slices".to_string(), json(&slices(opt))?);
    }
    // a flipped byte anywhere in the tensors is a load error
    let crc = data_crc32(
        out.iter()
            .map(|(k, (bytes, _, _))| (k.as_str(), bytes.as_slice())),
    );
    metadata.insert("data_crc32".to_string(), crc.to_string());
    let views = out
        .iter()
        .map(|(k, (bytes, dtype, shape))| {
            Ok((
                k.clone(),
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map_err(|e| err(path, e.to_string()))?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::tensor::serialize(views, Some(metadata)).map_err(|e| err(path, e.to_string()))
}

/// The collective save of a sharded run: each rank writes its file under
/// this save's names, the ranks exchange sizes and checksums, rank 0
/// writes the index (atomically), then removes the replaced save's files.
///
/// # Errors
/// [`crate::error::Error::Checkpoint`] on every rank when any rank's file or the
/// index could not be written.
fn save_sharded(ctx: &AmpContext, path: &Path, opt: &AmpOptimizer, group: &Group) -> Result<()> {
    let comm = group.comm();
    let (rank, world) = (comm.rank(), comm.world_size());
    // One id for this save on every rank (rank 0's), so that a load can
    // tell rank files of two saves apart even without the index.
    let id = exchange(comm, &new_save_id().to_le_bytes())?
        .first()
        .and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| err(path, "rank 0 sent no save id"))?;
    let id = format!("{id:016x}");
    // This save's own names: the checkpoint it replaces stays whole until
    // the new index is in place.
    let name = |r: usize| -> Result<String> {
        let file = generation_path(path, r, world, &id);
        file.file_name()
            .and_then(|n| n.to_str())
            .map(String::from)
            .ok_or_else(|| err(&file, "not a UTF-8 file name"))
    };
    let written = name(rank).and_then(|file| {
        let target = path.with_file_name(&file);
        let bytes = file_bytes(ctx, &target, opt, Some(&id))?;
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
    })?;
    // The new checkpoint is complete: the replaced one's files may go.
    if rank == 0 {
        remove_superseded(path, &index);
    }
    Ok(())
}

/// Raw little-endian bytes, dtype and shape of one stored tensor.
pub(crate) type Raw = (Vec<u8>, Dtype, Vec<usize>);

/// The little-endian bytes of `t` as safetensors stores them: FP8 codes
/// (U8 with `qtype`), F16 and BF16 as they are, anything else as F32.
pub(crate) fn raw(t: &Tensor, qtype: Option<QType>) -> Result<Raw> {
    let t = t.flatten_all()?;
    let (bytes, dtype) = match (t.dtype(), qtype) {
        (DType::U8, Some(QType::E4M3)) => (t.to_vec1::<u8>()?, Dtype::F8_E4M3),
        (DType::U8, Some(QType::E5M2)) => (t.to_vec1::<u8>()?, Dtype::F8_E5M2),
        (DType::BF16, _) => (
            t.to_vec1::<half::bf16>()?
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect(),
            Dtype::BF16,
        ),
        (DType::F16, _) => (
            t.to_vec1::<half::f16>()?
                .iter()
                .flat_map(|v| v.to_bits().to_le_bytes())
                .collect(),
            Dtype::F16,
        ),
        _ => (
            t.to_dtype(DType::F32)?
                .to_vec1::<f32>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
            Dtype::F32,
        ),
    };
    Ok((bytes, dtype, Vec::new()))
}

fn put(
    out: &mut BTreeMap<String, Raw>,
    name: String,
    t: &Tensor,
    qtype: Option<QType>,
) -> Result<()> {
    let (bytes, dtype, _) = raw(t, qtype)?;
    out.insert(name, (bytes, dtype, t.dims().to_vec()));
    Ok(())
}

fn put_meta(out: &mut BTreeMap<String, Raw>, name: &str, m: &ScalingMeta) -> Result<()> {
    put(out, format!("{name}.__scale"), m.scale(), None)?;
    put(out, format!("{name}.__scale_inv"), m.scale_inv(), None)?;
    put(
        out,
        format!("{name}.__amax_history"),
        m.amax_history(),
        None,
    )
}

fn put_scaled(out: &mut BTreeMap<String, Raw>, name: &str, t: &ScalingTensor) -> Result<()> {
    put(out, name.to_string(), t.data(), Some(t.qtype()))?;
    put_meta(out, name, t.meta())
}

fn put_state(out: &mut BTreeMap<String, Raw>, name: &str, s: &State) -> Result<()> {
    match s {
        State::F32(t) => put(out, name.to_string(), t, None),
        State::Scaled(t) => put_scaled(out, name, t),
        State::Sqrt(t) => put_scaled(out, &root_name(name), t),
    }
}

/// JSON for the metadata values.
mod erased {
    pub(super) trait Json {
        fn json(&self) -> Result<String, String>;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> Result<String, String> {
            serde_json::to_string(self).map_err(|e| e.to_string())
        }
    }
}

/// A fresh save id: the clock, the process and a per-process random key
/// hashed together (no two saves share one in practice).
fn new_save_id() -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    std::time::SystemTime::now().hash(&mut h);
    std::process::id().hash(&mut h);
    h.finish()
}
