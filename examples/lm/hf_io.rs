//! What both examples' Hugging Face modules (`hf.rs`) do alike: the
//! embedding's and head's rows padded past a checkpoint's vocabulary on
//! load, and a directory of `model.safetensors` and `config.json` written
//! on export.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var};
use std::path::Path;

/// A checkpoint's `[vocab, width]` table `t` as the model's variable `var`
/// (`ours`, in file `name`) holds it: the rows past the checkpoint's
/// vocabulary keep their initial values.
///
/// # Errors
/// A table whose shape is not the config's `[vocab, width]`; candle's.
pub fn padded_rows(
    name: &str,
    ours: &str,
    t: Tensor,
    var: &Var,
    (vocab, width): (usize, usize),
) -> Result<Tensor> {
    let want = var.shape().dims().to_vec();
    let rows = t.dim(0)?;
    if rows != vocab || t.dims()[1..] != want[1..] {
        bail!(
            "{name}: `{ours}` is {:?}, the config says [{vocab}, {width}]",
            t.dims()
        );
    }
    if rows >= want[0] {
        return Ok(t);
    }
    let rest = var
        .as_tensor()
        .narrow(0, rows, want[0] - rows)?
        .to_device(&Device::Cpu)?;
    Ok(Tensor::cat(&[&t, &rest], 0)?)
}

/// Writes `tensors` as `dir/model.safetensors` and `config` as
/// `dir/config.json`, creating `dir`.
///
/// # Errors
/// The file system's.
pub fn write_dir(
    dir: &Path,
    tensors: &[(String, Tensor)],
    config: &serde_json::Value,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let st = dir.join("model.safetensors");
    amp::levels::write_tensors(&st, tensors)
        .with_context(|| format!("{}: cannot write", st.display()))?;
    let cj = dir.join("config.json");
    std::fs::write(&cj, serde_json::to_string_pretty(config)? + "\n")
        .with_context(|| format!("{}: cannot write", cj.display()))
}
