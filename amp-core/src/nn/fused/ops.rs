//! The fused ops as candle custom ops: the CPU bodies of `cpu.rs`, the
//! CUDA launches of `cuda/nn.rs`, and the backward passes that chain them.
//! Inputs arrive contiguous (the public functions in `mod.rs` see to it).

use super::cpu;
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
};
use half::{bf16, f16};

/// A contiguous float storage as f32 values.
pub(super) fn f32s(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: non-contiguous input".into()))?;
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::F64(v) => v[a..b].iter().map(|&x| x as f32).collect(),
        other => candle_core::bail!("fused op: a float input, got {:?}", other.dtype()),
    })
}

pub(super) fn u32s(s: &CpuStorage, l: &Layout) -> Result<Vec<u32>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("fused op: non-contiguous targets".into()))?;
    match s {
        CpuStorage::U32(v) => Ok(v[a..b].to_vec()),
        other => candle_core::bail!("fused op: U32 targets, got {:?}", other.dtype()),
    }
}

/// f32 values stored as `dtype`.
pub(super) fn store(v: Vec<f32>, dtype: DType) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        DType::F64 => CpuStorage::F64(v.into_iter().map(f64::from).collect()),
        _ => CpuStorage::F32(v),
    }
}

pub(super) fn last_dim(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(1).max(1)
}

#[cfg(feature = "cuda")]
pub(super) fn wrap(e: crate::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// Causal softmax of `scale * s` (forward only; `CausalSoftmaxBwd` is its
/// backward, chained by the attention op).
pub(super) struct CausalSoftmax {
    pub scale: f32,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "amp_causal_softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = cpu::causal_softmax_fwd(&f32s(s, l)?, last_dim(l), self.scale);
        Ok((store(v, s.dtype()), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::ops::causal_softmax(s, l, None, self.scale).map_err(wrap)?;
        Ok((out, l.shape().clone()))
    }
}

/// `scale * p * (dp - sum(p dp))` of `(p, dp)`.
pub(super) struct CausalSoftmaxBwd {
    pub scale: f32,
}

impl CustomOp2 for CausalSoftmaxBwd {
    fn name(&self) -> &'static str {
        "amp_causal_softmax_bwd"
    }

    fn cpu_fwd(
        &self,
        p: &CpuStorage,
        lp: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let v = cpu::causal_softmax_bwd(&f32s(p, lp)?, &f32s(g, lg)?, last_dim(lp), self.scale);
        Ok((store(v, p.dtype()), lp.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        lp: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out =
            super::cuda::ops::causal_softmax(p, lp, Some((g, lg)), self.scale).map_err(wrap)?;
        Ok((out, lp.shape().clone()))
    }
}

/// Cross-entropy of logits `[rows, cols]` and U32 targets `[rows]`: F32
/// `[rows, 2]` holding `lse - x[t]` and `lse` per row (the second column
/// is kept for the backward, which ignores its gradient).
pub(super) struct CrossEntropy;

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "amp_cross_entropy"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        t: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, cols) = (lx.shape().elem_count() / last_dim(lx), last_dim(lx));
        let v = cpu::cross_entropy_fwd(&f32s(x, lx)?, &u32s(t, lt)?, cols);
        Ok((CpuStorage::F32(v), Shape::from((rows, 2))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        t: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let rows = lx.shape().elem_count() / last_dim(lx);
        let out = super::cuda::ops::cross_entropy_fwd(x, lx, t, lt).map_err(wrap)?;
        Ok((out, Shape::from((rows, 2))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        t: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let gl = Tensor::cat(&[grad.narrow(1, 0, 1)?, res.narrow(1, 1, 1)?], 1)?;
        let dx = x.apply_op3_no_bwd(t, &gl, &CrossEntropyBwd)?;
        Ok((Some(dx), None))
    }
}

/// [`CrossEntropy`] on handed logits: a token in, the `[rows, 2]` pairs (`y`)
/// out; backward hands the logits' gradient back. The op holds the only
/// reference to the logits and lets them go in its backward, once their
/// gradient is made: candle keeps a graph's ops until the whole backward
/// is over, and the logits are the largest activation of a language
/// model (`[tokens, vocabulary]`: 4.2 GB at Llama-3.2-1B's vocabulary and
/// 8 x 2048 tokens), alive beside their gradient and its FP8 casts
/// otherwise.
pub(super) struct CrossEntropyHanded {
    pub y: crate::nn::precomputed::Precomputed,
    pub logits: std::sync::Mutex<Option<Tensor>>,
    pub targets: Tensor,
    pub from: super::Handoff,
}

impl CustomOp1 for CrossEntropyHanded {
    fn name(&self) -> &'static str {
        "amp_cross_entropy_handed"
    }

    crate::nn::precomputed::precomputed_fwd!(1);

    fn bwd(&self, token: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let gl = Tensor::cat(&[grad.narrow(1, 0, 1)?, res.narrow(1, 1, 1)?], 1)?;
        let logits = match self.logits.lock() {
            Ok(mut held) => held.take(),
            Err(_) => None,
        };
        let Some(logits) = logits else {
            candle_core::bail!(
                "amp_cross_entropy_handed: a second backward through the same loss \
                 (its logits went with the first)"
            );
        };
        let dx = logits.apply_op3_no_bwd(&self.targets, &gl, &CrossEntropyBwd)?;
        drop(logits);
        self.from.put(dx).map_err(wrap_any)?;
        Ok(Some(super::Handoff::token_grad(token).map_err(wrap_any)?))
    }
}

fn wrap_any(e: crate::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// `g * (softmax(x) - onehot(t))` of `(x, t, [g, lse] per row)`.
pub(super) struct CrossEntropyBwd;

impl CustomOp3 for CrossEntropyBwd {
    fn name(&self) -> &'static str {
        "amp_cross_entropy_bwd"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        t: &CpuStorage,
        lt: &Layout,
        gl: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let cols = last_dim(lx);
        let v = cpu::cross_entropy_bwd(&f32s(x, lx)?, &u32s(t, lt)?, &f32s(gl, lg)?, cols);
        Ok((store(v, x.dtype()), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        t: &candle_core::CudaStorage,
        lt: &Layout,
        gl: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::ops::cross_entropy_bwd(x, lx, t, lt, gl, lg).map_err(wrap)?;
        Ok((out, lx.shape().clone()))
    }
}

/// LayerNorm of `(x, w, b)` over the last dimension (F32 `w`, `b`), or with
/// `dx` its input gradient of `(x, w, dy)`, with `res` (x's shape and dtype)
/// added to that gradient as candle's add would: the gradient rounded to
/// x's dtype, then the sum of the two rounded once. The backward of the
/// forward op adds `res` to its input gradient the same way.
pub(super) struct LayerNormOp {
    pub eps: f32,
    /// RMSNorm: the mean taken as 0 (the bias is then zero, its gradient
    /// unused).
    pub rms: bool,
    pub dx: bool,
    pub res: Option<Tensor>,
    /// With `dx`, where the input gradient's kernel leaves the rows'
    /// statistics for the weight gradient's op of the same backward.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub stats: RowStats,
}

/// The rows' (mean, rstd) that a LayerNorm's input-gradient kernel writes
/// on CUDA and the weight-gradient op of the same backward takes, so that
/// op does not read x once more for them (it computes them itself where
/// the cell is empty: the CPU, or an input gradient not taken).
#[derive(Clone, Default)]
pub(super) struct RowStats(
    #[cfg(feature = "cuda")]
    std::sync::Arc<
        std::sync::Mutex<Option<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>>>,
    >,
);

#[cfg(feature = "cuda")]
impl RowStats {
    fn put(&self, s: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>) {
        if let Ok(mut g) = self.0.lock() {
            *g = Some(s);
        }
    }

    fn take(&self) -> Option<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>> {
        self.0.lock().ok().and_then(|mut g| g.take())
    }
}

/// `v` rounded to `dtype`'s precision (F32 and wider: itself).
fn rounded(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        if self.dx {
            "amp_layer_norm_dx"
        } else {
            "amp_layer_norm"
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        third: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x32, w32, t32) = (f32s(x, lx)?, f32s(w, lw)?, f32s(third, l3)?);
        let mut v = if self.dx {
            cpu::layer_norm_dx(&x32, &w32, &t32, self.eps, self.rms)
        } else {
            cpu::layer_norm_fwd(&x32, &w32, &t32, self.eps, self.rms)
        };
        if let (true, Some(res)) = (self.dx, &self.res) {
            let (rs, rl) = res.storage_and_layout();
            let candle_core::Storage::Cpu(rs) = &*rs else {
                candle_core::bail!("amp_layer_norm_dx: the residual gradient is not on the CPU")
            };
            let r = f32s(rs, rl)?;
            if r.len() != v.len() {
                candle_core::bail!("amp_layer_norm_dx: a residual gradient of another size");
            }
            for (v, r) in v.iter_mut().zip(r) {
                *v = rounded(*v, x.dtype()) + r;
            }
        }
        Ok((store(v, x.dtype()), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        third: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let res = match (self.dx, &self.res) {
            (true, Some(r)) => Some(r.storage_and_layout()),
            _ => None,
        };
        let res = match &res {
            Some((s, l)) => match &**s {
                candle_core::Storage::Cuda(s) => Some((s, *l)),
                _ => candle_core::bail!("amp_layer_norm_dx: the residual gradient is not on CUDA"),
            },
            None => None,
        };
        let mut stats = match self.dx {
            true => {
                let rows = lx.shape().elem_count() / last_dim(lx).max(1);
                Some(super::cuda::ops::row_stats_buffer(x.device(), rows).map_err(wrap)?)
            }
            false => None,
        };
        let out = super::cuda::ops::layer_norm(
            (x, lx),
            (w, lw),
            (third, l3),
            self.eps,
            self.dx,
            self.rms,
            res,
            stats.as_mut(),
        )
        .map_err(wrap)?;
        if let Some(s) = stats {
            self.stats.put(s);
        }
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let stats = RowStats::default();
        let op = LayerNormOp {
            eps: self.eps,
            rms: self.rms,
            dx: true,
            res: self.res.as_ref().map(Tensor::contiguous).transpose()?,
            stats: stats.clone(),
        };
        let dx = x.apply_op3_no_bwd(w, &dy, &op)?;
        let dwdb = x.apply_op2_no_bwd(
            &dy,
            &LayerNormDwDb {
                eps: self.eps,
                rms: self.rms,
                stats,
            },
        )?;
        // the parameters' gradients outside candle's GradStore where a
        // `collect_param_grads` runs
        let hand = |p: &Tensor, g| {
            crate::scaling::param_grads::hand_over(p, Some(g)).map_err(candle_core::Error::wrap)
        };
        Ok((Some(dx), hand(w, dwdb.get(0)?)?, hand(_b, dwdb.get(1)?)?))
    }
}

/// LayerNorm (or RMSNorm) of `(x, w, b)` and `max |y|` of its stored
/// outputs: `[y, amax]`, the amax bit for bit the `amax` kernel's of `y`.
pub(super) struct LayerNormAmax {
    pub eps: f32,
    pub rms: bool,
}

impl crate::numerics::kernel::Kernel for LayerNormAmax {
    const NAME: &'static str = "layer_norm_amax";

    fn cpu(
        &self,
        inputs: &[(&CpuStorage, &Layout)],
    ) -> crate::error::Result<Vec<(CpuStorage, Shape)>> {
        let [(x, lx), (w, lw), (b, lb)] = inputs else {
            return Err(crate::numerics::kernel::arity(Self::NAME));
        };
        let v = cpu::layer_norm_fwd(
            &f32s(x, lx)?,
            &f32s(w, lw)?,
            &f32s(b, lb)?,
            self.eps,
            self.rms,
        );
        let y = store(v, x.dtype());
        // the amax of what is stored (rounded to x's dtype), as `amax` reads it
        let stored = f32s(&y, &Layout::contiguous(lx.shape().clone()))?;
        let amax = crate::numerics::cast::amax_of(&stored);
        Ok(vec![
            (y, lx.shape().clone()),
            (CpuStorage::F32(vec![amax]), Shape::from(1usize)),
        ])
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> crate::error::Result<Vec<(candle_core::CudaStorage, Shape)>> {
        let [(x, lx), (w, lw), (b, lb)] = inputs else {
            return Err(crate::numerics::kernel::arity(Self::NAME));
        };
        let (y, amax) =
            super::cuda::ops::layer_norm_amax((x, lx), (w, lw), (b, lb), self.eps, self.rms)?;
        Ok(vec![(y, lx.shape().clone()), (amax, Shape::from(1usize))])
    }
}

/// LayerNorm's weight and bias gradients of `(x, dy)`: F32 `[2, cols]`.
struct LayerNormDwDb {
    eps: f32,
    rms: bool,
    /// The rows' statistics where the input gradient's op left them.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    stats: RowStats,
}

impl CustomOp2 for LayerNormDwDb {
    fn name(&self) -> &'static str {
        "amp_layer_norm_dwdb"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let cols = last_dim(lx);
        let v = cpu::layer_norm_dwdb(&f32s(x, lx)?, &f32s(g, lg)?, cols, self.eps, self.rms);
        Ok((CpuStorage::F32(v), Shape::from((2, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out =
            super::cuda::ops::layer_norm_dwdb(x, lx, g, lg, self.eps, self.rms, self.stats.take())
                .map_err(wrap)?;
        Ok((out, Shape::from((2, last_dim(lx)))))
    }
}
