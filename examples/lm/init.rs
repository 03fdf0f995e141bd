//! Reproducible initial values (candle's CPU generator cannot be seeded):
//! each parameter draws from its own stream of the run's seed and its
//! name, so the values do not depend on the order of names.

use anyhow::Result;
use candle_core::Tensor;
use candle_nn::VarMap;
use rand::SeedableRng;
use rand_distr::Distribution;

/// A parameter's initial values.
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// Every element this value (biases 0, norm scales 1).
    Const(f32),
    /// N(0, std) from the parameter's own stream.
    Normal(f64),
}

/// Sets every variable of `varmap` as `rule` says for its name.
///
/// # Errors
/// A poisoned lock, a bad standard deviation, candle's.
pub fn init_all(varmap: &VarMap, seed: u64, rule: impl Fn(&str) -> Init) -> Result<()> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the VarMap's lock is poisoned"))?;
    for (name, var) in data.iter() {
        let n = var.elem_count();
        let values = match rule(name) {
            Init::Const(v) => vec![v; n],
            Init::Normal(std) => normal(seed, name, std, n)?,
        };
        let t = Tensor::from_vec(values, var.shape(), var.device())?.to_dtype(var.dtype())?;
        var.set(&t)?;
    }
    Ok(())
}

/// `n` draws of N(0, std) from the stream of `seed` and `name`.
///
/// # Errors
/// A standard deviation that is not finite and non-negative.
pub fn normal(seed: u64, name: &str, std: f64, n: usize) -> Result<Vec<f32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ fnv1a(name));
    let normal = rand_distr::Normal::new(0.0, std as f32)?;
    Ok((0..n).map(|_| normal.sample(&mut rng)).collect())
}

/// FNV-1a of a name: a stable per-parameter stream id.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}
