//! `--bench-ce`: NCCL's copy-engine collectives ([`CopyEngine`]: an
//! all-to-all and an all-gather of `--ce-mib` MiB a peer) against the same
//! calls run by NCCL's kernels and against the backend's own exchange
//! (grouped sends and receives, as the FP8 buckets use it), each alone and
//! beside a stream of BF16 GEMMs or of memory-bound kernels on candle's
//! stream: how long the collectives take, and how much they slow the
//! kernels beside them (what the backward feels while buckets travel).

use crate::nccl_raw::{CopyEngine, Window};
use crate::Args;
use amp::comm::{
    rendezvous, shard_range, Communicator, LaunchEnv, NcclComm, ReduceOp, RendezvousConfig,
};
use anyhow::{anyhow, Result};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// Two events recorded on `s` around what `f` enqueues.
fn on_stream(s: &Arc<CudaStream>, f: impl FnOnce() -> Result<()>) -> Result<Events> {
    let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    f()?;
    let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    Ok(Events(a, b))
}

struct Events(
    candle_core::cuda_backend::cudarc::driver::CudaEvent,
    candle_core::cuda_backend::cudarc::driver::CudaEvent,
);

impl Events {
    fn ms(&self) -> Result<f64> {
        Ok(f64::from(self.0.elapsed_ms(&self.1)?))
    }
}

/// A run of kernels on candle's stream.
type Work<'a> = Box<dyn Fn() -> Result<()> + 'a>;

enum Way<'a> {
    /// The backend's own `all_to_all` and `all_gather_shards` (tensors).
    Backend(&'a NcclComm, Vec<Tensor>, Tensor),
    /// `ncclAlltoAll` + `ncclAllGather` on symmetric windows.
    Raw(&'a CopyEngine, Window, Window),
    /// The same on ordinary device memory (candle's), no windows.
    Plain(&'a CopyEngine, Tensor, Tensor),
}

/// The device address of a contiguous CUDA `U8` tensor's first byte.
fn address(t: &Tensor) -> Result<u64> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*storage else {
        return Err(anyhow!("not on CUDA"));
    };
    let slice = cs.as_cuda_slice::<u8>()?;
    let (ptr, _guard) = slice.device_ptr(slice.stream());
    Ok(ptr + layout.start_offset() as u64)
}

impl Way<'_> {
    fn once(&self, c: usize) -> Result<()> {
        match self {
            Way::Backend(comm, chunks, shard) => {
                let side = comm
                    .side_stream()
                    .ok_or_else(|| anyhow!("no side stream"))?;
                let total = c * comm.world_size();
                amp::cuda::defer_side_work(|| {
                    side.run(|| -> Result<()> {
                        let _ = comm.all_to_all(chunks)?;
                        let _ = comm.all_gather_shards(shard, total)?;
                        Ok(())
                    })
                })
            }
            Way::Raw(engine, send, recv) => {
                engine.all_to_all((send, 0), (recv, 0), c)?;
                engine.all_gather((send, 0), (recv, 0), c)?;
                Ok(())
            }
            Way::Plain(engine, send, recv) => {
                let (s, r) = (address(send)?, address(recv)?);
                // SAFETY: both tensors hold N c bytes on this device and
                // outlive the bench, which synchronises before they go.
                unsafe {
                    engine.raw(false, s, r, c)?;
                    engine.raw(true, s, r, c)?;
                }
                Ok(())
            }
        }
    }
}

pub fn bench_ce(comm: &NcclComm, args: &Args) -> Result<()> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let dev = comm.device();
    let Device::Cuda(cuda) = dev else {
        return Err(anyhow!("not a CUDA device"));
    };
    let compute = cuda.cuda_stream();
    let side = comm
        .side_stream()
        .ok_or_else(|| anyhow!("no side stream"))?;
    let stream = side.cuda_stream().clone();
    let launch = LaunchEnv::from_env()?;
    let base = RendezvousConfig::from_env(&launch)?;
    let engine = |k: u16, zero: bool| -> Result<CopyEngine> {
        let cfg = RendezvousConfig {
            port: base.port + k,
            ..base.clone()
        };
        let id = rendezvous(&cfg, rank, n, || {
            CopyEngine::unique_id().map_err(|e| amp::comm::Error::Nccl {
                op: "ncclGetUniqueId",
                detail: e.to_string(),
            })
        })?;
        CopyEngine::new(id, rank, n, stream.clone(), zero)
    };
    let ce = engine(2, true)?;
    let kern = engine(3, false)?;
    let c = args.ce_mib << 20;
    let chunks = (0..n)
        .map(|j| {
            let r = shard_range(n * c, j, n);
            Tensor::zeros(r.len(), DType::U8, dev)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let shard = Tensor::zeros(c, DType::U8, dev)?;
    let ways = [
        ("backend send/recv", Way::Backend(comm, chunks, shard)),
        (
            "NCCL kernels (ncclAlltoAll+ncclAllGather)",
            Way::Raw(&kern, kern.window(n * c)?, kern.window(n * c)?),
        ),
        (
            "NCCL kernels, plain memory",
            Way::Plain(
                &kern,
                Tensor::zeros(n * c, DType::U8, dev)?,
                Tensor::zeros(n * c, DType::U8, dev)?,
            ),
        ),
        (
            "copy engines (zero-CTA, symmetric windows)",
            Way::Raw(&ce, ce.window(n * c)?, ce.window(n * c)?),
        ),
    ];
    // The kernels beside: BF16 GEMMs 4096^3, or a memory-bound affine of
    // 64M F32 (256 MiB read and written).
    let a = Tensor::randn(0f32, 1.0, (4096, 4096), dev)?.to_dtype(DType::BF16)?;
    let b = Tensor::randn(0f32, 1.0, (4096, 4096), dev)?.to_dtype(DType::BF16)?;
    let x = Tensor::randn(0f32, 1.0, 64 << 20, dev)?;
    let reps = args.iters.max(5) * 10;
    let work: [(&str, Work); 2] = [
        (
            "GEMM bf16 4096^3",
            Box::new(|| {
                for _ in 0..reps {
                    let _ = a.matmul(&b)?;
                }
                Ok(())
            }),
        ),
        (
            "affine f32 64M",
            Box::new(|| {
                for _ in 0..reps {
                    let _ = x.affine(1.0001, 0.5)?;
                }
                Ok(())
            }),
        ),
    ];
    comm.barrier()?;
    for (name, way) in &ways {
        // Alone: device ms per all-to-all + all-gather.
        for _ in 0..3 {
            way.once(c)?;
        }
        stream.synchronize()?;
        let k = 20;
        let ev = on_stream(&stream, || {
            for _ in 0..k {
                way.once(c)?;
            }
            Ok(())
        })?;
        let alone = ev.ms()? / k as f64;
        println!("[rank {rank}/{n}] CE {name}: alone {alone:.3} ms per all-to-all + all-gather of {} MiB a peer", args.ce_mib);
        for (wname, w) in &work {
            w()?;
            compute.synchronize()?;
            let solo = on_stream(&compute, w)?;
            let solo = solo.ms()?;
            comm.barrier()?;
            // Enough collectives to cover the kernels' own time.
            // (the same count on every rank: the largest).
            let m = ((solo / alone).ceil() as usize).max(1);
            let m = comm
                .all_reduce(&Tensor::new(&[m as f32], dev)?, ReduceOp::Max)?
                .to_vec1::<f32>()?[0] as usize;
            let cev = on_stream(&stream, || {
                for _ in 0..m {
                    way.once(c)?;
                }
                Ok(())
            })?;
            let wev = on_stream(&compute, w)?;
            let (cms, wms) = (cev.ms()?, wev.ms()?);
            println!(
                "[rank {rank}/{n}] CE {name} beside {wname}: kernels {solo:.2} ms alone, {wms:.2} ms beside (x{:.3}); {m} collectives {:.3} ms each beside",
                wms / solo,
                cms / m as f64
            );
            comm.barrier()?;
        }
    }
    drop(ways);
    Ok(())
}
