//! The context of a model trained at a level ([`AmpContext`]): the
//! compute scope for forward passes (and for evaluation that leaves the
//! training state as it was) and the training step. `initialize.rs`
//! converts a model's parameters to the level's storages and builds the
//! context and the optimizer (`optimizer.rs`).
//!
//! Data parallelism is not this module's: the optimizer step calls a
//! `DataParallel` hook (`data_parallel.rs`), which the `distributed` module
//! implements and installs through `initialize_with` (docs/ARCHITECTURE.md,
//! "Data parallelism"). This module imports none above it: the checkpoint
//! module (`save`, `load`, `export`) and the memory report
//! (`memory_report`) add their methods to [`AmpContext`], each beside its
//! concept.

use crate::config::AmpConfig;
use crate::error::Error;
use crate::level::Level;
use crate::optimizer::{AmpOptimizer, Stepped};
use amp_core::nn::{fp8_autocast, Fp8Autocast, Linear};
use candle_core::Tensor;

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
