//! The output head and its mean cross-entropy over chunks of rows, where
//! the logits would be large (`linear_cross_entropy` at the per-tensor
//! FP8 levels): for each chunk the forward makes the chunk's logits,
//! their loss and their gradient, and at once both of the head's
//! gradients (the input's, and the weight's summed in F32 over the
//! chunks, in the GEMM's accumulator), then lets the chunk go. The
//! logits `[tokens, vocabulary]`, their gradient and its two FP8 casts
//! (the largest tensors of a language model's step: 0.8 GB of BF16
//! logits at a GPT's vocabulary and 8 x 1024 tokens, 4.2 GB at Llama-3's
//! and 8 x 2048) never exist whole; a chunk holds about
//! [`loss_chunk_rows`] rows of them. The backward only scales the two
//! gradients by the loss's incoming gradient. The same GEMMs and kernels
//! as the op-by-op path (no product is computed twice; Liger-Kernel's
//! fused linear cross-entropy does the same for PyTorch).
//!
//! Numerics: the gradient of each row's loss is `g * (softmax - onehot)`
//! with `g` the mean's gradient, the same for every row; the forward
//! computes `softmax - onehot` (`g` unknown yet) and the backward
//! multiplies the input's gradient by `g` (in F32) and casts the FP8
//! weight gradient again times `g` (`ScalingTensor::times`: the same codes for a
//! power-of-two `g`, as with a power-of-two row count and an incoming
//! gradient of 1; a second rounding otherwise). The logits' gradient is cast with the scale of its bound
//! (`bound_scale`: no amax pass, one cast for both layouts) and the
//! weight gradient is summed over the chunks in F32 before its one cast.
//! Under current scaling, with one chunk, a power-of-two row count (`g` a
//! power of two) and a logit gradient whose amax is above 7/8 (as good as
//! always) the values are those of the op-by-op path bit for bit.

use super::layer_scaling::{noted, record, LastCasts, Role, Source, WEIGHT_GRAD_RECORD};
use super::op::fp8_grad;
use super::operands::Passes;
use super::switches::loss_chunk_rows;
use super::Linear;
use crate::error::{Error, Result};
use crate::gemm::{fp8_gemm, fp8_gemm_acc, fp8_gemm_with};
use crate::nn::fused::{self, Handoff};
use crate::nn::mode::{current_step, in_inference};
use crate::nn::norm::LayerNorm;
use crate::nn::precomputed::{precomputed_fwd, Precomputed};
use crate::numerics::format::Fp8Format;
use crate::scaling::flag::flagged_by_amax;
use crate::scaling::meta::ScalingMeta;
use crate::scaling::sink::GradSink;
use crate::scaling::telemetry::telemetry_enabled;
use crate::scaling::tensor::ScalingTensor;
use crate::scaling::weight::Weight;
use candle_core::{CustomOp2, DType, Shape, Tensor, Var};
use std::sync::Mutex;

/// The scale of the logits' gradient's FP8 cast: every element of
/// `softmax - onehot` lies in [-1, 1], so the largest power of two that
/// keeps 1 below `format`'s largest value (2^8 for E4M3, 2^15 for E5M2) never
/// saturates, and takes no pass for an amax (it is the current-scaling
/// scale wherever the amax is above 7/8 of the bound, as in almost every
/// chunk: one row whose target has a probability below 1/8 suffices).
/// The recipe's own scaling does not apply to this cast.
fn bound_scale(format: Fp8Format, device: &candle_core::Device) -> Result<ScalingMeta> {
    thread_local! {
        /// Made once a format and device (two host-to-device copies).
        static MADE: std::cell::RefCell<Vec<(Fp8Format, candle_core::Device, ScalingMeta)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    let found = MADE.with(|m| {
        m.borrow()
            .iter()
            .find(|(f, d, _)| *f == format && d.same_device(device))
            .map(|(_, _, meta)| meta.clone())
    });
    if let Some(meta) = found {
        return Ok(meta);
    }
    let scale = 2f32.powi(format.max().log2().floor() as i32);
    let meta = ScalingMeta::new(format.into(), 1, device)?.with_scale(scale)?;
    MADE.with(|m| m.borrow_mut().push((format, device.clone(), meta.clone())));
    Ok(meta)
}

/// The rows of each chunk of `rows`: about equal chunks of at most `most`
/// (at least 16) rows, a multiple of 16 (the FP8 GEMMs' alignment), the
/// last one shorter.
fn chunk_rows(rows: usize, most: usize) -> usize {
    let most = most.max(16);
    let chunks = rows.div_ceil(most).max(1);
    if chunks == 1 {
        return rows;
    }
    let even = rows.div_ceil(chunks).next_multiple_of(16);
    // rounding up may pass `most`: one chunk more then
    let even = if even > most { even - 16 } else { even };
    even.max(16).min(rows)
}

impl Linear {
    /// `mean cross-entropy(self(norm(x)), targets)` over chunks of rows
    /// (see the module's docs), where this layer runs per-tensor FP8 in
    /// all three GEMMs without a bias and `x` has at least
    /// [`loss_chunk_rows`] rows; `None` otherwise (the caller runs the ops one
    /// by one; `x_from` is then left as it was). `x_from`: `x` handed from
    /// another op, taken by the LayerNorm.
    ///
    /// # Errors
    /// As `linear_cross_entropy`.
    pub(crate) fn chunked_cross_entropy(
        &self,
        x: &Tensor,
        x_from: &mut Option<(Tensor, Handoff)>,
        norm: Option<&LayerNorm>,
        targets: &Tensor,
    ) -> Result<Option<Tensor>> {
        let most = loss_chunk_rows();
        if most == 0 || self.bias.is_some() {
            return Ok(None);
        }
        let (weight, classes, mode) = self.prepare(x)?;
        let passes = Passes::of(&mode);
        if passes.block.is_some() || !(passes.fprop && passes.dgrad && passes.wgrad) {
            return Ok(None);
        }
        let in_dim = x.dim(candle_core::D::Minus1)?;
        let rows = x.elem_count() / in_dim.max(1);
        // (the loss kernels take F32 and BF16 logits; the separate ops say
        // what is wrong with others)
        let dtype_ok = matches!(x.dtype(), DType::F32 | DType::BF16);
        if rows < most || x.rank() < 2 || !dtype_ok {
            return Ok(None);
        }
        let sink = self
            .sink
            .lock()
            .map_err(|_| Error::Poisoned {
                op: "Linear::chunked_cross_entropy",
            })?
            .clone();
        if sink.is_none() && !matches!(weight, Weight::F32(_)) {
            // the op-by-op path says what is wrong
            return Ok(None);
        }
        let mut lead = x.dims().to_vec();
        if let Some(last) = lead.last_mut() {
            *last = classes;
        }
        let targets =
            fused::class_targets(&Shape::from(lead), x.device(), targets)?.flatten_all()?;
        let step = current_step();
        let (normed, handoff, x_amax) = Self::normed(norm, x, true, (None, x_from.take()), &mode)?;
        let x_in = normed.as_ref().unwrap_or(x);
        let x2 = x_in.detach().reshape((rows, in_dim))?.contiguous()?;
        let (wq, wq_t) = self.weight_operand(&weight, &passes, step)?;
        let (xq, xq_t) = self.input_operand(&x2, x_amax.as_ref(), &passes, step)?;
        let (Some(wq), Some(xq)) = (wq, xq) else {
            return Err(Error::Unsupported {
                op: "Linear::chunked_cross_entropy",
                what: "an FP8 pass without its operand".into(),
            });
        };
        // a non-finite input amax makes the logits NaN (flag.rs)
        let xq = flagged_by_amax(&xq)?;
        let (arg0, handoff) = match handoff {
            Some((token, h)) => (token, Some(h)),
            None => (x_in.clone(), None),
        };
        // the weight's Var where its gradient goes to candle's GradStore,
        // else a tracked placeholder (candle then runs the backward)
        let w_arg = match (&weight, &sink) {
            (Weight::F32(var), None) => var.as_tensor().clone(),
            _ => Var::zeros(1, DType::F32, x.device())?.as_tensor().clone(),
        };
        // (evaluation, `nn::inference`: the loss alone, outside the graph)
        let tracked = !in_inference() && (arg0.track_op() || w_arg.track_op());
        let chunk = chunk_rows(rows, most);
        let grads = if tracked {
            let wt = match wq_t {
                Some(t) => t,
                None => wq.t()?,
            };
            let xt = match xq_t {
                Some(t) => t,
                None => xq.t()?,
            };
            Some((wt, xt))
        } else {
            None
        };
        let bound = bound_scale(passes.fmt.backward(), x.device())?;
        let ctx = Chunks {
            casts: &self.casts,
            xq: &xq,
            wq: &wq,
            targets: &targets,
            x_dtype: x2.dtype(),
            bound: &bound,
        };
        let mut pairs = Vec::new();
        let mut dxs = Vec::new();
        let mut acc: Option<Tensor> = None;
        for start in (0..rows).step_by(chunk) {
            let n = chunk.min(rows - start);
            let (p, dx, dw) = ctx.run(start, n, grads.as_ref(), arg0.track_op(), acc.as_ref())?;
            pairs.push(p);
            dxs.extend(dx);
            acc = dw.or(acc);
        }
        let pairs = Tensor::cat(&pairs, 0)?;
        let (Some(acc), true) = (acc, tracked) else {
            return Ok(Some(pairs.narrow(1, 0, 1)?.mean_all()?));
        };
        let dx = (!dxs.is_empty())
            .then(|| Tensor::cat(&dxs, 0))
            .transpose()?;
        drop(dxs);
        let dw = match &sink {
            // the F32 sum stays only where telemetry records the cast
            // (in the backward, once the incoming gradient is known)
            Some(_) => HeadGrad::Sink(fp8_grad(&acc)?, telemetry_enabled().then_some(acc)),
            None => HeadGrad::Store(acc),
        };
        *self.saved_bytes.lock().map_err(|_| Error::Poisoned {
            op: "Linear::chunked_cross_entropy",
        })? = dx
            .as_ref()
            .map_or(0, |d| d.elem_count() * d.dtype().size_in_bytes())
            + match &dw {
                HeadGrad::Sink(q, _) => q.nbytes(),
                HeadGrad::Store(t) => t.elem_count() * 4,
            };
        let op = HeadLossOp {
            y: Precomputed::new("amp_head_cross_entropy", pairs),
            grads: Mutex::new(Some((dx, dw))),
            handoff,
            x_shape: x_in.shape().clone(),
            casts: self.casts.clone(),
            sink,
            name: self.name.clone(),
            w_dtype: w_arg.dtype(),
        };
        Ok(Some(
            arg0.apply_op2(&w_arg, op)?.narrow(1, 0, 1)?.mean_all()?,
        ))
    }
}

/// What each chunk reads: the input's and the weight's FP8 codes (x
/// flagged), the U32 targets of all rows.
struct Chunks<'a> {
    xq: &'a ScalingTensor,
    wq: &'a ScalingTensor,
    targets: &'a Tensor,
    x_dtype: DType,
    /// The logits' gradient's cast: [`bound_scale`].
    bound: &'a ScalingMeta,
    /// The layer's casts: the first chunk's logit gradient is noted as its
    /// `grad_output` (telemetry, `last_cast_stats`).
    casts: &'a LastCasts,
}

impl Chunks<'_> {
    /// Rows `start..start + n`: their loss pairs; with `grads` (Wᵀ's and
    /// xᵀ's codes) the input's gradient (where `need_dx`) and the weight
    /// gradient added to `acc`, both for a mean's gradient of 1 a row.
    fn run(
        &self,
        start: usize,
        n: usize,
        grads: Option<&(ScalingTensor, ScalingTensor)>,
        need_dx: bool,
        acc: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
        let rows = |q: &ScalingTensor| {
            ScalingTensor::from_parts(q.data().narrow(0, start, n)?, q.meta().clone())
        };
        // fast accumulation in fprop, as the Linear's forward
        let logits = fp8_gemm_with(&rows(self.xq)?, self.wq, self.x_dtype, true)?;
        let t = self.targets.narrow(0, start, n)?;
        let Some((wt, xt)) = grads else {
            return Ok((fused::cross_entropy_rows(&logits, &t)?, None, None));
        };
        // the pairs and the logits' gradient for a row gradient of 1, one
        // kernel
        let (pairs, dl) = fused::cross_entropy_rows_with_grad(&logits, &t)?;
        drop(logits);
        // one pass, both layouts, the scale of the bound (no amax pass)
        let (dq, dq_t, _) = ScalingTensor::quantize_with_t(&dl, self.bound)?;
        if start == 0 {
            // the first chunk's cast stands for the head's output gradient
            noted(
                Source::Tensor(&dl),
                Role::GradOutput,
                self.casts,
                (dq.clone(), None),
            )?;
        }
        drop(dl);
        // a non-finite gradient amax rides in scale_inv into both products
        let dq = flagged_by_amax(&dq)?;
        let dq_t = ScalingTensor::from_parts(dq_t.data().clone(), dq.meta().clone())?;
        let dx = need_dx
            .then(|| fp8_gemm(&dq, wt, self.x_dtype))
            .transpose()?;
        // xᵀ's columns of these rows, contiguous for the GEMM
        let xt_rows = ScalingTensor::from_parts(
            xt.data().narrow(1, start, n)?.contiguous()?,
            xt.meta().clone(),
        )?;
        let dw = fp8_gemm_acc(&dq_t, &xt_rows, acc)?;
        Ok((pairs, dx, Some(dw)))
    }
}

/// The head's weight gradient as the forward left it: FP8 for the sink
/// (with its F32 source where telemetry records it), or F32 for candle's
/// GradStore.
enum HeadGrad {
    Sink(ScalingTensor, Option<Tensor>),
    Store(Tensor),
}

/// The autograd node of [`Linear::chunked_cross_entropy`]: `(x or its
/// token, the weight's Var or a placeholder)` in, the `[rows, 2]` loss
/// pairs out (their first column's mean is the loss); the backward hands
/// out the gradients the forward made, times the mean's gradient.
struct HeadLossOp {
    y: Precomputed,
    grads: Mutex<Option<(Option<Tensor>, HeadGrad)>>,
    /// The first argument is a token: the input's gradient goes here.
    handoff: Option<Handoff>,
    x_shape: Shape,
    casts: LastCasts,
    sink: Option<GradSink>,
    name: String,
    w_dtype: DType,
}

fn wrap(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

impl CustomOp2 for HeadLossOp {
    fn name(&self) -> &'static str {
        "amp_head_cross_entropy"
    }

    precomputed_fwd!(2);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let held = match self.grads.lock() {
            Ok(mut g) => g.take(),
            Err(_) => None,
        };
        let Some((dx, dw)) = held else {
            candle_core::bail!(
                "amp_head_cross_entropy: a second backward through the same loss \
                 (its gradients went with the first)"
            );
        };
        // the mean's gradient, the same for every row
        let g = grad.narrow(0, 0, 1)?.narrow(1, 0, 1)?.reshape(1)?;
        let dx = match dx {
            Some(d) if x.track_op() => {
                // g in F32 (a BF16 g would round every gradient the same way)
                let d = d
                    .to_dtype(DType::F32)?
                    .broadcast_mul(&g)?
                    .to_dtype(d.dtype())?;
                Some(match &self.handoff {
                    Some(h) => {
                        h.put(d.reshape(self.x_shape.clone())?).map_err(wrap)?;
                        Handoff::token_grad(x).map_err(wrap)?
                    }
                    None => d.reshape(x.shape())?,
                })
            }
            _ => None,
        };
        let dw = match (dw, &self.sink) {
            (HeadGrad::Sink(q, source), Some(sink)) => {
                let q = q.times(&g).map_err(wrap)?;
                if let Some(acc) = source {
                    let src = || Ok(acc.broadcast_mul(&g)?);
                    record(&self.casts, WEIGHT_GRAD_RECORD, &q, src).map_err(wrap)?;
                }
                sink.add(&self.name, q).map_err(wrap)?;
                None
            }
            (HeadGrad::Store(acc), _) if w.track_op() => {
                let d = acc.broadcast_mul(&g)?.to_dtype(self.w_dtype)?;
                crate::scaling::param_grads::hand_over(w, Some(d)).map_err(wrap)?
            }
            _ => None,
        };
        Ok((dx, dw))
    }
}

#[cfg(test)]
mod tests {
    use super::chunk_rows;

    #[test]
    fn chunks_are_equal_multiples_of_16() {
        // 8 x 1024 tokens at 4096: two chunks; 8 x 2048: four
        assert_eq!(chunk_rows(8192, 4096), 4096);
        assert_eq!(chunk_rows(16384, 4096), 4096);
        // as many rows as asked: one chunk of all rows
        assert_eq!(chunk_rows(100, 100), 100);
        // fewer than 16 asked still takes 16 rows
        assert_eq!(chunk_rows(64, 1), 16);
        // 100 rows, at most 40 a chunk: 3 of 34 -> 48 is above 40, so 32
        // (four chunks: 32, 32, 32, 4)
        assert_eq!(chunk_rows(100, 40), 32);
        // 100 rows, at most 50: 2 of 50 -> 64 is above 50, so 48
        assert_eq!(chunk_rows(100, 50), 48);
        // 9000 rows at 4096: 3 chunks of 3000 -> 3008
        assert_eq!(chunk_rows(9000, 4096), 3008);
    }
}
