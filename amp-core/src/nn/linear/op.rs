//! The FP8 Linear as a candle op with its own backward: fprop, dgrad and
//! wgrad in FP8 (or natively where overridden), the input saved as FP8,
//! the weight gradient handed to a sink or to candle's `GradStore`.

use crate::error::{Error, Result};
use crate::gemm::fp8_gemm;
use crate::nn::fused::BiasAdd;
use crate::nn::precomputed::Precomputed;
use crate::numerics::format::Fp8Format;
use crate::numerics::recipe::CurrentScaling;
use crate::scaling::flag::flagged_by_amax;
use crate::scaling::sink::GradSink;
use crate::scaling::tensor::ScalingTensor;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Storage};
use candle_core::{CustomOp3, DType, Tensor};

pub(crate) use super::layer_scaling::{cast, LastCasts, Role, Scaling, SharedScaling, Source};
use super::layer_scaling::{record, WEIGHT_GRAD_RECORD};
use super::saved::block_alone;
pub(crate) use super::saved::{KeptInput, Origin, Saved};

/// Which GEMMs run in FP8, with which formats and scaling.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub dgrad: bool,
    pub wgrad: bool,
    pub bwd_format: Fp8Format,
    pub scaling: Scaling,
    /// Block or rowwise scaling: the GEMMs of `linear/block.rs` on
    /// [`Saved::Block`] operands (the flags above unused).
    pub block: Option<crate::numerics::recipe::TileRecipe>,
}

/// The autograd node. Its forward returns the output computed before the op
/// was applied (candle's custom ops compute on storages; ours on tensors).
pub(crate) struct Fp8LinearOp {
    /// The output; with `epilogue`, the product before bias and residual.
    pub y: Precomputed,
    /// The forward adds bias (and the residual, with `residual`) to `y`
    /// into the storage it returns (see [`Fp8LinearOp::epilogue`]).
    pub epilogue: bool,
    /// The output's shape (`x`'s with the last dimension `out`).
    pub out_shape: candle_core::Shape,
    /// Whether the third argument is a bias (else a placeholder).
    pub has_bias: bool,
    /// The op's input is an activation's: the GEMMs take `act(x)`, and
    /// dgrad goes back through the activation's backward.
    pub activation: Option<crate::nn::Activation>,
    /// The activation's input (2-D) where the first argument is a token.
    pub act_z: Option<KeptInput>,
    /// The second argument is a residual added to the output (its gradient
    /// is the output's); the weight's gradient goes to the sink.
    pub residual: bool,
    /// A handed residual's value: the second argument is its token, and
    /// the forward's epilogue adds this instead.
    pub residual_value: Option<Tensor>,
    /// Where the residual's gradient goes instead of candle's graph (a
    /// LayerNorm handoff reading the same tensor adds it).
    pub residual_grad: Option<crate::nn::fused::ResidualGrad>,
    /// The first argument is a token for the input (see
    /// `fused::Handoff`): the input's gradient is left there.
    pub handoff: Option<crate::nn::fused::Handoff>,
    /// The output is handed on: the forward returns a token, the backward
    /// takes the output's gradient from here.
    pub hand_out: Option<crate::nn::fused::Handoff>,
    /// The input's shape (the first argument's, unless a token).
    pub x_shape: candle_core::Shape,
    pub x_saved: Saved,
    pub w_saved: Saved,
    pub plan: Plan,
    pub state: SharedScaling,
    pub casts: LastCasts,
    pub step: u64,
    pub sink: Option<GradSink>,
    pub name: String,
    pub x_dtype: DType,
    pub w_dtype: DType,
}

fn wrap(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

impl Fp8LinearOp {
    /// dgrad (when `need_dx`) and wgrad; the weight gradient goes to the sink
    /// (returned `None`) or back to candle.
    /// dx and dW from dy; `dy_amax`, where a pass that read dy already took
    /// its amax (the bias gradient's), spares a current-scaling cast its own.
    fn backward(
        &self,
        dy: &Tensor,
        need_dx: bool,
        dy_amax: Option<&Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let p = &self.plan;
        if let Some(r) = &p.block {
            let xt = self.x_saved.block_operand(r, self.x_dtype)?;
            let wt = self.w_saved.block_operand(r, self.x_dtype)?;
            let (dx, dw) =
                super::block::backward(&dy, (&xt, &wt), r, need_dx, self.x_dtype, &self.casts)?;
            return self.weight_grad(dx, dw);
        }
        let (dyq, dyq_t) = if p.dgrad || p.wgrad {
            let source = match dy_amax {
                Some(a) => Source::Measured(&dy, a),
                None => Source::Tensor(&dy),
            };
            let (q, qt) = cast(
                source,
                p.bwd_format,
                &p.scaling,
                &self.state,
                Role::GradOutput,
                self.step,
                &self.casts,
                p.wgrad && self.x_saved.is_fp8_t(),
            )?;
            (Some(q), qt)
        } else {
            (None, None)
        };
        // A saturating cast turns inf into max: carry a non-finite dy amax
        // into the results (x 1 if finite, NaN otherwise), so an overflowing
        // step is still seen, and skipped, downstream.
        // (the flag as a tensor only where a native product needs it, once)
        let flag = std::cell::OnceCell::new();
        let finite = |t: Tensor| -> Result<Tensor> {
            let Some(q) = &dyq else {
                return Ok(t);
            };
            if flag.get().is_none() {
                let _ = flag.set(q.meta().amax()?.affine(0.0, 1.0)?);
            }
            match flag.get() {
                Some(f) => Ok(t.broadcast_mul(&f.to_dtype(t.dtype())?)?),
                None => Ok(t),
            }
        };
        // The FP8 GEMMs take the flag in dy's scale_inv (no pass over their
        // outputs); the native products multiply by it.
        let (dqf, dqf_t) = match &dyq {
            Some(q) => {
                let dq = flagged_by_amax(q)?;
                // the transpose shares the flagged metadata
                let dqt = dyq_t
                    .as_ref()
                    .map(|t| ScalingTensor::from_parts(t.data().clone(), dq.meta().clone()))
                    .transpose()?;
                (Some(dq), dqt)
            }
            _ => (None, None),
        };
        let native = |q: &ScalingTensor| q.dequantize(dy.dtype());
        // dgrad: dx = dy · W, i.e. fp8_gemm(dy [m, out], Wᵀ [in, out]).
        let dx = if need_dx {
            let w_saved = self.w_saved.resolved()?;
            Some(match (&dqf, &*w_saved) {
                (Some(dq), Saved::Fp8T(wt)) if p.dgrad => fp8_gemm(dq, wt, self.x_dtype)?,
                (Some(dq), Saved::Fp8(wq)) if p.dgrad => fp8_gemm(dq, &wq.t()?, self.x_dtype)?,
                (_, Saved::Native(w)) => finite(dy.matmul(&w.to_dtype(dy.dtype())?)?)?,
                (_, Saved::Fp8(wq)) => finite(dy.matmul(&native(wq)?)?)?,
                (_, Saved::Fp8T(wt)) => finite(dy.matmul(&native(wt)?.t()?)?)?,
                (_, Saved::Recast { .. }) => return Err(recast_left()),
                (_, Saved::Block(_) | Saved::BlockFrom { .. }) => return Err(block_alone()),
            })
        } else {
            None
        };
        // wgrad: dW = dyᵀ · x, i.e. fp8_gemm(dyᵀ [out, m], xᵀ [in, m]).
        let x_saved = self.x_saved.resolved()?;
        let dw = match (&dqf, &*x_saved) {
            (Some(dq), Saved::Fp8T(xt)) if p.wgrad => match &dqf_t {
                Some(dqt) => fp8_gemm(dqt, xt, DType::F32)?,
                None => fp8_gemm(&dq.t()?, xt, DType::F32)?,
            },
            (Some(dq), Saved::Fp8(xq)) if p.wgrad => fp8_gemm(&dq.t()?, &xq.t()?, DType::F32)?,
            (_, Saved::Native(x)) => finite(
                dy.t()?
                    .matmul(&x.to_dtype(dy.dtype())?)?
                    .to_dtype(DType::F32)?,
            )?,
            (_, Saved::Fp8(xq)) => finite(dy.t()?.matmul(&native(xq)?)?.to_dtype(DType::F32)?)?,
            (_, Saved::Fp8T(xt)) => {
                finite(dy.t()?.matmul(&native(xt)?.t()?)?.to_dtype(DType::F32)?)?
            }
            (_, Saved::Recast { .. }) => return Err(recast_left()),
            (_, Saved::Block(_) | Saved::BlockFrom { .. }) => return Err(block_alone()),
        };
        drop(x_saved);
        self.weight_grad(dx, dw)
    }

    /// The weight gradient (F32) to the sink, or back to candle in the
    /// weight's dtype; `dx` passed through.
    fn weight_grad(
        &self,
        dx: Option<Tensor>,
        dw: Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        match &self.sink {
            Some(sink) => {
                let g = fp8_grad(&dw)?;
                record(&self.casts, WEIGHT_GRAD_RECORD, &g, || Ok(dw.clone()))?;
                sink.add(&self.name, g)?;
                Ok((dx, None))
            }
            None => Ok((dx, Some(dw.to_dtype(self.w_dtype)?))),
        }
    }
}

/// [`Saved::resolved`] never leaves a recast operand.
fn recast_left() -> Error {
    Error::Unsupported {
        op: "amp_fp8_linear backward",
        what: "an operand left to recast".into(),
    }
}

impl Fp8LinearOp {
    /// The epilogue's last part: `r + out` (the residual, the op's second
    /// argument, as the left operand: `r + y` as the unfused path adds it)
    /// with `residual`, `out` otherwise; shaped as the output.
    fn add_residual<S: BackendStorage>(
        &self,
        out: S,
        r: &S,
        lr: &Layout,
    ) -> candle_core::Result<(S, candle_core::Shape)> {
        let shape = self.out_shape.clone();
        if !self.residual {
            return Ok((out, shape));
        }
        let lo = Layout::contiguous(shape.clone());
        Ok((r.binary_impl::<candle_core::op::Add>(&out, lr, &lo)?, shape))
    }
}

/// A weight gradient as the sink keeps it: E4M3 with a power-of-two scale;
/// its metadata keeps the F32 gradient's amax, so inf or NaN stay visible.
pub(crate) fn fp8_grad(dw: &Tensor) -> Result<ScalingTensor> {
    Ok(ScalingTensor::quantize(dw, crate::QType::E4M3, &CurrentScaling::default())?.0)
}

impl CustomOp3 for Fp8LinearOp {
    fn name(&self) -> &'static str {
        "amp_fp8_linear"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        r: &CpuStorage,
        lr: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, candle_core::Shape)> {
        if self.hand_out.is_some() {
            drop(self.y.take()?);
            return Ok(crate::nn::fused::Handoff::cpu_token());
        }
        if !self.epilogue {
            return self.y.cpu();
        }
        let y = self.y.take()?;
        let (ys, ly) = y.storage_and_layout();
        let Storage::Cpu(ys) = &*ys else {
            candle_core::bail!("amp_fp8_linear: the output is not on the CPU")
        };
        let (out, _) = BiasAdd.cpu_fwd(ys, ly, b, lb)?;
        let Some(rv) = &self.residual_value else {
            return self.add_residual(out, r, lr);
        };
        let (rs, rl) = rv.storage_and_layout();
        let Storage::Cpu(rs) = &*rs else {
            candle_core::bail!("amp_fp8_linear: the residual is not on the CPU")
        };
        self.add_residual(out, rs, rl)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        r: &candle_core::CudaStorage,
        lr: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        if self.hand_out.is_some() {
            drop(self.y.take()?);
            return crate::nn::fused::Handoff::cuda_token(r.device());
        }
        if !self.epilogue {
            return self.y.cuda();
        }
        let y = self.y.take()?;
        let (ys, ly) = y.storage_and_layout();
        let Storage::Cuda(ys) = &*ys else {
            candle_core::bail!("amp_fp8_linear: the output is not on CUDA")
        };
        let (out, _) = BiasAdd.cuda_fwd(ys, ly, b, lb)?;
        let Some(rv) = &self.residual_value else {
            return self.add_residual(out, r, lr);
        };
        let (rs, rl) = rv.storage_and_layout();
        let Storage::Cuda(rs) = &*rs else {
            candle_core::bail!("amp_fp8_linear: the residual is not on CUDA")
        };
        self.add_residual(out, rs, rl)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // a handed-on output's gradient comes through the handoff
        let handed;
        // the column sums and amax of a handed gradient, where the
        // consumer's backward took them in its pass (see `want_col_stats`)
        let mut stats = None;
        let dy = match &self.hand_out {
            Some(h) => {
                handed = h.take().map_err(wrap)?;
                stats = h.take_col_stats().map_err(wrap)?;
                &handed
            }
            None => dy,
        };
        // the op flattens its input: dy to 2-D, dx back to x's shape
        let out_dim = dy.dim(candle_core::D::Minus1)?;
        let dy2 = dy.reshape(((), out_dim))?;
        // the bias gradient's pass over dy also takes the amax that dy's
        // current-scaling cast needs (`set_producer_amax`)
        let p = &self.plan;
        let fused_bias = self.has_bias
            && b.track_op()
            && super::switches::producer_amax()
            && p.block.is_none()
            && (p.dgrad || p.wgrad)
            && matches!(p.scaling, Scaling::Current(_));
        let (db_sum, dy_amax) = match (fused_bias, stats) {
            (true, Some((sum, amax))) if sum.elem_count() == out_dim => (Some(sum), Some(amax)),
            (true, _) => {
                let (sum, amax) = crate::nn::fused::col_sum_amax(&dy2).map_err(wrap)?;
                (Some(sum), Some(amax))
            }
            (false, _) => (None, None),
        };
        let (dx, dw) = self
            .backward(&dy2, x.track_op(), dy_amax.as_ref())
            .map_err(wrap)?;
        let dx = match dx {
            Some(d) => match self.activation {
                Some(act) => {
                    let z = match &self.act_z {
                        Some(z) => z.value().map_err(wrap)?,
                        None => x.reshape(((), x.dim(candle_core::D::Minus1)?))?,
                    };
                    // where the op that made z asked for them, the column
                    // sums and amax of z's gradient from the same pass
                    let stats_to = self.handoff.as_ref().filter(|h| h.wants_col_stats());
                    let both = match stats_to {
                        Some(_) => act.backward_with_col_sums(&z, &d).map_err(wrap)?,
                        None => None,
                    };
                    match (both, stats_to) {
                        (Some((dz, sums, amax)), Some(h)) => {
                            h.put_col_stats(sums, amax).map_err(wrap)?;
                            Some(dz)
                        }
                        _ => Some(act.backward_detached(&z, &d).map_err(wrap)?),
                    }
                }
                None => Some(d),
            },
            None => None,
        };
        let dx = match (&self.handoff, dx) {
            (Some(h), Some(d)) => {
                h.put(d.reshape(self.x_shape.clone())?).map_err(wrap)?;
                Some(crate::nn::fused::Handoff::token_grad(x).map_err(wrap)?)
            }
            (_, d) => d.map(|d| d.reshape(x.shape())).transpose()?,
        };
        // A weight gradient only goes to the GradStore for a tracked weight;
        // a residual in the weight's place gets the output's gradient.
        let dw = match (self.residual, w.track_op(), &self.residual_grad) {
            (true, true, Some(rg)) => {
                rg.put(dy.clone()).map_err(wrap)?;
                None
            }
            (true, true, None) => Some(dy.clone()),
            (false, true, _) => dw,
            (_, false, _) => None,
        };
        let db = if self.has_bias && b.track_op() {
            let sum = match db_sum {
                Some(s) => s,
                None => crate::nn::fused::col_sum(&dy2).map_err(wrap)?,
            };
            Some(sum.to_dtype(b.dtype())?.reshape(b.shape())?)
        } else {
            None
        };
        // a Var's gradient outside candle's GradStore where a
        // `collect_param_grads` runs (no zero fill and add for it)
        let hand = |p: &Tensor, g| crate::scaling::param_grads::hand_over(p, g).map_err(wrap);
        let dw = match self.residual {
            true => dw,
            false => hand(w, dw)?,
        };
        Ok((dx, dw, hand(b, db)?))
    }
}
