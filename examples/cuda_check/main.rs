//! GPU checks of candle-amp's CUDA path against its CPU kernels, and the
//! device measurements of BENCHMARKS.md. Runs on the lent H100:
//!
//!     cuda_check                 # every check; exit code 1 if one fails
//!     cuda_check --bench         # the checks, then GEMM and cast timings
//!
//! Checks: all 2^32 f32 bit patterns through quantize to E4M3, E5M2 and FP16
//! (codes, amax and counts, the CPU side on every core), all 2^16 BF16 and
//! FP16 inputs, every code decoded to every dtype, random tensors through
//! amax, quantize, dequantize, requantize and the scale updates, the
//! cuBLASLt FP8 GEMM against a float64 product on the GPU, the FP8 Linear's
//! forward and backward against the CPU, and a training-step slice captured
//! into a CUDA graph (where any device-to-host copy fails the capture), and
//! the fused low-bit AdamW step and gradient sum of squares against the CPU
//! (`--optim-only` for just those), and with `--codecs` the step's own
//! codecs over all 2^32 f32 inputs and every code (about 4 minutes more: a
//! run with every sweep needs most of a device call's 10 minutes).

mod attention;
mod bench;
mod blocks;
mod capture;
mod codecs;
mod exhaustive;
mod fused;
mod gemm;
mod ops;
mod optim;
mod optim_many;
mod util;

use anyhow::Result;
use candle_core::Device;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Check candle-amp's CUDA kernels against the CPU ones, and time them")]
struct Args {
    /// Also time the FP8 GEMM and the cast kernels.
    #[arg(long)]
    bench: bool,
    /// Only time (skip the checks; with --optim-only the optimizer bench alone).
    #[arg(long)]
    bench_only: bool,
    /// log2 of the exhaustive sweep's chunk, in elements.
    #[arg(long, default_value_t = 26)]
    chunk_log2: u32,
    /// Skip the 2^32 sweep (quick runs).
    #[arg(long)]
    skip_exhaustive: bool,
    /// Only the fused training ops' and the attention's checks (with
    /// --bench also the attention's timing).
    #[arg(long)]
    fused_only: bool,
    /// Only the optimizer's checks (and with --bench its timing).
    #[arg(long)]
    optim_only: bool,
    /// Also the step's codecs over all 2^32 f32 inputs (about 4 minutes).
    #[arg(long)]
    codecs: bool,
    /// Abort after this many seconds (a hung run wastes device time).
    #[arg(long, default_value_t = 420)]
    watchdog: u64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let limit = args.watchdog;
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(limit));
        println!("cuda_check: watchdog: still running after {limit} s, aborting");
        std::process::exit(3);
    });
    let dev = Device::new_cuda(0)?;
    let mut results: Vec<(String, bool)> = Vec::new();
    let mut check = |name: &str, r: Result<bool>| {
        let ok = match r {
            Ok(ok) => ok,
            Err(e) => {
                println!("{name}: ERROR {e:#}");
                false
            }
        };
        println!("CHECK {name}: {}", if ok { "PASS" } else { "FAIL" });
        results.push((name.to_string(), ok));
    };
    if args.fused_only {
        check("fused ops", fused::check(&dev));
        check("half-blocks", blocks::check(&dev));
        check("attention", attention::check(&dev));
        if args.bench {
            check("attention bench", attention::bench(&dev));
        }
    } else if args.optim_only {
        if !args.bench_only {
            check("lowbit adamw", optim::check(&dev));
        }
        if args.codecs {
            check("step codecs", codecs::check(&dev, args.chunk_log2));
        }
        if args.bench || args.bench_only {
            check("lowbit adamw bench", optim::bench(&dev));
        }
    } else if !args.bench_only {
        check("codes decode", ops::all_codes(&dev));
        check("16-bit inputs", exhaustive::all_16bit_inputs(&dev));
        check("random ops", ops::random_ops(&dev));
        check("cast-transpose", ops::cast_transpose(&dev));
        check("scale updates", ops::scale_updates(&dev));
        check("read scalars", ops::read_scalars(&dev));
        check("fp8 gemm", gemm::check(&dev));
        check("fp8 gemm epilogue", gemm::epilogue(&dev));
        check("fp8 gemm output amax", gemm::output_amax(&dev));
        check("fp8 linear", gemm::linear(&dev));
        check("fused ops", fused::check(&dev));
        check("half-blocks", blocks::check(&dev));
        check("attention", attention::check(&dev));
        check("no device-to-host copy", capture::check(&dev));
        check("lowbit adamw", optim::check(&dev));
    }
    // Before the long sweep, so a slow sweep cannot cost the timings.
    if !args.optim_only && !args.fused_only && (args.bench || args.bench_only) {
        check("bench", bench::run(&dev));
        check("attention bench", attention::bench(&dev));
        check("lowbit adamw bench", optim::bench(&dev));
    }
    if !args.optim_only && !args.fused_only && !args.bench_only && !args.skip_exhaustive {
        check(
            "2^32 f32 encode",
            exhaustive::all_f32(&dev, args.chunk_log2),
        );
    }
    if !args.optim_only && !args.fused_only && !args.bench_only && args.codecs {
        check("step codecs", codecs::check(&dev, args.chunk_log2));
    }
    println!("== summary ==");
    for (name, ok) in &results {
        println!("{:<28} {}", name, if *ok { "PASS" } else { "FAIL" });
    }
    if results.iter().any(|(_, ok)| !ok) {
        std::process::exit(1);
    }
    Ok(())
}
