//! [`StreamMark`]: a point in a device's work, to time a span of it. On
//! CUDA a timing event recorded on candle's stream, so the span is the
//! GPU time between two points of the queue, whatever the host did
//! meanwhile; on the CPU, where work runs as it is called, the wall clock.

use crate::error::Result;
use candle_core::Device;
use std::time::Instant;

/// A point in the work queued on a device (see the module docs).
#[derive(Debug)]
pub struct StreamMark(Mark);

#[derive(Debug)]
enum Mark {
    Host(Instant),
    #[cfg(feature = "cuda")]
    Cuda(candle_core::cuda_backend::cudarc::driver::CudaEvent),
}

impl StreamMark {
    /// Marks the work queued on `device` so far (CUDA: a timing event on
    /// candle's stream, no synchronization; elsewhere: now).
    ///
    /// # Errors
    /// The driver's, on CUDA.
    pub fn now(device: &Device) -> Result<Self> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => {
                use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
                use candle_core::cuda_backend::WrapErr;
                let event = dev
                    .cuda_stream()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?;
                Ok(Self(Mark::Cuda(event)))
            }
            _ => Ok(Self(Mark::Host(Instant::now()))),
        }
    }

    /// Milliseconds from `self` to `later` (CUDA: waits until the device
    /// has reached `later`). Two marks of different kinds give 0.
    ///
    /// # Errors
    /// The driver's, on CUDA.
    pub fn ms_until(&self, later: &Self) -> Result<f64> {
        match (&self.0, &later.0) {
            (Mark::Host(a), Mark::Host(b)) => {
                Ok(b.saturating_duration_since(*a).as_secs_f64() * 1e3)
            }
            #[cfg(feature = "cuda")]
            (Mark::Cuda(a), Mark::Cuda(b)) => {
                use candle_core::cuda_backend::WrapErr;
                Ok(f64::from(a.elapsed_ms(b).w()?))
            }
            #[cfg(feature = "cuda")]
            _ => Ok(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_marks_measure_forward_time() -> Result<()> {
        let a = StreamMark::now(&Device::Cpu)?;
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = StreamMark::now(&Device::Cpu)?;
        let ms = a.ms_until(&b)?;
        assert!(ms >= 5.0, "{ms}");
        assert_eq!(b.ms_until(&a)?, 0.0);
        Ok(())
    }
}
