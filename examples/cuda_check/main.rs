//! Device timings of candle-amp's CUDA path, the measurements of
//! BENCHMARKS.md. Runs on a GPU:
//!
//!     cuda_check                 # every timing below
//!     cuda_check --fused-only    # the attention's alone
//!     cuda_check --optim-only    # the optimizer step's alone
//!     cuda_check --block-only    # the block-scaled GEMMs and casts alone
//!
//! Timings: the FP8 and BF16 GEMMs at 8192^3 and the GPT linear shapes,
//! the pool release threshold's effect, the cast kernels' bandwidth over
//! the device copy's (`bench.rs`); the packed causal attention's forward
//! and backward, flash and materialised (`attention.rs`); the fused
//! low-bit AdamW step over its bandwidth floor (`optim.rs`); the
//! block-scaled and rowwise GEMMs and casts (`block.rs`). Each prints
//! `BENCH` lines and a `CHECK <name>: PASS` line once it ran.
//!
//! The checks of the CUDA path against the CPU (bit for bit where the
//! kernels promise it, the 2^32 sweeps included) are the tests of
//! `tests/gpu/main.rs`: `cargo test --release --features cuda --test gpu`.

mod attention;
mod bench;
mod block;
mod optim;
mod util;

use anyhow::Result;
use candle_core::Device;
use clap::Parser;

#[derive(Parser, Debug)]
#[command(about = "Time candle-amp's CUDA kernels (the checks are `cargo test --test gpu`)")]
struct Args {
    /// Accepted for the scripts written when this also checked: timing is
    /// all it does now.
    #[arg(long)]
    #[allow(dead_code)] // accepted, never read
    bench: bool,
    /// The same as --bench.
    #[arg(long)]
    #[allow(dead_code)] // accepted, never read
    bench_only: bool,
    /// Only the attention's timing.
    #[arg(long)]
    fused_only: bool,
    /// Only the optimizer step's timing.
    #[arg(long)]
    optim_only: bool,
    /// Only the block-scaled GEMMs' and casts' timings.
    #[arg(long)]
    block_only: bool,
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
    let all = !args.fused_only && !args.optim_only && !args.block_only;
    if all {
        check("bench", bench::run(&dev));
    }
    if all || args.fused_only {
        check("attention bench", attention::bench(&dev));
    }
    if all || args.optim_only {
        check("lowbit adamw bench", optim::bench(&dev));
    }
    if all || args.block_only {
        check("block-scaled bench", block::run(&dev));
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
