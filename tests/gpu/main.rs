//! candle-amp's CUDA path against its CPU bodies, as `cargo test` tests.
//!
//! Every CUDA kernel is compared with the CPU from the same inputs: the
//! casts bit for bit (every BF16 and FP16 input, every code decoded,
//! random tensors through amax, quantize, dequantize, requantize, the
//! cast-transpose, the scale updates), the cuBLASLt FP8 GEMM against a
//! float64 product, the FP8 Linear and the half-blocks to the GEMMs'
//! rounding, the fused training ops and attention to their tolerances
//! (RoPE bit for bit), a training-step slice captured into a CUDA graph
//! (no device-to-host copy), the fused low-bit AdamW step, the gradient
//! sum of squares and the step's codecs, and the bucketed FP8 reduction's
//! kernels bit for bit.
//!
//! One body per check, taking the device it runs on (`test_device!`):
//! `NAME_cuda` runs it on CUDA device 0 against the CPU reference, and
//! `NAME_cpu`, where a CPU-against-CPU run is cheap, runs the same body on
//! the CPU alone (the harness and the CPU bodies' determinism). A `_cuda`
//! test prints `skipped: <reason>` and passes where there is no usable GPU
//! or the binary was built without the `cuda` feature, so
//! `cargo test --workspace` builds and passes this binary on any machine.
//! The CUDA tests run one at a time on one shared device (some toggle
//! process-wide switches, and the graph capture must see no other stream).
//!
//! On a GPU machine (the device has no Rust: build the binary elsewhere
//! and carry it, see `scripts/gpu/README.md`):
//!
//! ```text
//! cargo test --release --features cuda --test gpu                      # 1 to 2 minutes on an H100
//! cargo test --release --features cuda --test gpu -- --include-ignored  # + the 2^32 sweeps
//! ```
//!
//! The 2^32 sweeps (every f32 bit pattern through the casts and through the
//! optimizer step's encodes, the CPU side on every core) are `#[ignore]`d:
//! about 2 minutes for the casts' three and 4 for the encodes' on an H100
//! with 16 cores (as measured with `cuda_check` before they moved here).
//! The timings live in the `cuda_check` example.

use anyhow::Result;
use candle_core::Device;
use std::sync::{Mutex, OnceLock};

/// Runs one test body on each device. `test_device!(body, name_cpu,
/// name_cuda)` makes the test `name_cpu` (`body` on the CPU) and
/// `name_cuda` (`body` on CUDA device 0, see [`on_cuda`]);
/// `test_device!(body, name_cuda)` the CUDA one alone. Attributes before
/// the body (`#[ignore = "..."]`) go to every test made.
macro_rules! test_device {
    ($(#[$m:meta])* $body:path, $cpu:ident, $cuda:ident) => {
        $(#[$m])*
        #[test]
        fn $cpu() -> anyhow::Result<()> {
            // the casts' counts are compared too
            amp::set_cast_counts(true);
            $body(&candle_core::Device::Cpu)
        }
        test_device!($(#[$m])* $body, $cuda);
    };
    ($(#[$m:meta])* $body:path, $cuda:ident) => {
        $(#[$m])*
        #[test]
        fn $cuda() -> anyhow::Result<()> {
            amp::set_cast_counts(true);
            crate::on_cuda(concat!(module_path!(), "::", stringify!($cuda)), $body)
        }
    };
}

#[path = "../common/mod.rs"]
mod common;

// (a crate root's modules sit beside it: these live in tests/gpu/)
mod block;
mod buckets;
mod capability;
mod capture;
mod casts;
mod codecs;
mod flag;
mod fused;
mod gemm;
mod native_op;
mod optim;
mod producer_amax;
mod rope;
mod selective;
mod util;

/// CUDA device 0, made once for the whole binary (the kernels' modules
/// load once), or why there is none.
fn cuda_device() -> &'static std::result::Result<Device, String> {
    static DEV: OnceLock<std::result::Result<Device, String>> = OnceLock::new();
    DEV.get_or_init(|| {
        if cfg!(feature = "cuda") {
            Device::new_cuda(0).map_err(|e| format!("no usable CUDA device: {e}"))
        } else {
            Err("built without the `cuda` feature".into())
        }
    })
}

/// `body` on CUDA device 0, one CUDA test at a time; without a device it
/// prints `skipped: <reason>` and passes.
fn on_cuda(test: &str, body: impl FnOnce(&Device) -> Result<()>) -> Result<()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let dev = match cuda_device() {
        Ok(dev) => dev,
        Err(why) => {
            println!("skipped: {test}: {why}");
            return Ok(());
        }
    };
    // a failed test poisons the lock; the device is still usable
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    body(dev)
}
