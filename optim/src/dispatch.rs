//! Each optimizer kernel as an amp-core [`Kernel`]: its CPU body (beside
//! its description in `fused.rs`, `multi.rs`, `codec.rs`) or, on a CUDA
//! device, its CUDA body (`cuda.rs`, `cuda_sum_sq.rs`, `cuda_multi.rs`,
//! `cuda_codec.rs`). The dispatch lives here, above both, so that the CUDA
//! bodies can read the kernels' descriptions without the descriptions
//! calling back into them.

use crate::codec::Codec;
use crate::fused::{LowBitStep, SumSq};
use crate::multi::{LowBitMulti, SumSqMulti};
use amp_core::kernel::Kernel;
use candle_core::{CpuStorage, Layout, Shape};

impl Kernel for LowBitStep<'_> {
    const NAME: &'static str = "lowbit_adamw_step";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        self.cpu_body(inputs)
    }

    /// Two launches, bit-identical to [`cpu`](Self::cpu) (see `cuda.rs`).
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> amp_core::Result<Vec<(candle_core::CudaStorage, Shape)>> {
        crate::cuda::lowbit_step(self, inputs)
    }
}

impl Kernel for SumSq {
    const NAME: &'static str = "grad_sum_sq";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        self.cpu_body(inputs)
    }

    /// The same sums in the same order, bit-identical (see `cuda.rs`).
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> amp_core::Result<Vec<(candle_core::CudaStorage, Shape)>> {
        crate::cuda_sum_sq::sum_sq(self, inputs)
    }
}

impl Kernel for SumSqMulti {
    const NAME: &'static str = "grad_sum_sq_multi";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        self.cpu_body(inputs)
    }

    /// One launch, a gradient a block.
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> amp_core::Result<Vec<(candle_core::CudaStorage, Shape)>> {
        crate::cuda_multi::sum_sq_multi(inputs)
    }
}

impl Kernel for LowBitMulti {
    const NAME: &'static str = "lowbit_adamw_step_multi";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        self.cpu_body(inputs)
    }

    /// One launch, a parameter a block.
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> amp_core::Result<Vec<(candle_core::CudaStorage, Shape)>> {
        crate::cuda_multi::lowbit_multi(self, inputs)
    }
}

impl Kernel for Codec {
    const NAME: &'static str = "lowbit_step_codec";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        self.cpu_body(inputs)
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> amp_core::Result<Vec<(candle_core::CudaStorage, candle_core::Shape)>> {
        crate::cuda_codec::codec(self, inputs)
    }
}
