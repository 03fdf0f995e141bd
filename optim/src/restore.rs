//! A skipped step's outputs put back on the device ([`RestoreOnSkip`],
//! `kernels/restore.cuh`): where the step is deferred
//! ([`LowBitAdamWConfig::defer_outcome`](crate::LowBitAdamWConfig)), the
//! host enqueues the updates without learning whether the gradients were
//! finite; the update kernels then return at once on a skipped step, and
//! this launch, enqueued behind them, copies every replaced state's bytes
//! (data and scales) into what replaced it, so the new weights and moments
//! are the old ones bit for bit without the old ones being kept until the
//! host reads the outcome.

use crate::error::Result;
use amp_core::kernel::{launch, Kernel};
use amp_core::ScalingTensor;
use candle_core::Tensor;

/// Copies, where the one-element F32 multiplier (the first input) is NaN,
/// each `(new, old)` pair's old bytes into the new tensor (the inputs after
/// the first, in pairs; the same dtype and element count; the new one
/// contiguous, written in place). No outputs. CUDA only: the CPU path
/// learns the outcome before it updates anything.
pub(crate) struct RestoreOnSkip;

/// The `(new, old)` pairs of tensors a step replaced, collected from the
/// states before and after it; a tensor that was not replaced (the same
/// tensor, as an F32 weight updated in place or a parameter without a
/// gradient) gives no pair.
#[derive(Default)]
pub(crate) struct Replaced(Vec<(Tensor, Tensor)>);

impl Replaced {
    /// `new` in place of `old`, if it is another tensor.
    pub(crate) fn tensor(&mut self, new: &Tensor, old: &Tensor) {
        if new.id() != old.id() {
            self.0.push((new.clone(), old.clone()));
        }
    }

    /// A scaled tensor's codes, scale, `1 / scale` and amax.
    pub(crate) fn scaled(&mut self, new: &ScalingTensor, old: &ScalingTensor) -> Result<()> {
        if new.data().id() == old.data().id() {
            return Ok(());
        }
        self.tensor(new.data(), old.data());
        self.tensor(new.meta().scale(), old.meta().scale());
        self.tensor(new.meta().scale_inv(), old.meta().scale_inv());
        self.tensor(&new.meta().amax()?, &old.meta().amax()?);
        Ok(())
    }

    /// One launch behind the step's updates that puts every pair's old
    /// bytes back where `grad_mul` (the step's multiplier) is NaN; nothing
    /// without pairs.
    ///
    /// # Errors
    /// A new tensor that is not contiguous, a pair of another dtype or
    /// length; the launch's.
    pub(crate) fn enqueue(self, grad_mul: &Tensor) -> Result<()> {
        if self.0.is_empty() {
            return Ok(());
        }
        let mut inputs = Vec::with_capacity(1 + 2 * self.0.len());
        inputs.push(grad_mul);
        for (new, old) in &self.0 {
            if !new.is_contiguous() {
                return Err(amp_core::Error::Unsupported {
                    op: RestoreOnSkip::NAME,
                    what: "a replaced state that is not contiguous".into(),
                }
                .into());
            }
            inputs.extend([new, old]);
        }
        launch(&RestoreOnSkip, &inputs)?;
        Ok(())
    }
}
