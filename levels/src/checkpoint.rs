//! Checkpoints in safetensors: every weight, master weight, moment and
//! scaling meta (scale, scale_inv, amax history), the layers' delayed-scaling
//! state, the loss scaler, the step counter and the config. FP8 tensors are
//! stored as `F8_E4M3` / `F8_E5M2`. Writes are atomic; loads validate every
//! tensor before anything changes.
//!
//! Names: a parameter `p` is stored as `p` (its working storage), `p.__master`
//! (O3), `p.__exp_avg`, `p.__exp_avg_sq`; a scaled tensor `t` adds
//! `t.__scale`, `t.__scale_inv`, `t.__amax_history`; a layer's delayed-scaling
//! metas are `w.__fp8_meta.{input,weight,grad_output}` with the same
//! suffixes.
//!
//! A ZeRO-sharded O3 run writes one file per rank (its slice of each
//! Linear weight's master and moments, flat, named in the metadata
//! `zero_slices` with its range and the whole shape; every replicated
//! tensor in full) and an index at the path itself (`crate::ckpt_index`).
//! Loading at the saved world size reads each rank's own file, bit-exact;
//! at another world size or level the loader decodes every rank's slices,
//! concatenates them in range order and re-encodes this run's part
//! (`crate::ckpt_reshard`).

use crate::context::{AmpContext, AmpOptimizer};
use crate::error::{Error, Result};
use amp_core::{QType, ScalingMeta, ScalingTensor, Weight};
use amp_optim::State;
use candle_core::{DType, Tensor};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

pub(crate) const FORMAT: &str = "candle-amp-checkpoint";
pub(crate) const VERSION: &str = "1";
pub(crate) const ROLES: [&str; 3] = ["input", "weight", "grad_output"];

pub(crate) fn err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// Raw little-endian bytes, dtype and shape of one stored tensor.
type Raw = (Vec<u8>, Dtype, Vec<usize>);

fn raw(t: &Tensor, qtype: Option<QType>) -> Result<Raw> {
    let t = t.flatten_all()?;
    let (bytes, dtype) = match (t.dtype(), qtype) {
        (DType::U8, Some(QType::E4M3)) => (t.to_vec1::<u8>()?, Dtype::F8_E4M3),
        (DType::U8, Some(QType::E5M2)) => (t.to_vec1::<u8>()?, Dtype::F8_E5M2),
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
    }
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
    Ok(())
}

impl AmpContext {
    /// Saves the model's parameters and the optimizer's whole state.
    ///
    /// In a data-parallel group every rank calls it: the replicas are
    /// identical, so rank 0 writes `path` and the others write nothing.
    /// At O3 with ZeRO each rank writes its own slice to
    /// [`shard_path`](crate::shard_path)`(path, rank, world)`, and once all
    /// are written rank 0 writes a small index at `path` itself: the world
    /// size, the step and each rank file's name, size and CRC-32
    /// ([`load`](Self::load) reads it back at any world size and level).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] on I/O errors, on every rank of a sharded run
    /// when any rank's write fails (the index is then not written).
    pub fn save(&self, path: impl AsRef<Path>, opt: &AmpOptimizer) -> Result<()> {
        if !opt.shards.is_empty() {
            return crate::ckpt_index::save_sharded(self, path.as_ref(), opt);
        }
        if opt.rank_and_world().0 != 0 {
            return Ok(());
        }
        self.save_inner(path.as_ref(), opt, false)
    }

    pub(crate) fn save_inner(
        &self,
        path: &Path,
        opt: &AmpOptimizer,
        fail_before_rename: bool,
    ) -> Result<()> {
        write_atomic(path, &self.checkpoint_bytes(path, opt)?, fail_before_rename)
    }

    /// The checkpoint file's bytes (`path` names it in errors).
    pub(crate) fn checkpoint_bytes(&self, path: &Path, opt: &AmpOptimizer) -> Result<Vec<u8>> {
        let mut out = BTreeMap::new();
        for p in opt.inner().params() {
            match &*p.slot.read()? {
                Weight::Fp8Gathered(_) => return Err(crate::zero::not_a_param("save")),
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
        for layer in self.linears() {
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
            ("level".to_string(), self.level().to_string()),
            ("step".to_string(), opt.inner().step_count().to_string()),
            ("config".to_string(), json(self.config())?),
            ("adam".to_string(), json(&opt.inner().config().adam)?),
            ("scaler".to_string(), json(opt.inner().scaler())?),
            ("layer_meta".to_string(), json(&layer_meta)?),
            ("zero".to_string(), crate::zero::tag(opt)),
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
        if !opt.shards.is_empty() {
            // which tensors are slices, and where they lie (resharding)
            metadata.insert(
                "zero_slices".to_string(),
                json(&crate::zero::slices(&opt.shards))?,
            );
        }
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
