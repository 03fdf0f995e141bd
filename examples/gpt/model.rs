//! A decoder-only GPT (pre-LayerNorm, causal self-attention, GELU MLP,
//! learned positions, output head) built from `amp::nn` layers. Its code
//! does not change with the level: `amp::initialize` converts the Linear
//! weights in place.
//!
//! Parameter names follow GPT-2 (`wte`, `wpe`, `h.{i}.ln_1`,
//! `h.{i}.attn.c_attn`, `h.{i}.attn.c_proj`, `h.{i}.ln_2`, `h.{i}.mlp.c_fc`,
//! `h.{i}.mlp.c_proj`, `ln_f`, `lm_head`), so an export reads like a GPT-2
//! checkpoint. The head has its own weight unless the config ties it to
//! `wte` (GPT-2's own checkpoints are tied). Linear weights are `[out, in]` (`nn.Linear`'s layout, which
//! `candle_nn::linear` reads); Hugging Face's GPT-2 `Conv1D` stores the
//! transpose.

use crate::block::{AttentionHalf, MlpHalf, PreNormBlock};
use crate::recompute::{CoreResult, Recompute};
use amp::nn::{self, LayerNorm, Linear, Stream};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// The architecture, for messages and plots.
pub const ARCH: &str = "GPT";
/// The example's name (the command's).
pub const BIN: &str = "gpt";
/// The command's one-line help.
pub const ABOUT: &str =
    "Train a GPT on the bundled corpus with candle-amp at any optimization level";
/// The model the shared training loop (`examples/lm`) trains.
pub type Model = Gpt;
/// Its shape.
pub type Config = GptConfig;

/// The shape of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct GptConfig {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Width.
    pub n_embd: usize,
    /// Vocabulary (256 for the byte-level tokenizer).
    pub vocab: usize,
    /// Context length (learned positions).
    pub ctx: usize,
    /// The head is `wte` (GPT-2's tied embeddings) instead of a weight of
    /// its own.
    pub tied: bool,
}

/// The sizes by name: `tiny` trains on two CPU cores in minutes; the others
/// are GPT-2/3 shapes (layers, heads, width) as `scripts/gpu/torch_gpt.py` uses them.
pub const SIZES: [(&str, usize, usize, usize); 8] = [
    ("tiny", 4, 4, 128),
    ("125m", 12, 12, 768),
    ("350m", 24, 16, 1024),
    ("760m", 24, 16, 1536),
    ("1.3b", 24, 32, 2048),
    ("2.7b", 32, 32, 2560),
    ("6.7b", 32, 32, 4096),
    ("13b", 40, 40, 5120),
];

impl GptConfig {
    /// The named size with a vocabulary and a context length.
    ///
    /// # Errors
    /// An unknown name, a zero vocabulary or context.
    pub fn named(size: &str, vocab: usize, ctx: usize) -> Result<Self> {
        let Some(&(_, n_layer, n_head, n_embd)) = SIZES.iter().find(|s| s.0 == size) else {
            let names: Vec<&str> = SIZES.iter().map(|s| s.0).collect();
            bail!("unknown size `{size}`: one of {}", names.join(", "));
        };
        if vocab == 0 || ctx == 0 {
            bail!("vocabulary ({vocab}) and context ({ctx}) must be positive");
        }
        Ok(Self {
            n_layer,
            n_head,
            n_embd,
            vocab,
            ctx,
            tied: false,
        })
    }

    /// Whether attention runs as flash attention on CUDA (the heads divide
    /// the width and the head dimension is one the kernels are built for),
    /// unless turned off.
    pub fn flash_head_dim(&self) -> bool {
        self.n_head > 0
            && self.n_embd % self.n_head == 0
            && amp::nn::flash_head_dim(self.n_embd / self.n_head)
    }

    /// Parameters in all.
    pub fn params(&self) -> usize {
        let d = self.n_embd;
        let block =
            2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d);
        let head = if self.tied { 0 } else { d * self.vocab };
        (self.vocab + self.ctx) * d + self.n_layer * block + 2 * d + head
    }

    /// Training FLOPs per token at sequence length `seq`: `6 N + 12 layers
    /// width seq`, `N` every parameter but the position embeddings
    /// (nanoGPT's `estimate_mfu`).
    pub fn flops_per_token(&self, seq: usize) -> f64 {
        let n = (self.params() - self.ctx * self.n_embd) as f64;
        6.0 * n + 12.0 * (self.n_layer * self.n_embd * seq) as f64
    }

    /// What the memory estimate needs (`crate::budget`): per token and
    /// block the fused block keeps its input and the residual between its
    /// halves (the LayerNorms' inputs) and fc1's output (GELU's input), 6
    /// d at the activations' width; flash attention q, k, v and its output
    /// in BF16; the FP8 codes of ln_1's, ln_2's, the attention's and
    /// GELU's outputs (7 d); the four weights' FP8 copies (12 d²).
    pub fn shape(&self) -> crate::budget::Shape {
        let d = self.n_embd;
        crate::budget::Shape {
            layers: self.n_layer,
            width: d,
            heads: self.n_head,
            vocab: self.vocab,
            params: self.params(),
            linear: self.n_layer * 12 * d * d,
            largest_linear: 4 * d * d,
            kept: 6 * d,
            act_input: 4 * d,
            flash_kept: 8 * d,
            materialized_kept: 3 * d,
            codes: (7 * d, d),
            weight_codes: 12 * d * d,
            native_kept: 33 * d,
        }
    }
}

#[derive(Clone)]
struct Block {
    n_head: usize,
    ln_1: LayerNorm,
    c_attn: Linear,
    c_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
}

/// The model.
pub struct Gpt {
    /// Token and position embeddings `[rows, n_embd]`, read through
    /// `amp::nn::embedding` (a deterministic backward without atomics).
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
    cfg: GptConfig,
    /// Dtype of the activations between layers.
    act: DType,
    /// Recompute each block's activations in backward (keep only its input).
    recompute: Recompute,
}

impl PreNormBlock for Block {
    fn parts(&self) -> (AttentionHalf<'_>, MlpHalf<'_>) {
        (
            (
                &self.ln_1,
                &self.c_attn,
                &self.c_proj,
                nn::BlockAttention::Causal { heads: self.n_head },
            ),
            (&self.ln_2, &self.c_fc, &self.mlp_proj, nn::Activation::Gelu),
        )
    }
}

impl Block {
    /// The parameters whose gradients candle's `GradStore` collects.
    fn vars(&self) -> CoreResult<Vec<Tensor>> {
        let mut v = self.ln_1.vars();
        v.extend(self.ln_2.vars());
        for l in [&self.c_attn, &self.c_proj, &self.c_fc, &self.mlp_proj] {
            v.extend(l.vars()?);
        }
        Ok(v)
    }
}

/// LayerNorm's epsilon (GPT-2's).
pub const LN_EPS: f64 = 1e-5;

impl Gpt {
    /// Builds the layers through `vb` (their weights are initialised by
    /// [`init_weights`], not here).
    ///
    /// # Errors
    /// A width that the heads do not divide, candle's.
    pub fn new(cfg: GptConfig, vb: VarBuilder) -> Result<Self> {
        let d = cfg.n_embd;
        if cfg.n_head == 0 || d % cfg.n_head != 0 {
            bail!("width {d} is not a multiple of the {} heads", cfg.n_head);
        }
        let emb =
            |n: usize, name: &str| -> Result<Tensor> { Ok(vb.pp(name).get((n, d), "weight")?) };
        let blocks = (0..cfg.n_layer)
            .map(|i| -> Result<Block> {
                let b = vb.pp(format!("h.{i}"));
                Ok(Block {
                    n_head: cfg.n_head,
                    ln_1: nn::layer_norm(d, LN_EPS, b.pp("ln_1"))?,
                    c_attn: nn::linear(d, 3 * d, b.pp("attn.c_attn"))?,
                    c_proj: nn::linear(d, d, b.pp("attn.c_proj"))?,
                    ln_2: nn::layer_norm(d, LN_EPS, b.pp("ln_2"))?,
                    c_fc: nn::linear(d, 4 * d, b.pp("mlp.c_fc"))?,
                    mlp_proj: nn::linear(4 * d, d, b.pp("mlp.c_proj"))?,
                })
            })
            .collect::<Result<_>>()?;
        let wte = emb(cfg.vocab, "wte")?;
        let lm_head = if cfg.tied {
            // `initialize` keeps a tied weight F32 (its lookup and the
            // head's product both train it)
            Linear::new("lm_head.weight", wte.clone(), None)?
        } else {
            nn::linear_no_bias(d, cfg.vocab, vb.pp("lm_head"))?
        };
        Ok(Self {
            wte,
            wpe: emb(cfg.ctx, "wpe")?,
            blocks,
            ln_f: nn::layer_norm(d, LN_EPS, vb.pp("ln_f"))?,
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
    /// BF16): the embeddings' sum is cast once, every layer keeps its
    /// input's dtype (LayerNorm statistics and cross-entropy sums stay F32).
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

    /// Every Linear layer with its GPT-2 name (`h.{i}.attn.c_attn`, ...,
    /// `lm_head`), in forward order.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::with_capacity(4 * self.blocks.len() + 1);
        for (i, b) in self.blocks.iter().enumerate() {
            out.push((format!("h.{i}.attn.c_attn"), &b.c_attn));
            out.push((format!("h.{i}.attn.c_proj"), &b.c_proj));
            out.push((format!("h.{i}.mlp.c_fc"), &b.c_fc));
            out.push((format!("h.{i}.mlp.c_proj"), &b.mlp_proj));
        }
        out.push(("lm_head".into(), &self.lm_head));
        out
    }

    /// The shape.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// Logits `[batch, seq, vocab]` of tokens `[batch, seq]` (u32).
    ///
    /// # Errors
    /// A sequence longer than the context, candle's.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let h = self.hidden(tokens)?.into_tensor()?;
        Ok(self.lm_head.forward(&self.ln_f.forward(&h)?)?)
    }

    /// The residual stream after the last block (before `ln_f`), handed
    /// from block to block (`amp::nn::pre_norm_block_stream`) where the
    /// blocks can.
    fn hidden(&self, tokens: &Tensor) -> Result<Stream> {
        let (_, t) = tokens.dims2()?;
        if t > self.cfg.ctx {
            bail!(
                "sequence of {t} tokens is longer than the context ({})",
                self.cfg.ctx
            );
        }
        let dev = tokens.device();
        let pos = Tensor::arange(0u32, t as u32, dev)?;
        let mut h = Stream::new(
            nn::embedding(tokens, &self.wte)?
                .broadcast_add(&nn::embedding(&pos, &self.wpe)?)?
                .to_dtype(self.act)?,
        );
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
        // ln_f -> lm_head -> cross-entropy with the normalised states and
        // the [batch, seq, vocab] logits handed op to op at the FP8 levels:
        // the logits never become a graph tensor (no reshape either)
        let h = self.hidden(x)?;
        Ok(nn::linear_cross_entropy_stream(
            h,
            Some(&self.ln_f),
            &self.lm_head,
            y,
        )?)
    }
}

/// GPT-2's initialisation, reproducible from `seed` (candle's CPU generator
/// cannot be seeded): weights of Linear layers and embeddings N(0, 0.02),
/// the residual projections (`c_proj`) N(0, 0.02 / sqrt(2 * n_layer)),
/// biases 0, LayerNorm scales 1. Each parameter draws from its own stream
/// (seed and name), so the values do not depend on the order of names.
///
/// # Errors
/// A parameter this model does not have, candle's.
pub fn init_weights(varmap: &VarMap, cfg: &GptConfig, seed: u64) -> Result<()> {
    use crate::init::Init;
    let resid_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
    crate::init::init_all(varmap, seed, |name| {
        if name.ends_with(".bias") {
            Init::Const(0.0)
        } else if name.starts_with("ln_") || name.contains(".ln_") {
            Init::Const(1.0)
        } else if name.ends_with("c_proj.weight") {
            Init::Normal(resid_std)
        } else {
            Init::Normal(0.02)
        }
    })
}

/// The model on `dev` with its `VarMap`, initialised from `seed`.
///
/// # Errors
/// As [`Gpt::new`] and [`init_weights`].
pub fn build(cfg: GptConfig, seed: u64, dev: &Device) -> Result<(Gpt, VarMap)> {
    let varmap = VarMap::new();
    let model = Gpt::new(cfg, VarBuilder::from_varmap(&varmap, DType::F32, dev))?;
    init_weights(&varmap, &cfg, seed)?;
    Ok((model, varmap))
}

#[cfg(test)]
mod budget_tests {
    use super::*;
    use crate::budget::{estimate, Run};
    use amp::levels::Level;

    /// A GPU run of 8 x 1024 per rank, BF16 activations, flash attention.
    fn gpu(recompute: Recompute, native: bool) -> Run {
        Run {
            batch: 8,
            seq: 1024,
            ranks: 1,
            shards: 1,
            act_bytes: 2,
            flash: true,
            recompute,
            native,
            native_graph: native,
            gpu: true,
            lean: false,
            fp8_moments: false,
            fp8_act_inputs: false,
            loss_chunk_rows: 0,
        }
    }

    #[test]
    fn the_estimate_covers_measured_gpu_peaks_without_doubling_them() {
        let gib = (1u64 << 30) as f64;
        // 350M O2: the pool's peak on an H200 was 10.8 GB (BENCHMARKS.md)
        let g = GptConfig::named("350m", 50304, 1024).unwrap();
        let none = gpu(Recompute::None, false);
        let e = estimate(&g.shape(), Level::O2, &none);
        assert!(e.total() > 10.8e9 && e.total() < 1.5 * 10.8e9, "{e:?}");
        // ranks as threads multiply it; materialized attention adds to it;
        // selective and full recomputation take from it
        let two = estimate(&g.shape(), Level::O2, &Run { ranks: 2, ..none });
        assert!((two.total() - 2.0 * e.total()).abs() < 1.0);
        let materialized = Run {
            flash: false,
            ..none
        };
        assert!(estimate(&g.shape(), Level::O2, &materialized).total() > e.total());
        let sel = estimate(&g.shape(), Level::O2, &gpu(Recompute::Selective, false));
        let full = estimate(&g.shape(), Level::O2, &gpu(Recompute::Full, false));
        assert!(full.activations < sel.activations && sel.activations < e.activations);
        assert_eq!(full.persistent, e.persistent);
        // the optimizer's phase: 5 bytes a Linear parameter at O2, the
        // larger phase with recomputation at 6.7B (measured 70.9 GiB on an
        // H100), not without
        let big = GptConfig::named("6.7b", 50304, 1024).unwrap();
        let full = estimate(&big.shape(), Level::O2, &gpu(Recompute::Full, false));
        let linear = 32.0 * 12.0 * 4096.0 * 4096.0;
        assert!((full.optimizer - 5.0 * linear).abs() < 1.0, "{full:?}");
        assert!(full.optimizer > full.activations + full.logits);
        assert!(full.total() > 70.9 * gib && full.total() < 78.0 * gib);
        // the head's loss over two chunks of 4096 rows: a chunk's logits
        // three times and the head's F32 weight gradient twice, less than
        // the whole logits three times (0.8 GB each at 8 x 1024 tokens);
        // the pool's peak on an H100 was 8.56 GiB (BENCHMARKS.md)
        let chunked = Run {
            loss_chunk_rows: 4096,
            ..none
        };
        let c = estimate(&g.shape(), Level::O2, &chunked);
        assert!(c.logits < 0.7 * e.logits, "{c:?}");
        let peak = 8.56 * gib;
        assert!(c.total() > peak && c.total() < 1.5 * peak, "{c:?}");
        let kept = estimate(&big.shape(), Level::O2, &none);
        assert!(kept.activations + kept.logits > kept.optimizer);
        // on the CPU the optimizer works a tensor at a time; the lean step
        // holds one parameter's new states (fc1's: 5 bytes x 4 d^2)
        let cpu = estimate(&big.shape(), Level::O2, &Run { gpu: false, ..none });
        assert_eq!(cpu.optimizer, 0.0);
        let lean = Run {
            lean: true,
            ..gpu(Recompute::Full, false)
        };
        let lean = estimate(&big.shape(), Level::O2, &lean);
        assert!((lean.optimizer - 5.0 * 4.0 * 4096.0 * 4096.0).abs() < 1.0);
        assert!(lean.total() < full.total() - 20.0 * gib, "{lean:?}");
        // O0 with native products through candle's graph (how O0 runs on
        // CUDA): 1.3B measured 46.37 GiB at its peak (H100), 2.7B ran out
        // of memory on 78.6 GiB free
        let o0 = |size: &str, run: &Run| {
            let g = GptConfig::named(size, 50304, 1024).unwrap();
            estimate(&g.shape(), Level::O0, run).total() / gib
        };
        let graph = gpu(Recompute::None, true);
        let g13 = o0("1.3b", &graph);
        assert!(g13 > 46.37 && g13 < 1.2 * 46.37, "{g13}");
        assert!(o0("2.7b", &graph) > 78.6, "{}", o0("2.7b", &graph));
        // through the layers' op (as on the CPU; on CUDA once measured):
        // each GEMM's input and a BF16 copy of each weight kept instead of
        // candle's graph; between the graph and O2
        let op = Run {
            native_graph: false,
            ..graph
        };
        let o13 = o0("1.3b", &op);
        let g = GptConfig::named("1.3b", 50304, 1024).unwrap();
        let o2 = estimate(&g.shape(), Level::O2, &none).total() / gib;
        assert!(o13 < g13 && o13 > o2, "op {o13}, graph {g13}, O2 {o2}");
    }
}
