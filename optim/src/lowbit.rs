//! `LowBitAdamW` (MS-AMP's LBAdamW): AdamW whose moments are stored in scaled
//! low-bit formats and whose weights may be F32, scaled FP16 (the master at
//! O1/O2) or FP8 with a scaled FP16 master (O3).

use crate::adamw::AdamWConfig;
use crate::error::{kernel_error, Error, Result};
use crate::grad::{Grad, Grads};
use crate::loss_scaler::{LossScaler, LossScaling};
use crate::schedule::{Constant, LrSchedule};
use crate::state::{State, StateFormat};
use crate::telemetry::MomentRecord;
use amp_core::GradSink;
use amp_core::{Weight, WeightSlot};
use candle_core::{backprop::GradStore, Tensor};

/// Configuration of [`LowBitAdamW`]. Defaults: PyTorch AdamW, first moment
/// E4M3 and second moment FP16 (MS-AMP), no clipping, no loss scaling.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LowBitAdamWConfig {
    /// AdamW hyperparameters.
    pub adam: AdamWConfig,
    /// Storage of the first moment (`exp_avg`).
    pub exp_avg: StateFormat,
    /// Storage of the second moment (`exp_avg_sq`).
    pub exp_avg_sq: StateFormat,
    /// Clip the global gradient norm (over every parameter) to this value.
    pub max_grad_norm: Option<f64>,
    /// Loss scaling.
    pub loss_scaling: LossScaling,
    /// On a GPU, wait for the step's outcome (whether every gradient is
    /// finite) before enqueueing the updates, instead of after: each
    /// parameter's old weight and moments are then freed as its update is
    /// enqueued, where otherwise all of them are kept until the outcome is
    /// read (a skipped step puts them back). The step's memory beyond the
    /// states falls from the level's state bytes per parameter to one
    /// parameter's, for one wait of the host on the device per step. The
    /// same values either way. Off by default.
    pub lean_step: bool,
    /// On a GPU, leave the step's outcome on the device: the updates are
    /// enqueued behind the skip decision (a skipped step's kernels return
    /// at once and one more launch puts the replaced states back, bit for
    /// bit), and the step returns [`StepOutcome::Pending`] without waiting
    /// for the device, so the host goes on to queue the next forward while
    /// the device finishes this step. The host learns the outcome at the
    /// next step, or at [`LowBitAdamW::resolve`]; until then
    /// [`step_count`](LowBitAdamW::step_count), the parameters' `step` and
    /// the loss scaler count the pending step as applied. The same values
    /// as without it. Not taken (the step waits as before) with dynamic
    /// loss scaling (the next backward needs the scale the outcome sets),
    /// with `lean_step`, on the CPU, or where a weight is not updated by the
    /// kernels' own outputs or in place. Off by default.
    pub defer_outcome: bool,
}

impl Default for LowBitAdamWConfig {
    fn default() -> Self {
        Self {
            adam: AdamWConfig::default(),
            exp_avg: StateFormat::E4M3,
            exp_avg_sq: StateFormat::F16,
            max_grad_norm: None,
            loss_scaling: LossScaling::None,
            lean_step: false,
            defer_outcome: false,
        }
    }
}

/// One parameter with its moments.
#[derive(Debug, Clone)]
pub struct ParamState {
    /// Its name (unique).
    pub name: String,
    /// Its storage, shared with the layer that reads it.
    pub slot: WeightSlot,
    /// First moment.
    pub exp_avg: State,
    /// Second moment.
    pub exp_avg_sq: State,
    /// Updates applied to this parameter (PyTorch's per-parameter `step`:
    /// the bias correction's exponent; a parameter without a gradient in a
    /// step does not advance).
    pub step: u64,
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// The update was applied; the global gradient norm (after unscaling,
    /// before clipping).
    Applied {
        /// The norm.
        grad_norm: f64,
    },
    /// A gradient held inf or NaN: nothing changed but the loss scaler,
    /// which backed off.
    Skipped,
    /// The outcome is still on the device
    /// ([`LowBitAdamWConfig::defer_outcome`]): the next step, or
    /// [`LowBitAdamW::resolve`], reads it and returns it as `Applied` or
    /// `Skipped`.
    Pending,
}

/// A step whose outcome the host has not read yet (`defer_outcome`): what
/// to take back if it was skipped.
#[derive(Debug)]
pub(crate) struct PendingStep {
    /// The parameters it stepped (their `step` advanced).
    pub updated: Vec<usize>,
    /// The moments' telemetry records before it.
    pub records_before: usize,
}

/// AdamW with low-bit moments over parameters of any [`Weight`] storage.
#[derive(Debug)]
pub struct LowBitAdamW {
    pub(crate) params: Vec<ParamState>,
    pub(crate) config: LowBitAdamWConfig,
    pub(crate) schedule: Box<dyn LrSchedule>,
    pub(crate) scaler: LossScaler,
    pub(crate) step: u64,
    /// Steps skipped so far (a non-finite gradient).
    pub(crate) skipped: u64,
    pub(crate) scratch: std::sync::Mutex<Vec<f32>>,
    /// The moments' telemetry of the steps taken while it recorded.
    pub(crate) moment_records: Vec<MomentRecord>,
    /// The step's outcome on its way to the host (GPU path).
    pub(crate) outcome_read: amp_core::HostReadback,
    /// The last step, while its outcome is on its way (`defer_outcome`).
    pub(crate) pending: Option<PendingStep>,
}

impl LowBitAdamW {
    /// An optimizer over named weight slots; moments start at zero.
    ///
    /// # Errors
    /// [`Error::Config`] for bad hyperparameters, [`Error::DuplicateName`].
    pub fn new(params: Vec<(String, WeightSlot)>, config: LowBitAdamWConfig) -> Result<Self> {
        let (m, v) = (config.exp_avg, config.exp_avg_sq);
        Self::with_formats(
            params.into_iter().map(|(n, s)| (n, s, m, v)).collect(),
            config,
        )
    }

    /// As [`new`](Self::new), with each parameter's moment formats given
    /// (`exp_avg`, `exp_avg_sq`) instead of the config's.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_formats(
        params: Vec<(String, WeightSlot, StateFormat, StateFormat)>,
        config: LowBitAdamWConfig,
    ) -> Result<Self> {
        config.adam.validate()?;
        config.loss_scaling.validate()?;
        if let Some(n) = config.max_grad_norm {
            if !(n > 0.0 && n.is_finite()) {
                return Err(Error::Config {
                    field: "max_grad_norm",
                    reason: "must be finite and > 0".into(),
                });
            }
        }
        let mut states = Vec::with_capacity(params.len());
        for (name, slot, m_format, v_format) in params {
            if states.iter().any(|p: &ParamState| p.name == name) {
                return Err(Error::DuplicateName(name));
            }
            let (shape, device) = {
                let w = slot.read()?;
                let t = w.master_f32()?;
                (t.shape().clone(), t.device().clone())
            };
            states.push(ParamState {
                name,
                slot,
                exp_avg: State::zeros(m_format, &shape, &device)?,
                exp_avg_sq: State::zeros(v_format, &shape, &device)?,
                step: 0,
            });
        }
        Ok(Self {
            params: states,
            schedule: Box::new(Constant(config.adam.lr)),
            scaler: LossScaler::new(config.loss_scaling),
            config,
            step: 0,
            skipped: 0,
            scratch: std::sync::Mutex::new(Vec::new()),
            moment_records: Vec::new(),
            outcome_read: amp_core::HostReadback::default(),
            pending: None,
        })
    }

    /// An optimizer over every variable of a `VarMap`, as F32 weights, named
    /// as in the map.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn from_varmap(varmap: &candle_nn::VarMap, config: LowBitAdamWConfig) -> Result<Self> {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| amp_core::Error::Poisoned { op: "from_varmap" })?;
        let mut params: Vec<_> = data
            .iter()
            .map(|(name, var)| (name.clone(), WeightSlot::new(Weight::F32(var.clone()))))
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        drop(data);
        Self::new(params, config)
    }

    /// Replaces the learning-rate schedule (default: constant `adam.lr`).
    pub fn set_schedule(&mut self, schedule: impl LrSchedule + 'static) {
        self.schedule = Box::new(schedule);
    }

    /// [`set_schedule`](Self::set_schedule), by value.
    pub fn with_schedule(mut self, schedule: impl LrSchedule + 'static) -> Self {
        self.schedule = Box::new(schedule);
        self
    }

    /// The moments' records of the steps taken while telemetry recorded
    /// (`amp_core::set_telemetry`: each new low-bit moment measured
    /// against its F32 value, see [`MomentRecord`]), oldest first; taking
    /// them empties the list. Skipped steps leave none (a
    /// [pending](StepOutcome::Pending) step's records are in it until
    /// [`resolve`](Self::resolve) has left out a skipped one's).
    pub fn take_moment_telemetry(&mut self) -> Vec<MomentRecord> {
        std::mem::take(&mut self.moment_records)
    }

    /// The parameters with their moments (for checkpoints and reports).
    pub fn params(&self) -> &[ParamState] {
        &self.params
    }

    /// Steps applied so far (skipped steps do not count; a
    /// [pending](StepOutcome::Pending) one counts until it is resolved).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Steps skipped so far (a non-finite gradient: nothing changed but
    /// the loss scaler). Applied plus skipped steps count the batches a
    /// training loop has consumed, which is where a resumed run goes on.
    pub fn skipped_count(&self) -> u64 {
        self.skipped
    }

    /// Restores the skipped-step counter (checkpoints). A
    /// [pending](StepOutcome::Pending) step is forgotten: the state it
    /// would settle is being replaced.
    pub fn restore_skipped(&mut self, skipped: u64) {
        self.pending = None;
        self.skipped = skipped;
    }

    /// Whether the last step's outcome is still on the device
    /// ([`StepOutcome::Pending`]).
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Reads the outcome of a [pending](StepOutcome::Pending) step (one
    /// wait for the device, where it has not reached the step's skip
    /// decision yet) and settles what depends on it: a skipped step is
    /// taken back from the counters (its states were put back on the
    /// device) and the loss scaler backs off. `None` without a pending
    /// step. Every step calls it first.
    ///
    /// # Errors
    /// The read's.
    pub fn resolve(&mut self) -> Result<Option<StepOutcome>> {
        let Some(pending) = self.pending.take() else {
            return Ok(None);
        };
        let [sum_sq, grad_norm] = <[f64; 2]>::try_from(self.outcome_read.wait()?)
            .map_err(|_| kernel_error("clipping outcome"))?;
        if sum_sq.is_finite() {
            self.scaler.update(false);
            return Ok(Some(StepOutcome::Applied { grad_norm }));
        }
        self.step -= 1;
        for i in pending.updated {
            self.params[i].step -= 1;
        }
        self.moment_records.truncate(pending.records_before);
        self.scaler.update(true);
        self.skipped += 1;
        Ok(Some(StepOutcome::Skipped))
    }

    /// The loss scaler.
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// The configuration.
    pub fn config(&self) -> &LowBitAdamWConfig {
        &self.config
    }

    /// The learning rate of the next step: the schedule at the next batch
    /// (applied and skipped steps so far, plus one).
    pub fn learning_rate(&self) -> f64 {
        self.schedule.lr(self.step + self.skipped + 1)
    }

    /// Restores the step counter and loss scaler (checkpoints). A
    /// [pending](StepOutcome::Pending) step is forgotten: the counters it
    /// would settle are being replaced.
    pub fn restore_counters(&mut self, step: u64, scaler: LossScaler) {
        self.pending = None;
        self.step = step;
        self.scaler = scaler;
    }

    /// Mutable access to the moments (checkpoints).
    pub fn params_mut(&mut self) -> &mut [ParamState] {
        &mut self.params
    }

    /// The F32 gradients of the `Var`-stored parameters in a `GradStore`.
    ///
    /// # Errors
    /// [`Error::Core`] on a poisoned slot.
    pub fn grads_from_store(&self, store: &GradStore) -> Result<Grads> {
        let mut grads = Grads::new();
        for p in &self.params {
            if let Weight::F32(var) = &*p.slot.read()? {
                if let Some(g) = store.get(var.as_tensor()) {
                    grads.insert(p.name.clone(), Grad::F32(g.clone()));
                }
            }
        }
        Ok(grads)
    }

    /// Runs backward on the loss times the loss scale and gathers the
    /// gradients: F32 ones of `Var` parameters from candle's `GradStore`
    /// (the layers' own ops hand theirs over outside it,
    /// `amp_core::collect_param_grads`),
    /// FP8 ones from `sink` (taken after backward has filled it); two for
    /// one name are summed.
    ///
    /// # Errors
    /// candle's; [`Error::Core`] on a poisoned slot or sink.
    pub fn backward(&self, loss: &Tensor, sink: Option<&GradSink>) -> Result<Grads> {
        let scaled = if self.scaler.scale == 1.0 {
            loss.clone()
        } else {
            (loss * self.scaler.scale)?
        };
        // the layers' parameter gradients handed over outside candle's
        // GradStore (no zero fill and add each), then put into it
        let (store, params) = amp_core::collect_param_grads(|| scaled.backward());
        let mut store = store?;
        params.insert_into(&mut store)?;
        let mut grads = self.grads_from_store(&store)?;
        if let Some(sink) = sink {
            for (name, g) in sink.take()? {
                grads.merge(name, Grad::Scaled(g))?;
            }
        }
        Ok(grads)
    }

    /// [`backward`](Self::backward) then [`step`](Self::step).
    ///
    /// # Errors
    /// As both.
    pub fn backward_step_with(
        &mut self,
        loss: &Tensor,
        sink: Option<&GradSink>,
    ) -> Result<StepOutcome> {
        let grads = self.backward(loss, sink)?;
        self.step_owned(grads)
    }

    /// [`backward_step_with`](Self::backward_step_with) without a sink.
    ///
    /// # Errors
    /// As [`step`](Self::step).
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<StepOutcome> {
        self.backward_step_with(loss, None)
    }
}
