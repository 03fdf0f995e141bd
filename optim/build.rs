//! Builds the PTX of `kernels/lowbit.cu` (the fused low-bit AdamW step and
//! the gradient sum of squares) with nvcc, only under the `cuda` feature: the
//! default build needs no CUDA toolkit. `-fmad=false`: no multiply-add
//! contraction, so the update rounds as the CPU body does (see lowbit.cu).
//!
//! nvcc must be 13.0 (PTX ISA 9.0): the device's CUDA 13.0 driver refuses
//! PTX from newer toolkits (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). Build
//! through `../shared/gpu/build-cuda.sh`, which puts nvcc 13.0 first on the
//! PATH and sets `NVCC` and `CUDA_ROOT`.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=kernels/lowbit.cu");
    println!("cargo:rerun-if-changed=kernels/sumsq.cuh");
    println!("cargo:rerun-if-changed=kernels/clip.cuh");
    println!("cargo:rerun-if-changed=kernels/codec.cuh");
    println!("cargo:rerun-if-changed=kernels/multi.cuh");
    println!("cargo:rerun-if-changed=kernels/codec_ops.cuh");
    println!("cargo:rerun-if-changed=kernels/groups.cuh");
    for v in ["NVCC", "CUDA_ROOT", "AMP_CUDA_ARCH"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    // compute_90: Hopper (the hardware FP8 conversions need sm_89 or newer).
    let arch = std::env::var("AMP_CUDA_ARCH").unwrap_or_else(|_| "compute_90".into());
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("lowbit.ptx"); // ok: cargo always sets it for build scripts
    let version = Command::new(&nvcc).arg("--version").output();
    match version {
        Ok(v) if String::from_utf8_lossy(&v.stdout).contains("release 13.0") => {}
        Ok(v) => {
            println!(
            "cargo:warning=nvcc is not 13.0 ({}): the device's CUDA 13.0 driver may refuse its PTX",
            String::from_utf8_lossy(&v.stdout).lines().last().unwrap_or("?")
        )
        }
        Err(e) => panic!(
            "feature `cuda` needs nvcc ({nvcc}): {e}; build with ../shared/gpu/build-cuda.sh"
        ),
    }
    let mut cmd = Command::new(&nvcc);
    cmd.args([
        "--ptx",
        "-O3",
        "-fmad=false",
        "-std=c++17",
        &format!("--gpu-architecture={arch}"),
    ])
    .arg("kernels/lowbit.cu")
    .arg("-o")
    .arg(&out);
    if let Ok(root) = std::env::var("CUDA_ROOT") {
        let cccl = PathBuf::from(root).join("include/cccl");
        if cccl.is_dir() {
            cmd.arg(format!("-I{}", cccl.display()));
        }
    }
    let status = cmd.status().expect("running nvcc"); // ok: a build script fails by panicking; nvcc ran a moment ago (--version)
    assert!(status.success(), "nvcc failed on kernels/lowbit.cu");
}
