//! The [`Communicator`] collectives of [`NcclComm`], on the candle
//! device's stream (see the module docs of `nccl`).

use super::buffer::{self, Output};
use super::{nccl_err, NcclComm};
use crate::communicator::{Communicator, ReduceOp};
use crate::error::{Error, Result};
use crate::pad::{pad_rows, padded_len};
use crate::shard::{shard_len, shard_range};
use candle_core::{DType, Device, Tensor};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, CudaView, DevicePtrMut, DeviceSlice, SyncOnDrop};
use cudarc::nccl::{group_end, group_start, ReduceOp as NcclOp};
use std::sync::Arc;

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
    }
}

fn nbytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl NcclComm {
    /// NCCL's F32 reduction of the 1-D `flat`: an all-reduce (as long as
    /// `flat`), or with `scatter` a reduce-scatter (`flat.len() / N`, the
    /// length a multiple of `N`).
    fn reduce_raw(
        &self,
        op: &'static str,
        flat: &Tensor,
        red: ReduceOp,
        scatter: bool,
    ) -> Result<Tensor> {
        let flat = flat.contiguous()?;
        let n = flat.elem_count();
        let out_len = if scatter { n / self.world_size() } else { n };
        let mut out = Output::new(op, self.side.cuda_stream(), DType::F32, out_len)?;
        if out_len > 0 {
            let (storage, layout) = flat.storage_and_layout();
            let send = buffer::f32s(op, &storage, layout, n)?;
            let mut recv = out.f32s(op)?;
            let red = nccl_op(red);
            self.fenced(op, || {
                if scatter {
                    self.comm.reduce_scatter(&send, &mut recv, &red)
                } else {
                    self.comm.all_reduce(&send, &mut recv, &red)
                }
                .map_err(nccl_err(op))?;
                Ok(())
            })?;
        }
        Ok(out.into_tensor(&self.cuda, out_len))
    }

    /// Max with NaN winning (NCCL's max drops NaN): the values with NaN as
    /// +inf and a 0/1 NaN flag per element are reduced together. With
    /// `scatter`, this rank's padded chunk (`ceil(L / N)` elements).
    fn reduce_max(&self, op: &'static str, flat: &Tensor, scatter: bool) -> Result<Tensor> {
        let n = self.world_size();
        let nan = flat.ne(flat)?;
        let inf = Tensor::new(f32::INFINITY, flat.device())?.broadcast_as(flat.shape())?;
        let values = nan.where_cond(&inf, flat)?;
        let flags = nan.to_dtype(DType::F32)?;
        let (both, part) = if scatter {
            // Chunk j is [values_j, flags_j], each padded to ceil(L / N).
            let rows = Tensor::cat(&[pad_rows(&values, n)?, pad_rows(&flags, n)?], 1)?;
            (rows.flatten_all()?, padded_len(flat.elem_count(), n))
        } else {
            (Tensor::cat(&[&values, &flags], 0)?, flat.elem_count())
        };
        let reduced = self.reduce_raw(op, &both, ReduceOp::Max, scatter)?;
        let max = reduced.narrow(0, 0, part)?;
        let any_nan = reduced.narrow(0, part, part)?.gt(0.5f32)?;
        let nan = Tensor::new(f32::NAN, flat.device())?.broadcast_as(part)?;
        Ok(any_nan.where_cond(&nan, &max)?)
    }

    /// Every rank's `x` (contiguous bytes) in rank order, flat.
    fn gather_raw(&self, op: &'static str, x: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        let len = x.elem_count();
        let total = self.world_size() * len;
        let mut out = Output::new(op, self.side.cuda_stream(), x.dtype(), total)?;
        if len > 0 {
            let (storage, layout) = x.storage_and_layout();
            let send = buffer::bytes(op, &storage, layout, len)?;
            let mut recv = out.bytes(op)?;
            self.fenced(op, || {
                self.comm
                    .all_gather(&send, &mut recv)
                    .map_err(nccl_err(op))?;
                Ok(())
            })?;
        }
        Ok(out.into_tensor(&self.cuda, total))
    }

    /// Uneven chunks gathered with grouped sends and receives straight
    /// into their places in the result, this rank's own chunk copied there
    /// on the same stream: no padding, no candle op (so it may run inside
    /// a [`SideStream::run`](amp_core::SideStream::run)).
    fn gather_uneven(&self, op: &'static str, shard: &Tensor, len: usize) -> Result<Tensor> {
        let (n, rank) = (self.world_size(), self.rank());
        let shard = shard.flatten_all()?.contiguous()?;
        let b = shard.dtype().size_in_bytes();
        let stream = self.side.cuda_stream();
        let mut out = Output::new(op, stream, shard.dtype(), len)?;
        let (storage, layout) = shard.storage_and_layout();
        let own = shard_range(len, rank, n);
        let mine = buffer::bytes(op, &storage, layout, own.len())?;
        let peer = |j: usize| i32::try_from(j).map_err(|_| Self::invalid(op, format!("rank {j}")));
        let sends = (0..n)
            .filter(|&j| j != rank && !own.is_empty())
            .map(|j| Ok((peer(j)?, mine.slice(..))))
            .collect::<Result<Vec<_>>>()?;
        let mut whole = out.bytes(op)?;
        let (base, guard) = whole.device_ptr_mut(stream);
        // Each rank's byte range of the result, in rank order.
        let mut recvs = Vec::with_capacity(n);
        let mut own_part = None;
        for j in 0..n {
            let r = shard_range(len, j, n);
            let part = Part {
                ptr: base + (r.start * b) as u64,
                len: r.len() * b,
                stream: stream.clone(),
            };
            if j == rank {
                own_part = Some(part);
            } else if !r.is_empty() {
                recvs.push((peer(j)?, part));
            }
        }
        self.fenced(op, || {
            self.send_recv(op, &sends, &mut recvs, own_part.map(|p| (&mine, p)))
        })?;
        drop(guard);
        Ok(out.into_tensor(&self.cuda, len))
    }

    /// One NCCL group of `sends` and `recvs` (and a device copy of `own`'s
    /// bytes into its place, before the group), on the communicator's
    /// stream; the caller fences.
    fn send_recv(
        &self,
        op: &'static str,
        sends: &[(i32, CudaView<'_, u8>)],
        recvs: &mut [(i32, impl DevicePtrMut<u8>)],
        own: Option<(&CudaView<'_, u8>, Part)>,
    ) -> Result<()> {
        self.enter()?;
        if let Some((src, mut dst)) = own {
            if !src.is_empty() {
                self.side
                    .cuda_stream()
                    .memcpy_dtod(src, &mut dst)
                    .map_err(|e| Error::Candle(candle_core::Error::wrap(e)))?;
            }
        }
        group_start().map_err(nccl_err(op))?;
        let mut enqueued = Ok(());
        for (j, view) in sends {
            enqueued = enqueued.and_then(|()| self.comm.send(view, *j));
        }
        for (j, view) in recvs.iter_mut() {
            enqueued = enqueued.and_then(|()| self.comm.recv(view, *j).map(|_| ()));
        }
        // The group is closed whatever happened inside it.
        let ended = group_end();
        enqueued.map_err(nccl_err(op))?;
        ended.map_err(nccl_err(op))?;
        Ok(())
    }

    /// Runs the NCCL calls of `f` on the communicator's stream: the stream
    /// first waits for candle's, and candle's waits for it after, unless
    /// inside the stream's [`run`](amp_core::SideStream::run) (whose fences
    /// are its own).
    /// The watchdog ([`super::watchdog`]) times `op` from the start of its
    /// enqueue.
    fn fenced<R>(&self, op: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let inside = self.side.is_current();
        if !inside {
            self.side.wait_for_compute()?;
        }
        self.enter()?;
        if let Some(w) = &self.watchdog {
            w.begin(op)?;
        }
        let out = f()?;
        if let Some(w) = &self.watchdog {
            w.enqueued(op)?;
        }
        if !inside {
            self.side.compute_wait()?;
        }
        Ok(out)
    }

    /// One chunk a rank, each on this communicator's device.
    fn check_chunks(&self, op: &'static str, chunks: &[Tensor]) -> Result<()> {
        let n = self.world_size();
        if chunks.len() != n {
            return Err(Self::invalid(
                op,
                format!("{} chunks for a world of {n}", chunks.len()),
            ));
        }
        chunks.iter().try_for_each(|c| self.check(op, c))
    }

    fn invalid(op: &'static str, what: String) -> Error {
        Error::InvalidArgument { op, what }
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        self.check_f32(OP, x)?;
        let flat = x.flatten_all()?;
        let out = match op {
            ReduceOp::Sum => self.reduce_raw(OP, &flat, op, false)?,
            ReduceOp::Max => self.reduce_max(OP, &flat, false)?,
        };
        let (n, len) = (self.world_size(), x.elem_count());
        let s = shard_len(len, self.rank(), n);
        self.count((len - s + (n - 1) * s) * 4);
        Ok(out.reshape(x.shape())?)
    }

    fn all_reduce_max_no_nan(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        self.check_f32(OP, x)?;
        let out = self.reduce_raw(OP, &x.flatten_all()?, ReduceOp::Max, false)?;
        let (n, len) = (self.world_size(), x.elem_count());
        let s = shard_len(len, self.rank(), n);
        self.count((len - s + (n - 1) * s) * 4);
        Ok(out.reshape(x.shape())?)
    }

    fn reduce_scatter(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        self.check_f32(OP, x)?;
        let (n, len) = (self.world_size(), x.elem_count());
        let flat = x.flatten_all()?;
        let padded = match op {
            ReduceOp::Sum => self.reduce_raw(OP, &pad_rows(&flat, n)?.flatten_all()?, op, true)?,
            ReduceOp::Max => self.reduce_max(OP, &flat, true)?,
        };
        let s = shard_len(len, self.rank(), n);
        self.count((len - s) * 4);
        Ok(padded.narrow(0, 0, s)?)
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "all_gather";
        self.check(OP, x)?;
        let n = self.world_size();
        let mut dims = vec![n];
        dims.extend_from_slice(x.dims());
        let out = self.gather_raw(OP, x)?.reshape(dims)?;
        self.count((n - 1) * nbytes(x));
        Ok(out)
    }

    fn all_gather_shards(&self, shard: &Tensor, len: usize) -> Result<Tensor> {
        const OP: &str = "all_gather_shards";
        self.check(OP, shard)?;
        let (n, rank) = (self.world_size(), self.rank());
        let want = shard_len(len, rank, n);
        if shard.elem_count() != want {
            return Err(Self::invalid(
                OP,
                format!(
                    "rank {rank} of {n} owns {want} of {len} elements, its shard has {}",
                    shard.elem_count()
                ),
            ));
        }
        let out = if len % n == 0 {
            // Even chunks: NCCL's all-gather straight into the result.
            self.gather_raw(OP, shard)?
        } else {
            self.gather_uneven(OP, shard, len)?
        };
        self.count((n - 1) * nbytes(shard));
        Ok(out)
    }

    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        self.check(OP, x)?;
        let n = self.world_size();
        let root_i32 = i32::try_from(root)
            .ok()
            .filter(|_| root < n)
            .ok_or_else(|| {
                Self::invalid(OP, format!("root {root} is not a rank of a world of {n}"))
            })?;
        let x = x.contiguous()?;
        let len = x.elem_count();
        let mut out = Output::new(OP, self.side.cuda_stream(), x.dtype(), len)?;
        if len > 0 {
            let (storage, layout) = x.storage_and_layout();
            let send = buffer::bytes(OP, &storage, layout, len)?;
            let mut recv = out.bytes(OP)?;
            self.fenced(OP, || {
                self.comm
                    .broadcast(Some(&send), &mut recv, root_i32)
                    .map_err(nccl_err(OP))?;
                Ok(())
            })?;
        }
        if self.rank() == root {
            self.count((n - 1) * nbytes(&x));
        }
        Ok(out.into_tensor(&self.cuda, x.shape()))
    }

    fn all_to_all(&self, chunks: &[Tensor]) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        let (n, rank) = (self.world_size(), self.rank());
        self.check_chunks(OP, chunks)?;
        let own = &chunks[rank];
        let peer = |j: usize| i32::try_from(j).map_err(|_| Self::invalid(OP, format!("rank {j}")));
        let chunks = chunks
            .iter()
            .map(|c| c.contiguous())
            .collect::<candle_core::Result<Vec<_>>>()?;
        // Receive buffers shaped as the chunk this rank keeps; none for
        // itself, none when empty (both ends know the size and skip).
        let mut outs = (0..n)
            .map(|j| match j == rank || own.elem_count() == 0 {
                true => Ok(None),
                false => Output::new(OP, self.side.cuda_stream(), own.dtype(), own.elem_count())
                    .map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        {
            let guards: Vec<_> = chunks.iter().map(|c| c.storage_and_layout()).collect();
            let mut sends = Vec::with_capacity(n);
            for (j, ((storage, layout), c)) in guards.iter().zip(&chunks).enumerate() {
                if j != rank && c.elem_count() > 0 {
                    sends.push((
                        peer(j)?,
                        buffer::bytes(OP, storage, layout, c.elem_count())?,
                    ));
                }
            }
            let mut recvs = Vec::with_capacity(n);
            for (j, out) in outs.iter_mut().enumerate() {
                if let Some(out) = out {
                    recvs.push((peer(j)?, out.bytes(OP)?));
                }
            }
            self.fenced(OP, || self.send_recv(OP, &sends, &mut recvs, None))?;
        }
        let sent: usize = (0..n)
            .filter(|&j| j != rank)
            .map(|j| nbytes(&chunks[j]))
            .sum();
        self.count(sent);
        Ok(outs
            .into_iter()
            .enumerate()
            .map(|(j, out)| match out {
                Some(out) => out.into_tensor(&self.cuda, own.shape()),
                // This rank's own chunk, or an empty one.
                None if j == rank => chunks[rank].clone(),
                None => own.clone(),
            })
            .collect())
    }

    fn all_to_all_gather(
        &self,
        chunks: &[Tensor],
        extra: &Tensor,
    ) -> Result<(Vec<Tensor>, Tensor)> {
        const OP: &str = "all_to_all_gather";
        let (n, rank) = (self.world_size(), self.rank());
        self.check_chunks(OP, chunks)?;
        self.check(OP, extra)?;
        let peer = |j: usize| i32::try_from(j).map_err(|_| Self::invalid(OP, format!("rank {j}")));
        let chunks = chunks
            .iter()
            .map(|c| c.contiguous())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let extra = extra.contiguous()?;
        let own_len = chunks[rank].elem_count();
        let stream = self.side.cuda_stream();
        // Receive buffers: a chunk shaped as this rank's own from every
        // other rank (none when it is empty: both ends know), and the
        // extras in rank order.
        let mut outs = (0..n)
            .map(|j| match j == rank || own_len == 0 {
                true => Ok(None),
                false => Output::new(OP, stream, chunks[rank].dtype(), own_len).map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        let eb = nbytes(&extra);
        let mut gathered = Output::new(OP, stream, extra.dtype(), n * extra.elem_count())?;
        {
            let guards: Vec<_> = chunks.iter().map(|c| c.storage_and_layout()).collect();
            let (es, el) = extra.storage_and_layout();
            let ev = buffer::bytes(OP, &es, el, extra.elem_count())?;
            // Per peer, in the same order on every rank: its chunk, then
            // the extra.
            let mut sends = Vec::with_capacity(2 * n);
            for (j, ((storage, layout), c)) in guards.iter().zip(&chunks).enumerate() {
                if j != rank && c.elem_count() > 0 {
                    sends.push((
                        peer(j)?,
                        buffer::bytes(OP, storage, layout, c.elem_count())?,
                    ));
                }
            }
            for j in (0..n).filter(|&j| j != rank && eb > 0) {
                sends.push((peer(j)?, ev.slice(..)));
            }
            let mut views = Vec::with_capacity(n);
            for out in outs.iter_mut().flatten() {
                views.push(out.bytes(OP)?);
            }
            let mut whole = gathered.bytes(OP)?;
            let mut ptr_guards = Vec::with_capacity(n + 1);
            let mut recvs = Vec::with_capacity(2 * n);
            let mut next = views.iter_mut();
            for j in 0..n {
                if j != rank && own_len > 0 {
                    let v = next
                        .next()
                        .ok_or_else(|| Self::invalid(OP, "a receive buffer short".into()))?;
                    let len = v.len();
                    let (ptr, g) = v.device_ptr_mut(stream);
                    ptr_guards.push(g);
                    recvs.push((
                        peer(j)?,
                        Part {
                            ptr,
                            len,
                            stream: stream.clone(),
                        },
                    ));
                }
            }
            let (base, g) = whole.device_ptr_mut(stream);
            ptr_guards.push(g);
            let mut own_part = None;
            for j in 0..n {
                let part = Part {
                    ptr: base + (j * eb) as u64,
                    len: eb,
                    stream: stream.clone(),
                };
                if j == rank {
                    own_part = Some(part);
                } else if eb > 0 {
                    recvs.push((peer(j)?, part));
                }
            }
            self.fenced(OP, || {
                self.send_recv(OP, &sends, &mut recvs, own_part.map(|p| (&ev, p)))
            })?;
            drop(ptr_guards);
        }
        let sent: usize = (0..n)
            .filter(|&j| j != rank)
            .map(|j| nbytes(&chunks[j]))
            .sum();
        self.count(sent + (n - 1) * eb);
        let mut dims = vec![n];
        dims.extend_from_slice(extra.dims());
        let gathered = gathered
            .into_tensor(&self.cuda, n * extra.elem_count())
            .reshape(dims)?;
        let received = outs
            .into_iter()
            .enumerate()
            .map(|(j, out)| match out {
                Some(out) => out.into_tensor(&self.cuda, chunks[rank].shape()),
                None if j == rank => chunks[rank].clone(),
                None => chunks[rank].clone(),
            })
            .collect();
        Ok((received, gathered))
    }

    fn side_stream(&self) -> Option<&amp_core::SideStream> {
        Some(&self.side)
    }

    fn barrier(&self) -> Result<()> {
        const OP: &str = "barrier";
        let token = Tensor::zeros(1, DType::F32, &self.device)?;
        self.reduce_raw(OP, &token, ReduceOp::Sum, false)?;
        // The one host wait of the backend: a barrier returns only once
        // every rank has arrived.
        self.cuda
            .cuda_stream()
            .synchronize()
            .map_err(|e| Error::Candle(candle_core::Error::wrap(e)))
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn reset_bytes_sent(&self) {
        self.bytes.store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A byte range of a buffer the caller keeps alive, as NCCL's receive
/// buffer (several disjoint ranges of one output at once, which cudarc's
/// views cannot lend together).
struct Part {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceSlice<u8> for Part {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl DevicePtrMut<u8> for Part {
    fn device_ptr_mut<'a>(&'a mut self, _: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        // No events: the communicator's stream is fenced by the caller.
        (self.ptr, SyncOnDrop::Record(None))
    }
}
