//! An embedding table's gradient averaged from every rank's looked-up rows
//! (docs/ARCHITECTURE.md, "Data parallelism"): the gradient of a lookup
//! depends only on its ids and the gradient of the rows it returned, so
//! instead of all-reducing the table's `rows x cols` F32 gradient after the
//! backward, each rank gathers every rank's ids and row gradients (`n x
//! cols` a rank) and builds the mean itself
//! ([`amp_core::nn::embedding_grad`] with `1 / N`: each rank's rows in rank
//! order, each token's row scaled by `1 / N`, summed in token order). A GPT
//! at 1.3B looks up 8,192 rows a rank from a 50,304-row table: 6x fewer
//! bytes than the all-reduce, and no pass over the table but the one that
//! writes it.
//!
//! With `AmpConfig::embedding_rows` (off by default: every rank must
//! look up the same number of ids at every step). Taken where it sends
//! fewer bytes: a ring all-reduce sends
//! `2 (N - 1) / N * rows * cols * 4` bytes a rank, the gathers
//! `(N - 1) * n * (cols + 1) * 4`, so when `N n < 2 rows` ([`worth_it`]).
//! Every rank decides alike (the same table and, as every collective of a
//! step requires, the same number of ids). A table used elsewhere too (a
//! tied head) keeps that other gradient in candle's store, reduced with
//! the other F32 gradients; the group adds the two means.
//!
//! With gradient accumulation the rows of the micro-batches before the
//! last are kept (no communication; `n x cols` a micro-batch, less than
//! the table they would otherwise be added into) and gathered with the
//! last one's: the same bytes as one step of the whole batch. A lookup
//! that would take the kept rows past [`worth_it`] leaves its gradient to
//! candle's store instead, reduced with the others; the two parts add up.

use crate::error::Result;
use amp_comm::Communicator;
use amp_core::nn::{embedding_grad, with_embedding_backward};
use amp_core::StreamMark;
use candle_core::{Tensor, TensorId};
use std::collections::HashMap;

/// What the lookups of one step handed over, averaged.
#[derive(Default)]
pub(crate) struct RowGrads {
    /// The averaged table gradients, by parameter name.
    pub(crate) taken: Vec<(String, Tensor)>,
    /// Bytes sent for them.
    pub(crate) wire_bytes: u64,
    /// The spans of their gathers (nothing else runs meanwhile).
    pub(crate) spans: Vec<(StreamMark, StreamMark)>,
}

/// One table's rows kept since the step began: its name, its row count,
/// and each lookup's ids and row gradients.
struct Kept {
    name: String,
    rows: usize,
    ids: Vec<Tensor>,
    grads: Vec<Tensor>,
}

impl Kept {
    fn len(&self) -> usize {
        self.ids.iter().map(Tensor::elem_count).sum()
    }
}

/// The rows kept since the step began, tables in first-lookup order (the
/// same on every rank).
#[derive(Default)]
pub(crate) struct Stash(Vec<Kept>);

impl Stash {
    /// Bytes held (ids and row gradients).
    pub(crate) fn bytes(&self) -> Vec<(String, usize)> {
        self.0
            .iter()
            .map(|k| {
                let b = k.ids.iter().chain(&k.grads);
                let b = b.map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum();
                (k.name.clone(), b)
            })
            .collect()
    }
}

/// Whether `world` ranks gathering `ids` rows each send fewer bytes than
/// an all-reduce of a `rows`-row table: `world * ids < 2 * rows`.
pub(crate) fn worth_it(world: usize, ids: usize, rows: usize) -> bool {
    world > 1 && world.saturating_mul(ids) < rows.saturating_mul(2)
}

/// Runs `body` (a backward) with every lookup of a table named in `tables`
/// (by its tensor's id) kept in `stash` instead of going to candle's
/// store, as long as the rows kept for the table stay [`worth_it`].
pub(crate) fn with_rows_kept<R>(
    world: usize,
    tables: &HashMap<TensorId, String>,
    stash: &mut Stash,
    body: impl FnOnce() -> R,
) -> R {
    if tables.is_empty() {
        return body();
    }
    with_embedding_backward(
        |l| {
            let Some(name) = tables.get(&l.table.id()) else {
                return Ok(false);
            };
            let rows = l.table.dims2()?.0;
            let at = match stash.0.iter().position(|k| &k.name == name) {
                Some(at) => at,
                None => {
                    stash.0.push(Kept {
                        name: name.clone(),
                        rows,
                        ids: Vec::new(),
                        grads: Vec::new(),
                    });
                    stash.0.len() - 1
                }
            };
            let kept = &mut stash.0[at];
            if !worth_it(world, kept.len() + l.ids.elem_count(), rows) {
                return Ok(false);
            }
            kept.ids.push(l.ids.clone());
            kept.grads.push(l.grad.clone());
            Ok(true)
        },
        body,
    )
}

/// Every table's mean over the ranks from the rows in `stash` (emptied):
/// each rank's kept ids and row gradients gathered in rank order, into
/// `out`.
pub(crate) fn gather_means(
    comm: &dyn Communicator,
    stash: &mut Stash,
    out: &mut RowGrads,
) -> Result<()> {
    let world = comm.world_size();
    for kept in std::mem::take(&mut stash.0) {
        if kept.ids.is_empty() {
            continue;
        }
        let cat = |v: &[Tensor]| match v {
            [one] => Ok(one.clone()),
            _ => Tensor::cat(v, 0),
        };
        let (ids, grads) = (cat(&kept.ids)?, cat(&kept.grads)?);
        let (n, cols) = grads.dims2()?;
        let before = comm.bytes_sent();
        let start = StreamMark::now(grads.device())?;
        let all_ids = comm.all_gather(&ids)?.flatten_all()?;
        let all_grads = comm.all_gather(&grads)?.reshape((world * n, cols))?;
        out.spans.push((start, StreamMark::now(grads.device())?));
        out.wire_bytes += comm.bytes_sent().saturating_sub(before);
        let scale = (1.0 / world as f64) as f32;
        let mean = embedding_grad(&all_ids, &all_grads, kept.rows, scale)?;
        out.taken.push((kept.name, mean));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::worth_it;

    #[test]
    fn rows_are_gathered_only_where_they_are_fewer_bytes() {
        // GPT-2's table, 8 x 1024 tokens a rank
        assert!(worth_it(2, 8192, 50304));
        assert!(worth_it(12, 8192, 50304));
        assert!(!worth_it(13, 8192, 50304));
        // its position table: every rank looks up all 1024 rows 8 times
        assert!(!worth_it(2, 8192, 1024));
        // one rank: nothing to average
        assert!(!worth_it(1, 1, 1 << 20));
    }
}
