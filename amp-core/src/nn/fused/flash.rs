//! Causal flash attention on CUDA (`kernels/flash.cu`), the attention ops'
//! body where it applies: a CUDA device, a head dimension of 64. The
//! scores and probabilities stay on chip; backward keeps the output and
//! one F32 per row instead of the `[batch, heads, t, t]` probabilities
//! (2.4 GB at the 125M GPT's batch of 8 x 1024) and recomputes them.
//! Elsewhere (the CPU, other head dimensions) the ops materialise the
//! probabilities. [`set_flash_attention`] turns it off, for A/B runs.

use crate::error::{Error, Result};
use crate::kernel::{launch, Kernel};
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// The head dimension the kernels are built for.
pub(crate) const HEAD_DIM: usize = 64;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Whether attention on CUDA runs as flash attention where it applies (a
/// head dimension of 64); on by default. Off, it materialises the
/// probabilities as on the CPU (the comparison runs of `BENCHMARKS.md`).
/// Takes effect for the ops built after the call.
pub fn set_flash_attention(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether [`set_flash_attention`] left flash attention on.
pub fn flash_attention_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A flash-attention problem: `b` x `heads` sequences of `t` rows; q, k, v
/// packed side by side in one projection's rows `[b, t, 3 * heads * 64]`,
/// or separate `[b, heads, t, 64]` tensors.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Flash {
    pub b: usize,
    pub heads: usize,
    pub t: usize,
    pub packed: bool,
}

impl Flash {
    fn applies(x: &Tensor, hd: usize) -> bool {
        cfg!(feature = "cuda")
            && flash_attention_enabled()
            && x.device().is_cuda()
            && hd == HEAD_DIM
            && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
    }

    /// Whether the launch grid takes `b` x `heads` (grid y and z, at most
    /// 65535 each) and the kernels' `int` row index takes `t`.
    fn grid_fits(b: usize, heads: usize, t: usize) -> bool {
        b * heads * t > 0 && b <= 65_535 && heads <= 65_535 && t < i32::MAX as usize - 64
    }

    /// The problem of separate q, k, v shaped as `q`, if flash applies.
    pub(crate) fn separate(q: &Tensor) -> Option<Self> {
        let (b, heads, t, hd) = q.dims4().ok()?;
        (Self::applies(q, hd) && Self::grid_fits(b, heads, t)).then_some(Self {
            b,
            heads,
            t,
            packed: false,
        })
    }

    /// The problem of a packed projection `[b, t, 3 * heads * hd]`, if
    /// flash applies.
    pub(crate) fn packed(qkv: &Tensor, heads: usize, hd: usize) -> Option<Self> {
        let (b, t, _) = qkv.dims3().ok()?;
        (Self::applies(qkv, hd) && Self::grid_fits(b, heads, t)).then_some(Self {
            b,
            heads,
            t,
            packed: true,
        })
    }

    /// `(o, lse)` of BF16 [`input`]s (the packed projection, or q, k, v):
    /// the output (BF16, [`Self::out_shape`]) and the rows' log-sum-exp.
    pub(crate) fn forward(&self, inputs: &[Tensor]) -> Result<(Tensor, Tensor)> {
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let fwd = Kernels {
            flash: *self,
            backward: false,
        };
        let mut out = launch(&fwd, &refs)?;
        match (out.pop(), out.pop()) {
            (Some(lse), Some(o)) => Ok((o, lse)),
            _ => Err(Error::Unsupported {
                op: Kernels::NAME,
                what: "a kernel without its two outputs".into(),
            }),
        }
    }

    /// The BF16 gradients of the inputs (one packed, or q, k, v) from
    /// `dy` (any float dtype, the output's layout) and the forward's `o`
    /// and `lse`.
    pub(crate) fn backward(
        &self,
        inputs: &[Tensor],
        o: &Tensor,
        dy: &Tensor,
        lse: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let dy = input(dy)?;
        let mut refs: Vec<&Tensor> = inputs.iter().collect();
        refs.extend([o, &dy, lse]);
        let bwd = Kernels {
            flash: *self,
            backward: true,
        };
        launch(&bwd, &refs)
    }
}

/// The kernels' arguments (`cuda::flash`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Flash {
    /// Columns of q (and of k, v, and of the output) per row.
    pub(crate) fn width(&self) -> usize {
        self.heads * HEAD_DIM
    }

    /// Rows of all (batch, head) sequences.
    pub(crate) fn rows(&self) -> usize {
        self.b * self.heads * self.t
    }

    /// `1 / sqrt(head_dim)`.
    pub(crate) fn scale(&self) -> f32 {
        1.0 / (HEAD_DIM as f32).sqrt()
    }

    /// (batch, head, row) strides of q, k, v in elements.
    pub(crate) fn in_strides(&self) -> [i64; 3] {
        let w = self.width() as i64;
        let (t, d) = (self.t as i64, HEAD_DIM as i64);
        if self.packed {
            [t * 3 * w, d, 3 * w]
        } else {
            [self.heads as i64 * t * d, t * d, d]
        }
    }

    /// (batch, head, row) strides of the output (and of its gradient).
    pub(crate) fn out_strides(&self) -> [i64; 3] {
        let (t, d) = (self.t as i64, HEAD_DIM as i64);
        if self.packed {
            [t * self.width() as i64, d, self.width() as i64]
        } else {
            [self.heads as i64 * t * d, t * d, d]
        }
    }

    /// The shape of the input (one packed, or each of q, k, v).
    pub(crate) fn in_shape(&self) -> Shape {
        if self.packed {
            Shape::from((self.b, self.t, 3 * self.width()))
        } else {
            Shape::from((self.b, self.heads, self.t, HEAD_DIM))
        }
    }

    /// The shape of the output: rows `[b, t, heads * 64]` packed, heads
    /// otherwise.
    pub(crate) fn out_shape(&self) -> Shape {
        if self.packed {
            Shape::from((self.b, self.t, self.width()))
        } else {
            Shape::from((self.b, self.heads, self.t, HEAD_DIM))
        }
    }
}

/// `x` as a kernel input: BF16, contiguous, starting 16-byte aligned.
pub(crate) fn input(x: &Tensor) -> Result<Tensor> {
    let x = x.detach().to_dtype(DType::BF16)?.contiguous()?;
    if x.layout().start_offset() % 8 == 0 {
        return Ok(x);
    }
    // a view into its storage: a fresh one (exact both ways)
    Ok(x.to_dtype(DType::F32)?.to_dtype(DType::BF16)?)
}

/// The flash kernels as a [`Kernel`]: the forward, or (`backward`) the
/// backward. CUDA only: the attention ops choose flash only there.
struct Kernels {
    flash: Flash,
    backward: bool,
}

impl Kernel for Kernels {
    const NAME: &'static str = "flash_attention";
    fn cpu(&self, _: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        Err(Error::UnsupportedDevice {
            op: Self::NAME,
            device: candle_core::DeviceLocation::Cpu,
        })
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        if self.backward {
            crate::cuda::flash::bwd(self.flash, inputs)
        } else {
            crate::cuda::flash::fwd(self.flash, inputs)
        }
    }
}
