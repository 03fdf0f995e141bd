//! The corpus, its byte-level tokenizer, the train/validation split and
//! deterministic batches.
//!
//! Tokens are bytes (a vocabulary of 256, nothing to download or train).
//! The last [`VAL_FRACTION`] of the text is the validation split. Batch `i`
//! of a split is a function of the seed and `i` alone, so a resumed run
//! sees the very batches an uninterrupted one would.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use std::path::Path;

/// The bundled corpus: Genesis to Ruth, King James Version (public
/// domain; `examples/data/README.md` says where it comes from).
pub const BUNDLED: &[u8] = include_bytes!("../data/kjv-genesis-ruth.txt");

/// Share of the text kept for validation (its end).
pub const VAL_FRACTION: f64 = 0.1;

/// The byte-level vocabulary.
pub const VOCAB: usize = 256;

/// Which part of the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The first 90%.
    Train,
    /// The last 10%.
    Val,
}

/// A tokenized text split in two.
#[derive(Debug, Clone)]
pub struct Corpus {
    train: Vec<u32>,
    val: Vec<u32>,
}

impl Corpus {
    /// The bundled text.
    pub fn bundled() -> Self {
        Self::from_bytes(BUNDLED)
    }

    /// A text file, read as bytes.
    ///
    /// # Errors
    /// A file that cannot be read, or one too short for a split.
    pub fn from_path(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        if bytes.len() < 64 {
            bail!(
                "{}: {} bytes is too short a corpus",
                path.display(),
                bytes.len()
            );
        }
        Ok(Self::from_bytes(&bytes))
    }

    fn from_bytes(bytes: &[u8]) -> Self {
        let tokens = encode(bytes);
        let cut = ((tokens.len() as f64) * (1.0 - VAL_FRACTION)) as usize;
        Self {
            val: tokens[cut..].to_vec(),
            train: tokens[..cut].to_vec(),
        }
    }

    /// The tokens of a split.
    pub fn tokens(&self, split: Split) -> &[u32] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Batch `index` of `split`: inputs and next-token targets, both
    /// `[batch, seq]` u32, from `batch` windows at random offsets drawn from
    /// (`seed`, `split`, `index`).
    ///
    /// # Errors
    /// A split shorter than `seq + 1` tokens, candle's.
    pub fn batch(
        &self,
        split: Split,
        index: u64,
        seed: u64,
        batch: usize,
        seq: usize,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let tokens = self.tokens(split);
        if tokens.len() <= seq + 1 {
            bail!(
                "the {split:?} split has {} tokens: too few for sequences of {seq}",
                tokens.len()
            );
        }
        let tag = match split {
            Split::Train => 0x7472_6169_6e00_0000u64,
            Split::Val => 0x7661_6c00_0000_0000u64,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(
            seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ tag ^ index,
        );
        let (mut x, mut y) = (
            Vec::with_capacity(batch * seq),
            Vec::with_capacity(batch * seq),
        );
        for _ in 0..batch {
            let o = rng.random_range(0..tokens.len() - seq - 1);
            x.extend_from_slice(&tokens[o..o + seq]);
            y.extend_from_slice(&tokens[o + 1..o + seq + 1]);
        }
        Ok((
            Tensor::from_vec(x, (batch, seq), dev)?,
            Tensor::from_vec(y, (batch, seq), dev)?,
        ))
    }
}

/// Bytes to tokens.
pub fn encode(bytes: &[u8]) -> Vec<u32> {
    bytes.iter().map(|&b| b as u32).collect()
}

/// Tokens to text (bytes that are not UTF-8 print as U+FFFD).
pub fn decode(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().map(|&t| t.min(255) as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
