//! Launches of the `bucket_*` kernels (`kernels/amp.cu`): up to
//! `BUCKET_MAX` items a launch (`blockIdx.y`), described by value in a
//! `BucketArgs`; more items take more launches into the same outputs.
//! By what they do, as `numerics/bucket/` has the ops: the casts
//! (`casts.rs`), the ranks' agreement on scales and bounds (`agree.rs`),
//! the decode-and-sum (`sums.rs`) and the bytes' layout (`layout.rs`);
//! here what they share (the launch arguments and grids, code views).

mod agree;
mod casts;
mod layout;
mod sums;

pub(crate) use agree::{bucket_column_max, bucket_max, bucket_mean_bound, bucket_scales_sent};
pub(crate) use casts::{
    bucket_amax, bucket_flag_scale_inv, bucket_quantize, bucket_requantize, bucket_scales,
};
pub(crate) use layout::{bucket_concat, bucket_copy_from};
pub(crate) use sums::bucket_decode_sum;

use super::launch::{multiprocessors, scalar as scalar_view, view};
use crate::error::{Error, Result};
use crate::numerics::qtype::QType;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig, SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{Layout, Shape};

/// Items a launch (`BUCKET_MAX`).
const ITEMS: usize = 64;
const THREADS: u32 = 256;

/// `BucketArgs` in amp.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct BucketArgs {
    src: [u64; ITEMS],
    len: [u64; ITEMS],
    out_off: [u64; ITEMS],
    aux: [u64; ITEMS],
    t: [i32; ITEMS],
}

// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl DeviceRepr for BucketArgs {}

impl BucketArgs {
    fn new() -> Self {
        Self {
            src: [0; ITEMS],
            len: [0; ITEMS],
            out_off: [0; ITEMS],
            aux: [0; ITEMS],
            t: [0; ITEMS],
        }
    }
}

/// One item: input address, length, output offset, extra, tensor.
#[derive(Clone, Copy)]
struct Item {
    src: u64,
    len: usize,
    out_off: usize,
    aux: u64,
    t: usize,
}

/// The grid of a launch of `items`: `blockIdx.y` the item, enough blocks
/// in x for the longest, about eight blocks a multiprocessor in all.
fn grid(dev: &CudaDevice, items: &[Item]) -> Result<LaunchConfig> {
    let longest = items.iter().map(|i| i.len).max().unwrap_or(0);
    let budget = (multiprocessors(dev)? * 8)
        .div_ceil(items.len().max(1))
        .max(1);
    let x = longest.div_ceil(THREADS as usize * 4).clamp(1, budget) as u32;
    Ok(LaunchConfig {
        grid_dim: (x, items.len() as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The launches for the items, `ITEMS` at a time (chunks of empty items
/// left out): the `BucketArgs` of each and its grid.
fn launches(dev: &CudaDevice, items: &[Item]) -> Result<Vec<(BucketArgs, LaunchConfig)>> {
    items
        .chunks(ITEMS)
        .filter(|c| c.iter().any(|i| i.len > 0))
        .map(|chunk| {
            let mut a = BucketArgs::new();
            for (k, i) in chunk.iter().enumerate() {
                a.src[k] = i.src;
                a.len[k] = i.len as u64;
                a.out_off[k] = i.out_off as u64;
                a.aux[k] = i.aux;
                a.t[k] = i.t as i32;
            }
            Ok((a, grid(dev, chunk)?))
        })
        .collect()
}

fn fmt_name(op: &'static str, qtype: QType) -> Result<&'static str> {
    match qtype {
        QType::E4M3 => Ok("e4m3"),
        QType::E5M2 => Ok("e5m2"),
        QType::F16 => Err(Error::Unsupported {
            op,
            what: "FP16 codes".into(),
        }),
    }
}

fn wrap_f32(s: CudaSlice<f32>, dev: &CudaDevice, n: usize) -> (CudaStorage, Shape) {
    (CudaStorage::wrap_cuda_slice(s, dev.clone()), Shape::from(n))
}

/// One block of a thread per item (the launches over one-element inputs).
fn one_block_of_items() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (ITEMS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Runs `launch` with the device addresses of one-element F32 `inputs`,
/// kept live (cudarc's guards) until it has queued its launches.
fn with_scalar_ptrs(
    op: &'static str,
    inputs: &[(&CudaStorage, &Layout)],
    stream: &std::sync::Arc<CudaStream>,
    launch: impl FnOnce(&[u64]) -> Result<()>,
) -> Result<()> {
    let views = inputs
        .iter()
        .map(|(s, l)| scalar_view(op, s, l))
        .collect::<Result<Vec<_>>>()?;
    let mut guards = Vec::with_capacity(views.len());
    let mut ptrs = Vec::with_capacity(views.len());
    for v in &views {
        let (p, g) = v.device_ptr(stream);
        ptrs.push(p);
        guards.push(g);
    }
    let done = launch(&ptrs);
    drop(guards);
    done
}

/// A code storage's view: `U8` for FP8, `F16` for FP16.
enum CodeView<'a> {
    U8(CudaView<'a, u8>),
    F16(CudaView<'a, half::f16>),
}

impl CodeView<'_> {
    fn new<'a>(
        op: &'static str,
        qtype: QType,
        (c, l): (&'a CudaStorage, &Layout),
    ) -> Result<CodeView<'a>> {
        Ok(if qtype == QType::F16 {
            CodeView::F16(view::<half::f16>(op, c, l)?)
        } else {
            CodeView::U8(view::<u8>(op, c, l)?)
        })
    }

    fn len(&self) -> usize {
        match self {
            Self::U8(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }

    fn ptr<'s>(&'s self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>) {
        match self {
            Self::U8(v) => v.device_ptr(stream),
            Self::F16(v) => v.device_ptr(stream),
        }
    }
}

fn code_name(qtype: QType) -> &'static str {
    match qtype {
        QType::E4M3 => "e4m3",
        QType::E5M2 => "e5m2",
        QType::F16 => "f16",
    }
}
