//! A tensor handed from one of our ops to the next outside candle's graph.
//!
//! candle's backward gives every graph edge a zero-filled gradient and an
//! add, and keeps every op's inputs until backward ends. Between two of our
//! own ops neither is needed: the producer computes its output before the
//! graph sees it and puts a one-element token in the graph in its place;
//! the consumer takes the token as its graph input (the real tensor as a
//! value) and, in its backward, leaves the real gradient in the
//! [`Handoff`] and returns a one-element gradient for the token; the
//! producer's backward, which candle runs next, takes it from there. The
//! output is then freed as soon as the consumer's forward is done with it.

use super::ops::LayerNormOp;
use crate::error::{Error, Result};
use candle_core::{CpuStorage, CustomOp3, DType, Shape, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The slot between a producer and its consumer: the handed tensor's
/// gradient, and where the producer asks for them
/// ([`want_col_stats`](Self::want_col_stats)) its column sums and amax,
/// if the consumer's backward took them in the pass that made it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Handoff {
    grad: Arc<Mutex<Option<Tensor>>>,
    stats: Arc<Mutex<Option<(Tensor, Tensor)>>>,
    wants_stats: Arc<AtomicBool>,
}

impl Handoff {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Option<Tensor>>> {
        self.grad
            .lock()
            .map_err(|_| Error::Poisoned { op: "Handoff" })
    }

    /// The consumer's backward leaves the gradient of the handed tensor.
    pub(crate) fn put(&self, grad: Tensor) -> Result<()> {
        let mut slot = self.lock()?;
        if slot.is_some() {
            return Err(Error::Unsupported {
                op: "Handoff",
                what: "a second gradient for one handoff (one consumer per handed tensor)".into(),
            });
        }
        *slot = Some(grad);
        Ok(())
    }

    /// The producer's backward takes it. candle runs a producer's backward
    /// only after its consumer's, which always leaves one: an empty slot is
    /// an error, never a silently missing gradient.
    pub(crate) fn take(&self) -> Result<Tensor> {
        self.lock()?.take().ok_or_else(|| Error::Unsupported {
            op: "Handoff",
            what: "no gradient was handed back (the consumer's backward did not run)".into(),
        })
    }

    /// The producer's backward would use the gradient's column sums and
    /// amax (a bias gradient and its cast's amax).
    pub(crate) fn want_col_stats(&self) {
        self.wants_stats.store(true, Ordering::Relaxed);
    }

    /// Whether the producer asked for them.
    pub(crate) fn wants_col_stats(&self) -> bool {
        self.wants_stats.load(Ordering::Relaxed)
    }

    /// The consumer's backward leaves the column sums (F32 `[cols]`) and
    /// amax (F32 `[1]`) of the gradient it puts.
    pub(crate) fn put_col_stats(&self, sums: Tensor, amax: Tensor) -> Result<()> {
        let mut slot = self
            .stats
            .lock()
            .map_err(|_| Error::Poisoned { op: "Handoff" })?;
        *slot = Some((sums, amax));
        Ok(())
    }

    /// The producer's backward takes them, if the consumer left them.
    pub(crate) fn take_col_stats(&self) -> Result<Option<(Tensor, Tensor)>> {
        Ok(self
            .stats
            .lock()
            .map_err(|_| Error::Poisoned { op: "Handoff" })?
            .take())
    }

    /// A one-element token's storage (F32 0) on the CPU.
    pub(crate) fn cpu_token() -> (CpuStorage, Shape) {
        (CpuStorage::F32(vec![0.0]), Shape::from(1usize))
    }

    /// A one-element token's storage (F32 0) on `dev`.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_token(
        dev: &candle_core::CudaDevice,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let zero = dev.alloc_zeros::<f32>(1)?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(zero, dev.clone()),
            Shape::from(1usize),
        ))
    }

    /// The one-element gradient a consumer returns for the token: the
    /// token itself, detached (its one F32 zero, never written; the
    /// producer's backward does not read the value, only candle's walk
    /// needs a gradient to reach it). No fill launch, where a fresh zero
    /// took one per handoff and step.
    pub(crate) fn token_grad(token: &Tensor) -> Result<Tensor> {
        if token.dtype() != DType::F32 || token.elem_count() != 1 {
            return Err(Error::Unsupported {
                op: "Handoff",
                what: format!(
                    "a token of one F32 element, not {:?} {:?}",
                    token.dtype(),
                    token.shape()
                ),
            });
        }
        Ok(token.detach())
    }
}

/// The gradient of a pre-LayerNorm half-block's input `h` through its
/// residual (`h + proj(...)`, the residual taken into the projection's op),
/// carried to the LayerNorm handoff that reads the same `h`, whose backward
/// adds it to the input gradient in its kernel: `h` then gets one gradient
/// in candle's graph instead of two (each a zero-fill and an add there).
/// Used only where both ends attach: the LayerNorm handoff as the reader
/// (before), the projection's op as the writer (after, only if a reader is
/// attached); a reader whose writer attached finds the gradient or fails.
#[derive(Debug, Clone, Default)]
pub(crate) struct ResidualGrad {
    slot: Arc<Mutex<ResidualSlot>>,
}

#[derive(Debug, Default)]
struct ResidualSlot {
    reader: bool,
    writer: bool,
    grad: Option<Tensor>,
}

impl ResidualGrad {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, ResidualSlot>> {
        self.slot
            .lock()
            .map_err(|_| Error::Poisoned { op: "ResidualGrad" })
    }

    /// The LayerNorm handoff will add the gradient.
    fn attach_reader(&self) -> Result<()> {
        self.lock()?.reader = true;
        Ok(())
    }

    /// The op that takes the residual will leave its gradient here, if a
    /// reader is attached (returned); otherwise it returns the gradient to
    /// candle as before.
    pub(crate) fn attach_writer(&self) -> Result<bool> {
        let mut s = self.lock()?;
        s.writer = s.reader;
        Ok(s.writer)
    }

    /// The writer's backward leaves the residual's gradient.
    pub(crate) fn put(&self, grad: Tensor) -> Result<()> {
        let mut s = self.lock()?;
        if s.grad.is_some() {
            return Err(Error::Unsupported {
                op: "ResidualGrad",
                what: "a second residual gradient".into(),
            });
        }
        s.grad = Some(grad);
        Ok(())
    }

    /// The reader's backward takes it: `None` without a writer, an error if
    /// the writer's backward left none.
    fn take(&self) -> Result<Option<Tensor>> {
        let mut s = self.lock()?;
        if !s.writer {
            return Ok(None);
        }
        s.grad.take().map(Some).ok_or_else(|| Error::Unsupported {
            op: "ResidualGrad",
            what: "no residual gradient was left (the writer's backward did not run)".into(),
        })
    }
}

/// LayerNorm of `x` (F32 `weight` and `bias`, F32 or BF16 `x`, as
/// [`layer_norm`](super::layer_norm); `rms`: [`rms_norm`](super::rms_norm)
/// with a zero `bias`) handed to the next op: `(out, amax, token,
/// handoff)`, with `want_amax` `amax` the max |out| that the normalisation's
/// pass took (see `norm_amax`). `out` is detached; the token (F32 `[1]`) stands for it in the
/// graph, and the LayerNorm's backward (input, weight and bias gradients)
/// runs from the gradient the consumer leaves in `handoff`, with the
/// residual gradient of `res_grad` (see [`ResidualGrad`]) added to the
/// input's.
///
/// # Errors
/// As [`layer_norm`](super::layer_norm).
pub(crate) fn layer_norm_handoff(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    (eps, rms): (f64, bool),
    (res_grad, x_from): (Option<ResidualGrad>, Option<(Tensor, Handoff)>),
    want_amax: bool,
) -> Result<(Tensor, Option<Tensor>, Tensor, Handoff)> {
    let (x0, w0, b0) = (x.detach(), weight.detach(), bias.detach());
    let (out, amax) = match want_amax {
        true => {
            let (out, amax) = super::norm_amax(&x0, &w0, &b0, eps, rms)?;
            (out, Some(amax))
        }
        false => (super::norm(&x0, &w0, &b0, eps, rms)?, None),
    };
    let handoff = Handoff::default();
    if let Some(r) = &res_grad {
        r.attach_reader()?;
    }
    // a handed input: its token is the graph's argument, the value is kept
    // here for the backward, whose input gradient goes back to its producer
    let (arg0, input) = match x_from {
        Some((token, from)) => (token, Some((x0, from))),
        None => (x.contiguous()?, None),
    };
    let op = LayerNormToken {
        eps: eps as f32,
        rms,
        handoff: handoff.clone(),
        res_grad,
        input,
    };
    let dim = weight.elem_count();
    let token = arg0.apply_op3(&weight.contiguous()?, &super::vector(bias, dim)?, op)?;
    Ok((out, amax, token, handoff))
}

/// The LayerNorm's graph node: a one-element output; backward from the
/// handed gradient, as [`LayerNormOp`]'s.
struct LayerNormToken {
    eps: f32,
    rms: bool,
    handoff: Handoff,
    res_grad: Option<ResidualGrad>,
    /// A handed input: its value (the graph's first argument is its
    /// token) and the handoff its gradient goes to.
    input: Option<(Tensor, Handoff)>,
}

impl CustomOp3 for LayerNormToken {
    fn name(&self) -> &'static str {
        "amp_layer_norm_token"
    }

    token_fwd!(3);

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        res: &Tensor,
        _token_grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = self.handoff.take().map_err(candle_core::Error::wrap)?;
        let dres = match &self.res_grad {
            Some(r) => r.take().map_err(candle_core::Error::wrap)?,
            None => None,
        };
        let op = LayerNormOp {
            eps: self.eps,
            rms: self.rms,
            dx: false,
            res: dres,
            stats: Default::default(),
        };
        let Some((value, from)) = &self.input else {
            return op.bwd(x, w, b, res, &dy);
        };
        let (dx, dw, db) = op.bwd(&value.contiguous()?, w, b, res, &dy)?;
        if let Some(dx) = dx {
            from.put(dx).map_err(candle_core::Error::wrap)?;
        }
        let token_grad = Handoff::token_grad(x).map_err(candle_core::Error::wrap)?;
        Ok((Some(token_grad), dw, db))
    }
}

/// `cpu_fwd` and `cuda_fwd` of a graph node that stands in for a handed
/// tensor: a one-element token on the first input's device (as
/// `precomputed_fwd!` for an op whose output was computed before).
macro_rules! token_fwd {
    (1) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            Ok($crate::nn::fused::Handoff::cpu_token())
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s: &candle_core::CudaStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            use candle_core::backend::BackendStorage;
            $crate::nn::fused::Handoff::cuda_token(s.device())
        }
    };
    (3) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            Ok($crate::nn::fused::Handoff::cpu_token())
        }

        #[cfg(feature = "cuda")]
        fn cuda_fwd(
            &self,
            s: &candle_core::CudaStorage,
            _: &candle_core::Layout,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
            _: &candle_core::CudaStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
            use candle_core::backend::BackendStorage;
            $crate::nn::fused::Handoff::cuda_token(s.device())
        }
    };
}
pub(crate) use token_fwd;
