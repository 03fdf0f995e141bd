//! The GPU's compute capability as the CUDA path reads it: an H100 or
//! H200 (9.0) or an Ada GPU (8.9) passes the check every kernel loader
//! makes; `AMP_COMPUTE_CAP` (set by `scripts/gpu/run-tests.sh`'s caller)
//! would make it believe another.

#[cfg(feature = "cuda")]
use anyhow::ensure;
use anyhow::Result;
use candle_core::Device;

fn capability(dev: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        let cc = amp::cuda::compute_capability(d)?;
        ensure!(
            cc >= amp::cuda::MIN_COMPUTE_CAPABILITY,
            "the test GPU reads as {cc:?}"
        );
        amp::cuda::ensure_supported(d)?;
    }
    // (only called with a CUDA device: `on_cuda` skips elsewhere)
    let _ = dev;
    Ok(())
}

test_device!(capability, capability_is_read_and_accepted);
