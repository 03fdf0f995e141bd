//! Softmax over the last dimension with a backward pass, for the attention
//! on CUDA: candle 0.11's fused `softmax_last_dim` has no backward, and the
//! composed softmax keeps four full attention matrices per layer alive for
//! backprop (at 350M, batch 8 x 1024 tokens, about 77 GB in F32: more than
//! an H100 holds). This op keeps only its output (the backward is
//! `y * (g - sum(g * y))`), and runs candle's own fused kernel forward.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, D};

struct SoftmaxLast;

impl CustomOp1 for SoftmaxLast {
    fn name(&self) -> &'static str {
        "gpt-softmax-last-dim"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("gpt-softmax-last-dim: CUDA only (the CPU path composes the softmax)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{
            CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
        };
        use candle_core::cuda_backend::{kernel_name, kernels, Map1, WrapErr};
        use candle_core::{CudaDevice, WithDType};

        // candle-nn 0.11.1's SoftmaxLastDim::cuda_fwd (private there).
        struct S;
        impl Map1 for S {
            fn f<T: DeviceRepr + WithDType>(
                &self,
                src: &CudaSlice<T>,
                dev: &CudaDevice,
                layout: &Layout,
            ) -> Result<CudaSlice<T>> {
                let src = match layout.contiguous_offsets() {
                    None => candle_core::bail!("softmax: input has to be contiguous"),
                    Some((o1, o2)) => src.slice(o1..o2),
                };
                let el = layout.shape().elem_count();
                let n_cols = layout.shape().dims()[layout.shape().rank() - 1];
                let cfg = LaunchConfig {
                    grid_dim: ((el / n_cols) as u32, 1, 1),
                    block_dim: (1, 32, 1),
                    shared_mem_bytes: 0,
                };
                let func = dev.get_or_load_func(&kernel_name::<T>("softmax"), &kernels::REDUCE)?;
                // SAFETY: every element is written by the kernel.
                let dst = unsafe { dev.alloc::<T>(el)? };
                let mut builder = func.builder();
                builder.arg(&src);
                builder.arg(&dst);
                let cols = n_cols as i32;
                builder.arg(&cols);
                // SAFETY: src and dst hold `el` elements of rows of `cols`.
                unsafe { builder.launch(cfg) }.w()?;
                Ok(dst)
            }
        }
        let dev = storage.device();
        let slice = S.map(&storage.slice, dev, layout)?;
        Ok((
            candle_core::cuda_backend::CudaStorage {
                slice,
                device: dev.clone(),
            },
            layout.shape().clone(),
        ))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let dot = (grad_res * res)?.sum_keepdim(D::Minus1)?;
        Ok(Some((res * grad_res.broadcast_sub(&dot)?)?))
    }
}

/// Softmax over the last dimension (CUDA), differentiable.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(SoftmaxLast)
}
