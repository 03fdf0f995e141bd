//! The cast-transpose as a [`Kernel`]: the cast of a 2-D input with its
//! codes also written transposed (CUDA: `kernels/cast_t.cu`, one pass; the
//! CPU casts, then transposes).

use crate::error::{Error, Result};
use crate::numerics::cast::{Dequantize, Quantize};
use crate::numerics::kernel::arity;
use crate::numerics::kernel::Kernel;
use crate::numerics::qtype::QType;
use crate::numerics::requantize::DecodedAmax;
use crate::numerics::scale::FromAmax;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape};

/// [`Quantize`] of a 2-D `x` (FP8 targets) with its codes also transposed:
/// `(codes [rows, cols], codes [cols, rows], amax, counts)`, the operands
/// of the GEMMs that take `x` K-major (Transformer Engine's cast-transpose).
/// One pass on CUDA; the CPU casts, then transposes the codes. `scaled`:
/// `x` is an FP16 scaling tensor's data and a third input its scale_inv;
/// the cast takes the dequantized F32 values (bit for bit a dequantize,
/// then this cast), which CUDA decodes as it reads.
pub(crate) struct QuantizeT {
    pub qtype: QType,
    pub from_amax: Option<FromAmax>,
    pub scaled: bool,
    /// Whether the counts output is made (numerics/counts.rs).
    pub counts: bool,
}

impl Kernel for QuantizeT {
    const NAME: &'static str = "quantize_t";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let cast = Quantize {
            qtype: self.qtype,
            from_amax: self.from_amax,
            counts: self.counts,
        };
        let mut out = match inputs {
            [x, s] if !self.scaled => cast.cpu(&[*x, *s])?,
            [x, s, pre] if self.scaled => {
                let dq = Dequantize {
                    qtype: QType::F16,
                    dtype: DType::F32,
                };
                let [(values, shape)] = <[(CpuStorage, Shape); 1]>::try_from(dq.cpu(&[*x, *pre])?)
                    .map_err(|_| arity(Self::NAME))?;
                cast.cpu(&[(&values, &Layout::contiguous(shape)), *s])?
            }
            _ => return Err(arity(Self::NAME)),
        };
        let (rows, cols) = out[0].1.dims2()?;
        let CpuStorage::U8(codes) = &out[0].0 else {
            return Err(Error::Unsupported {
                op: Self::NAME,
                what: "a transposed FP16 cast (FP8 targets only)".into(),
            });
        };
        let mut t = vec![0u8; codes.len()];
        for (r, row) in codes.chunks(cols.max(1)).enumerate() {
            for (c, &v) in row.iter().enumerate() {
                t[c * rows + r] = v;
            }
        }
        out.insert(1, (CpuStorage::U8(t), Shape::from((cols, rows))));
        Ok(out)
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::cast_t::quantize_t(
            self.qtype,
            self.from_amax,
            self.scaled,
            self.counts,
            inputs,
        )
    }
}

/// [`QuantizeT`] of many FP16 scaling tensors with current scaling, each
/// from its own decoded amax ([`DecodedAmax`] then `QuantizeT { scaled:
/// true, from_amax: Some(from) }` per tensor): inputs `(codes [rows,
/// cols], scale_inv)` pairs; outputs per tensor `codes, codes_t, scale,
/// scale_inv`, then every tensor's amax `[T]` and with `counts` their
/// counts `[T, 2]`. CUDA:
/// two launches for all of them (`kernels/cast_t.cu`,
/// `decoded_amax_many_f16` and `quantize_t_many_f16s_*`), each tensor's
/// bits those of its own launches; the CPU runs the per-tensor bodies.
pub(crate) struct RequantizeTMany {
    pub qtype: QType,
    pub from: FromAmax,
    /// Whether the counts output is made (numerics/counts.rs).
    pub counts: bool,
}

/// Outputs of [`RequantizeTMany`] per tensor before the shared amax and
/// counts.
pub(crate) const MANY_T_OUTPUTS: usize = 4;

impl Kernel for RequantizeTMany {
    const NAME: &'static str = "requantize_t_many";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        if inputs.is_empty() || inputs.len() % 2 != 0 {
            return Err(arity(Self::NAME));
        }
        let cast = QuantizeT {
            qtype: self.qtype,
            from_amax: Some(self.from),
            scaled: true,
            counts: true,
        };
        let count = inputs.len() / 2;
        let mut out = Vec::with_capacity(count * MANY_T_OUTPUTS + 2);
        let (mut amaxes, mut counts) = (Vec::with_capacity(count), Vec::with_capacity(2 * count));
        for pair in inputs.chunks_exact(2) {
            let [x, pre] = pair else {
                return Err(arity(Self::NAME));
            };
            let amax = DecodedAmax { qtype: QType::F16 }.cpu(&[*x, *pre])?;
            let [(amax, shape)] =
                <[(CpuStorage, Shape); 1]>::try_from(amax).map_err(|_| arity(Self::NAME))?;
            let layout = Layout::contiguous(shape);
            amaxes.extend_from_slice(amax.as_slice::<f32>()?);
            let cast = cast.cpu(&[*x, (&amax, &layout), *pre])?;
            let [codes, codes_t, (c, _), scale, scale_inv] =
                <[(CpuStorage, Shape); 5]>::try_from(cast).map_err(|_| arity(Self::NAME))?;
            counts.extend_from_slice(c.as_slice::<i64>()?);
            out.extend([codes, codes_t, scale, scale_inv]);
        }
        out.push((CpuStorage::F32(amaxes), Shape::from(count)));
        if self.counts {
            out.push((CpuStorage::I64(counts), Shape::from((count, 2))));
        }
        Ok(out)
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::cast_t_many::requantize_t_many(
            self.qtype,
            self.from,
            self.counts,
            inputs,
        )
    }
}
