//! What a data-parallel group does for a level's context: the hook
//! (`DataParallel`) that `initialize_with` installs and the optimizer
//! step calls; the `distributed` module implements it (the levels' other
//! modules know no communicator).

use crate::comm_stats::CommStats;
use crate::error::Result;
use amp_core::WeightSlot;
use amp_optim::{Grads, LowBitAdamW};
use candle_core::Tensor;

/// A gradient's name, data bytes and metadata bytes.
pub(crate) type GradBytes = (String, usize, usize);

/// What a data-parallel group does inside [`initialize_with`] and the
/// optimizer step; the `distributed` module implements it (this module
/// knows no communicator).
pub(crate) trait DataParallel: std::fmt::Debug {
    /// This rank and the number of ranks.
    fn rank_and_world(&self) -> (usize, usize);

    /// At a level that keeps an FP8 copy and an FP16 master of Linear
    /// weight `name` (F32 `value`, the layer's `slot`): the optimizer's slot
    /// holding this rank's slice of the master, the layer's slot then set
    /// to the whole FP8 copy; `None` (nothing changed) to store it whole.
    fn split_master(
        &mut self,
        name: &str,
        value: &Tensor,
        slot: &WeightSlot,
    ) -> Result<Option<WeightSlot>>;

    /// Runs `backward`, which fills the layers' gradient sink (and returns
    /// the step's gradients as the optimizer collects them), and may start
    /// averaging gradients while the sink receives them, taking them out of
    /// the sink (and their earlier micro-batches' part out of `pending`);
    /// [`average`](Self::average) then completes the step's averaging.
    /// Returns the gradients and, of those taken early, each one's name,
    /// data bytes and metadata bytes.
    fn backward(
        &self,
        pending: &mut Option<Grads>,
        backward: &mut dyn FnMut() -> Result<Grads>,
    ) -> Result<(Grads, Vec<GradBytes>)>;

    /// Runs the backward of a micro-batch before a step's last
    /// ([`AmpOptimizer::backward_accumulate`]): nothing is communicated,
    /// and the group may keep what it takes out of the gradients for the
    /// step's last backward (an embedding table's looked-up rows), named
    /// with their bytes as [`backward`](Self::backward) names what it took.
    fn backward_micro(
        &self,
        backward: &mut dyn FnMut() -> Result<Grads>,
    ) -> Result<(Grads, Vec<GradBytes>)>;

    /// The mean of every rank's gradients (of a weight this rank holds a
    /// slice of: only that slice), its buckets and bytes counted in `stats`.
    fn average(&self, grads: Grads, stats: &mut CommStats) -> Result<Grads>;

    /// Whether the optimizer holds only this rank's slice of `name`.
    fn holds_slice(&self, name: &str) -> bool;

    /// The squared gradient norm over all ranks, from this rank's part
    /// (one F32 on the device; the sum likewise, without a host read).
    fn total_sq(&self, part_sq: &Tensor) -> amp_optim::Result<Tensor>;

    /// After an applied step: what the ranks share again (the FP8 copies
    /// of the sliced weights).
    fn after_step(&self, opt: &LowBitAdamW, stats: &mut CommStats) -> Result<()>;

    /// Itself, for the implementing module to find its own type.
    fn as_any(&self) -> &dyn std::any::Any;
}
