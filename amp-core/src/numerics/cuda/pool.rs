//! The device's default stream-ordered memory pool, which every candle
//! tensor on CUDA comes from: keep freed blocks pooled (as PyTorch's
//! caching allocator does) and read its high-water marks (the GPT
//! example's peak memory).

use crate::error::{Error, Result};
use candle_core::cuda_backend::cudarc::driver::{self as driver};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Device;
use std::ffi::c_void;

/// Sets the release threshold of the device's default stream-ordered memory
/// pool: memory freed to the pool above this many bytes goes back to the
/// driver at the next synchronization. CUDA's default is 0, which makes every
/// synchronized step map its outputs again; `u64::MAX` keeps them pooled (as
/// PyTorch's caching allocator does).
///
/// # Errors
/// [`Error::UnsupportedDevice`] off CUDA; driver errors.
pub fn set_pool_release_threshold(device: &Device, bytes: u64) -> Result<()> {
    let Device::Cuda(dev) = device else {
        return Err(Error::UnsupportedDevice {
            op: "set_pool_release_threshold",
            device: device.location(),
        });
    };
    set_threshold(dev, bytes)
}

/// [`set_pool_release_threshold`] with `u64::MAX`: freed device memory stays
/// in the pool for reuse. Also turns off the pool's three cross-stream reuse
/// policies (reuse after an event dependency, opportunistic reuse, reuse
/// with an inserted dependency): they only decide whether a block freed on
/// one stream may serve an allocation on another, and candle's device runs
/// everything on one stream, where a freed block is always reusable in
/// stream order; their bookkeeping made each `cuMemAllocAsync` /
/// `cuMemFreeAsync` pair cost more host time (docs/ARCHITECTURE.md, "The
/// memory pool").
///
/// # Errors
/// As [`set_pool_release_threshold`].
pub fn keep_freed_memory(device: &Device) -> Result<()> {
    set_pool_release_threshold(device, u64::MAX)?;
    let pool = default_pool(device, "keep_freed_memory")?;
    use driver::sys::CUmemPool_attribute as A;
    for attr in [
        A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
        A::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
        A::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
    ] {
        let mut off = 0i32;
        // SAFETY: a valid pool; these attributes take an int (0 or 1).
        unsafe {
            driver::sys::cuMemPoolSetAttribute(pool, attr, &mut off as *mut i32 as *mut c_void)
                .result()
                .w()?;
        }
    }
    Ok(())
}

/// Stops cudarc from creating (and later destroying) two CUDA events with
/// every allocation on `device`'s context, and from recording and waiting
/// on them at every use. They exist to order a buffer's uses across
/// streams; candle's device (`Device::new_cuda`) runs every op on one
/// stream (the per-thread default stream, which cudarc does not count as a
/// second stream), and so do candle-amp's kernels and cuBLASLt; NCCL's
/// collectives and the bucketed reductions run on a
/// [`SideStream`](crate::SideStream), which fences with its own events. So
/// the per-buffer events only cost driver calls on the host (a few
/// thousand allocations per GPT step). Returns whether tracking was on.
///
/// # Safety
/// Nothing may use a buffer on another stream of this context (one
/// created by `CudaContext::new_stream`, or by another library) without
/// its own synchronization: a [`SideStream`](crate::SideStream) used as
/// its docs say is synchronized. No other host thread may use this device
/// (each host thread gets its own per-thread stream).
///
/// # Errors
/// [`Error::UnsupportedDevice`] off CUDA.
pub unsafe fn skip_event_tracking(device: &Device) -> Result<bool> {
    let Device::Cuda(dev) = device else {
        return Err(Error::UnsupportedDevice {
            op: "skip_event_tracking",
            device: device.location(),
        });
    };
    let ctx = dev.cuda_stream().context().clone();
    if !ctx.is_event_tracking() {
        return Ok(false);
    }
    // SAFETY: the caller vouches for every other stream's synchronization.
    unsafe { ctx.disable_event_tracking() };
    Ok(true)
}

pub(crate) fn set_threshold(dev: &CudaDevice, mut bytes: u64) -> Result<()> {
    use driver::sys as dsys;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().w()?;
    let mut pool: dsys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: plain driver calls with valid out-pointers on a bound context.
    unsafe {
        dsys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .w()?;
        dsys::cuMemPoolSetAttribute(
            pool,
            dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut bytes as *mut u64 as *mut c_void,
        )
        .result()
        .w()?;
    }
    Ok(())
}

/// `(free, total)` bytes of the CUDA device's memory, as the driver
/// reports them now (`cuMemGetInfo`): what a run may still allocate,
/// before it starts.
///
/// # Errors
/// [`Error::UnsupportedDevice`] off CUDA; driver errors.
pub fn device_memory(device: &Device) -> Result<(u64, u64)> {
    let Device::Cuda(dev) = device else {
        return Err(Error::UnsupportedDevice {
            op: "device_memory",
            device: device.location(),
        });
    };
    dev.cuda_stream().context().bind_to_thread().w()?;
    let (free, total) = driver::result::mem_get_info().w()?;
    Ok((free as u64, total as u64))
}

/// High-water marks of the device's default memory pool (the one cudarc's
/// stream-ordered allocations, and so every candle tensor, come from):
/// `(used, reserved)` bytes since the pool was created or since the last
/// [`reset_pool_peaks`]. Memory outside the pool (cuBLAS/cuBLASLt
/// workspaces, the CUDA context, module images) is not counted.
///
/// # Errors
/// [`Error::UnsupportedDevice`] off CUDA; driver errors.
pub fn pool_peaks(device: &Device) -> Result<(u64, u64)> {
    use driver::sys as dsys;
    let pool = default_pool(device, "pool_peaks")?;
    let (mut used, mut reserved) = (0u64, 0u64);
    // SAFETY: valid pool, out-pointers to u64 (the attributes' type).
    unsafe {
        dsys::cuMemPoolGetAttribute(
            pool,
            dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            &mut used as *mut u64 as *mut c_void,
        )
        .result()
        .w()?;
        dsys::cuMemPoolGetAttribute(
            pool,
            dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            &mut reserved as *mut u64 as *mut c_void,
        )
        .result()
        .w()?;
    }
    Ok((used, reserved))
}

/// Resets the high-water marks of [`pool_peaks`] to the current use.
///
/// # Errors
/// As [`pool_peaks`].
pub fn reset_pool_peaks(device: &Device) -> Result<()> {
    use driver::sys as dsys;
    let pool = default_pool(device, "reset_pool_peaks")?;
    let mut zero = 0u64;
    // SAFETY: valid pool; the driver only accepts 0 for these attributes.
    unsafe {
        for attr in [
            dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            dsys::cuMemPoolSetAttribute(pool, attr, &mut zero as *mut u64 as *mut c_void)
                .result()
                .w()?;
        }
    }
    Ok(())
}

fn default_pool(device: &Device, op: &'static str) -> Result<driver::sys::CUmemoryPool> {
    let Device::Cuda(dev) = device else {
        return Err(Error::UnsupportedDevice {
            op,
            device: device.location(),
        });
    };
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().w()?;
    let mut pool: driver::sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer on a bound context.
    unsafe {
        driver::sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
            .result()
            .w()?;
    }
    Ok(pool)
}
