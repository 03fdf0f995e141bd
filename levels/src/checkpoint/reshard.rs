//! Loading a checkpoint of another sharding: the files of a ZeRO-sharded
//! save at another world size (or into a run of another level, or not
//! sharded), or a whole checkpoint into a sharded run.
//!
//! Every file is read and checked (its metadata against the first file's
//! and the index's: level, step, per-parameter steps; its ZeRO tag against
//! its rank). For each parameter of this run, every file's piece is decoded
//! to F32 (value, first and second moment: FP16 masters and E4M3/FP16
//! moments each with their own scales): the slices of a sharded parameter
//! are concatenated in range order ([`amp_comm::shard_range`]), a
//! replicated one is taken from rank 0's file. This run keeps its own range
//! of it (a sharded run) or the whole tensor, re-encoded in its storage
//! with fresh scales: the one loss is that re-encoding. A parameter that
//! neither run shards, at the same level, is read as stored, bit-exact.
//! Each delayed-scaling state is rank 0's (each rank's histories saw its
//! own inputs).

use super::header::{read_header, Header};
use super::index::Index;
use super::reader::{encode, Reader};
use super::stage::{read_layers, staged, Staged};
use super::{err, Part};
use crate::context::AmpContext;
use crate::distributed;
use crate::error::Result;
use crate::optimizer::AmpOptimizer;
use amp_comm::shard_range;
use candle_core::{Shape, Tensor};
use std::path::Path;

/// Reads and checks `parts` (the files of the checkpoint `path`, in
/// rank order, listed by `index` when there is one) and stages what
/// this rank holds of them; changes nothing.
pub(crate) fn stage_assembled(
    ctx: &AmpContext,
    path: &Path,
    parts: &[Part],
    index: Option<&Index>,
    opt: &AmpOptimizer,
) -> Result<Staged> {
    let mut files = Vec::with_capacity(parts.len());
    for part in parts {
        let (st, header) = read_header(&part.path, &part.bytes)?;
        check_part(part, &header, files.first().map(|(_, h)| h), index)?;
        files.push((st, header));
    }
    let first = files
        .first()
        .map(|(_, h)| h.clone())
        .ok_or_else(|| err(path, "no files"))?;
    let convert = first.level != ctx.level();
    let mut readers: Vec<Reader<'_>> = files
        .iter()
        .zip(parts)
        .map(|((st, _), part)| Reader::new(st, &part.path))
        .collect();
    let shards = distributed::shards(opt);
    let mut weights = Vec::new();
    for p in opt.inner().params() {
        let w = p.slot.read()?;
        let shard = shards.iter().find(|s| s.name == p.name);
        let shape = shard.map_or_else(|| w.shape().clone(), |s| s.shape.clone());
        let slices = files
            .iter()
            .filter(|(_, h)| h.slices.contains_key(&p.name))
            .count();
        if slices == 0 && shard.is_none() && !convert {
            // stored as this run stores it: rank 0's, as it is
            let mut stored = Vec::new();
            for r in readers.iter_mut() {
                r.device = w.device().clone();
                stored.push(r.exact(p, &w)?);
            }
            weights.extend(stored.into_iter().next());
            continue;
        }
        let mut pieces = Vec::new();
        for ((reader, (_, header)), part) in readers.iter_mut().zip(&files).zip(parts) {
            reader.device = w.device().clone();
            let stored = match header.slices.get(&p.name) {
                Some(s) => {
                    let want = shard_range(shape.elem_count(), part.rank, part.world);
                    if s.shape != shape.dims() || (s.start..s.end) != want {
                        return Err(err(
                            &part.path,
                            format!(
                                "`{}`: slice {}..{} of a {:?} weight, this model's rank {} of {} holds {want:?} of {:?}",
                                p.name, s.start, s.end, s.shape, part.rank, part.world, shape.dims()
                            ),
                        ));
                    }
                    Shape::from(want.len())
                }
                None => shape.clone(),
            };
            pieces.push(reader.values(&p.name, &stored)?);
        }
        let mut whole = if slices == 0 {
            pieces.swap_remove(0)
        } else if slices == parts.len() {
            let mut out = Vec::with_capacity(3);
            for i in 0..3 {
                let all: Vec<&Tensor> = pieces.iter().map(|x| &x[i]).collect();
                out.push(Tensor::cat(&all, 0)?.reshape(&shape)?);
            }
            <[Tensor; 3]>::try_from(out).map_err(|_| err(path, "three values"))?
        } else {
            return Err(err(
                path,
                format!(
                    "`{}` is a slice in some rank files, whole in others",
                    p.name
                ),
            ));
        };
        if let Some(s) = shard {
            for t in &mut whole {
                *t = t.flatten_all()?.narrow(0, s.range.start, s.range.len())?;
            }
        }
        weights.push(encode(p, &w, whole)?);
    }
    let mut layers = None;
    for ((reader, (_, header)), part) in readers.iter_mut().zip(&files).zip(parts) {
        let state = read_layers(ctx, reader, &header.layer_meta, convert)?;
        layers.get_or_insert(state);
        reader.check_all_read()?;
        if header.param_steps != first.param_steps {
            return Err(err(
                &part.path,
                "per-parameter steps differ from rank 0's file: files of different saves",
            ));
        }
    }
    staged(path, opt, weights, layers.unwrap_or_default(), first)
}

/// Checks one file's metadata against its rank, the first file's and the
/// index's.
fn check_part(
    part: &Part,
    header: &Header,
    first: Option<&Header>,
    index: Option<&Index>,
) -> Result<()> {
    let tag = if part.world > 1 {
        format!("{}/{}", part.rank, part.world)
    } else {
        "none".to_string()
    };
    if header.zero != tag {
        let reason = if index.is_none() {
            format!(
                "rank file `{}` of a sharded checkpoint: load its index (the path the run saved to)",
                header.zero
            )
        } else {
            format!(
                "saved as ZeRO slice `{}`, expected `{tag}`: a file of another save",
                header.zero
            )
        };
        return Err(err(&part.path, reason));
    }
    let expected = first
        .map(|h| (h.level, h.step, "rank 0's file"))
        .or(index.map(|i| (i.level, i.step, "the index")));
    if let Some((level, step, whose)) = expected {
        if (header.level, header.step) != (level, step) {
            return Err(err(
                &part.path,
                format!(
                    "saved at step {} ({}), but {whose} at step {step} ({level}): a file of another save",
                    header.step, header.level
                ),
            ));
        }
    }
    Ok(())
}
