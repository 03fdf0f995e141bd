//! # amp-comm
//!
//! Communication for candle-amp: the [`Communicator`] trait (all-reduce,
//! reduce-scatter, all-gather, broadcast, all-to-all, barrier on candle
//! tensors, with a count of the bytes each rank sends), an in-process
//! backend ([`InProcessComm`]: `N` ranks as threads, CPU tensors), and the
//! FP8 gradient all-reduce of docs/ARCHITECTURE.md, "Data parallelism" ([`fp8_all_reduce`]: one scale
//! agreed by all ranks, FP8 on the wire, F32 accumulation) with its two
//! halves for ZeRO ([`fp8_reduce_scatter`], [`fp8_all_gather`]), and its
//! bucketed form ([`fp8_all_reduce_bucket`]: several gradients, each with
//! its own scales and bitwise the result of `fp8_all_reduce`, in four
//! collectives for the whole bucket instead of four per tensor).
//!
//! Uneven sizes follow [`shard_range`]: chunks in rank order, the first
//! `len % N` ranks one element longer. No backend hangs: a rank that does
//! not arrive in time is named in [`Error::Timeout`], and a rank that fails
//! breaks the group ([`Error::PeerFailed`] on every other rank).
//!
//! ```
//! use amp_comm::{run_ranks, Communicator};
//! use candle_core::{Device, Tensor};
//! // Two ranks, two threads: each adds its vector to the other's.
//! let sums = run_ranks(2, |comm| {
//!     let x = Tensor::new(&[comm.rank() as f32 + 1.0, 10.0], &Device::Cpu)?;
//!     let sum = comm.all_reduce_sum(&x)?;
//!     Ok::<_, amp_comm::Error>((sum.to_vec1::<f32>()?, comm.bytes_sent()))
//! })?;
//! assert_eq!(sums[0], (vec![3.0, 20.0], 8)); // ring: 2 (N-1)/N * 2 elements * 4 bytes
//! assert_eq!(sums[1], (vec![3.0, 20.0], 8));
//! # Ok::<(), amp_comm::Error>(())
//! ```
//!
//! # Features
//! - `nccl`: [`NcclComm`], the NCCL backend through cudarc (one process
//!   per GPU, set up from `torchrun`'s variables, see [`LaunchEnv`]);
//!   implies candle's `cuda`. Without it `NcclComm` exists but its
//!   constructors return [`Error::NotCompiled`], and the build needs no
//!   CUDA toolkit. The TCP [`rendezvous`] that hands out NCCL's unique id
//!   is plain Rust and is always built.
#![warn(missing_docs)]

mod bucket_cast;
mod communicator;
mod error;
mod fp8_bucket;
mod fp8_reduce;
mod fp8_zero_bucket;
mod in_process;
mod launch;
#[cfg(feature = "nccl")]
mod nccl;
#[cfg(not(feature = "nccl"))]
#[path = "nccl_stub.rs"]
mod nccl;
mod pad;
mod rank_sum;
mod rendezvous;
mod shard;

pub use communicator::{Communicator, ReduceOp};
pub use error::{Error, Result};
pub use fp8_bucket::fp8_all_reduce_bucket;
pub use fp8_reduce::{
    fp8_all_gather, fp8_all_reduce, fp8_reduce_scatter, Fp8ReduceConfig, Fp8Reduced, Grad,
    ReducedShard,
};
pub use fp8_zero_bucket::{fp8_all_gather_bucket, fp8_reduce_scatter_bucket};
pub use in_process::{run_ranks, run_ranks_each, run_ranks_with, InProcessComm, InProcessConfig};
pub use launch::{LaunchEnv, RendezvousConfig, DEFAULT_RENDEZVOUS_TIMEOUT};
pub use nccl::NcclComm;
pub use rendezvous::{rendezvous, PROTOCOL_VERSION, UNIQUE_ID_BYTES};
pub use shard::{shard_len, shard_range};
