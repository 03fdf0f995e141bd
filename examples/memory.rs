//! For a GPT of a named size and every level, allocates the real parameters
//! and optimizer state, runs one tiny training step (so that weight
//! gradients and saved activations exist) and prints the memory report:
//! bytes by category, bytes per Linear parameter measured vs predicted, and
//! the total against O0.
//!
//! `cargo run --release --example memory -- --size 125m`

// the GPT example's model and what it needs (the training parts unused here)
#[allow(dead_code)]
#[path = "lm/block.rs"]
mod block;
#[allow(dead_code)]
#[path = "lm/budget.rs"]
mod budget;
#[allow(dead_code)]
#[path = "lm/init.rs"]
mod init;
#[allow(dead_code)]
#[path = "gpt/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "lm/recompute.rs"]
mod recompute;

use amp::levels::{initialize, AmpConfig, Compute, Level, MemoryReport};
use amp::optim::AdamWConfig;
use amp::CurrentScaling;
use anyhow::Result;
use candle_core::{Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Memory per level for a GPT-shaped model")]
struct Args {
    /// Model size: tiny, 125m, 350m, 760m, 1.3b, 2.7b, 6.7b (the GPT example's).
    #[arg(long, default_value = "125m")]
    size: String,
    /// Levels to report (comma-separated).
    #[arg(long, default_value = "O0,O1,O2,O3", value_delimiter = ',')]
    levels: Vec<Level>,
    /// Vocabulary (GPT-2's, padded, as the GPU benchmarks use).
    #[arg(long, default_value_t = 50304)]
    vocab: usize,
    /// Context length.
    #[arg(long, default_value_t = 1024)]
    ctx: usize,
    /// Print one JSON line per level instead of tables.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let cfg = model::GptConfig::named(&args.size, args.vocab, args.ctx)?;
    let dev = Device::Cpu;
    let mut o0: Option<MemoryReport> = None;
    for &level in &args.levels {
        let (model, varmap) = model::build(cfg, 0, &dev)?;
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
        // One step on one sequence of 8 tokens: gradients and saved inputs
        // exist (the loss kept alive, so that the report shows the
        // activations it holds: `amp.step` would free them first).
        let tokens = Tensor::arange(0u32, 9, &dev)?.unsqueeze(0)?;
        let loss = {
            let _fp8 = amp.autocast();
            model.loss(&tokens.narrow(1, 0, 8)?, &tokens.narrow(1, 1, 8)?)?
        };
        #[allow(deprecated)]
        opt.backward_step(&loss)?;
        let mut r = amp.memory_report(&opt)?;
        if let Some(base) = &o0 {
            r = r.with_baseline(base);
        }
        if args.json {
            println!("{}", r.to_json()?);
        } else {
            println!(
                "{} ({} layers, width {}, {} parameters):\n{r}\n",
                args.size,
                cfg.n_layer,
                cfg.n_embd,
                cfg.params()
            );
        }
        if level == Level::O0 {
            o0 = Some(r);
        }
    }
    Ok(())
}
