//! Reproducible initial values (candle's CPU generator cannot be seeded):
//! each parameter draws from its own stream of the run's seed and its
//! name, so the values do not depend on the order of names.

use anyhow::Result;
use rand::SeedableRng;
use rand_distr::Distribution;

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
