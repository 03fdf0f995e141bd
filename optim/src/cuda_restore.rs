//! The CUDA body of [`RestoreOnSkip`](crate::restore::RestoreOnSkip)
//! (`kernels/restore.cuh`): a descriptor per pair, copied to the device
//! with the launch, and a CUDA block per descriptor.

use crate::cuda::{address, bad, func, scalar_address, Outputs};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::Layout;

/// `CopyDesc` of restore.cuh.
#[repr(C)]
#[derive(Clone, Copy)]
struct CopyDesc {
    dst: u64,
    src: u64,
    bytes: u64,
}
// SAFETY: plain old data laid out as the C struct.
unsafe impl DeviceRepr for CopyDesc {}

/// The address of a contiguous input's first element (U8, F16 or F32, as
/// the states are) and its length in bytes.
fn span(op: &'static str, s: &CudaStorage, l: &Layout) -> amp_core::Result<(u64, u64)> {
    let ptr = address(op, s, l, s.dtype(), s.device())?;
    let bytes = l.shape().elem_count() * s.dtype().size_in_bytes();
    Ok((ptr, bytes as u64))
}

pub(crate) fn restore_on_skip(inputs: &[(&CudaStorage, &Layout)]) -> amp_core::Result<Outputs> {
    const OP: &str = "restore_on_skip";
    let Some(((gm, lgm), pairs)) = inputs.split_first() else {
        return Err(bad(OP, "no multiplier"));
    };
    if pairs.is_empty() || pairs.len() % 2 != 0 {
        return Err(bad(OP, "inputs come in (new, old) pairs"));
    }
    let dev = gm.device().clone();
    let gmul = scalar_address(OP, gm, lgm, &dev)?;
    let mut descs = Vec::with_capacity(pairs.len() / 2);
    for pair in pairs.chunks(2) {
        let [(new, ln), (old, lo)] = pair else {
            return Err(bad(OP, "inputs come in (new, old) pairs"));
        };
        if new.dtype() != old.dtype() || ln.shape().elem_count() != lo.shape().elem_count() {
            return Err(bad(OP, "a pair of another dtype or length"));
        }
        let ((dst, bytes), (src, _)) = (span(OP, new, ln)?, span(OP, old, lo)?);
        if bytes > 0 {
            descs.push(CopyDesc { dst, src, bytes });
        }
    }
    if descs.is_empty() {
        return Ok(Vec::new());
    }
    let stream = dev.cuda_stream();
    let d = stream.clone_htod(&descs).w()?;
    let f = func(&dev, "restore_on_skip")?;
    let mut b = stream.launch_builder(&f);
    b.arg(&d).arg(&gmul);
    let cfg = LaunchConfig {
        grid_dim: (descs.len() as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: each descriptor addresses `bytes` of a live contiguous input
    // at both ends (the new one written in place, as the step's in-place
    // F32 weights are); `gmul` one f32; one block per descriptor.
    unsafe { b.launch(cfg) }.w()?;
    Ok(Vec::new())
}
