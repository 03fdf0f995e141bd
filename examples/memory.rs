//! For a GPT of a named size and every level, allocates the real parameters
//! and optimizer state, runs one tiny training step (so that weight
//! gradients and saved activations exist) and prints the memory report:
//! bytes by category, bytes per Linear parameter measured vs predicted, and
//! the total against O0.
//!
//! `cargo run --release --example memory -- --size 125m`

use amp::levels::{initialize, AmpConfig, Compute, Level, MemoryReport};
use amp::nn::{self, LayerNorm, Linear};
use amp::optim::AdamWConfig;
use amp::CurrentScaling;
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, VarBuilder, VarMap};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Memory per level for a GPT-shaped model")]
struct Args {
    /// Model size: tiny, 125m, 350m, 1.3b.
    #[arg(long, default_value = "125m")]
    size: String,
    /// Levels to report (comma-separated).
    #[arg(long, default_value = "O0,O1,O2,O3", value_delimiter = ',')]
    levels: Vec<Level>,
    /// Print one JSON line per level instead of tables.
    #[arg(long)]
    json: bool,
}

/// GPT-2/3 shapes: layers, width, vocabulary, context.
fn shape(size: &str) -> Result<(usize, usize, usize, usize)> {
    Ok(match size {
        "tiny" => (2, 64, 256, 64),
        "125m" => (12, 768, 50304, 1024),
        "350m" => (24, 1024, 50304, 1024),
        "1.3b" => (24, 2048, 50304, 2048),
        other => anyhow::bail!("unknown size `{other}`: tiny, 125m, 350m or 1.3b"),
    })
}

/// The parameters of a GPT (token and position embeddings, per block two
/// LayerNorms, qkv, attention output, fc1, fc2; final LayerNorm; head) with
/// a forward that touches every one of them. Attention mixing is left out:
/// it holds no parameters and this model only measures memory.
struct GptShape {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<(LayerNorm, Linear, Linear, LayerNorm, Linear, Linear)>,
    ln_f: LayerNorm,
    head: Linear,
    d: usize,
}

impl GptShape {
    fn new(vb: VarBuilder, layers: usize, d: usize, vocab: usize, ctx: usize) -> Result<Self> {
        let emb = |n, name: &str| -> Result<Embedding> {
            Ok(Embedding::new(
                vb.get_with_hints(
                    (n, d),
                    &format!("{name}.weight"),
                    candle_nn::Init::Randn {
                        mean: 0.0,
                        stdev: 0.02,
                    },
                )?,
                d,
            ))
        };
        let blocks = (0..layers)
            .map(|i| -> Result<_> {
                let b = vb.pp(format!("h.{i}"));
                Ok((
                    nn::layer_norm(d, 1e-5, b.pp("ln_1"))?,
                    nn::linear(d, 3 * d, b.pp("attn.c_attn"))?,
                    nn::linear(d, d, b.pp("attn.c_proj"))?,
                    nn::layer_norm(d, 1e-5, b.pp("ln_2"))?,
                    nn::linear(d, 4 * d, b.pp("mlp.c_fc"))?,
                    nn::linear(4 * d, d, b.pp("mlp.c_proj"))?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            wte: emb(vocab, "wte")?,
            wpe: emb(ctx, "wpe")?,
            blocks,
            ln_f: nn::layer_norm(d, 1e-5, vb.pp("ln_f"))?,
            head: nn::linear_no_bias(d, vocab, vb.pp("lm_head"))?,
            d,
        })
    }

    fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let pos = Tensor::arange(0u32, tokens.dim(1)? as u32, tokens.device())?;
        let mut h = self
            .wte
            .forward(tokens)?
            .broadcast_add(&self.wpe.forward(&pos)?)?;
        for (ln1, qkv, proj, ln2, fc, out) in &self.blocks {
            let a = qkv.forward(&ln1.forward(&h)?)?.narrow(2, 0, self.d)?;
            h = (&h + proj.forward(&a)?)?;
            h = (&h + out.forward(&fc.forward(&ln2.forward(&h)?)?.gelu()?)?)?;
        }
        Ok(self.head.forward(&self.ln_f.forward(&h)?)?)
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (layers, d, vocab, ctx) = shape(&args.size)?;
    let dev = Device::Cpu;
    let mut o0: Option<MemoryReport> = None;
    for &level in &args.levels {
        let varmap = VarMap::new();
        let model = GptShape::new(
            VarBuilder::from_varmap(&varmap, DType::F32, &dev),
            layers,
            d,
            vocab,
            ctx,
        )?;
        let compute = if level == Level::O0 {
            Compute::Native
        } else {
            Compute::Fp8Current {
                recipe: CurrentScaling::default(),
            }
        };
        let (amp, mut opt) = initialize(
            &varmap,
            AdamWConfig::default(),
            AmpConfig {
                level,
                compute,
                ..Default::default()
            },
        )?;
        // One step on one sequence of 8 tokens: gradients and saved inputs exist.
        let tokens = Tensor::arange(0u32, 8, &dev)?.unsqueeze(0)?;
        let loss = {
            let _fp8 = amp.autocast();
            model.forward(&tokens)?.sqr()?.mean_all()?
        };
        opt.backward_step(&loss)?;
        let mut r = amp.memory_report(&opt)?;
        if let Some(base) = &o0 {
            r = r.with_baseline(base);
        }
        if args.json {
            println!("{}", r.to_json()?);
        } else {
            println!("{} ({} layers, width {}):\n{r}\n", args.size, layers, d);
        }
        if level == Level::O0 {
            o0 = Some(r);
        }
    }
    Ok(())
}
