//! The context of a model trained at a level: [`initialize`] converts a
//! model's parameters to the level's storages and builds the optimizer;
//! [`AmpContext`] opens the compute scope for forward passes (and for
//! evaluation that leaves the training state as it was);
//! [`AmpOptimizer::backward_step`] runs a training step.
//!
//! Data parallelism is not this module's: the optimizer step calls a
//! [`DataParallel`] hook, which the `distributed` module implements and
//! installs through [`initialize_with`] (docs/ARCHITECTURE.md, "Data
//! parallelism"). This module imports none above it: the checkpoint module
//! (`save`, `load`, `export`) and the memory report (`memory_report`) add
//! their methods to [`AmpContext`], each beside its concept.

use crate::comm_stats::CommStats;
use crate::config::AmpConfig;
use crate::error::{Error, Result};
use crate::level::{GradStorage, Level, WeightStorage};
use amp_core::nn::{fp8_autocast, registered_linear, Fp8Autocast, GradSink, Linear};
use amp_core::{CurrentScaling, QType, ScalingTensor, StreamMark, Weight, WeightSlot};
use amp_optim::{
    AdamWConfig, Grad, Grads, LowBitAdamW, LowBitAdamWConfig, StateFormat, StepOutcome,
};
use candle_core::Tensor;

/// A gradient's name, data bytes and metadata bytes.
pub(crate) type GradBytes = (String, usize, usize);

/// What a data-parallel group does inside [`initialize_with`] and the
/// optimizer step; the `distributed` module implements it (this module
/// knows no communicator).
pub(crate) trait DataParallel: std::fmt::Debug {
    /// This rank and the number of ranks.
    fn rank_and_world(&self) -> (usize, usize);

    /// At a level that keeps an FP8 copy and an FP16 master of Linear
    /// weight `name` (F32 `value`, the layer's `slot`): the optimizer's slot
    /// holding this rank's slice of the master, the layer's slot then set
    /// to the whole FP8 copy; `None` (nothing changed) to store it whole.
    fn split_master(
        &mut self,
        name: &str,
        value: &Tensor,
        slot: &WeightSlot,
    ) -> Result<Option<WeightSlot>>;

    /// Runs `backward`, which fills the layers' gradient sink (and returns
    /// the step's gradients as the optimizer collects them), and may start
    /// averaging gradients while the sink receives them, taking them out of
    /// the sink (and their earlier micro-batches' part out of `pending`);
    /// [`average`](Self::average) then completes the step's averaging.
    /// Returns the gradients and, of those taken early, each one's name,
    /// data bytes and metadata bytes.
    fn backward(
        &self,
        pending: &mut Option<Grads>,
        backward: &mut dyn FnMut() -> Result<Grads>,
    ) -> Result<(Grads, Vec<GradBytes>)>;

    /// Runs the backward of a micro-batch before a step's last
    /// ([`AmpOptimizer::backward_accumulate`]): nothing is communicated,
    /// and the group may keep what it takes out of the gradients for the
    /// step's last backward (an embedding table's looked-up rows), named
    /// with their bytes as [`backward`](Self::backward) names what it took.
    fn backward_micro(
        &self,
        backward: &mut dyn FnMut() -> Result<Grads>,
    ) -> Result<(Grads, Vec<GradBytes>)>;

    /// The mean of every rank's gradients (of a weight this rank holds a
    /// slice of: only that slice), its buckets and bytes counted in `stats`.
    fn average(&self, grads: Grads, stats: &mut CommStats) -> Result<Grads>;

    /// Whether the optimizer holds only this rank's slice of `name`.
    fn holds_slice(&self, name: &str) -> bool;

    /// The squared gradient norm over all ranks, from this rank's part
    /// (one F32 on the device; the sum likewise, without a host read).
    fn total_sq(&self, part_sq: &Tensor) -> amp_optim::Result<Tensor>;

    /// After an applied step: what the ranks share again (the FP8 copies
    /// of the sliced weights).
    fn after_step(&self, opt: &LowBitAdamW, stats: &mut CommStats) -> Result<()>;

    /// Itself, for the implementing module to find its own type.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// What `initialize` set up: the config, the Linear layers that compute in
/// its path (those it converted, and those tied to a weight of another
/// name) and the sink their FP8 weight gradients go to.
#[derive(Debug)]
pub struct AmpContext {
    pub(crate) config: AmpConfig,
    pub(crate) linears: Vec<Linear>,
    pub(crate) linear_names: Vec<String>,
    /// Tied layers: (the layer's name, the name of the weight it shares).
    pub(crate) tied: Vec<(String, String)>,
    /// Data-parallel ranks (1 without a group).
    pub(crate) world: usize,
}

impl AmpContext {
    /// The configuration.
    pub fn config(&self) -> &AmpConfig {
        &self.config
    }

    /// The level.
    pub fn level(&self) -> Level {
        self.config.level
    }

    /// The Linear layers that compute in the config's path: those the level
    /// converted, and those tied to a weight of another name (an output
    /// head sharing the embedding), which keep their F32 weight. Layers
    /// kept in high precision are not among them.
    pub fn linears(&self) -> &[Linear] {
        &self.linears
    }

    /// The Linear layers built over a weight the `VarMap` knows under
    /// another name (a head tied to the embedding), as (layer, weight)
    /// names: kept F32 at every level. A layer here that was not meant to
    /// be tied was built with a name other than its weight's.
    pub fn tied(&self) -> &[(String, String)] {
        &self.tied
    }

    /// Opens the config's compute scope for one step's forward (and the
    /// backward that follows): `let _fp8 = amp.autocast();`.
    pub fn autocast(&self) -> Fp8Autocast {
        fp8_autocast(true, self.config.compute.mode())
    }

    /// One training step that cannot forget the FP8 scope: `loss` (the
    /// forward) runs inside [`autocast`](Self::autocast); then the
    /// backward, the reduction over the ranks of a data-parallel group and
    /// the optimizer step, with the loss and the activations its graph
    /// holds dropped before the step (as PyTorch frees them during
    /// `backward()`). Returns the step's outcome and the loss's value (a
    /// tensor without the graph; reading it waits for the device).
    ///
    /// ```
    /// use amp_levels::{initialize, AmpConfig, Level};
    /// use candle_core::{DType, Device, Module, Tensor};
    /// let varmap = candle_nn::VarMap::new();
    /// let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// let fc = amp_core::nn::linear(8, 8, vb.pp("fc"))?;
    /// let (amp, mut opt) = initialize(&varmap, Default::default(), AmpConfig::level(Level::O2))?;
    /// let x = Tensor::ones((4, 8), DType::F32, &Device::Cpu)?;
    /// let step = amp.step(&mut opt, || -> amp_levels::Result<Tensor> {
    ///     Ok(fc.forward(&x)?.sqr()?.mean_all()?)
    /// })?;
    /// assert!(step.loss.to_scalar::<f32>()? > 0.0);
    /// # Ok::<(), amp_levels::Error>(())
    /// ```
    ///
    /// # Errors
    /// `loss`'s, and [`AmpOptimizer::backward_step_owned`]'s (converted).
    pub fn step<E: From<Error>>(
        &self,
        opt: &mut AmpOptimizer,
        loss: impl FnOnce() -> std::result::Result<Tensor, E>,
    ) -> std::result::Result<Stepped, E> {
        let loss = {
            let _fp8 = self.autocast();
            loss()?
        };
        let value = loss.detach();
        let outcome = opt.step_owned(loss)?;
        // the next forward's weight casts, all at once (amp_core::nn's
        // `cast_weights_ahead`: the same codes, two launches for all). The
        // step is applied: a cast that fails here leaves each forward to
        // cast its own weight, which reports a lasting error itself.
        if amp_core::nn::weight_casts_ahead() {
            let _ = amp_core::nn::cast_weights_ahead(&self.linears);
        }
        Ok(Stepped {
            outcome,
            loss: value,
        })
    }

    /// Whether a parameter name belongs to a Linear weight handled by the level.
    pub fn is_linear(&self, name: &str) -> bool {
        self.linear_names.iter().any(|n| n == name)
    }

    /// Runs `f` (forward passes for validation or sampling) in the config's
    /// compute mode, then puts every Linear's delayed-scaling state back as
    /// it was. Under delayed scaling a forward records amaxes and each
    /// scope rolls the amax histories, so validation between training steps
    /// would otherwise change the scales of the following steps (and a
    /// resumed run would not match an uninterrupted one).
    ///
    /// ```
    /// # use amp_levels::{initialize, AmpConfig, Compute, Level};
    /// # use candle_core::{Device, DType, Module, Tensor};
    /// # let varmap = candle_nn::VarMap::new();
    /// # let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// let fc = amp_core::nn::linear(8, 8, vb.pp("fc"))?;
    /// let cfg = AmpConfig {
    ///     level: Level::O2,
    ///     compute: Compute::Fp8Delayed { recipe: Default::default() },
    ///     ..Default::default()
    /// };
    /// let (amp, _opt) = initialize(&varmap, Default::default(), cfg)?;
    /// let x = Tensor::ones((4, 8), DType::F32, &Device::Cpu)?;
    /// let val = amp.evaluate(|| -> Result<f32, Box<dyn std::error::Error>> {
    ///     Ok(fc.forward(&x)?.sum_all()?.to_scalar::<f32>()?)
    /// })?;
    /// assert!(val.is_finite());
    /// assert!(fc.scaling_state()?.is_none()); // as before: no delayed-scaling state yet
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// `f`'s; [`Error::Core`] for a poisoned layer.
    pub fn evaluate<T, E: From<Error>>(
        &self,
        f: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let saved = self
            .linears()
            .iter()
            .map(|l| l.scaling_state())
            .collect::<amp_core::Result<Vec<_>>>()
            .map_err(|e| E::from(e.into()))?;
        let out = {
            let _scope = self.autocast();
            // nothing here is backpropagated
            let _eval = amp_core::nn::inference();
            f()
        };
        for (layer, state) in self.linears().iter().zip(saved) {
            layer
                .set_scaling_state(state)
                .map_err(|e| E::from(e.into()))?;
        }
        out
    }
}

/// The optimizer of a level: low-bit AdamW over every parameter, fed by
/// candle's `GradStore` and the layers' FP8 gradient sink.
#[derive(Debug)]
pub struct AmpOptimizer {
    pub(crate) opt: LowBitAdamW,
    pub(crate) sink: GradSink,
    /// Last step's gradient bytes: Linear data, Linear scales, others.
    pub(crate) last_grad_bytes: [usize; 3],
    /// CUDA: the pool's used high-water mark when the last backward pass
    /// ended (before the optimizer step).
    pub(crate) backward_peak: Option<u64>,
    pub(crate) linear_names: Vec<String>,
    /// Data parallelism's group (`initialize_distributed`), if any.
    group: Option<Box<dyn DataParallel>>,
    /// The last step's communication (with a group).
    last_comm: Option<CommStats>,
    /// Gradients of this step's earlier micro-batches
    /// ([`backward_accumulate`](Self::backward_accumulate)).
    pending: Option<Grads>,
}

/// What [`AmpContext::step`] returns.
#[derive(Debug, Clone)]
pub struct Stepped {
    /// Applied or skipped (a non-finite gradient on any rank).
    pub outcome: StepOutcome,
    /// The loss's value, without its graph.
    pub loss: Tensor,
}

impl AmpOptimizer {
    /// Scales the loss, runs backward, gathers the F32 gradients of `Var`
    /// parameters and the FP8 gradients of the sink, averages them over the
    /// ranks of a data-parallel group (FP8 ones in FP8), and steps.
    ///
    /// # Errors
    /// The optimizer's, candle's.
    #[deprecated(
        note = "use `AmpContext::step`, which opens the FP8 scope and frees the \
                         activations before the step"
    )]
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<StepOutcome> {
        let grads = self.backward_grads(loss, true)?;
        self.step_grads(grads)
    }

    /// [`backward_step`](Self::backward_step) that takes the loss and drops
    /// it after the backward pass, before the optimizer step: candle keeps
    /// a graph's saved tensors (the activations) until its output is
    /// dropped, so where the caller holds no other handle on the graph they
    /// are freed before the step allocates the new weights and moments, as
    /// PyTorch frees them during `backward()`. Read the loss's value first.
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step).
    #[deprecated(note = "use `AmpContext::step`, which opens the FP8 scope too")]
    pub fn backward_step_owned(&mut self, loss: Tensor) -> Result<StepOutcome> {
        self.step_owned(loss)
    }

    /// [`backward_step_owned`](Self::backward_step_owned)'s body, for
    /// [`AmpContext::step`].
    pub(crate) fn step_owned(&mut self, loss: Tensor) -> Result<StepOutcome> {
        let grads = self.backward_grads(&loss, true)?;
        drop(loss);
        self.step_grads(grads)
    }

    /// The backward of one micro-batch of a step with gradient
    /// accumulation: its gradients are added to those kept since the last
    /// step, and nothing is communicated or stepped (PyTorch DDP's
    /// `no_sync`); the step's last micro-batch goes through
    /// [`backward_step`](Self::backward_step) (or
    /// [`backward_step_owned`](Self::backward_step_owned)), which adds its
    /// own, averages the sum over the ranks once and steps. Scale each
    /// micro-batch's loss by `1 / micro-batches` for the mean. The loss is
    /// dropped after its backward, freeing its saved activations.
    ///
    /// # Errors
    /// As [`backward_step`](Self::backward_step).
    pub fn backward_accumulate(&mut self, loss: Tensor) -> Result<()> {
        let grads = self.backward_grads(&loss, false)?;
        drop(loss);
        match &mut self.pending {
            Some(p) => p.accumulate(grads)?,
            None => self.pending = Some(grads),
        }
        Ok(())
    }

    /// The backward half of [`backward_step`](Self::backward_step): the
    /// gradients, and this step's gradient bytes and backward peak recorded.
    fn backward_grads(&mut self, loss: &Tensor, last: bool) -> Result<Grads> {
        let (grads, early) = match &self.group {
            Some(group) => {
                let (opt, sink) = (&self.opt, &self.sink);
                let mut backward = || Ok(opt.backward(loss, Some(sink))?);
                if last {
                    group.backward(&mut self.pending, &mut backward)?
                } else {
                    group.backward_micro(&mut backward)?
                }
            }
            None => (self.opt.backward(loss, Some(&self.sink))?, Vec::new()),
        };
        if loss.device().is_cuda() {
            self.backward_peak = Some(amp_core::pool_peaks(loss.device())?.0);
        }
        // What the gradients of this step hold, by class: Linear data, their
        // scales, and the F32 gradients of every other parameter.
        // (Those data parallelism reduced during the backward included.)
        let (mut data, mut meta, mut other) = (0, 0, 0);
        let sizes = grads.0.iter().map(|(name, g)| match g {
            Grad::F32(t) => (name, t.elem_count() * t.dtype().size_in_bytes(), 0),
            Grad::Scaled(t) => (name, t.nbytes() - t.meta().nbytes(), t.meta().nbytes()),
        });
        for (name, d, m) in sizes.chain(early.iter().map(|(n, d, m)| (n, *d, *m))) {
            if self.linear_names.iter().any(|n| n == name) {
                data += d;
                meta += m;
            } else {
                other += d + m;
            }
        }
        self.last_grad_bytes = [data, meta, other];
        Ok(grads)
    }

    /// The step half of [`backward_step`](Self::backward_step); with a
    /// data-parallel group the gradients are averaged over the ranks, the
    /// squared norm summed over them, and after an applied step the FP8
    /// copies of sliced weights gathered again.
    fn step_grads(&mut self, mut grads: Grads) -> Result<StepOutcome> {
        if let Some(mut pending) = self.pending.take() {
            pending.accumulate(grads)?;
            grads = pending;
        }
        let Some(group) = &self.group else {
            return Ok(self.opt.step_owned(grads)?);
        };
        let device = grads.0.values().next().map(|g| match g {
            Grad::F32(t) => t.device().clone(),
            Grad::Scaled(t) => t.device().clone(),
        });
        let mark = || device.as_ref().map(StreamMark::now).transpose();
        let mut stats = CommStats::default();
        let start = mark()?;
        let grads = group.average(grads, &mut stats)?;
        if let (Some(a), Some(b)) = (start, mark()?) {
            stats.push_span(a, b);
        }
        let holds_slice = |name: &str| group.holds_slice(name);
        let mut total_sq = |part_sq: &Tensor| group.total_sq(part_sq);
        let outcome = self
            .opt
            .step_partitioned(grads, &holds_slice, &mut total_sq)?;
        if let StepOutcome::Applied { .. } = outcome {
            let start = mark()?;
            group.after_step(&self.opt, &mut stats)?;
            if let (Some(a), Some(b)) = (start, mark()?) {
                stats.push_gather_span(a, b);
            }
        }
        self.last_comm = Some(stats);
        Ok(outcome)
    }

    /// With a data-parallel group, the communication of the last step:
    /// buckets, bytes sent by this rank, and the time the step waited for
    /// it ([`CommStats::exposed_ms`]); `None` without a group or before a
    /// step.
    pub fn last_comm(&self) -> Option<&CommStats> {
        self.last_comm.as_ref()
    }

    /// CUDA only: the device pool's used high-water mark (bytes) when the
    /// last [`backward_step`](Self::backward_step)'s backward pass ended,
    /// before its optimizer step; `None` on the CPU or before a step.
    pub fn last_backward_peak(&self) -> Option<u64> {
        self.backward_peak
    }

    /// This rank and the number of ranks (`(0, 1)` without a group).
    pub fn rank_and_world(&self) -> (usize, usize) {
        self.group.as_ref().map_or((0, 1), |g| g.rank_and_world())
    }

    /// The data-parallel group's hook, if there is a group.
    pub(crate) fn data_parallel(&self) -> Option<&dyn DataParallel> {
        self.group.as_deref()
    }

    /// The low-bit AdamW inside.
    pub fn inner(&self) -> &LowBitAdamW {
        &self.opt
    }

    /// Mutable access (schedules, checkpoints).
    pub fn inner_mut(&mut self) -> &mut LowBitAdamW {
        &mut self.opt
    }
}

fn low_bit(values: &Tensor, qtype: QType) -> Result<ScalingTensor> {
    Ok(ScalingTensor::quantize(values, qtype, &CurrentScaling::default())?.0)
}

/// The entry `initialize` leaves in a `VarMap` it has converted.
pub const INITIALIZED_MARK: &str = "__candle_amp.initialized";

/// Marks a `VarMap` as initialized; a second `initialize` of the same map
/// is an error (its converted weights have left the map, so it would build
/// an optimizer that silently skips them).
fn claim(varmap: &candle_nn::VarMap) -> Result<()> {
    let mut data = varmap
        .data()
        .lock()
        .map_err(|_| amp_core::Error::Poisoned { op: "initialize" })?;
    if data.contains_key(INITIALIZED_MARK) {
        return Err(Error::Config {
            field: "varmap".into(),
            reason: "this VarMap was already initialized: build the model anew for another level"
                .into(),
        });
    }
    data.insert(
        INITIALIZED_MARK.into(),
        candle_core::Var::zeros(1, candle_core::DType::U8, &candle_core::Device::Cpu)?,
    );
    Ok(())
}

/// Converts every Linear weight in `varmap` (layers built with `amp::nn`) to
/// the level's storage, attaches the gradient sink where the level keeps
/// FP8 gradients, and builds the optimizer over all parameters with the
/// level's moment formats. A converted weight leaves the `VarMap` (its F32
/// copy is freed). The model's code does not change between levels.
/// Layers kept in high precision (`AmpConfig::high_precision`) and layers
/// tied to a weight of another name ([`AmpContext::tied`]: an output head
/// sharing the embedding) keep their F32 weight.
///
/// # Errors
/// [`Error::Core`] for a bad config, the optimizer's for bad
/// hyperparameters.
pub fn initialize(
    varmap: &candle_nn::VarMap,
    adam: AdamWConfig,
    config: AmpConfig,
) -> Result<(AmpContext, AmpOptimizer)> {
    initialize_with(varmap, adam, config, None)
}

/// [`initialize`] for one rank of a data-parallel `group`, which the
/// optimizer then keeps: at O3 the group may keep only this rank's slice
/// of each Linear weight's master ([`DataParallel::split_master`]).
pub(crate) fn initialize_with(
    varmap: &candle_nn::VarMap,
    adam: AdamWConfig,
    config: AmpConfig,
    mut group: Option<Box<dyn DataParallel>>,
) -> Result<(AmpContext, AmpOptimizer)> {
    let (_, world) = group.as_ref().map_or((0, 1), |g| g.rank_and_world());
    amp_core::config::Validate::validate(&config)?;
    adam.validate()?;
    if config.level != Level::O0 {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| amp_core::Error::Poisoned { op: "initialize" })?;
        // (an initialized map has lost its converted weights: `claim` says so)
        let fresh = !data.contains_key(INITIALIZED_MARK);
        let any_linear = data
            .values()
            .any(|v| registered_linear(v.as_tensor().id()).is_some());
        drop(data);
        if fresh && !any_linear {
            return Err(Error::Config {
                field: "level".into(),
                reason: format!(
                    "{} converts the weights of `amp::nn` Linear layers, and this model has none \
                     (built with `candle_nn::linear`?): build its Linear layers with \
                     `amp::nn::linear` (same arguments), or use O0",
                    config.level
                ),
            });
        }
    }
    claim(varmap)?;
    let policy = config.policy();
    let sink = GradSink::new();
    let mut vars: Vec<(String, candle_core::Var)> = {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| amp_core::Error::Poisoned { op: "initialize" })?;
        data.iter()
            .filter(|(n, _)| n.as_str() != INITIALIZED_MARK)
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect()
    };
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut params = Vec::with_capacity(vars.len());
    let (mut linears, mut linear_names, mut removed) = (vec![], vec![], vec![]);
    let mut tied_names = vec![];
    for (name, var) in vars {
        let moments = |(m, v): (StateFormat, StateFormat)| {
            if config.keeps_f32_moments(&name) {
                (StateFormat::F32, StateFormat::F32)
            } else {
                (m, v)
            }
        };
        let layer = registered_linear(var.as_tensor().id());
        // A Linear over a weight the map knows under another name (a head
        // tied to the embedding): the weight has another use, so it keeps
        // its F32 storage and F32 gradient, which candle sums over both
        // uses; its product still runs in the config's path (Transformer
        // Engine's path with an F32 weight), unless kept high precision.
        let tied = layer.as_ref().is_some_and(|l| l.name() != name);
        match layer {
            Some(layer) if !tied && !config.is_high_precision(&name) => {
                let slot = layer.weight_slot().clone();
                if !matches!(&*slot.read()?, Weight::F32(_)) {
                    return Err(Error::Config {
                        field: name,
                        reason: "this Linear weight was converted by an earlier initialize: build the model anew".into(),
                    });
                }
                let value = var.as_tensor();
                let mut param_slot = slot.clone();
                match policy.linear_weight {
                    WeightStorage::F32 => {}
                    WeightStorage::F16 => slot.replace(Weight::F16(low_bit(value, QType::F16)?))?,
                    WeightStorage::Fp8WithMaster => {
                        let sliced = match group.as_mut() {
                            Some(g) => g.split_master(&name, value, &slot)?,
                            None => None,
                        };
                        match sliced {
                            Some(master) => param_slot = master,
                            None => slot.replace(Weight::Fp8 {
                                weight: low_bit(value, QType::E4M3)?,
                                master: low_bit(value, QType::F16)?,
                            })?,
                        }
                    }
                }
                if policy.linear_weight != WeightStorage::F32 {
                    removed.push(name.clone());
                }
                layer.set_grad_sink(if policy.linear_grad == GradStorage::Fp8 {
                    Some(sink.clone())
                } else {
                    None
                })?;
                layer.set_high_precision(false);
                let (m, v) = moments(policy.linear_moments);
                params.push((name.clone(), param_slot, m, v));
                linear_names.push(name);
                linears.push(layer);
            }
            other => {
                if let Some(layer) = other {
                    if tied {
                        tied_names.push((layer.name().to_string(), name.clone()));
                    }
                    let high = !tied
                        || config.is_high_precision(&name)
                        || config.is_high_precision(layer.name());
                    layer.set_high_precision(high);
                    layer.set_grad_sink(None)?;
                    if !high {
                        // its scaling state is saved and restored with the
                        // converted layers'
                        linears.push(layer);
                    }
                }
                let (m, v) = moments(policy.other_moments);
                params.push((name, WeightSlot::new(Weight::F32(var)), m, v));
            }
        }
    }
    if !removed.is_empty() {
        let mut data = varmap
            .data()
            .lock()
            .map_err(|_| amp_core::Error::Poisoned { op: "initialize" })?;
        for name in &removed {
            data.remove(name);
        }
    }
    let opt_config = LowBitAdamWConfig {
        adam,
        loss_scaling: config.loss_scaling,
        max_grad_norm: config.max_grad_norm,
        lean_step: config.lean_step,
        ..Default::default()
    };
    let opt = LowBitAdamW::with_formats(params, opt_config)?;
    let ctx = AmpContext {
        config,
        linears,
        linear_names: linear_names.clone(),
        tied: tied_names,
        world,
    };
    Ok((
        ctx,
        AmpOptimizer {
            opt,
            sink,
            last_grad_bytes: [0; 3],
            backward_peak: None,
            linear_names,
            group,
            last_comm: None,
            pending: None,
        },
    ))
}
