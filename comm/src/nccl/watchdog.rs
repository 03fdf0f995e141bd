//! A watchdog of our own for NCCL. NCCL's collectives have no timeout: a
//! rank that dies leaves the others spinning in a collective's kernel and
//! their host blocked at its next synchronization, forever. Each
//! [`NcclComm`](super::NcclComm) therefore records an event on its stream
//! after every collective, and a thread polls the latest one: when it has
//! not completed `timeout` after it was recorded, the thread says on
//! stderr which collective of which rank waited how long, and aborts the
//! process (no exit handlers: tearing down a context whose kernel never
//! ends can block; `torchrun` then ends the rest of the group, and every
//! other rank's own watchdog fires in any case).
//!
//! Off unless `AMP_NCCL_TIMEOUT_S` names a timeout in seconds (PyTorch's
//! default is 600): its first run on two GPUs (`scripts/gpu/watchdog.sh`)
//! ended at the device call's time limit without a word from either rank,
//! cause not established (the ranks may not have reached a collective
//! when one was killed), so it stays opt-in until that script shows it
//! firing.

use crate::error::{Error, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The variable that sets the timeout, in seconds (unset or 0: off).
pub(crate) const TIMEOUT_VAR: &str = "AMP_NCCL_TIMEOUT_S";

/// The timeout `AMP_NCCL_TIMEOUT_S` asks for: `None` when it is unset or 0.
///
/// # Errors
/// [`Error::Env`] for a value that is not a whole number of seconds.
pub(crate) fn timeout_from_env(op: &'static str) -> Result<Option<Duration>> {
    match std::env::var(TIMEOUT_VAR) {
        Err(_) => Ok(None),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(0) => Ok(None),
            Ok(s) => Ok(Some(Duration::from_secs(s))),
            Err(_) => Err(Error::Env {
                op,
                var: TIMEOUT_VAR,
                what: format!("`{v}` is not a whole number of seconds (0 turns the watchdog off)"),
            }),
        },
    }
}

/// The latest collective: its name, when it was enqueued, and whether any was.
struct Latest {
    op: &'static str,
    at: Instant,
    any: bool,
}

struct Shared {
    event: CudaEvent,
    latest: Mutex<Latest>,
    stop: AtomicBool,
}

/// The watchdog of one communicator; stops its thread when dropped.
pub(super) struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the thread for rank `rank` of `world` on `ctx`.
    ///
    /// # Errors
    /// The driver's, when the event cannot be made; the OS's, when the
    /// thread cannot start.
    pub(super) fn start(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let event = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| Error::Candle(candle_core::Error::wrap(e)))?;
        let shared = Arc::new(Shared {
            event,
            latest: Mutex::new(Latest {
                op: "",
                at: Instant::now(),
                any: false,
            }),
            stop: AtomicBool::new(false),
        });
        let (s, ctx) = (shared.clone(), ctx.clone());
        let poll = (timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let thread = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{rank}"))
            .spawn(move || {
                let _ = ctx.bind_to_thread();
                while !s.stop.load(Ordering::Acquire) {
                    std::thread::park_timeout(poll);
                    let Ok(latest) = s.latest.lock() else {
                        return;
                    };
                    if !latest.any || latest.at.elapsed() < timeout {
                        continue;
                    }
                    // queried under the lock: no newer record in between
                    if let Ok(false) = s.event.try_is_complete() {
                        eprintln!(
                            "error: rank {rank} of {world}: NCCL's `{}` has not completed {} s \
                             after it was enqueued ({TIMEOUT_VAR} = {} s): another rank has \
                             died or hangs; aborting",
                            latest.op,
                            latest.at.elapsed().as_secs(),
                            timeout.as_secs()
                        );
                        std::process::abort();
                    }
                }
            })
            .map_err(|e| Error::InvalidArgument {
                op: "NcclComm watchdog",
                what: format!("cannot start its thread: {e}"),
            })?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Marks collective `op`, just enqueued on `stream`, as the latest.
    ///
    /// # Errors
    /// The driver's.
    pub(super) fn mark(&self, op: &'static str, stream: &CudaStream) -> Result<()> {
        let mut latest = self
            .shared
            .latest
            .lock()
            .map_err(|_| Error::InvalidArgument {
                op,
                what: "the watchdog's lock is poisoned".into(),
            })?;
        self.shared
            .event
            .record(stream)
            .map_err(|e| Error::Candle(candle_core::Error::wrap(e)))?;
        *latest = Latest {
            op,
            at: Instant::now(),
            any: true,
        };
        Ok(())
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}
