//! Token shards as other trainers write them, memory-mapped:
//!
//! - llm.c's: a header of 256 little-endian `i32` (magic, version, token
//!   count, the rest 0), then the tokens: magic 20240520 version 1 with
//!   `u16` tokens (GPT-2), magic 20240801 version 7 with `u32` tokens
//!   (Llama 3);
//! - nanoGPT's: a headerless `.bin` of little-endian `u16` tokens.
//!
//! A file is checked when it is opened: the header against the file's
//! length, and every token read once for the largest (which the model's
//! vocabulary must exceed). Every error names the file and what is wrong.

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use std::fs::File;
use std::path::Path;

/// llm.c's header: 256 `i32`.
pub const HEADER_BYTES: usize = 256 * 4;
/// llm.c's GPT-2 shards: magic and version, `u16` tokens.
pub const LLMC_U16: (i32, i32) = (20240520, 1);
/// llm.c's Llama 3 shards: magic and version, `u32` tokens.
pub const LLMC_U32: (i32, i32) = (20240801, 7);

/// How a shard stores its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// llm.c, magic 20240520 version 1: `u16` after the header.
    LlmcU16,
    /// llm.c, magic 20240801 version 7: `u32` after the header.
    LlmcU32,
    /// nanoGPT: `u16` from the first byte.
    NanoGpt,
}

impl Format {
    /// Bytes a token.
    pub fn token_bytes(self) -> usize {
        match self {
            Self::LlmcU32 => 4,
            Self::LlmcU16 | Self::NanoGpt => 2,
        }
    }

    /// Where the tokens start.
    pub fn offset(self) -> usize {
        match self {
            Self::NanoGpt => 0,
            Self::LlmcU16 | Self::LlmcU32 => HEADER_BYTES,
        }
    }
}

/// One memory-mapped shard.
#[derive(Debug)]
pub struct Shard {
    map: Mmap,
    format: Format,
    len: usize,
    max_token: u32,
}

/// Whether `path` is a token shard (by its first bytes, or `.bin`) rather
/// than a text file.
///
/// # Errors
/// A file that cannot be read.
pub fn is_shard(path: &Path) -> Result<bool> {
    if path.extension().is_some_and(|e| e == "bin") {
        return Ok(true);
    }
    let mut head = [0u8; 8];
    let n = read_head(path, &mut head)?;
    Ok(n == 8 && {
        let magic = i32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        magic == LLMC_U16.0 || magic == LLMC_U32.0
    })
}

fn read_head(path: &Path, buf: &mut [u8]) -> Result<usize> {
    use std::io::Read;
    let mut f = File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
        }
    }
    Ok(n)
}

impl Shard {
    /// Maps `path` and checks it (see the module docs).
    ///
    /// # Errors
    /// A file that cannot be read; an llm.c header with an unknown magic or
    /// version, or a token count the file's length disagrees with; a
    /// headerless file of an odd number of bytes; no tokens.
    pub fn open(path: &Path) -> Result<Self> {
        let name = path.display();
        let file = File::open(path).with_context(|| format!("{name}: cannot open"))?;
        let bytes = file
            .metadata()
            .with_context(|| format!("{name}: cannot read"))?
            .len();
        if bytes == 0 {
            bail!("{name}: an empty file, no tokens");
        }
        // SAFETY: the file is only read; a file changed by another process
        // while it is mapped is the user's to avoid (as for llm.c and
        // nanoGPT, which map or read their shards the same way).
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("{name}: cannot map"))?;
        let format = Self::detect(path, &map)?;
        let body = map.len() - format.offset();
        if body % format.token_bytes() != 0 {
            bail!(
                "{name}: {body} bytes of tokens is not a whole number of {}-byte tokens \
                 (a truncated file?)",
                format.token_bytes()
            );
        }
        let len = body / format.token_bytes();
        if format != Format::NanoGpt {
            let count = i32::from_le_bytes([map[8], map[9], map[10], map[11]]);
            if usize::try_from(count).ok() != Some(len) {
                bail!(
                    "{name}: the header says {count} tokens, the file holds {len} \
                     (a truncated or damaged shard)"
                );
            }
        }
        if len == 0 {
            bail!("{name}: no tokens");
        }
        let mut shard = Self {
            map,
            format,
            len,
            max_token: 0,
        };
        shard.max_token = shard.scan_max();
        Ok(shard)
    }

    /// The format of `map` (the file at `path`).
    fn detect(path: &Path, map: &[u8]) -> Result<Format> {
        let name = path.display();
        let word = |i: usize| -> Option<i32> {
            let b = map.get(4 * i..4 * i + 4)?;
            Some(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let header_like =
            map.len() >= HEADER_BYTES && map[12..HEADER_BYTES].iter().all(|&b| b == 0);
        match (word(0), word(1)) {
            (Some(m), Some(v)) if m == LLMC_U16.0 || m == LLMC_U32.0 => {
                if map.len() < HEADER_BYTES {
                    bail!(
                        "{name}: an llm.c magic ({m}) but only {} bytes, less than its \
                         {HEADER_BYTES}-byte header",
                        map.len()
                    );
                }
                match (m, v) {
                    _ if (m, v) == LLMC_U16 => Ok(Format::LlmcU16),
                    _ if (m, v) == LLMC_U32 => Ok(Format::LlmcU32),
                    _ => bail!(
                        "{name}: llm.c magic {m} with version {v}: known are magic {} \
                         version {} (u16 tokens) and magic {} version {} (u32 tokens)",
                        LLMC_U16.0,
                        LLMC_U16.1,
                        LLMC_U32.0,
                        LLMC_U32.1
                    ),
                }
            }
            // an llm.c header (zeros after its third field) whose magic is
            // not one of llm.c's: a damaged shard, not nanoGPT tokens
            (Some(m), _) if header_like => bail!(
                "{name}: a {HEADER_BYTES}-byte llm.c-style header with magic {m}, which is \
                 neither {} (u16 tokens) nor {} (u32 tokens)",
                LLMC_U16.0,
                LLMC_U32.0
            ),
            _ => Ok(Format::NanoGpt),
        }
    }

    /// The largest token (every token read once).
    fn scan_max(&self) -> u32 {
        let body = &self.map[self.format.offset()..];
        match self.format.token_bytes() {
            2 => body
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                .max(),
            _ => body
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .max(),
        }
        .unwrap_or(0)
    }

    /// How it stores its tokens.
    #[allow(dead_code)] // the tests' (the example reads any format alike)
    pub fn format(&self) -> Format {
        self.format
    }

    /// Tokens in the shard.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The largest token in it.
    pub fn max_token(&self) -> u32 {
        self.max_token
    }

    /// Tokens `start..start + n` appended to `out`.
    ///
    /// # Panics
    /// A range past the end (callers draw ranges within [`len`](Self::len)).
    pub fn extend(&self, start: usize, n: usize, out: &mut Vec<u32>) {
        let b = self.format.token_bytes();
        let bytes =
            &self.map[self.format.offset() + start * b..self.format.offset() + (start + n) * b];
        match b {
            2 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            ),
            _ => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
        }
    }
}

/// Writes `tokens` as a shard of `format` at `path`.
///
/// # Errors
/// A token that does not fit the format's width; the file system's.
#[allow(dead_code)] // the tests'
pub fn write(path: &Path, format: Format, tokens: &[u32]) -> Result<()> {
    let mut bytes = Vec::with_capacity(format.offset() + tokens.len() * format.token_bytes());
    if format != Format::NanoGpt {
        let (magic, version) = match format {
            Format::LlmcU16 => LLMC_U16,
            _ => LLMC_U32,
        };
        let count = i32::try_from(tokens.len()).context("more tokens than llm.c's header holds")?;
        let mut header = [0i32; 256];
        header[..3].copy_from_slice(&[magic, version, count]);
        for h in header {
            bytes.extend_from_slice(&h.to_le_bytes());
        }
    }
    for &t in tokens {
        match format.token_bytes() {
            2 => {
                let t =
                    u16::try_from(t).with_context(|| format!("token {t} does not fit in u16"))?;
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            _ => bytes.extend_from_slice(&t.to_le_bytes()),
        }
    }
    std::fs::write(path, bytes).with_context(|| format!("{}: cannot write", path.display()))
}
