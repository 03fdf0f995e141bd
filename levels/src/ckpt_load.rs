//! Loading a checkpoint: every rank reads and checks everything, the ranks
//! agree, then each applies; a checkpoint of another level is converted,
//! one of another world size resharded (`crate::ckpt_reshard`).

use crate::checkpoint::{err, ROLES};
use crate::ckpt_header::{read_header, Header};
use crate::ckpt_index::{agree, Index};
use crate::ckpt_reader::Reader;
use crate::context::{AmpContext, AmpOptimizer};
use crate::error::Result;
use amp_core::nn::LayerScaling;
use amp_core::{ScalingMeta, Weight};
use amp_optim::{LossScaler, State};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Everything a load sets, read and checked: one entry per parameter of
/// the optimizer, one per Linear layer.
pub(crate) struct Staged {
    /// What the checkpoint is called in errors.
    path: PathBuf,
    /// Each parameter's weight and moments.
    weights: Vec<(Weight, State, State)>,
    /// Each parameter's step counter.
    steps: Vec<u64>,
    /// Each Linear layer's delayed-scaling state.
    layers: Vec<Option<LayerScaling>>,
    step: u64,
    scaler: LossScaler,
}

impl AmpContext {
    /// Loads a checkpoint into this (initialized) model and optimizer.
    /// Everything is validated first (header, every tensor's presence,
    /// dtype and shape, no extra tensor, the level); on any error nothing
    /// changes.
    ///
    /// A checkpoint of the same level and world size resumes bit-exactly;
    /// one of another level is converted (re-encoded in this level's
    /// storage). A ZeRO-sharded checkpoint (the index at `path` and its
    /// rank files beside it) loads at any world size and level: each rank
    /// reads every rank file (checked against the index's sizes and
    /// CRC-32s), decodes the saved slices to F32, concatenates them in
    /// range order and takes what it holds (its own range when this run is
    /// sharded, the whole tensor otherwise), re-encoded in this run's
    /// storage with fresh scales: lossy only by that re-encoding. The
    /// replicated parameters are read as stored where this run stores them
    /// alike. A sharded run also loads a whole checkpoint this way.
    ///
    /// In a data-parallel group every rank calls it, and they agree before
    /// anything changes: a file that one rank cannot read fails every rank.
    ///
    /// # Errors
    /// [`Error::Checkpoint`](crate::Error::Checkpoint) naming the file and
    /// what is wrong, on every rank of a group.
    pub fn load(&self, path: impl AsRef<Path>, opt: &mut AmpOptimizer) -> Result<()> {
        let path = path.as_ref();
        let staged = self.stage(path, opt);
        let staged = match &opt.comm {
            Some(comm) => agree(comm.0.as_ref(), path, staged, |r| {
                format!("rank {r} could not load it, so nothing changed here")
            })?,
            None => staged?,
        };
        self.apply(opt, staged)?;
        if let (false, Some(comm)) = (opt.shards.is_empty(), &opt.comm) {
            // the FP8 copies, gathered from the loaded master slices
            crate::zero::gather(comm.0.as_ref(), &opt.opt, &opt.shards)?;
        }
        Ok(())
    }

    /// Reads and checks what `path` holds for this rank; changes nothing.
    fn stage(&self, path: &Path, opt: &AmpOptimizer) -> Result<Staged> {
        let (rank, world) = opt.rank_and_world();
        let sharded = !opt.shards.is_empty();
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if sharded && e.kind() == std::io::ErrorKind::NotFound => {
                // saved without an index (before there was one): this
                // rank's own file, at the same world size only
                let own = crate::shard_path(path, rank, world);
                return match std::fs::read(&own) {
                    Ok(bytes) => self.stage_file(&own, &bytes, opt),
                    Err(_) => Err(err(
                        path,
                        format!(
                            "{e}: neither a checkpoint nor the index of a sharded one \
                             (nor rank {rank}'s file of a {world}-rank save without an index)"
                        ),
                    )),
                };
            }
            Err(e) => return Err(err(path, e.to_string())),
        };
        match Index::parse(path, &bytes)? {
            // the saved world size: this rank's own file, bit-exact
            Some(index) if sharded && index.world == world => {
                let part = index.read_file(path, rank)?;
                self.stage_file(&part.path, &part.bytes, opt)
            }
            Some(index) => {
                let parts = (0..index.world)
                    .map(|r| index.read_file(path, r))
                    .collect::<Result<Vec<_>>>()?;
                self.stage_assembled(path, &parts, Some(&index), opt)
            }
            None if sharded => {
                let whole = crate::ckpt_reshard::Part {
                    path: path.to_path_buf(),
                    bytes,
                    rank: 0,
                    world: 1,
                };
                self.stage_assembled(path, &[whole], None, opt)
            }
            None => self.stage_file(path, &bytes, opt),
        }
    }

    /// One file holding everything this rank loads (of this run's
    /// sharding, any level).
    fn stage_file(&self, path: &Path, bytes: &[u8], opt: &AmpOptimizer) -> Result<Staged> {
        let (st, header) = read_header(path, bytes)?;
        // Saved at another level: values are read whatever their storage and
        // re-encoded in this level's (lossy where this level stores less).
        let convert = header.level != self.level();
        if header.zero != crate::zero::tag(opt) {
            return Err(err(
                path,
                format!(
                    "saved as ZeRO slice `{}`, this run holds `{}`: load the checkpoint's index \
                     (the path the sharded run saved to), which reshards",
                    header.zero,
                    crate::zero::tag(opt)
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
        let layers = self.read_layers(&mut reader, &header.layer_meta, convert)?;
        reader.check_all_read()?;
        self.staged(path, opt, weights, layers, header)
    }

    /// Each Linear layer's delayed-scaling state from `reader`'s file;
    /// with `convert` (another level), state this config has no use for
    /// is skipped.
    pub(crate) fn read_layers(
        &self,
        reader: &mut Reader<'_>,
        layer_meta: &BTreeMap<String, u64>,
        convert: bool,
    ) -> Result<Vec<Option<LayerScaling>>> {
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
        &self,
        path: &Path,
        opt: &AmpOptimizer,
        mut weights: Vec<(Weight, State, State)>,
        layers: Vec<Option<LayerScaling>>,
        header: Header,
    ) -> Result<Staged> {
        let mut steps = Vec::with_capacity(weights.len());
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
            scaler: header.scaler,
        })
    }

    /// Sets everything staged.
    fn apply(&self, opt: &mut AmpOptimizer, staged: Staged) -> Result<()> {
        let path = &staged.path;
        for ((p, (weight, m, v)), step) in opt
            .inner_mut()
            .params_mut()
            .iter_mut()
            .zip(staged.weights)
            .zip(staged.steps)
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
        for (layer, state) in self.linears().iter().zip(staged.layers) {
            layer.set_scaling_state(state)?;
        }
        opt.inner_mut().restore_counters(staged.step, staged.scaler);
        Ok(())
    }
}
