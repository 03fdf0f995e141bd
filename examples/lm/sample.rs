//! Sampling text from the model.

use crate::data::codec::Codec;
use crate::model::Model;
use anyhow::{Context, Result};
use candle_core::{Device, Tensor, D};
use rand::SeedableRng;
use rand_distr::Distribution;

/// `n` tokens continuing `prompt` (tokenized by `codec`), sampled at
/// temperature 0.8 from a generator seeded with `seed`, as text.
///
/// # Errors
/// candle's; the tokenizer's.
pub fn generate(
    model: &Model,
    codec: &Codec,
    prompt: &str,
    n: usize,
    seed: u64,
    dev: &Device,
) -> Result<String> {
    const TEMPERATURE: f64 = 0.8;
    let ctx = model.config().ctx;
    let mut tokens = codec.encode(prompt.as_bytes())?;
    if tokens.is_empty() {
        // a newline's token, or the first one
        tokens = codec.encode(b"\n")?;
        tokens.resize(1, 0);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for _ in 0..n {
        let window = &tokens[tokens.len().saturating_sub(ctx)..];
        let x = Tensor::new(window, dev)?.unsqueeze(0)?;
        let logits = model.forward(&x)?.squeeze(0)?.get(window.len() - 1)?;
        let probs = candle_nn::ops::softmax(&(logits / TEMPERATURE)?, D::Minus1)?;
        let probs: Vec<f32> = probs.to_vec1()?;
        let pick = rand::distr::weighted::WeightedIndex::new(&probs)
            .context("the model's output is not a distribution (non-finite logits)")?;
        tokens.push(pick.sample(&mut rng) as u32);
    }
    codec.decode(&tokens)
}
