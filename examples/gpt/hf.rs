//! Hugging Face GPT-2 checkpoints in and out (`--init-from DIR`,
//! `--export DIR`): a directory of `model.safetensors` (on load, or the
//! shards of `model.safetensors.index.json`) and `config.json` as
//! `transformers`' `GPT2LMHeadModel.save_pretrained` writes it.
//!
//! | Hugging Face (`transformer.` prefix optional on load) | shape | this model |
//! |---|---|---|
//! | `wte.weight` | `[vocab, d]` | `wte.weight`, rows past the config's vocabulary kept as initialised |
//! | `wpe.weight` | `[n_positions, d]` | `wpe.weight` (the context is `n_positions`) |
//! | `h.{i}.ln_1.{weight,bias}`, `h.{i}.ln_2.*`, `ln_f.*` | `[d]` | the same |
//! | `h.{i}.attn.c_attn.weight` | `[d, 3d]` (`Conv1D`: in, out) | transposed: `[3d, d]` |
//! | `h.{i}.attn.c_proj.weight` | `[d, d]` (in, out) | transposed |
//! | `h.{i}.mlp.c_fc.weight` | `[d, 4d]` (in, out) | transposed: `[4d, d]` |
//! | `h.{i}.mlp.c_proj.weight` | `[4d, d]` (in, out) | transposed: `[d, 4d]` |
//! | `h.{i}.*.bias` | `[out]` | the same |
//! | `lm_head.weight` | `[vocab, d]` (`nn.Linear`) | none when tied (the head reads `wte`); else `lm_head.weight`, a copy of `wte` where absent |
//!
//! Loading ignores the attention-mask buffers older checkpoints carry
//! (`h.{i}.attn.bias`, `h.{i}.attn.masked_bias`) and refuses any other
//! tensor it does not know, a missing one, a wrong shape, and a
//! configuration this model does not compute (another activation, layer
//! norm epsilon or attention scaling). A tied checkpoint
//! (`tie_word_embeddings`, `transformers`' default for GPT-2) makes a tied
//! model unless the run unties it (`--tie-embeddings false`: the head
//! starts as a copy of `wte`). The export writes the model's tying and
//! trims the vocabulary back to `vocab_out` (the loaded config's, where
//! the model pads it, e.g. 50257 of 50304).

use crate::model::GptConfig;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_nn::VarMap;
use std::collections::HashMap;
use std::path::Path;

/// The fields of GPT-2's `config.json` this model reads (others ignored).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct HfConfig {
    /// Vocabulary.
    pub vocab_size: usize,
    /// Context length (learned positions).
    pub n_positions: usize,
    /// Width.
    pub n_embd: usize,
    /// Blocks.
    pub n_layer: usize,
    /// Heads.
    pub n_head: usize,
    /// The MLP's inner width (`null`: 4 x `n_embd`).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// The MLP's activation.
    #[serde(default = "gelu_new")]
    pub activation_function: String,
    /// LayerNorm's epsilon.
    #[serde(default = "ln_eps")]
    pub layer_norm_epsilon: f64,
    /// Whether `lm_head` is `wte`.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Attention scaled by `1 / sqrt(head dim)`.
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Attention also scaled by `1 / (layer + 1)`.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
}

impl HfConfig {
    /// The positions the checkpoint has (its longest sequence).
    pub fn positions(&self) -> usize {
        self.n_positions
    }
}

fn gelu_new() -> String {
    "gelu_new".into()
}
fn ln_eps() -> f64 {
    1e-5
}
fn yes() -> bool {
    true
}

/// The activations that are this model's GELU (the tanh approximation).
const TANH_GELUS: [&str; 3] = ["gelu_new", "gelu_pytorch_tanh", "gelu_fast"];

/// `DIR/config.json`, checked against what this model computes.
///
/// # Errors
/// A missing or malformed file; a configuration this model does not
/// compute (the error says which field).
pub fn read_config(dir: &Path) -> Result<HfConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let c: HfConfig = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a GPT-2 config", path.display()))?;
    let name = path.display();
    if !TANH_GELUS.contains(&c.activation_function.as_str()) {
        bail!(
            "{name}: activation_function `{}`: this GPT computes GELU's tanh approximation \
             (one of {})",
            c.activation_function,
            TANH_GELUS.join(", ")
        );
    }
    if (c.layer_norm_epsilon - crate::model::LN_EPS).abs() > 1e-12 {
        bail!(
            "{name}: layer_norm_epsilon {}: this GPT uses {}",
            c.layer_norm_epsilon,
            crate::model::LN_EPS
        );
    }
    if c.n_inner.is_some_and(|n| n != 4 * c.n_embd) {
        bail!(
            "{name}: n_inner {:?}: this GPT's MLP is 4 x n_embd wide",
            c.n_inner
        );
    }
    if !c.scale_attn_weights || c.scale_attn_by_inverse_layer_idx {
        bail!("{name}: attention scaled otherwise than by 1 / sqrt(head dim)");
    }
    if c.n_head == 0 || c.n_embd % c.n_head != 0 || c.vocab_size == 0 || c.n_positions == 0 {
        bail!(
            "{name}: n_embd {} over n_head {}, vocab_size {}, n_positions {}: not a model",
            c.n_embd,
            c.n_head,
            c.vocab_size,
            c.n_positions
        );
    }
    Ok(c)
}

/// This model's shape for `hf`, its vocabulary padded to `vocab` where
/// that is larger (e.g. 50304 for 50257); the context is the checkpoint's
/// (learned positions), whatever the run's sequence length.
pub fn model_config(hf: &HfConfig, vocab: usize, _seq: usize) -> GptConfig {
    GptConfig {
        n_layer: hf.n_layer,
        n_head: hf.n_head,
        n_embd: hf.n_embd,
        vocab: hf.vocab_size.max(vocab),
        ctx: hf.n_positions,
        tied: hf.tie_word_embeddings,
    }
}

/// Whether this model's parameter `name` is a Linear weight that GPT-2
/// stores transposed (`Conv1D`).
fn conv1d(name: &str) -> bool {
    [
        "attn.c_attn.weight",
        "attn.c_proj.weight",
        "mlp.c_fc.weight",
        "mlp.c_proj.weight",
    ]
    .iter()
    .any(|s| name.ends_with(s))
}

/// Sets every variable of `varmap` (a model of shape `cfg`, from
/// [`model_config`]) from `DIR/model.safetensors` or its shards
/// (`crate::hf_io::read_tensors`).
///
/// # Errors
/// A missing, unknown or misshapen tensor (the error names it and the file).
pub fn load_into(dir: &Path, hf: &HfConfig, cfg: &GptConfig, varmap: &VarMap) -> Result<()> {
    let (name, raw) = crate::hf_io::read_tensors(dir)?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (k, v) in raw {
        let k = k.strip_prefix("transformer.").unwrap_or(&k).to_string();
        if k.ends_with(".attn.bias") || k.ends_with(".attn.masked_bias") {
            continue; // the causal mask, a buffer
        }
        tensors.insert(k, v);
    }
    let tying = (hf.tie_word_embeddings, cfg.tied);
    crate::hf_io::head_tensor(&mut tensors, "wte.weight", tying, &name.to_string())?;
    let data = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the VarMap's lock is poisoned"))?;
    for (ours, var) in data.iter() {
        let Some(t) = tensors.remove(ours) else {
            bail!("{name}: no `{ours}` (GPT-2 with {} blocks)", cfg.n_layer);
        };
        let t = t.to_dtype(DType::F32)?;
        let t = if conv1d(ours) {
            t.t()?.contiguous()?
        } else {
            t
        };
        let want = var.shape().dims().to_vec();
        let t = if ours == "wte.weight" || ours == "lm_head.weight" {
            crate::hf_io::padded_rows(&name.to_string(), ours, t, var, (hf.vocab_size, cfg.n_embd))?
        } else {
            t
        };
        if t.dims() != want.as_slice() {
            let stored = if conv1d(ours) { "transposed, " } else { "" };
            bail!(
                "{name}: `{ours}` is {:?} ({stored}as this model reads it), the model needs {want:?}",
                t.dims()
            );
        }
        var.set(&t.to_device(var.device())?)?;
    }
    if let Some(extra) = tensors.keys().next() {
        bail!("{name}: `{extra}` is not a GPT-2 tensor this model knows");
    }
    Ok(())
}

/// Writes `weights` (this model's names and layouts, F32 or BF16, from
/// `AmpContext::export_weights`) as a Hugging Face GPT-2 directory `dir`:
/// `model.safetensors` in their dtype and `config.json`, the vocabulary
/// trimmed to `vocab_out`.
///
/// # Errors
/// The file system's; candle's.
pub fn write_dir(
    dir: &Path,
    weights: Vec<(String, Tensor)>,
    cfg: &GptConfig,
    vocab_out: usize,
) -> Result<()> {
    let dtype = weights.first().map_or(DType::F32, |(_, t)| t.dtype());
    let vocab_out = vocab_out.min(cfg.vocab);
    let mut out: Vec<(String, Tensor)> = Vec::with_capacity(weights.len());
    for (k, v) in weights {
        let v = if conv1d(&k) { v.t()?.contiguous()? } else { v };
        let v = if k == "wte.weight" || k == "lm_head.weight" {
            v.narrow(0, 0, vocab_out)?.contiguous()?
        } else {
            v
        };
        let key = if k == "lm_head.weight" {
            k
        } else {
            format!("transformer.{k}")
        };
        out.push((key, v));
    }
    let config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_out,
        "n_positions": cfg.ctx,
        "n_ctx": cfg.ctx,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": crate::model::LN_EPS,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "tie_word_embeddings": cfg.tied,
        "torch_dtype": if dtype == DType::BF16 { "bfloat16" } else { "float32" },
    });
    crate::hf_io::write_dir(dir, &out, &config)
}
