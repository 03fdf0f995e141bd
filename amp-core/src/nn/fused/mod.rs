//! Fused training ops with their backward passes: causal attention,
//! cross-entropy, LayerNorm and RMSNorm, GELU and SwiGLU, the embedding
//! lookup and rotary position embeddings (RoPE).
//!
//! candle composes these from elementwise kernels, and its backprop gives
//! every intermediate a zero-filled gradient and an add; in a GPT step on
//! a GPU those kernels take most of the step's time (docs/ARCHITECTURE.md,
//! "candle's graph: zero-filled gradients and kept inputs").
//! Each op here is one kernel forward and one or two backward, on the CPU
//! (`cpu.rs`, the reference) and on CUDA (`kernels/nn.cu`). Sums are in
//! F32 on both; CPU and CUDA agree to rounding (their `exp`, `ln` and
//! `tanh` differ in the last bit), not bit for bit as the casts do. NaN
//! propagates alike; a +inf score or logit gives a non-finite result on
//! both, though not always the same one (NaN on the CPU where CUDA's
//! online max gives +inf or a NaN at that position only).
//!
//! ```
//! use amp_core::nn::{causal_attention, cross_entropy, gelu};
//! use candle_core::{Device, Tensor, Var};
//!
//! let dev = Device::Cpu;
//! let q = Var::randn(0f32, 1.0, (2, 4, 16, 8), &dev)?;
//! let y = gelu(&causal_attention(&q, &q, &q)?)?;             // [2, 4, 16, 8]
//! let logits = y.reshape((2 * 4 * 16, 8))?;
//! let targets = Tensor::from_vec((0..128u32).map(|i| i % 8).collect(), 128, &dev)?;
//! let loss = cross_entropy(&logits, &targets)?;
//! let grads = loss.backward()?;
//! assert!(grads.get(&q).is_some());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod activation;
mod attention;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod embedding;
mod embedding_hook;
pub(crate) mod flash;
mod flash_shape;
mod handoff;
mod heads;
mod ops;
mod pointwise;
mod rope;
mod rope_attention;
mod xent_rows;

pub use activation::{swiglu, Activation};
pub use attention::{causal_attention, causal_attention_qkv};
pub use embedding::{embedding, embedding_grad};
pub use embedding_hook::{with_embedding_backward, LookupGrad};
pub use flash::{flash_attention_enabled, flash_head_dim, set_flash_attention};
pub use rope::{rope, rope_tables, RopeScaling};
pub(crate) use rope_attention::rope_attention_handed;
pub use rope_attention::rope_attention_qkv;

use crate::error::{Error, Result};
use candle_core::{DType, Tensor, D};

fn float_dtype(op: &'static str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::F32 | DType::BF16 => Ok(()),
        DType::F16 | DType::F64 if !t.device().is_cuda() => Ok(()),
        got => Err(Error::DType {
            op,
            expected: "F32 or BF16 (F16 and F64 on the CPU)",
            got,
        }),
    }
}

/// Mean cross-entropy of `logits` `[.., classes]` against `targets` of
/// the leading dimensions (`[rows]` for `[rows, classes]`, `[batch, seq]`
/// for `[batch, seq, classes]`; class indices, any integer dtype):
/// `mean(logsumexp(x) - x[target])`, in F32, as a one-element tensor.
/// Forward keeps one F32 pair per row; backward writes `softmax(x) -
/// onehot(t)` in one pass. Logits of any rank go into the op as they are:
/// no reshape node whose gradient candle would zero-fill and add (for a
/// GPT's logits, hundreds of megabytes per step).
///
/// # Errors
/// [`Error::Rank`], [`Error::Shape`], [`Error::DType`], [`Error::Device`];
/// on the CPU a target outside `0..classes` is [`Error::Unsupported`]. On
/// CUDA such a target is not read back (no host copy): its row's loss is
/// NaN, so the mean is NaN and a loss-scaled step is skipped, never silently
/// wrong.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let targets = ce_targets(logits, targets)?;
    let pairs = logits
        .contiguous()?
        .apply_op2(&targets, ops::CrossEntropy)?;
    Ok(pairs.narrow(1, 0, 1)?.mean_all()?)
}

/// [`cross_entropy`]'s checks; the targets as contiguous U32.
fn ce_targets(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    if logits.rank() < 2 {
        return Err(Error::Rank {
            op: OP,
            expected: 2,
            got: logits.shape().clone(),
        });
    }
    float_dtype(OP, logits)?;
    class_targets(logits.shape(), logits.device(), targets)
}

/// The targets of logits of shape `logits` (rank 2 or more, on `device`)
/// checked as [`cross_entropy`] checks them, as contiguous U32 of the
/// logits' leading dimensions.
pub(crate) fn class_targets(
    logits: &candle_core::Shape,
    device: &candle_core::Device,
    targets: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "cross_entropy";
    let (lead, classes) = logits.dims().split_at(logits.rank().saturating_sub(1));
    let (rows, classes) = (
        lead.iter().product::<usize>(),
        classes.first().copied().unwrap_or(0),
    );
    if rows == 0 || classes == 0 {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("logits of shape {logits:?}: no rows or no classes"),
        });
    }
    if targets.dims() != lead {
        return Err(Error::Shape {
            op: OP,
            lhs: logits.clone(),
            rhs: targets.shape().clone(),
        });
    }
    if !targets.device().same_device(device) {
        return Err(Error::Device {
            op: OP,
            lhs: device.location(),
            rhs: targets.device().location(),
        });
    }
    let targets = match targets.dtype() {
        DType::U32 => targets.contiguous()?,
        DType::U8 | DType::I64 => targets.to_dtype(DType::U32)?,
        got => {
            return Err(Error::DType {
                op: OP,
                expected: "integer class indices (U32, U8 or I64)",
                got,
            })
        }
    };
    if !targets.device().is_cuda() {
        let max = targets.flatten_all()?.max(0)?.to_scalar::<u32>()?;
        if max as usize >= classes {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("target {max} is outside the {classes} classes"),
            });
        }
    }
    Ok(targets)
}

/// Cross-entropy of 2-D logits against U32 targets, one F32 pair per row
/// (`lse - x[t]`, `lse`): [`cross_entropy`]'s forward without a graph node.
pub(crate) fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(logits
        .contiguous()?
        .apply_op2_no_bwd(targets, &ops::CrossEntropy)?)
}

/// [`cross_entropy_rows`] and [`cross_entropy`]'s backward kernel with
/// `g = 1` for every row, in one kernel (one read of the logits from
/// memory): `(pairs, dx)`, `dx = softmax(x) - onehot(t)` in the logits'
/// dtype, bit for bit what the two kernels give.
pub(crate) fn cross_entropy_rows_with_grad(
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let kernel = xent_rows::CrossEntropyRowsGrad;
    let [pairs, dx] = <[Tensor; 2]>::try_from(crate::numerics::kernel::launch(
        &kernel,
        &[logits, targets],
    )?)
    .map_err(|_| Error::Unsupported {
        op: "cross_entropy_rows_with_grad",
        what: "the kernel's two outputs".into(),
    })?;
    Ok((pairs, dx))
}

/// [`cross_entropy`] of logits handed from the previous op (`token`
/// stands for them in the graph, `from` takes their gradient): the logits
/// never become a graph tensor (no zero-filled gradient as large as the
/// logits); the op keeps them for its backward and frees them there (one
/// backward per loss).
pub(crate) fn cross_entropy_handed(
    logits: &Tensor,
    token: &Tensor,
    from: &Handoff,
    targets: &Tensor,
) -> Result<Tensor> {
    let targets = ce_targets(logits, targets)?;
    let logits = logits.contiguous()?;
    let pairs = logits.apply_op2_no_bwd(&targets, &ops::CrossEntropy)?;
    let op = ops::CrossEntropyHanded {
        y: crate::nn::precomputed::Precomputed::new("amp_cross_entropy_handed", pairs),
        logits: std::sync::Mutex::new(Some(logits)),
        targets,
        from: from.clone(),
    };
    Ok(token.apply_op1(op)?.narrow(1, 0, 1)?.mean_all()?)
}

/// GELU, tanh form (candle's `gelu`), with a one-kernel backward.
///
/// # Errors
/// [`Error::DType`] for a non-float input; candle's.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    float_dtype("gelu", x)?;
    Ok(x.contiguous()?.apply_op1(pointwise::Gelu)?)
}

/// LayerNorm over the last dimension with F32 `weight` and `bias` of that
/// length: `(x - mean) / sqrt(var + eps) * weight + bias`, statistics in
/// F32; the output has `x`'s dtype. Backward: one kernel for the input
/// gradient, one pass for the weight and bias gradients (summed in a fixed
/// order: deterministic).
///
/// # Errors
/// [`Error::Shape`] when the last dimension is not the parameters' length,
/// [`Error::DType`] for parameters other than F32; candle's.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    norm(x, weight, bias, eps, false)
}

/// RMSNorm over the last dimension with an F32 `weight` of that length:
/// `x / sqrt(mean(x²) + eps) * weight` (Llama's, TE's `RMSNorm`),
/// statistics in F32; the output has `x`'s dtype. The kernels are
/// [`layer_norm`]'s with the mean taken as 0.
///
/// # Errors
/// As [`layer_norm`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    norm(x, weight, &weight.zeros_like()?.detach(), eps, true)
}

/// [`layer_norm`], or with `rms` [`rms_norm`] (`bias` zero).
pub(crate) fn norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    rms: bool,
) -> Result<Tensor> {
    let dim = check_norm(x, weight, bias)?;
    let op = ops::LayerNormOp {
        eps: eps as f32,
        rms,
        dx: false,
        res: None,
        stats: Default::default(),
    };
    Ok(x.contiguous()?
        .apply_op3(&weight.contiguous()?, &vector(bias, dim)?, op)?)
}

/// [`norm`] of detached tensors and `max |y|` of its stored output
/// (1-element F32, bit for bit [`amax`](crate::amax) of `y`), in the
/// normalisation's own pass where the CUDA kernel holds the row in
/// registers: what a current-scaling cast of `y` needs. No graph node.
pub(crate) fn norm_amax(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    rms: bool,
) -> Result<(Tensor, Tensor)> {
    let dim = check_norm(x, weight, bias)?;
    let op = ops::LayerNormAmax {
        eps: eps as f32,
        rms,
    };
    let inputs = [
        &x.detach().contiguous()?,
        &weight.detach().contiguous()?,
        &vector(&bias.detach(), dim)?,
    ];
    let [y, amax] = <[Tensor; 2]>::try_from(crate::numerics::kernel::launch(&op, &inputs)?)
        .map_err(|_| crate::numerics::kernel::arity("layer_norm_amax"))?;
    Ok((y, amax))
}

/// A LayerNorm's inputs checked: a float `x` whose last dimension is the
/// F32 weight's and bias's length (returned).
fn check_norm(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<usize> {
    const OP: &str = "layer_norm";
    float_dtype(OP, x)?;
    let dim = weight.elem_count();
    if x.rank() == 0 || x.dim(D::Minus1)? != dim || bias.elem_count() != dim || weight.rank() != 1 {
        return Err(Error::Shape {
            op: OP,
            lhs: x.shape().clone(),
            rhs: weight.shape().clone(),
        });
    }
    for p in [weight, bias] {
        if p.dtype() != DType::F32 {
            return Err(Error::DType {
                op: OP,
                expected: "F32 weight and bias",
                got: p.dtype(),
            });
        }
    }
    Ok(dim)
}

/// A parameter as a contiguous vector of `dim` elements: itself where it is
/// one (a reshape is a node of candle's graph, so its gradient would be
/// zero-filled and added once more before it reaches the parameter).
pub(crate) fn vector(p: &Tensor, dim: usize) -> Result<Tensor> {
    let v = if p.rank() == 1 {
        p.clone()
    } else {
        p.reshape(dim)?
    };
    Ok(v.contiguous()?)
}

/// `x + bias` with an F32 `bias` of `x`'s last dimension broadcast over the
/// other dimensions, in one pass (candle's broadcast add takes several
/// times as long on CUDA); the gradient of `bias` is one column-sum pass
/// over `dy`, summed in a fixed order. Other dtypes go through candle's
/// `broadcast_add`.
///
/// # Errors
/// [`Error::Shape`] unless `bias` has `x`'s last dimension; candle's.
pub fn bias_add(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let dim = x.dims().last().copied().unwrap_or(0);
    if bias.elem_count() != dim || x.rank() == 0 {
        return Err(Error::Shape {
            op: "bias_add",
            lhs: x.shape().clone(),
            rhs: bias.shape().clone(),
        });
    }
    // F64 keeps candle's path (the fused pass sums in F32)
    if bias.dtype() != DType::F32 || x.dtype() == DType::F64 || float_dtype("bias_add", x).is_err()
    {
        return Ok(x.broadcast_add(&bias.to_dtype(x.dtype())?)?);
    }
    Ok(x.contiguous()?
        .apply_op2(&bias.contiguous()?, pointwise::BiasAdd)?)
}

/// Whether [`bias_add`]'s kernel takes `x` and `bias` as they are (a
/// contiguous F32 bias, F32 or BF16 `x`): then [`BiasAdd`] is that kernel,
/// for ops that run it on storages.
pub(crate) fn bias_kernel_takes(x: &Tensor, bias: &Tensor) -> bool {
    bias.dtype() == DType::F32
        && bias.is_contiguous()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && x.rank() > 0
        && x.dims().last() == Some(&bias.elem_count())
}

pub(crate) use attention::causal_attention_handed;
pub(crate) use handoff::{layer_norm_handoff, token_fwd, Handoff, ResidualGrad};
pub(crate) use pointwise::BiasAdd;

/// `x + bias` as [`bias_add`] computes it, outside the graph (for ops
/// that return the bias's gradient themselves, such as the FP8 Linear).
pub(crate) fn bias_add_detached(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    bias_add(&x.detach(), &bias.detach())
}

/// The sums over the rows of `x` (all dimensions but the last), F32, in a
/// fixed order: a bias gradient.
pub(crate) fn col_sum(x: &Tensor) -> Result<Tensor> {
    let x = match x.dtype() {
        DType::F32 | DType::BF16 => x.contiguous()?,
        // the CUDA kernel reads F32 or BF16
        _ => x.to_dtype(DType::F32)?.contiguous()?,
    };
    Ok(x.apply_op1_no_bwd(&pointwise::ColSum { amax: false })?)
}

/// [`col_sum`] and `x`'s amax (1-element F32, bit for bit what
/// [`amax`](crate::amax) returns) from one pass over `x`: a bias gradient
/// and the amax its output gradient's current-scaling cast needs.
pub(crate) fn col_sum_amax(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = match x.dtype() {
        DType::F32 | DType::BF16 => x.contiguous()?,
        _ => x.to_dtype(DType::F32)?.contiguous()?,
    };
    let both = x.apply_op1_no_bwd(&pointwise::ColSum { amax: true })?;
    let cols = both.elem_count() - 1;
    Ok((both.narrow(0, 0, cols)?, both.narrow(0, cols, 1)?))
}
