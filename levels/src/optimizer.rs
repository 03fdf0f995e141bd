//! The optimizer of a level ([`AmpOptimizer`]): low-bit AdamW over every
//! parameter, fed by candle's `GradStore` and the layers' FP8 gradient
//! sink; the backward and step of one or more micro-batches, with a
//! data-parallel group's averaging where [`initialize_with`] installed one.
//!
//! [`initialize_with`]: crate::initialize::initialize_with

use crate::comm_stats::CommStats;
use crate::error::Result;
use amp_core::nn::GradSink;
use amp_core::StreamMark;
use amp_optim::{Grad, Grads, LowBitAdamW, StepOutcome};
use candle_core::Tensor;

use crate::data_parallel::DataParallel;

/// The optimizer of a level: low-bit AdamW over every parameter, fed by
/// candle's `GradStore` and the layers' FP8 gradient sink.
#[derive(Debug)]
pub struct AmpOptimizer {
    pub(crate) opt: LowBitAdamW,
    pub(crate) sink: GradSink,
    /// Last step's gradient bytes: Linear data, Linear scales, others.
    pub(crate) last_grad_bytes: [usize; 3],
    /// CUDA: the pool's used high-water mark when the last backward pass
    /// ended (before the optimizer step).
    pub(crate) backward_peak: Option<u64>,
    pub(crate) linear_names: Vec<String>,
    /// Data parallelism's group (`initialize_distributed`), if any.
    pub(crate) group: Option<Box<dyn DataParallel>>,
    /// The last step's communication (with a group).
    pub(crate) last_comm: Option<CommStats>,
    /// Gradients of this step's earlier micro-batches
    /// ([`backward_accumulate`](Self::backward_accumulate)).
    pub(crate) pending: Option<Grads>,
}

/// What [`AmpContext::step`](crate::AmpContext::step) returns.
#[derive(Debug, Clone)]
pub struct Stepped {
    /// Applied or skipped (a non-finite gradient on any rank), or pending
    /// ([`AmpConfig::defer_outcome`](crate::AmpConfig::defer_outcome): the
    /// next step or [`AmpOptimizer::resolve`] reads it).
    pub outcome: StepOutcome,
    /// The loss's value, without its graph.
    pub loss: Tensor,
}

impl AmpOptimizer {
    /// Scales the loss, runs backward, gathers the F32 gradients of `Var`
    /// parameters and the FP8 gradients of the sink, averages them over the
    /// ranks of a data-parallel group (FP8 ones in FP8), and steps.
    ///
    /// # Errors
    /// The optimizer's, candle's.
    #[deprecated(
        note = "use `AmpContext::step`, which opens the FP8 scope and frees the \
                         activations before the step"
    )]
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<StepOutcome> {
        let grads = self.backward_grads(loss, true)?;
        self.step_grads(grads)
    }

    /// [`backward_step`](Self::backward_step) that takes the loss and drops
    /// it after the backward pass, before the optimizer step: candle keeps
    /// a graph's saved tensors (the activations) until its output is
    /// dropped, so where the caller holds no other handle on the graph they
    /// are freed before the step allocates the new weights and moments, as
    /// PyTorch frees them during `backward()`. Read the loss's value first.
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step).
    #[deprecated(note = "use `AmpContext::step`, which opens the FP8 scope too")]
    pub fn backward_step_owned(&mut self, loss: Tensor) -> Result<StepOutcome> {
        self.step_owned(loss)
    }

    /// [`backward_step_owned`](Self::backward_step_owned)'s body, for
    /// [`AmpContext::step`].
    pub(crate) fn step_owned(&mut self, loss: Tensor) -> Result<StepOutcome> {
        let grads = self.backward_grads(&loss, true)?;
        drop(loss);
        self.step_grads(grads)
    }

    /// The backward of one micro-batch of a step with gradient
    /// accumulation: its gradients are added to those kept since the last
    /// step, and nothing is communicated or stepped (PyTorch DDP's
    /// `no_sync`); the step's last micro-batch goes through
    /// [`backward_step`](Self::backward_step) (or
    /// [`backward_step_owned`](Self::backward_step_owned)), which adds its
    /// own, averages the sum over the ranks once and steps. Scale each
    /// micro-batch's loss by `1 / micro-batches` for the mean. The loss is
    /// dropped after its backward, freeing its saved activations.
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step).
    pub fn backward_accumulate(&mut self, loss: Tensor) -> Result<()> {
        let grads = self.backward_grads(&loss, false)?;
        drop(loss);
        match &mut self.pending {
            Some(p) => p.accumulate(grads)?,
            None => self.pending = Some(grads),
        }
        Ok(())
    }

    /// The backward half of [`backward_step`](Self::backward_step): the
    /// gradients, and this step's gradient bytes and backward peak recorded.
    fn backward_grads(&mut self, loss: &Tensor, last: bool) -> Result<Grads> {
        let (grads, early) = match &self.group {
            Some(group) => {
                let (opt, sink) = (&self.opt, &self.sink);
                let mut backward = || Ok(opt.backward(loss, Some(sink))?);
                if last {
                    group.backward(&mut self.pending, &mut backward)?
                } else {
                    group.backward_micro(&mut backward)?
                }
            }
            None => (self.opt.backward(loss, Some(&self.sink))?, Vec::new()),
        };
        if loss.device().is_cuda() {
            self.backward_peak = Some(amp_core::pool_peaks(loss.device())?.0);
        }
        // What the gradients of this step hold, by class: Linear data, their
        // scales, and the F32 gradients of every other parameter.
        // (Those data parallelism reduced during the backward included.)
        let (mut data, mut meta, mut other) = (0, 0, 0);
        let sizes = grads.0.iter().map(|(name, g)| match g {
            Grad::F32(t) => (name, t.elem_count() * t.dtype().size_in_bytes(), 0),
            Grad::Scaled(t) => (name, t.nbytes() - t.meta().nbytes(), t.meta().nbytes()),
        });
        for (name, d, m) in sizes.chain(early.iter().map(|(n, d, m)| (n, *d, *m))) {
            if self.linear_names.iter().any(|n| n == name) {
                data += d;
                meta += m;
            } else {
                other += d + m;
            }
        }
        self.last_grad_bytes = [data, meta, other];
        Ok(grads)
    }

    /// The step half of [`backward_step`](Self::backward_step); with a
    /// data-parallel group the gradients are averaged over the ranks, the
    /// squared norm summed over them, and after an applied step the FP8
    /// copies of sliced weights gathered again.
    fn step_grads(&mut self, mut grads: Grads) -> Result<StepOutcome> {
        if let Some(mut pending) = self.pending.take() {
            pending.accumulate(grads)?;
            grads = pending;
        }
        let Some(group) = &self.group else {
            return Ok(self.opt.step_owned(grads)?);
        };
        let device = grads.0.values().next().map(|g| match g {
            Grad::F32(t) => t.device().clone(),
            Grad::Scaled(t) => t.device().clone(),
        });
        let mark = || device.as_ref().map(StreamMark::now).transpose();
        let mut stats = CommStats::default();
        let start = mark()?;
        let grads = group.average(grads, &mut stats)?;
        if let (Some(a), Some(b)) = (start, mark()?) {
            stats.push_span(a, b);
        }
        let holds_slice = |name: &str| group.holds_slice(name);
        let mut total_sq = |part_sq: &Tensor| group.total_sq(part_sq);
        let mut outcome = self
            .opt
            .step_partitioned(grads, &holds_slice, &mut total_sq)?;
        // ZeRO's gathers follow the outcome, read here: a skipped step keeps
        // the gathered copies as they are (at start-up they were not made
        // from the masters, so a gather of the put-back masters could
        // differ), and every rank must agree on whether to gather. Without
        // slices there is nothing to gather and the outcome may wait.
        let sliced = self.opt.params().iter().any(|p| group.holds_slice(&p.name));
        if sliced && outcome == StepOutcome::Pending {
            outcome = self.opt.resolve()?.unwrap_or(outcome);
        }
        if let StepOutcome::Applied { .. } | StepOutcome::Pending = outcome {
            let start = mark()?;
            group.after_step(&self.opt, &mut stats)?;
            if let (Some(a), Some(b)) = (start, mark()?) {
                stats.push_gather_span(a, b);
            }
        }
        self.last_comm = Some(stats);
        Ok(outcome)
    }

    /// Reads the outcome of a pending step
    /// ([`AmpConfig::defer_outcome`](crate::AmpConfig::defer_outcome)) and
    /// settles the counters and the loss scaler by it; `None` without one
    /// (`LowBitAdamW::resolve`). The next step does it by itself; call it
    /// before reading the counters or saving a checkpoint.
    ///
    /// # Errors
    /// The read's.
    pub fn resolve(&mut self) -> Result<Option<StepOutcome>> {
        Ok(self.opt.resolve()?)
    }

    /// With a data-parallel group, the communication of the last step:
    /// buckets, bytes sent by this rank, and the time the step waited for
    /// it ([`CommStats::exposed_ms`]); `None` without a group or before a
    /// step.
    pub fn last_comm(&self) -> Option<&CommStats> {
        self.last_comm.as_ref()
    }

    /// CUDA only: the device pool's used high-water mark (bytes) when the
    /// last [`backward_step`](Self::backward_step)'s backward pass ended,
    /// before its optimizer step; `None` on the CPU or before a step.
    pub fn last_backward_peak(&self) -> Option<u64> {
        self.backward_peak
    }

    /// This rank and the number of ranks (`(0, 1)` without a group).
    pub fn rank_and_world(&self) -> (usize, usize) {
        self.group.as_ref().map_or((0, 1), |g| g.rank_and_world())
    }

    /// The data-parallel group's hook, if there is a group.
    pub(crate) fn data_parallel(&self) -> Option<&dyn DataParallel> {
        self.group.as_deref()
    }

    /// The low-bit AdamW inside.
    pub fn inner(&self) -> &LowBitAdamW {
        &self.opt
    }

    /// Mutable access (schedules, checkpoints).
    pub fn inner_mut(&mut self) -> &mut LowBitAdamW {
        &mut self.opt
    }
}
