//! [`CommStats`]: what one optimizer step of a data-parallel group spent
//! on communication: buckets, bytes sent, and the time the step waited.

use crate::error::Result;
use amp_core::StreamMark;

/// One step's communication on this rank ([`AmpOptimizer::last_comm`](
/// crate::AmpOptimizer::last_comm)).
#[derive(Debug, Default)]
pub struct CommStats {
    /// Buckets reduced (gradient buckets, and at O3 the FP8 weight
    /// gathers after the step).
    pub buckets: usize,
    /// Of those, the buckets reduced while the backward still ran.
    pub overlapped: usize,
    /// Bytes this rank sent, as the
    /// [`Communicator`](amp_comm::Communicator) counts them.
    pub wire_bytes: u64,
    /// The spans of the step's work in which the device (or, on the CPU,
    /// the thread) did nothing but communicate: from the end of the
    /// backward to the gradients' arrival, and at O3 the weight gathers.
    spans: Vec<(StreamMark, StreamMark)>,
    /// Of those, the span of O3's weight gathers after the step.
    gather: Option<(StreamMark, StreamMark)>,
}

impl CommStats {
    /// Adds a span that only communicated.
    pub(crate) fn push_span(&mut self, from: StreamMark, to: StreamMark) {
        self.spans.push((from, to));
    }

    /// Adds the span of O3's weight gathers after the step (only
    /// communicated).
    pub(crate) fn push_gather_span(&mut self, from: StreamMark, to: StreamMark) {
        self.gather = Some((from, to));
    }

    /// Of [`exposed_ms`](Self::exposed_ms), the milliseconds of O3's weight
    /// gathers after the step (`None` without them).
    ///
    /// # Errors
    /// The driver's, on CUDA.
    pub fn gather_ms(&self) -> Result<Option<f64>> {
        Ok(self
            .gather
            .as_ref()
            .map(|(a, b)| a.ms_until(b))
            .transpose()?)
    }

    /// Milliseconds the step waited for communication (the spans summed;
    /// on CUDA read from timing events on candle's stream, which waits for
    /// the device to reach them).
    ///
    /// # Errors
    /// The driver's, on CUDA.
    pub fn exposed_ms(&self) -> Result<f64> {
        let mut ms = 0.0;
        for (a, b) in &self.spans {
            ms += a.ms_until(b)?;
        }
        Ok(ms + self.gather_ms()?.unwrap_or(0.0))
    }
}
