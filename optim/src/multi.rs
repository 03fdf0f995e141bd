//! The sum of squares and the step of many small tensors in one launch
//! each (a tensor a CUDA block, `kernels/multi.cuh`): a GPT's biases and
//! LayerNorm parameters are hundreds of tensors of at most a few thousand
//! elements, whose two launches and allocations each cost more host and
//! GPU time than their work. Every result has the bits of the per-tensor
//! kernels (the same code, run as a grid of one block).
//!
//! The step's new moments go into one buffer per dtype (views of it become
//! each parameter's state), and all meta slots into one more, so the whole
//! batch allocates four buffers.

use crate::adamw::AdamStep;
use crate::fused::{SumSqMany, META_LEN, Q};
use candle_core::{CpuStorage, DType, Layout, Shape};

/// Most elements of a tensor that takes the launches over many tensors:
/// the sum of squares of one CUDA block of `sumsq_partials` (4 element
/// blocks of 2048), which also bounds the step's one-block launch.
pub(crate) const MULTI_MAX: usize = 8192;

/// Elements each moment's place in its buffer is rounded up to (16 bytes
/// for every dtype: the kernels' vector accesses).
const ALIGN: usize = 16;

/// Sums of squares of many F32 gradients of 1..=[`MULTI_MAX`] elements:
/// inputs (gradient, its scale_inv) pairs; output one F64 per gradient.
pub(crate) struct SumSqMulti;

impl SumSqMulti {
    /// The CPU body of the kernel (`dispatch.rs` makes it one): each
    /// gradient's own sum, as [`SumSqMany`] of F32 gradients.
    pub(crate) fn cpu_body(
        &self,
        inputs: &[(&CpuStorage, &Layout)],
    ) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        SumSqMany { g: None }.cpu_body(inputs)
    }
}

/// Steps of many parameters whose weights are F32 and updated in place
/// (CUDA only: the CPU body cannot write an input): per parameter its
/// constants, the kinds of its gradient, m and v, and where v holds
/// square roots their rounding's salt ([`LowBitStep::v_sqrt`](crate::fused::LowBitStep)). Inputs per parameter
/// weight, its scale_inv, gradient, scale_inv, m, scale_inv, v, scale_inv;
/// then the gradient multiplier. Outputs: the U8, F16 and F32 buffers that
/// hold every m and v at [`MomentPlaces`], then the meta slots,
/// [`META_LEN`] a parameter (as `LowBitStep` orders them).
pub(crate) struct LowBitMulti {
    pub steps: Vec<(AdamStep, [Q; 3], Option<u32>)>,
}

/// Where each parameter's m and v lie: (dtype, offset in that dtype's
/// buffer), and the buffers' lengths (U8, F16, F32; at least [`ALIGN`]).
pub(crate) struct MomentPlaces {
    pub places: Vec<[(DType, usize); 2]>,
    /// (read by the CUDA body, which allocates the buffers)
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub lens: [usize; 3],
}

/// The dtypes of the moment buffers, in the order of the step's outputs.
pub(crate) const BUFFER_DTYPES: [DType; 3] = [DType::U8, DType::F16, DType::F32];

/// The buffer of a dtype among the three (F32 for any other).
pub(crate) fn buffer_index(dtype: DType) -> usize {
    BUFFER_DTYPES.iter().position(|&d| d == dtype).unwrap_or(2)
}

impl MomentPlaces {
    /// The places of the moments of `kinds` (m's and v's dtype per
    /// parameter) for tensors of `ns` elements, in order.
    pub fn new(dtypes: &[[DType; 2]], ns: &[usize]) -> Self {
        let mut lens = [0usize; 3];
        let places = dtypes
            .iter()
            .zip(ns)
            .map(|(d, &n)| {
                d.map(|dtype| {
                    let len = &mut lens[buffer_index(dtype)];
                    let at = *len;
                    *len += n.div_ceil(ALIGN) * ALIGN;
                    (dtype, at)
                })
            })
            .collect();
        Self {
            places,
            lens: lens.map(|l| l.max(ALIGN)),
        }
    }
}

/// The meta slots of parameter `i` start here in the meta buffer.
pub(crate) fn meta_at(i: usize) -> usize {
    i * META_LEN
}

/// The storage dtype of a stream of kind `q`.
pub(crate) fn storage_dtype(q: Q) -> DType {
    match q {
        Some(amp_core::QType::F16) => DType::F16,
        Some(_) => DType::U8,
        None => DType::F32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::SumSq;
    use amp_core::kernel::launch;
    use candle_core::{Device, Tensor};

    #[test]
    fn moments_get_aligned_places_that_do_not_overlap() {
        let dtypes = [
            [DType::U8, DType::F16],
            [DType::F32, DType::F32],
            [DType::U8, DType::F16],
        ];
        let p = MomentPlaces::new(&dtypes, &[1, 17, 16]);
        assert_eq!(
            p.places,
            vec![
                [(DType::U8, 0), (DType::F16, 0)],
                [(DType::F32, 0), (DType::F32, 32)],
                [(DType::U8, 16), (DType::F16, 16)],
            ]
        );
        assert_eq!(p.lens, [32, 32, 64]);
        // an unused dtype still gets a (small) buffer
        assert_eq!(
            MomentPlaces::new(&[[DType::U8, DType::U8]], &[3]).lens,
            [32, 16, 16]
        );
    }

    #[test]
    fn the_batched_sums_are_the_single_ones() -> amp_core::Result<()> {
        let one = Tensor::ones(1, DType::F32, &Device::Cpu)?;
        let gs: Vec<Tensor> = [1usize, 9, 2048, 2049, 8192]
            .iter()
            .map(|&n| {
                let v: Vec<f32> = (0..n)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
                    .collect();
                Tensor::from_vec(v, n, &Device::Cpu)
            })
            .collect::<candle_core::Result<_>>()?;
        let inputs: Vec<&Tensor> = gs.iter().flat_map(|g| [g, &one]).collect();
        let batched = launch(&SumSqMulti, &inputs)?[0].to_vec1::<f64>()?;
        for (g, b) in gs.iter().zip(&batched) {
            let single = launch(&SumSq { g: None }, &[g, &one])?[0].to_vec1::<f64>()?;
            assert_eq!(single[0].to_bits(), b.to_bits());
        }
        // the step over many tensors writes weights in place: not on the CPU
        let k = LowBitMulti { steps: Vec::new() };
        assert!(launch(&k, &[&one]).is_err());
        Ok(())
    }
}
