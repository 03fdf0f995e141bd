//! The cuBLASLt side of the FP8 GEMM (`gemm.rs`): one context per device
//! (handle, workspace, scale slots) and per [`PlanKey`] the descriptors and
//! the heuristic's algorithm, made once and cached.

use crate::error::{Error, Result};
use crate::numerics::format::Fp8Format;
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::cuda_backend::{CudaDevice, DeviceId, WrapErr};
use candle_core::DType;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

pub(super) const OP: &str = "fp8_gemm";
/// cuBLASLt's recommended workspace on Hopper.
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;
/// cuBLASLt FP8: dimensions padded to multiples of this.
pub(super) const ALIGN: usize = 16;

pub(super) fn lt_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Unsupported {
        op: OP,
        what: format!("cuBLASLt {what}: {e:?}"),
    }
}

/// Descriptors and the chosen algorithm of one shape.
pub(super) struct Plan {
    pub(super) desc: sys::cublasLtMatmulDesc_t,
    pub(super) a: sys::cublasLtMatrixLayout_t,
    pub(super) b: sys::cublasLtMatrixLayout_t,
    pub(super) d: sys::cublasLtMatrixLayout_t,
    pub(super) algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by the matching create calls, destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// What a plan is made for: the padded shape, the formats, the output
/// dtype, fast accumulation, and the epilogue's parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct PlanKey {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) fa: Fp8Format,
    pub(super) fb: Fp8Format,
    pub(super) out: DType,
    pub(super) fast: bool,
    pub(super) bias: bool,
    pub(super) c: bool,
    /// Alignments (bytes, up to 256) of cuBLASLt's A, B, C and the bias.
    pub(super) align: [u32; 4],
    /// cuBLASLt's scale modes of A and B (`cublasLtMatmulMatrixScale_t`:
    /// 0 one scalar each, the per-tensor GEMM; the block modes otherwise).
    pub(super) modes: [u8; 2],
}

/// One device's cuBLASLt state.
pub(super) struct LtContext {
    pub(super) handle: sys::cublasLtHandle_t,
    pub(super) workspace: CudaSlice<u8>,
    /// Two 16-byte-aligned slots for scales whose own address is not.
    pub(super) slots: CudaSlice<f32>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) plans: HashMap<PlanKey, Plan>,
}

// SAFETY: the handle and descriptors are host objects of cuBLASLt, which
// allows a handle to be used from any thread; every use goes through the
// Mutex around the context, so no two threads touch them at once.
unsafe impl Send for LtContext {}

impl Drop for LtContext {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

type Contexts = Mutex<HashMap<DeviceId, Arc<Mutex<LtContext>>>>;

pub(super) fn context(dev: &CudaDevice) -> Result<Arc<Mutex<LtContext>>> {
    static CONTEXTS: OnceLock<Contexts> = OnceLock::new();
    let mut map = CONTEXTS
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| Error::Poisoned { op: OP })?;
    if let Some(c) = map.get(&dev.id()) {
        return Ok(c.clone());
    }
    crate::numerics::cuda::launch::ensure_supported(dev)?;
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    crate::numerics::cuda::pool::set_threshold(dev, u64::MAX)?;
    let handle = lt::create_handle().map_err(|e| lt_err("create handle", e))?;
    let c = Arc::new(Mutex::new(LtContext {
        handle,
        workspace: dev.alloc_zeros::<u8>(WORKSPACE_BYTES)?,
        slots: dev.alloc_zeros::<f32>(8)?,
        stream,
        plans: HashMap::new(),
    }));
    map.insert(dev.id(), c.clone());
    Ok(c)
}

fn fp8_type(f: Fp8Format) -> sys::cudaDataType_t {
    match f {
        Fp8Format::E4M3 => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => sys::cudaDataType_t::CUDA_R_8F_E5M2,
    }
}

fn out_type(d: DType) -> Result<sys::cudaDataType_t> {
    match d {
        DType::F32 => Ok(sys::cudaDataType_t::CUDA_R_32F),
        DType::BF16 => Ok(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType_t::CUDA_R_16F),
        got => Err(Error::DType {
            op: OP,
            expected: "F32, BF16 or F16",
            got,
        }),
    }
}

/// # Safety
/// `desc` is a live descriptor; `value` is the attribute's type.
pub(super) unsafe fn set_attr<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(|e| lt_err("matmul desc attribute", e))
}

impl LtContext {
    /// Descriptors and heuristic for `key`; the scale pointers are set before
    /// the heuristic, as NVIDIA's samples do.
    pub(super) fn plan(&self, key: PlanKey, scales: (u64, u64), bias: u64) -> Result<Plan> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let PlanKey {
            m,
            n,
            k,
            fa,
            fb,
            out,
            fast,
            bias: with_bias,
            align,
            modes,
            ..
        } = key;
        // SAFETY: descriptors are created here and owned by the Plan; every
        // attribute gets a value of its documented type.
        unsafe {
            let desc = lt::create_matmul_desc(
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cudaDataType_t::CUDA_R_32F,
            )
            .map_err(|e| lt_err("matmul desc", e))?;
            let t = candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T
                as i32;
            let nop = candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N
                as i32;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &t)?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &nop)?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &i8::from(fast))?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scales.0)?;
            set_attr(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scales.1)?;
            if modes != [0, 0] {
                let (ma, mb) = (i32::from(modes[0]), i32::from(modes[1]));
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma)?;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb)?;
            }
            if with_bias {
                let epi = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi)?;
                let ty = sys::cudaDataType_t::CUDA_R_16BF;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &ty)?;
                set_attr(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
            }
            // A = b: k x n (ld k); B = a: k x m (ld k); D = y: n x m (ld n).
            let (k64, n64, m64) = (k as u64, n as u64, m as u64);
            let a = lt::create_matrix_layout(fp8_type(fb), k64, n64, k as i64)
                .map_err(|e| lt_err("layout A", e))?;
            let b = lt::create_matrix_layout(fp8_type(fa), k64, m64, k as i64)
                .map_err(|e| lt_err("layout B", e))?;
            let d = lt::create_matrix_layout(out_type(out)?, n64, m64, n as i64)
                .map_err(|e| lt_err("layout D", e))?;
            let pref = lt::create_matmul_pref().map_err(|e| lt_err("preference", e))?;
            let ws = WORKSPACE_BYTES as u64;
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let mut set = lt::set_matmul_pref_attribute(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            );
            // the pointers' alignments; D is a fresh allocation (256)
            let d_align = 256u32;
            for (attr, v) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &d_align),
            ] {
                set = set.and_then(|_| {
                    lt::set_matmul_pref_attribute(pref, attr, v as *const u32 as *const c_void, 4)
                });
            }
            let heur = set
                .and_then(|_| lt::get_matmul_algo_heuristic(self.handle, desc, a, b, d, d, pref));
            let _ = lt::destroy_matmul_pref(pref);
            // The Plan owns the descriptors from here: an error below drops them.
            let mut plan = Plan {
                desc,
                a,
                b,
                d,
                algo: std::mem::zeroed(),
            };
            let heur = heur.map_err(|e| {
                lt_err(
                    &format!(
                        "no algorithm for m={m} n={n} k={k} {fa} x {fb} -> {out:?} (bias \
                         {with_bias}, alignments {align:?}, scale modes {modes:?})"
                    ),
                    e,
                )
            })?;
            plan.algo = heur.algo;
            Ok(plan)
        }
    }
}
