//! Launches of the causal flash attention (`kernels/flash.cu`): forward
//! (output and the rows' log-sum-exp), and backward (`rowsum(do * o)`,
//! then dq, dk, dv in one launch), with the kernels built for the
//! problem's head dimension. Inputs are contiguous BF16 storages laid out
//! as [`Flash`] says; nothing is read back to the host.

use super::flash_func;
use super::ops::store;
use crate::error::{Error, Result};
use crate::nn::fused::flash_shape::{Flash, HEAD_DIMS};
use crate::numerics::cuda::launch::aligned;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaView, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{Layout, Shape};
use half::bf16;

const OP: &str = "flash_attention";
/// Rows of a tile (`TILE` in flash.cu) and threads of a block (`NT`).
const TILE: usize = 64;
const THREADS: u32 = 128;

/// The shared memory (bytes) a block of the forward (`backward` false) or
/// the backward takes at head dimension `hd`, as flash.cu lays it out:
/// 64-row BF16 tiles of `hd` rounded up to 64 columns, 5 in the forward,
/// 4 in the backward (6 above `hd` 64, which keeps its stationary tiles).
fn smem_bytes(hd: usize, backward: bool) -> usize {
    let tile = TILE * hd.div_ceil(64) * 64 * std::mem::size_of::<bf16>();
    let tiles = match (backward, hd > 64) {
        (false, _) => 5,
        (true, false) => 4,
        (true, true) => 6,
    };
    tiles * tile
}

/// `flash.cu`'s kernel `stem` built for the problem's head dimension,
/// allowed the shared memory it takes, and that amount.
fn kernel(dev: &CudaDevice, f: &Flash, stem: &str, backward: bool) -> Result<(CudaFunction, u32)> {
    if !HEAD_DIMS.contains(&f.hd) {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("a head dimension of {}", f.hd),
        });
    }
    let func = flash_func(dev, &format!("{stem}_hd{}", f.hd))?;
    let bytes = smem_bytes(f.hd, backward);
    // at most 96 KiB
    super::allow_shared_memory(&func, bytes)?;
    Ok((func, bytes as u32))
}

/// The q, k, v views of the inputs: one packed projection (k and v at
/// [`Flash::kv_offsets`]) or three tensors.
fn qkv_views<'a>(
    f: &Flash,
    inputs: &'a [(&'a CudaStorage, &'a Layout)],
    dev: &CudaDevice,
) -> Result<[CudaView<'a, bf16>; 3]> {
    let n_in = f.in_shape().elem_count();
    if inputs.iter().any(|(_, l)| l.shape().elem_count() != n_in) {
        return Err(arity());
    }
    let views = match inputs {
        [(s, l)] if f.packed => {
            let x = crate::numerics::cuda::launch::view::<bf16>(OP, s, l)?;
            let (k, v) = f.kv_offsets();
            [x.slice(0..), x.slice(k..), x.slice(v..)]
        }
        [(q, lq), (k, lk), (v, lv)] if !f.packed => [
            crate::numerics::cuda::launch::view::<bf16>(OP, q, lq)?,
            crate::numerics::cuda::launch::view::<bf16>(OP, k, lk)?,
            crate::numerics::cuda::launch::view::<bf16>(OP, v, lv)?,
        ],
        _ => return Err(arity()),
    };
    if !views.iter().all(|v| aligned(v, dev)) {
        return Err(unaligned());
    }
    Ok(views)
}

fn arity() -> Error {
    Error::Unsupported {
        op: OP,
        what: "inputs that do not match the layout".into(),
    }
}

fn unaligned() -> Error {
    Error::Unsupported {
        op: OP,
        what: "rows that are not 16-byte aligned".into(),
    }
}

/// The grid: `x` blocks per (head, batch), 128 threads, `smem` bytes of
/// dynamic shared memory.
fn config(f: &Flash, x: usize, smem: u32) -> Result<LaunchConfig> {
    let dim = |n: usize| {
        u32::try_from(n)
            .ok()
            .filter(|&n| n <= 65_535)
            .ok_or(Error::Unsupported {
                op: OP,
                what: format!("{} heads x batch {}", f.heads, f.b),
            })
    };
    Ok(LaunchConfig {
        grid_dim: (
            u32::try_from(x).map_err(|_| arity())?,
            dim(f.heads)?,
            dim(f.b)?,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem,
    })
}

/// Query heads per key/value head, as the kernels take it.
fn group_i32(f: &Flash) -> Result<i32> {
    match f.kv_heads {
        kv if kv > 0 && f.heads % kv == 0 && (f.packed || kv == f.heads) => {
            i32::try_from(f.group()).map_err(|_| arity())
        }
        _ => Err(arity()),
    }
}

fn seq_i32(f: &Flash) -> Result<i32> {
    i32::try_from(f.t).map_err(|_| Error::Unsupported {
        op: OP,
        what: format!("sequences of {} rows", f.t),
    })
}

/// `(o, lse2)`: the output (BF16, [`Flash::out_shape`]) and per row of
/// every (batch, head) the log-sum-exp of the scaled scores in log2 units
/// (F32 `[b, heads, t]`).
pub(crate) fn fwd(
    f: Flash,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    let Some((first, _)) = inputs.first() else {
        return Err(arity());
    };
    let dev = first.device().clone();
    let [q, k, v] = qkv_views(&f, inputs, &dev)?;
    let t = seq_i32(&f)?;
    let [sb, sh, st] = f.in_strides();
    let [ob, oh, ot] = f.out_strides();
    let scale_log2 = f.scale() * std::f32::consts::LOG2_E;
    let group = group_i32(&f)?;
    // SAFETY (both): the kernel writes every row of every (batch, head).
    let mut o = unsafe { dev.alloc::<bf16>(f.b * f.t * f.width())? };
    let mut lse = unsafe { dev.alloc::<f32>(f.rows())? };
    let (func, smem) = kernel(&dev, &f, "flash_fwd_bf16", false)?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(&q).arg(&k).arg(&v).arg(&sb).arg(&sh).arg(&st);
    b.arg(&mut o).arg(&ob).arg(&oh).arg(&ot);
    b.arg(&mut lse).arg(&t).arg(&group).arg(&scale_log2);
    unsafe { b.launch(config(&f, f.t.div_ceil(TILE), smem)?) }.w()?;
    Ok(vec![
        (store(o, &dev), f.out_shape()),
        (store(lse, &dev), Shape::from((f.b, f.heads, f.t))),
    ])
}

/// The gradients of q, k, v (BF16, the inputs' layout: one packed
/// storage, or three) from the inputs, then `o`, `do` and `lse2`.
pub(crate) fn bwd(
    f: Flash,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    let n = if f.packed { 1 } else { 3 };
    if inputs.len() != n + 3 {
        return Err(arity());
    }
    let (qkv, rest) = inputs.split_at(n);
    let dev = qkv[0].0.device().clone();
    let [q, k, v] = qkv_views(&f, qkv, &dev)?;
    let [(o, lo), (dout, ld), (lse, ll)] = rest else {
        return Err(arity());
    };
    // the kernels index these by the problem's strides: sizes must match
    let out = f.out_shape();
    if lo.shape() != &out || ld.shape() != &out || ll.shape().elem_count() != f.rows() {
        return Err(arity());
    }
    let o = crate::numerics::cuda::launch::view::<bf16>(OP, o, lo)?;
    let dout = crate::numerics::cuda::launch::view::<bf16>(OP, dout, ld)?;
    let lse = crate::numerics::cuda::launch::view::<f32>(OP, lse, ll)?;
    if !(aligned(&o, &dev) && aligned(&dout, &dev)) {
        return Err(unaligned());
    }
    let t = seq_i32(&f)?;
    let [sb, sh, st] = f.in_strides();
    let [ob, oh, ot] = f.out_strides();
    let heads = i32::try_from(f.heads).map_err(|_| arity())?;
    let rows = i64::try_from(f.rows()).map_err(|_| arity())?;
    let chunks = (f.hd / 8) as i32;
    let stream = dev.cuda_stream();
    // SAFETY: one value per row.
    let mut dsum = unsafe { dev.alloc::<f32>(f.rows())? };
    let dot = flash_func(&dev, "flash_bwd_dot_bf16")?;
    let mut b = stream.launch_builder(&dot);
    b.arg(&o).arg(&dout).arg(&ob).arg(&oh).arg(&ot);
    b.arg(&mut dsum).arg(&heads).arg(&t).arg(&rows).arg(&chunks);
    let threads = 8 * f.rows();
    let cfg = LaunchConfig {
        grid_dim: (
            u32::try_from(threads.div_ceil(256)).map_err(|_| arity())?,
            1,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;

    let each = f.in_shape().elem_count();
    // SAFETY: the dK/dV blocks write every key row, the dQ blocks every
    // query row, of every (batch, head); packed, the three parts tile the
    // rows.
    let mut grads: Vec<_> = (0..n)
        .map(|_| unsafe { dev.alloc::<bf16>(each) })
        .collect::<std::result::Result<_, _>>()?;
    let group = group_i32(&f)?;
    let scale = f.scale();
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let (func, smem) = kernel(&dev, &f, "flash_bwd_bf16", true)?;
    {
        // Packed, dq, dk and dv are the columns at 0 and the k and v
        // offsets of every row of one storage: raw addresses, not
        // overlapping views.
        let mut held = Vec::with_capacity(n);
        let mut ptrs = Vec::with_capacity(3);
        for g in grads.iter_mut() {
            let (ptr, guard) = g.device_ptr_mut(&stream);
            held.push(guard);
            ptrs.push(ptr);
        }
        if f.packed {
            let (k, v) = f.kv_offsets();
            let bytes = |cols: usize| (cols * std::mem::size_of::<bf16>()) as u64;
            ptrs = vec![ptrs[0], ptrs[0] + bytes(k), ptrs[0] + bytes(v)];
        }
        let mut b = stream.launch_builder(&func);
        b.arg(&q).arg(&k).arg(&v).arg(&sb).arg(&sh).arg(&st);
        b.arg(&dout).arg(&ob).arg(&oh).arg(&ot).arg(&lse).arg(&dsum);
        for p in &ptrs {
            b.arg(p);
        }
        b.arg(&t).arg(&group).arg(&scale_log2).arg(&scale);
        unsafe { b.launch(config(&f, 2 * f.t.div_ceil(TILE), smem)?) }.w()?;
        drop(held);
    }
    let shape = f.in_shape();
    Ok(grads
        .into_iter()
        .map(|g| (store(g, &dev), shape.clone()))
        .collect())
}
