//! Times one `LowBitAdamW` step over N parameters on one CPU core, next to a
//! copy of the same number of bytes in the same run, and counts persistent
//! bytes per parameter from the tensors.
//!
//! `cargo run --release --example optim_step -- --params 100000000`

use amp::optim::{Grad, Grads, LowBitAdamW, LowBitAdamWConfig, StateFormat};
use amp::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "One LowBitAdamW step against its bandwidth floor")]
struct Args {
    /// Parameters in the tensor being updated.
    #[arg(long, default_value_t = 100_000_000)]
    params: usize,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Weight storages to run: F32, F16, FP8 (comma-separated).
    #[arg(long, default_value = "F32,F16,FP8", value_delimiter = ',')]
    storage: Vec<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds to copy `bytes` bytes (read + write counted once each: the copy
/// moves `2 * bytes`).
fn copy_time(bytes: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn main() -> Result<()> {
    let args = Args::parse();
    let n = args.params;
    let dev = Device::Cpu;
    let init = Tensor::randn(0f32, 0.02, n, &dev)?;
    let g = Tensor::randn(0f32, 1e-3, n, &dev)?;
    let q = |x: &Tensor, t| -> Result<ScalingTensor> {
        Ok(ScalingTensor::quantize(x, t, &CurrentScaling::default())?.0)
    };
    println!(
        "LowBitAdamW step over {n} parameters, 1 thread (exp_avg E4M3, exp_avg_sq F16, grad E4M3)"
    );
    println!(
        "{:<5} {:>10} {:>12} {:>11} {:>11} {:>13} {:>9}",
        "store", "step s", "params/s", "bytes/par", "floor s", "persist B/par", "x floor"
    );
    for kind in &args.storage {
        let (weight, w_bytes) = match kind.as_str() {
            "F32" => (Weight::F32(Var::from_tensor(&init)?), 4 + 4),
            "F16" => (Weight::F16(q(&init, QType::F16)?), 2 + 2),
            "FP8" => (
                Weight::Fp8 {
                    weight: q(&init, QType::E4M3)?,
                    master: q(&init, QType::F16)?,
                },
                2 + 2 + 1,
            ),
            other => anyhow::bail!("unknown storage {other}: F32, F16 or FP8"),
        };
        let slot = WeightSlot::new(weight);
        let cfg = LowBitAdamWConfig {
            exp_avg: StateFormat::E4M3,
            exp_avg_sq: StateFormat::F16,
            ..Default::default()
        };
        let mut opt = LowBitAdamW::new(vec![("w".into(), slot.clone())], cfg)?;
        let mut grads = Grads::new();
        grads.insert("w", Grad::Scaled(q(&g, QType::E4M3)?));
        let mut times = vec![];
        for _ in 0..args.steps {
            let t = Instant::now();
            opt.step(&grads)?;
            times.push(t.elapsed().as_secs_f64());
        }
        let step = median(times);
        // Bytes a step must touch per parameter: weight read + write (and the
        // FP8 copy written at O3), grad read (1), m read + write (1 + 1),
        // v read + write (2 + 2).
        let touched = w_bytes + 1 + 2 + 4;
        let floor = copy_time(touched * n / 2, 3);
        let p = &opt.params()[0];
        let persistent = slot.read().map_err(anyhow::Error::msg)?.nbytes()
            + p.exp_avg.nbytes()
            + p.exp_avg_sq.nbytes();
        println!(
            "{:<5} {:>10.3} {:>12.3e} {:>11} {:>11.3} {:>13.3} {:>9.1}",
            kind,
            step,
            n as f64 / step,
            touched,
            floor,
            persistent as f64 / n as f64,
            step / floor
        );
        drop(opt);
        let _ = DType::F32;
    }
    Ok(())
}
