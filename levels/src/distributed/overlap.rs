//! Buckets reduced while the backward runs (docs/ARCHITECTURE.md,
//! "Overlap with the backward"): the layers hand their FP8 weight
//! gradients to the sink one by one during candle's backward, and as soon
//! as every gradient of a bucket has arrived its reduction is enqueued,
//! from inside the backward, behind the backward's kernels. The host's
//! work for a bucket (a few dozen launches and the collectives) then runs
//! while the device still computes the rest of the backward, instead of
//! after it.
//!
//! The buckets must be the same on every rank and every step, so they are
//! planned from the first step: its backward runs with the reduction after
//! it, and records the order (and the multiplicity, for a weight used
//! twice) in which the sink received each gradient; later steps cut that
//! order into buckets of the cap ([`plan`]) and launch bucket `k` once its
//! gradients have all arrived and buckets `0..k` are launched. A gradient
//! that arrives more often than at the first step is an error (a backward
//! that changes from step to step); one that never arrives leaves its
//! bucket to the reduction after the backward, on every rank alike.

use super::plan::plan;
use super::zero::{self, Shard};
use crate::comm_stats::CommStats;
use crate::data_parallel::GradBytes;
use crate::error::{Error, Result};
use amp_comm::{fp8_all_reduce_bucket, Communicator, Fp8ReduceConfig, ReducedShard};
use amp_core::{defer_side_work, GradSink, QType, ScalingTensor};
use amp_optim::{Grad, Grads};
use candle_core::Tensor;
use std::collections::HashMap;

/// One planned bucket: its gradients' names with how often each arrives.
#[derive(Debug)]
pub(crate) struct Bucket {
    names: Vec<(String, usize)>,
    sharded: bool,
}

/// What the group knows of the backward's order.
#[derive(Debug, Default)]
pub(crate) enum Schedule {
    /// Before the first step.
    #[default]
    Unknown,
    /// During the first step: the sink's arrivals, in order.
    Recording(Vec<String>),
    /// The buckets, in launch order.
    Planned(Vec<Bucket>),
}

impl Schedule {
    /// Plans the buckets from the recorded arrivals and the step's
    /// gradients (their sizes and formats): FP8 gradients only, split by
    /// format and by sharding, in first-arrival order.
    pub(crate) fn finish_recording(&mut self, grads: &Grads, shards: &[Shard], cap: usize) {
        let Self::Recording(order) = std::mem::take(self) else {
            return;
        };
        let mut seen: Vec<(String, usize)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for name in order {
            match index.get(&name) {
                Some(&i) => seen[i].1 += 1,
                None => {
                    index.insert(name.clone(), seen.len());
                    seen.push((name, 1));
                }
            }
        }
        let mut items = Vec::new();
        let mut kept = Vec::new();
        for (name, count) in seen {
            if let Some(Grad::Scaled(t)) = grads.get(&name) {
                let sharded = shards.iter().any(|s| s.name == name);
                items.push((t.elem_count(), (t.qtype(), sharded)));
                kept.push((name, count));
            }
        }
        let buckets = plan(&items, cap)
            .into_iter()
            .map(|run| Bucket {
                sharded: items[run.start].1 .1,
                names: kept[run].to_vec(),
            })
            .collect();
        *self = Self::Planned(buckets);
    }
}

/// One step's reduction during the backward.
pub(crate) struct Step<'a> {
    comm: &'a dyn Communicator,
    /// FP8 buckets reduced in one shot (`AmpConfig::fp8_one_shot`).
    one_shot: bool,
    shards: &'a [Shard],
    buckets: &'a [Bucket],
    /// Arrivals so far, by name.
    arrived: HashMap<String, usize>,
    /// Planned count by name.
    planned: HashMap<&'a str, usize>,
    /// The next bucket to launch.
    next: usize,
    /// Earlier micro-batches' gradients (accumulation), consumed per name.
    pending: &'a mut Option<Grads>,
    /// The averaged gradients of the launched buckets.
    pub(crate) reduced: Grads,
    pub(crate) stats: CommStats,
    /// Name, data bytes and metadata bytes of each gradient taken.
    pub(crate) taken: Vec<GradBytes>,
    /// The work left for after the wait for the communicator's stream.
    pub(crate) late: Late,
}

/// What the buckets reduced during the backward leave for after candle's
/// stream has waited for the communicator's ([`SideStream`](amp_core::SideStream)):
/// their inputs, which must live until then (freeing one hands its memory
/// back to candle's stream while the reduction may still read it), and
/// ZeRO's slices, which the optimizer reads on candle's stream.
#[derive(Default)]
pub(crate) struct Late {
    inputs: Vec<ScalingTensor>,
    slices: Vec<(String, ReducedShard)>,
}

impl Late {
    /// After the wait: the inputs freed, the slices' gradients into `out`
    /// (their agreed amaxes into `agreed`).
    pub(crate) fn finish(self, out: &mut Grads, agreed: &mut Vec<Tensor>) {
        drop(self.inputs);
        for (name, r) in self.slices {
            out.insert(name, zero::slice_grad(r, agreed));
        }
    }
}

impl<'a> Step<'a> {
    pub(crate) fn new(
        comm: &'a dyn Communicator,
        one_shot: bool,
        shards: &'a [Shard],
        schedule: &'a Schedule,
        pending: &'a mut Option<Grads>,
    ) -> Option<Self> {
        let Schedule::Planned(buckets) = schedule else {
            return None;
        };
        let planned = buckets
            .iter()
            .flat_map(|b| b.names.iter().map(|(n, c)| (n.as_str(), *c)))
            .collect();
        Some(Self {
            comm,
            one_shot,
            shards,
            buckets,
            arrived: HashMap::new(),
            planned,
            next: 0,
            pending,
            reduced: Grads::new(),
            stats: CommStats::default(),
            taken: Vec::new(),
            late: Late::default(),
        })
    }

    /// The sink received `name`: launch every bucket now complete, in order.
    pub(crate) fn arrived(&mut self, sink: &GradSink, name: &str) -> Result<()> {
        let count = self.arrived.entry(name.to_string()).or_insert(0);
        *count += 1;
        if let Some(&want) = self.planned.get(name) {
            if *count > want {
                return Err(Error::Config {
                    field: name.to_string(),
                    reason: format!(
                        "this weight's gradient arrived {count} times in one backward, {want} at the \
                         first step: overlapping the reduction with the backward needs the same \
                         backward every step"
                    ),
                });
            }
        }
        while let Some(b) = self.buckets.get(self.next) {
            let complete = b
                .names
                .iter()
                .all(|(n, c)| self.arrived.get(n).is_some_and(|a| a >= c));
            if !complete {
                break;
            }
            self.launch(sink, self.next)?;
            self.next += 1;
        }
        Ok(())
    }

    /// Reduces bucket `k` now.
    fn launch(&mut self, sink: &GradSink, k: usize) -> Result<()> {
        let bucket = &self.buckets[k];
        let mut grads: Vec<(String, ScalingTensor)> = Vec::with_capacity(bucket.names.len());
        for (name, _) in &bucket.names {
            let Some(g) = sink.take_one(name)? else {
                return Err(Error::Config {
                    field: name.clone(),
                    reason: "the gradient sink lost this weight's gradient".into(),
                });
            };
            let meta = g.meta().nbytes();
            self.taken.push((name.clone(), g.nbytes() - meta, meta));
            let g = match self.pending.as_mut().and_then(|p| p.0.remove(name)) {
                None => g,
                Some(earlier) => {
                    let mut sum = Grads::new();
                    sum.insert(name.clone(), earlier);
                    let mut more = Grads::new();
                    more.insert(name.clone(), Grad::Scaled(g));
                    sum.accumulate(more)?;
                    match sum.0.remove(name) {
                        Some(Grad::Scaled(t)) => t,
                        _ => {
                            return Err(Error::Config {
                                field: name.clone(),
                                reason: "an accumulated FP8 gradient became F32".into(),
                            })
                        }
                    }
                }
            };
            grads.push((name.clone(), g));
        }
        let qtype: QType = grads[0].1.qtype();
        let before = self.comm.bytes_sent();
        if bucket.sharded {
            let with_shards = grads
                .iter()
                .map(|(name, t)| {
                    let shard = self
                        .shards
                        .iter()
                        .find(|s| &s.name == name)
                        .ok_or_else(|| Error::Config {
                            field: name.clone(),
                            reason: "a planned sharded weight has no shard".into(),
                        })?;
                    Ok((t, shard))
                })
                .collect::<Result<Vec<_>>>()?;
            // The optimizer reads the slices on candle's stream: after the wait.
            let out = defer_side_work(|| zero::reduce_scatter(self.comm, &with_shards))?;
            for ((name, _), r) in grads.iter().zip(out) {
                self.late.slices.push((name.clone(), r));
            }
        } else {
            let cfg = Fp8ReduceConfig {
                qtype,
                one_shot: self.one_shot,
                ..Default::default()
            };
            let out = defer_side_work(|| {
                fp8_all_reduce_bucket(self.comm, grads.iter().map(|(_, t)| t), &cfg)
            })?;
            for ((name, _), r) in grads.iter().zip(out) {
                self.reduced.insert(name.clone(), Grad::Scaled(r.grad));
            }
        }
        self.late.inputs.extend(grads.into_iter().map(|(_, t)| t));
        self.stats.wire_bytes += self.comm.bytes_sent().saturating_sub(before);
        self.stats.buckets += 1;
        Ok(())
    }
}
