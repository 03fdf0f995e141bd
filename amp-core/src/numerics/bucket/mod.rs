//! The per-tensor steps of a bucketed FP8 reduction, a whole bucket in one
//! launch each instead of one launch per tensor (issue 21: with one launch
//! per tensor, a 350M GPT's 96 weight gradients cost a few thousand small
//! kernels a step). Each is bit for bit its one-tensor op, and its CPU
//! body is made of those ops:
//! [`bucket_amax`] (`ScalingTensor::decoded_amax`, NaN counted as inf),
//! [`bucket_scales`] (`ScalingMeta::for_current_amax`),
//! [`bucket_requantize`] (`ScalingTensor::requantize_with`, concatenated),
//! [`bucket_decode_sum`] ([`decode_sum`](crate::decode_sum) of each piece,
//! concatenated, with each tensor's amax), [`bucket_quantize`]
//! (`ScalingTensor::quantize_with` of each piece, concatenated), and the
//! pair that does the last two without the F32 sums in memory:
//! [`bucket_decode_amax`] (the amaxes alone) and
//! [`bucket_decode_sum_quantize`] (the codes of the sums).
//!
//! Here the pieces and the checks every step shares; the casts in
//! `casts.rs`, the rank sums in `sums.rs`, the small vectors the ranks
//! agree on in `agree.rs`, the copies and concatenations in `layout.rs`.

mod agree;
mod casts;
mod layout;
mod sums;

pub use agree::{bucket_column_max, bucket_max, bucket_mean_bound, bucket_scales_sent};
pub use casts::{
    bucket_amax, bucket_flag_scale_inv, bucket_quantize, bucket_requantize, bucket_scales,
};
pub use layout::{bucket_concat, bucket_copy, bucket_copy_from};
pub use sums::{bucket_decode_amax, bucket_decode_sum, bucket_decode_sum_quantize};
pub(crate) use sums::{BucketDecodeSum, SumOut};

use crate::error::{Error, Result};
use crate::numerics::kernel::{arity, slice, Kernel};
use crate::numerics::qtype::QType;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// One piece of a bucket: the tensor it belongs to, where it starts in the
/// input it is read from, and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Index of its tensor (for the per-tensor scale vectors).
    pub tensor: usize,
    /// First element in the input.
    pub start: usize,
    /// Elements.
    pub len: usize,
}

fn f32_one(v: f32) -> (CpuStorage, Layout) {
    (CpuStorage::F32(vec![v]), Layout::contiguous(1))
}

fn u8s(v: &[u8]) -> (CpuStorage, Layout) {
    (CpuStorage::U8(v.to_vec()), Layout::contiguous(v.len()))
}

/// Elements `start..start + len` of a code storage (U8 or F16), as a
/// storage of their own.
fn codes_range(
    c: &CpuStorage,
    l: &Layout,
    start: usize,
    len: usize,
) -> Result<(CpuStorage, Layout)> {
    const OP: &str = "bucket codes";
    let out = match c {
        CpuStorage::U8(_) => CpuStorage::U8(
            slice::<u8>(OP, c, l)?
                .get(start..start + len)
                .ok_or_else(|| arity(OP))?
                .to_vec(),
        ),
        CpuStorage::F16(_) => CpuStorage::F16(
            slice::<half::f16>(OP, c, l)?
                .get(start..start + len)
                .ok_or_else(|| arity(OP))?
                .to_vec(),
        ),
        other => {
            return Err(Error::DType {
                op: OP,
                expected: "U8 or F16",
                got: other.dtype(),
            })
        }
    };
    Ok((out, Layout::contiguous(len)))
}

fn fp8(op: &'static str, qtype: QType) -> Result<()> {
    match qtype.fp8() {
        Some(_) => Ok(()),
        None => Err(Error::Unsupported {
            op,
            what: "FP16 codes".into(),
        }),
    }
}

/// Of a bucket decode's `scale_inv` for `ranks` chunks: the number of
/// tensors, and whether each rank has its own scales (`[N, T]`: rank `k`'s
/// codes of tensor `t` decoded with element `[k, t]`) or all share them
/// (`[T]`).
fn scale_layout(shape: &Shape, ranks: usize) -> Result<(usize, bool)> {
    match shape.dims() {
        [t] => Ok((*t, false)),
        [n, t] if *n == ranks => Ok((*t, true)),
        _ => Err(Error::Unsupported {
            op: BucketDecodeSum::NAME,
            what: format!("scales of shape {shape:?} for {ranks} chunks"),
        }),
    }
}

fn check_lists(op: &'static str, codes: &[&Tensor], scale_invs: &[&Tensor]) -> Result<()> {
    if codes.is_empty() || codes.len() != scale_invs.len() {
        return Err(Error::Unsupported {
            op,
            what: format!(
                "{} code tensors with {} scales",
                codes.len(),
                scale_invs.len()
            ),
        });
    }
    Ok(())
}
