//! CUDA body of [`Codec`]: `codec_encode` / `codec_decode` of
//! `kernels/codec_ops.cuh` (in lowbit.cu's module), the step kernels' own
//! packed codecs over a stream.

use crate::codec::Codec;
use crate::cuda::{address, func, kind, Buf, Outputs, THREADS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{DType, Layout};

pub(crate) fn codec(k: &Codec, inputs: &[(&CudaStorage, &Layout)]) -> amp_core::Result<Outputs> {
    const OP: &str = "lowbit_step_codec";
    let [(s, l)] = inputs else {
        return Err(crate::cuda::bad(OP, "wrong number of inputs"));
    };
    let dev = s.device().clone();
    let n = l.shape().elem_count();
    let (q, factor, name) = match *k {
        Codec::Encode { q, scale } => (q, scale, "codec_encode"),
        Codec::Decode { q, scale_inv } => (q, scale_inv, "codec_decode"),
    };
    let (kd, code_dtype) = kind(Some(q));
    let (in_dtype, out_dtype) = match k {
        Codec::Encode { .. } => (DType::F32, code_dtype),
        Codec::Decode { .. } => (code_dtype, DType::F32),
    };
    let src = address(OP, s, l, in_dtype, &dev)?;
    let mut out = Buf::alloc(&dev, out_dtype, n.max(1))?;
    let dst = out.address(&dev);
    // the four-element groups need every stream 16-byte aligned
    let vec = i32::from(src % 16 == 0 && dst % 16 == 0);
    let f = func(&dev, name)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    b.arg(&src)
        .arg(&n)
        .arg(&kd)
        .arg(&factor)
        .arg(&vec)
        .arg(&dst);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(4 * THREADS as usize).clamp(1, 4096) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: src holds n elements of in_dtype, dst n of out_dtype (groups
    // only where both are 16-byte aligned, none past n); every element of
    // dst is written.
    unsafe { b.launch(cfg) }.w()?;
    Ok(vec![(out.storage(&dev), l.shape().clone())])
}
