//! [`with_embedding_backward`]: a caller's say over an embedding table's
//! gradient while a backward runs. Data parallelism uses it to average a
//! large table's gradient from every rank's looked-up rows (a few
//! megabytes a rank) instead of the whole table (`rows x cols` F32): the
//! rows are all the gradient depends on.

use crate::error::Result;
use candle_core::Tensor;
use std::cell::RefCell;

/// One F32 lookup's backward, as [`with_embedding_backward`]'s hook sees
/// it.
#[derive(Debug, Clone, Copy)]
pub struct LookupGrad<'a> {
    /// The table looked up (`[rows, cols]`, the tensor the lookup read:
    /// a `Var`'s own tensor when the model passes the variable).
    pub table: &'a Tensor,
    /// The ids, flat (`[n]` U32).
    pub ids: &'a Tensor,
    /// The gradient of the looked-up rows (`[n, cols]` F32).
    pub grad: &'a Tensor,
}

/// What the hook of [`with_embedding_backward`] is.
type Hook<'a> = Box<dyn FnMut(&LookupGrad<'_>) -> Result<bool> + 'a>;

thread_local! {
    /// This thread's hook (a `'static` box of a shorter-lived closure: see
    /// [`with_embedding_backward`]).
    static HOOK: RefCell<Option<Hook<'static>>> = const { RefCell::new(None) };
}

/// Runs `body` with `hook` offered the backward of every F32 embedding
/// lookup ([`embedding`](crate::nn::embedding)) made on this thread
/// meanwhile (candle's backward runs on the calling thread). Where the hook
/// returns `true` it has taken the table's gradient from this lookup (it
/// keeps what it computed from the lookup's rows, e.g. with
/// [`embedding_grad`](crate::nn::embedding_grad)), and candle's
/// `GradStore` receives none from it: a table used elsewhere too (a tied
/// head) gets only those other uses' gradients there, for the caller to
/// add. With `false`, or without a hook, the lookup's gradient goes to the
/// `GradStore` as always. An error of the hook is the backward's. The hook
/// is not called from within itself and is removed when `body` returns or
/// panics.
///
/// ```
/// use amp_core::nn::{embedding, embedding_grad, with_embedding_backward};
/// use candle_core::{Device, Tensor, Var};
/// let table = Var::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &Device::Cpu)?;
/// let ids = Tensor::new(&[2u32, 0, 2], &Device::Cpu)?;
/// let mut taken = None;
/// let rows = embedding(&ids, table.as_tensor())?;
/// let store = with_embedding_backward(
///     |l| {
///         taken = Some(embedding_grad(l.ids, l.grad, l.table.dims2()?.0, 0.5)?);
///         Ok(true)
///     },
///     || rows.sum_all()?.backward(),
/// )?;
/// assert!(store.get(table.as_tensor()).is_none());
/// let g = taken.ok_or("the hook took no gradient")?.to_vec2::<f32>()?;
/// assert_eq!(g, [[0.5, 0.5], [0.0, 0.0], [1.0, 1.0]]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn with_embedding_backward<'a, R>(
    hook: impl FnMut(&LookupGrad<'_>) -> Result<bool> + 'a,
    body: impl FnOnce() -> R,
) -> R {
    struct Reset(Option<Hook<'static>>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let prev = self.0.take();
            HOOK.with(|h| *h.borrow_mut() = prev);
        }
    }
    let boxed: Hook<'a> = Box::new(hook);
    // SAFETY: the box is removed from the thread-local by `Reset` before
    // this function returns (or unwinds), so it never outlives 'a.
    let boxed: Hook<'static> = unsafe { std::mem::transmute(boxed) };
    let prev = HOOK.with(|h| h.borrow_mut().replace(boxed));
    let _reset = Reset(prev);
    body()
}

/// Offers a lookup's backward to this thread's hook, if any (taken out for
/// the call): whether it took the table's gradient.
pub(super) fn offer(lookup: &LookupGrad<'_>) -> Result<bool> {
    let Some(mut hook) = HOOK.with(|h| h.borrow_mut().take()) else {
        return Ok(false);
    };
    let out = hook(lookup);
    HOOK.with(|h| *h.borrow_mut() = Some(hook));
    out
}
