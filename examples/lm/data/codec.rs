//! Text to tokens and back: bytes (the default, a vocabulary of 256), or a
//! Hugging Face `tokenizer.json` (`--tokenizer`, read with the `tokenizers`
//! crate), for raw text under `--data` and for `--sample`'s prompt and
//! output.

use anyhow::{anyhow, bail, Context, Result};
use std::path::Path;

/// How text becomes tokens.
#[derive(Clone, Default)]
pub enum Codec {
    /// One token a byte.
    #[default]
    Bytes,
    /// A Hugging Face tokenizer (its file, for messages).
    Tokenizer(Box<tokenizers::Tokenizer>, String),
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bytes => f.write_str("Bytes"),
            Self::Tokenizer(_, file) => write!(f, "Tokenizer({file})"),
        }
    }
}

impl Codec {
    /// `--tokenizer FILE`: a `tokenizer.json` as Hugging Face saves it.
    ///
    /// # Errors
    /// A file that cannot be read or is not a tokenizer (the error names
    /// the file), or a tokenizer with an empty vocabulary.
    pub fn from_file(path: &Path) -> Result<Self> {
        let file = path.display().to_string();
        let bytes = std::fs::read(path).with_context(|| format!("reading {file}"))?;
        let tok = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow!("{file}: not a Hugging Face tokenizer.json: {e}"))?;
        if tok.get_vocab_size(true) == 0 {
            bail!("{file}: the tokenizer has an empty vocabulary");
        }
        Ok(Self::Tokenizer(Box::new(tok), file))
    }

    /// Tokens the vocabulary holds: the model's `--vocab` must be at least
    /// this.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Bytes => super::VOCAB,
            Self::Tokenizer(t, _) => t.get_vocab_size(true),
        }
    }

    /// The tokens of `text` (bytes that are not UTF-8 are an error for a
    /// tokenizer: it reads text).
    ///
    /// # Errors
    /// Text that is not UTF-8, or the tokenizer's error.
    pub fn encode(&self, text: &[u8]) -> Result<Vec<u32>> {
        match self {
            Self::Bytes => Ok(super::encode(text)),
            Self::Tokenizer(t, file) => {
                let s = std::str::from_utf8(text)
                    .map_err(|e| anyhow!("the text is not UTF-8 ({e}): {file} reads text"))?;
                let enc = t
                    .encode(s, false)
                    .map_err(|e| anyhow!("{file}: cannot tokenize the text: {e}"))?;
                Ok(enc.get_ids().to_vec())
            }
        }
    }

    /// The text of `tokens`; with a tokenizer, tokens beyond its
    /// vocabulary (a model's padded rows) are left out. Bytes that are not
    /// UTF-8 print as U+FFFD.
    ///
    /// # Errors
    /// The tokenizer's.
    pub fn decode(&self, tokens: &[u32]) -> Result<String> {
        match self {
            Self::Bytes => Ok(super::decode(tokens)),
            Self::Tokenizer(t, file) => {
                let n = t.get_vocab_size(true);
                let known: Vec<u32> = tokens
                    .iter()
                    .copied()
                    .filter(|&i| (i as usize) < n)
                    .collect();
                t.decode(&known, false)
                    .map_err(|e| anyhow!("{file}: cannot decode: {e}"))
            }
        }
    }
}
