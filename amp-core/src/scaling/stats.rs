//! Precision telemetry: how many elements a cast of a scaling tensor
//! saturated and how many it flushed to zero ([`CastStats`]), counted again
//! from its input. A diagnostic pass, outside the training step.

use crate::error::{Error, Result};
use crate::numerics::cast::{with_float, CastStats, Float};
use crate::numerics::kernel::arity;
use crate::numerics::kernel::{launch, scalar, slice, Kernel};
use crate::scaling::tensor::ScalingTensor;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Shape, Tensor};

impl ScalingTensor {
    /// Counts what casting `original` into `self` saturated and flushed:
    /// `original` is the tensor this one was quantized from.
    ///
    /// # Errors
    /// [`Error::Shape`] when the shapes differ, [`Error::DType`] unless
    /// `original` is F32, F16 or BF16.
    pub fn cast_stats(&self, original: &Tensor) -> Result<CastStats> {
        if original.shape() != self.shape() {
            return Err(Error::Shape {
                op: StatsKernel::NAME,
                lhs: original.shape().clone(),
                rhs: self.shape().clone(),
            });
        }
        let kernel = StatsKernel {
            max: self.qtype().max(),
        };
        let [counts] = <[Tensor; 1]>::try_from(launch(
            &kernel,
            &[original, self.data(), self.meta().scale()],
        )?)
        .map_err(|_| arity(StatsKernel::NAME))?;
        match counts.to_vec1::<i64>()?.as_slice() {
            [saturated, flushed] => Ok(CastStats {
                saturated: *saturated as u64,
                flushed: *flushed as u64,
                total: self.elem_count() as u64,
            }),
            _ => Err(arity(StatsKernel::NAME)),
        }
    }
}

/// x, data, scale -> [saturated, flushed] (I64: counts past 2^32 elements).
struct StatsKernel {
    max: f32,
}

impl Kernel for StatsKernel {
    const NAME: &'static str = "cast_stats";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(x, lx), (q, lq), (s, ls)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let scale = scalar(Self::NAME, s, ls)?;
        let zero: Vec<bool> = match q {
            CpuStorage::U8(_) => slice::<u8>(Self::NAME, q, lq)?
                .iter()
                .map(|c| c & 0x7F == 0)
                .collect(),
            CpuStorage::F16(_) => slice::<half::f16>(Self::NAME, q, lq)?
                .iter()
                .map(|v| v.to_f32() == 0.0)
                .collect(),
            other => {
                return Err(Error::DType {
                    op: Self::NAME,
                    expected: "U8 or F16",
                    got: other.dtype(),
                })
            }
        };
        let (saturated, flushed) = with_float!(Self::NAME, *x, |xs: T| {
            let xs = slice::<T>(Self::NAME, xs, lx)?;
            let mut counts = (0i64, 0i64);
            for (&v, &z) in xs.iter().zip(&zero) {
                let v = v.to_f32();
                let scaled = (v * scale).abs();
                counts.0 += i64::from(scaled > self.max);
                counts.1 += i64::from(z && v != 0.0 && !v.is_nan());
            }
            Ok::<_, Error>(counts)
        })?;
        Ok(vec![(
            CpuStorage::I64(vec![saturated, flushed]),
            Shape::from(2usize),
        )])
    }
}
