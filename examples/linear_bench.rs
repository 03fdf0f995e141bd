//! CPU time of forward + backward of one `amp::nn::Linear` per compute mode,
//! and the bytes each mode keeps for backward, measured from the tensors.
//!
//! `cargo run --release --example linear_bench -- --rows 2048 --in-dim 1024 --out-dim 4096`

use amp::nn::{self, fp8_autocast, ComputeMode};
use amp::{CurrentScaling, DelayedScaling, OverrideLinearPrecision};
use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "amp::nn::Linear forward + backward per compute mode")]
struct Args {
    /// Rows (tokens) in the batch.
    #[arg(long, default_value_t = 2048)]
    rows: usize,
    /// Input features.
    #[arg(long, default_value_t = 1024)]
    in_dim: usize,
    /// Output features.
    #[arg(long, default_value_t = 4096)]
    out_dim: usize,
    /// Timed iterations (median reported).
    #[arg(long, default_value_t = 3)]
    iters: usize,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let layer = nn::linear_no_bias(
        a.in_dim,
        a.out_dim,
        VarBuilder::from_varmap(&varmap, DType::F32, &dev).pp("fc"),
    )?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (a.rows, a.in_dim), &dev)?)?;
    let all_native = OverrideLinearPrecision {
        fprop: true,
        dgrad: true,
        wgrad: true,
    };
    let modes = [
        ("native (candle matmul)", ComputeMode::Native),
        (
            "native (our op, all GEMMs overridden)",
            ComputeMode::Fp8Delayed(DelayedScaling {
                override_linear_precision: all_native,
                ..Default::default()
            }),
        ),
        (
            "fp8-current",
            ComputeMode::Fp8Current(CurrentScaling::default()),
        ),
        (
            "fp8-delayed",
            ComputeMode::Fp8Delayed(DelayedScaling::default()),
        ),
    ];
    println!(
        "Linear {}x{} (in x out), batch {} rows, 1 process on {} threads",
        a.in_dim,
        a.out_dim,
        a.rows,
        candle_core::utils::get_num_threads()
    );
    println!(
        "{:<40} {:>12} {:>16} {:>18}",
        "mode", "fwd+bwd ms", "saved B/token", "saved weight B"
    );
    for (name, mode) in modes {
        let mut times = vec![];
        for i in 0..=a.iters {
            let t = Instant::now();
            let _s = fp8_autocast(true, mode.clone());
            let y = layer.forward(x.as_tensor())?;
            let grads = y.sum_all()?.backward()?;
            std::hint::black_box(grads);
            if i > 0 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        let saved = layer.saved_bytes()?;
        let w_elems = a.in_dim * a.out_dim;
        // Split what the op kept into the input's part and the weight's part.
        let (per_token, weight) = if saved == 0 {
            ("(candle's)".to_string(), "(candle's)".to_string())
        } else {
            let w_bytes = if saved >= (a.rows + a.out_dim) * a.in_dim * 4 {
                w_elems * 4
            } else {
                w_elems
            };
            (
                format!("{:.1}", (saved - w_bytes) as f64 / a.rows as f64),
                format!("{w_bytes}"),
            )
        };
        println!(
            "{:<40} {:>12.1} {:>16} {:>18}",
            name,
            times[times.len() / 2],
            per_token,
            weight
        );
    }
    Ok(())
}
