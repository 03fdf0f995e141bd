//! Compute modes and the `fp8_autocast` scope (Transformer Engine's
//! `fp8_autocast(enabled, fp8_recipe)`).

use crate::numerics::recipe::{
    CurrentScaling, DelayedScaling, Float8BlockScaling, Float8RowwiseScaling,
};
use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

/// How the matrix products of `amp::nn` layers run; orthogonal to the
/// optimization level.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum ComputeMode {
    /// The input's own precision (F32 on the CPU); on CUDA an F32 input
    /// is multiplied in BF16 (the O0 baseline, as PyTorch autocast).
    #[default]
    Native,
    /// FP8, each cast scaled from its tensor's own amax (MS-AMP; TE's
    /// `Float8CurrentScaling`).
    Fp8Current(CurrentScaling),
    /// FP8, scales from each tensor's amax history (TE's `DelayedScaling`).
    Fp8Delayed(DelayedScaling),
    /// FP8 with one scale per 1 x 128 tile or 128 x 128 block of each
    /// operand (TE's `Float8BlockScaling`, DeepSeek-V3's recipe; see
    /// `nn/linear/block.rs`).
    Fp8Block(Float8BlockScaling),
    /// FP8 with one scale per row of each operand along the reduced
    /// dimension (torchao's `rowwise` recipe).
    Fp8Rowwise(Float8RowwiseScaling),
}

thread_local! {
    /// The open scopes of this thread, innermost last, each with the step
    /// its outermost scope started.
    static SCOPES: RefCell<Vec<(ComputeMode, u64)>> = const { RefCell::new(Vec::new()) };
}

/// Step numbers handed out: every outermost scope entered, on any thread,
/// takes a fresh one (so threads never share a step).
static STEP: AtomicU64 = AtomicU64::new(0);

/// While alive, `amp::nn` layers on this thread compute in its mode; scopes
/// nest, the innermost wins. Entering an outermost scope starts a new
/// scaling step: delayed-scaling histories roll once per step, lazily, at
/// each layer's first cast of the step.
///
/// ```
/// use amp_core::nn::{fp8_autocast, current_mode, ComputeMode};
/// use amp_core::DelayedScaling;
/// assert_eq!(current_mode(), ComputeMode::Native);
/// {
///     let _fp8 = fp8_autocast(true, ComputeMode::Fp8Delayed(DelayedScaling::default()));
///     assert!(matches!(current_mode(), ComputeMode::Fp8Delayed(_)));
///     let _off = fp8_autocast(false, ComputeMode::Fp8Delayed(DelayedScaling::default()));
///     assert_eq!(current_mode(), ComputeMode::Native);
/// }
/// assert_eq!(current_mode(), ComputeMode::Native);
/// ```
#[must_use = "the scope ends when this guard is dropped"]
#[derive(Debug)]
pub struct Fp8Autocast {
    _not_send: PhantomData<*const ()>,
}

/// Opens a scope: `mode` when `enabled`, native otherwise.
pub fn fp8_autocast(enabled: bool, mode: ComputeMode) -> Fp8Autocast {
    SCOPES.with(|s| {
        let mut s = s.borrow_mut();
        let step = match s.last() {
            Some((_, step)) => *step,
            None => STEP.fetch_add(1, Ordering::SeqCst) + 1,
        };
        s.push((if enabled { mode } else { ComputeMode::Native }, step));
    });
    Fp8Autocast {
        _not_send: PhantomData,
    }
}

/// Runs `f` inside a scope.
pub fn with_fp8_autocast<R>(enabled: bool, mode: ComputeMode, f: impl FnOnce() -> R) -> R {
    let _scope = fp8_autocast(enabled, mode);
    f()
}

impl Drop for Fp8Autocast {
    fn drop(&mut self) {
        // try_with: nothing to pop once the thread's locals are torn down.
        let _ = SCOPES.try_with(|s| s.borrow_mut().pop());
    }
}

thread_local! {
    /// Open [`inference`] scopes of this thread.
    static INFERENCE: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// While alive, the forward passes on this thread are not backpropagated
/// (evaluation): an op that would make gradients in its forward (the
/// head's loss over chunks of rows, `set_loss_chunk_rows`) makes only its
/// output, outside the graph. Scopes nest. `AmpContext::evaluate` opens
/// one. A backward through what was computed inside is an error or gives
/// no gradient for those ops.
#[must_use = "the scope ends when this guard is dropped"]
#[derive(Debug)]
pub struct Inference {
    _not_send: PhantomData<*const ()>,
}

/// Opens an [`Inference`] scope.
pub fn inference() -> Inference {
    INFERENCE.with(|c| c.set(c.get() + 1));
    Inference {
        _not_send: PhantomData,
    }
}

impl Drop for Inference {
    fn drop(&mut self) {
        let _ = INFERENCE.try_with(|c| c.set(c.get().saturating_sub(1)));
    }
}

/// Whether an [`inference`] scope is open on this thread.
pub fn in_inference() -> bool {
    INFERENCE.try_with(|c| c.get() > 0).unwrap_or(false)
}

/// The mode of the innermost scope on this thread; native outside any.
pub fn current_mode() -> ComputeMode {
    SCOPES.with(|s| {
        s.borrow()
            .last()
            .map(|(m, _)| m.clone())
            .unwrap_or_default()
    })
}

/// This thread's current scaling step (0 outside any scope).
pub(crate) fn current_step() -> u64 {
    SCOPES.with(|s| s.borrow().last().map_or(0, |(_, step)| *step))
}

/// `f` inside a scope of `mode` at `step` (an earlier scope's: no new
/// step): what a recomputed forward runs in, so that its casts take the
/// scales, and record the amaxes, of the forward it repeats.
pub(crate) fn in_scope_at<R>(mode: ComputeMode, step: u64, f: impl FnOnce() -> R) -> R {
    SCOPES.with(|s| s.borrow_mut().push((mode, step)));
    let _pop = Fp8Autocast {
        _not_send: PhantomData,
    };
    f()
}
