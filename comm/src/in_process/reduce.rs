//! The reductions of the in-process backend, over the CPU storages of the
//! deposited tensors (no copies).

use super::deposit::Deposit;
use crate::communicator::ReduceOp;
use crate::error::{Error, Result};
use candle_core::{Storage, Tensor};
use std::ops::Range;

/// The error for a deposit that should be there by construction.
pub(super) fn missing(op: &'static str, rank: usize) -> Error {
    Error::InvalidArgument {
        op,
        what: format!("internal: no tensor from rank {rank}"),
    }
}

/// The one tensor of a deposit.
pub(super) fn first<'a>(op: &'static str, d: &'a Deposit) -> Result<&'a Tensor> {
    d.tensors.first().ok_or_else(|| missing(op, 0))
}

/// NaN wins; otherwise the larger.
#[inline]
fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else if b > a {
        b
    } else {
        a
    }
}

/// Elements `range` of the reduction of the deposits' first tensors
/// (contiguous F32 on the CPU), combined in rank order.
pub(super) fn reduce_range(
    op: &'static str,
    deps: &[Deposit],
    reduce: ReduceOp,
    range: Range<usize>,
) -> Result<Vec<f32>> {
    let mut acc: Vec<f32> = Vec::with_capacity(range.len());
    for (rank, d) in deps.iter().enumerate() {
        let t = first(op, d)?;
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            return Err(Error::UnsupportedDevice {
                op,
                backend: "in-process",
                device: t.device().location(),
            });
        };
        let data = cpu.as_slice::<f32>()?;
        let src = layout
            .contiguous_offsets()
            .and_then(|(start, end)| data.get(start..end))
            .and_then(|s| s.get(range.clone()))
            .ok_or_else(|| Error::InvalidArgument {
                op,
                what: format!("internal: tensor of rank {rank} is not contiguous or too short"),
            })?;
        if rank == 0 {
            acc.extend_from_slice(src);
            continue;
        }
        match reduce {
            ReduceOp::Sum => acc.iter_mut().zip(src).for_each(|(a, b)| *a += *b),
            ReduceOp::Max => acc
                .iter_mut()
                .zip(src)
                .for_each(|(a, b)| *a = max_nan(*a, *b)),
        }
    }
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_propagates_nan_from_either_side() {
        assert!(max_nan(f32::NAN, 1.0).is_nan());
        assert!(max_nan(1.0, f32::NAN).is_nan());
        assert_eq!(max_nan(1.0, f32::INFINITY), f32::INFINITY);
        assert_eq!(max_nan(-1.0, -2.0), -1.0);
    }
}
