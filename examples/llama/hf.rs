//! Hugging Face Llama checkpoints in and out (`--init-from DIR`,
//! `--export DIR`): a directory of `model.safetensors` (on load, or the
//! shards of `model.safetensors.index.json`) and `config.json` as
//! `transformers`' `LlamaForCausalLM.save_pretrained` writes it.
//!
//! | Hugging Face (`model.` prefix) | shape | this model |
//! |---|---|---|
//! | `embed_tokens.weight` | `[vocab, d]` | `embed.weight`, rows past the config's vocabulary kept as initialised |
//! | `layers.{i}.input_layernorm.weight` | `[d]` | `layers.{i}.attn_norm.weight` |
//! | `layers.{i}.self_attn.{q,k,v}_proj.weight` | `[heads hd, d]`, `[kv hd, d]` twice | stacked: `layers.{i}.attn.qkv.weight` |
//! | `layers.{i}.self_attn.o_proj.weight` | `[d, d]` | `layers.{i}.attn.o.weight` |
//! | `layers.{i}.post_attention_layernorm.weight` | `[d]` | `layers.{i}.mlp.layer_norm.weight` |
//! | `layers.{i}.mlp.{gate,up}_proj.weight` | `[f, d]` twice | stacked: `layers.{i}.mlp.fc1.weight` |
//! | `layers.{i}.mlp.down_proj.weight` | `[d, f]` | `layers.{i}.mlp.fc2.weight` |
//! | `norm.weight` | `[d]` | `norm.weight` |
//! | `lm_head.weight` (no prefix) | `[vocab, d]` | none when tied (the head reads `embed.weight`); else `lm_head.weight`, a copy of `embed_tokens` where absent |
//!
//! Every Linear is `nn.Linear` (`[out, in]`, this model's layout); q and
//! k are in the `rotate_half` order `transformers` uses (its own
//! checkpoints are; Meta's original ones are permuted by its converter).
//! Loading refuses an unknown tensor, a missing one, a wrong shape, and a
//! configuration this model does not compute (another activation, biases
//! on the projections, a RoPE scaling other than Llama 3's). A tied
//! checkpoint (`tie_word_embeddings: true`, as Llama-3.2-1B's; `false` is
//! `transformers`' default for Llama) makes a tied model unless the run
//! unties it (`--tie-embeddings false`: the head starts as a copy of the
//! embedding). The export writes the model's tying and trims the
//! vocabulary back to `vocab_out`.

use crate::model::LlamaConfig;
use amp::nn::RopeScaling;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_nn::VarMap;
use std::collections::HashMap;
use std::path::Path;

/// The fields of Llama's `config.json` this model reads (others ignored).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct HfConfig {
    /// Vocabulary.
    pub vocab_size: usize,
    /// Width.
    pub hidden_size: usize,
    /// The MLP's inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key and value heads (`null`: as many as the query heads).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// The longest sequence.
    pub max_position_embeddings: usize,
    /// RMSNorm's epsilon.
    #[serde(default = "rms_eps")]
    pub rms_norm_eps: f64,
    /// RoPE's base.
    #[serde(default = "theta")]
    pub rope_theta: f64,
    /// RoPE's scaling (`rope_type` "llama3" or none).
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// The MLP's activation (`silu`: SwiGLU).
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// Biases on q, k, v and o.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on the MLP's projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Whether `lm_head` is the embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// The head dimension where the config states it (this model's is
    /// `hidden_size / num_attention_heads`).
    #[serde(default)]
    pub head_dim: Option<usize>,
}

impl HfConfig {
    /// The positions the checkpoint has (its longest sequence).
    pub fn positions(&self) -> usize {
        self.max_position_embeddings
    }

    /// Key and value heads.
    fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }
}

fn rms_eps() -> f64 {
    1e-6
}
fn theta() -> f64 {
    10_000.0
}
fn silu() -> String {
    "silu".into()
}

/// Llama 3's scaling from `rope_scaling`, or none; another kind is refused.
fn scaling(name: &str, v: &Option<serde_json::Value>) -> Result<Option<RopeScaling>> {
    let Some(v) = v.as_ref().filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|t| t.as_str())
        .unwrap_or("");
    if kind != "llama3" {
        bail!("{name}: rope_scaling of type `{kind}`: this model computes Llama 3's (`llama3`) or none");
    }
    let s: RopeScaling = serde_json::from_value(v.clone())
        .with_context(|| format!("{name}: rope_scaling is not Llama 3's"))?;
    Ok(Some(s))
}

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
        .with_context(|| format!("{}: not a Llama config", path.display()))?;
    let name = path.display().to_string();
    if c.hidden_act != "silu" {
        bail!(
            "{name}: hidden_act `{}`: this Llama computes SwiGLU (`silu`)",
            c.hidden_act
        );
    }
    if c.attention_bias || c.mlp_bias {
        bail!("{name}: biases on the projections: this Llama has none");
    }
    let (h, kv) = (c.num_attention_heads, c.kv_heads());
    if h == 0 || kv == 0 || h % kv != 0 || c.hidden_size % h != 0 || (c.hidden_size / h) % 2 != 0 {
        bail!(
            "{name}: hidden_size {} over {h} heads and {kv} key/value heads: not a model this \
             Llama computes (an even head dimension, key/value heads dividing the heads)",
            c.hidden_size
        );
    }
    if let Some(hd) = c.head_dim.filter(|&hd| hd * h != c.hidden_size) {
        bail!(
            "{name}: head_dim {hd} is not hidden_size {} over {h} heads: this Llama's \
             projections are as wide as the model",
            c.hidden_size
        );
    }
    if c.vocab_size == 0 || c.max_position_embeddings == 0 || c.intermediate_size == 0 {
        bail!("{name}: vocab_size, intermediate_size and max_position_embeddings must be positive");
    }
    scaling(&name, &c.rope_scaling)?;
    Ok(c)
}

/// This model's shape for `hf`, its vocabulary padded to `vocab` where
/// that is larger, the rotary tables for `seq` positions (a RoPE scaling
/// [`read_config`] refused is left out here).
pub fn model_config(hf: &HfConfig, vocab: usize, seq: usize) -> LlamaConfig {
    LlamaConfig {
        n_layer: hf.num_hidden_layers,
        n_head: hf.num_attention_heads,
        n_kv_head: hf.kv_heads(),
        dim: hf.hidden_size,
        hidden: hf.intermediate_size,
        vocab: hf.vocab_size.max(vocab),
        ctx: seq.min(hf.max_position_embeddings),
        rope_theta: hf.rope_theta,
        // checked by read_config
        rope_scaling: scaling("config.json", &hf.rope_scaling).ok().flatten(),
        norm_eps: hf.rms_norm_eps,
        tied: hf.tie_word_embeddings,
    }
}

/// The Hugging Face tensors that make this model's `ours`, in order
/// (stacked along the rows where more than one).
fn sources(ours: &str) -> Vec<String> {
    let layer = |rest: &str| -> Option<String> {
        let i = ours.strip_prefix("layers.")?.strip_suffix(rest)?;
        Some(format!("model.layers.{i}."))
    };
    if let Some(p) = layer(".attn.qkv.weight") {
        return ["q_proj", "k_proj", "v_proj"]
            .iter()
            .map(|s| format!("{p}self_attn.{s}.weight"))
            .collect();
    }
    if let Some(p) = layer(".mlp.fc1.weight") {
        return ["gate_proj", "up_proj"]
            .iter()
            .map(|s| format!("{p}mlp.{s}.weight"))
            .collect();
    }
    let one = |p: String, s: &str| vec![format!("{p}{s}")];
    if let Some(p) = layer(".attn.o.weight") {
        return one(p, "self_attn.o_proj.weight");
    }
    if let Some(p) = layer(".mlp.fc2.weight") {
        return one(p, "mlp.down_proj.weight");
    }
    if let Some(p) = layer(".attn_norm.weight") {
        return one(p, "input_layernorm.weight");
    }
    if let Some(p) = layer(".mlp.layer_norm.weight") {
        return one(p, "post_attention_layernorm.weight");
    }
    match ours {
        "embed.weight" => vec!["model.embed_tokens.weight".into()],
        "norm.weight" => vec!["model.norm.weight".into()],
        other => vec![other.to_string()],
    }
}

/// Sets every variable of `varmap` (a model of shape `cfg`, from
/// [`model_config`]) from `DIR/model.safetensors` or its shards
/// (`crate::hf_io::read_tensors`).
///
/// # Errors
/// A missing, unknown or misshapen tensor (the error names it and the file).
pub fn load_into(dir: &Path, hf: &HfConfig, cfg: &LlamaConfig, varmap: &VarMap) -> Result<()> {
    let (name, raw) = crate::hf_io::read_tensors(dir)?;
    let mut tensors: HashMap<String, Tensor> = raw
        .into_iter()
        .filter(|(k, _)| !k.ends_with("rotary_emb.inv_freq"))
        .collect();
    let tying = (hf.tie_word_embeddings, cfg.tied);
    crate::hf_io::head_tensor(
        &mut tensors,
        "model.embed_tokens.weight",
        tying,
        &name.to_string(),
    )?;
    let data = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("the VarMap's lock is poisoned"))?;
    for (ours, var) in data.iter() {
        let parts = sources(ours)
            .iter()
            .map(|k| {
                tensors
                    .remove(k)
                    .with_context(|| {
                        format!("{name}: no `{k}` (Llama with {} layers)", cfg.n_layer)
                    })?
                    .to_dtype(DType::F32)
                    .map_err(anyhow::Error::from)
            })
            .collect::<Result<Vec<_>>>()?;
        let t = Tensor::cat(&parts, 0)?;
        let want = var.shape().dims().to_vec();
        let t = if ours == "embed.weight" || ours == "lm_head.weight" {
            crate::hf_io::padded_rows(&name.to_string(), ours, t, var, (hf.vocab_size, cfg.dim))?
        } else {
            t
        };
        if t.dims() != want.as_slice() {
            bail!(
                "{name}: `{ours}` is {:?} as this model reads it, the model needs {want:?}",
                t.dims()
            );
        }
        var.set(&t.to_device(var.device())?)?;
    }
    if let Some(extra) = tensors.keys().next() {
        bail!("{name}: `{extra}` is not a Llama tensor this model knows");
    }
    Ok(())
}

/// Writes `weights` (this model's names and layouts, F32 or BF16, from
/// `AmpContext::export_weights`) as a Hugging Face Llama directory `dir`:
/// `model.safetensors` in their dtype and `config.json`, the vocabulary
/// trimmed to `vocab_out`.
///
/// # Errors
/// The file system's; candle's.
pub fn write_dir(
    dir: &Path,
    weights: Vec<(String, Tensor)>,
    cfg: &LlamaConfig,
    vocab_out: usize,
) -> Result<()> {
    let dtype = weights.first().map_or(DType::F32, |(_, t)| t.dtype());
    let vocab_out = vocab_out.min(cfg.vocab);
    let hd = cfg.head_dim();
    let mut out: Vec<(String, Tensor)> = Vec::with_capacity(weights.len() + 3 * cfg.n_layer);
    for (k, v) in weights {
        let v = if k == "embed.weight" || k == "lm_head.weight" {
            v.narrow(0, 0, vocab_out)?.contiguous()?
        } else {
            v
        };
        let rows: Vec<usize> = if k.ends_with(".attn.qkv.weight") {
            vec![cfg.n_head * hd, cfg.n_kv_head * hd, cfg.n_kv_head * hd]
        } else if k.ends_with(".mlp.fc1.weight") {
            vec![cfg.hidden, cfg.hidden]
        } else {
            vec![v.dim(0)?]
        };
        let mut start = 0;
        for (key, n) in sources(&k).into_iter().zip(rows) {
            out.push((key, v.narrow(0, start, n)?.contiguous()?));
            start += n;
        }
    }
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_out,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "head_dim": hd,
        "max_position_embeddings": cfg.ctx,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": cfg.tied,
        "initializer_range": 0.02,
        "torch_dtype": if dtype == DType::BF16 { "bfloat16" } else { "float32" },
    });
    if let Some(s) = &cfg.rope_scaling {
        let mut v = serde_json::to_value(s)?;
        v["rope_type"] = "llama3".into();
        config["rope_scaling"] = v;
    }
    crate::hf_io::write_dir(dir, &out, &config)
}
