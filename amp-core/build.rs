//! Builds the PTX of `kernels/amp.cu` (casts, scales), `kernels/cast_t.cu`
//! (the cast-transpose; both include `kernels/cast.cuh`), `kernels/nn.cu`
//! (fused training ops; it includes the `nn_*.cuh` parts) and
//! `kernels/flash.cu` (causal flash attention)
//! with nvcc, only under the `cuda` feature: the default build needs no
//! CUDA toolkit.
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
    println!("cargo:rerun-if-changed=kernels/amp.cu");
    println!("cargo:rerun-if-changed=kernels/nn.cu");
    println!("cargo:rerun-if-changed=kernels/nn_pointwise.cuh");
    println!("cargo:rerun-if-changed=kernels/nn_layout.cuh");
    println!("cargo:rerun-if-changed=kernels/nn_xent.cuh");
    println!("cargo:rerun-if-changed=kernels/nn_embedding.cuh");
    println!("cargo:rerun-if-changed=kernels/cast_t.cu");
    println!("cargo:rerun-if-changed=kernels/cast.cuh");
    println!("cargo:rerun-if-changed=kernels/flash.cu");
    println!("cargo:rerun-if-changed=kernels/flash.cuh");
    for v in ["NVCC", "CUDA_ROOT", "AMP_CUDA_ARCH"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    // compute_90: Hopper (the hardware FP8 conversions need sm_89 or newer).
    let arch = std::env::var("AMP_CUDA_ARCH").unwrap_or_else(|_| "compute_90".into());
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")); // ok: cargo always sets it for build scripts
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
    for name in ["amp", "nn", "cast_t", "flash"] {
        ptx(&nvcc, &arch, name, &out_dir);
    }
}

/// `kernels/{name}.cu` to `{out_dir}/{name}.ptx`.
fn ptx(nvcc: &str, arch: &str, name: &str, out_dir: &std::path::Path) {
    let mut cmd = Command::new(nvcc);
    cmd.args([
        "--ptx",
        "-O3",
        "-std=c++17",
        &format!("--gpu-architecture={arch}"),
    ])
    .arg(format!("kernels/{name}.cu"))
    .arg("-o")
    .arg(out_dir.join(format!("{name}.ptx")));
    if let Ok(root) = std::env::var("CUDA_ROOT") {
        let cccl = PathBuf::from(root).join("include/cccl");
        if cccl.is_dir() {
            cmd.arg(format!("-I{}", cccl.display()));
        }
    }
    let status = cmd.status().expect("running nvcc"); // ok: a build script fails by panicking; nvcc ran a moment ago (--version)
    assert!(status.success(), "nvcc failed on kernels/{name}.cu");
}
