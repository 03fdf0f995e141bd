//! nccl_check: every collective of the NCCL backend against direct
//! computation, the FP8 all-reduce against the in-process backend on the
//! CPU (bitwise), and with `--bench` the all-reduce of 256 MiB of F32
//! gradients: F32 path vs FP8 path, time and bytes on the wire.
//!
//! One process per GPU, launched either way:
//!
//! ```text
//! torchrun --no-python --nproc-per-node 2 target/release/examples/nccl_check --bench
//! for r in 0 1; do RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
//!   MASTER_PORT=29500 target/release/examples/nccl_check --bench & done; wait
//! ```
//!
//! Prints `PASS`/`FAIL` lines prefixed by the rank; exits 1 on any FAIL.

mod bench;
mod copy_engine;
mod nccl_raw;

use amp::comm::{
    fp8_all_reduce, fp8_all_reduce_bucket, fp8_reduce_scatter_bucket, run_ranks, shard_range,
    Communicator, Fp8ReduceConfig, NcclComm, ReduceOp,
};
use amp::{CurrentScaling, QType, ScalingTensor};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Checks and times the NCCL backend of candle-amp (one process per GPU)")]
struct Args {
    /// Also time the all-reduce of `--mib` MiB of F32 gradients, F32 vs FP8.
    #[arg(long)]
    bench: bool,
    /// Gradient size for `--bench`, in MiB of F32.
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// Timed iterations per path (after 3 warm-ups); the median is reported.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// Also time NCCL's copy-engine collectives against its kernels, alone
    /// and beside GEMMs / memory-bound kernels (`--ce-mib` MiB a peer).
    #[arg(long)]
    bench_ce: bool,
    /// Bytes a peer for `--bench-ce`, in MiB.
    #[arg(long, default_value_t = 16)]
    ce_mib: usize,
    /// Bucket cap for `--bench`'s bucketed FP8 reduction, MiB of F32.
    #[arg(long, default_value_t = 25.0)]
    bucket_mb: f64,
}

/// Rank `r`'s input: small dyadic values, so sums are exact in any order.
fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 31 + i * 7) % 13) as f32 - 6.0 + rank as f32 * 0.25)
        .collect()
}

/// Gradient-like values: signs and magnitudes from 1e-3 to 10 (xorshift).
fn grad_input(rank: usize, len: usize) -> Vec<f32> {
    let mut s = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 11) as f64 / (1u64 << 53) as f64;
            let mag = 10f64.powf(-3.0 + 4.0 * u);
            (if s & 1 == 0 { mag } else { -mag }) as f32
        })
        .collect()
}

struct Checker<'a> {
    comm: &'a NcclComm,
    failures: usize,
}

impl Checker<'_> {
    fn report(&mut self, name: &str, ok: Result<bool>) {
        let (r, n) = (self.comm.rank(), self.comm.world_size());
        match ok {
            Ok(true) => println!("[rank {r}/{n}] PASS {name}"),
            Ok(false) => {
                self.failures += 1;
                println!("[rank {r}/{n}] FAIL {name}: wrong values or byte count");
            }
            Err(e) => {
                self.failures += 1;
                println!("[rank {r}/{n}] FAIL {name}: {e:#}");
            }
        }
    }

    fn gpu(&self, v: &[f32]) -> Result<Tensor> {
        Ok(Tensor::from_slice(v, v.len(), self.comm.device())?)
    }

    /// Runs `f`, checks its values against `want` (bitwise, NaN included)
    /// and the bytes it sent against `bytes`.
    fn check_against(
        &mut self,
        name: &str,
        want: &[f32],
        bytes: usize,
        f: impl FnOnce(&NcclComm) -> Result<Tensor>,
    ) {
        self.comm.reset_bytes_sent();
        let ok = f(self.comm).and_then(|t| {
            let got = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let same = got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
            Ok(same && self.comm.bytes_sent() == bytes as u64)
        });
        self.report(name, ok);
    }
}

fn collectives(ck: &mut Checker) -> Result<()> {
    let (rank, n) = (ck.comm.rank(), ck.comm.world_size());
    for len in [1usize, 7, 1001, 65_537] {
        let all: Vec<Vec<f32>> = (0..n).map(|r| input(r, len)).collect();
        let mine = &all[rank];
        let own = shard_range(len, rank, n);
        let s = own.len();
        let sum: Vec<f32> = (0..len).map(|i| all.iter().map(|v| v[i]).sum()).collect();
        let mut with_nan = all.clone();
        with_nan[n - 1][len / 2] = f32::NAN;
        let max: Vec<f32> = (0..len)
            .map(|i| {
                with_nan.iter().map(|v| v[i]).fold(f32::MIN, |a, b| {
                    if a.is_nan() || b.is_nan() {
                        f32::NAN
                    } else {
                        a.max(b)
                    }
                })
            })
            .collect();
        let x = ck.gpu(mine)?;
        let xn = ck.gpu(&with_nan[rank])?;
        let ar = (len - s + (n - 1) * s) * 4;
        ck.check_against(&format!("all_reduce sum L={len}"), &sum, ar, |c| {
            Ok(c.all_reduce_sum(&x)?)
        });
        ck.check_against(&format!("all_reduce max+NaN L={len}"), &max, ar, |c| {
            Ok(c.all_reduce_max(&xn)?)
        });
        let x2 = x.reshape((1, len))?;
        ck.check_against(&format!("all_reduce sum 2-D L={len}"), &sum, ar, |c| {
            Ok(c.all_reduce_sum(&x2)?)
        });
        ck.check_against(
            &format!("reduce_scatter sum L={len}"),
            &sum[own.clone()],
            (len - s) * 4,
            |c| Ok(c.reduce_scatter(&x, ReduceOp::Sum)?),
        );
        ck.check_against(
            &format!("reduce_scatter max+NaN L={len}"),
            &max[own.clone()],
            (len - s) * 4,
            |c| Ok(c.reduce_scatter(&xn, ReduceOp::Max)?),
        );
        let stacked: Vec<f32> = all.concat();
        ck.check_against(
            &format!("all_gather f32 L={len}"),
            &stacked,
            (n - 1) * len * 4,
            |c| Ok(c.all_gather(&x)?),
        );
        ck.check_against(
            &format!("all_gather bf16 L={len}"),
            &stacked,
            (n - 1) * len * 2,
            |c| Ok(c.all_gather(&x.to_dtype(DType::BF16)?)?),
        );
        // Codes as U8: the global vector is all[0] mod 256, sharded.
        let codes: Vec<u8> = (0..len).map(|i| (i * 37 % 251) as u8).collect();
        let codes_f: Vec<f32> = codes.iter().map(|&c| c as f32).collect();
        let shard = Tensor::from_slice(&codes[own.clone()], s, ck.comm.device())?;
        ck.check_against(
            &format!("all_gather_shards u8 L={len}"),
            &codes_f,
            (n - 1) * s,
            |c| Ok(c.all_gather_shards(&shard, len)?),
        );
        ck.check_against(
            &format!("all_gather_shards f32 L={len}"),
            &sum,
            (n - 1) * s * 4,
            |c| {
                Ok(c.all_gather_shards(
                    &Tensor::from_slice(&sum[own.clone()], s, c.device())?,
                    len,
                )?)
            },
        );
        for root in [0, n - 1] {
            let bytes = if rank == root { (n - 1) * len * 4 } else { 0 };
            ck.check_against(
                &format!("broadcast root={root} L={len}"),
                &all[root],
                bytes,
                |c| Ok(c.broadcast(&x, root)?),
            );
        }
        // all_to_all: rank r sends chunk j of its input to rank j.
        let bytes_of =
            |r: usize| -> Vec<u8> { (0..len).map(|i| ((i * 37 + r * 11) % 251) as u8).collect() };
        let mine_u8 = Tensor::from_vec(bytes_of(rank), len, ck.comm.device())?;
        let chunks = (0..n)
            .map(|j| {
                let r = shard_range(len, j, n);
                Ok(mine_u8.narrow(0, r.start, r.len())?)
            })
            .collect::<Result<Vec<_>>>()?;
        let want: Vec<f32> = (0..n)
            .flat_map(|r| {
                bytes_of(r)[own.clone()]
                    .iter()
                    .map(|&a| a as f32)
                    .collect::<Vec<_>>()
            })
            .collect();
        let sent = len - s;
        ck.check_against(&format!("all_to_all u8 L={len}"), &want, sent, |c| {
            // candle cannot allocate a zero-element CUDA tensor (cat or a
            // cast of one fails with CUDA_ERROR_INVALID_VALUE): the empty
            // chunks (L = 1 on 2 ranks) are left out, an empty result is
            // compared on the CPU
            let got: Vec<Tensor> = c
                .all_to_all(&chunks)?
                .into_iter()
                .filter(|t| t.elem_count() > 0)
                .collect();
            match got.is_empty() {
                true => Ok(Tensor::zeros(0, DType::F32, &Device::Cpu)?),
                false => Ok(Tensor::cat(&got, 0)?),
            }
        });
        // all_to_all_gather: the same chunks, and every rank's two F32
        // (its rank and len) gathered in the same group, after the chunks
        let extra = ck.gpu(&[rank as f32, len as f32])?;
        let mut want_both = want.clone();
        want_both.extend((0..n).flat_map(|r| [r as f32, len as f32]));
        let sent_both = sent + (n - 1) * 8;
        ck.check_against(
            &format!("all_to_all_gather u8 + f32 L={len}"),
            &want_both,
            sent_both,
            |c| {
                let (got, gathered) = c.all_to_all_gather(&chunks, &extra)?;
                let mut parts: Vec<Tensor> = got
                    .into_iter()
                    .filter(|t| t.elem_count() > 0)
                    .map(|t| t.to_dtype(DType::F32))
                    .collect::<candle_core::Result<_>>()?;
                parts.push(gathered.flatten_all()?);
                Ok(Tensor::cat(&parts, 0)?)
            },
        );
    }
    ck.comm.reset_bytes_sent();
    let b = ck.comm.barrier().map(|()| ck.comm.bytes_sent() == 0);
    ck.report("barrier", b.map_err(Into::into));
    Ok(())
}

/// FP8 all-reduce on the GPUs against the in-process backend on the CPU
/// with the same inputs: codes and scale bitwise equal.
fn fp8_check(ck: &mut Checker) -> Result<()> {
    let (rank, n) = (ck.comm.rank(), ck.comm.world_size());
    let cfg = Fp8ReduceConfig::default();
    for len in [7usize, 1001, 65_537] {
        let g = ck.gpu(&grad_input(rank, len))?;
        ck.comm.reset_bytes_sent();
        let got = fp8_all_reduce(ck.comm, &g, &cfg);
        let name = format!("fp8_all_reduce vs in-process L={len}");
        let got = match got {
            Ok(r) => r,
            // amp-core's casts have no CUDA bodies in this build (its `cuda`
            // feature): say so instead of failing.
            Err(amp::comm::Error::Core(e @ amp::CoreError::UnsupportedDevice { .. })) => {
                println!("[rank {rank}/{n}] SKIP {name}: {e} (amp-core built without CUDA casts)");
                continue;
            }
            Err(e) => {
                ck.report(&name, Err(e.into()));
                continue;
            }
        };
        let gpu_bytes = ck.comm.bytes_sent();
        let reference = run_ranks(n, |c| {
            let g = Tensor::from_vec(grad_input(c.rank(), len), len, &Device::Cpu)?;
            let r = fp8_all_reduce(&c, &g, &cfg)?;
            Ok::<_, amp::comm::Error>((
                r.grad.data().to_vec1::<u8>()?,
                r.grad.meta().scale().to_vec1::<f32>()?,
                c.bytes_sent(),
            ))
        })?;
        let (codes, scale, bytes) = &reference[rank];
        let ok = (|| {
            Ok(
                got.grad.data().to_device(&Device::Cpu)?.to_vec1::<u8>()? == *codes
                    && got
                        .grad
                        .meta()
                        .scale()
                        .to_device(&Device::Cpu)?
                        .to_vec1::<f32>()?
                        == *scale
                    && got.is_finite()?
                    && gpu_bytes == *bytes,
            )
        })();
        ck.report(&name, ok);
    }
    Ok(())
}

/// The bucketed FP8 reductions on the GPUs (E5M2 gradients as the layers
/// hand them over, three tensors in one bucket) against the in-process
/// backend on the CPU: the all-reduce's codes and scales, and ZeRO's
/// reduce-scatter's F32 shards, bitwise equal.
fn bucket_check(ck: &mut Checker) -> Result<()> {
    let (rank, n) = (ck.comm.rank(), ck.comm.world_size());
    let lens = [7usize, 1001, 65_537];
    let cfg = Fp8ReduceConfig {
        qtype: QType::E5M2,
        ..Default::default()
    };
    let scaled = |rank: usize, dev: &Device| -> Result<Vec<ScalingTensor>> {
        lens.iter()
            .map(|&len| {
                let g = Tensor::from_vec(grad_input(rank, len), len, dev)?;
                Ok(ScalingTensor::quantize(&g, QType::E5M2, &CurrentScaling::default())?.0)
            })
            .collect()
    };
    type Out = (Vec<Vec<u8>>, Vec<Vec<f32>>, Vec<Vec<u32>>);
    // `defer`: as the levels run them during the backward, on the
    // communicator's stream with candle's waiting only at the end.
    let run = |comm: &dyn Communicator, grads: &[ScalingTensor], defer: bool| -> Result<Out> {
        let reduce = || -> amp::comm::Result<_> {
            Ok((
                fp8_all_reduce_bucket(comm, grads, &cfg)?,
                fp8_reduce_scatter_bucket(comm, grads, &cfg)?,
            ))
        };
        let (all, shards) = if defer {
            let out = amp::cuda::defer_side_work(reduce)?;
            if let Some(side) = comm.side_stream() {
                side.compute_wait()?;
            }
            out
        } else {
            reduce()?
        };
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
        Ok((
            all.iter()
                .map(|r| Ok(cpu(r.grad.data())?.to_vec1::<u8>()?))
                .collect::<Result<_>>()?,
            all.iter()
                .map(|r| Ok(cpu(r.grad.meta().scale())?.to_vec1::<f32>()?))
                .collect::<Result<_>>()?,
            shards
                .iter()
                .map(|r| {
                    Ok(cpu(&r.shard)?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|v| v.to_bits())
                        .collect())
                })
                .collect::<Result<_>>()?,
        ))
    };
    let name = "fp8 buckets (all-reduce, reduce-scatter) vs in-process";
    let grads = scaled(rank, ck.comm.device())?;
    let got = run(ck.comm, &grads, false);
    let deferred = run(ck.comm, &grads, true);
    let reference = run_ranks(n, |c| {
        run(
            &c,
            &scaled(c.rank(), &Device::Cpu).map_err(|e| amp::comm::Error::InvalidArgument {
                op: "bucket_check",
                what: format!("{e:#}"),
            })?,
            false,
        )
        .map_err(|e| amp::comm::Error::InvalidArgument {
            op: "bucket_check",
            what: format!("{e:#}"),
        })
    })?;
    ck.report(name, got.map(|g| g == reference[rank]));
    ck.report(
        "fp8 buckets deferred on the communicator's stream vs in-process",
        deferred.map(|g| g == reference[rank]),
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let start = Instant::now();
    let comm = NcclComm::from_env().context("joining the NCCL group")?;
    println!(
        "[rank {}/{}] NCCL {} on {:?}, set up in {:.2} s",
        comm.rank(),
        comm.world_size(),
        NcclComm::nccl_version()?,
        comm.device().location(),
        start.elapsed().as_secs_f64()
    );
    let mut ck = Checker {
        comm: &comm,
        failures: 0,
    };
    collectives(&mut ck)?;
    fp8_check(&mut ck)?;
    bucket_check(&mut ck)?;
    let failures = ck.failures;
    if args.bench {
        bench::bench(&comm, &args)?;
    }
    if args.bench_ce {
        copy_engine::bench_ce(&comm, &args)?;
    }
    comm.barrier()?;
    println!(
        "[rank {}/{}] {} failure(s)",
        comm.rank(),
        comm.world_size(),
        failures
    );
    if failures > 0 {
        std::process::exit(1);
    }
    Ok(())
}
