//! The in-process backend: `N` ranks as threads of one process, for CPU
//! tests and for data parallelism on one CPU machine.
//!
//! Tensors must live on the CPU. The ranks meet under one mutex and
//! condvar (see `group.rs`); every wait has a timeout
//! ([`InProcessConfig::timeout`], 60 s by default), and the first failure
//! of any rank breaks the whole group: every pending and later collective
//! of every rank returns an error. A rank fails when a collective of it
//! returns an error, when its communicator is dropped (its closure
//! returned, with an error or not, while others still call collectives),
//! when its thread panics, or when it times out waiting for others.

mod agree;
mod deposit;
mod group;
mod reduce;
mod run;

pub use run::{run_ranks, run_ranks_each, run_ranks_with};

use crate::communicator::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::shard::{shard_len, shard_range};
use candle_core::{DType, Device, Tensor};
use deposit::{Call, Deposit};
use group::{FailureKind, Group};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Settings of an in-process group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InProcessConfig {
    /// How long a rank waits for the others in one collective before it
    /// gives [`Error::Timeout`] naming the ranks that did not arrive.
    pub timeout: Duration,
}

impl Default for InProcessConfig {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
        }
    }
}

/// One rank of an in-process group: `N` ranks as threads of one process.
/// Make the group with [`group`](Self::group) and move each communicator
/// into its own thread, or let [`run_ranks`] do it.
///
/// Tensors must live on the CPU ([`Error::UnsupportedDevice`] otherwise).
/// Every wait has a timeout ([`InProcessConfig::timeout`], 60 s by
/// default), after which the waiting ranks report [`Error::Timeout`]
/// naming the ranks that did not arrive. The first failure of any rank
/// breaks the group: every pending and later collective of every rank
/// returns an error ([`Error::PeerFailed`], or the `Timeout` or
/// [`Error::Mismatch`] itself for the ranks in that collective). A rank
/// fails when a collective of it returns an error, when its communicator
/// is dropped (its thread returned, with an error or not, while the others
/// still call collectives), when its thread panics, or when it times out.
/// Dropping all communicators after the last collective is the normal end.
///
/// Each rank reduces its own chunk (reduce-scatter) and the chunks are
/// gathered, so an all-reduce costs every rank `O(L)` work; sums run in
/// rank order and every rank receives the bitwise same result.
pub struct InProcessComm {
    group: Arc<Group>,
    rank: usize,
    device: Device,
    bytes: AtomicU64,
}

impl std::fmt::Debug for InProcessComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessComm")
            .field("rank", &self.rank)
            .field("world_size", &self.group.world())
            .finish_non_exhaustive()
    }
}

const BACKEND: &str = "in-process";

fn nbytes(t: &Tensor) -> u64 {
    (t.elem_count() * t.dtype().size_in_bytes()) as u64
}

impl InProcessComm {
    /// `world` communicators of one group, rank `i` at index `i`, with the
    /// default settings.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `world` is 0.
    pub fn group(world: usize) -> Result<Vec<Self>> {
        Self::group_with(world, &InProcessConfig::default())
    }

    /// As [`group`](Self::group), with `config`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `world` is 0.
    pub fn group_with(world: usize, config: &InProcessConfig) -> Result<Vec<Self>> {
        if world == 0 {
            return Err(Error::InvalidArgument {
                op: "InProcessComm::group",
                what: "a group needs at least one rank".into(),
            });
        }
        let group = Arc::new(Group::new(world, config.timeout));
        Ok((0..world)
            .map(|rank| Self {
                group: Arc::clone(&group),
                rank,
                device: Device::Cpu,
                bytes: AtomicU64::new(0),
            })
            .collect())
    }

    /// Breaks the group on purpose: every pending and later collective of
    /// every rank returns [`Error::PeerFailed`] naming this rank and `reason`.
    pub fn abort(&self, reason: &str) {
        self.group
            .fail(self.rank, FailureKind::Error(format!("aborted: {reason}")));
    }

    pub(crate) fn shared(&self) -> Arc<Group> {
        Arc::clone(&self.group)
    }

    /// A local argument error: breaks the group (the other ranks would
    /// otherwise wait for this one) and returns it.
    fn refuse(&self, err: Error) -> Error {
        self.group.fail_with(self.rank, err)
    }

    fn check_device(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.device().is_cpu() {
            Ok(())
        } else {
            Err(self.refuse(Error::UnsupportedDevice {
                op,
                backend: BACKEND,
                device: t.device().location(),
            }))
        }
    }

    fn check_f32(&self, op: &'static str, t: &Tensor) -> Result<()> {
        self.check_device(op, t)?;
        if t.dtype() == DType::F32 {
            Ok(())
        } else {
            Err(self.refuse(Error::DType {
                op,
                expected: "F32",
                got: t.dtype(),
            }))
        }
    }

    fn count(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn round<R>(
        &self,
        op: &'static str,
        call: Call,
        tensors: Vec<Tensor>,
        read: impl FnOnce(&[Deposit]) -> Result<R>,
    ) -> Result<R> {
        let deposit = Deposit { op, call, tensors };
        self.group.round(self.rank, deposit, read)
    }

    fn reduce_scatter_as(&self, op: &'static str, x: &Tensor, reduce: ReduceOp) -> Result<Tensor> {
        self.check_f32(op, x)?;
        let x = x.contiguous().map_err(|e| self.refuse(e.into()))?;
        let len = x.elem_count();
        let range = shard_range(len, self.rank, self.world_size());
        let shard = self.round(op, Call::ReduceScatter(reduce), vec![x], |deps| {
            let values = reduce::reduce_range(op, deps, reduce, range.clone())?;
            Ok(Tensor::from_vec(values, range.len(), &Device::Cpu)?)
        })?;
        self.count(((len - range.len()) * 4) as u64);
        Ok(shard)
    }

    fn all_gather_shards_as(&self, op: &'static str, shard: &Tensor, len: usize) -> Result<Tensor> {
        self.check_device(op, shard)?;
        let want = shard_len(len, self.rank, self.world_size());
        if shard.elem_count() != want {
            return Err(self.refuse(Error::InvalidArgument {
                op,
                what: format!(
                    "rank {} of {} owns {want} of {len} elements, its shard has {}",
                    self.rank,
                    self.world_size(),
                    shard.elem_count()
                ),
            }));
        }
        let flat = shard.flatten_all().map_err(|e| self.refuse(e.into()))?;
        let sent = nbytes(&flat) * (self.world_size() as u64 - 1);
        let full = self.round(op, Call::AllGatherShards { len }, vec![flat], |deps| {
            let parts = deps
                .iter()
                .map(|d| reduce::first(op, d))
                .collect::<Result<Vec<_>>>()?;
            Ok(Tensor::cat(&parts, 0)?)
        })?;
        self.count(sent);
        Ok(full)
    }
}

impl Drop for InProcessComm {
    fn drop(&mut self) {
        let kind = if std::thread::panicking() {
            FailureKind::Panicked
        } else {
            FailureKind::Dropped
        };
        self.group.fail(self.rank, kind);
    }
}

impl Communicator for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world()
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        let shard = self.reduce_scatter_as(OP, x, op)?;
        let full = self.all_gather_shards_as(OP, &shard, x.elem_count())?;
        Ok(full.reshape(x.shape())?)
    }

    fn reduce_scatter(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.reduce_scatter_as("reduce_scatter", x, op)
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather";
        self.check_device(OP, x)?;
        let out = self.round(OP, Call::AllGather, vec![x.clone()], |deps| {
            let parts = deps
                .iter()
                .map(|d| reduce::first(OP, d))
                .collect::<Result<Vec<_>>>()?;
            Ok(Tensor::stack(&parts, 0)?)
        })?;
        self.count(nbytes(x) * (self.world_size() as u64 - 1));
        Ok(out)
    }

    fn all_gather_shards(&self, shard: &Tensor, len: usize) -> Result<Tensor> {
        self.all_gather_shards_as("all_gather_shards", shard, len)
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        self.check_device(OP, x)?;
        if root >= self.world_size() {
            return Err(self.refuse(Error::InvalidArgument {
                op: OP,
                what: format!("root {root} out of range for {} ranks", self.world_size()),
            }));
        }
        let out = self.round(OP, Call::Broadcast { root }, vec![x.clone()], |deps| {
            if root == self.rank {
                return Ok(x.clone());
            }
            let d = deps.get(root).ok_or_else(|| reduce::missing(OP, root))?;
            // A copy: the root may later change its tensor in place.
            Ok(reduce::first(OP, d)?.copy()?)
        })?;
        if root == self.rank {
            self.count(nbytes(x) * (self.world_size() as u64 - 1));
        }
        Ok(out)
    }

    fn all_to_all(&self, chunks: &[Tensor]) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        if chunks.len() != self.world_size() {
            return Err(self.refuse(Error::InvalidArgument {
                op: OP,
                what: format!(
                    "{} chunks for {} ranks (one chunk per rank)",
                    chunks.len(),
                    self.world_size()
                ),
            }));
        }
        for c in chunks {
            self.check_device(OP, c)?;
        }
        let me = self.rank;
        let out = self.round(OP, Call::AllToAll, chunks.to_vec(), |deps| {
            deps.iter()
                .enumerate()
                .map(|(i, d)| {
                    let c = d.tensors.get(me).ok_or_else(|| reduce::missing(OP, i))?;
                    // Copies: a chunk is often a view into the sender's buffer.
                    Ok(if i == me { c.clone() } else { c.copy()? })
                })
                .collect::<Result<Vec<_>>>()
        })?;
        let sent: u64 = chunks
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != me)
            .map(|(_, c)| nbytes(c))
            .sum();
        self.count(sent);
        Ok(out)
    }

    fn barrier(&self) -> Result<()> {
        self.round("barrier", Call::Barrier, Vec::new(), |_| Ok(()))
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    fn reset_bytes_sent(&self) {
        self.bytes.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8_reduce::{fp8_all_reduce, Fp8ReduceConfig};

    #[test]
    fn communicators_can_be_shared_and_used_as_trait_objects() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<InProcessComm>();
        let out = run_ranks(2, |comm| {
            let dynamic: Box<dyn Communicator + Send + Sync> = Box::new(comm);
            let g = Tensor::new(&[1.0f32, 2.0], &Device::Cpu)?;
            let r = fp8_all_reduce(dynamic.as_ref(), &g, &Fp8ReduceConfig::default())?;
            Ok::<_, Error>(r.grad.dequantize(DType::F32)?.to_vec1::<f32>()?)
        })
        .unwrap();
        assert_eq!(out, [[1.0, 2.0], [1.0, 2.0]]);
    }

    #[test]
    fn an_empty_group_is_refused() {
        let err = InProcessComm::group(0).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    }
}
