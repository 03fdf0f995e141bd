//! Quantize a tensor to E4M3, E5M2 and scaled FP16, print each one's scaling
//! metadata and error; then run a few steps of TE delayed scaling to show the
//! amax history at work.
//!
//! `cargo run --release --example quantize -- --help`

use amp::{fp8_gemm, CurrentScaling, DelayedScaling, QType, ScalingMeta, ScalingTensor};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Quantize a tensor to FP8/FP16 and report scales and errors")]
struct Args {
    /// Rows of the tensor.
    #[arg(long, default_value_t = 512)]
    rows: usize,
    /// Columns of the tensor.
    #[arg(long, default_value_t = 1024)]
    cols: usize,
    /// Standard deviation of the values.
    #[arg(long, default_value_t = 3.0)]
    std: f64,
    /// Delayed-scaling recipe (TE `DelayedScaling`, JSON or TOML); TE defaults otherwise.
    #[arg(long)]
    recipe: Option<std::path::PathBuf>,
    /// Steps of the delayed-scaling demo.
    #[arg(long, default_value_t = 5)]
    steps: usize,
}

fn error_stats(x: &Tensor, y: &Tensor) -> Result<(f64, f64)> {
    let x = x.to_dtype(DType::F64)?;
    let y = y.to_dtype(DType::F64)?;
    let diff = (&y - &x)?;
    let max_abs = diff.abs()?.max_all()?.to_scalar::<f64>()?;
    let rel = (diff.sqr()?.sum_all()?.to_scalar::<f64>()?
        / x.sqr()?.sum_all()?.to_scalar::<f64>()?)
    .sqrt();
    Ok((max_abs, rel))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::Cpu;
    let x = (Tensor::randn(0f32, 1.0, (args.rows, args.cols), &dev)? * args.std)?;
    let f32_bytes = x.elem_count() * 4;
    println!(
        "tensor {}x{} F32, std {}: {} bytes\n",
        args.rows, args.cols, args.std, f32_bytes
    );
    println!(
        "{:<6} {:>10} {:>12} {:>12} {:>10} {:>9} {:>11} {:>10} {:>8}",
        "qtype", "amax", "scale", "scale_inv", "bytes", "vs F32", "max |err|", "rel err", "flushed"
    );
    let recipe = CurrentScaling::default();
    for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
        let (q, amax) = ScalingTensor::quantize(&x, qtype, &recipe)?;
        let y = q.dequantize(DType::F32)?;
        let (max_abs, rel) = error_stats(&x, &y)?;
        let stats = q.cast_stats(&x)?;
        let scale = q.meta().scale().to_vec1::<f32>()?[0];
        println!(
            "{:<6} {:>10.4} {:>12} {:>12.3e} {:>10} {:>8.1}% {:>11.3e} {:>10.3e} {:>8}",
            qtype.to_string(),
            amax.to_vec1::<f32>()?[0],
            scale,
            q.scale_inv()?,
            q.nbytes(),
            100.0 * q.nbytes() as f64 / f32_bytes as f64,
            max_abs,
            rel,
            stats.flushed,
        );
    }

    // The FP8 GEMM reference on the same data: x · wᵀ against F32.
    let w = (Tensor::randn(0f32, 0.02, (256, args.cols), &dev)?).contiguous()?;
    let (xq, _) = ScalingTensor::quantize(&x, QType::E4M3, &recipe)?;
    let (wq, _) = ScalingTensor::quantize(&w, QType::E4M3, &recipe)?;
    let y8 = fp8_gemm(&xq, &wq, DType::F32)?;
    let y32 = x.matmul(&w.t()?)?;
    let (_, rel) = error_stats(&y32, &y8)?;
    println!(
        "\nfp8_gemm E4M3 x E4M3 [{}x{}]·[256x{}]ᵀ vs F32 matmul: rel err {rel:.3e}",
        args.rows, args.cols, args.cols
    );

    // Delayed scaling: the scale for step t comes from amaxes up to t-1.
    let recipe = match &args.recipe {
        Some(path) => DelayedScaling::from_path(path)?,
        None => DelayedScaling {
            amax_history_len: 4,
            ..Default::default()
        },
    };
    println!(
        "\ndelayed scaling (margin {}, history {}, {:?}): the input grows 2x per step",
        recipe.margin, recipe.amax_history_len, recipe.amax_compute_algo
    );
    let mut meta = ScalingMeta::new(
        recipe.fp8_format.forward().into(),
        recipe.amax_history_len,
        &dev,
    )?;
    for step in 0..args.steps {
        let xs = (&x * 2f64.powi(step as i32))?;
        let (q, amax) = ScalingTensor::quantize_with(&xs, &meta)?;
        let stats = q.cast_stats(&xs)?;
        let (_, rel) = error_stats(&xs, &q.dequantize(DType::F32)?)?;
        println!(
            "step {step}: scale {:>10.4} amax {:>9.3} saturated {:>6} rel err {:.3e}",
            meta.scale().to_vec1::<f32>()?[0],
            amax.to_vec1::<f32>()?[0],
            stats.saturated,
            rel
        );
        meta.record_amax(&amax)?;
        meta.update_delayed(&recipe)?;
    }
    Ok(())
}
