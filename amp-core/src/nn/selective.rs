//! Selective recomputation (Megatron's `selective`, for FP8 layers): inside
//! [`selective`], the ops keep for backward only what is expensive to
//! compute again, and recompute in backward what is cheap:
//!
//! - an FP8 Linear keeps the source of its FP8 input instead of the codes
//!   where that source is kept anyway (its op's graph input; GELU's input,
//!   which GELU's backward keeps; a LayerNorm's input, which the
//!   LayerNorm's backward keeps; an attention output the attention's
//!   backward keeps), and the weight instead of its FP8 copy where the
//!   weight is stored in F32 or FP16 (O0's FP8 compute path, O1, O2).
//!   Backward casts them again with the scale the forward's cast used (its
//!   metadata is kept: a few bytes), so the codes, and every gradient, are
//!   bit for bit those of a run that kept them; no amax is recorded twice;
//! - materialized attention (where flash attention does not run) keeps q, k
//!   and v but not the probabilities (`batch x heads x seq²` per layer),
//!   which backward computes again from q and k (flash attention never
//!   keeps them).
//!
//! No matrix product of a Linear runs twice: this is the cheap middle
//! between keeping everything and [`recompute`](super::recompute) (`full`,
//! which runs a block's whole forward again). Native products (an F32
//! weight outside an FP8 scope) keep what candle's ops keep.

use std::cell::Cell;

thread_local! {
    /// Open [`selective`] calls on this thread.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// `f()`, with the ops it runs on this thread keeping less for backward
/// (see the module's documentation); gradients unchanged, bit for bit.
///
/// ```
/// use amp_core::nn::{self, fp8_autocast, selective, ComputeMode};
/// use amp_core::CurrentScaling;
/// use candle_core::{DType, Device, Module, Tensor, Var};
/// use candle_nn::{VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let fc = nn::linear(16, 16, vb.pp("fc"))?;
/// let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (8, 16), &Device::Cpu)?)?;
/// let _fp8 = fp8_autocast(true, ComputeMode::Fp8Current(CurrentScaling::default()));
/// let kept = fc.forward(&x)?.sqr()?.sum_all()?.backward()?;
/// let kept_bytes = fc.saved_bytes()?;
/// let y = selective(|| fc.forward(&x))?;
/// assert!(fc.saved_bytes()? < kept_bytes);
/// let again = y.sqr()?.sum_all()?.backward()?;
/// let flat = |g: &candle_core::backprop::GradStore| g.get(&x).unwrap().flatten_all()?.to_vec1::<f32>();
/// assert_eq!(flat(&kept)?, flat(&again)?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn selective<R>(f: impl FnOnce() -> R) -> R {
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            // try_with: nothing to close once the thread's locals are gone
            let _ = DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
        }
    }
    DEPTH.with(|d| d.set(d.get() + 1));
    let _close = Close;
    f()
}

/// Whether a [`selective`] call is open on this thread.
pub(crate) fn active() -> bool {
    DEPTH.with(|d| d.get() > 0)
}
