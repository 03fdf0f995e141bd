//! Which GPUs the CUDA path runs on: compute capability 8.9 (Ada) or newer,
//! where the FP8 tensor cores and the hardware FP8 conversions are, and no
//! older than the architecture the kernels were built for
//! (`CUDA_COMPUTE_CAP` at build time). Checked once per device, when the
//! first kernel or GEMM is loaded, so that an A100 or a build for the
//! wrong GPU is a sentence, not a driver error code.
//!
//! `AMP_COMPUTE_CAP` (`8.0`, `80`, `8.9` ...) makes the check believe
//! another capability than the GPU's: how the refusals are tried on an H100.

use crate::error::{Error, Result};

/// The oldest compute capability with FP8 tensor cores (Ada, 8.9).
pub const MIN_COMPUTE_CAPABILITY: (u32, u32) = (8, 9);

/// `"8.9"`, `"89"` or `"sm_89"` as `(8, 9)`; `None` for anything else.
pub fn parse_capability(s: &str) -> Option<(u32, u32)> {
    let s = s
        .trim()
        .trim_start_matches("sm_")
        .trim_start_matches("compute_");
    if let Some((a, b)) = s.split_once('.') {
        return Some((a.parse().ok()?, b.parse().ok()?));
    }
    let n: u32 = s.parse().ok()?;
    (n >= 10).then_some((n / 10, n % 10))
}

/// Whether the CUDA path runs on a GPU of capability `cc` with kernels
/// built for the virtual architecture `ptx_arch` (e.g. 90 for
/// `compute_90`).
///
/// # Errors
/// [`Error::Unsupported`] below 8.9 (no FP8 in hardware: an A100 or older),
/// or below the build's architecture (the driver cannot run PTX made for
/// a newer GPU: rebuild with `CUDA_COMPUTE_CAP` set to the GPU's).
pub fn check_capability(cc: (u32, u32), ptx_arch: u32) -> Result<()> {
    let (major, minor) = cc;
    if cc < MIN_COMPUTE_CAPABILITY {
        return Err(Error::Unsupported {
            op: "CUDA",
            what: format!(
                "a GPU of compute capability {major}.{minor}: candle-amp's CUDA path needs 8.9 \
                 (Ada: L4, L40S, RTX 4090) or newer (Hopper: H100, H200) for FP8 tensor cores \
                 and conversions; train this GPU through candle alone, or on the CPU"
            ),
        });
    }
    if major * 10 + minor < ptx_arch {
        return Err(Error::Unsupported {
            op: "CUDA",
            what: format!(
                "a GPU of compute capability {major}.{minor} with kernels built for \
                 compute_{ptx_arch}: rebuild with CUDA_COMPUTE_CAP={major}{minor}"
            ),
        });
    }
    Ok(())
}
