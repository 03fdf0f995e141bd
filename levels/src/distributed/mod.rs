//! Data parallelism (docs/ARCHITECTURE.md, "Data parallelism"): every rank
//! holds the whole model, trains on its share of the batch, and the
//! gradients are averaged across ranks before the step, the Linear weight
//! gradients in FP8.
//!
//! - The gradients travel in buckets ([`buckets`]: up to
//!   [`AmpConfig::bucket_mb`] each, a handful of collectives a bucket).
//! - FP8 weight gradients (O1-O3): [`amp_comm::fp8_all_reduce_bucket`]:
//!   one scale per tensor agreed by all ranks, FP8 codes on the wire (a
//!   quarter of F32's bytes), F32 accumulation, the mean re-quantized with
//!   a fresh agreed scale.
//! - F32 gradients (every other parameter, and Linear weights at O0): one
//!   packed F32 all-reduce a bucket, divided by the world size.
//! - At O3 with more than one rank, ZeRO ([`zero`]): each rank keeps a
//!   slice of every Linear weight's master and moments.
//!
//! Every rank then takes the same step on the same gradients, so the
//! replicas stay bitwise identical; a non-finite gradient on any rank is
//! non-finite on every rank after the reduction, and every rank skips.
//!
//! The context does not know this module: [`initialize_distributed`]
//! hands a [`Group`] to the context's initialization as its
//! [`DataParallel`] hook, which the optimizer step calls. The checkpoint
//! and the memory report, above both, find the group with [`group`].

mod buckets;
mod overlap;
mod plan;
mod rows;
pub(crate) mod zero;

use crate::comm_stats::CommStats;
use crate::config::AmpConfig;
use crate::context::AmpContext;
use crate::data_parallel::{DataParallel, GradBytes};
use crate::error::Result;
use crate::initialize::{initialize_with, INITIALIZED_MARK};
use crate::optimizer::AmpOptimizer;
use amp_comm::Communicator;
use amp_core::{with_sink_listener, GradSink, WeightSlot};
use amp_optim::{AdamWConfig, Grad, Grads, LowBitAdamW};
use candle_core::{Tensor, TensorId};
use overlap::{Late, Schedule, Step};
use rows::{with_rows_kept, RowGrads, Stash};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use zero::Shard;

/// A data-parallel group as one rank's optimizer holds it: the
/// communicator and, at O3 with ZeRO, the Linear weights whose master and
/// moments this rank holds a slice of.
pub(crate) struct Group {
    comm: Arc<dyn Communicator>,
    shards: Vec<Shard>,
    /// A bucket's cap, in elements.
    cap: usize,
    /// The buckets reduced during the backward ([`overlap`]), unless off.
    schedule: RefCell<Schedule>,
    overlap: bool,
    /// F32 gradients as BF16 on the wire, FP8 buckets in one shot
    /// (`AmpConfig::bf16_wire`, `AmpConfig::fp8_one_shot`).
    wire: buckets::Wire,
    /// What the last backward reduced already, for [`DataParallel::average`].
    early: RefCell<Option<(Grads, CommStats, Late)>>,
    /// The agreed amaxes of this step's sharded gradients, for the norm.
    agreed: RefCell<Vec<Tensor>>,
    /// Every parameter's name by its tensor's id, for the embedding
    /// tables whose gradient [`rows`] averages from their rows (empty
    /// unless `AmpConfig::embedding_rows`).
    tables: HashMap<TensorId, String>,
    /// What the last backward's lookups handed over ([`rows`]).
    rows: RefCell<RowGrads>,
    /// The rows kept since the step began ([`rows`]).
    stash: RefCell<Stash>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Group(rank {} of {}, {} shard(s))",
            self.comm.rank(),
            self.comm.world_size(),
            self.shards.len()
        )
    }
}

impl Group {
    /// The communicator.
    pub(crate) fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// The sharded weights (empty unless ZeRO).
    pub(crate) fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Every shard's FP8 copy gathered from the ranks' master slices in
    /// `opt` (after a step or a load).
    ///
    /// # Errors
    /// The communicator's; a shard the optimizer does not hold.
    pub(crate) fn gather(&self, opt: &LowBitAdamW) -> Result<()> {
        let mut stats = CommStats::default();
        self.gather_counted(opt, &mut stats)
    }

    fn gather_counted(&self, opt: &LowBitAdamW, stats: &mut CommStats) -> Result<()> {
        let before = self.comm.bytes_sent();
        let cap = self.cap.saturating_mul(zero::GATHER_CAP_FACTOR);
        zero::gather(self.comm(), opt, &self.shards, cap, stats)?;
        stats.wire_bytes += self.comm.bytes_sent().saturating_sub(before);
        Ok(())
    }

    /// The backward with the FP8 buckets reduced while it runs (unless
    /// overlap is off; the first step records their order).
    fn backward_overlapped(
        &self,
        pending: &mut Option<Grads>,
        backward: &mut dyn FnMut() -> Result<Grads>,
    ) -> Result<(Grads, Vec<GradBytes>)> {
        if !self.overlap {
            return Ok((backward()?, Vec::new()));
        }
        let mut schedule = self.schedule.borrow_mut();
        if let Schedule::Unknown = *schedule {
            *schedule = Schedule::Recording(Vec::new());
        }
        if let Schedule::Recording(order) = &mut *schedule {
            let grads = with_sink_listener(
                |_: &GradSink, name: &str| {
                    order.push(name.to_string());
                    Ok(())
                },
                &mut *backward,
            )?;
            schedule.finish_recording(&grads, &self.shards, self.cap);
            return Ok((grads, Vec::new()));
        }
        let Some(mut step) = Step::new(
            self.comm(),
            self.wire.one_shot,
            &self.shards,
            &schedule,
            pending,
        ) else {
            return Ok((backward()?, Vec::new()));
        };
        let grads = with_sink_listener(
            |sink: &GradSink, name: &str| {
                step.arrived(sink, name)
                    .map_err(|e| amp_core::Error::Unsupported {
                        op: "data parallelism during the backward",
                        what: e.to_string(),
                    })
            },
            &mut *backward,
        )?;
        *self.early.borrow_mut() = Some((step.reduced, step.stats, step.late));
        Ok((grads, step.taken))
    }

    /// The buckets' part of [`DataParallel::average`]: those the backward
    /// reduced, then the rest.
    fn average_buckets(&self, grads: Grads, stats: &mut CommStats) -> Result<Grads> {
        let (mut out, early, late) = self.early.take().unwrap_or_default();
        // The buckets of the backward may still run on the communicator's
        // stream: candle's waits for them here, then their inputs may go.
        if let Some(side) = self.comm.side_stream() {
            side.compute_wait()?;
        }
        let mut agreed = Vec::new();
        late.finish(&mut out, &mut agreed);
        stats.buckets += early.buckets;
        stats.overlapped += early.buckets;
        stats.wire_bytes += early.wire_bytes;
        let before = self.comm.bytes_sent();
        let rest = buckets::average(
            self.comm(),
            grads,
            &self.shards,
            self.cap,
            self.wire,
            stats,
            &mut agreed,
        )?;
        *self.agreed.borrow_mut() = agreed;
        stats.wire_bytes += self.comm.bytes_sent().saturating_sub(before);
        out.0.extend(rest.0);
        Ok(out)
    }
}

impl DataParallel for Group {
    fn rank_and_world(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world_size())
    }

    fn split_master(
        &mut self,
        name: &str,
        value: &Tensor,
        slot: &WeightSlot,
    ) -> Result<Option<WeightSlot>> {
        let split = zero::split(name, value, slot, self.rank_and_world())?;
        Ok(split.map(|(shard, master)| {
            self.shards.push(shard);
            master
        }))
    }

    fn backward(
        &self,
        pending: &mut Option<Grads>,
        backward: &mut dyn FnMut() -> Result<Grads>,
    ) -> Result<(Grads, Vec<GradBytes>)> {
        let world = self.comm.world_size();
        let mut stash = self.stash.borrow_mut();
        let (grads, mut taken) = with_rows_kept(world, &self.tables, &mut stash, || {
            self.backward_overlapped(pending, backward)
        })?;
        let mut rows = RowGrads::default();
        rows::gather_means(self.comm(), &mut stash, &mut rows)?;
        for (name, g) in &rows.taken {
            taken.push((name.clone(), g.elem_count() * g.dtype().size_in_bytes(), 0));
        }
        *self.rows.borrow_mut() = rows;
        Ok((grads, taken))
    }

    fn backward_micro(
        &self,
        backward: &mut dyn FnMut() -> Result<Grads>,
    ) -> Result<(Grads, Vec<GradBytes>)> {
        let world = self.comm.world_size();
        let mut stash = self.stash.borrow_mut();
        let grads = with_rows_kept(world, &self.tables, &mut stash, backward)?;
        let kept = stash.bytes().into_iter().map(|(n, b)| (n, b, 0)).collect();
        Ok((grads, kept))
    }

    fn average(&self, grads: Grads, stats: &mut CommStats) -> Result<Grads> {
        let mut out = self.average_buckets(grads, stats)?;
        // The tables averaged from their rows during the backward, added to
        // the mean of whatever other gradient they got (a tied head's).
        let rows = self.rows.take();
        stats.wire_bytes += rows.wire_bytes;
        for (a, b) in rows.spans {
            stats.push_span(a, b);
        }
        for (name, mean) in rows.taken {
            let sum = match out.0.remove(&name) {
                None => mean,
                Some(Grad::F32(other)) => (other + mean)?,
                Some(Grad::Scaled(_)) => {
                    return Err(crate::error::Error::Config {
                        field: name,
                        reason: "an embedding table's gradient arrived in FP8".into(),
                    })
                }
            };
            out.insert(name, Grad::F32(sum));
        }
        Ok(out)
    }

    fn holds_slice(&self, name: &str) -> bool {
        self.shards.iter().any(|s| s.name == name)
    }

    fn total_sq(&self, part_sq: &Tensor) -> amp_optim::Result<Tensor> {
        if self.shards.is_empty() {
            return Ok(part_sq.clone());
        }
        let err = |e: crate::error::Error| amp_optim::Error::Config {
            field: "data parallelism",
            reason: e.to_string(),
        };
        let agreed = self.agreed.take();
        let part = zero::poison(part_sq, &agreed).map_err(err)?;
        self.comm().all_reduce_sum(&part).map_err(|e| err(e.into()))
    }

    fn after_step(&self, opt: &LowBitAdamW, stats: &mut CommStats) -> Result<()> {
        self.gather_counted(opt, stats)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The group that [`initialize_distributed`] installed in `opt`, if any.
pub(crate) fn group(opt: &AmpOptimizer) -> Option<&Group> {
    opt.data_parallel()?.as_any().downcast_ref()
}

/// The weights whose master and moments `opt` holds a slice of (empty
/// unless ZeRO).
pub(crate) fn shards(opt: &AmpOptimizer) -> &[Shard] {
    match group(opt) {
        Some(g) => g.shards(),
        None => &[],
    }
}

/// [`initialize`](crate::initialize::initialize) for one rank of a data-parallel
/// group: every parameter is first broadcast from rank 0 (candle's CPU
/// generator cannot be seeded, so replicas built apart start apart), then
/// converted as the level says (at O3 with ZeRO: this rank's slice of each
/// Linear weight's master and moments);
/// [`AmpContext::step`] averages the gradients over the ranks
/// before it steps. Each rank calls this with its own model, built by the
/// same code.
///
/// # Errors
/// As [`initialize`](crate::initialize::initialize); the communicator's
/// ([`Error::Comm`](crate::Error::Comm)), e.g. a rank that fails or never arrives.
pub fn initialize_distributed(
    varmap: &candle_nn::VarMap,
    adam: AdamWConfig,
    config: AmpConfig,
    comm: Arc<dyn Communicator>,
) -> Result<(AmpContext, AmpOptimizer)> {
    broadcast_vars(varmap, comm.as_ref())?;
    let tables = match config.embedding_rows {
        true => varmap
            .data()
            .lock()
            .map_err(|_| amp_core::Error::Poisoned { op: "initialize" })?
            .iter()
            .map(|(name, var)| (var.as_tensor().id(), name.clone()))
            .collect(),
        false => HashMap::new(),
    };
    let group = Group {
        comm,
        shards: Vec::new(),
        cap: plan::cap_elems(config.bucket_mb),
        schedule: RefCell::new(Schedule::Unknown),
        overlap: config.overlap_backward,
        wire: buckets::Wire {
            bf16: config.bf16_wire,
            one_shot: config.fp8_one_shot,
        },
        early: RefCell::new(None),
        agreed: RefCell::new(Vec::new()),
        tables,
        rows: RefCell::new(RowGrads::default()),
        stash: RefCell::new(Stash::default()),
    };
    initialize_with(varmap, adam, config, Some(Box::new(group)))
}

/// Rank 0's value of every variable, in name order, on every rank.
fn broadcast_vars(varmap: &candle_nn::VarMap, comm: &dyn Communicator) -> Result<()> {
    let mut vars: Vec<(String, candle_core::Var)> = varmap
        .data()
        .lock()
        .map_err(|_| amp_core::Error::Poisoned { op: "initialize" })?
        .iter()
        .filter(|(n, _)| n.as_str() != INITIALIZED_MARK)
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, var) in vars {
        let value = comm.broadcast(var.as_tensor(), 0)?;
        if comm.rank() != 0 {
            var.set(&value.reshape(var.shape())?)?;
        }
    }
    Ok(())
}
