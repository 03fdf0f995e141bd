//! Loading a checkpoint: every rank reads and checks everything (which
//! files depends on what `path` holds and on this run's sharding), the
//! ranks agree, then each applies; a checkpoint of another level is
//! converted, one of another sharding resharded ([`super::reshard`]).

use super::agree::agree;
use super::agree::exchange;
use super::index::{find_rank_file, Index};
use super::reshard::stage_assembled;
use super::stage::{stage_file, Staged};
use super::{err, Part};
use crate::context::AmpContext;
use crate::distributed;
use crate::error::Result;
use crate::optimizer::AmpOptimizer;
use amp_core::Weight;
use std::path::Path;

/// Loads the checkpoint at `path` into `ctx` and `opt`
/// ([`AmpContext::load`]): staged (every rank of a group agreeing that it
/// could), then applied; at O3 with ZeRO the FP8 copies are then gathered
/// from the loaded master slices.
///
/// # Errors
/// [`crate::error::Error::Checkpoint`] naming the file and what is wrong,
/// on every rank of a group; nothing changed.
pub(crate) fn load(ctx: &AmpContext, path: &Path, opt: &mut AmpOptimizer) -> Result<()> {
    let staged = stage(ctx, path, opt);
    let staged = match distributed::group(opt) {
        Some(group) => {
            let staged = agree(group.comm(), path, staged, |r| {
                format!("rank {r} could not load it, so nothing changed here")
            })?;
            one_save(group.comm(), path, staged.save_id.as_deref())?;
            staged
        }
        None => staged?,
    };
    apply(ctx, opt, staged)?;
    if let Some(group) = distributed::group(opt).filter(|g| !g.shards().is_empty()) {
        // the FP8 copies, gathered from the loaded master slices
        group.gather(opt.inner())?;
    }
    Ok(())
}

/// Fails on every rank unless all ranks read files of one save (the same
/// sharded save's id, or none): rank files of two saves, found without
/// their index, are never mixed.
fn one_save(comm: &dyn amp_comm::Communicator, path: &Path, id: Option<&str>) -> Result<()> {
    // [has an id, the id's 16 hex digits]
    let mut mine = [0u8; 17];
    if let Some(id) = id {
        mine[0] = 1;
        let b = id.as_bytes();
        let n = b.len().min(16);
        mine[1..=n].copy_from_slice(&b[..n]);
    }
    let all = exchange(comm, &mine)?;
    match all.iter().position(|o| o != &all[0]) {
        None => Ok(()),
        Some(r) => {
            let show = |o: &[u8]| match o.first() {
                Some(1) => format!("save {}", String::from_utf8_lossy(&o[1..])),
                _ => "no save id".to_string(),
            };
            Err(err(
                path,
                format!(
                    "the ranks' files are of different saves (rank 0: {}, rank {r}: {}): \
                     nothing was loaded; load the index of one save",
                    show(&all[0]),
                    show(&all[r])
                ),
            ))
        }
    }
}

/// Reads and checks what `path` holds for this rank; changes nothing.
fn stage(ctx: &AmpContext, path: &Path, opt: &AmpOptimizer) -> Result<Staged> {
    let (rank, world) = opt.rank_and_world();
    let sharded = !distributed::shards(opt).is_empty();
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if sharded && e.kind() == std::io::ErrorKind::NotFound => {
            // no index (lost, or a save before there was one): this
            // rank's own file, found by name, at the same world size only
            return match find_rank_file(path, rank, world)?
                .and_then(|own| std::fs::read(&own).ok().map(|b| (own, b)))
            {
                Some((own, bytes)) => stage_file(ctx, &own, &bytes, opt),
                None => Err(err(
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
            stage_file(ctx, &part.path, &part.bytes, opt)
        }
        Some(index) => {
            let parts = (0..index.world)
                .map(|r| index.read_file(path, r))
                .collect::<Result<Vec<_>>>()?;
            stage_assembled(ctx, path, &parts, Some(&index), opt)
        }
        None if sharded => {
            let whole = Part {
                path: path.to_path_buf(),
                bytes,
                rank: 0,
                world: 1,
            };
            stage_assembled(ctx, path, &[whole], None, opt)
        }
        None => stage_file(ctx, path, &bytes, opt),
    }
}

/// Sets everything staged.
fn apply(ctx: &AmpContext, opt: &mut AmpOptimizer, staged: Staged) -> Result<()> {
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
    for (layer, state) in ctx.linears().iter().zip(staged.layers) {
        layer.set_scaling_state(state)?;
    }
    opt.inner_mut().restore_counters(staged.step, staged.scaler);
    opt.inner_mut().restore_skipped(staged.skipped);
    Ok(())
}
