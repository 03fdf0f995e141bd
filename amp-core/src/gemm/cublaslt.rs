//! The FP8 GEMM on CUDA through cuBLASLt.
//!
//! `y [m, n] = (a [m, k] · b [n, k]ᵀ) * a.scale_inv * b.scale_inv`, FP8
//! inputs (E4M3 or E5M2, not both E5M2: cuBLASLt has no E5M2 x E5M2 kernel),
//! F32 accumulation, F32, BF16 or F16 output.
//!
//! - Layout: Hopper's FP8 tensor cores take only "TN". Row-major `b [n, k]`
//!   is column-major `k x n`, so cuBLASLt computes `D = op(A) · op(B)` with
//!   `A = b` (`transa = T`), `B = a` (`transb = N`) and `D` = `y` seen as
//!   column-major `n x m`: no copy, no transpose.
//! - Alignment: cuBLASLt's FP8 kernels want every dimension a multiple of
//!   16 (leading dimensions of 16 bytes). Operands whose `m`, `n` or `k` are
//!   not are padded with zero codes (MS-AMP does the same) and the output is
//!   cut back; the padding costs one copy of the operand.
//! - Scales: `A_SCALE_POINTER` / `B_SCALE_POINTER` point at the operands'
//!   `scale_inv` tensors on the device (no host read). cuBLASLt refuses a
//!   scale pointer that is not 16-byte aligned (seen on the H100); such a
//!   scale is first copied, on the stream, into a 16-byte-aligned slot.
//! - Epilogue ([`Epilogue`]): a BF16 bias through `CUBLASLT_EPILOGUE_BIAS`
//!   (its length is D's row count, our `n`) and a residual as C with
//!   beta = 1, C's layout that of D; the caller sends only unpadded BF16
//!   cases here.
//! - Alignment: each pointer's alignment (up to 256 bytes; A and B may be
//!   views at an offset) is declared in the heuristic's preferences
//!   (`MIN_ALIGNMENT_*`, the bias's through its pointer) and is part of the
//!   plan's key, so a cached algorithm never meets a pointer less aligned
//!   than the one it was chosen for.
//! - Per shape (m, n, k, formats, output dtype, fast accumulation,
//!   epilogue, alignments) the descriptors and the heuristic's first algorithm
//!   are made once and cached; the 32 MiB workspace is allocated once per
//!   device (`gemm_plan.rs`).
//! - Output buffers come from the stream-ordered pool; creating a context
//!   raises the default pool's release threshold (see
//!   [`keep_freed_memory`](crate::numerics::cuda::pool::keep_freed_memory)) so freed outputs are
//!   reused instead of being unmapped at every synchronize.

use super::plan::{
    context, lt_err, set_attr, LtContext, Plan, PlanKey, ALIGN, OP, WORKSPACE_BYTES,
};
use crate::error::{Error, Result};
use crate::gemm::Epilogue;
use crate::numerics::format::Fp8Format;
use crate::scaling::tensor::ScalingTensor;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{
    self as driver, CudaStream, DevicePtr, DevicePtrMut,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, WrapErr};
use candle_core::{DType, Device, Storage, Tensor};
use half::{bf16, f16};
use std::ffi::c_void;
use std::sync::Arc;

pub(crate) use super::cublaslt_block::block_gemm;

/// Zero codes appended so that each dim of a 2-D U8 tensor is a multiple of 16.
pub(super) fn pad(t: &Tensor) -> Result<Tensor> {
    let (r, c) = t.dims2()?;
    let mut t = t.clone();
    if c % ALIGN != 0 {
        t = t.pad_with_zeros(1, 0, ALIGN - c % ALIGN)?;
    }
    if r % ALIGN != 0 {
        t = t.pad_with_zeros(0, 0, ALIGN - r % ALIGN)?;
    }
    Ok(t.contiguous()?)
}

/// The device address of a contiguous tensor's first element.
pub(super) fn address(t: &Tensor, stream: &Arc<CudaStream>) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        return Err(Error::UnsupportedDevice {
            op: OP,
            device: t.device().location(),
        });
    };
    let bytes = t.dtype().size_in_bytes() as u64;
    let base = match s.dtype() {
        DType::U8 => s.as_cuda_slice::<u8>()?.device_ptr(stream).0,
        DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(stream).0,
        DType::BF16 => s.as_cuda_slice::<bf16>()?.device_ptr(stream).0,
        got => {
            return Err(Error::DType {
                op: OP,
                expected: "U8 codes, an F32 scale or a BF16 addend",
                got,
            })
        }
    };
    Ok(base + bytes * layout.start_offset() as u64)
}

/// A BF16 addend's address, 16-byte aligned (a copy into fresh storage
/// where the tensor's own is not, as cuBLASLt wants for C and the bias).
pub(super) fn addend(
    t: Option<&Tensor>,
    stream: &Arc<CudaStream>,
) -> Result<(Option<Tensor>, u64)> {
    let Some(t) = t else {
        return Ok((None, 0));
    };
    let mut t = t.contiguous()?;
    if address(&t, stream)? % 16 != 0 {
        // a fresh buffer at offset 0 (`copy` would keep the offset)
        t = t.force_contiguous()?;
    }
    let at = address(&t, stream)?;
    if at % 16 != 0 {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("an epilogue addend at {at:#x}, not 16-byte aligned"),
        });
    }
    Ok((Some(t), at))
}

/// The alignment of a device address that cuBLASLt's preferences speak of:
/// the largest power of two up to 256 dividing it.
fn alignment(at: u64) -> u32 {
    if at == 0 {
        256
    } else {
        1u32 << at.trailing_zeros().min(8)
    }
}

/// The cuBLASLt FP8 GEMM; see the module docs. Operands: 2-D FP8 tensors
/// on one CUDA device (checked by the caller), not both E5M2; an epilogue
/// only with BF16 output, BF16 addends of the right shapes and `m`, `n`,
/// `k` multiples of 16 (checked by the caller).
pub(crate) fn fp8_gemm(
    a: &ScalingTensor,
    b: &ScalingTensor,
    out: DType,
    fast_accum: bool,
    epi: Epilogue<'_>,
) -> Result<Tensor> {
    let (Some(fa), Some(fb)) = (a.qtype().fp8(), b.qtype().fp8()) else {
        return Err(Error::Unsupported {
            op: OP,
            what: "FP16 operand".into(),
        });
    };
    if fa == Fp8Format::E5M2 && fb == Fp8Format::E5M2 {
        return Err(Error::Unsupported {
            op: OP,
            what: "cuBLASLt has no E5M2 x E5M2 FP8 GEMM".into(),
        });
    }
    let Device::Cuda(dev) = a.device() else {
        return Err(Error::UnsupportedDevice {
            op: OP,
            device: a.device().location(),
        });
    };
    let m = a.shape().dims2()?.0;
    let n = b.shape().dims2()?.0;
    let (ad, bd) = (pad(a.data())?, pad(b.data())?);
    let ctx = context(dev)?;
    let mut ctx = ctx.lock().map_err(|_| Error::Poisoned { op: OP })?;
    let stream = ctx.stream.clone();
    // cuBLASLt's A is our b, its B our a.
    let mut scales = (
        address(b.meta().scale_inv(), &stream)?,
        address(a.meta().scale_inv(), &stream)?,
    );
    if scales.0 % 16 != 0 || scales.1 % 16 != 0 {
        let (slots, _guard) = ctx.slots.device_ptr(&stream);
        // SAFETY: 4-byte device-to-device copies between live allocations,
        // ordered on the stream before the GEMM that reads them.
        unsafe {
            driver::result::memcpy_dtod_async(slots, scales.0, 4, stream.cu_stream()).w()?;
            driver::result::memcpy_dtod_async(slots + 16, scales.1, 4, stream.cu_stream()).w()?;
        }
        scales = (slots, slots + 16);
    }
    let k = a.shape().dims2()?.1;
    let g = Planned {
        ad: &ad,
        bd: &bd,
        mn: (m, n),
        k,
        formats: (fa, fb),
        out,
        fast: fast_accum,
        modes: [0, 0],
        scales,
    };
    g.launch(&mut ctx, dev, epi)
}

/// A GEMM ready for cuBLASLt: the padded codes (`ad` our `a`, `bd` our
/// `b`), the unpadded `(m, n)` and `k`, the formats, output, fast
/// accumulation, scale modes and the scale pointers (cuBLASLt's A's, B's).
pub(super) struct Planned<'a> {
    pub(super) ad: &'a Tensor,
    pub(super) bd: &'a Tensor,
    pub(super) mn: (usize, usize),
    pub(super) k: usize,
    pub(super) formats: (Fp8Format, Fp8Format),
    pub(super) out: DType,
    pub(super) fast: bool,
    pub(super) modes: [u8; 2],
    pub(super) scales: (u64, u64),
}

impl Planned<'_> {
    /// The plan of this shape (made once and cached), its pointers set,
    /// the output allocated and the GEMM queued; the output cut back to
    /// `[m, n]`. An epilogue only without padding.
    pub(super) fn launch(
        &self,
        ctx: &mut LtContext,
        dev: &CudaDevice,
        epi: Epilogue<'_>,
    ) -> Result<Tensor> {
        let stream = ctx.stream.clone();
        let (m, n) = self.mn;
        let (mp, kp) = self.ad.dims2()?;
        let np = self.bd.dims2()?.0;
        let padded = (mp, np) != (m, n) || kp != self.k;
        if padded && (epi.bias.is_some() || epi.residual.is_some()) {
            return Err(Error::Unsupported {
                op: OP,
                what: format!("an epilogue on a padded GEMM (m={m} n={n} k={})", self.k),
            });
        }
        // kept alive until the GEMM is queued
        let (_bias, bias_ptr) = addend(epi.bias, &stream)?;
        let (_res, c_ptr) = addend(epi.residual, &stream)?;
        let a_ptr = address(self.ad, &stream)?;
        let b_ptr = address(self.bd, &stream)?;
        let key = PlanKey {
            m: mp,
            n: np,
            k: kp,
            fa: self.formats.0,
            fb: self.formats.1,
            out: self.out,
            fast: self.fast,
            bias: epi.bias.is_some(),
            c: epi.residual.is_some(),
            // cuBLASLt's A is our b
            align: [
                alignment(b_ptr),
                alignment(a_ptr),
                alignment(c_ptr),
                alignment(bias_ptr),
            ],
            modes: self.modes,
        };
        let scales = self.scales;
        if !ctx.plans.contains_key(&key) {
            let plan = ctx.plan(key, scales, bias_ptr)?;
            ctx.plans.insert(key, plan);
        }
        let ctx = &*ctx;
        let plan = ctx.plans.get(&key).ok_or(Error::Poisoned { op: OP })?;
        // SAFETY: the plan's descriptor is only used under the context's lock.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t as A;
            set_attr(
                plan.desc,
                A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                &scales.0,
            )?;
            set_attr(
                plan.desc,
                A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                &scales.1,
            )?;
            if epi.bias.is_some() {
                set_attr(plan.desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr)?;
            }
        }
        let c = (epi.residual.is_some()).then_some(c_ptr);
        let storage = match self.out {
            DType::BF16 => run::<bf16>(ctx, plan, dev, (a_ptr, b_ptr, c), mp * np)?,
            DType::F16 => run::<f16>(ctx, plan, dev, (a_ptr, b_ptr, c), mp * np)?,
            _ => run::<f32>(ctx, plan, dev, (a_ptr, b_ptr, c), mp * np)?,
        };
        let y = Tensor::from_storage(
            Storage::Cuda(storage),
            (mp, np),
            candle_core::op::BackpropOp::none(),
            false,
        );
        if (mp, np) == (m, n) {
            Ok(y)
        } else {
            Ok(y.narrow(0, 0, m)?.narrow(1, 0, n)?.contiguous()?)
        }
    }
}

/// Allocates the output and launches the plan's GEMM on the stream; `c`
/// (a residual of D's shape and type) is added with beta = 1.
fn run<T: candle_core::cuda_backend::CudaDType + driver::DeviceRepr>(
    ctx: &LtContext,
    plan: &Plan,
    dev: &CudaDevice,
    (a_ptr, b_ptr, c): (u64, u64, Option<u64>),
    len: usize,
) -> Result<CudaStorage> {
    let stream = &ctx.stream;
    // SAFETY: cuBLASLt writes every element of D.
    let mut y = unsafe { dev.alloc::<T>(len)? };
    {
        let (y_ptr, _gy) = y.device_ptr_mut(stream);
        let (ws, _gw) = ctx.workspace.device_ptr(stream);
        let alpha = 1.0f32;
        let (beta, c_ptr) = match c {
            Some(c) => (1.0f32, c),
            None => (0.0f32, y_ptr),
        };
        // SAFETY: pointers to live device memory of the plan's shapes and
        // types, all on `stream`; without a residual C is D's buffer,
        // unread with beta = 0.
        unsafe {
            lt::matmul(
                ctx.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b_ptr as *const c_void,
                plan.a,
                a_ptr as *const c_void,
                plan.b,
                c_ptr as *const c_void,
                plan.d,
                y_ptr as *mut c_void,
                plan.d,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )
            .map_err(|e| lt_err("matmul", e))?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}
