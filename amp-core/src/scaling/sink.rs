//! `GradSink`: where FP8 Linear layers hand their weight gradients, as FP8
//! scaling tensors, instead of candle's `GradStore`; and
//! [`with_sink_listener`], which lets a caller act on each gradient as the
//! backward hands it over (data parallelism starts reducing a bucket of
//! them before the backward has finished).

use crate::error::{Error, Result};
use crate::numerics::recipe::CurrentScaling;
use crate::scaling::tensor::ScalingTensor;
use candle_core::DType;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What [`with_sink_listener`] calls after each [`GradSink::add`].
type Listener<'a> = Box<dyn FnMut(&GradSink, &str) -> Result<()> + 'a>;

thread_local! {
    /// This thread's listener (a `'static` box of a shorter-lived closure:
    /// see [`with_sink_listener`]).
    static LISTENER: RefCell<Option<Listener<'static>>> = const { RefCell::new(None) };
}

/// Runs `body` with `listener` called after every [`GradSink::add`] made on
/// this thread meanwhile (candle's backward runs on the calling thread),
/// with the sink and the gradient's name, once the sink holds it. An error
/// of the listener is the error of that `add` (and so of the backward).
/// The listener is not called from within itself (its own sink calls do
/// not recurse), and is removed when `body` returns or panics.
///
/// # Errors
/// `body`'s.
pub fn with_sink_listener<'a, R>(
    listener: impl FnMut(&GradSink, &str) -> Result<()> + 'a,
    body: impl FnOnce() -> R,
) -> R {
    struct Reset(Option<Listener<'static>>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let prev = self.0.take();
            LISTENER.with(|l| *l.borrow_mut() = prev);
        }
    }
    let boxed: Listener<'a> = Box::new(listener);
    // SAFETY: the box is removed from the thread-local by `Reset` before
    // this function returns (or unwinds), so it never outlives 'a.
    let boxed: Listener<'static> = unsafe { std::mem::transmute(boxed) };
    let prev = LISTENER.with(|l| l.borrow_mut().replace(boxed));
    let _reset = Reset(prev);
    body()
}

/// Calls this thread's listener, if any, taken out for the call.
fn notify(sink: &GradSink, name: &str) -> Result<()> {
    let Some(mut f) = LISTENER.with(|l| l.borrow_mut().take()) else {
        return Ok(());
    };
    let out = f(sink, name);
    LISTENER.with(|l| *l.borrow_mut() = Some(f));
    out
}

/// Weight gradients by layer weight name (`<layer prefix>.weight`); clones
/// share the same store. Two gradients for one name (a weight used twice)
/// are summed in f32 and re-encoded.
#[derive(Debug, Clone, Default)]
pub struct GradSink(Arc<Mutex<HashMap<String, ScalingTensor>>>);

impl GradSink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a gradient.
    ///
    /// # Errors
    /// [`Error::Poisoned`]; candle's on a shape mismatch when summing.
    pub fn add(&self, name: &str, grad: ScalingTensor) -> Result<()> {
        let mut map = self.0.lock().map_err(|_| Error::Poisoned {
            op: "GradSink::add",
        })?;
        let grad = match map.remove(name) {
            None => grad,
            Some(prev) => {
                let sum = (prev.dequantize(DType::F32)? + grad.dequantize(DType::F32)?)?;
                ScalingTensor::quantize(&sum, grad.qtype(), &CurrentScaling::default())?.0
            }
        };
        map.insert(name.to_string(), grad);
        drop(map);
        notify(self, name)
    }

    /// Takes one gradient out, if the sink holds it.
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn take_one(&self, name: &str) -> Result<Option<ScalingTensor>> {
        let mut map = self.0.lock().map_err(|_| Error::Poisoned {
            op: "GradSink::take_one",
        })?;
        Ok(map.remove(name))
    }

    /// Takes every gradient out, leaving the sink empty.
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn take(&self) -> Result<HashMap<String, ScalingTensor>> {
        let mut map = self.0.lock().map_err(|_| Error::Poisoned {
            op: "GradSink::take",
        })?;
        Ok(std::mem::take(&mut *map))
    }

    /// Bytes held by the gradients now in the sink.
    ///
    /// # Errors
    /// [`Error::Poisoned`].
    pub fn nbytes(&self) -> Result<usize> {
        let map = self.0.lock().map_err(|_| Error::Poisoned {
            op: "GradSink::nbytes",
        })?;
        Ok(map.values().map(ScalingTensor::nbytes).sum())
    }
}
