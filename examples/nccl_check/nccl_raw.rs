//! [`CopyEngine`]: NCCL's collectives that move bytes with the GPU's copy
//! engines instead of kernels (NCCL 2.28: `ncclAlltoAll` and
//! `ncclAllGather` on one host), so that they take no multiprocessors
//! from the kernels that run beside them (the backward's, while gradient
//! buckets are exchanged).
//!
//! NCCL takes that path only when all of these hold: the communicator was
//! made with `CTAPolicy = NCCL_CTA_POLICY_ZERO`, every rank is on one
//! host with direct peer access (`symmetricSupport`), and both buffers
//! lie in windows registered with `NCCL_WIN_COLL_SYMMETRIC` (memory from
//! `ncclMemAlloc`, the same offsets on every rank); otherwise it runs its
//! kernels as usual. A `CopyEngine` is a communicator of its own, made
//! with that policy or NCCL's default one, and [`Window`]s it registers:
//! what `--bench-ce` measures against the backend's own exchange. The
//! library does not use them (BENCHMARKS.md, "NCCL's copy engines",
//! says why).

use anyhow::{anyhow, Result};
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::cudarc::nccl::sys;
use std::ffi::{c_void, CStr};
use std::rc::Rc;
use std::sync::Arc;

/// `NCCL_CTA_POLICY_ZERO` (nccl.h).
const CTA_POLICY_ZERO: i32 = 2;
/// `NCCL_WIN_COLL_SYMMETRIC` (nccl.h).
const WIN_COLL_SYMMETRIC: i32 = 1;
/// `NCCL_CONFIG_UNDEF_INT` (nccl.h): a field NCCL fills with its default.
const UNDEF: i32 = i32::MIN;

fn check(op: &'static str, r: sys::ncclResult_t) -> Result<()> {
    if r == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: NCCL returns a static C string for every result code.
    let text = unsafe {
        let p = sys::ncclGetErrorString(r);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(anyhow!("NCCL's {op}: {r:?}: {text}"))
}

/// NCCL's `NCCL_CONFIG_INITIALIZER` for the 2.28 layout, with the given
/// CTA policy (`None`: NCCL's default).
fn config(cta_policy: Option<i32>) -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // NCCL_VERSION(2, 28, 0): the layout of the fields below.
        version: 22800,
        blocking: UNDEF,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: cta_policy.unwrap_or(UNDEF),
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// A communicator for the copy-engine collectives (see the module docs),
/// enqueueing on one stream.
pub struct CopyEngine {
    raw: Rc<RawComm>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
}

impl std::fmt::Debug for CopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyEngine")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

/// `ncclAlltoAll` and `ncclAllGather`: the same arguments.
type Collective = unsafe fn(
    *const c_void,
    *mut c_void,
    usize,
    sys::ncclDataType_t,
    sys::ncclComm_t,
    sys::cudaStream_t,
) -> sys::ncclResult_t;

/// The NCCL communicator, destroyed when its engine and its last window
/// are gone.
struct RawComm(sys::ncclComm_t);

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: made by ncclCommInitRankConfig; no window is left.
        unsafe {
            let _ = sys::ncclCommDestroy(self.0);
        }
    }
}

/// Device memory from `ncclMemAlloc`, registered as a symmetric window of
/// a [`CopyEngine`]'s communicator; deregistered and freed on drop.
pub struct Window {
    raw: Rc<RawComm>,
    win: sys::ncclWindow_t,
    ptr: *mut c_void,
    bytes: usize,
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Window {
    fn at(&self, op: &'static str, offset: usize, len: usize) -> Result<*mut c_void> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(self.ptr.cast::<u8>().wrapping_add(offset).cast()),
            _ => Err(anyhow!(
                "{op}: bytes {offset}..{offset}+{len} outside a window of {}",
                self.bytes
            )),
        }
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        // SAFETY: registered on the communicator `raw` keeps alive, memory
        // from ncclMemAlloc. Errors cannot be returned from drop.
        unsafe {
            let _ = sys::ncclCommWindowDeregister(self.raw.0, self.win);
            let _ = sys::ncclMemFree(self.ptr);
        }
    }
}

impl CopyEngine {
    /// A new NCCL unique id, for one rank to make and hand to the others
    /// (as `amp::comm::rendezvous` hands it out).
    ///
    /// # Errors
    /// NCCL's, when it cannot make one.
    pub fn unique_id() -> Result<[u8; 128]> {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: out-pointer valid.
        check("CopyEngine::unique_id", unsafe {
            sys::ncclGetUniqueId(&mut id)
        })?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins a new communicator of `world_size` ranks as `rank`, with the
    /// NCCL unique id `id` (made by one rank, handed to all), enqueueing
    /// on `stream`. `zero_cta` asks for `NCCL_CTA_POLICY_ZERO` (the copy
    /// engines); without it NCCL's kernels run the same calls (a
    /// reference to measure against).
    ///
    /// # Errors
    /// NCCL's, when it refuses.
    pub fn new(
        id: [u8; 128],
        rank: usize,
        world_size: usize,
        stream: Arc<CudaStream>,
        zero_cta: bool,
    ) -> Result<Self> {
        const OP: &str = "CopyEngine::new";
        let bad = |what: String| anyhow!("{OP}: {what}");
        let n = i32::try_from(world_size).map_err(|_| bad(format!("world size {world_size}")))?;
        let r = i32::try_from(rank).map_err(|_| bad(format!("rank {rank}")))?;
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let mut cfg = config(zero_cta.then_some(CTA_POLICY_ZERO));
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        stream.context().bind_to_thread()?;
        // SAFETY: out-pointer and config valid for the call.
        check(OP, unsafe {
            sys::ncclCommInitRankConfig(&mut comm, n, id, r, &mut cfg)
        })?;
        Ok(Self {
            raw: Rc::new(RawComm(comm)),
            stream,
            rank,
            world_size,
        })
    }

    /// A symmetric window of `bytes` bytes (at least one). Collective:
    /// every rank calls it with the same size, in the same order.
    ///
    /// # Errors
    /// NCCL's, when it cannot allocate or register it.
    pub fn window(&self, bytes: usize) -> Result<Window> {
        const OP: &str = "CopyEngine::window";
        let bytes = bytes.max(1);
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer valid.
        check(OP, unsafe { sys::ncclMemAlloc(&mut ptr, bytes) })?;
        let mut win: sys::ncclWindow_t = std::ptr::null_mut();
        // SAFETY: `ptr` from ncclMemAlloc, `bytes` long.
        let registered = check(OP, unsafe {
            sys::ncclCommWindowRegister(self.raw.0, ptr, bytes, &mut win, WIN_COLL_SYMMETRIC)
        });
        if let Err(e) = registered {
            // SAFETY: allocated above, not registered.
            unsafe {
                let _ = sys::ncclMemFree(ptr);
            }
            return Err(e);
        }
        Ok(Window {
            raw: self.raw.clone(),
            win,
            ptr,
            bytes,
        })
    }

    /// Rank `r` receives bytes `[r c, (r + 1) c)` of every rank's `send`
    /// region (`send_at`, `N c` bytes) into its `recv` region (`recv_at`,
    /// `N c` bytes), in rank order: `ncclAlltoAll` of `c` bytes a peer.
    ///
    /// # Errors
    /// A region outside its window; NCCL's errors.
    pub fn all_to_all(
        &self,
        (send, send_at): (&Window, usize),
        (recv, recv_at): (&Window, usize),
        c: usize,
    ) -> Result<()> {
        const OP: &str = "CopyEngine::all_to_all";
        let total = c * self.world_size;
        let s = send.at(OP, send_at, total)?;
        let r = recv.at(OP, recv_at, total)?;
        // SAFETY: both regions checked inside their windows.
        unsafe { self.enqueue(OP, sys::ncclAlltoAll, s as u64, r as u64, c) }
    }

    /// Every rank's `c` bytes at `send_at` of `send`, in rank order, into
    /// `N c` bytes at `recv_at` of `recv`: `ncclAllGather`.
    ///
    /// # Errors
    /// As [`all_to_all`](Self::all_to_all).
    pub fn all_gather(
        &self,
        (send, send_at): (&Window, usize),
        (recv, recv_at): (&Window, usize),
        c: usize,
    ) -> Result<()> {
        const OP: &str = "CopyEngine::all_gather";
        let s = send.at(OP, send_at, c)?;
        let r = recv.at(OP, recv_at, c * self.world_size)?;
        // SAFETY: both regions checked inside their windows.
        unsafe { self.enqueue(OP, sys::ncclAllGather, s as u64, r as u64, c) }
    }

    /// [`all_to_all`](Self::all_to_all) (`gather` false) or
    /// [`all_gather`](Self::all_gather) on any device memory (outside a
    /// window NCCL runs its kernels).
    ///
    /// # Safety
    /// `send` and `recv` are device addresses on this engine's device of
    /// `N c` bytes each (`send` of `c` for the gather), alive until the
    /// stream has run the call.
    ///
    /// # Errors
    /// NCCL's.
    pub unsafe fn raw(&self, gather: bool, send: u64, recv: u64, c: usize) -> Result<()> {
        match gather {
            false => unsafe {
                self.enqueue("CopyEngine::all_to_all", sys::ncclAlltoAll, send, recv, c)
            },
            true => unsafe {
                self.enqueue("CopyEngine::all_gather", sys::ncclAllGather, send, recv, c)
            },
        }
    }

    /// One of NCCL's byte collectives of `c` bytes a rank on the engine's
    /// stream.
    ///
    /// # Safety
    /// As [`raw`](Self::raw).
    unsafe fn enqueue(
        &self,
        op: &'static str,
        f: Collective,
        send: u64,
        recv: u64,
        c: usize,
    ) -> Result<()> {
        check(op, unsafe {
            f(
                send as *const c_void,
                recv as *mut c_void,
                c,
                sys::ncclDataType_t::ncclUint8,
                self.raw.0,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        })
    }
}
