//! Loading the embedded PTX and launching its kernels on candle's stream.

use crate::error::{Error, Result};
use crate::numerics::capability::{check_capability, parse_capability};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::Layout;
use std::sync::Mutex;

/// The PTX built from `kernels/amp.cu` by `build.rs`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/amp.ptx"));
/// The name of our module in candle's per-device module cache.
const MODULE: &str = "candle_amp_kernels";
/// Threads per block (a multiple of 32; the reductions assume it).
pub(crate) const THREADS: u32 = 256;
/// Blocks of [`THREADS`] threads that fill one multiprocessor: a grid
/// holds this many per multiprocessor, a grid-stride loop covers the rest.
const BLOCKS_PER_SM: usize = 8;

/// The PTX built from `kernels/cast_t.cu` (the cast-transpose).
const CAST_T_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/cast_t.ptx"));
/// Its name in candle's module cache.
const CAST_T_MODULE: &str = "candle_amp_cast_t_kernels";

/// The PTX built from `kernels/block.cu` (the block-scaled casts).
const BLOCK_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/block.ptx"));
/// Its name in candle's module cache.
const BLOCK_MODULE: &str = "candle_amp_block_kernels";

/// The virtual architecture the PTX was built for (`build/nvcc.rs`).
const PTX_ARCH: &str = env!("AMP_PTX_ARCH");

/// The compute capability of `dev`'s GPU, `(major, minor)`, read from the
/// driver; or the one `AMP_COMPUTE_CAP` names, to try the checks of
/// [`ensure_supported`] on another GPU.
///
/// # Errors
/// The driver's; an `AMP_COMPUTE_CAP` that is not a capability.
pub fn compute_capability(dev: &CudaDevice) -> Result<(u32, u32)> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute as A;
    if let Some(v) = std::env::var("AMP_COMPUTE_CAP")
        .ok()
        .filter(|v| !v.trim().is_empty())
    {
        return parse_capability(&v).ok_or_else(|| Error::Unsupported {
            op: "AMP_COMPUTE_CAP",
            what: format!("{v:?} (a compute capability such as 8.9 or 90)"),
        });
    }
    let ctx = dev.cuda_stream().context().clone();
    let read = |a| {
        ctx.attribute(a).map_err(|e| Error::Unsupported {
            op: "compute_capability",
            what: format!("reading the device's compute capability: {e}"),
        })
    };
    let major = read(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = read(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok((major.max(0) as u32, minor.max(0) as u32))
}

/// [`check_capability`] of `dev`'s GPU against this build, once per
/// device (a refusal is returned again each time).
///
/// # Errors
/// As `check_capability`, and [`compute_capability`]'s.
pub fn ensure_supported(dev: &CudaDevice) -> Result<()> {
    static CHECKED: PerDevice<std::result::Result<(), String>> = Mutex::new(Vec::new());
    per_device(&CHECKED, dev, || {
        let arch = PTX_ARCH.parse().unwrap_or(90);
        compute_capability(dev)
            .and_then(|cc| check_capability(cc, arch))
            .map_err(|e| match e {
                Error::Unsupported { what, .. } => what,
                other => other.to_string(),
            })
    })
    .map_err(|what| Error::Unsupported { op: "CUDA", what })
}

/// A value kept per device (by ordinal).
type PerDevice<T> = Mutex<Vec<(usize, T)>>;

/// `cache`'s value for `dev`, made by `make` the first time.
fn per_device<T: Clone>(cache: &PerDevice<T>, dev: &CudaDevice, make: impl FnOnce() -> T) -> T {
    let ordinal = dev.cuda_stream().context().ordinal();
    let known = cache.lock().ok().and_then(|k| {
        k.iter()
            .find(|(o, _)| *o == ordinal)
            .map(|(_, v)| v.clone())
    });
    known.unwrap_or_else(|| {
        let v = make();
        if let Ok(mut k) = cache.lock() {
            k.push((ordinal, v.clone()));
        }
        v
    })
}

/// A cast-transpose kernel `name` (`kernels/cast_t.cu`), loaded once per device.
pub(crate) fn cast_t_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    ensure_supported(dev)?;
    Ok(dev
        .get_or_load_custom_func(name, CAST_T_MODULE, CAST_T_PTX)?
        .into_cuda_function())
}

/// A block-scaled cast kernel `name` (`kernels/block.cu`), loaded once per
/// device.
pub(crate) fn block_func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    ensure_supported(dev)?;
    Ok(dev
        .get_or_load_custom_func(name, BLOCK_MODULE, BLOCK_PTX)?
        .into_cuda_function())
}

/// Our kernel `name`, loaded once per device.
pub(crate) fn func(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    ensure_supported(dev)?;
    Ok(dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function())
}

/// The number of multiprocessors of `dev`'s GPU, read from the driver
/// once per device and kept: grid-stride kernels size their grids to fill
/// the GPU once (docs/ARCHITECTURE.md, "Grid sizes and the SM count").
///
/// # Errors
/// The driver's, if the attribute cannot be read.
pub fn multiprocessors(dev: &CudaDevice) -> Result<usize> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    static KNOWN: PerDevice<std::result::Result<usize, String>> = Mutex::new(Vec::new());
    per_device(&KNOWN, dev, || {
        dev.cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map(|n| usize::try_from(n).unwrap_or(1).max(1))
            .map_err(|e| format!("reading the device's multiprocessor count: {e}"))
    })
    .map_err(|what| Error::Unsupported {
        op: "multiprocessors",
        what,
    })
}

/// A grid for `items` units of work of one thread each: at most
/// [`BLOCKS_PER_SM`] blocks per multiprocessor of `dev`.
pub(crate) fn grid(dev: &CudaDevice, items: usize) -> Result<LaunchConfig> {
    let max_blocks = multiprocessors(dev)? * BLOCKS_PER_SM;
    let blocks = items.div_ceil(THREADS as usize).clamp(1, max_blocks) as u32;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One block (the small metadata kernels).
pub(crate) fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The contiguous elements of a storage, as a view from its start offset.
pub(crate) fn view<'a, T: CudaDType>(
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
pub(crate) fn aligned<T>(
    v: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
    dev: &CudaDevice,
) -> bool {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let stream = dev.cuda_stream();
    let (ptr, _guard) = v.device_ptr(&stream);
    ptr % 16 == 0
}

/// A 1-element F32 input: a scale, scale_inv or amax.
pub(crate) fn scalar<'a>(
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
pub(crate) struct Current {
    rule: i32,
    margin: u32,
    max: f32,
    scale: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    scale_inv: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
}

/// Null pointers and zeros for a cast without [`Current`].
const NO_CURRENT: (u64, i32, u32, f32) = (0, 0, 0, 0.0);

impl Current {
    pub(crate) fn new(
        dev: &CudaDevice,
        qtype: crate::numerics::qtype::QType,
        from: Option<crate::numerics::scale::FromAmax>,
    ) -> Result<Option<Self>> {
        let Some(from) = from else {
            return Ok(None);
        };
        Ok(Some(Self {
            // bit 0 the rule, bit 1 the flag (cast_scale in cast.cuh)
            rule: match from.rule {
                crate::numerics::scale::ScaleRule::Te => 0,
                crate::numerics::scale::ScaleRule::PowerOfTwo => 1,
            } | (i32::from(from.flag) << 1),
            margin: from.margin,
            max: qtype.max(),
            // SAFETY (both): the kernel's first thread writes them.
            scale: unsafe { dev.alloc::<f32>(1)? },
            scale_inv: unsafe { dev.alloc::<f32>(1)? },
        }))
    }

    /// Pushes the scale parameter (`input` is the scale, or null when the
    /// kernel computes it).
    pub(crate) fn push_scale<'a>(
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
    pub(crate) fn push_tail<'a>(
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
    pub(crate) fn outputs(
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
