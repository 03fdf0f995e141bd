//! What the bucketed FP8 collectives share: their inputs (each as codes
//! with this rank's own scale, for the reductions), and the agreement of
//! a vector of amaxes (one all-reduce(max) for a bucket; ZeRO's weight
//! gather casts each slice with its own agreed scale). Each bit for bit
//! the per-tensor functions' steps; the decode and sum is
//! [`rank_order_mean`](crate::rank_sum::rank_order_mean).

use crate::communicator::Communicator;
use crate::error::{Error, Result};
use crate::fp8_reduce::{Fp8ReduceConfig, Grad};
use amp_core::{bucket_scales, QType, ScalingMeta, ScalingTensor};
use candle_core::{DType, Shape, Tensor};

/// One gradient of a bucket.
pub(crate) enum Input {
    /// A float tensor (F32, F16, BF16), flat.
    Float(Tensor),
    /// FP8 or FP16 codes with their scale.
    Scaled(ScalingTensor),
}

impl Input {
    /// Checks the dtype.
    pub(crate) fn new(op: &'static str, grad: Grad<'_>) -> Result<Self> {
        match grad {
            Grad::Tensor(t) => match t.dtype() {
                DType::F32 | DType::F16 | DType::BF16 => Ok(Self::Float(t.flatten_all()?)),
                got => Err(Error::DType {
                    op,
                    expected: "F32, F16, BF16 or a ScalingTensor",
                    got,
                }),
            },
            Grad::Scaled(s) => Ok(Self::Scaled(s.clone())),
        }
    }

    pub(crate) fn shape(&self) -> &Shape {
        match self {
            Self::Float(t) => t.shape(),
            Self::Scaled(s) => s.shape(),
        }
    }

    pub(crate) fn elem_count(&self) -> usize {
        self.shape().elem_count()
    }

    /// The amax of the value (NaN when it holds one).
    pub(crate) fn amax(&self) -> Result<Tensor> {
        Ok(match self {
            Self::Float(t) => amp_core::amax(t)?,
            Self::Scaled(s) => s.decoded_amax()?,
        })
    }

    /// The value as codes of `cfg.qtype` with this rank's own scale
    /// ([`own_codes`](crate::fp8_reduce::own_codes)).
    pub(crate) fn own_codes(&self, cfg: &Fp8ReduceConfig) -> Result<ScalingTensor> {
        let grad = match self {
            Self::Float(t) => Grad::Tensor(t),
            Self::Scaled(s) => Grad::Scaled(s),
        };
        crate::fp8_reduce::own_codes("fp8_all_reduce_bucket", grad, cfg)
    }

    /// The flat codes of the value cast with `meta`.
    pub(crate) fn cast(&self, meta: &ScalingMeta) -> Result<Tensor> {
        let q = match self {
            Self::Float(t) => ScalingTensor::quantize_with(t, meta)?.0,
            Self::Scaled(s) => s.requantize_with(meta)?.0,
        };
        Ok(q.data().flatten_all()?)
    }
}

/// The bucket's inputs, with their original shapes, from `grads`.
pub(crate) fn inputs<'a, G: Into<Grad<'a>>>(
    op: &'static str,
    grads: impl IntoIterator<Item = G>,
) -> Result<(Vec<Input>, Vec<Shape>)> {
    let mut inputs = Vec::new();
    let mut shapes = Vec::new();
    for g in grads {
        let g = g.into();
        shapes.push(match g {
            Grad::Tensor(t) => t.shape().clone(),
            Grad::Scaled(s) => s.shape().clone(),
        });
        inputs.push(Input::new(op, g)?);
    }
    Ok((inputs, shapes))
}

/// One metadata per element of `amaxes` (1-element F32 tensors, NaN
/// counted as inf), agreed with one all-reduce(max) of their vector: what
/// the per-tensor functions agree with one all-reduce each. Returns the
/// agreed amaxes too, as a vector.
pub(crate) fn agreed_metas<C: Communicator + ?Sized>(
    comm: &C,
    amaxes: &[Tensor],
    cfg: &Fp8ReduceConfig,
) -> Result<(Vec<ScalingMeta>, Tensor)> {
    let flat = amaxes
        .iter()
        .map(Tensor::flatten_all)
        .collect::<candle_core::Result<Vec<_>>>()?;
    let local = Tensor::cat(&flat, 0)?;
    let inf = Tensor::full(f32::INFINITY, local.shape(), local.device())?;
    let local = local.ne(&local)?.where_cond(&inf, &local)?;
    let global = comm.all_reduce_max_no_nan(&local)?;
    let (scale, scale_inv) = bucket_scales(&global, cfg.qtype, cfg.scale_rule, cfg.margin)?;
    let metas = metas_of(cfg.qtype, &scale, &scale_inv, &global, amaxes.len())?;
    Ok((metas, global))
}

/// Tensor `t`'s metadata, for `t` in `0..n`: element `t` of `scale`,
/// `scale_inv` and `amax` (its agreed amax, as the per-tensor functions
/// keep it), as views.
pub(crate) fn metas_of(
    qtype: QType,
    scale: &Tensor,
    scale_inv: &Tensor,
    amax: &Tensor,
    n: usize,
) -> Result<Vec<ScalingMeta>> {
    (0..n)
        .map(|t| {
            Ok(ScalingMeta::from_parts(
                qtype,
                scale.narrow(0, t, 1)?,
                scale_inv.narrow(0, t, 1)?,
                amax.narrow(0, t, 1)?,
            )?)
        })
        .collect()
}

/// The concatenation of the non-empty `parts` (1-D, one dtype); a view of
/// zero elements of `empty` when all are empty, so that no zero-element
/// tensor is allocated.
pub(crate) fn cat_nonempty(parts: &[Tensor], empty: &Tensor) -> Result<Tensor> {
    let parts: Vec<&Tensor> = parts.iter().filter(|p| p.elem_count() > 0).collect();
    Ok(match parts.as_slice() {
        [] => empty.narrow(0, 0, 0)?,
        [one] => (*one).clone(),
        _ => Tensor::cat(&parts, 0)?,
    })
}

/// The bucket's FP8 gradients and their format when every step can run a
/// bucket at a time (`amp_core::bucket_*`): all inputs scaling tensors of
/// the configured FP8 format, at most 64 ranks.
pub(crate) fn fused<'i>(
    inputs: &'i [Input],
    cfg: &Fp8ReduceConfig,
    n: usize,
) -> Option<(Vec<&'i ScalingTensor>, QType)> {
    if cfg.qtype == QType::F16 || n > 64 {
        return None;
    }
    let scaled = inputs
        .iter()
        .map(|x| match x {
            Input::Scaled(s) if s.qtype() == cfg.qtype => Some(s),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    Some((scaled, cfg.qtype))
}

/// Every input as codes with this rank's own scale
/// ([`Input::own_codes`]).
pub(crate) fn own_all(inputs: &[Input], cfg: &Fp8ReduceConfig) -> Result<Vec<ScalingTensor>> {
    inputs.iter().map(|x| x.own_codes(cfg)).collect()
}
