//! The FP8 Linear's scaling: the modes (current, delayed), the roles of its
//! three scaled tensors, the per-layer delayed-scaling state (TE's
//! `fp8_meta`) and the casts that use them.

use crate::error::{Error, Result};
use crate::numerics::format::Fp8Format;
use crate::numerics::qtype::QType;
use crate::numerics::recipe::{CurrentScaling, DelayedScaling};
use crate::scaling::block::BlockTensor;
use crate::scaling::meta::ScalingMeta;
use crate::scaling::telemetry::{telemetry_enabled, Pending};
use crate::scaling::tensor::ScalingTensor;
use candle_core::Tensor;
use std::sync::{Arc, Mutex};

/// How a layer's casts are scaled in an FP8 mode.
#[derive(Debug, Clone)]
pub(crate) enum Scaling {
    Current(CurrentScaling),
    Delayed(DelayedScaling),
}

/// Which of a layer's three scaled tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Input = 0,
    Weight = 1,
    GradOutput = 2,
}

/// A layer's delayed-scaling state: one `ScalingMeta` each for the input,
/// the weight and the output gradient (TE's `fp8_meta`), and the step at
/// which each was last updated.
#[derive(Debug, Clone)]
pub struct LayerScaling {
    /// Input (E4M3).
    pub input: ScalingMeta,
    /// Weight (E4M3).
    pub weight: ScalingMeta,
    /// Output gradient (E5M2 under HYBRID, E4M3 under E4M3).
    pub grad_output: ScalingMeta,
    recipe: DelayedScaling,
    last_step: [u64; 3],
}

impl LayerScaling {
    fn new(recipe: &DelayedScaling, device: &candle_core::Device) -> Result<Self> {
        let meta = |f: Fp8Format| ScalingMeta::new(f.into(), recipe.amax_history_len, device);
        Ok(Self {
            input: meta(recipe.fp8_format.forward())?,
            weight: meta(recipe.fp8_format.forward())?,
            grad_output: meta(recipe.fp8_format.backward())?,
            recipe: recipe.clone(),
            last_step: [0; 3],
        })
    }

    /// Rebuilds a state (checkpoints): `used[i]` says whether input, weight
    /// and output-gradient metas have taken part in a step, so that the next
    /// step rolls their histories as the uninterrupted run would.
    pub fn from_parts(
        input: ScalingMeta,
        weight: ScalingMeta,
        grad_output: ScalingMeta,
        recipe: DelayedScaling,
        used: [bool; 3],
    ) -> Self {
        // u64::MAX never equals a step number: "used, in some earlier step".
        let last_step = used.map(|u| if u { u64::MAX } else { 0 });
        Self {
            input,
            weight,
            grad_output,
            recipe,
            last_step,
        }
    }

    /// Whether each meta (input, weight, output gradient) has been used.
    pub fn used(&self) -> [bool; 3] {
        self.last_step.map(|s| s != 0)
    }

    /// The recipe the metas follow.
    pub fn recipe(&self) -> &DelayedScaling {
        &self.recipe
    }

    fn meta_mut(&mut self, role: Role) -> &mut ScalingMeta {
        match role {
            Role::Input => &mut self.input,
            Role::Weight => &mut self.weight,
            Role::GradOutput => &mut self.grad_output,
        }
    }
}

/// A layer's delayed-scaling state, shared with its pending backward ops.
pub(crate) type SharedScaling = Arc<Mutex<Option<LayerScaling>>>;

/// A layer's last FP8 casts, in every FP8 mode: per role (input, weight,
/// output gradient) the metadata of its last cast, and per telemetry role
/// ([`TELEMETRY_ROLES`](crate::nn::TELEMETRY_ROLES): those and the weight
/// gradient) the record of its last cast while telemetry recorded.
#[derive(Debug, Default, Clone)]
pub(crate) struct Casts {
    pub(crate) metas: [Option<ScalingMeta>; 3],
    pub(crate) records: [Option<Pending>; 4],
}

/// A layer's [`Casts`], shared with its pending backward ops.
pub(crate) type LastCasts = Arc<Mutex<Casts>>;

/// The slot of the weight gradient's record in [`Casts::records`].
pub(crate) const WEIGHT_GRAD_RECORD: usize = 3;

/// Keeps `q`'s record (cast from `source`) in slot `slot` of `casts` while
/// telemetry records; nothing otherwise.
pub(crate) fn record(
    casts: &LastCasts,
    slot: usize,
    q: &ScalingTensor,
    source: impl FnOnce() -> Result<Tensor>,
) -> Result<()> {
    if !telemetry_enabled() {
        return Ok(());
    }
    store(casts, slot, Pending::of(q, &source()?)?)
}

fn store(casts: &LastCasts, slot: usize, pending: Pending) -> Result<()> {
    casts
        .lock()
        .map_err(|_| Error::Poisoned { op: "telemetry" })?
        .records[slot] = Some(pending);
    Ok(())
}

/// Keeps the block-scaled `b`'s record (cast from `source`) in slot
/// `slot` of `casts` while telemetry records; nothing otherwise.
pub(crate) fn record_block(
    casts: &LastCasts,
    slot: usize,
    b: &BlockTensor,
    source: &Tensor,
) -> Result<()> {
    if !telemetry_enabled() {
        return Ok(());
    }
    store(casts, slot, Pending::of_block(b, source)?)
}

/// Current scaling by `r`, the scale_inv flagged by the amax with `flag`.
fn from_amax(r: &CurrentScaling, flag: bool) -> crate::numerics::scale::FromAmax {
    match flag {
        true => crate::numerics::scale::FromAmax::flagged(r),
        false => crate::numerics::scale::FromAmax::of(r),
    }
}

/// What a cast reads: a tensor, or a scaling tensor's value (a weight
/// stored in FP16, cast from its codes without an F32 copy where the
/// cast-transpose takes it).
#[derive(Clone, Copy)]
pub(crate) enum Source<'a> {
    Tensor(&'a Tensor),
    Scaled(&'a ScalingTensor),
    /// A tensor and its amax, taken by a pass that read it for another
    /// reason (the bias gradient's column sums): current scaling casts
    /// without an amax pass of their own; delayed scaling ignores it.
    Measured(&'a Tensor, &'a Tensor),
}

impl Source<'_> {
    fn device(&self) -> &candle_core::Device {
        match self {
            Self::Tensor(t) | Self::Measured(t, _) => t.device(),
            Self::Scaled(t) => t.device(),
        }
    }

    /// The value as a plain tensor (the casts without an in-place path).
    fn tensor(&self) -> Result<Tensor> {
        match self {
            Self::Tensor(t) | Self::Measured(t, _) => Ok((*t).clone()),
            Self::Scaled(t) => t.dequantize(candle_core::DType::F32),
        }
    }

    /// The cast, current scaling by `r`; with `flag`, its scale_inv
    /// carries the non-finite flag (flag.rs), written by the cast itself
    /// (a tensor's cast; a scaled weight's is not flagged).
    fn quantize(&self, qtype: QType, r: &CurrentScaling, flag: bool) -> Result<ScalingTensor> {
        let from = from_amax(r, flag);
        Ok(match self {
            Self::Measured(t, amax) => {
                ScalingTensor::quantize_from_amax_as(t, qtype, from, (*amax).clone())?.0
            }
            Self::Tensor(t) => {
                let amax = crate::numerics::cast::amax(t)?;
                ScalingTensor::quantize_from_amax_as(t, qtype, from, amax)?.0
            }
            Self::Scaled(_) => ScalingTensor::quantize(&self.tensor()?, qtype, r)?.0,
        })
    }

    /// The cast and its transpose, current scaling by `r`; `flag` as in
    /// [`quantize`](Self::quantize).
    fn quantize_t(
        &self,
        qtype: QType,
        r: &CurrentScaling,
        flag: bool,
    ) -> Result<(ScalingTensor, ScalingTensor)> {
        let from = from_amax(r, flag);
        let (q, qt, _) = match self {
            Self::Tensor(t) => ScalingTensor::quantize_t_as(t, qtype, from, None)?,
            Self::Measured(t, amax) => {
                ScalingTensor::quantize_t_as(t, qtype, from, Some((*amax).clone()))?
            }
            Self::Scaled(w) => w.requantize_t(qtype, r)?,
        };
        Ok((q, qt))
    }

    /// The cast and its transpose with `meta`'s scale.
    fn quantize_with_t(&self, meta: &ScalingMeta) -> Result<(ScalingTensor, ScalingTensor)> {
        let (q, qt, _) = match self {
            Self::Tensor(t) | Self::Measured(t, _) => ScalingTensor::quantize_with_t(t, meta)?,
            Self::Scaled(w) => w.requantize_with_t(meta)?,
        };
        Ok((q, qt))
    }
}

/// Casts `x` to FP8 for `role` at `step`, and with `transpose` also returns
/// its codes transposed (one pass on CUDA: the K-major operand of dgrad or
/// wgrad). Delayed scaling: the first cast of a role in a new step first
/// rolls its history and takes the next scale (amaxes up to the previous
/// step), or with `calibrate_first_step`, at the role's first step ever,
/// takes it from this cast's own amax; every cast records its amax and
/// counts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cast(
    x: Source<'_>,
    format: Fp8Format,
    scaling: &Scaling,
    state: &SharedScaling,
    role: Role,
    step: u64,
    casts: &LastCasts,
    transpose: bool,
) -> Result<(ScalingTensor, Option<ScalingTensor>)> {
    let cast = cast_scaled(x, format, scaling, state, role, step, transpose)?;
    noted(x, role, casts, cast)
}

/// A cast of `x` for `role` made elsewhere (the weights' casts made ahead,
/// ahead.rs) noted as [`cast`] notes its own: the layer's last metadata of
/// the role and the telemetry's record.
pub(crate) fn noted(
    x: Source<'_>,
    role: Role,
    casts: &LastCasts,
    (q, qt): (ScalingTensor, Option<ScalingTensor>),
) -> Result<(ScalingTensor, Option<ScalingTensor>)> {
    casts
        .lock()
        .map_err(|_| Error::Poisoned {
            op: "fp8 linear cast",
        })?
        .metas[role as usize] = Some(q.meta().clone());
    record(casts, role as usize, &q, || x.tensor())?;
    Ok((q, qt))
}

fn cast_scaled(
    x: Source<'_>,
    format: Fp8Format,
    scaling: &Scaling,
    state: &SharedScaling,
    role: Role,
    step: u64,
    transpose: bool,
) -> Result<(ScalingTensor, Option<ScalingTensor>)> {
    let quantize_with = |meta: &ScalingMeta| -> Result<(ScalingTensor, Option<ScalingTensor>)> {
        Ok(if transpose {
            let (q, qt) = x.quantize_with_t(meta)?;
            (q, Some(qt))
        } else {
            (ScalingTensor::quantize_with(&x.tensor()?, meta)?.0, None)
        })
    };
    // the input's and the output gradient's casts carry the FP8 GEMMs'
    // non-finite flag in their scale_inv (flag.rs) from the cast kernel
    let flag = !matches!(role, Role::Weight);
    match scaling {
        Scaling::Current(r) if transpose => {
            let (q, qt) = x.quantize_t(format.into(), r, flag)?;
            Ok((q, Some(qt)))
        }
        Scaling::Current(r) => Ok((x.quantize(format.into(), r, flag)?, None)),
        Scaling::Delayed(recipe) => {
            let mut guard = state.lock().map_err(|_| Error::Poisoned {
                op: "fp8 linear cast",
            })?;
            if guard.as_ref().is_none_or(|s| &s.recipe != recipe) {
                *guard = Some(LayerScaling::new(recipe, x.device())?);
            }
            let Some(s) = guard.as_mut() else {
                return Err(Error::Poisoned {
                    op: "fp8 linear cast",
                });
            };
            let slot = role as usize;
            if s.last_step[slot] != step {
                let recipe = s.recipe.clone();
                if s.last_step[slot] != 0 {
                    s.meta_mut(role).update_delayed(&recipe)?;
                } else if recipe.calibrate_first_step {
                    // no history yet: the scale from this cast's own amax
                    let amax = crate::numerics::cast::amax(&x.tensor()?)?;
                    let meta = s.meta_mut(role);
                    meta.record_amax(&amax)?;
                    meta.update_delayed(&recipe)?;
                }
                s.last_step[slot] = step;
            }
            let meta = s.meta_mut(role);
            let (q, qt) = quantize_with(meta)?;
            meta.record_cast(q.meta())?;
            Ok((q, qt))
        }
    }
}
