//! CUDA bodies of the launches over many small tensors (`multi.rs`,
//! `kernels/multi.cuh`): a descriptor per tensor, copied to the device
//! with the launch, and a CUDA block per descriptor.

use crate::cuda::{
    address, bad, func, kind, pairs_device, scalar_address, Adam, Buf, Outputs, Outs, Streams,
    META_PER_STREAM, THREADS,
};
use crate::fused::META_LEN;
use crate::multi::{buffer_index, meta_at, LowBitMulti, MomentPlaces, BUFFER_DTYPES, MULTI_MAX};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{DType, Layout, Shape};

/// `SumDesc` of multi.cuh.
#[repr(C)]
#[derive(Clone, Copy)]
struct SumDesc {
    g: u64,
    si: u64,
    n: u64,
    vec: i32,
    _pad: i32,
    out: u64,
}
// SAFETY: plain old data laid out as the C struct.
unsafe impl DeviceRepr for SumDesc {}

/// `OneDesc` of multi.cuh.
#[repr(C)]
#[derive(Clone, Copy)]
struct OneDesc {
    s: Streams,
    o: Outs,
    k: Adam,
    n: u64,
    vec: i32,
    _pad: i32,
    copy_si: u64,
    amax: u64,
}
// SAFETY: plain old data laid out as the C struct.
unsafe impl DeviceRepr for OneDesc {}

fn one_block_each(blocks: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A checked element count of a tensor that takes the multi launches.
fn small(op: &'static str, l: &Layout) -> amp_core::Result<usize> {
    let n = l.shape().elem_count();
    if n == 0 || n > MULTI_MAX {
        return Err(bad(op, "a tensor of 1 to 8192 elements"));
    }
    Ok(n)
}

pub(crate) fn sum_sq_multi(inputs: &[(&CudaStorage, &Layout)]) -> amp_core::Result<Outputs> {
    const OP: &str = "grad_sum_sq_multi";
    let (dev, count) = pairs_device(OP, inputs)?;
    let stream = dev.cuda_stream();
    // SAFETY: block i of sumsq_multi_3 writes element i (each gradient has
    // 1..=MULTI_MAX elements: one CUDA block writes its total).
    let mut out = unsafe { dev.alloc::<f64>(count)? };
    let base = out.device_ptr_mut(&stream).0;
    let mut descs = Vec::with_capacity(count);
    for (i, pair) in inputs.chunks(2).enumerate() {
        let [(g, lg), (gs, lgs)] = pair else {
            return Err(bad(OP, "inputs come in (gradient, scale_inv) pairs"));
        };
        let n = small(OP, lg)?;
        let gp = address(OP, g, lg, DType::F32, &dev)?;
        descs.push(SumDesc {
            g: gp,
            si: scalar_address(OP, gs, lgs, &dev)?,
            n: n as u64,
            vec: i32::from(gp % 16 == 0),
            _pad: 0,
            out: base + 8 * i as u64,
        });
    }
    let d = stream.clone_htod(&descs).w()?;
    let f = func(&dev, "sumsq_multi_3")?;
    let mut b = stream.launch_builder(&f);
    b.arg(&d);
    // SAFETY: each descriptor addresses a live F32 gradient of n elements
    // (16-byte words only where aligned), its scale_inv, and one f64 of
    // `out`; one 32-thread block per descriptor.
    unsafe { b.launch(one_block_each(count, 32)) }.w()?;
    Ok(vec![(
        CudaStorage::wrap_cuda_slice(out, dev),
        Shape::from(count),
    )])
}

pub(crate) fn lowbit_multi(
    k: &LowBitMulti,
    inputs: &[(&CudaStorage, &Layout)],
) -> amp_core::Result<Outputs> {
    const OP: &str = "lowbit_adamw_step_multi";
    let count = k.steps.len();
    let (Some(((gm, lgm), params)), true) = (inputs.split_last(), inputs.len() == 8 * count + 1)
    else {
        return Err(bad(OP, "wrong number of inputs"));
    };
    if count == 0 {
        return Err(bad(OP, "no parameters"));
    }
    let dev = gm.device().clone();
    let stream = dev.cuda_stream();
    let gmul = scalar_address(OP, gm, lgm, &dev)?;
    let mut ns = Vec::with_capacity(count);
    let mut dtypes = Vec::with_capacity(count);
    for ((_, [_, m, v], _), p) in k.steps.iter().zip(params.chunks(8)) {
        ns.push(small(OP, p[0].1)?);
        dtypes.push([kind(*m).1, kind(*v).1]);
    }
    let places = MomentPlaces::new(&dtypes, &ns);
    let mut arenas = BUFFER_DTYPES
        .into_iter()
        .zip(places.lens)
        .map(|(dtype, len)| Buf::alloc(&dev, dtype, len))
        .collect::<amp_core::Result<Vec<_>>>()?;
    let bases: Vec<u64> = arenas.iter_mut().map(|a| a.address(&dev)).collect();
    // SAFETY: block i writes the 12 meta slots of parameter i, and zeroes
    // and then uses its 3 amax words after them.
    let mut meta = unsafe { dev.alloc::<f32>(META_LEN * count)? };
    let meta_base = meta.device_ptr_mut(&stream).0;
    let mut descs = Vec::with_capacity(count);
    for (i, (((step, qs, roots), p), n)) in
        k.steps.iter().zip(params.chunks(8)).zip(&ns).enumerate()
    {
        let [(w, lw), (ws, lws), (g, lg), (gs, lgs), (m, lm), (ms, lms), (v, lv), (vs, lvs)] = p
        else {
            return Err(bad(OP, "wrong number of inputs"));
        };
        for l in [lg, lm, lv] {
            if l.shape().elem_count() != *n {
                return Err(amp_core::Error::Shape {
                    op: OP,
                    lhs: lw.shape().clone(),
                    rhs: l.shape().clone(),
                });
            }
        }
        let kinds = [kind(None), kind(qs[0]), kind(qs[1]), kind(qs[2])];
        let mut s = Streams {
            data: [0; 4],
            scale_inv: [0; 4],
            kinds: kinds.map(|k| k.0),
            salt: 0,
        };
        s.roots(OP, qs[2], *roots)?;
        for (j, ((x, lx), (xs, lxs))) in [(w, lw), (g, lg), (m, lm), (v, lv)]
            .into_iter()
            .zip([(ws, lws), (gs, lgs), (ms, lms), (vs, lvs)])
            .enumerate()
        {
            s.data[j] = address(OP, x, lx, kinds[j].1, &dev)?;
            s.scale_inv[j] = scalar_address(OP, xs, lxs, &dev)?;
        }
        let at = |(dtype, off): (DType, usize)| {
            bases[buffer_index(dtype)] + (off * dtype.size_in_bytes()) as u64
        };
        let [mp, vp] = places.places[i];
        let slot0 = meta_base + 4 * meta_at(i) as u64;
        let mut o = Outs {
            data: [s.data[0], at(mp), at(vp)],
            copy: 0,
            meta: [0; 4 * META_PER_STREAM],
        };
        for (j, slot) in o.meta.iter_mut().enumerate() {
            *slot = slot0 + 4 * j as u64;
        }
        let c = step.constants();
        let vec = i32::from(s.data.iter().chain(&o.data).all(|a| a % 16 == 0));
        descs.push(OneDesc {
            s,
            o,
            k: Adam([c[0], c[1], c[2], c[3], c[4], c[5], c[6], 1.0]),
            n: *n as u64,
            vec,
            _pad: 0,
            copy_si: s.scale_inv[0],
            amax: slot0 + 4 * (4 * META_PER_STREAM) as u64,
        });
    }
    let d = stream.clone_htod(&descs).w()?;
    let f = func(&dev, "lowbit_multi")?;
    let mut b = stream.launch_builder(&f);
    b.arg(&d).arg(&gmul);
    // SAFETY: each descriptor addresses live inputs of n elements of their
    // kinds, the F32 weight itself as the weight's output (in place, see
    // lowbit.cu), places of n elements in the moment buffers (16-byte
    // aligned, `vec` only where every stream is), and 15 words of `meta`;
    // `gmul` one f32; one block per descriptor.
    unsafe { b.launch(one_block_each(count, THREADS)) }.w()?;
    let mut out: Outputs = arenas
        .into_iter()
        .map(|a| {
            let n = a.len();
            (a.storage(&dev), Shape::from(n))
        })
        .collect();
    out.push((
        CudaStorage::wrap_cuda_slice(meta, dev),
        Shape::from(META_LEN * count),
    ));
    Ok(out)
}
