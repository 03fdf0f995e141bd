// The nvcc driver of candle-amp's build scripts: amp-core/build.rs and
// optim/build.rs `include!` this file, so both compile their CUDA kernels
// with the same code and flags.
//
// Only under the `cuda` feature: the default build needs no CUDA toolkit.
// Each `kernels/{name}.cu` of the calling crate becomes
// `$OUT_DIR/{name}.ptx`, which the crate's launchers `include_str!`.
//
// nvcc must be 13.0 (PTX ISA 9.0): the device's CUDA 13.0 driver refuses
// PTX from newer toolkits (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). Build
// through `scripts/gpu/build-cuda.sh`, which installs nvcc 13.0, puts it
// first on the PATH and sets `NVCC` and `CUDA_ROOT`. The virtual
// architecture is `compute_{CUDA_COMPUTE_CAP}` (candle's variable: 89 for
// Ada, 90 for Hopper; default 90), or `AMP_CUDA_ARCH` verbatim; below 89 the
// build stops (the hardware FP8 conversions need sm_89 or newer). The
// number is handed to the crate as `AMP_PTX_ARCH`, which the run-time
// capability check compares with the GPU's.

/// Compiles `kernels/{name}.cu` to `$OUT_DIR/{name}.ptx` for each of
/// `names`, with `-O3 -std=c++17` and `flags`, when the crate is built
/// with its `cuda` feature. Reruns when anything under `kernels/` or
/// `watch` (paths relative to the crate: sources outside `kernels/` that
/// the kernels include) changes, or nvcc's environment does.
fn build_ptx(names: &[&str], flags: &[&str], watch: &[&str]) {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=kernels");
    for w in watch {
        println!("cargo:rerun-if-changed={w}");
    }
    for v in ["NVCC", "CUDA_ROOT", "AMP_CUDA_ARCH", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let arch = ptx_arch();
    let number: String = arch.chars().filter(char::is_ascii_digit).collect();
    println!("cargo:rustc-env=AMP_PTX_ARCH={number}");
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")); // ok: cargo always sets it for build scripts
    match std::process::Command::new(&nvcc).arg("--version").output() {
        Ok(v) if String::from_utf8_lossy(&v.stdout).contains("release 13.0") => {}
        Ok(v) => {
            println!(
            "cargo:warning=nvcc is not 13.0 ({}): the device's CUDA 13.0 driver may refuse its PTX",
            String::from_utf8_lossy(&v.stdout).lines().last().unwrap_or("?")
        )
        }
        Err(e) => panic!(
            "feature `cuda` needs nvcc 13.0 ({nvcc}): {e}; build through scripts/gpu/build-cuda.sh"
        ),
    }
    // libcu++ (`cuda/std`, which cuda_fp8.h and cuda_bf16.h include) lives
    // in include/cccl of the pip-installed toolkit
    let cccl = std::env::var("CUDA_ROOT")
        .ok()
        .map(|root| std::path::PathBuf::from(root).join("include/cccl"))
        .filter(|p| p.is_dir());
    for name in names {
        let src = format!("kernels/{name}.cu");
        let mut cmd = std::process::Command::new(&nvcc);
        cmd.args([
            "--ptx",
            "-O3",
            "-std=c++17",
            &format!("--gpu-architecture={arch}"),
        ])
        .args(flags)
        .arg(&src)
        .arg("-o")
        .arg(out_dir.join(format!("{name}.ptx")));
        if let Some(cccl) = &cccl {
            cmd.arg(format!("-I{}", cccl.display()));
        }
        let status = cmd.status().expect("running nvcc"); // ok: a build script fails by panicking; nvcc ran a moment ago (--version)
        assert!(status.success(), "nvcc failed on {src}");
    }
}

/// The virtual architecture nvcc builds for (see the file's header).
fn ptx_arch() -> String {
    if let Ok(arch) = std::env::var("AMP_CUDA_ARCH") {
        return arch;
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let digits: String = cap.chars().filter(char::is_ascii_digit).collect();
    match digits.parse::<u32>() {
        Ok(n) if n >= 89 => format!("compute_{n}"),
        _ => panic!(
            "CUDA_COMPUTE_CAP={cap}: candle-amp's CUDA kernels need compute capability 8.9 (Ada) \
             or newer (FP8 conversions in hardware); build for 89 or 90, or without the `cuda` \
             feature"
        ),
    }
}
