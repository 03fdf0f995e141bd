//! What both examples' Hugging Face modules (`hf.rs`) do alike: a
//! checkpoint's tensors read from one `model.safetensors` or from the
//! shards its `model.safetensors.index.json` names, the head tied or not on
//! load, the embedding's and head's rows padded past a checkpoint's
//! vocabulary, and a directory of `model.safetensors` and `config.json`
//! written on export.

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var};
use std::collections::HashMap;
use std::path::Path;

/// Every tensor of the Hugging Face checkpoint in `dir`, on the CPU in its
/// stored dtype: `model.safetensors`, or where there is none the shards
/// that `model.safetensors.index.json` maps the tensors to (as
/// `save_pretrained` writes a model above its shard size). Returns the
/// file that names them, for messages.
///
/// # Errors
/// Neither file (a PyTorch `.bin` checkpoint is named as such); an
/// unreadable or malformed index; a shard outside `dir`, unreadable, or
/// without a tensor the index maps to it; a tensor in two shards.
pub fn read_tensors(dir: &Path) -> Result<(String, HashMap<String, Tensor>)> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        let name = single.display().to_string();
        let t = candle_core::safetensors::load(&single, &Device::Cpu)
            .with_context(|| format!("{name}: cannot read"))?;
        return Ok((name, t));
    }
    let index = dir.join("model.safetensors.index.json");
    let name = index.display().to_string();
    if !index.exists() {
        let bin = dir.join("pytorch_model.bin").exists();
        bail!(
            "{}: no model.safetensors or model.safetensors.index.json{}",
            dir.display(),
            if bin {
                " (a PyTorch .bin checkpoint: save it again with safe_serialization=True)"
            } else {
                ""
            }
        );
    }
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let text = std::fs::read_to_string(&index).with_context(|| format!("{name}: cannot read"))?;
    let index: Index =
        serde_json::from_str(&text).with_context(|| format!("{name}: not a safetensors index"))?;
    let mut by_file: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for (tensor, file) in &index.weight_map {
        let plain = Path::new(file)
            .file_name()
            .is_some_and(|f| f == std::ffi::OsStr::new(file));
        if !plain || file == ".." {
            bail!("{name}: shard `{file}` of `{tensor}` is not a file in the directory");
        }
        by_file.entry(file).or_default().push(tensor);
    }
    let mut tensors = HashMap::new();
    for (file, wanted) in by_file {
        let path = dir.join(file);
        let mut shard = candle_core::safetensors::load(&path, &Device::Cpu)
            .with_context(|| format!("{}: cannot read (a shard {name} names)", path.display()))?;
        for tensor in wanted {
            let t = shard.remove(tensor).with_context(|| {
                format!("{}: no `{tensor}`, which {name} maps to it", path.display())
            })?;
            if tensors.insert(tensor.to_string(), t).is_some() {
                bail!("{name}: `{tensor}` is in two shards");
            }
        }
    }
    Ok((name, tensors))
}

/// Makes a checkpoint's `tensors` hold what the model's head reads, as
/// `transformers` does: a tied model (`model_tied`) reads no
/// `lm_head.weight` (a copy a tied checkpoint carries is dropped); an
/// untied one reads the checkpoint's own, or a copy of the embedding
/// `embed_key` where the checkpoint is tied (`hf_tied`) or has none.
///
/// # Errors
/// A tied model over a checkpoint with a head of its own (its weights
/// would be lost), no embedding to copy; both name the file `name`.
pub fn head_tensor(
    tensors: &mut HashMap<String, Tensor>,
    embed_key: &str,
    (hf_tied, model_tied): (bool, bool),
    name: &str,
) -> Result<()> {
    const HEAD: &str = "lm_head.weight";
    if model_tied {
        if !hf_tied && tensors.contains_key(HEAD) {
            bail!(
                "{name}: the checkpoint trains `{HEAD}` apart from the embedding \
                 (tie_word_embeddings false): tying them would drop it"
            );
        }
        tensors.remove(HEAD);
    } else if hf_tied || !tensors.contains_key(HEAD) {
        let e = tensors
            .get(embed_key)
            .with_context(|| format!("{name}: no {embed_key}"))?
            .clone();
        tensors.insert(HEAD.into(), e);
    }
    Ok(())
}

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
