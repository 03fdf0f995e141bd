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

use crate::context::{AmpContext, AmpOptimizer};
use crate::error::{Error, Result};
use amp_core::nn::LayerScaling;
use amp_core::{QType, ScalingMeta, ScalingTensor, Weight};
use amp_optim::{LossScaler, State};
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use crate::ckpt_reader::Reader;

const FORMAT: &str = "candle-amp-checkpoint";
const VERSION: &str = "1";
const ROLES: [&str; 3] = ["input", "weight", "grad_output"];

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
    /// # Errors
    /// [`Error::Checkpoint`] on I/O errors.
    pub fn save(&self, path: impl AsRef<Path>, opt: &AmpOptimizer) -> Result<()> {
        self.save_inner(path.as_ref(), opt, false)
    }

    pub(crate) fn save_inner(
        &self,
        path: &Path,
        opt: &AmpOptimizer,
        fail_before_rename: bool,
    ) -> Result<()> {
        let mut out = BTreeMap::new();
        for p in opt.inner().params() {
            match &*p.slot.read()? {
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
        let metadata = HashMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("version".to_string(), VERSION.to_string()),
            ("level".to_string(), self.level().to_string()),
            ("step".to_string(), opt.inner().step_count().to_string()),
            ("config".to_string(), json(self.config())?),
            ("adam".to_string(), json(&opt.inner().config().adam)?),
            ("scaler".to_string(), json(opt.inner().scaler())?),
            ("layer_meta".to_string(), json(&layer_meta)?),
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
        let bytes = safetensors::tensor::serialize(views, Some(metadata))
            .map_err(|e| err(path, e.to_string()))?;
        write_atomic(path, &bytes, fail_before_rename)
    }

    /// Loads a checkpoint saved at the same level into this (initialized)
    /// model and optimizer. Everything is validated first (header, every
    /// tensor's presence, dtype and shape, no extra tensor, the level); on
    /// any error nothing changes.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming what is wrong.
    pub fn load(&self, path: impl AsRef<Path>, opt: &mut AmpOptimizer) -> Result<()> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| err(path, e.to_string()))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| err(path, format!("not a readable safetensors file: {e}")))?;
        let (_, header) =
            SafeTensors::read_metadata(&bytes).map_err(|e| err(path, e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let field = |k: &str| {
            meta.get(k)
                .ok_or_else(|| err(path, format!("metadata `{k}` missing")))
        };
        if field("format")? != FORMAT {
            return Err(err(path, "not a candle-amp checkpoint"));
        }
        // Saved at another level: values are read whatever their storage and
        // re-encoded in this level's (lossy where this level stores less).
        if field("version")? != VERSION {
            return Err(err(
                path,
                format!(
                    "format version {}, this build reads {VERSION}",
                    field("version")?
                ),
            ));
        }
        let saved_level: crate::Level = field("level")?
            .parse()
            .map_err(|e: String| err(path, format!("metadata `level`: {e}")))?;
        let convert = saved_level != self.level();
        // Counters far beyond any run are corrupt (and would overflow).
        const MAX_COUNT: u64 = 1 << 53;
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
        let scaler: LossScaler = serde_json::from_str(field("scaler")?)
            .map_err(|e| err(path, format!("metadata `scaler`: {e}")))?;
        check_scaler(&scaler)
            .map_err(|reason| err(path, format!("metadata `scaler`: {reason}")))?;
        let param_steps: BTreeMap<String, u64> = serde_json::from_str(field("param_steps")?)
            .map_err(|e| err(path, format!("metadata `param_steps`: {e}")))?;
        let layer_meta: BTreeMap<String, u64> = serde_json::from_str(field("layer_meta")?)
            .map_err(|e| err(path, format!("metadata `layer_meta`: {e}")))?;
        for (k, v) in param_steps.iter().chain(&layer_meta) {
            count(k, *v)?;
        }
        let mut reader = Reader {
            st: &st,
            path,
            seen: Vec::new(),
            device: Device::Cpu,
        };
        // Read and check everything first.
        let mut staged = Vec::new();
        for p in opt.inner().params() {
            let w = p.slot.read()?;
            reader.device = w.device().clone();
            let (weight, m, v) = if convert {
                reader.converted(p, &w)?
            } else {
                let weight = match &*w {
                    Weight::F32(v) => Weight::F32(candle_core::Var::from_tensor(
                        &reader.plain(&p.name, v.shape())?,
                    )?),
                    Weight::F16(t) => Weight::F16(reader.scaled(&p.name, t)?),
                    Weight::Fp8 { weight, master } => Weight::Fp8 {
                        weight: reader.scaled(&p.name, weight)?,
                        master: reader.scaled(&format!("{}.__master", p.name), master)?,
                    },
                };
                let m = reader.state(&format!("{}.__exp_avg", p.name), &p.exp_avg)?;
                let v = reader.state(&format!("{}.__exp_avg_sq", p.name), &p.exp_avg_sq)?;
                (weight, m, v)
            };
            staged.push((weight, m, v));
        }
        let mut layers = Vec::new();
        for layer in self.linears() {
            let used_key = format!("{}.__fp8_meta.used", layer.name());
            let Some(&used) = layer_meta.get(&used_key) else {
                layers.push(None);
                continue;
            };
            let recipe = match &self.config().compute {
                crate::Compute::Fp8Delayed { recipe } => recipe.clone(),
                // Converting from a config with delayed scaling to one
                // without: the layer state has no use here.
                _ if convert => {
                    reader.skip_prefix(&format!("{}.__fp8_meta.", layer.name()));
                    layers.push(None);
                    continue;
                }
                _ => {
                    return Err(err(
                        path,
                        format!(
                            "`{}` has delayed-scaling state but the config does not use it",
                            layer.name()
                        ),
                    ))
                }
            };
            let mut metas = Vec::new();
            for (i, role) in ROLES.iter().enumerate() {
                let name = format!("{}.__fp8_meta.{role}", layer.name());
                let qtype = if i == 2 {
                    recipe.fp8_format.backward().into()
                } else {
                    recipe.fp8_format.forward().into()
                };
                let updates = *layer_meta
                    .get(&name)
                    .ok_or_else(|| err(path, format!("metadata for `{name}` missing")))?;
                let meta = reader.meta(&name, qtype)?.with_updates(updates);
                if meta.amax_history().elem_count() != recipe.amax_history_len {
                    return Err(err(
                        path,
                        format!(
                            "`{name}`: amax history of {}, the recipe's is {}",
                            meta.amax_history().elem_count(),
                            recipe.amax_history_len
                        ),
                    ));
                }
                metas.push(meta);
            }
            let flags = [used & 4 != 0, used & 2 != 0, used & 1 != 0];
            let [input, weight, grad_output] =
                <[ScalingMeta; 3]>::try_from(metas).map_err(|_| err(path, "metas"))?;
            layers.push(Some(LayerScaling::from_parts(
                input,
                weight,
                grad_output,
                recipe,
                flags,
            )));
        }
        let mut extra: Vec<&str> = st
            .names()
            .into_iter()
            .filter(|n| !reader.seen.iter().any(|s| s == n))
            .collect();
        extra.sort_unstable();
        if let Some(first) = extra.first() {
            return Err(err(
                path,
                format!("{} unexpected tensor(s), e.g. `{first}`", extra.len()),
            ));
        }
        let mut steps = Vec::with_capacity(staged.len());
        for (p, (weight, _, _)) in opt.inner().params().iter().zip(&mut staged) {
            steps.push(
                *param_steps
                    .get(&p.name)
                    .ok_or_else(|| err(path, format!("metadata: no step for `{}`", p.name)))?,
            );
            // Give an F32 value the Var's own dtype now, so that applying
            // cannot fail half way.
            if let (Weight::F32(v), Weight::F32(cur)) = (&*weight, &*p.slot.read()?) {
                *weight = Weight::F32(candle_core::Var::from_tensor(
                    &v.as_tensor().to_dtype(cur.dtype())?,
                )?);
            }
        }
        // All checked: apply.
        for ((p, (weight, m, v)), step) in opt
            .inner_mut()
            .params_mut()
            .iter_mut()
            .zip(staged)
            .zip(steps)
        {
            match weight {
                Weight::F32(var) => match &*p.slot.read()? {
                    Weight::F32(cur) => cur.set(var.as_tensor())?,
                    _ => return Err(err(path, "storage changed while loading")),
                },
                other => p.slot.replace(other)?,
            }
            p.exp_avg = m;
            p.exp_avg_sq = v;
            p.step = step;
        }
        for (layer, state) in self.linears().iter().zip(layers) {
            layer.set_scaling_state(state)?;
        }
        opt.inner_mut().restore_counters(step, scaler);
        Ok(())
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
