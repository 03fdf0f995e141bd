//! `initialize`: converts a model's parameters to a level's storages and
//! builds the optimizer; `AmpOptimizer::backward_step` runs a training step.

use crate::config::AmpConfig;
use crate::error::Result;
use crate::level::{GradStorage, Level, WeightStorage};
use amp_core::nn::{fp8_autocast, registered_linear, Fp8Autocast, GradSink, Linear};
use amp_core::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use amp_optim::{
    AdamWConfig, Grad, Grads, LowBitAdamW, LowBitAdamWConfig, StateFormat, StepOutcome,
};
use candle_core::Tensor;

/// What `initialize` set up: the config, the Linear layers it converted and
/// the sink their FP8 weight gradients go to.
#[derive(Debug)]
pub struct AmpContext {
    pub(crate) config: AmpConfig,
    pub(crate) linears: Vec<Linear>,
    pub(crate) linear_names: Vec<String>,
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

    /// The Linear layers found among the parameters (converted unless kept in
    /// high precision).
    pub fn linears(&self) -> &[Linear] {
        &self.linears
    }

    /// Opens the config's compute scope for one step's forward (and the
    /// backward that follows): `let _fp8 = amp.autocast();`.
    pub fn autocast(&self) -> Fp8Autocast {
        fp8_autocast(true, self.config.compute.mode())
    }

    /// The memory report of this model and optimizer now.
    ///
    /// # Errors
    /// As [`crate::MemoryReport::measure`].
    pub fn memory_report(&self, opt: &AmpOptimizer) -> Result<crate::MemoryReport> {
        crate::MemoryReport::measure(self, opt)
    }

    /// Whether a parameter name belongs to a Linear weight handled by the level.
    pub fn is_linear(&self, name: &str) -> bool {
        self.linear_names.iter().any(|n| n == name)
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
    /// Data parallelism's group ([`crate::initialize_distributed`]).
    pub(crate) comm: Option<crate::distributed::Comm>,
    /// O3 with more than one rank: the Linear weights whose master and
    /// moments this rank holds a slice of.
    pub(crate) shards: Vec<crate::zero::Shard>,
}

impl AmpOptimizer {
    /// Scales the loss, runs backward, gathers the F32 gradients of `Var`
    /// parameters and the FP8 gradients of the sink, averages them over the
    /// ranks of a data-parallel group (FP8 ones in FP8), and steps.
    ///
    /// # Errors
    /// The optimizer's, candle's.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<StepOutcome> {
        let grads = self.backward_grads(loss)?;
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
    pub fn backward_step_owned(&mut self, loss: Tensor) -> Result<StepOutcome> {
        let grads = self.backward_grads(&loss)?;
        drop(loss);
        self.step_grads(grads)
    }

    /// The backward half of [`backward_step`](Self::backward_step): the
    /// gradients, and this step's gradient bytes and backward peak recorded.
    fn backward_grads(&mut self, loss: &Tensor) -> Result<Grads> {
        let grads = self.opt.backward(loss, Some(&self.sink))?;
        if loss.device().is_cuda() {
            self.backward_peak = Some(amp_core::pool_peaks(loss.device())?.0);
        }
        // What the gradients of this step hold, by class: Linear data, their
        // scales, and the F32 gradients of every other parameter.
        let (mut data, mut meta, mut other) = (0, 0, 0);
        for (name, g) in &grads.0 {
            let (d, m) = match g {
                Grad::F32(t) => (t.elem_count() * t.dtype().size_in_bytes(), 0),
                Grad::Scaled(t) => (t.nbytes() - t.meta().nbytes(), t.meta().nbytes()),
            };
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

    /// The step half of [`backward_step`](Self::backward_step).
    fn step_grads(&mut self, grads: Grads) -> Result<StepOutcome> {
        let Some(comm) = &self.comm else {
            return Ok(self.opt.step(&grads)?);
        };
        let comm = comm.0.as_ref();
        let grads = crate::distributed::average(comm, grads, &self.shards)?;
        let shards = &self.shards;
        let outcome = self.opt.step_partitioned(
            &grads,
            &|name| shards.iter().any(|s| s.name == name),
            &mut |part_sq| {
                if shards.is_empty() {
                    return Ok(part_sq);
                }
                let t = Tensor::new(&[part_sq as f32], comm.device())?;
                let sum = comm
                    .all_reduce_sum(&t)
                    .map_err(|e| amp_optim::Error::Config {
                        field: "data parallelism",
                        reason: e.to_string(),
                    })?;
                Ok(sum.to_vec1::<f32>()?[0] as f64)
            },
        )?;
        if let StepOutcome::Applied { .. } = outcome {
            crate::zero::gather(comm, &self.opt, &self.shards)?;
        }
        Ok(outcome)
    }

    /// CUDA only: the device pool's used high-water mark (bytes) when the
    /// last [`backward_step`](Self::backward_step)'s backward pass ended,
    /// before its optimizer step; `None` on the CPU or before a step.
    pub fn last_backward_peak(&self) -> Option<u64> {
        self.backward_peak
    }

    /// This rank and the number of ranks (`(0, 1)` without a group).
    pub fn rank_and_world(&self) -> (usize, usize) {
        self.comm
            .as_ref()
            .map_or((0, 1), |c| (c.0.rank(), c.0.world_size()))
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
        return Err(crate::Error::Config {
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
///
/// # Errors
/// [`crate::Error::Core`] for a bad config, the optimizer's for bad
/// hyperparameters.
pub fn initialize(
    varmap: &candle_nn::VarMap,
    adam: AdamWConfig,
    config: AmpConfig,
) -> Result<(AmpContext, AmpOptimizer)> {
    initialize_sharded(varmap, adam, config, (0, 1))
}

/// [`initialize`] for `rank` of `world` data-parallel ranks: at O3 with
/// more than one rank, each Linear weight's master and moments are this
/// rank's slice ([`crate::zero`]).
pub(crate) fn initialize_sharded(
    varmap: &candle_nn::VarMap,
    adam: AdamWConfig,
    config: AmpConfig,
    (rank, world): (usize, usize),
) -> Result<(AmpContext, AmpOptimizer)> {
    amp_core::config::Validate::validate(&config)?;
    adam.validate()?;
    claim(varmap)?;
    let policy = config.level.policy();
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
    let mut shards = vec![];
    for (name, var) in vars {
        let moments = |(m, v): (StateFormat, StateFormat)| {
            if config.keeps_f32_moments(&name) {
                (StateFormat::F32, StateFormat::F32)
            } else {
                (m, v)
            }
        };
        let layer = registered_linear(var.as_tensor().id());
        match layer {
            Some(layer) if !config.is_high_precision(&name) => {
                let slot = layer.weight_slot().clone();
                let converts = policy.linear_weight != WeightStorage::F32
                    || policy.linear_grad != GradStorage::F32;
                if !matches!(&*slot.read()?, Weight::F32(_)) {
                    return Err(crate::Error::Config {
                        field: name,
                        reason: "this Linear weight was converted by an earlier initialize: build the model anew".into(),
                    });
                }
                if converts && layer.name() != name {
                    return Err(crate::Error::Config {
                        field: name.clone(),
                        reason: format!(
                            "the Linear layer `{}` uses this weight under another name (a tied weight): \
                             keep it in high precision (`high_precision`) or untie it",
                            layer.name()
                        ),
                    });
                }
                let value = var.as_tensor();
                let mut param_slot = slot.clone();
                match policy.linear_weight {
                    WeightStorage::F32 => {}
                    WeightStorage::F16 => slot.replace(Weight::F16(low_bit(value, QType::F16)?))?,
                    WeightStorage::Fp8WithMaster => {
                        match crate::zero::master_slice(value, rank, world)? {
                            Some((master, range)) if world > 1 => {
                                slot.replace(Weight::Fp8Gathered(low_bit(value, QType::E4M3)?))?;
                                param_slot = WeightSlot::new(Weight::F16(master));
                                shards.push(crate::zero::Shard {
                                    name: name.clone(),
                                    layer: slot.clone(),
                                    range,
                                    shape: value.shape().clone(),
                                });
                            }
                            _ => slot.replace(Weight::Fp8 {
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
                    layer.set_high_precision(true);
                    layer.set_grad_sink(None)?;
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
        ..Default::default()
    };
    let opt = LowBitAdamW::with_formats(params, opt_config)?;
    let ctx = AmpContext {
        config,
        linears,
        linear_names: linear_names.clone(),
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
            comm: None,
            shards,
        },
    ))
}
