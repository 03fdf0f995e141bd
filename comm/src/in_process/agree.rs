//! Whether the deposits of one round fit together (same collective, same
//! shapes and dtypes where the collective needs them).

use super::deposit::{Call, Deposit};
use candle_core::{DType, Tensor};

fn describe(t: &Tensor) -> (DType, Vec<usize>) {
    (t.dtype(), t.dims().to_vec())
}

/// Checks that the deposits of one round fit together; the error says how not.
pub(super) fn check_agree(deposits: &[Deposit]) -> std::result::Result<(), String> {
    let Some(first) = deposits.first() else {
        return Ok(());
    };
    for (r, d) in deposits.iter().enumerate() {
        if d.op != first.op || d.call != first.call {
            return Err(format!(
                "rank 0 called {} ({:?}), rank {r} called {} ({:?})",
                first.op, first.call, d.op, d.call
            ));
        }
    }
    match first.call {
        Call::AllToAll => {
            for (i, d) in deposits.iter().enumerate() {
                for (j, chunk) in d.tensors.iter().enumerate() {
                    let own = deposits.get(j).and_then(|dj| dj.tensors.get(j));
                    if own.map(describe) != Some(describe(chunk)) {
                        return Err(format!(
                            "rank {i} sends rank {j} a chunk of {:?}, rank {j} keeps {:?}",
                            describe(chunk),
                            own.map(describe)
                        ));
                    }
                }
            }
        }
        Call::AllGatherShards { .. } => {
            for (r, d) in deposits.iter().enumerate() {
                let (a, b) = (d.tensors.first(), first.tensors.first());
                if a.map(Tensor::dtype) != b.map(Tensor::dtype) {
                    return Err(format!(
                        "rank 0 passes {:?}, rank {r} {:?}",
                        b.map(Tensor::dtype),
                        a.map(Tensor::dtype)
                    ));
                }
            }
        }
        Call::ReduceScatter(_) | Call::AllGather | Call::Broadcast { .. } | Call::Barrier => {
            let want: Vec<_> = first.tensors.iter().map(describe).collect();
            for (r, d) in deposits.iter().enumerate() {
                let got: Vec<_> = d.tensors.iter().map(describe).collect();
                if got != want {
                    return Err(format!("rank 0 passes {want:?}, rank {r} {got:?}"));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::communicator::ReduceOp;
    use candle_core::Device;

    fn zeros(n: usize, dtype: DType) -> Tensor {
        Tensor::zeros(n, dtype, &Device::Cpu).unwrap()
    }

    fn dep(op: &'static str, call: Call, tensors: Vec<Tensor>) -> Deposit {
        Deposit { op, call, tensors }
    }

    #[test]
    fn same_calls_agree() {
        let d = |_| {
            dep(
                "all_reduce",
                Call::ReduceScatter(ReduceOp::Sum),
                vec![zeros(3, DType::F32)],
            )
        };
        assert_eq!(check_agree(&[d(0), d(1), d(2)]), Ok(()));
    }

    #[test]
    fn reduce_op_dtype_and_root_must_agree() {
        let a = dep(
            "all_reduce",
            Call::ReduceScatter(ReduceOp::Sum),
            vec![zeros(3, DType::F32)],
        );
        let b = dep(
            "all_reduce",
            Call::ReduceScatter(ReduceOp::Max),
            vec![zeros(3, DType::F32)],
        );
        assert!(check_agree(&[a, b]).unwrap_err().contains("rank 1"));
        let a = dep("all_gather", Call::AllGather, vec![zeros(3, DType::F32)]);
        let b = dep("all_gather", Call::AllGather, vec![zeros(3, DType::U8)]);
        assert!(check_agree(&[a, b]).is_err());
        let a = dep(
            "broadcast",
            Call::Broadcast { root: 0 },
            vec![zeros(1, DType::F32)],
        );
        let b = dep(
            "broadcast",
            Call::Broadcast { root: 1 },
            vec![zeros(1, DType::F32)],
        );
        assert!(check_agree(&[a, b]).is_err());
    }

    #[test]
    fn all_to_all_chunks_must_fit_their_receiver() {
        // Rank 0 keeps 2 elements, rank 1 keeps 3: what each sends the other must match.
        let ok0 = || {
            dep(
                "all_to_all",
                Call::AllToAll,
                vec![zeros(2, DType::U8), zeros(3, DType::U8)],
            )
        };
        let ok1 = || {
            dep(
                "all_to_all",
                Call::AllToAll,
                vec![zeros(2, DType::U8), zeros(3, DType::U8)],
            )
        };
        assert_eq!(check_agree(&[ok0(), ok1()]), Ok(()));
        let bad1 = dep(
            "all_to_all",
            Call::AllToAll,
            vec![zeros(3, DType::U8), zeros(3, DType::U8)],
        );
        let err = check_agree(&[ok0(), bad1]).unwrap_err();
        assert!(err.contains("rank 1 sends rank 0"), "{err}");
    }
}
