//! Staging a load: everything a load sets ([`Staged`]), read and checked
//! before anything changes; here from one file stored as this run stores
//! it (same sharding, any level), and the parts every staging shares (the
//! layers' delayed-scaling state, the counters).

use super::header::{read_header, zero_tag, Header};
use super::reader::Reader;
use super::{err, ROLES};
use crate::config::Compute;
use crate::context::AmpContext;
use crate::error::Result;
use crate::optimizer::AmpOptimizer;
use amp_core::nn::LayerScaling;
use amp_core::{ScalingMeta, Weight};
use amp_optim::{LossScaler, State};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Everything a load sets, read and checked: one entry per parameter of
/// the optimizer, one per Linear layer.
pub(crate) struct Staged {
    /// What the checkpoint is called in errors.
    pub path: PathBuf,
    /// Each parameter's weight and moments.
    pub weights: Vec<(Weight, State, State)>,
    /// Each parameter's step counter.
    pub steps: Vec<u64>,
    /// Each Linear layer's delayed-scaling state.
    pub layers: Vec<Option<LayerScaling>>,
    /// The optimizer's step counter.
    pub step: u64,
    /// Its skipped steps.
    pub skipped: u64,
    /// The save's id (a sharded save's rank file), for the ranks to check
    /// that they loaded files of one save.
    pub save_id: Option<String>,
    /// The loss scaler.
    pub scaler: LossScaler,
}

/// One file holding everything this rank loads (of this run's
/// sharding, any level).
pub(crate) fn stage_file(
    ctx: &AmpContext,
    path: &Path,
    bytes: &[u8],
    opt: &AmpOptimizer,
) -> Result<Staged> {
    let (st, header) = read_header(path, bytes)?;
    // Saved at another level: values are read whatever their storage and
    // re-encoded in this level's (lossy where this level stores less).
    let convert = header.level != ctx.level();
    if header.zero != zero_tag(opt) {
        return Err(err(
            path,
            format!(
                "saved as ZeRO slice `{}`, this run holds `{}`: load the checkpoint's index \
                 (the path the sharded run saved to), which reshards",
                header.zero,
                zero_tag(opt)
            ),
        ));
    }
    let mut reader = Reader::new(&st, path);
    // Read and check everything first.
    let mut weights = Vec::new();
    for p in opt.inner().params() {
        let w = p.slot.read()?;
        reader.device = w.device().clone();
        weights.push(if convert {
            reader.converted(p, &w)?
        } else {
            reader.exact(p, &w)?
        });
    }
    let layers = read_layers(ctx, &mut reader, &header.layer_meta, convert)?;
    reader.check_all_read()?;
    staged(path, opt, weights, layers, header)
}

/// Each Linear layer's delayed-scaling state from `reader`'s file;
/// with `convert` (another level), state this config has no use for
/// is skipped.
pub(crate) fn read_layers(
    ctx: &AmpContext,
    reader: &mut Reader<'_>,
    layer_meta: &BTreeMap<String, u64>,
    convert: bool,
) -> Result<Vec<Option<LayerScaling>>> {
    let mut layers = Vec::new();
    for layer in ctx.linears() {
        let used_key = format!("{}.__fp8_meta.used", layer.name());
        let Some(&used) = layer_meta.get(&used_key) else {
            layers.push(None);
            continue;
        };
        let recipe = match &ctx.config().compute {
            Compute::Fp8Delayed { recipe } => recipe.clone(),
            // Converting from a config with delayed scaling to one
            // without: the layer state has no use here.
            _ if convert => {
                reader.skip_prefix(&format!("{}.__fp8_meta.", layer.name()));
                layers.push(None);
                continue;
            }
            _ => {
                return Err(err(
                    reader.path,
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
                .ok_or_else(|| err(reader.path, format!("metadata for `{name}` missing")))?;
            let meta = reader.meta(&name, qtype)?.with_updates(updates);
            if meta.amax_history().elem_count() != recipe.amax_history_len {
                return Err(err(
                    reader.path,
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
            <[ScalingMeta; 3]>::try_from(metas).map_err(|_| err(reader.path, "metas"))?;
        layers.push(Some(LayerScaling::from_parts(
            input,
            weight,
            grad_output,
            recipe,
            flags,
        )));
    }
    Ok(layers)
}

/// The staged load of `weights` and `layers` with `header`'s counters;
/// F32 values get their Var's dtype now, so that applying cannot fail
/// half way.
pub(crate) fn staged(
    path: &Path,
    opt: &AmpOptimizer,
    mut weights: Vec<(Weight, State, State)>,
    layers: Vec<Option<LayerScaling>>,
    header: Header,
) -> Result<Staged> {
    let mut steps = Vec::with_capacity(weights.len());
    for (p, (weight, m, v)) in opt.inner().params().iter().zip(&weights) {
        check_values(path, &p.name, weight, m, v)?;
    }
    for (p, (weight, _, _)) in opt.inner().params().iter().zip(&mut weights) {
        steps.push(
            *header
                .param_steps
                .get(&p.name)
                .ok_or_else(|| err(path, format!("metadata: no step for `{}`", p.name)))?,
        );
        if let (Weight::F32(v), Weight::F32(cur)) = (&*weight, &*p.slot.read()?) {
            *weight = Weight::F32(candle_core::Var::from_tensor(
                &v.as_tensor().to_dtype(cur.dtype())?,
            )?);
        }
    }
    Ok(Staged {
        path: path.to_path_buf(),
        weights,
        steps,
        layers,
        step: header.step,
        skipped: header.skipped,
        save_id: header.save_id,
        scaler: header.scaler,
    })
}

/// Fails unless a parameter's values can be trained from: its value (the
/// master where it has one) and first moment finite, its second moment
/// finite and not negative. A file whose checksum matches can still hold
/// such values (written by another tool, or saved from a run that had
/// gone bad); loaded, they would turn the first step into NaN.
fn check_values(path: &Path, name: &str, w: &Weight, m: &State, v: &State) -> Result<()> {
    let finite = |what: String, t: &Tensor| -> Result<()> {
        let amax = amp_core::amax(&t.flatten_all()?.to_dtype(DType::F32)?)?.to_vec1::<f32>()?;
        if amax.iter().all(|a| a.is_finite()) {
            Ok(())
        } else {
            Err(err(
                path,
                format!("`{what}` holds NaN or inf: nothing was loaded"),
            ))
        }
    };
    finite(name.to_string(), &w.master_f32()?)?;
    if let Weight::Fp8 { weight, .. } = w {
        finite(name.to_string(), &weight.dequantize(DType::F32)?)?;
    }
    let state = |s: &State| -> Result<Tensor> { Ok(s.values()?) };
    finite(format!("{name}.__exp_avg"), &state(m)?)?;
    let v = state(v)?;
    finite(format!("{name}.__exp_avg_sq"), &v)?;
    if v.elem_count() > 0 && v.flatten_all()?.min(0)?.to_vec0::<f32>()? < 0.0 {
        return Err(err(
            path,
            format!("`{name}.__exp_avg_sq` holds a negative second moment: nothing was loaded"),
        ));
    }
    Ok(())
}
