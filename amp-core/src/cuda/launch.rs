//! Loading the embedded PTX and launching its kernels on candle's stream.

use crate::error::{Error, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::Layout;

/// The PTX built from `kernels/amp.cu` by `build.rs`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/amp.ptx"));
/// The name of our module in candle's per-device module cache.
const MODULE: &str = "candle_amp_kernels";
/// Threads per block (a multiple of 32; the reductions assume it).
pub(super) const THREADS: u32 = 256;
/// At most this many blocks: a grid-stride loop covers the rest (8 blocks
/// of 256 threads fill one SM; 132 SMs on an H100).
const MAX_BLOCKS: usize = 132 * 8;

/// The PTX built from `kernels/nn.cu` (the fused training ops).
const NN_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/nn.ptx"));
/// Its name in candle's module cache.
const NN_MODULE: &str = "candle_amp_nn_kernels";

/// The PTX built from `kernels/cast_t.cu` (the cast-transpose).
const CAST_T_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/cast_t.ptx"));
/// Its name in candle's module cache.
const CAST_T_MODULE: &str = "candle_amp_cast_t_kernels";

/// The PTX built from `kernels/flash.cu` (causal flash attention).
const FLASH_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash.ptx"));
/// Its name in candle's module cache.
const FLASH_MODULE: &str = "candle_amp_flash_kernels";

/// A flash-attention kernel `name` (`kernels/flash.cu`), loaded once per device.
pub(super) fn flash_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, FLASH_MODULE, FLASH_PTX)?
        .into_cuda_function())
}

/// A cast-transpose kernel `name` (`kernels/cast_t.cu`), loaded once per device.
pub(super) fn cast_t_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, CAST_T_MODULE, CAST_T_PTX)?
        .into_cuda_function())
}

/// Our kernel `name`, loaded once per device.
pub(super) fn func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

/// A fused training op's kernel `name` (`kernels/nn.cu`), loaded once per device.
pub(super) fn nn_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, NN_MODULE, NN_PTX)?
        .into_cuda_function())
}

/// A grid for `items` units of work of one thread each.
pub(super) fn grid(items: usize) -> LaunchConfig {
    let blocks = items.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block (the small metadata kernels).
pub(super) fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The contiguous elements of a storage, as a view from its start offset.
pub(super) fn view<'a, T: CudaDType>(
    op: &'static str,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    let (start, end) = l.contiguous_offsets().ok_or(Error::Unsupported {
        op,
        what: "non-contiguous input".into(),
    })?;
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// Whether a view's device address is 16-byte aligned (the vector paths).
pub(super) fn aligned<T>(
    v: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
    dev: &CudaDevice,
) -> bool {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let stream = dev.cuda_stream();
    let (ptr, _guard) = v.device_ptr(&stream);
    ptr % 16 == 0
}

/// A 1-element F32 input: a scale, scale_inv or amax.
pub(super) fn scalar<'a>(
    op: &'static str,
    s: &'a CudaStorage,
    l: &Layout,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>> {
    if l.shape().elem_count() != 1 {
        return Err(Error::Shape {
            op,
            lhs: candle_core::Shape::from(1usize),
            rhs: l.shape().clone(),
        });
    }
    view::<f32>(op, s, l)
}

/// The current-scaling arguments of the cast kernels (`CUR_PARAMS` in
/// cast.cuh): the scale rule, margin and format max, and the two outputs
/// the kernel writes (scale, scale_inv). Without it the kernels take their
/// scale input as the scale and get nulls here.
pub(super) struct Current {
    rule: i32,
    margin: u32,
    max: f32,
    scale: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    scale_inv: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
}

/// Null pointers and zeros for a cast without [`Current`].
const NO_CURRENT: (u64, i32, u32, f32) = (0, 0, 0, 0.0);

impl Current {
    pub(super) fn new(
        dev: &CudaDevice,
        qtype: crate::qtype::QType,
        from: Option<crate::cast::FromAmax>,
    ) -> Result<Option<Self>> {
        let Some(from) = from else {
            return Ok(None);
        };
        Ok(Some(Self {
            rule: match from.rule {
                crate::scale::ScaleRule::Te => 0,
                crate::scale::ScaleRule::PowerOfTwo => 1,
            },
            margin: from.margin,
            max: qtype.max(),
            // SAFETY (both): the kernel's first thread writes them.
            scale: unsafe { dev.alloc::<f32>(1)? },
            scale_inv: unsafe { dev.alloc::<f32>(1)? },
        }))
    }

    /// Pushes the scale parameter (`input` is the scale, or null when the
    /// kernel computes it).
    pub(super) fn push_scale<'a>(
        cur: &Option<Self>,
        b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
        input: &'a candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>,
    ) {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        match cur {
            Some(_) => b.arg(&NO_CURRENT.0),
            None => b.arg(input),
        };
    }

    /// Pushes the trailing `CUR_PARAMS` (`input` is the amax when current).
    pub(super) fn push_tail<'a>(
        cur: &'a mut Option<Self>,
        b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
        input: &'a candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>,
    ) {
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        match cur {
            Some(c) => b
                .arg(input)
                .arg(&c.rule)
                .arg(&c.margin)
                .arg(&c.max)
                .arg(&mut c.scale)
                .arg(&mut c.scale_inv),
            None => b
                .arg(&NO_CURRENT.0)
                .arg(&NO_CURRENT.1)
                .arg(&NO_CURRENT.2)
                .arg(&NO_CURRENT.3)
                .arg(&NO_CURRENT.0)
                .arg(&NO_CURRENT.0),
        };
    }

    /// The scale and scale_inv outputs, when current.
    pub(super) fn outputs(
        cur: Option<Self>,
        dev: &CudaDevice,
    ) -> Vec<(CudaStorage, candle_core::Shape)> {
        cur.map(|c| {
            let one = candle_core::Shape::from(1usize);
            vec![
                (
                    CudaStorage::wrap_cuda_slice(c.scale, dev.clone()),
                    one.clone(),
                ),
                (CudaStorage::wrap_cuda_slice(c.scale_inv, dev.clone()), one),
            ]
        })
        .unwrap_or_default()
    }
}
