//! [`HostReadback`]: a small F64 tensor's values brought to the host
//! behind the work queued so far, without waiting for the device when the
//! copy is queued. On CUDA the copy goes to page-locked host memory (kept
//! from one read to the next while the length stays) and only [`HostReadback::wait`] waits, for
//! the copy alone: work queued after it keeps the device busy while the
//! host goes on (the optimizer queues its updates behind the clipping
//! outcome, then reads the outcome while the updates run). On the CPU,
//! where work runs as it is called, the values are read at once.

use crate::error::{Error, Result};
use candle_core::{DType, Tensor};

/// A reusable slot for one pending device-to-host read (see the module
/// docs).
///
/// ```
/// use amp_core::HostReadback;
/// use candle_core::{Device, Tensor};
/// let mut slot = HostReadback::default();
/// slot.queue(&Tensor::new(&[1.5f64, -2.0], &Device::Cpu)?)?;
/// assert_eq!(slot.wait()?, [1.5, -2.0]);
/// assert!(slot.wait().is_err()); // nothing queued
/// # Ok::<(), amp_core::Error>(())
/// ```
#[derive(Default)]
pub struct HostReadback {
    pending: Option<Pending>,
    #[cfg(feature = "cuda")]
    pinned: Option<candle_core::cuda_backend::cudarc::driver::PinnedHostSlice<f64>>,
}

enum Pending {
    Ready(Vec<f64>),
    /// The copy's length and an event recorded behind it (our own: the
    /// pinned slice records its event only where cudarc manages the
    /// stream's synchronization, which the project turns off).
    #[cfg(feature = "cuda")]
    Pinned(usize, candle_core::cuda_backend::cudarc::driver::CudaEvent),
}

impl Drop for HostReadback {
    /// A copy still in flight finishes before its page-locked buffer is
    /// freed (cudarc's own wait on the buffer is off with event tracking).
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(Pending::Pinned(_, copied)) = self.pending.take() {
            // nothing to report an error to: the driver's is dropped, as
            // cudarc's own drops do
            let _ = copied.synchronize();
        }
    }
}

impl std::fmt::Debug for HostReadback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostReadback")
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

impl HostReadback {
    const OP: &'static str = "HostReadback";

    /// Queues the read of `t`'s values (F64, any shape, read in row-major
    /// order) behind the work queued on its device so far (on CUDA,
    /// candle's stream: a tensor made on another stream must be ordered
    /// before it, e.g. by `SideStream::compute_wait`), replacing a read
    /// queued before and not waited for.
    ///
    /// # Errors
    /// [`Error::DType`] for a tensor other than F64; the driver's.
    pub fn queue(&mut self, t: &Tensor) -> Result<()> {
        if t.dtype() != DType::F64 {
            return Err(Error::DType {
                op: Self::OP,
                expected: "F64",
                got: t.dtype(),
            });
        }
        #[cfg(feature = "cuda")]
        if let Some(Pending::Pinned(_, copied)) = self.pending.take() {
            // a read not waited for may still be copying into the buffer
            // this one reuses (from another stream where `t` is elsewhere)
            use candle_core::cuda_backend::WrapErr;
            copied.synchronize().w()?;
        }
        self.pending = None;
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(_) = t.device() {
            return self.queue_cuda(t);
        }
        self.pending = Some(Pending::Ready(t.flatten_all()?.to_vec1::<f64>()?));
        Ok(())
    }

    /// The values of the read queued last, once its copy is done (CUDA:
    /// waits for the device to reach the copy, not for work queued after).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when no read is queued; the driver's.
    pub fn wait(&mut self) -> Result<Vec<f64>> {
        match self.pending.take() {
            None => Err(Error::Unsupported {
                op: Self::OP,
                what: "wait without a queued read".into(),
            }),
            Some(Pending::Ready(v)) => Ok(v),
            #[cfg(feature = "cuda")]
            Some(Pending::Pinned(n, done)) => {
                use candle_core::cuda_backend::WrapErr;
                done.synchronize().w()?;
                let host = self.pinned.as_ref().ok_or_else(|| Error::Unsupported {
                    op: Self::OP,
                    what: "the host buffer is gone".into(),
                })?;
                Ok(host.as_slice().w()?.get(..n).unwrap_or_default().to_vec())
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn queue_cuda(&mut self, t: &Tensor) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::sys::{
            CUevent_flags, CU_MEMHOSTALLOC_PORTABLE,
        };
        use candle_core::cuda_backend::WrapErr;
        use candle_core::Storage;
        let t = t.flatten_all()?.contiguous()?;
        let n = t.elem_count();
        if n == 0 {
            self.pending = Some(Pending::Ready(Vec::new()));
            return Ok(());
        }
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err(Error::Unsupported {
                op: Self::OP,
                what: "a CUDA tensor without CUDA storage".into(),
            });
        };
        let (start, end) = layout
            .contiguous_offsets()
            .ok_or_else(|| Error::Unsupported {
                op: Self::OP,
                what: "a non-contiguous tensor".into(),
            })?;
        let src = cs.as_cuda_slice::<f64>()?.slice(start..end);
        let stream = cs.device.cuda_stream();
        // of exactly n values: the driver's copy takes its length from the
        // host side
        if self.pinned.as_ref().is_none_or(|p| p.len() != n) {
            // SAFETY: written by the copy below before any read of it
            // (`wait` reads it after the copy's event).
            let host = unsafe {
                stream
                    .context()
                    .alloc_pinned_with_flags::<f64>(n, CU_MEMHOSTALLOC_PORTABLE)
            }
            .w()?;
            self.pinned = Some(host);
        }
        let host = self.pinned.as_mut().ok_or_else(|| Error::Unsupported {
            op: Self::OP,
            what: "the host buffer is gone".into(),
        })?;
        stream.memcpy_dtoh(&src, host).w()?;
        // no blocking flag: the wait follows the context's scheduling
        // policy, as the stream synchronize of a plain read does
        let done = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .w()?;
        self.pending = Some(Pending::Pinned(n, done));
        Ok(())
    }
}
