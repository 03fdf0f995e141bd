//! Shared by the GPT example's test files (which include its modules).

use crate::data::Corpus;
use crate::train::{train, Summary, TrainConfig};
use std::path::Path;

/// `cfg` run whole, then again stopped after step `at` with a checkpoint
/// at `ckpt`, then resumed from it: (the whole run, the resumed part).
pub fn whole_and_resumed(
    cfg: &TrainConfig,
    corpus: &Corpus,
    at: u64,
    ckpt: &Path,
) -> anyhow::Result<(Summary, Summary)> {
    let whole = train(cfg, corpus)?;
    train(
        &TrainConfig {
            stop_at: Some(at),
            save: Some(ckpt.to_path_buf()),
            ..cfg.clone()
        },
        corpus,
    )?;
    let rest = train(
        &TrainConfig {
            resume: Some(ckpt.to_path_buf()),
            ..cfg.clone()
        },
        corpus,
    )?;
    Ok((whole, rest))
}
