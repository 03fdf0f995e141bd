//! Causal flash attention on CUDA (`kernels/flash.cu`), the attention ops'
//! body where it applies: a CUDA device, a head dimension of 64, 80, 96 or
//! 128. The scores and probabilities stay on chip; backward keeps the output and
//! one F32 per row instead of the `[batch, heads, t, t]` probabilities
//! (2.4 GB at the 125M GPT's batch of 8 x 1024) and recomputes them.
//! Elsewhere (the CPU, other head dimensions) the ops materialise the
//! probabilities. [`set_flash_attention`] turns it off, for A/B runs.

use super::flash_shape::{Flash, HEAD_DIMS};
use crate::error::{Error, Result};
use crate::numerics::kernel::{launch, Kernel};
use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Whether attention on CUDA runs as flash attention where it applies (a
/// head dimension of 64, 80, 96 or 128); on by default. Off, it
/// materialises the
/// probabilities as on the CPU (for A/B comparisons).
/// Takes effect for the ops built after the call.
pub fn set_flash_attention(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether [`set_flash_attention`] left flash attention on.
pub fn flash_attention_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Whether the flash kernels are built for head dimension `hd` (64, 80,
/// 96, 128): on CUDA, attention with another one materialises the
/// probabilities.
///
/// ```
/// assert!(amp_core::nn::flash_head_dim(128));
/// assert!(!amp_core::nn::flash_head_dim(48));
/// ```
pub fn flash_head_dim(hd: usize) -> bool {
    HEAD_DIMS.contains(&hd)
}

impl Flash {
    fn applies(x: &Tensor, hd: usize) -> bool {
        cfg!(feature = "cuda")
            && flash_attention_enabled()
            && x.device().is_cuda()
            && flash_head_dim(hd)
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
            kv_heads: heads,
            t,
            hd,
            packed: false,
        })
    }

    /// The problem of a packed projection `[b, t, (heads + 2 kv_heads) *
    /// hd]` (`kv_heads` a divisor of `heads`), if flash applies.
    pub(crate) fn packed(
        qkv: &Tensor,
        (heads, kv_heads): (usize, usize),
        hd: usize,
    ) -> Option<Self> {
        let (b, t, w) = qkv.dims3().ok()?;
        let fits = kv_heads > 0 && heads % kv_heads == 0 && w == (heads + 2 * kv_heads) * hd;
        (fits && Self::applies(qkv, hd) && Self::grid_fits(b, heads, t)).then_some(Self {
            b,
            heads,
            kv_heads,
            t,
            hd,
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
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
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
    // without the `cuda` feature the trait's default answers
    // `UnsupportedDevice` (no CUDA tensor exists then)
    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        inputs: &[(&candle_core::CudaStorage, &Layout)],
    ) -> Result<Vec<(candle_core::CudaStorage, Shape)>> {
        if self.backward {
            super::cuda::flash::bwd(self.flash, inputs)
        } else {
            super::cuda::flash::fwd(self.flash, inputs)
        }
    }
}
