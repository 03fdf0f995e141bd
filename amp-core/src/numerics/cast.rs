//! Scaled casts as kernels: amax, quantize (with the input's amax, one pass)
//! and dequantize. Their f32 arithmetic is the definition the CUDA kernels
//! must reproduce bit for bit:
//!
//! - quantize: `code = encode(f32(x) * scale)` (one f32 product, then the cast
//!   of [`Fp8Format::encode`], or for FP16 a saturating round to nearest even);
//! - dequantize: `y = dtype(decode(code) * scale_inv)`;
//! - amax: `max |x|`, NaN if any element is NaN.

use crate::error::{Error, Result};
use crate::numerics::format::F16_MAX;
use crate::numerics::kernel::arity;
use crate::numerics::kernel::{scalar, slice, Kernel};
use crate::numerics::qtype::QType;
use crate::numerics::scale::{check_scale, FromAmax};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape, Tensor};
use half::{bf16, f16};

/// A float element type a cast reads or writes.
pub(crate) trait Float: candle_core::WithDType {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}
impl Float for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}
impl Float for f64 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v as f64
    }
}
impl Float for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}
impl Float for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Runs `$body` with `$T` bound to the element type of a float storage
/// (F32, F16, BF16), or returns [`Error::DType`].
macro_rules! with_float {
    ($op:expr, $storage:expr, |$data:ident : $T:ident| $body:expr) => {
        match $storage {
            CpuStorage::F32(_) => {
                type $T = f32;
                let $data = $storage;
                $body
            }
            CpuStorage::F16(_) => {
                type $T = half::f16;
                let $data = $storage;
                $body
            }
            CpuStorage::BF16(_) => {
                type $T = half::bf16;
                let $data = $storage;
                $body
            }
            other => Err($crate::error::Error::DType {
                op: $op,
                expected: "F32, F16 or BF16",
                got: other.dtype(),
            }),
        }
    };
}
pub(crate) use with_float;

/// The FP16 NaN encode produces: 0x7FFF, as CUDA's `__float2half`.
pub const F16_NAN_BITS: u16 = 0x7FFF;

/// FP16 encode with the FP8 casts' rules: round to nearest even, saturate
/// finite, one canonical NaN ([`F16_NAN_BITS`]).
#[inline(always)]
pub(crate) fn encode_f16(x: f32) -> f16 {
    if x.is_nan() {
        f16::from_bits(F16_NAN_BITS)
    } else {
        f16::from_f32(x.clamp(-F16_MAX, F16_MAX))
    }
}

/// FP16 decode; every NaN becomes the canonical f32 NaN.
#[inline(always)]
pub(crate) fn decode_f16(v: f16) -> f32 {
    if v.is_nan() {
        f32::from_bits(crate::numerics::format::CANONICAL_NAN_BITS)
    } else {
        v.to_f32()
    }
}

/// `|x|` as bits: comparing them as integers orders every NaN above +inf,
/// so a max over them propagates NaN and vectorizes.
#[inline(always)]
fn abs_bits(x: f32) -> u32 {
    x.to_bits() & 0x7FFF_FFFF
}

pub(crate) fn amax_of<T: Float>(xs: &[T]) -> f32 {
    let m = xs.iter().fold(0u32, |m, &x| m.max(abs_bits(x.to_f32())));
    f32::from_bits(m)
}

pub(crate) fn one(v: f32) -> (CpuStorage, Shape) {
    (CpuStorage::F32(vec![v]), Shape::from(1usize))
}

/// `max |x|` into a 1-element F32 tensor.
pub(crate) struct Amax;

/// `max |x|` of a float tensor (F32, F16, BF16), in one pass, as a
/// 1-element F32 tensor; NaN when `x` holds a NaN, 0 when it is empty.
///
/// ```
/// use candle_core::{Device, Tensor};
/// let x = Tensor::new(&[0.5f32, -3.0, 2.0], &Device::Cpu)?;
/// assert_eq!(amp_core::amax(&x)?.to_vec1::<f32>()?, [3.0]);
/// # Ok::<(), amp_core::Error>(())
/// ```
///
/// # Errors
/// [`Error::DType`](crate::Error::DType) for another dtype.
pub fn amax(x: &Tensor) -> Result<Tensor> {
    let [a] = <[Tensor; 1]>::try_from(crate::numerics::kernel::launch(&Amax, &[x])?)
        .map_err(|_| arity(Amax::NAME))?;
    Ok(a)
}

impl Kernel for Amax {
    const NAME: &'static str = "amax";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(x, lx)] = inputs else {
            return Err(arity(Self::NAME));
        };
        with_float!(Self::NAME, *x, |s: T| {
            Ok(vec![one(amax_of(slice::<T>(Self::NAME, s, lx)?))])
        })
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::amax(inputs)
    }
}

/// `(encode(x * scale), max |x|, [saturated, flushed])` in one pass.
/// Inputs: x, scale; or with `from_amax`, x and its amax, and then the
/// outputs are `(codes, counts, scale, scale_inv)`. Without `counts` the
/// counts output is left out (numerics/counts.rs).
pub(crate) struct Quantize {
    pub qtype: QType,
    pub from_amax: Option<FromAmax>,
    pub counts: bool,
}

impl Kernel for Quantize {
    const NAME: &'static str = "quantize";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(x, lx), (s, ls)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let scale = FromAmax::scale(
            self.from_amax,
            self.qtype,
            Self::NAME,
            scalar(Self::NAME, s, ls)?,
        )?;
        let shape = lx.shape().clone();
        let (codes, amax, counts) = with_float!(Self::NAME, *x, |xs: T| {
            let xs = slice::<T>(Self::NAME, xs, lx)?;
            Ok::<_, Error>(quantize_slice(self.qtype, xs, scale))
        })?;
        let counts = self
            .counts
            .then(|| (CpuStorage::I64(counts.to_vec()), Shape::from(2usize)));
        Ok(match self.from_amax {
            // the amax was an input: not returned again
            Some(from) => {
                let inv = 1.0 / scale;
                let inv = match from.flag {
                    // flag_scale_inv's value: NaN where the amax is not finite
                    true => inv * (scalar(Self::NAME, s, ls)? * 0.0 + 1.0),
                    false => inv,
                };
                let mut out = vec![(codes, shape)];
                out.extend(counts);
                out.extend([one(scale), one(inv)]);
                out
            }
            None => {
                let mut out = vec![(codes, shape), one(amax)];
                out.extend(counts);
                out
            }
        })
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::quantize(self.qtype, self.from_amax, self.counts, inputs)
    }
}

/// Block length of the fused loop: small enough to stay in L1, long enough
/// for the inner loops to vectorize.
const BLOCK: usize = 4096;

/// Elements a cast saturated (scaled magnitude above max, or infinite) and
/// flushed (non-zero, encoded as zero).
#[inline(always)]
fn count_block(xs: &[f32], scale: f32, max: f32, zero: impl Fn(usize) -> bool) -> (i64, i64) {
    let mut saturated = 0i64;
    let mut flushed = 0i64;
    for (i, &x) in xs.iter().enumerate() {
        saturated += i64::from((x * scale).abs() > max);
        flushed += i64::from(x != 0.0 && !x.is_nan() && zero(i));
    }
    (saturated, flushed)
}

/// Codes, amax and `[saturated, flushed]`.
pub(crate) fn quantize_slice<T: Float>(
    qtype: QType,
    xs: &[T],
    scale: f32,
) -> (CpuStorage, f32, [i64; 2]) {
    let mut amax = 0u32;
    let mut counts = [0i64; 2];
    let max = qtype.max();
    let mut buf = [0f32; BLOCK];
    let storage = match qtype.fp8() {
        Some(format) => {
            let mut codes = vec![0u8; xs.len()];
            for (src, dst) in xs.chunks(BLOCK).zip(codes.chunks_mut(BLOCK)) {
                let buf = &mut buf[..src.len()];
                for (b, &x) in buf.iter_mut().zip(src) {
                    *b = x.to_f32();
                    amax = amax.max(abs_bits(*b));
                }
                // Lengths are equal by construction: the chunks pair up.
                let _ = format.encode_scaled_slice(buf, scale, dst);
                let (s, f) = count_block(buf, scale, max, |i| dst[i] & 0x7F == 0);
                counts[0] += s;
                counts[1] += f;
            }
            CpuStorage::U8(codes)
        }
        None => {
            let mut out = vec![f16::ZERO; xs.len()];
            for (src, dst) in xs.chunks(BLOCK).zip(out.chunks_mut(BLOCK)) {
                let buf = &mut buf[..src.len()];
                for ((b, d), &x) in buf.iter_mut().zip(dst.iter_mut()).zip(src) {
                    *b = x.to_f32();
                    amax = amax.max(abs_bits(*b));
                    *d = encode_f16(*b * scale);
                }
                let (s, f) = count_block(buf, scale, max, |i| dst[i].to_f32() == 0.0);
                counts[0] += s;
                counts[1] += f;
            }
            CpuStorage::F16(out)
        }
    };
    (storage, f32::from_bits(amax), counts)
}

/// `decode(code) * scale_inv` in `dtype`. Inputs: codes, scale_inv.
pub(crate) struct Dequantize {
    pub qtype: QType,
    pub dtype: DType,
}

impl Kernel for Dequantize {
    const NAME: &'static str = "dequantize";
    fn cpu(&self, inputs: &[(&CpuStorage, &Layout)]) -> Result<Vec<(CpuStorage, Shape)>> {
        let [(q, lq), (s, ls)] = inputs else {
            return Err(arity(Self::NAME));
        };
        let scale_inv = scalar(Self::NAME, s, ls)?;
        check_scale(Self::NAME, scale_inv)?;
        let shape = lq.shape().clone();
        let values: Vec<f32> = match (self.qtype.fp8(), q) {
            (Some(format), CpuStorage::U8(_)) => {
                let codes = slice::<u8>(Self::NAME, q, lq)?;
                let mut out = vec![0f32; codes.len()];
                format.decode_scaled_slice(codes, scale_inv, &mut out)?;
                out
            }
            (None, CpuStorage::F16(_)) => slice::<f16>(Self::NAME, q, lq)?
                .iter()
                .map(|v| decode_f16(*v) * scale_inv)
                .collect(),
            (_, other) => {
                return Err(Error::DType {
                    op: Self::NAME,
                    expected: if self.qtype.fp8().is_some() {
                        "U8"
                    } else {
                        "F16"
                    },
                    got: other.dtype(),
                })
            }
        };
        let out = match self.dtype {
            DType::F32 => CpuStorage::F32(values),
            DType::F16 => CpuStorage::F16(convert(&values)),
            DType::BF16 => CpuStorage::BF16(convert(&values)),
            DType::F64 => CpuStorage::F64(convert(&values)),
            got => {
                return Err(Error::DType {
                    op: Self::NAME,
                    expected: "F32, F16, BF16 or F64",
                    got,
                })
            }
        };
        Ok(vec![(out, shape)])
    }
    fn cuda(&self, inputs: &[(&CudaStorage, &Layout)]) -> Result<Vec<(CudaStorage, Shape)>> {
        crate::numerics::cuda::dequantize(self.qtype, self.dtype, inputs)
    }
}

fn convert<T: Float>(values: &[f32]) -> Vec<T> {
    values.iter().map(|&v| T::from_f32(v)).collect()
}

/// What one cast lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct CastStats {
    /// Elements whose scaled magnitude exceeded the format's max (or were
    /// infinite) and were clamped to it.
    pub saturated: u64,
    /// Non-zero elements that became zero.
    pub flushed: u64,
    /// Elements inspected.
    pub total: u64,
}
