//! The attention's layouts: a fused projection's rows `[batch, seq, 3 *
//! heads * head_dim]` and the heads `[batch, heads, seq, head_dim]` its
//! products take. On CUDA one kernel per part (`rows_to_heads`,
//! `heads_to_rows` in `kernels/nn.cu`) moves and converts to or from BF16
//! in the same pass; elsewhere candle's reshape, transpose and copy.

use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Shape, Tensor};

/// The layout of a fused projection.
#[derive(Clone, Copy)]
pub(super) struct Qkv {
    pub b: usize,
    pub t: usize,
    pub heads: usize,
    pub hd: usize,
}

impl Qkv {
    /// Rows `[b, t, 3 * heads * hd]` (any float dtype) to contiguous q, k,
    /// v `[b, heads, t, hd]` of the compute dtype: one kernel each on CUDA
    /// (the BF16 conversion in the same pass), candle's ops elsewhere.
    pub(super) fn split(&self, x: &Tensor, compute: DType) -> candle_core::Result<[Tensor; 3]> {
        let x = x.detach();
        if kernels(&x, compute) {
            let x = x.contiguous()?;
            let part = |which| {
                x.apply_op1_no_bwd(&Layouts {
                    qkv: *self,
                    s: 3,
                    which,
                })
            };
            return Ok([part(0)?, part(1)?, part(2)?]);
        }
        let x = x
            .to_dtype(compute)?
            .reshape((self.b, self.t, 3, self.heads, self.hd))?;
        let part = |i: usize| x.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2)?.contiguous();
        Ok([part(0)?, part(1)?, part(2)?])
    }

    /// Rows `[b, t, heads * hd]` to heads of the compute dtype.
    pub(super) fn heads(&self, x: &Tensor, compute: DType) -> candle_core::Result<Tensor> {
        if kernels(x, compute) {
            return x.contiguous()?.apply_op1_no_bwd(&Layouts {
                qkv: *self,
                s: 1,
                which: 0,
            });
        }
        x.to_dtype(compute)?
            .reshape((self.b, self.t, self.heads, self.hd))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// Heads `[b, heads, t, hd]` (one, or q, k, v) to rows of `dtype`.
    pub(super) fn rows(&self, parts: &[Tensor], dtype: DType) -> candle_core::Result<Tensor> {
        let cuda = parts
            .iter()
            .all(|p| p.device().is_cuda() && p.dtype() == DType::BF16);
        let rows = Rows { qkv: *self, dtype };
        match parts {
            [y] if cuda => y.contiguous()?.apply_op1_no_bwd(&rows),
            [q, k, v] if cuda => {
                q.contiguous()?
                    .apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &rows)
            }
            _ => {
                let t: Vec<Tensor> = parts
                    .iter()
                    .map(|p| p.transpose(1, 2))
                    .collect::<candle_core::Result<_>>()?;
                Tensor::stack(&t, 2)?
                    .reshape((self.b, self.t, parts.len() * self.heads * self.hd))?
                    .to_dtype(dtype)
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self, s: usize) -> super::cuda::layout::Heads {
        super::cuda::layout::Heads {
            b: self.b,
            t: self.t,
            s,
            h: self.heads,
            d: self.hd,
        }
    }
}

/// Whether the layout kernels take `x` (CUDA, F32 or BF16 rows, BF16 heads).
fn kernels(x: &Tensor, compute: DType) -> bool {
    x.device().is_cuda() && compute == DType::BF16 && matches!(x.dtype(), DType::F32 | DType::BF16)
}

/// Part `which` of `s` side by side, rows to BF16 heads (CUDA).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Layouts {
    qkv: Qkv,
    s: usize,
    which: usize,
}

impl CustomOp1 for Layouts {
    fn name(&self) -> &'static str {
        "amp_rows_to_heads"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp_rows_to_heads: CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let q = self.qkv;
        let out = super::cuda::layout::rows_to_heads(x, l, q.cuda(self.s), self.which)
            .map_err(candle_core::Error::wrap)?;
        Ok((out, Shape::from((q.b, q.heads, q.t, q.hd))))
    }
}

/// BF16 heads (one or three) to rows of `dtype` (CUDA).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Rows {
    qkv: Qkv,
    dtype: DType,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Rows {
    fn shape(&self, s: usize) -> Shape {
        Shape::from((self.qkv.b, self.qkv.t, s * self.qkv.heads * self.qkv.hd))
    }
}

impl CustomOp1 for Rows {
    fn name(&self) -> &'static str {
        "amp_heads_to_rows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp_heads_to_rows: CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::layout::heads_to_rows(&[(y, l)], self.qkv.cuda(1), self.dtype)
            .map_err(candle_core::Error::wrap)?;
        Ok((out, self.shape(1)))
    }
}

impl CustomOp3 for Rows {
    fn name(&self) -> &'static str {
        "amp_heads_to_rows"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp_heads_to_rows: CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let parts = [(q, lq), (k, lk), (v, lv)];
        let out = super::cuda::layout::heads_to_rows(&parts, self.qkv.cuda(3), self.dtype)
            .map_err(candle_core::Error::wrap)?;
        Ok((out, self.shape(3)))
    }
}
