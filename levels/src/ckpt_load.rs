//! Loading a checkpoint: read and check everything, then apply; a
//! checkpoint of another level is converted.

use crate::checkpoint::{err, FORMAT, ROLES, VERSION};
use crate::ckpt_reader::Reader;
use crate::context::{AmpContext, AmpOptimizer};
use crate::error::Result;
use amp_core::nn::LayerScaling;
use amp_core::{ScalingMeta, Weight};
use amp_optim::LossScaler;
use candle_core::Device;
use safetensors::tensor::SafeTensors;
use std::collections::BTreeMap;
use std::path::Path;

impl AmpContext {
    /// Loads a checkpoint saved at the same level into this (initialized)
    /// model and optimizer. Everything is validated first (header, every
    /// tensor's presence, dtype and shape, no extra tensor, the level); on
    /// any error nothing changes.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming what is wrong.
    pub fn load(&self, path: impl AsRef<Path>, opt: &mut AmpOptimizer) -> Result<()> {
        if opt.shards.is_empty() {
            return self.load_file(path.as_ref(), opt);
        }
        // ZeRO: this rank's slice file, then the FP8 copies gathered again
        let (rank, world) = opt.rank_and_world();
        let file = crate::shard_path(path, rank, world);
        let loaded = if file.exists() {
            self.load_file(&file, opt)
        } else {
            Err(err(
                &file,
                format!(
                    "no such file: a ZeRO-sharded run resumes from the files of its {world} ranks, \
                     saved at the same world size"
                ),
            ))
        };
        if let (Err(_), Some(comm)) = (&loaded, &opt.comm) {
            // the others are about to gather: fail the group, do not leave them waiting
            comm.0.barrier().ok();
        }
        loaded?;
        if let Some(comm) = &opt.comm {
            crate::zero::gather(comm.0.as_ref(), &opt.opt, &opt.shards)?;
        }
        Ok(())
    }

    fn load_file(&self, path: &Path, opt: &mut AmpOptimizer) -> Result<()> {
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
        let zero = meta.get("zero").map_or("none", String::as_str);
        if zero != crate::zero::tag(opt) {
            return Err(err(
                path,
                format!(
                    "saved with ZeRO slices `{zero}`, this run holds `{}`: resume at the world size it was saved at",
                    crate::zero::tag(opt)
                ),
            ));
        }
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
                    Weight::Fp8Gathered(_) => return Err(crate::zero::not_a_param("load")),
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
