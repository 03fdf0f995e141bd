//! Multi-process launch: one process per GPU, started by
//! `torchrun --no-python --nproc-per-node N target/release/examples/gpt ...`
//! or by a shell loop that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR
//! and MASTER_PORT; the ranks talk through NCCL (`--features nccl`).

use amp::comm::{Communicator, NcclComm};
use anyhow::{Context, Result};
use std::sync::Arc;

/// The NCCL group when this process is one rank of a launch (WORLD_SIZE is
/// set), `None` otherwise.
///
/// # Errors
/// A build without `nccl`, bad launch variables, a rank that never arrives.
// The training loop takes any backend as `Arc<dyn Communicator>` (the
// in-process ranks share theirs across threads); an NCCL communicator is
// not Send (its NCCL handle belongs to this process's one thread), and it
// never leaves the thread that made it.
#[allow(clippy::arc_with_non_send_sync)]
pub fn from_env() -> Option<Result<Arc<dyn Communicator>>> {
    std::env::var_os("WORLD_SIZE")?;
    Some(
        NcclComm::from_env()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .context("WORLD_SIZE is set: joining the NCCL group of a torchrun-style launch"),
    )
}
