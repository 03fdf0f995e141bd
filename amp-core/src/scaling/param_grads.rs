//! Parameter gradients handed over outside candle's `GradStore`.
//!
//! candle's backprop gives every gradient it receives a zero-filled
//! tensor and an add, one fill and one add a parameter a step. Inside
//! [`collect_param_grads`], our ops (the Linear's op: its bias and an F32
//! weight without a sink; the LayerNorm's: its weight and bias) hand the
//! gradients of the `Var`s they take directly to a per-thread collection
//! instead, returning none to candle; the caller puts them into the
//! `GradStore` afterwards ([`ParamGrads::insert_into`]), where the rest
//! of the code finds them as before. The values are candle's: a
//! parameter's gradients are summed in the order the backward hands them
//! over, as candle adds them (its zero fill adds nothing).

use crate::error::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId};
use std::cell::RefCell;
use std::collections::HashMap;

thread_local! {
    /// This thread's collection, while a [`collect_param_grads`] runs.
    static COLLECTED: RefCell<Option<HashMap<TensorId, (Tensor, Tensor)>>> =
        const { RefCell::new(None) };
}

/// The parameter gradients a [`collect_param_grads`] run collected: each
/// `Var`'s sum of what the ops handed over.
#[derive(Debug, Default)]
pub struct ParamGrads(HashMap<TensorId, (Tensor, Tensor)>);

impl ParamGrads {
    /// How many parameters have a gradient here.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none has.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Puts every gradient into `store` (added to one candle collected for
    /// the same parameter through its own graph, if any).
    ///
    /// # Errors
    /// candle's, for a gradient of another shape than the store's.
    pub fn insert_into(self, store: &mut GradStore) -> Result<()> {
        for (_, (param, grad)) in self.0 {
            let grad = match store.get(&param) {
                Some(g) => (g + grad)?,
                None => grad,
            };
            store.insert(&param, grad);
        }
        Ok(())
    }
}

/// Runs `f` (a backward) with this thread's ops handing the gradients of
/// the `Var`s they take to the returned [`ParamGrads`] instead of
/// candle's `GradStore` (see the module docs). Not nested: an inner run
/// keeps the outer collection.
pub fn collect_param_grads<R>(f: impl FnOnce() -> R) -> (R, ParamGrads) {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            if self.0 {
                let _ = COLLECTED.try_with(|c| c.borrow_mut().take());
            }
        }
    }
    let opened = COLLECTED.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_some() {
            return false;
        }
        *c = Some(HashMap::new());
        true
    });
    let reset = Reset(opened);
    let out = f();
    let grads = match opened {
        true => COLLECTED
            .with(|c| c.borrow_mut().take())
            .unwrap_or_default(),
        false => HashMap::new(),
    };
    drop(reset);
    (out, ParamGrads(grads))
}

/// An op's gradient `grad` of its argument `param`: kept in this thread's
/// collection (and `None` returned to candle) where a
/// [`collect_param_grads`] runs and `param` is a `Var`; otherwise `grad`.
pub(crate) fn hand_over(param: &Tensor, grad: Option<Tensor>) -> Result<Option<Tensor>> {
    let Some(grad) = grad else {
        return Ok(None);
    };
    if !param.is_variable() {
        return Ok(Some(grad));
    }
    COLLECTED.with(|c| {
        let mut c = c.borrow_mut();
        let Some(map) = c.as_mut() else {
            return Ok(Some(grad));
        };
        if grad.shape() != param.shape() {
            return Err(Error::Shape {
                op: "collect_param_grads",
                lhs: param.shape().clone(),
                rhs: grad.shape().clone(),
            });
        }
        let grad = grad.detach();
        match map.remove(&param.id()) {
            Some((p, sum)) => map.insert(param.id(), (p, (sum + grad)?)),
            None => map.insert(param.id(), (param.clone(), grad)),
        };
        Ok(None)
    })
}
