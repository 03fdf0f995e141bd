//! The step's global gradient norm, skip decision and gradient multiplier
//! (loss-scale inverse times the clipping coefficient), from every
//! parameter's sum of squares and every scaled gradient's source amax.
//!
//! [`clip_math`] is the host's arithmetic; [`ClipCoef`] is the same as a
//! kernel (CPU body and, under `cuda`, `kernels/clip.cuh`, bit-identical),
//! so that on a GPU the step's update is enqueued without the host waiting
//! for the sums: the update kernels read the multiplier from the device,
//! and a NaN multiplier (a non-finite gradient) makes them skip.

use amp_core::kernel::{slice, Kernel};
use candle_core::{CpuStorage, Layout, Shape};

/// The global norm (unscaled, before clipping) and the multiplier for a
/// finite squared norm `sum_sq` of the scaled gradients.
pub(crate) fn clip_math(sum_sq: f64, inv_scale: f64, max_norm: Option<f64>) -> (f64, f32) {
    let grad_norm = sum_sq.sqrt() * inv_scale;
    let clip = match max_norm {
        Some(max) => (max / (grad_norm + 1e-6)).min(1.0),
        None => 1.0,
    };
    (grad_norm, (inv_scale * clip) as f32)
}

/// Input: one F64 tensor, the `n_sums` sums of squares in parameter order
/// and then the amaxes. Outputs: F64 `[sum, norm]` (sum not finite, norm
/// NaN, where the step is skipped) and the F32 multiplier (NaN to skip).
pub(crate) struct ClipCoef {
    pub n_sums: usize,
    pub inv_scale: f64,
    pub max_norm: Option<f64>,
}

impl ClipCoef {
    /// `[sum, norm]` and the multiplier of `vals`, as the kernel gives them.
    fn reduce(&self, vals: &[f64]) -> ([f64; 2], f32) {
        let (sums, amaxes) = vals.split_at(self.n_sums.min(vals.len()));
        let mut sum = sums.iter().fold(0f64, |s, v| s + v);
        if amaxes.iter().any(|a| !a.is_finite()) {
            sum = f64::INFINITY;
        }
        if !sum.is_finite() {
            return ([sum, f64::NAN], f32::NAN);
        }
        let (norm, mul) = clip_math(sum, self.inv_scale, self.max_norm);
        ([sum, norm], mul)
    }
}

impl Kernel for ClipCoef {
    const NAME: &'static str = "grad_clip";

    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        let [(v, l)] = inputs else {
            return Err(amp_core::Error::Unsupported {
                op: Self::NAME,
                what: "wrong number of inputs".into(),
            });
        };
        let (out, mul) = self.reduce(slice::<f64>(Self::NAME, v, l)?);
        Ok(vec![
            (CpuStorage::F64(out.to_vec()), Shape::from(2usize)),
            (CpuStorage::F32(vec![mul]), Shape::from(1usize)),
        ])
    }

    /// One block; the same additions in the same order (see `clip.cuh`).
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> amp_core::Result<Vec<(candle_core::CudaStorage, Shape)>> {
        use crate::cuda::{bad, func, THREADS};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        use candle_core::cuda_backend::{CudaStorage, WrapErr};
        let [(v, l)] = inputs else {
            return Err(bad(Self::NAME, "wrong number of inputs"));
        };
        let n = l.shape().elem_count();
        let (start, end) = l
            .contiguous_offsets()
            .ok_or_else(|| bad(Self::NAME, "non-contiguous input"))?;
        let dev = v.device().clone();
        let stream = dev.cuda_stream();
        let vals = v.as_cuda_slice::<f64>()?.slice(start..end);
        // SAFETY (both): thread 0 of grad_clip writes both elements of `out`
        // and the multiplier.
        let mut out = unsafe { dev.alloc::<f64>(2)? };
        let mut mul = unsafe { dev.alloc::<f32>(1)? };
        let (n_sums, len) = (self.n_sums as u32, n as u32);
        let max_norm = self.max_norm.unwrap_or(0.0);
        let f = func(&dev, "grad_clip")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&vals)
            .arg(&n_sums)
            .arg(&len)
            .arg(&self.inv_scale)
            .arg(&max_norm)
            .arg(&mut out)
            .arg(&mut mul);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `vals` holds n f64, `out` 2 f64, `mul` one f32.
        unsafe { b.launch(cfg) }.w()?;
        Ok(vec![
            (
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from(2usize),
            ),
            (CudaStorage::wrap_cuda_slice(mul, dev), Shape::from(1usize)),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_body_is_the_host_arithmetic() {
        let k = ClipCoef {
            n_sums: 3,
            inv_scale: 0.25,
            max_norm: Some(1.0),
        };
        let ([sum, norm], mul) = k.reduce(&[4.0, 9.0, 3.0, 1.5, 2.0]);
        // sqrt(16) * 0.25 = 1: clipped to 1 / (1 + 1e-6), times the inverse
        assert_eq!((sum, norm), (16.0, 1.0));
        assert_eq!(mul, (0.25 * (1.0 / (1.0 + 1e-6))) as f32);
        // a non-finite amax skips, as does a non-finite sum
        let ([sum, norm], mul) = k.reduce(&[4.0, 9.0, 3.0, f64::NAN, 2.0]);
        assert!(sum.is_infinite() && norm.is_nan() && mul.is_nan());
        let (_, mul) = k.reduce(&[4.0, f64::INFINITY, 3.0]);
        assert!(mul.is_nan());
        // no clipping below the limit; the multiplier is the scale's inverse
        let k = ClipCoef {
            n_sums: 1,
            inv_scale: 0.5,
            max_norm: Some(100.0),
        };
        assert_eq!(k.reduce(&[4.0]).1, 0.5);
    }
}
