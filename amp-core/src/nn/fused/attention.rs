//! Causal self-attention as one autograd op: `softmax(q kᵀ / sqrt(d) +
//! mask) v` with the scale and the mask inside the softmax kernel, so the
//! graph keeps one matrix per layer (the probabilities) instead of the
//! scores, the masked scores and the probabilities, and backprop spends
//! no zero-fill and add on each of them.

use super::ops::{CausalSoftmax, CausalSoftmaxBwd};
use crate::error::{Error, Result};
use crate::nn::precomputed::Precomputed;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

/// Causal attention of `q`, `k`, `v` (`[batch, heads, seq, head_dim]`,
/// one float dtype, one device): `softmax(q kᵀ / sqrt(head_dim) + mask) v`,
/// where query `i` sees keys `0..=i`. The products run in BF16 on CUDA (as
/// PyTorch autocast) and in the inputs' dtype on the CPU, the softmax sums
/// in F32; the output and the gradients have the inputs' dtype.
///
/// # Errors
/// [`Error::Rank`], [`Error::Shape`], [`Error::DType`] or [`Error::Device`]
/// for inputs that do not fit; candle's.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    const OP: &str = "causal_attention";
    let (_, _, _, d) = q.dims4().map_err(|_| Error::Rank {
        op: OP,
        expected: 4,
        got: q.shape().clone(),
    })?;
    for t in [k, v] {
        if t.shape() != q.shape() {
            return Err(Error::Shape {
                op: OP,
                lhs: q.shape().clone(),
                rhs: t.shape().clone(),
            });
        }
        if t.dtype() != q.dtype() {
            return Err(Error::DType {
                op: OP,
                expected: "q, k and v of one dtype",
                got: t.dtype(),
            });
        }
        if !t.device().same_device(q.device()) {
            return Err(Error::Device {
                op: OP,
                lhs: q.device().location(),
                rhs: t.device().location(),
            });
        }
    }
    if !matches!(q.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(Error::DType {
            op: OP,
            expected: "F32, BF16 or F16",
            got: q.dtype(),
        });
    }
    let compute = if q.device().is_cuda() {
        DType::BF16
    } else {
        q.dtype()
    };
    let scale = 1.0 / (d.max(1) as f32).sqrt();
    let cast = |t: &Tensor| -> Result<Tensor> { Ok(t.detach().to_dtype(compute)?.contiguous()?) };
    let (qc, kc, vc) = (cast(q)?, cast(k)?, cast(v)?);
    let p = qc
        .matmul(&kc.t()?)?
        .apply_op1_no_bwd(&CausalSoftmax { scale })?;
    let y = p.matmul(&vc)?.to_dtype(q.dtype())?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(y);
    }
    let op = CausalAttention {
        y: Precomputed::new(OP, y),
        p,
        scale,
        compute,
    };
    Ok(q.apply_op3(k, v, op)?)
}

/// The autograd node: the forward's output, the probabilities for backward.
struct CausalAttention {
    y: Precomputed,
    p: Tensor,
    scale: f32,
    compute: DType,
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "amp_causal_attention"
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
        self.y.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        self.y.cuda()
    }

    /// `dP = dy vᵀ`, `dS = P (dP - rowsum(P dP)) / sqrt(d)`, `dq = dS k`,
    /// `dk = dSᵀ q`, `dv = Pᵀ dy`.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let cast = |t: &Tensor| t.detach().to_dtype(self.compute)?.contiguous();
        let (qc, kc, vc, dy) = (cast(q)?, cast(k)?, cast(v)?, cast(dy)?);
        let dp = dy.matmul(&vc.t()?)?;
        let ds = self
            .p
            .apply_op2_no_bwd(&dp, &CausalSoftmaxBwd { scale: self.scale })?;
        drop(dp);
        let back = |t: Tensor| t.to_dtype(q.dtype());
        let dq = back(ds.matmul(&kc)?)?;
        let dk = back(ds.t()?.matmul(&qc)?)?;
        let dv = back(self.p.t()?.matmul(&dy)?)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
