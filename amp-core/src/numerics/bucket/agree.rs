//! The small per-tensor vectors a bucket's ranks agree on: column maxima
//! of a `[ranks, tensors]` matrix, the scales each rank sends with, the
//! bound of the mean's amax, and the elementwise max of two amax vectors.

use super::*;
use crate::error::{Error, Result};
use crate::numerics::cast::quantize_slice;
use crate::numerics::kernel::{arity, launch, scalar, slice, Kernel};
use crate::numerics::qtype::QType;
use candle_core::{CpuStorage, CudaStorage, Layout, Shape, Tensor};

/// Columns `start..start + count` of the one input `m` (`[N, C]` F32),
/// each folded over the rows in row order from 0 by `f` (NaN passed as
/// inf): the CPU bodies of the column kernels.
fn fold_columns(
    name: &'static str,
    inputs: &[(&CpuStorage, &Layout)],
    start: usize,
    count: usize,
    f: impl Fn(f32, f32) -> f32,
) -> Result<Vec<f32>> {
    let [(m, lm)] = inputs else {
        return Err(arity(name));
    };
    let [rows, cols] = lm.shape().dims() else {
        return Err(arity(name));
    };
    let v = slice::<f32>(name, m, lm)?;
    Ok((start..start + count)
        .map(|c| {
            (0..*rows).fold(0f32, |acc, r| {
                let x = v[r * cols + c];
                f(acc, if x.is_nan() { f32::INFINITY } else { x })
            })
        })
        .collect())
}

/// m [N, C] (F32) -> [count]: the largest of column `start + c` over the
/// rows, NaN counted as inf.
pub(crate) struct BucketColumnMax {
    pub start: usize,
    pub count: usize,
}

impl Kernel for BucketColumnMax {
    const NAME: &'static str = "bucket_column_max";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let out = fold_columns(Self::NAME, inputs, self.start, self.count, |acc, x| {
            if x > acc {
                x
            } else {
                acc
            }
        })?;
        Ok(vec![(CpuStorage::F32(out), Shape::from(self.count))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_column_max(self.start, self.count, inputs)
    }
}

/// The largest of columns `start..start + count` of `m` (`[N, C]` F32,
/// values at least 0: amaxes, every rank's in a row) over the rows, NaN
/// counted as inf, as one `[count]` vector in one launch (that follows a
/// [`SideStream`](crate::SideStream)): the agreed amaxes of gathered
/// ones.
///
/// # Errors
/// [`Error::Unsupported`] unless `m` is 2-D with the columns.
pub fn bucket_column_max(m: &Tensor, start: usize, count: usize) -> Result<Tensor> {
    const OP: &str = BucketColumnMax::NAME;
    match m.dims() {
        [_, c] if start + count <= *c && count > 0 => {}
        _ => {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("columns {start}..{} of {:?}", start + count, m.shape()),
            })
        }
    }
    let op = BucketColumnMax { start, count };
    let [c] = <[Tensor; 1]>::try_from(launch(&op, &[m])?).map_err(|_| arity(OP))?;
    Ok(c)
}

/// scale_inv_0..T-1, scale_0..T-1, amax_0..T-1 -> [2T].
pub(crate) struct BucketScalesSent {
    pub qtype: QType,
}

impl Kernel for BucketScalesSent {
    const NAME: &'static str = "bucket_scales_sent";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let t = inputs.len() / 3;
        if t == 0 || inputs.len() != 3 * t {
            return Err(arity(Self::NAME));
        }
        let one = |k: usize| -> Result<f32> {
            let (s, l) = inputs[k];
            scalar(Self::NAME, s, l)
        };
        let mut out = vec![0f32; 2 * t];
        for i in 0..t {
            let (s, sc, m) = (one(i)?, one(t + i)?, one(2 * t + i)?);
            let flag = m * 0.0 + 1.0;
            out[i] = s * flag;
            // the code quantize casts the amax to, decoded
            let d = match (quantize_slice(self.qtype, &[m], sc).0, self.qtype.fp8()) {
                (CpuStorage::U8(c), Some(format)) => {
                    let mut d = [0f32];
                    format.decode_scaled_slice(&c, s, &mut d)?;
                    d[0]
                }
                (CpuStorage::F16(c), None) => c[0].to_f32() * s,
                _ => return Err(arity(Self::NAME)),
            };
            out[t + i] = d * flag;
        }
        Ok(vec![(CpuStorage::F32(out), Shape::from(2 * t))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_scales_sent(self.qtype, inputs)
    }
}

/// What a rank sends with its FP8 codes of `T` tensors, as one `[2T]`
/// vector in one launch (that follows a [`SideStream`](crate::SideStream)):
/// each tensor's `scale_inv` where its amax is finite and NaN where it is
/// not (`scale_inv * (amax * 0 + 1)`), then each tensor's largest decoded
/// value, `decode(cast(amax * scale)) * scale_inv` (NaN where the amax is
/// not finite): the exact amax of codes cast from values at most `amax`
/// with `scale` (casting to nearest is monotonic), without a pass over
/// them.
///
/// # Errors
/// [`Error::Unsupported`] for no tensor or lists of different lengths;
/// candle's for a value that is not one F32.
pub fn bucket_scales_sent(
    scale_invs: &[&Tensor],
    scales: &[&Tensor],
    amaxes: &[&Tensor],
    qtype: QType,
) -> Result<Tensor> {
    const OP: &str = BucketScalesSent::NAME;
    check_lists(OP, scale_invs, scales)?;
    check_lists(OP, scale_invs, amaxes)?;
    let mut inputs: Vec<&Tensor> = scale_invs.to_vec();
    inputs.extend_from_slice(scales);
    inputs.extend_from_slice(amaxes);
    let [c] = <[Tensor; 1]>::try_from(launch(&BucketScalesSent { qtype }, &inputs)?)
        .map_err(|_| arity(OP))?;
    Ok(c)
}

/// m [N, C] (F32) -> [count]: a bound of the mean's amax per column.
pub(crate) struct BucketMeanBound {
    pub start: usize,
    pub count: usize,
    pub factor: f32,
    pub inv_n: Option<f32>,
}

impl Kernel for BucketMeanBound {
    const NAME: &'static str = "bucket_mean_bound";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let sums = fold_columns(Self::NAME, inputs, self.start, self.count, |acc, x| acc + x)?;
        let out = sums
            .into_iter()
            .map(|sum| {
                let b = sum * self.factor;
                match self.inv_n {
                    Some(inv) => b * inv + 0.0,
                    None => b,
                }
            })
            .collect();
        Ok(vec![(CpuStorage::F32(out), Shape::from(self.count))])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_mean_bound(
            self.start,
            self.count,
            self.factor,
            self.inv_n,
            inputs,
        )
    }
}

/// A bound of the amax of the ranks' mean (or sum) of each tensor, from
/// their codes' amaxes alone, in one launch: `m` is `[N, C]` with rank
/// `r`'s amax of tensor `c` at `[r, start + c]` (the largest decoded value,
/// [`bucket_scales_sent`]); the result, `[count]`, is their sum in rank
/// order (NaN counted as inf), divided by `N` when `average` as
/// [`decode_sum`](crate::decode_sum) divides. Every element of the decoded
/// mean is at most this bound, rounding included (f32 addition and the
/// division are monotonic), so a scale from it never saturates; it costs
/// up to `log2 N` binades of range against the mean's own amax where the
/// ranks' largest values fall apart.
///
/// # Errors
/// [`Error::Unsupported`] unless `m` is 2-D with the columns.
pub fn bucket_mean_bound(m: &Tensor, start: usize, count: usize, average: bool) -> Result<Tensor> {
    const OP: &str = BucketMeanBound::NAME;
    let rows = match m.dims() {
        [r, c] if start + count <= *c && count > 0 => *r,
        _ => {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("columns {start}..{} of {:?}", start + count, m.shape()),
            })
        }
    };
    let op = BucketMeanBound {
        start,
        count,
        factor: 1.0,
        inv_n: (average && rows > 1).then(|| crate::numerics::decode_sum::DecodeSum::inv_n(rows)),
    };
    let [c] = <[Tensor; 1]>::try_from(launch(&op, &[m])?).map_err(|_| arity(OP))?;
    Ok(c)
}

/// a [T], b [T] (F32) -> their elementwise maximum (neither holds NaN:
/// agreed amaxes count NaN as inf).
pub(crate) struct BucketMax;

impl Kernel for BucketMax {
    const NAME: &'static str = "bucket_max";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(a, la), (b, lb)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let (a, b) = (
            slice::<f32>(Self::NAME, a, la)?,
            slice::<f32>(Self::NAME, b, lb)?,
        );
        if a.len() != b.len() {
            return Err(arity(Self::NAME));
        }
        let out: Vec<f32> = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| if y > x { y } else { x })
            .collect();
        Ok(vec![(CpuStorage::F32(out), la.shape().clone())])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::bucket_max(inputs)
    }
}

/// The elementwise maximum of two amax vectors (F32, one element a tensor,
/// no NaN), in one launch that follows a [`SideStream`](crate::SideStream)
/// (where `Tensor::maximum` would run on candle's stream).
///
/// # Errors
/// [`Error::Unsupported`] for vectors of different lengths; candle's.
pub fn bucket_max(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.elem_count() != b.elem_count() {
        return Err(Error::Unsupported {
            op: BucketMax::NAME,
            what: format!("{} and {} amaxes", a.elem_count(), b.elem_count()),
        });
    }
    let [c] = <[Tensor; 1]>::try_from(launch(&BucketMax, &[a, b])?)
        .map_err(|_| arity(BucketMax::NAME))?;
    Ok(c)
}
