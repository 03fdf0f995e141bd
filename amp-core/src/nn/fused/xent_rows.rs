//! The cross-entropy of rows and the logits' gradient for `g = 1` in one
//! kernel ([`CrossEntropyRowsGrad`]): what the head's loss over chunks of
//! rows (`nn/linear/head_loss.rs`) makes per chunk. Bit for bit the
//! forward ([`super::cross_entropy_rows`]) and then the backward kernel of
//! [`super::cross_entropy`] with `[1, lse]` a row, on each device, with one
//! read of the logits from memory instead of two.

use super::cpu;
use super::ops::{f32s, last_dim, store, u32s};
use crate::error::{Error, Result};
use crate::numerics::kernel::Kernel;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Shape};

/// Inputs: the logits `[rows, cols]` (F32 or BF16) and U32 targets
/// `[rows]`. Outputs: the F32 pairs `[rows, 2]` (`lse - x[t]`, `lse`) and
/// `softmax(x) - onehot(t)` in the logits' dtype and shape.
pub(super) struct CrossEntropyRowsGrad;

fn arity(got: usize) -> Error {
    Error::Unsupported {
        op: CrossEntropyRowsGrad::NAME,
        what: format!("two inputs (logits, targets), got {got}"),
    }
}

impl Kernel for CrossEntropyRowsGrad {
    const NAME: &'static str = "cross_entropy_rows_grad";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let &[(x, lx), (t, lt)] = inputs else {
            return Err(arity(inputs.len()));
        };
        let cols = last_dim(lx);
        let (xs, ts) = (f32s(x, lx)?, u32s(t, lt)?);
        let pairs = cpu::cross_entropy_fwd(&xs, &ts, cols);
        let gl: Vec<f32> = pairs.chunks(2).flat_map(|p| [1.0, p[1]]).collect();
        let dx = cpu::cross_entropy_bwd(&xs, &ts, &gl, cols);
        let rows = ts.len();
        Ok(vec![
            (CpuStorage::F32(pairs), Shape::from((rows, 2))),
            (store(dx, x.dtype()), lx.shape().clone()),
        ])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> Result<Vec<(candle_core::CudaStorage, Shape)>> {
        let &[(x, lx), (t, lt)] = inputs else {
            return Err(arity(inputs.len()));
        };
        let rows = lx.shape().elem_count() / last_dim(lx);
        let (pairs, dx) = super::cuda::ops::cross_entropy_fwd_bwd(x, lx, t, lt)?;
        Ok(vec![
            (pairs, Shape::from((rows, 2))),
            (dx, lx.shape().clone()),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::super::ops::CrossEntropyBwd;
    use candle_core::{DType, Device, Tensor};

    /// The fused kernel against the forward and then the backward kernel
    /// with `[1, lse]` a row, bit for bit, in F32 and BF16, at a width the
    /// packed loads take and one they do not.
    #[test]
    fn the_pair_and_gradient_as_the_two_kernels() -> crate::Result<()> {
        let dev = Device::Cpu;
        for (rows, cols) in [(5, 64), (3, 37)] {
            let x = Tensor::randn(0f32, 3.0, (rows, cols), &dev)?;
            let t = Tensor::from_vec(
                (0..rows as u32)
                    .map(|r| (r * 7) % cols as u32)
                    .collect::<Vec<_>>(),
                rows,
                &dev,
            )?;
            for dtype in [DType::F32, DType::BF16] {
                let x = x.to_dtype(dtype)?;
                let (pairs, dx) = super::super::cross_entropy_rows_with_grad(&x, &t)?;
                let want = super::super::cross_entropy_rows(&x, &t)?;
                let ones = Tensor::ones((rows, 1), DType::F32, &dev)?;
                let gl = Tensor::cat(&[&ones, &want.narrow(1, 1, 1)?], 1)?;
                let want_dx = x.apply_op3_no_bwd(&t, &gl, &CrossEntropyBwd)?;
                let bits = |a: &Tensor| -> crate::Result<Vec<u32>> {
                    Ok(a.to_dtype(DType::F32)?
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|v| v.to_bits())
                        .collect())
                };
                assert_eq!(bits(&pairs)?, bits(&want)?, "{dtype:?} {rows}x{cols}");
                assert_eq!(bits(&dx)?, bits(&want_dx)?, "{dtype:?} {rows}x{cols}");
                assert_eq!(dx.dtype(), dtype);
            }
        }
        Ok(())
    }

    /// Non-finite logits and a target outside the row give the two
    /// kernels' values too (NaN and inf where they give them): a NaN row,
    /// a +inf logit, a -inf logit, a target past the last class.
    #[test]
    fn non_finite_rows_and_bad_targets_as_the_two_kernels() -> crate::Result<()> {
        let dev = Device::Cpu;
        let cols = 8;
        let mut v: Vec<f32> = (0..4 * cols).map(|i| (i % 5) as f32 * 0.5).collect();
        v[2] = f32::NAN;
        v[cols + 3] = f32::INFINITY;
        v[2 * cols + 1] = f32::NEG_INFINITY;
        let x = Tensor::from_vec(v, (4, cols), &dev)?;
        let t = Tensor::from_vec(vec![1u32, 3, 0, cols as u32 + 2], 4, &dev)?;
        let (pairs, dx) = super::super::cross_entropy_rows_with_grad(&x, &t)?;
        let want = x.apply_op2_no_bwd(&t, &super::super::ops::CrossEntropy)?;
        let ones = Tensor::ones((4, 1), DType::F32, &dev)?;
        let gl = Tensor::cat(&[&ones, &want.narrow(1, 1, 1)?], 1)?;
        let want_dx = x.apply_op3_no_bwd(&t, &gl, &CrossEntropyBwd)?;
        let bits = |a: &Tensor| -> crate::Result<Vec<u32>> {
            Ok(a.flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() })
                .collect())
        };
        assert_eq!(bits(&pairs)?, bits(&want)?);
        assert_eq!(bits(&dx)?, bits(&want_dx)?);
        let p = pairs.to_vec2::<f32>()?;
        assert!(p[0][0].is_nan(), "a NaN row's loss is NaN");
        assert!(p[3][0].is_nan(), "a target past the classes gives NaN");
        Ok(())
    }
}
