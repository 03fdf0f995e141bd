//! The corpus, its train/validation split and deterministic batches.
//!
//! Two kinds of data (`--data`):
//! - text (the bundled corpus, or a text file), tokenized by bytes (a
//!   vocabulary of 256, nothing to download or train) or by a Hugging Face
//!   `tokenizer.json` (`--tokenizer`, [`codec`]); its last
//!   [`VAL_FRACTION`] is the validation split;
//! - token shards ([`shards`]: llm.c's and nanoGPT's layouts), one file or
//!   a glob of them, memory-mapped. Shards with `_val_` in their file name
//!   are the validation split (llm.c's naming), the rest train; without
//!   any, the last [`VAL_FRACTION`] of all tokens (in file-name order).
//!
//! Batch `i` of a split is a function of the seed and `i` alone, so a
//! resumed run sees the very batches an uninterrupted one would. A window
//! never crosses from one shard into the next.

pub mod codec;
pub mod shards;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use codec::Codec;
use rand::{Rng, SeedableRng};
use shards::Shard;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The bundled corpus: Genesis to Ruth, King James Version (public
/// domain; `examples/data/README.md` says where it comes from).
pub const BUNDLED: &[u8] = include_bytes!("../../data/kjv-genesis-ruth.txt");

/// Share of the tokens kept for validation (their end), where the data
/// names no validation shards.
pub const VAL_FRACTION: f64 = 0.1;

/// The byte-level vocabulary.
pub const VOCAB: usize = 256;

/// Which part of the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// The first 90%, or the shards not named `_val_`.
    Train,
    /// The last 10%, or the `_val_` shards.
    Val,
}

/// Where a split's tokens live.
#[derive(Debug, Clone)]
enum Source {
    /// Byte tokens of a text, in memory.
    Text(Arc<Vec<u32>>),
    /// A memory-mapped shard.
    Shard(Arc<Shard>),
}

/// Tokens `start..start + len` of a source.
#[derive(Debug, Clone)]
struct Piece {
    source: Source,
    start: usize,
    len: usize,
}

impl Piece {
    fn extend(&self, at: usize, n: usize, out: &mut Vec<u32>) {
        let start = self.start + at;
        match &self.source {
            Source::Text(t) => out.extend_from_slice(&t[start..start + n]),
            Source::Shard(s) => s.extend(start, n, out),
        }
    }
}

/// Tokenized data split in two.
#[derive(Debug, Clone)]
pub struct Corpus {
    train: Vec<Piece>,
    val: Vec<Piece>,
    max_token: u32,
}

impl Corpus {
    /// The bundled text (tokenized by bytes: the tests' shorthand for
    /// [`bundled_with`](Self::bundled_with)).
    #[allow(dead_code)]
    pub fn bundled() -> Self {
        Self::from_tokens(encode(BUNDLED))
    }

    /// The bundled text, tokenized by `codec`.
    ///
    /// # Errors
    /// The tokenizer's.
    pub fn bundled_with(codec: &Codec) -> Result<Self> {
        Ok(Self::from_tokens(codec.encode(BUNDLED)?))
    }

    /// `--data`: a text file, a token shard, or a glob of token shards
    /// (see the module docs).
    ///
    /// # Errors
    /// A file that cannot be read; a text too short for a split; a glob
    /// that matches nothing, text files, or only validation shards; a
    /// damaged shard (the error names the file).
    #[allow(dead_code)] // the tests' shorthand
    pub fn from_path(path: &Path) -> Result<Self> {
        Self::from_path_with(path, &Codec::Bytes)
    }

    /// [`from_path`](Self::from_path) with a text file tokenized by `codec`
    /// (shards are tokens already).
    ///
    /// # Errors
    /// As `from_path`, and the tokenizer's (naming the file).
    pub fn from_path_with(path: &Path, codec: &Codec) -> Result<Self> {
        let pattern = path.to_string_lossy();
        if pattern.contains(['*', '?', '[']) {
            let files = glob::glob(&pattern)
                .with_context(|| format!("{pattern}: not a valid glob"))?
                .collect::<Result<Vec<PathBuf>, _>>()
                .with_context(|| format!("{pattern}: cannot list the matches"))?;
            if files.is_empty() {
                bail!("{pattern}: no file matches");
            }
            for f in &files {
                if !shards::is_shard(f)? {
                    bail!(
                        "{}: not a token shard (a glob takes llm.c or nanoGPT shards;                          give a text file on its own)",
                        f.display()
                    );
                }
            }
            return Self::from_shards(&pattern, &files);
        }
        if shards::is_shard(path)? {
            return Self::from_shards(&pattern, &[path.to_path_buf()]);
        }
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        if bytes.len() < 64 {
            bail!(
                "{}: {} bytes is too short a corpus",
                path.display(),
                bytes.len()
            );
        }
        let tokens = codec
            .encode(&bytes)
            .with_context(|| format!("tokenizing {}", path.display()))?;
        if tokens.len() < 64 {
            bail!(
                "{}: {} tokens is too short a corpus",
                path.display(),
                tokens.len()
            );
        }
        Ok(Self::from_tokens(tokens))
    }

    fn from_tokens(tokens: Vec<u32>) -> Self {
        let tokens = Arc::new(tokens);
        let cut = ((tokens.len() as f64) * (1.0 - VAL_FRACTION)) as usize;
        let piece = |start, len| Piece {
            source: Source::Text(tokens.clone()),
            start,
            len,
        };
        Self {
            train: vec![piece(0, cut)],
            val: vec![piece(cut, tokens.len() - cut)],
            max_token: tokens.iter().copied().max().unwrap_or(0),
        }
    }

    /// The shards `files` (in the order given), split as the module docs say.
    fn from_shards(what: &str, files: &[PathBuf]) -> Result<Self> {
        let mut train = Vec::new();
        let mut val = Vec::new();
        let mut max_token = 0;
        for f in files {
            let shard = Arc::new(Shard::open(f)?);
            max_token = max_token.max(shard.max_token());
            let piece = Piece {
                len: shard.len(),
                source: Source::Shard(shard),
                start: 0,
            };
            let is_val = f
                .file_name()
                .is_some_and(|n| n.to_string_lossy().contains("_val_"));
            if is_val { &mut val } else { &mut train }.push(piece);
        }
        if train.is_empty() {
            bail!("{what}: only validation shards (`_val_` in the name), nothing to train on");
        }
        if val.is_empty() {
            let total: usize = train.iter().map(|p| p.len).sum();
            let mut keep = ((total as f64) * (1.0 - VAL_FRACTION)) as usize;
            let all = std::mem::take(&mut train);
            for p in all {
                let here = keep.min(p.len);
                if here > 0 {
                    train.push(Piece {
                        len: here,
                        ..p.clone()
                    });
                }
                if here < p.len {
                    val.push(Piece {
                        start: p.start + here,
                        len: p.len - here,
                        ..p
                    });
                }
                keep -= here;
            }
        }
        Ok(Self {
            train,
            val,
            max_token,
        })
    }

    fn pieces(&self, split: Split) -> &[Piece] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Tokens in a split.
    pub fn len(&self, split: Split) -> usize {
        self.pieces(split).iter().map(|p| p.len).sum()
    }

    /// The largest token of the data (the model's vocabulary must exceed it).
    pub fn max_token(&self) -> u32 {
        self.max_token
    }

    /// Whether the data is text tokenized by bytes (so that tokens decode).
    pub fn is_text(&self) -> bool {
        matches!(self.train.first().map(|p| &p.source), Some(Source::Text(_)))
    }

    /// Batch `index` of `split`: inputs and next-token targets, both
    /// `[batch, seq]` u32, from `batch` windows at random offsets drawn from
    /// (`seed`, `split`, `index`), each within one shard.
    ///
    /// # Errors
    /// A split with no shard of more than `seq + 1` tokens, candle's.
    pub fn batch(
        &self,
        split: Split,
        index: u64,
        seed: u64,
        batch: usize,
        seq: usize,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let pieces = self.pieces(split);
        // the window starts each piece offers (as many as the text's one
        // piece always did: the last start left out)
        let starts: Vec<usize> = pieces
            .iter()
            .map(|p| p.len.saturating_sub(seq + 1))
            .collect();
        let total: usize = starts.iter().sum();
        if total == 0 {
            bail!(
                "the {split:?} split has {} tokens (its longest piece {}): too few for \
                 sequences of {seq}",
                self.len(split),
                pieces.iter().map(|p| p.len).max().unwrap_or(0)
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
        let mut window = Vec::with_capacity(seq + 1);
        for _ in 0..batch {
            let mut o = rng.random_range(0..total);
            let mut k = 0;
            while o >= starts[k] {
                o -= starts[k];
                k += 1;
            }
            window.clear();
            pieces[k].extend(o, seq + 1, &mut window);
            x.extend_from_slice(&window[..seq]);
            y.extend_from_slice(&window[1..]);
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
