//! The README's first code block, compiled and run by the test suite: a
//! model built from `amp::nn`, `amp::initialize` at O2, training steps,
//! a checkpoint, and the memory report beside O0's.
//!
//! cargo run --release --example quickstart

use amp::nn;
use amp::optim::AdamWConfig;
use amp::{AmpConfig, Level};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

/// Two `amp::nn` Linear layers; at O2 their weights become FP8 with FP16
/// masters and their GEMMs run in FP8, with no change to this code.
struct Mlp {
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Mlp {
    fn new(vb: VarBuilder) -> amp::Result<Self> {
        Ok(Self {
            fc1: nn::linear(64, 256, vb.pp("fc1"))?,
            fc2: nn::linear(256, 64, vb.pp("fc2"))?,
        })
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> amp::Result<Tensor> {
        let pred = self.fc2.forward(&self.fc1.forward(x)?.relu()?)?;
        Ok((pred - y)?.sqr()?.mean_all()?)
    }
}

fn train(level: Level, steps: usize) -> amp::Result<(f32, f32, amp::MemoryReport)> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let adam = AdamWConfig {
        lr: 3e-3,
        ..Default::default()
    };
    // O2: FP8 GEMMs (current scaling), FP8 weights with FP16 masters, FP8
    // weight gradients, FP8 + FP16 Adam moments
    let (amp, mut opt) = amp::initialize(&varmap, adam, AmpConfig::level(level))?;
    let x = Tensor::randn(0f32, 1.0, (32, 64), &dev)?;
    let y = (x.sin()? * 0.5)?;
    let (mut first, mut last) = (None, 0.0);
    for _ in 0..steps {
        // the forward in the FP8 scope, backward, low-bit AdamW
        let step = amp.step(&mut opt, || model.loss(&x, &y))?;
        last = step.loss.to_scalar::<f32>()?;
        first.get_or_insert(last);
    }
    let dir = std::env::temp_dir().join(format!("amp-quickstart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| amp::levels::Error::Checkpoint {
        path: dir.display().to_string(),
        reason: e.to_string(),
    })?;
    // every scale, moment and master: `amp.load` resumes bit-exactly
    amp.save(dir.join(format!("{level}.safetensors")), &opt)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((first.unwrap_or(last), last, amp.memory_report(&opt)?))
}

fn main() -> amp::Result<()> {
    let (_, _, o0) = train(Level::O0, 1)?;
    let (first, last, o2) = train(Level::O2, 200)?;
    println!("O2 loss {first:.4} -> {last:.4}");
    println!("{}", o2.with_baseline(&o0));
    if last.is_nan() || last >= 0.5 * first {
        return Err(amp::levels::Error::Config {
            field: "quickstart".into(),
            reason: format!("the loss did not fall: {first} -> {last}"),
        });
    }
    Ok(())
}
