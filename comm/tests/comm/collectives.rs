//! Collectives of the in-process backend against direct computation, for
//! 1 to 4 ranks and sizes that do not divide by the world size, with the
//! bytes each rank sends.

use amp_comm::{run_ranks, run_ranks_each, Communicator, Error, InProcessConfig, ReduceOp};
use candle_core::{DType, Device, Tensor};
use std::time::Duration;

const SIZES: [usize; 3] = [1, 7, 1001];

/// Rank `r`'s input: small dyadic values, so sums are exact in any order.
fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 31 + i * 7) % 13) as f32 - 6.0 + rank as f32 * 0.25)
        .collect()
}

/// The chunk bounds, written out here rather than taken from the crate.
fn bounds(len: usize, world: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for r in 0..world {
        let n = len / world + if r < len % world { 1 } else { 0 };
        out.push((start, start + n));
        start += n;
    }
    out
}

fn cpu(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
}

#[test]
fn reductions_match_direct_computation() {
    for world in 1..=4 {
        for len in SIZES {
            let sum: Vec<f32> = (0..len)
                .map(|i| (0..world).map(|r| input(r, len)[i]).sum())
                .collect();
            let max: Vec<f32> = (0..len)
                .map(|i| {
                    (0..world)
                        .map(|r| input(r, len)[i])
                        .fold(f32::MIN, f32::max)
                })
                .collect();
            let b = bounds(len, world);
            let out = run_ranks(world, |comm| {
                let r = comm.rank();
                let x = cpu(&input(r, len));
                let s = comm.all_reduce_sum(&x)?.to_vec1::<f32>()?;
                let ar_bytes = comm.bytes_sent();
                let m = comm.all_reduce_max(&x)?.to_vec1::<f32>()?;
                comm.reset_bytes_sent();
                let rs = comm.reduce_scatter(&x, ReduceOp::Sum)?.to_vec1::<f32>()?;
                Ok::<_, Error>((s, m, rs, ar_bytes, comm.bytes_sent()))
            })
            .unwrap();
            for (r, (s, m, rs, ar_bytes, rs_bytes)) in out.into_iter().enumerate() {
                let (lo, hi) = b[r];
                let own = (hi - lo) as u64;
                assert_eq!(s, sum, "sum N={world} len={len} rank {r}");
                assert_eq!(m, max, "max N={world} len={len} rank {r}");
                assert_eq!(
                    rs,
                    &sum[lo..hi],
                    "reduce_scatter N={world} len={len} rank {r}"
                );
                let len = len as u64;
                let n = world as u64;
                assert_eq!(rs_bytes, 4 * (len - own), "reduce_scatter bytes");
                assert_eq!(
                    ar_bytes,
                    4 * (len - own + (n - 1) * own),
                    "all_reduce bytes"
                );
            }
        }
    }
}

#[test]
fn all_reduce_keeps_the_shape_and_sends_the_ring_bytes() {
    let out = run_ranks(4, |comm| {
        let x = Tensor::ones((3, 8), DType::F32, &Device::Cpu)?;
        let y = comm.all_reduce_sum(&x)?;
        Ok::<_, Error>((
            y.dims().to_vec(),
            y.sum_all()?.to_scalar::<f32>()?,
            comm.bytes_sent(),
        ))
    })
    .unwrap();
    for (dims, total, bytes) in out {
        assert_eq!(dims, [3, 8]);
        assert_eq!(total, 4.0 * 24.0);
        // 24 elements over 4 ranks divide evenly: 2 (N-1)/N * 24 * 4 bytes.
        assert_eq!(bytes, 2 * 3 * 24 * 4 / 4);
    }
}

#[test]
fn data_moving_collectives_match_direct_computation() {
    for world in 1..=4 {
        for len in SIZES {
            let b = bounds(len, world);
            let full: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
            let out = run_ranks(world, |comm| {
                let r = comm.rank();
                let n = world;
                let x = cpu(&input(r, len));
                let mut bytes = Vec::new();
                let gathered = comm.all_gather(&x)?;
                bytes.push(comm.bytes_sent());
                comm.reset_bytes_sent();
                let (lo, hi) = b[r];
                let shards = comm.all_gather_shards(&cpu(&full[lo..hi]), len)?;
                bytes.push(comm.bytes_sent());
                comm.reset_bytes_sent();
                let root = n - 1;
                let bc = comm.broadcast(&x, root)?;
                bytes.push(comm.bytes_sent());
                comm.reset_bytes_sent();
                // Chunk for rank j: j + 1 elements of value 100 r + j.
                let chunks: Vec<Tensor> = (0..n)
                    .map(|j| cpu(&vec![(100 * r + j) as f32; j + 1]))
                    .collect();
                let got = comm.all_to_all(&chunks)?;
                bytes.push(comm.bytes_sent());
                comm.reset_bytes_sent();
                comm.barrier()?;
                bytes.push(comm.bytes_sent());
                let got: Vec<Vec<f32>> = got
                    .iter()
                    .map(|t| t.to_vec1::<f32>())
                    .collect::<candle_core::Result<_>>()?;
                Ok::<_, Error>((
                    gathered.dims().to_vec(),
                    gathered.to_vec2::<f32>()?,
                    shards.to_vec1::<f32>()?,
                    bc.to_vec1::<f32>()?,
                    got,
                    bytes,
                ))
            })
            .unwrap();
            let (n, l) = (world as u64, len as u64);
            for (r, (dims, g, s, bc, got, bytes)) in out.into_iter().enumerate() {
                let ctx = format!("N={world} len={len} rank {r}");
                assert_eq!(dims, [world, len], "{ctx}");
                for (q, row) in g.iter().enumerate() {
                    assert_eq!(row, &input(q, len), "{ctx}");
                }
                assert_eq!(s, full, "{ctx}");
                assert_eq!(bc, input(world - 1, len), "{ctx}");
                assert_eq!(got.len(), world, "{ctx}");
                for (i, chunk) in got.iter().enumerate() {
                    assert_eq!(chunk, &vec![(100 * i + r) as f32; r + 1], "{ctx}");
                }
                let own = (b[r].1 - b[r].0) as u64;
                let root_bytes = if r == world - 1 { (n - 1) * l * 4 } else { 0 };
                let a2a: u64 = (0..world)
                    .filter(|&j| j != r)
                    .map(|j| 4 * (j as u64 + 1))
                    .sum();
                assert_eq!(
                    bytes,
                    [(n - 1) * l * 4, (n - 1) * own * 4, root_bytes, a2a, 0],
                    "{ctx}"
                );
            }
        }
    }
}

#[test]
fn max_propagates_nan_and_sum_propagates_inf() {
    let out = run_ranks(3, |comm| {
        let mut v = vec![1.0f32, 2.0, 3.0];
        if comm.rank() == 1 {
            v[0] = f32::NAN;
            v[2] = f32::INFINITY;
        }
        let m = comm.all_reduce_max(&cpu(&v))?.to_vec1::<f32>()?;
        let s = comm.all_reduce_sum(&cpu(&v))?.to_vec1::<f32>()?;
        Ok::<_, Error>((m, s))
    })
    .unwrap();
    for (m, s) in out {
        assert!(m[0].is_nan());
        assert_eq!(&m[1..], [2.0, f32::INFINITY]);
        assert!(s[0].is_nan());
        assert_eq!(&s[1..], [6.0, f32::INFINITY]);
    }
}

fn short() -> InProcessConfig {
    InProcessConfig {
        timeout: Duration::from_secs(2),
    }
}

#[test]
fn mismatched_shapes_are_an_error_on_every_rank() {
    let out = run_ranks_each(3, &short(), |comm| {
        let len = if comm.rank() == 2 { 4 } else { 3 };
        comm.all_reduce_sum(&Tensor::zeros(len, DType::F32, &Device::Cpu)?)
    })
    .unwrap();
    for (r, res) in out.iter().enumerate() {
        match res {
            Err(Error::Mismatch {
                op: "all_reduce",
                detail,
            }) => {
                assert!(detail.contains("rank 2"), "rank {r}: {detail}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn different_collectives_are_an_error_on_every_rank() {
    let out = run_ranks_each(2, &short(), |comm| {
        if comm.rank() == 0 {
            comm.barrier()
        } else {
            comm.broadcast(&Tensor::zeros(1, DType::F32, &Device::Cpu)?, 0)
                .map(|_| ())
        }
    })
    .unwrap();
    for res in out {
        let err = res.unwrap_err();
        assert!(matches!(err, Error::Mismatch { .. }), "{err}");
        assert!(err.to_string().contains("barrier"), "{err}");
    }
}

#[test]
fn a_local_argument_error_fails_the_rank_and_breaks_the_others() {
    let out = run_ranks_each(3, &short(), |comm| {
        let dtype = if comm.rank() == 1 {
            DType::U8
        } else {
            DType::F32
        };
        comm.all_reduce_sum(&Tensor::zeros(5, dtype, &Device::Cpu)?)
    })
    .unwrap();
    assert!(
        matches!(
            out[1],
            Err(Error::DType {
                op: "all_reduce",
                ..
            })
        ),
        "{:?}",
        out[1]
    );
    for r in [0, 2] {
        assert!(
            matches!(out[r], Err(Error::PeerFailed { rank: 1, .. })),
            "rank {r}: {:?}",
            out[r]
        );
    }
}
