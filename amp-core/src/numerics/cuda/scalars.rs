//! Launch of `gather_scalars` (`kernels/amp.cu`): one-element F32/F64
//! storages side by side as F64, 256 per launch, the addresses passed by
//! value (no host-to-device copy).

use super::launch::func;
use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{DType, Layout, Shape};

/// Values per launch (`GATHER_MAX` in amp.cu).
const CHUNK: usize = 256;

pub(crate) fn gather_scalars(
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "read_scalars";
    let Some((first, _)) = inputs.first() else {
        return Err(Error::Unsupported {
            op: OP,
            what: "no input".into(),
        });
    };
    let dev = first.device().clone();
    let stream = dev.cuda_stream();
    let n = inputs.len();
    // SAFETY: the launches write every element.
    let mut out = unsafe { dev.alloc::<f64>(n)? };
    let f = func(&dev, "gather_scalars")?;
    for (c, chunk) in inputs.chunks(CHUNK).enumerate() {
        let mut ptrs = [0u64; CHUNK];
        let mut wide = [0u32; CHUNK / 32];
        let mut guards = Vec::with_capacity(chunk.len());
        for (i, (s, l)) in chunk.iter().enumerate() {
            let at = l.start_offset();
            let (ptr, size) = match s.dtype() {
                DType::F32 => {
                    let (p, g) = s.as_cuda_slice::<f32>()?.device_ptr(&stream);
                    guards.push(g);
                    (p, 4)
                }
                DType::F64 => {
                    let (p, g) = s.as_cuda_slice::<f64>()?.device_ptr(&stream);
                    guards.push(g);
                    wide[i / 32] |= 1 << (i % 32);
                    (p, 8)
                }
                got => {
                    return Err(Error::DType {
                        op: OP,
                        expected: "F32 or F64",
                        got,
                    })
                }
            };
            ptrs[i] = ptr + (at * size) as u64;
        }
        let len = chunk.len() as i32;
        let mut dst = out.slice_mut(c * CHUNK..c * CHUNK + chunk.len());
        let mut b = stream.launch_builder(&f);
        b.arg(&ptrs).arg(&wide).arg(&len).arg(&mut dst);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (CHUNK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every pointer is the address of a live one-element F32 or
        // F64 storage element (held by `guards`), flagged by its dtype.
        unsafe { b.launch(cfg) }.w()?;
        drop(guards);
    }
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from(n),
    )])
}
