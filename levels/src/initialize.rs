//! [`initialize`]: a model's parameters converted to a level's storages,
//! the layers' gradient sink attached, the optimizer built; once per
//! `VarMap` (`INITIALIZED_MARK`).

use crate::config::AmpConfig;
use crate::error::{Error, Result};
use crate::level::{GradStorage, Level, WeightStorage};
use amp_core::nn::{registered_linear, GradSink};
use amp_core::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use amp_optim::{AdamWConfig, LowBitAdamW, LowBitAdamWConfig, StateFormat};
use candle_core::Tensor;

use crate::context::AmpContext;
use crate::data_parallel::DataParallel;
use crate::optimizer::AmpOptimizer;

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
        defer_outcome: config.defer_outcome,
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
