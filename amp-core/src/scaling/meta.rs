//! `ScalingMeta`: a tensor's scale, scale_inv and amax history, on its device.

use crate::error::{Error, Result};
use crate::numerics::kernel::arity;
use crate::numerics::kernel::{launch, scalar, slice, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::recipe::{AmaxComputeAlgo, DelayedScaling};
use crate::numerics::scale::ScaleRule;
use candle_core::{CpuStorage, CudaStorage, DType, Device, Layout, Shape, Tensor};

/// Scaling metadata of one tensor (TE's `fp8_meta` entry, MS-AMP's `ScalingMeta`).
///
/// `scale`, `scale_inv` and the amax history are F32 tensors on the data's
/// device, so a training step reads and updates them without a host copy.
/// The scale is a tensor, not a scalar, so that block scaling can later give
/// it more than one element.
///
/// The history is a ring in Transformer Engine's order: slot 0 collects the
/// amax of the current step ([`record_amax`](Self::record_amax)); an update
/// ([`update_scale`](Self::update_scale)) reduces the history to one amax,
/// rotates it by -1 (slot 0 moves to the end) and zeroes slot 0, then derives
/// the next scale. So the scale used at step t comes from amaxes up to t-1.
#[derive(Debug, Clone)]
pub struct ScalingMeta {
    qtype: QType,
    scale: Tensor,
    scale_inv: Tensor,
    amax_history: Tensor,
    updates: u64,
    last_cast: Option<Tensor>,
    /// Whether `scale_inv` already carries the cast's non-finite flag
    /// (`scaling/flag.rs`): written so by the cast kernel itself.
    flagged: bool,
}

impl ScalingMeta {
    /// Scale 1, an all-zero amax history of `amax_history_len` slots.
    ///
    /// # Errors
    /// [`Error::Config`] when `amax_history_len` is 0 or above
    /// [`MAX_AMAX_HISTORY_LEN`](crate::numerics::recipe::MAX_AMAX_HISTORY_LEN).
    pub fn new(qtype: QType, amax_history_len: usize, device: &Device) -> Result<Self> {
        crate::numerics::recipe::check_history_len(amax_history_len)?;
        Ok(Self {
            qtype,
            scale: Tensor::ones(1, DType::F32, device)?,
            scale_inv: Tensor::ones(1, DType::F32, device)?,
            amax_history: Tensor::zeros(amax_history_len, DType::F32, device)?,
            updates: 0,
            last_cast: None,
            flagged: false,
        })
    }

    /// The same metadata with `scale` (and `scale_inv = 1 / scale`) set from the host.
    ///
    /// # Errors
    /// [`Error::BadScale`] unless `scale` is finite and positive.
    pub fn with_scale(mut self, scale: f32) -> Result<Self> {
        crate::numerics::scale::check_scale("ScalingMeta::with_scale", scale)?;
        let device = self.scale.device().clone();
        self.scale = Tensor::new(&[scale], &device)?;
        self.scale_inv = Tensor::new(&[1.0 / scale], &device)?;
        Ok(self)
    }

    /// Metadata from its parts (for checkpoints): F32 tensors on one device,
    /// `scale` and `scale_inv` of one element, a non-empty 1-D history.
    ///
    /// # Errors
    /// [`Error::DType`], [`Error::Shape`] or [`Error::Device`] naming the part.
    pub fn from_parts(
        qtype: QType,
        scale: Tensor,
        scale_inv: Tensor,
        amax_history: Tensor,
    ) -> Result<Self> {
        const OP: &str = "ScalingMeta::from_parts";
        for t in [&scale, &scale_inv, &amax_history] {
            if t.dtype() != DType::F32 {
                return Err(Error::DType {
                    op: OP,
                    expected: "F32",
                    got: t.dtype(),
                });
            }
            if !t.device().same_device(scale.device()) {
                return Err(Error::Device {
                    op: OP,
                    lhs: scale.device().location(),
                    rhs: t.device().location(),
                });
            }
        }
        for t in [&scale, &scale_inv] {
            if t.dims() != [1] {
                return Err(Error::Shape {
                    op: OP,
                    lhs: Shape::from(1usize),
                    rhs: t.shape().clone(),
                });
            }
        }
        if amax_history.rank() != 1 || amax_history.elem_count() == 0 {
            return Err(Error::Rank {
                op: OP,
                expected: 1,
                got: amax_history.shape().clone(),
            });
        }
        Ok(Self {
            qtype,
            scale,
            scale_inv,
            amax_history,
            updates: 0,
            last_cast: None,
            flagged: false,
        })
    }

    /// The storage type this metadata scales for.
    pub fn qtype(&self) -> QType {
        self.qtype
    }

    /// The scale (F32, one element).
    pub fn scale(&self) -> &Tensor {
        &self.scale
    }

    /// `1 / scale` (F32, one element).
    pub fn scale_inv(&self) -> &Tensor {
        &self.scale_inv
    }

    /// The amax history; slot 0 is the current step's.
    pub fn amax_history(&self) -> &Tensor {
        &self.amax_history
    }

    /// The current step's amax (slot 0 of the history).
    ///
    /// # Errors
    /// Only candle's, on a corrupt tensor.
    pub fn amax(&self) -> Result<Tensor> {
        Ok(self.amax_history.narrow(0, 0, 1)?)
    }

    /// How many updates ([`update_scale`](Self::update_scale) or
    /// [`update_delayed`](Self::update_delayed)) have run; the phase of
    /// `interval` counts them all, so keep one kind of update per meta.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The same metadata with the counts `[saturated, flushed]` (I64, on the
    /// device) of the cast it describes.
    pub(crate) fn with_last_cast(mut self, counts: Option<Tensor>) -> Self {
        self.last_cast = counts;
        self
    }

    /// The counts `[saturated, flushed]` of the cast it describes, where
    /// they were made.
    pub(crate) fn last_cast_counts(&self) -> Option<Tensor> {
        self.last_cast.clone()
    }

    /// The same metadata, its scale_inv marked as carrying the cast's
    /// non-finite flag (the cast kernel multiplied it in).
    pub(crate) fn with_flag(mut self) -> Self {
        self.flagged = true;
        self
    }

    /// Whether the scale_inv carries the non-finite flag already.
    pub(crate) fn flagged(&self) -> bool {
        self.flagged
    }

    /// Folds the amax of a cast made with this metadata into slot 0 (as
    /// [`record_amax`](Self::record_amax)) and keeps that cast's saturated
    /// and flushed counts as this metadata's last cast.
    ///
    /// # Errors
    /// As [`record_amax`](Self::record_amax).
    pub fn record_cast(&mut self, cast: &ScalingMeta) -> Result<()> {
        self.record_amax(&cast.amax()?)?;
        self.last_cast.clone_from(&cast.last_cast);
        Ok(())
    }

    /// How many elements the last recorded cast saturated and flushed to
    /// zero (a host read: telemetry, not for the training step). `None`
    /// before any cast, and for a cast that did not count (casts count
    /// while their thread asked, [`set_cast_counts`](crate::set_cast_counts),
    /// or records telemetry). `total` is left 0: the counts come from the
    /// device.
    ///
    /// # Errors
    /// Only candle's.
    pub fn last_cast_stats(&self) -> Result<Option<crate::numerics::cast::CastStats>> {
        let Some(counts) = &self.last_cast else {
            return Ok(None);
        };
        match counts.to_vec1::<i64>()?.as_slice() {
            [saturated, flushed] => Ok(Some(crate::numerics::cast::CastStats {
                saturated: *saturated as u64,
                flushed: *flushed as u64,
                total: 0,
            })),
            _ => Err(Error::Shape {
                op: "last_cast_stats",
                lhs: Shape::from(2usize),
                rhs: counts.shape().clone(),
            }),
        }
    }

    /// The same metadata with its update counter set (checkpoints: the phase
    /// of `interval`).
    pub fn with_updates(mut self, updates: u64) -> Self {
        self.updates = updates;
        self
    }

    /// Bytes held: scale, scale_inv and history.
    pub fn nbytes(&self) -> usize {
        4 * (self.scale.elem_count() + self.scale_inv.elem_count() + self.amax_history.elem_count())
    }

    /// Folds `amax` (a 1-element F32 tensor) into slot 0: the max of both,
    /// NaN if either is NaN. Several casts in one step (micro-batches) keep
    /// the largest.
    ///
    /// # Errors
    /// [`Error::Shape`] unless `amax` has one element; [`Error::Device`].
    pub fn record_amax(&mut self, amax: &Tensor) -> Result<()> {
        let [history] = <[Tensor; 1]>::try_from(launch(&RecordAmax, &[&self.amax_history, amax])?)
            .map_err(|_| arity(RecordAmax::NAME))?;
        self.amax_history = history;
        Ok(())
    }

    /// Reduces the history to one amax by `algo`, rotates it (TE order) and
    /// sets the scale from that amax by `rule` with `margin`; where the amax
    /// is 0, inf or NaN the previous scale stays.
    ///
    /// # Errors
    /// Only candle's, on a corrupt tensor.
    pub fn update_scale(
        &mut self,
        rule: ScaleRule,
        algo: AmaxComputeAlgo,
        margin: u32,
    ) -> Result<()> {
        self.update(ScaleUpdate {
            rule,
            algo,
            margin,
            max: self.qtype.max(),
            set_scale: true,
        })
    }

    /// One step of Transformer Engine's delayed scaling: the history rotates
    /// every call, the scale (TE rule) is recomputed every `recipe.interval`
    /// calls, starting with the first.
    ///
    /// # Errors
    /// Only candle's, on a corrupt tensor.
    pub fn update_delayed(&mut self, recipe: &DelayedScaling) -> Result<()> {
        let set_scale = self.updates % u64::from(recipe.interval.max(1)) == 0;
        self.update(ScaleUpdate {
            rule: ScaleRule::Te,
            algo: recipe.amax_compute_algo,
            margin: recipe.margin,
            max: self.qtype.max(),
            set_scale,
        })
    }

    /// Current scaling's metadata for an amax just taken: the same scale and
    /// scale_inv as [`new`](Self::new) with one slot, then
    /// [`record_amax`](Self::record_amax) and
    /// [`update_scale`](Self::update_scale) with `MostRecent` (previous
    /// scale 1; a 0 or non-finite amax keeps it), in one launch instead of
    /// three fills and two launches (each cast of current scaling made
    /// them; 418 per GPT-125M step).
    ///
    /// ```
    /// use amp_core::{QType, ScaleRule, ScalingMeta};
    /// use candle_core::{Device, Tensor};
    /// let amax = Tensor::new(&[96.0f32], &Device::Cpu)?;
    /// let m = ScalingMeta::for_current_amax(QType::E4M3, &amax, ScaleRule::PowerOfTwo, 0)?;
    /// assert_eq!(m.scale().to_vec1::<f32>()?, [4.0]); // 2^floor(log2(448 / 96))
    /// # Ok::<(), amp_core::Error>(())
    /// ```
    ///
    /// # Errors
    /// Only candle's, on a corrupt tensor.
    pub fn for_current_amax(
        qtype: QType,
        amax: &Tensor,
        rule: ScaleRule,
        margin: u32,
    ) -> Result<Self> {
        let op = ScaleUpdate {
            rule,
            algo: AmaxComputeAlgo::MostRecent,
            margin,
            max: qtype.max(),
            set_scale: true,
        };
        let [amax_history, scale, scale_inv] =
            <[Tensor; 3]>::try_from(launch(&op, &[&amax.flatten_all()?])?)
                .map_err(|_| arity(ScaleUpdate::NAME))?;
        Ok(Self {
            qtype,
            scale,
            scale_inv,
            amax_history,
            updates: 1,
            last_cast: None,
            flagged: false,
        })
    }

    fn update(&mut self, op: ScaleUpdate) -> Result<()> {
        let out = launch(&op, &[&self.amax_history, &self.scale])?;
        let [history, scale, scale_inv] =
            <[Tensor; 3]>::try_from(out).map_err(|_| arity(ScaleUpdate::NAME))?;
        if op.set_scale {
            self.scale = scale;
            self.scale_inv = scale_inv;
        }
        self.amax_history = history;
        self.updates += 1;
        Ok(())
    }
}

/// history, amax -> history with slot 0 = max(slot 0, amax), NaN-propagating.
struct RecordAmax;

impl Kernel for RecordAmax {
    const NAME: &'static str = "record_amax";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(h, lh), (a, la)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let amax = scalar(Self::NAME, a, la)?;
        let mut history = slice::<f32>(Self::NAME, h, lh)?.to_vec();
        if let Some(slot) = history.first_mut() {
            *slot = if slot.is_nan() || amax.is_nan() {
                f32::NAN
            } else {
                slot.max(amax)
            };
        }
        Ok(vec![(CpuStorage::F32(history), lh.shape().clone())])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::record_amax(inputs)
    }
}

/// history, scale -> rotated history, new scale, new scale_inv. Without the
/// scale input the previous scale is 1.
struct ScaleUpdate {
    rule: ScaleRule,
    algo: AmaxComputeAlgo,
    margin: u32,
    max: f32,
    set_scale: bool,
}

impl Kernel for ScaleUpdate {
    const NAME: &'static str = "scale_update";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let (h, lh, prev) = match inputs {
            [(h, lh), (s, ls)] => (h, lh, scalar(Self::NAME, s, ls)?),
            [(h, lh)] => (h, lh, 1.0),
            _ => return Err(arity(Self::NAME)),
        };
        let history = slice::<f32>(Self::NAME, h, lh)?;
        let amax = match self.algo {
            AmaxComputeAlgo::Max => history.iter().fold(0f32, |m, &a| {
                if m.is_nan() || a.is_nan() {
                    f32::NAN
                } else {
                    m.max(a)
                }
            }),
            AmaxComputeAlgo::MostRecent => history.first().copied().unwrap_or(0.0),
        };
        let mut rolled = history.to_vec();
        rolled.rotate_left(1);
        if let Some(slot) = rolled.first_mut() {
            *slot = 0.0;
        }
        let scale = self.rule.compute(amax, prev, self.max, self.margin);
        let one = |v: f32| (CpuStorage::F32(vec![v]), Shape::from(1usize));
        Ok(vec![
            (CpuStorage::F32(rolled), lh.shape().clone()),
            one(scale),
            one(1.0 / scale),
        ])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::scale_update(self.rule, self.algo, self.margin, self.max, inputs)
    }
}

#[cfg(test)]
mod tests {
    // Current scaling's scale, computed inside the cast kernel (quantize) and
    // by `ScalingMeta::for_current_amax` (requantize), against the
    // three-step path it replaces (record the amax, update the scale).
    use super::*;

    #[test]
    fn current_amax_meta_equals_new_record_update() -> Result<()> {
        let dev = Device::Cpu;
        let amaxes = [
            0.0f32,
            1e-40,
            1e-3,
            0.75,
            448.0,
            3.0e5,
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
        ];
        for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
            for rule in [ScaleRule::Te, ScaleRule::PowerOfTwo] {
                for margin in [0, 2] {
                    for a in amaxes {
                        let amax = Tensor::new(&[a], &dev)?;
                        let recipe = crate::numerics::recipe::CurrentScaling {
                            scale_rule: rule,
                            margin,
                            ..Default::default()
                        };
                        let mut old = ScalingMeta::new(qtype, 1, &dev)?;
                        old.record_amax(&amax)?;
                        old.update_scale(rule, AmaxComputeAlgo::MostRecent, margin)?;
                        let (q, _) =
                            crate::scaling::tensor::ScalingTensor::quantize(&amax, qtype, &recipe)?;
                        let new = q.meta();
                        let req = ScalingMeta::for_current_amax(qtype, &amax, rule, margin)?;
                        let bits = |t: &Tensor| -> Result<Vec<u32>> {
                            Ok(t.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
                        };
                        assert_eq!(bits(new.scale())?, bits(old.scale())?, "{qtype:?} {a}");
                        assert_eq!(bits(new.scale_inv())?, bits(old.scale_inv())?);
                        assert_eq!(bits(req.scale())?, bits(old.scale())?, "{qtype:?} {a}");
                        assert_eq!(bits(req.scale_inv())?, bits(old.scale_inv())?);
                        assert_eq!(req.updates, old.updates);
                    }
                }
            }
        }
        Ok(())
    }
}
