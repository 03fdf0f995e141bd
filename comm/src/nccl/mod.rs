//! The NCCL backend: one process per GPU, NCCL through cudarc (NCCL 2.28's
//! API), collectives on candle's CUDA tensors on candle's own stream.
//!
//! Set-up follows `torchrun` ([`LaunchEnv`]): `LOCAL_RANK` picks
//! `cuda:LOCAL_RANK`, rank 0 makes NCCL's unique id and hands it to the
//! others over TCP ([`rendezvous`]), then every rank joins the NCCL
//! communicator.
//!
//! Every collective is enqueued on the communicator's own stream (a
//! [`SideStream`] beside candle's, [`Communicator::side_stream`]), fenced
//! with events: that stream first waits for the kernels enqueued on
//! candle's stream (which made the inputs), and candle's stream then
//! waits for the collective before the kernels that read its output. No
//! host synchronisation, except in [`barrier`](Communicator::barrier),
//! which must wait by definition. Inside [`SideStream::run`] the fences
//! are the run's: the bucketed FP8 reductions run their kernels and
//! collectives there, and under [`amp_core::defer_side_work`] overlap
//! candle's later kernels (docs/ARCHITECTURE.md, "Overlap with the
//! backward"). Outputs are allocated on the communicator's stream.
//! The data-moving collectives (gathers, broadcast, all-to-all) send the
//! tensors' bytes (any dtype; FP8 codes travel as `U8`); the reductions
//! take F32.
//!
//! Uneven chunks ([`shard_range`](crate::shard_range)) are padded to
//! `ceil(L / N)` for NCCL's even reduce-scatter and trimmed after; an
//! uneven `all_gather_shards` is grouped sends and receives into place; [`bytes_sent`](Communicator::bytes_sent) counts the
//! trait's logical bytes, not the padding.
//!
//! **Max and NaN.** NCCL's max drops NaN (it is `fmax`-like), while the
//! trait says NaN wins; `all_reduce`/`reduce_scatter` with
//! [`ReduceOp::Max`] therefore reduce the values with NaN replaced by
//! +inf together with a 0/1 NaN flag per element (twice the elements on
//! the wire, a cost paid only by max, which serves amaxes of one element).
//!
//! **Sum order.** NCCL chooses the order of the additions (ring, tree);
//! every rank still receives the same result.
//!
//! **Timeouts.** The rendezvous is bounded ([`RendezvousConfig::timeout`]);
//! NCCL's own collectives have none. Each communicator runs a watchdog of
//! its own ([`watchdog`]): a collective that has not completed 600 s
//! (`AMP_NCCL_TIMEOUT_S`; 0 turns it off) after its enqueue began ends the
//! process with an error naming it, as PyTorch's watchdog does, instead of
//! a hang when another rank has died. `torchrun` ends the whole group when
//! one process exits with an error, which is the usual way out.

mod buffer;
mod collectives;
mod watchdog;

use crate::error::{Error, Result};
use crate::launch::{LaunchEnv, RendezvousConfig};
use crate::rendezvous::{rendezvous, UNIQUE_ID_BYTES};
use amp_core::SideStream;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Tensor};
use cudarc::nccl::{result::NcclError, Comm, Id};
use std::sync::atomic::{AtomicU64, Ordering};

const BACKEND: &str = "nccl";

/// One rank of an NCCL group: this process, its GPU, and the NCCL
/// communicator on its own stream beside candle's.
///
/// Make tensors on [`device`](crate::Communicator::device) (the same
/// `Device` value: candle tells CUDA devices apart by the instance).
/// Neither `Send` nor `Sync`: it holds an NCCL communicator, which belongs
/// to the thread that made it.
///
/// ```no_run
/// use amp_comm::{Communicator, NcclComm};
/// use candle_core::Tensor;
/// // Under `torchrun --nproc-per-node 2 ...`, or with RANK, WORLD_SIZE,
/// // LOCAL_RANK, MASTER_ADDR, MASTER_PORT set by hand:
/// let comm = NcclComm::from_env()?;
/// let g = Tensor::ones(1024, candle_core::DType::F32, comm.device())?;
/// let sum = comm.all_reduce_sum(&g)?; // = world size, everywhere
/// # Ok::<(), amp_comm::Error>(())
/// ```
pub struct NcclComm {
    comm: Comm,
    device: Device,
    cuda: CudaDevice,
    /// The stream NCCL runs on ([`Communicator::side_stream`]).
    side: SideStream,
    /// Ends the process when a collective never completes ([`watchdog`]).
    watchdog: Option<watchdog::Watchdog>,
    bytes: AtomicU64,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

fn nccl_err(op: &'static str) -> impl Fn(NcclError) -> Error {
    move |e| Error::Nccl {
        op,
        detail: format!("{e:?}"),
    }
}

impl NcclComm {
    /// Joins the group `torchrun` (or a shell loop) describes in the
    /// environment: [`LaunchEnv::from_env`], [`RendezvousConfig::from_env`],
    /// then [`new`](Self::new).
    ///
    /// # Errors
    /// [`Error::Env`] naming a missing or invalid variable, and the errors
    /// of [`new`](Self::new).
    pub fn from_env() -> Result<Self> {
        let launch = LaunchEnv::from_env()?;
        let rdv = RendezvousConfig::from_env(&launch)?;
        Self::new(&launch, &rdv)
    }

    /// Opens `cuda:LOCAL_RANK` and joins the group as rank `launch.rank`
    /// of `launch.world_size`.
    ///
    /// # Errors
    /// [`Error::Env`] naming `LOCAL_RANK` when that GPU cannot be opened,
    /// and the errors of [`with_device`](Self::with_device).
    pub fn new(launch: &LaunchEnv, rendezvous: &RendezvousConfig) -> Result<Self> {
        let device = Device::new_cuda(launch.local_rank).map_err(|e| Error::Env {
            op: "NcclComm::new",
            var: "LOCAL_RANK",
            what: format!("cannot open cuda:{}: {e}", launch.local_rank),
        })?;
        Self::with_device(device, launch.rank, launch.world_size, rendezvous)
    }

    /// Joins the group as rank `rank` of `world_size` on `device` (a CUDA
    /// device), with the NCCL id from the rendezvous at `rendezvous`.
    ///
    /// # Errors
    /// [`Error::UnsupportedDevice`] off CUDA; the [`rendezvous`] errors
    /// ([`Error::Timeout`] naming missing ranks, [`Error::Mismatch`] for
    /// ranks of different worlds); [`Error::Nccl`] when NCCL refuses.
    pub fn with_device(
        device: Device,
        rank: usize,
        world_size: usize,
        rendezvous_at: &RendezvousConfig,
    ) -> Result<Self> {
        const OP: &str = "NcclComm::with_device";
        let cuda = match &device {
            Device::Cuda(d) => d.clone(),
            other => {
                return Err(Error::UnsupportedDevice {
                    op: OP,
                    backend: BACKEND,
                    device: other.location(),
                })
            }
        };
        cuda.cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(candle_core::Error::wrap)?;
        let side = SideStream::new(&device)?.ok_or(Error::UnsupportedDevice {
            op: OP,
            backend: BACKEND,
            device: device.location(),
        })?;
        let id = rendezvous(rendezvous_at, rank, world_size, || {
            let id = Id::new().map_err(nccl_err(OP))?;
            Ok(id.internal().map(|c| c as u8))
        })?;
        let id: [u8; UNIQUE_ID_BYTES] = id;
        let stream = side.cuda_stream().clone();
        let comm = Comm::from_rank(stream, rank, world_size, Id::uninit(id.map(|b| b as _)))
            .map_err(nccl_err(OP))?;
        let watchdog = match watchdog::timeout_from_env(OP)? {
            Some(timeout) => Some(watchdog::Watchdog::start(
                side.cuda_stream(),
                rank,
                world_size,
                timeout,
            )?),
            None => None,
        };
        Ok(Self {
            comm,
            device,
            cuda,
            side,
            watchdog,
            bytes: AtomicU64::new(0),
        })
    }

    /// The version of the NCCL library loaded (e.g. 22809 for 2.28.9).
    ///
    /// # Errors
    /// [`Error::Nccl`] when NCCL cannot answer.
    pub fn nccl_version() -> Result<i32> {
        cudarc::nccl::result::get_nccl_version().map_err(nccl_err("NcclComm::nccl_version"))
    }

    fn check(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.device().same_device(&self.device) {
            Ok(())
        } else {
            Err(Error::Device {
                op,
                expected: self.device.location(),
                got: t.device().location(),
            })
        }
    }

    fn check_f32(&self, op: &'static str, t: &Tensor) -> Result<()> {
        self.check(op, t)?;
        if t.dtype() == DType::F32 {
            Ok(())
        } else {
            Err(Error::DType {
                op,
                expected: "F32",
                got: t.dtype(),
            })
        }
    }

    /// Makes this GPU's context current on the calling thread (NCCL looks
    /// up the device there).
    fn enter(&self) -> Result<()> {
        self.cuda
            .cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(|e| Error::Candle(candle_core::Error::wrap(e)))
    }

    fn count(&self, bytes: usize) {
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}
