//! Each optimizer kernel as an amp-core [`Kernel`]: its CPU body (beside
//! its description in `fused.rs`, `multi.rs`, `codec.rs`, `restore.rs`)
//! or, on a CUDA device, its CUDA body (`cuda.rs`, `cuda_sum_sq.rs`,
//! `cuda_multi.rs`, `cuda_codec.rs`, `cuda_restore.rs`). The dispatch
//! lives here, above both, so that the CUDA bodies can read the kernels'
//! descriptions without the descriptions calling back into them.

use crate::codec::Codec;
use crate::fused::{LowBitStep, SumSq, SumSqMany};
use crate::multi::{LowBitMulti, SumSqMulti};
use crate::restore::RestoreOnSkip;
use amp_core::kernel::Kernel;
use candle_core::{CpuStorage, Layout, Shape};

/// `impl Kernel for $ty`: the CPU body `cpu_body` (or, with `cpu refuses
/// $what`, a clear error naming what the CPU does not do), the CUDA body
/// `$cuda` (with `$k` the kernel and `$inputs` the storages).
macro_rules! dispatch {
    ($ty:ty, $name:literal, |$k:ident, $inputs:ident| $cuda:expr) => {
        dispatch!(@impl $ty, $name, |kernel, inputs| kernel.cpu_body(inputs), |$k, $inputs| $cuda);
    };
    ($ty:ty, $name:literal, cpu refuses $what:literal, |$k:ident, $inputs:ident| $cuda:expr) => {
        dispatch!(@impl $ty, $name, |_kernel, _inputs| Err(amp_core::Error::Unsupported {
            op: $name,
            what: $what.into(),
        }), |$k, $inputs| $cuda);
    };
    (@impl $ty:ty, $name:literal, |$ck:ident, $cin:ident| $cpu:expr, |$k:ident, $inputs:ident| $cuda:expr) => {
        impl Kernel for $ty {
            const NAME: &'static str = $name;

            fn cpu(
                &self,
                $cin: &[(&CpuStorage, &Layout)],
            ) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
                let $ck = self;
                $cpu
            }

            #[cfg(feature = "cuda")]
            fn cuda(
                &self,
                $inputs: &[(&candle_core::CudaStorage, &Layout)],
            ) -> amp_core::Result<Vec<(candle_core::CudaStorage, Shape)>> {
                let $k = self;
                $cuda
            }
        }
    };
}

// Two launches, bit-identical to the CPU body (see `cuda.rs`).
dispatch!(LowBitStep<'_>, "lowbit_adamw_step", |k, inputs| {
    crate::cuda::lowbit_step(k, inputs)
});
// The same sums in the same order, bit-identical (see `cuda.rs`).
dispatch!(
    SumSq,
    "grad_sum_sq",
    |k, inputs| crate::cuda_sum_sq::sum_sq(k, inputs)
);
// Two launches for all, each total with the bits of its own SumSq.
dispatch!(SumSqMany, "grad_sum_sq_many", |k, inputs| {
    crate::cuda_sum_sq::sum_sq_many(k, inputs)
});
// One launch, a gradient a block.
dispatch!(SumSqMulti, "grad_sum_sq_multi", |_k, inputs| {
    crate::cuda_multi::sum_sq_multi(inputs)
});
// One launch, a parameter a block.
dispatch!(LowBitMulti, "lowbit_adamw_step_multi",
    cpu refuses "an in-place weight update on the CPU", |k, inputs| {
    crate::cuda_multi::lowbit_multi(k, inputs)
});
dispatch!(Codec, "lowbit_step_codec", |k, inputs| {
    crate::cuda_codec::codec(k, inputs)
});
// One launch behind a deferred step's updates, a pair a block.
// (the CPU path learns the outcome before it updates anything)
dispatch!(RestoreOnSkip, "restore_on_skip",
    cpu refuses "a step's outcome left on the device, on the CPU", |_k, inputs| {
    crate::cuda_restore::restore_on_skip(inputs)
});
