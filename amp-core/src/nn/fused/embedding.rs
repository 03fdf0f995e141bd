//! Embedding lookup with a deterministic backward that needs no atomics:
//! the table's gradient for row `r` is the sum of the output gradient's rows
//! of the tokens equal to `r`, added in token order from zero, the order of
//! candle's `index_add` (so the bits equal candle's backward of
//! `index_select` when the table gets no other gradient; a table also used
//! elsewhere, a tied head say, has this sum added to the rest where candle
//! adds each row into it, which rounds differently). On CUDA each sum stays
//! in one thread; candle's kernel gives a thread a whole column, 768 threads
//! for a GPT-2 table: too few to fill a GPU.

use super::embedding_hook::{offer, LookupGrad};
#[cfg(feature = "cuda")]
use super::ops::wrap;
use super::ops::{f32s, u32s};
use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};

/// `table[ids]`: rows of `table` `[rows, cols]` for U32 `ids` of any shape,
/// `[ids.., cols]`. F32 tables go through the fused op; other float tables
/// through candle's `index_select` (the same values for ids in range,
/// candle's backward).
///
/// # Errors
/// [`Error::DType`] for ids other than U32, [`Error::Rank`] for a table that
/// is not 2-D, [`Error::Device`]; on the CPU an id outside `0..rows` is
/// [`Error::Unsupported`]. On CUDA such an id is not read back (no host
/// copy): with an F32 table its output row is NaN, so the loss is NaN and a
/// loss-scaled step is skipped, never silently wrong; with another dtype it
/// is candle's `index_select` (a device-side assertion).
pub fn embedding(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    const OP: &str = "embedding";
    if ids.dtype() != DType::U32 {
        return Err(Error::DType {
            op: OP,
            expected: "U32 ids",
            got: ids.dtype(),
        });
    }
    let (rows, cols) = table.dims2().map_err(|_| Error::Rank {
        op: OP,
        expected: 2,
        got: table.shape().clone(),
    })?;
    if !ids.device().same_device(table.device()) {
        return Err(Error::Device {
            op: OP,
            lhs: ids.device().location(),
            rhs: table.device().location(),
        });
    }
    let mut dims = ids.dims().to_vec();
    dims.push(cols);
    let flat = ids.flatten_all()?.contiguous()?;
    if !flat.device().is_cuda() && flat.elem_count() > 0 {
        let max = flat.max(0)?.to_scalar::<u32>()?;
        if max as usize >= rows {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("id {max} is outside a table of {rows} rows"),
            });
        }
    }
    let rows = if table.dtype() == DType::F32 {
        flat.apply_op2(&table.contiguous()?, Embedding)?
    } else {
        table.index_select(&flat, 0)?
    };
    Ok(rows.reshape(dims)?)
}

/// `(ids [n], table [rows, cols])` -> `[n, cols]`, F32.
struct Embedding;

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "amp_embedding"
    }

    fn cpu_fwd(
        &self,
        ids: &CpuStorage,
        li: &Layout,
        table: &CpuStorage,
        lt: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, cols) = lt.shape().dims2()?;
        let (a, b) = lt
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("embedding: non-contiguous table".into()))?;
        let CpuStorage::F32(t) = table else {
            candle_core::bail!("embedding: an F32 table, got {:?}", table.dtype())
        };
        let t = &t[a..b];
        let ids = u32s(ids, li)?;
        let mut out = Vec::with_capacity(ids.len() * cols);
        for &r in &ids {
            // `embedding` refused ids past the table; NaN rows as on CUDA
            // for a direct caller
            match t.get(r as usize * cols..(r as usize + 1) * cols) {
                Some(row) if (r as usize) < rows => out.extend_from_slice(row),
                _ => out.extend(std::iter::repeat_n(f32::NAN, cols)),
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((ids.len(), cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ids: &candle_core::CudaStorage,
        li: &Layout,
        table: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let cols = lt.shape().dims2()?.1;
        let out = super::cuda::embedding::embedding_fwd(ids, li, table, lt).map_err(wrap)?;
        Ok((out, Shape::from((li.shape().elem_count(), cols))))
    }

    fn bwd(
        &self,
        ids: &Tensor,
        table: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let rows = table.dims2()?.0;
        let grad = grad.contiguous()?;
        let lookup = LookupGrad {
            table,
            ids,
            grad: &grad,
        };
        if offer(&lookup).map_err(|e| candle_core::Error::Msg(e.to_string()))? {
            return Ok((None, None));
        }
        let dt = ids.apply_op2_no_bwd(&grad, &EmbeddingBwd { rows, scale: 1.0 })?;
        // outside candle's GradStore where a `collect_param_grads` runs
        let dt = crate::scaling::param_grads::hand_over(table, Some(dt))
            .map_err(candle_core::Error::wrap)?;
        Ok((None, dt))
    }
}

/// The gradient `[rows, cols]` of a table from lookups of `ids` (`[n]` U32)
/// whose rows got the gradient `grad` (`[n, cols]` F32): row `r` the sum,
/// in token order from +0, of `grad[i] * scale` over the tokens with
/// `ids[i] == r` (ids past the table add nothing). With `scale` 1 the bits
/// of the lookup's own backward; data parallelism passes every rank's ids
/// and rows in rank order with `1 / N` (see
/// [`with_embedding_backward`](crate::nn::with_embedding_backward)). Each
/// product is rounded before its sum (no fused multiply-add), on the CPU
/// and on CUDA alike.
///
/// # Errors
/// [`Error::DType`] for ids other than U32 or a gradient other than F32,
/// [`Error::Shape`] unless `grad` is `[n, cols]`, [`Error::Device`].
pub fn embedding_grad(ids: &Tensor, grad: &Tensor, rows: usize, scale: f32) -> Result<Tensor> {
    const OP: &str = "embedding_grad";
    for (t, want) in [(ids, DType::U32), (grad, DType::F32)] {
        if t.dtype() != want {
            return Err(Error::DType {
                op: OP,
                expected: if want == DType::U32 {
                    "U32 ids"
                } else {
                    "an F32 gradient"
                },
                got: t.dtype(),
            });
        }
    }
    let n = ids.elem_count();
    match grad.dims() {
        [m, _] if *m == n => {}
        _ => {
            return Err(Error::Shape {
                op: OP,
                lhs: ids.shape().clone(),
                rhs: grad.shape().clone(),
            })
        }
    }
    if !ids.device().same_device(grad.device()) {
        return Err(Error::Device {
            op: OP,
            lhs: ids.device().location(),
            rhs: grad.device().location(),
        });
    }
    let ids = ids.flatten_all()?.contiguous()?;
    Ok(ids.apply_op2_no_bwd(&grad.contiguous()?, &EmbeddingBwd { rows, scale })?)
}

/// `(ids [n], g [n, cols])` -> the table's gradient `[rows, cols]`, each
/// row of `g` times `scale`.
struct EmbeddingBwd {
    rows: usize,
    scale: f32,
}

impl CustomOp2 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "amp_embedding_bwd"
    }

    fn cpu_fwd(
        &self,
        ids: &CpuStorage,
        li: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let cols = lg.shape().dims2()?.1;
        let g = f32s(g, lg)?;
        let mut dt = vec![0f32; self.rows * cols];
        for (i, &r) in u32s(ids, li)?.iter().enumerate() {
            let r = r as usize;
            if r < self.rows {
                let src = &g[i * cols..(i + 1) * cols];
                for (d, s) in dt[r * cols..(r + 1) * cols].iter_mut().zip(src) {
                    *d += s * self.scale;
                }
            }
        }
        Ok((CpuStorage::F32(dt), Shape::from((self.rows, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ids: &candle_core::CudaStorage,
        li: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let cols = lg.shape().dims2()?.1;
        let dt = super::cuda::embedding::embedding_bwd(ids, li, g, lg, self.rows, self.scale)
            .map_err(wrap)?;
        Ok((dt, Shape::from((self.rows, cols))))
    }
}
