//! A Llama-architecture decoder (RMSNorm, rotary positions with Llama 3's
//! frequency scaling, grouped-query attention, the SwiGLU MLP, no biases)
//! built from `amp::nn` layers, trained by the loop the GPT example shares
//! (`examples/lm`). Its code does not change with the level:
//! `amp::initialize` converts the Linear weights in place.
//!
//! Parameter names: `embed.weight`, `layers.{i}.attn_norm.weight`,
//! `layers.{i}.attn.qkv.weight` (q's rows, then k's, then v's: Hugging
//! Face's `q_proj`, `k_proj`, `v_proj` stacked), `layers.{i}.attn.o.weight`,
//! `layers.{i}.mlp.layer_norm.weight`, `layers.{i}.mlp.fc1.weight`
//! (`gate_proj` then `up_proj` stacked), `layers.{i}.mlp.fc2.weight`
//! (`down_proj`), `norm.weight`, `lm_head.weight`. The head is trained
//! apart from the embedding unless the config ties them (then there is no
//! `lm_head.weight`: the head's product reads `embed.weight`).

use crate::block::{AttentionHalf, MlpHalf, PreNormBlock};
use crate::recompute::{CoreResult, Recompute};
use amp::nn::{self, Activation, LayerNorm, LayerNormMLP, Linear, MlpForm, RopeScaling, Stream};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// The architecture, for messages and plots.
pub const ARCH: &str = "Llama";
/// The example's name (the command's).
pub const BIN: &str = "llama";
/// The command's one-line help.
pub const ABOUT: &str =
    "Train a Llama-style decoder on the bundled corpus with candle-amp at any optimization level";
/// The model the shared training loop (`examples/lm`) trains.
pub type Model = Llama;
/// Its shape.
pub type Config = LlamaConfig;

/// The shape of a Llama.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct LlamaConfig {
    /// Decoder layers.
    pub n_layer: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key and value heads (grouped-query attention below `n_head`).
    pub n_kv_head: usize,
    /// Width.
    pub dim: usize,
    /// The MLP's inner width (SwiGLU's; fc1 is twice it).
    pub hidden: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Positions the rotary tables cover (the run's sequence length).
    pub ctx: usize,
    /// RoPE's base.
    pub rope_theta: f64,
    /// Llama 3's frequency scaling, where the model has it.
    pub rope_scaling: Option<RopeScaling>,
    /// RMSNorm's epsilon.
    pub norm_eps: f64,
    /// The head is the embedding (`tie_word_embeddings`, as Llama-3.2-1B)
    /// instead of a weight of its own.
    pub tied: bool,
}

/// The sizes by name: (name, layers, heads, kv heads, width, inner width).
/// `tiny` trains on two CPU cores in minutes; `1b` is Llama-3.2-1B's
/// shape (with its RoPE scaling; vocabulary from `--vocab`, 128256 for
/// its tokenizer).
pub const SIZES: [(&str, usize, usize, usize, usize, usize); 3] = [
    ("tiny", 4, 4, 2, 128, 352),
    ("150m", 12, 12, 4, 768, 2048),
    ("1b", 16, 32, 8, 2048, 8192),
];

impl LlamaConfig {
    /// The named size with a vocabulary and a sequence length.
    ///
    /// # Errors
    /// An unknown name, a zero vocabulary or context.
    pub fn named(size: &str, vocab: usize, ctx: usize) -> Result<Self> {
        let Some(&(name, n_layer, n_head, n_kv_head, dim, hidden)) =
            SIZES.iter().find(|s| s.0 == size)
        else {
            let names: Vec<&str> = SIZES.iter().map(|s| s.0).collect();
            bail!("unknown size `{size}`: one of {}", names.join(", "));
        };
        if vocab == 0 || ctx == 0 {
            bail!("vocabulary ({vocab}) and context ({ctx}) must be positive");
        }
        let llama32 = name == "1b";
        Ok(Self {
            n_layer,
            n_head,
            n_kv_head,
            dim,
            hidden,
            vocab,
            ctx,
            rope_theta: if llama32 { 500_000.0 } else { 10_000.0 },
            rope_scaling: llama32.then_some(RopeScaling {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            }),
            norm_eps: 1e-5,
            tied: false,
        })
    }

    /// The head dimension.
    pub fn head_dim(&self) -> usize {
        self.dim / self.n_head.max(1)
    }

    /// Whether attention runs as flash attention on CUDA, unless turned off.
    pub fn flash_head_dim(&self) -> bool {
        self.n_head > 0 && self.dim % self.n_head == 0 && nn::flash_head_dim(self.head_dim())
    }

    /// The parameters of one layer's Linears.
    fn layer_linear(&self) -> usize {
        let (d, hd) = (self.dim, self.head_dim());
        d * (self.n_head + 2 * self.n_kv_head) * hd + d * d + d * 2 * self.hidden + self.hidden * d
    }

    /// Parameters in all.
    pub fn params(&self) -> usize {
        let d = self.dim;
        let tables = if self.tied { 1 } else { 2 };
        self.n_layer * (self.layer_linear() + 2 * d) + d + tables * self.vocab * d
    }

    /// Training FLOPs per token at sequence length `seq`: `6 N + 12 layers
    /// width seq`, `N` every parameter but the embedding (a lookup; a tied
    /// table counts once, as the head's product).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let lookup = if self.tied { 0 } else { self.vocab * self.dim };
        let n = (self.params() - lookup) as f64;
        6.0 * n + 12.0 * (self.n_layer * self.dim * seq) as f64
    }

    /// What the memory estimate needs (`crate::budget`). Per token and
    /// layer the block keeps its input and the residual between its halves
    /// and fc1's output (2 inner widths) at the activations' width; flash
    /// attention keeps q, the key and value heads repeated for each group,
    /// and its output in BF16; the FP8 codes of the four products' inputs.
    /// With native products (O0) 27 d at the activations' width (1B on an
    /// H100: 63.9 GB measured, about 66.7 estimated). Checked on the CPU against
    /// the heap's peak at every recompute mode (`tests/gpt/llama.rs`).
    pub fn shape(&self) -> crate::budget::Shape {
        let (d, f) = (self.dim, self.hidden);
        crate::budget::Shape {
            layers: self.n_layer,
            width: d,
            heads: self.n_head,
            vocab: self.vocab,
            params: self.params(),
            linear: self.n_layer * self.layer_linear(),
            largest_linear: 2 * f * d,
            kept: 2 * d + 2 * f,
            act_input: 2 * f,
            flash_kept: 8 * d,
            materialized_kept: 3 * d,
            codes: (3 * d + f, d),
            weight_codes: self.layer_linear(),
            native_kept: 27 * d,
        }
    }
}

#[derive(Clone)]
struct Block {
    heads: (usize, usize),
    attn_norm: LayerNorm,
    qkv: Linear,
    o: Linear,
    mlp: LayerNormMLP,
    cos: Tensor,
    sin: Tensor,
}

impl PreNormBlock for Block {
    fn parts(&self) -> (AttentionHalf<'_>, MlpHalf<'_>) {
        let attention = nn::BlockAttention::Rope {
            heads: self.heads,
            tables: (&self.cos, &self.sin),
        };
        let m = &self.mlp;
        (
            (&self.attn_norm, &self.qkv, &self.o, attention),
            (&m.norm, &m.fc1, &m.fc2, Activation::SwiGlu),
        )
    }
}

impl Block {
    /// The parameters whose gradients candle's `GradStore` collects.
    fn vars(&self) -> CoreResult<Vec<Tensor>> {
        let mut v = self.attn_norm.vars();
        v.extend(self.mlp.norm.vars());
        for l in [&self.qkv, &self.o, &self.mlp.fc1, &self.mlp.fc2] {
            v.extend(l.vars()?);
        }
        Ok(v)
    }
}

/// The model.
pub struct Llama {
    /// The token embedding `[vocab, dim]`, read through `amp::nn::embedding`.
    embed: Tensor,
    blocks: Vec<Block>,
    norm: LayerNorm,
    lm_head: Linear,
    cfg: LlamaConfig,
    act: DType,
    recompute: Recompute,
}

impl Llama {
    /// Builds the layers through `vb` (their weights are initialised by
    /// [`init_weights`], not here).
    ///
    /// # Errors
    /// A width that the heads do not divide, key/value heads that do not
    /// divide the query heads, an odd head dimension; candle's.
    pub fn new(cfg: LlamaConfig, vb: VarBuilder) -> Result<Self> {
        let d = cfg.dim;
        if cfg.n_head == 0 || d % cfg.n_head != 0 || cfg.head_dim() % 2 != 0 {
            bail!(
                "width {d} over {} heads: an even head dimension is needed",
                cfg.n_head
            );
        }
        if cfg.n_kv_head == 0 || cfg.n_head % cfg.n_kv_head != 0 {
            bail!(
                "{} key/value heads do not divide {} heads",
                cfg.n_kv_head,
                cfg.n_head
            );
        }
        let hd = cfg.head_dim();
        let (cos, sin) = nn::rope_tables(
            cfg.ctx,
            hd,
            cfg.rope_theta,
            cfg.rope_scaling.as_ref(),
            vb.device(),
        )?;
        let form = MlpForm::llama();
        let blocks = (0..cfg.n_layer)
            .map(|i| -> Result<Block> {
                let b = vb.pp(format!("layers.{i}"));
                Ok(Block {
                    heads: (cfg.n_head, cfg.n_kv_head),
                    attn_norm: nn::rms_norm(d, cfg.norm_eps, b.pp("attn_norm"))?,
                    qkv: nn::linear_no_bias(
                        d,
                        (cfg.n_head + 2 * cfg.n_kv_head) * hd,
                        b.pp("attn.qkv"),
                    )?,
                    o: nn::linear_no_bias(d, d, b.pp("attn.o"))?,
                    mlp: nn::layer_norm_mlp_with(d, cfg.hidden, cfg.norm_eps, form, b.pp("mlp"))?,
                    cos: cos.clone(),
                    sin: sin.clone(),
                })
            })
            .collect::<Result<_>>()?;
        let embed = vb.pp("embed").get((cfg.vocab, d), "weight")?;
        let lm_head = if cfg.tied {
            // `initialize` keeps a tied weight F32 (its lookup and the
            // head's product both train it)
            Linear::new("lm_head.weight", embed.clone(), None)?
        } else {
            nn::linear_no_bias(d, cfg.vocab, vb.pp("lm_head"))?
        };
        Ok(Self {
            embed,
            blocks,
            norm: nn::rms_norm(d, cfg.norm_eps, vb.pp("norm"))?,
            lm_head,
            cfg,
            act: DType::F32,
            recompute: Recompute::None,
        })
    }

    /// The same model recomputing activations in backward as `mode` says.
    pub fn with_recompute(mut self, mode: Recompute) -> Self {
        self.recompute = mode;
        self
    }

    /// The same model with activations of `dtype` between layers (F32 or
    /// BF16).
    ///
    /// # Errors
    /// A dtype other than F32 or BF16.
    pub fn with_activations(mut self, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            bail!("activations in {dtype:?}: F32 or BF16");
        }
        self.act = dtype;
        Ok(self)
    }

    /// Every Linear layer with its name, in forward order.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::with_capacity(4 * self.blocks.len() + 1);
        for (i, b) in self.blocks.iter().enumerate() {
            out.push((format!("layers.{i}.attn.qkv"), &b.qkv));
            out.push((format!("layers.{i}.attn.o"), &b.o));
            out.push((format!("layers.{i}.mlp.fc1"), &b.mlp.fc1));
            out.push((format!("layers.{i}.mlp.fc2"), &b.mlp.fc2));
        }
        out.push(("lm_head".into(), &self.lm_head));
        out
    }

    /// The shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Logits `[batch, seq, vocab]` of tokens `[batch, seq]` (u32).
    ///
    /// # Errors
    /// A sequence longer than the rotary tables, candle's.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let h = self.hidden(tokens)?.into_tensor()?;
        Ok(self.lm_head.forward(&self.norm.forward(&h)?)?)
    }

    /// The residual stream after the last layer (before `norm`), handed
    /// from layer to layer (`amp::nn::pre_norm_block_stream`) where the
    /// layers can.
    fn hidden(&self, tokens: &Tensor) -> Result<Stream> {
        let (_, t) = tokens.dims2()?;
        if t > self.cfg.ctx {
            bail!(
                "sequence of {t} tokens is longer than the context ({})",
                self.cfg.ctx
            );
        }
        let mut h = Stream::new(nn::embedding(tokens, &self.embed)?.to_dtype(self.act)?);
        for blk in &self.blocks {
            let b = blk.clone();
            h = self.recompute.run_stream(
                h,
                || blk.vars(),
                |s| blk.forward_stream(s),
                move |x| b.forward(x),
            )?;
        }
        Ok(h)
    }

    /// Mean cross-entropy of next-token prediction.
    ///
    /// # Errors
    /// Shapes that disagree, candle's.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let h = self.hidden(x)?;
        Ok(nn::linear_cross_entropy_stream(
            h,
            Some(&self.norm),
            &self.lm_head,
            y,
        )?)
    }
}

/// Llama's initialisation as nanoGPT-style code does it, reproducible from
/// `seed`: Linear weights and the embedding N(0, 0.02), the residual
/// projections (`attn.o`, `mlp.fc2`) N(0, 0.02 / sqrt(2 * n_layer)), norm
/// scales 1. Each parameter draws from its own stream (seed and name).
///
/// # Errors
/// candle's.
pub fn init_weights(varmap: &VarMap, cfg: &LlamaConfig, seed: u64) -> Result<()> {
    use crate::init::Init;
    let resid_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    crate::init::init_all(varmap, seed, |name| {
        if name.ends_with("norm.weight") {
            Init::Const(1.0)
        } else if name.ends_with("attn.o.weight") || name.ends_with("mlp.fc2.weight") {
            Init::Normal(resid_std)
        } else {
            Init::Normal(0.02)
        }
    })
}

/// The model on `dev` with its `VarMap`, initialised from `seed`.
///
/// # Errors
/// As [`Llama::new`] and [`init_weights`].
pub fn build(cfg: LlamaConfig, seed: u64, dev: &Device) -> Result<(Llama, VarMap)> {
    let varmap = VarMap::new();
    let model = Llama::new(cfg, VarBuilder::from_varmap(&varmap, DType::F32, dev))?;
    init_weights(&varmap, &cfg, seed)?;
    Ok((model, varmap))
}
