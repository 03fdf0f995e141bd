//! [`SideStream`]: a second CUDA stream beside candle's, for work that
//! should overlap candle's kernels (a data-parallel group's gradient
//! reductions during the backward; docs/ARCHITECTURE.md, "Overlap with the
//! backward").
//!
//! candle runs every op on one stream per device, and this project turns
//! cudarc's per-buffer events off (docs/ARCHITECTURE.md, "cudarc's event
//! tracking"), so work on a second stream is ordered by explicit fences
//! only:
//!
//! - [`SideStream::run`] makes the side stream wait for everything already
//!   enqueued on candle's stream, then runs its closure with this crate's
//!   bucket kernels (`bucket_*`) launched, and their outputs allocated, on
//!   the side stream (a communicator bound to the same stream puts its
//!   collectives there too); at the end candle's stream waits for the side
//!   stream, so the results can be used at once, as if everything had run
//!   on one stream.
//! - Inside [`defer_side_work`], `run` leaves that last wait out: candle's
//!   stream goes on with later kernels (the rest of the backward) while
//!   the side stream works. The caller then owes two things: to call
//!   [`SideStream::compute_wait`] before any candle op reads a result, and
//!   to keep every input of the deferred work (tensors made on candle's
//!   stream) alive until then, since freeing one returns its memory to
//!   candle's stream while the side stream may still read it.
//!
//! The other direction needs no fence: a result the side stream made (its
//! memory allocated there) may be freed from candle's stream's side at
//! any time after `compute_wait`, since the side stream writes only after
//! it has waited for candle's stream, and its own later allocations follow
//! the free on its stream (the optimizer drops the averaged gradients as
//! soon as their updates are queued).
//!
//! A closure given to `run` may only launch work that follows the stream:
//! the `bucket_*` kernels and a bound communicator's collectives. A candle
//! op inside it would run on candle's stream, unordered with the side
//! stream's work.
//!
//! On devices other than CUDA there is no side stream
//! ([`SideStream::new`] returns `None`) and nothing to order.

use crate::error::Result;
use candle_core::Device;
use std::cell::Cell;

thread_local! {
    /// Set inside [`defer_side_work`].
    static DEFER: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with [`SideStream::run`]'s final wait left out: the side
/// stream's work may still run when `f` returns. The caller must call
/// [`SideStream::compute_wait`] before reading any result of it on
/// candle's stream, and keep the inputs of that work alive until then (see
/// the module docs).
pub fn defer_side_work<R>(f: impl FnOnce() -> R) -> R {
    let before = DEFER.with(|d| d.replace(true));
    let out = f();
    DEFER.with(|d| d.set(before));
    out
}

fn deferring() -> bool {
    DEFER.with(Cell::get)
}

/// A second stream of a CUDA device (see the module docs).
pub struct SideStream {
    #[cfg(feature = "cuda")]
    inner: cuda::Inner,
}

impl std::fmt::Debug for SideStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SideStream")
    }
}

impl SideStream {
    /// A new stream beside candle's on `device`; `None` for a device other
    /// than CUDA (or in a build without the `cuda` feature).
    ///
    /// # Errors
    /// The driver's, when the stream or its events cannot be made.
    pub fn new(device: &Device) -> Result<Option<Self>> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => Ok(Some(Self {
                inner: cuda::Inner::new(dev)?,
            })),
            _ => Ok(None),
        }
    }

    /// The side stream waits (on the device) for everything enqueued on
    /// candle's stream so far.
    ///
    /// # Errors
    /// The driver's.
    pub fn wait_for_compute(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        self.inner.wait_for_compute()?;
        Ok(())
    }

    /// candle's stream waits (on the device) for everything enqueued on the
    /// side stream so far. The host does not wait.
    ///
    /// # Errors
    /// The driver's.
    pub fn compute_wait(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        self.inner.compute_wait()?;
        Ok(())
    }

    /// Whether the calling thread is inside this stream's [`run`](Self::run).
    pub fn is_current(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.inner.is_current();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Runs `f` with the `bucket_*` kernels on this stream, fenced on both
    /// sides, or only at the start inside [`defer_side_work`] (see the
    /// module docs). Nested calls run on the outer call's stream.
    ///
    /// # Errors
    /// `f`'s, and the driver's for the fences.
    pub fn run<R, E: From<crate::error::Error>>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        if self.is_current() {
            return f();
        }
        self.wait_for_compute()?;
        #[cfg(feature = "cuda")]
        let out = self.inner.enter(f);
        #[cfg(not(feature = "cuda"))]
        let out = f();
        if !deferring() {
            self.compute_wait()?;
        }
        out
    }

    /// The CUDA stream.
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(
        &self,
    ) -> &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream> {
        &self.inner.stream
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    //! The CUDA side: the stream, two reusable events, the thread's current
    //! stream.

    use crate::error::Result;
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream};
    use candle_core::cuda_backend::{CudaDevice, WrapErr};
    use std::cell::RefCell;
    use std::sync::Arc;

    thread_local! {
        /// The stream of the innermost [`SideStream::run`](super::SideStream::run).
        static CURRENT: RefCell<Option<Arc<CudaStream>>> = const { RefCell::new(None) };
    }

    pub(crate) struct Inner {
        pub(crate) stream: Arc<CudaStream>,
        compute: Arc<CudaStream>,
        /// Recorded on candle's stream, waited on by the side stream.
        to_side: CudaEvent,
        /// Recorded on the side stream, waited on by candle's.
        to_compute: CudaEvent,
    }

    impl Inner {
        pub(crate) fn new(dev: &CudaDevice) -> Result<Self> {
            let compute = dev.cuda_stream();
            let ctx = compute.context().clone();
            let stream = ctx.new_stream().w()?;
            let flags = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
            Ok(Self {
                to_side: ctx.new_event(flags).w()?,
                to_compute: ctx.new_event(flags).w()?,
                stream,
                compute,
            })
        }

        pub(crate) fn wait_for_compute(&self) -> Result<()> {
            self.to_side.record(&self.compute).w()?;
            self.stream.wait(&self.to_side).w()?;
            Ok(())
        }

        pub(crate) fn compute_wait(&self) -> Result<()> {
            self.to_compute.record(&self.stream).w()?;
            self.compute.wait(&self.to_compute).w()?;
            Ok(())
        }

        pub(crate) fn is_current(&self) -> bool {
            CURRENT.with(|c| {
                c.borrow()
                    .as_ref()
                    .is_some_and(|s| s.cu_stream() == self.stream.cu_stream())
            })
        }

        pub(crate) fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
            let before = CURRENT.with(|c| c.replace(Some(self.stream.clone())));
            let out = f();
            CURRENT.with(|c| *c.borrow_mut() = before);
            out
        }
    }

    /// The stream this crate's bucket kernels run on for `dev`: the
    /// current side stream if it belongs to `dev`'s context, else candle's.
    pub(crate) fn current_stream(dev: &CudaDevice) -> Arc<CudaStream> {
        let compute = dev.cuda_stream();
        CURRENT
            .with(|c| {
                c.borrow()
                    .as_ref()
                    .filter(|s| s.context().cu_ctx() == compute.context().cu_ctx())
                    .cloned()
            })
            .unwrap_or(compute)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_side_stream_off_cuda_and_deferral_nests() {
        assert!(SideStream::new(&Device::Cpu).unwrap().is_none());
        assert!(!deferring());
        defer_side_work(|| {
            assert!(deferring());
            defer_side_work(|| assert!(deferring()));
            assert!(deferring());
        });
        assert!(!deferring());
    }
}
