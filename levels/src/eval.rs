//! Evaluation that leaves training as it was.

use crate::context::AmpContext;

impl AmpContext {
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
    /// `f`'s; [`crate::Error::Core`] for a poisoned layer.
    pub fn evaluate<T, E: From<crate::Error>>(
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
