//! AdamW with PyTorch's update rule, as a pure function on f32 slices, and
//! the F32 reference optimizer over candle `Var`s.

use crate::error::{Error, Result};
use candle_core::{backprop::GradStore, Tensor, Var};

/// AdamW hyperparameters; defaults are PyTorch's `torch.optim.AdamW`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

impl AdamWConfig {
    /// Checks the ranges PyTorch checks.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: &str| {
            Err(Error::Config {
                field,
                reason: reason.into(),
            })
        };
        if !(self.lr >= 0.0 && self.lr.is_finite()) {
            return bad("lr", "must be finite and >= 0");
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return bad("beta1", "must be in [0, 1)");
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return bad("beta2", "must be in [0, 1)");
        }
        if !(self.eps >= 0.0 && self.eps.is_finite()) {
            return bad("eps", "must be finite and >= 0");
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad("weight_decay", "must be finite and >= 0");
        }
        Ok(())
    }

    /// The f32 constants of step `step` (1-based) at learning rate `lr`.
    pub fn at_step(&self, lr: f64, step: u64) -> AdamStep {
        let bc1 = 1.0 - self.beta1.powf(step as f64);
        let bc2 = 1.0 - self.beta2.powf(step as f64);
        AdamStep {
            lr_wd: (lr * self.weight_decay) as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            step_size: (lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: self.eps as f32,
        }
    }
}

/// The constants of one AdamW step, as PyTorch's single-tensor AdamW forms
/// them: in f64 from Python floats, used as f32 scalars.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamStep {
    lr_wd: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
}

impl AdamStep {
    /// The constants in field order (`lr_wd`, `1-β1`, `β2`, `1-β2`,
    /// `step_size`, `sqrt(bc2)`, `eps`), for the CUDA kernel.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn constants(&self) -> [f32; 7] {
        [
            self.lr_wd,
            self.one_minus_beta1,
            self.beta2,
            self.one_minus_beta2,
            self.step_size,
            self.bc2_sqrt,
            self.eps,
        ]
    }

    /// One update in place, in PyTorch's order: `p -= p·(lr·wd)` (PyTorch
    /// writes `p *= 1 - lr·wd`; rounding `1 - lr·wd` to f32 first costs up to
    /// 3e-8 relative per step, systematically, so we subtract the small term);
    /// `m += (1-β1)(g - m)`; `v = β2·v + (1-β2)·g·g`;
    /// `p -= step_size · m / (sqrt(v)/sqrt(bc2) + eps)`. `g` is multiplied
    /// by `grad_mul` first (loss-scale inverse times clipping coefficient).
    pub fn update(&self, p: &mut [f32], g: &[f32], grad_mul: f32, m: &mut [f32], v: &mut [f32]) {
        for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = if grad_mul == 1.0 { g } else { g * grad_mul };
            *p -= *p * self.lr_wd;
            *m += self.one_minus_beta1 * (g - *m);
            *v = *v * self.beta2 + self.one_minus_beta2 * g * g;
            let denom = v.sqrt() / self.bc2_sqrt + self.eps;
            *p += -self.step_size * (*m / denom);
        }
    }
}

/// The F32 reference AdamW over candle `Var`s (implements
/// `candle_nn::Optimizer`).
///
/// ```
/// use amp_optim::{AdamW, AdamWConfig};
/// use candle_core::{Device, Tensor, Var};
/// use candle_nn::Optimizer;
/// let w = Var::new(&[3.0f32, -2.0], &Device::Cpu)?;
/// let mut opt = AdamW::new(vec![w.clone()], AdamWConfig { lr: 0.1, ..Default::default() })?;
/// for _ in 0..100 {
///     opt.backward_step(&w.as_tensor().sqr()?.sum_all()?)?;
/// }
/// assert!(w.as_tensor().abs()?.max_all()?.to_scalar::<f32>()? < 0.1);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct AdamW {
    /// Each variable with its moments and its own step count (PyTorch's).
    vars: Vec<(Var, Vec<f32>, Vec<f32>, u64)>,
    config: AdamWConfig,
    step: u64,
}

impl AdamW {
    /// The number of steps taken.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    fn step_inner(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        for (var, m, v, step) in &mut self.vars {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            if g.shape() != var.shape() {
                return Err(Error::GradShape {
                    op: "AdamW::step",
                    name: format!("{:?}", var.id()),
                    expected: var.shape().clone(),
                    got: g.shape().clone(),
                });
            }
            let shape = var.shape().clone();
            let mut p = flat(var.as_tensor())?;
            *step += 1;
            let k = self.config.at_step(self.config.lr, *step);
            k.update(&mut p, &flat(g)?, 1.0, m, v);
            var.set(&Tensor::from_vec(p, shape, var.device())?.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }
}

/// A tensor's values as a flat F32 vector.
pub(crate) fn flat(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1::<f32>()?)
}

impl candle_nn::Optimizer for AdamW {
    type Config = AdamWConfig;

    fn new(vars: Vec<Var>, config: AdamWConfig) -> candle_core::Result<Self> {
        config.validate().map_err(candle_core::Error::wrap)?;
        let vars = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|v| {
                let n = v.elem_count();
                (v, vec![0f32; n], vec![0f32; n], 0)
            })
            .collect();
        Ok(Self {
            vars,
            config,
            step: 0,
        })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_inner(grads).map_err(candle_core::Error::wrap)
    }

    fn learning_rate(&self) -> f64 {
        self.config.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}
