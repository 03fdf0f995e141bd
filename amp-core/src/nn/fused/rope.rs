//! Rotary position embeddings (RoPE) in Hugging Face Llama's `rotate_half`
//! convention, as one op with a backward: for head dimension `D`, `half =
//! D / 2`, position `t` and pair `i < half`,
//!
//! ```text
//! y[i]        = x[i] * cos[t, i] - x[i + half] * sin[t, i]
//! y[i + half] = x[i + half] * cos[t, i] + x[i] * sin[t, i]
//! ```
//!
//! in F32 on both devices (the same expression in the same order, no fused
//! multiply-add on CUDA: the same bits). The backward is the transpose of
//! the rotation, the same op with `-sin`; the tables get no gradient. The
//! tables themselves ([`rope_tables`]) are computed once in f64, with
//! Llama 3's frequency scaling ([`RopeScaling`]) where a model has it.

use super::float_dtype;
#[cfg(feature = "cuda")]
use super::ops::wrap;
use super::ops::{f32s, store};
use crate::error::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};

/// Llama 3's RoPE frequency scaling (`rope_scaling` of a Hugging Face
/// `config.json` with `"rope_type": "llama3"`; that key and any other are
/// ignored when deserializing). Wavelengths shorter than
/// `original_max_position_embeddings / high_freq_factor` keep their
/// frequency, those longer than `original_max_position_embeddings /
/// low_freq_factor` have it divided by `factor`, and those between are
/// interpolated smoothly between the two: transformers'
/// `_compute_llama3_parameters`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct RopeScaling {
    /// What the low frequencies are divided by (32 for Llama 3.2, 8 for 3.1).
    pub factor: f64,
    /// Sets the long-wavelength bound: `original_max_position_embeddings /
    /// low_freq_factor` (1 for Llama 3).
    pub low_freq_factor: f64,
    /// Sets the short-wavelength bound: `original_max_position_embeddings /
    /// high_freq_factor` (4 for Llama 3); greater than `low_freq_factor`.
    pub high_freq_factor: f64,
    /// The context length the model was pretrained with (8192 for Llama 3).
    pub original_max_position_embeddings: usize,
}

impl RopeScaling {
    /// Refuses values for which the scaling is undefined (a zero divisor,
    /// a non-finite or non-positive factor, bounds in the wrong order).
    fn check(&self) -> Result<()> {
        let bad = |field: &str, reason: String| Error::Config {
            field: format!("rope_scaling.{field}"),
            reason,
        };
        let positive = |field: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(bad(field, format!("must be finite and positive, got {v}")))
            }
        };
        positive("factor", self.factor)?;
        positive("low_freq_factor", self.low_freq_factor)?;
        positive("high_freq_factor", self.high_freq_factor)?;
        if self.high_freq_factor <= self.low_freq_factor {
            return Err(bad(
                "high_freq_factor",
                format!(
                    "must be greater than low_freq_factor ({}), got {}",
                    self.low_freq_factor, self.high_freq_factor
                ),
            ));
        }
        if self.original_max_position_embeddings == 0 {
            return Err(bad(
                "original_max_position_embeddings",
                "must be positive, got 0".into(),
            ));
        }
        Ok(())
    }

    /// The scaled inverse frequency of `inv_freq`.
    fn scale(&self, inv_freq: f64) -> f64 {
        let old = self.original_max_position_embeddings as f64;
        let low_freq_wavelen = old / self.low_freq_factor;
        let high_freq_wavelen = old / self.high_freq_factor;
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        if wavelen > low_freq_wavelen {
            inv_freq / self.factor
        } else if wavelen < high_freq_wavelen {
            inv_freq
        } else {
            let smooth = (old / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }
}

/// The RoPE tables for positions `0..seq`: F32 `cos` and `sin`, each
/// `[seq, head_dim / 2]`, of the angles `t * inv_freq[i]` with `inv_freq[i]
/// = theta^(-2 i / head_dim)`, scaled by `scaling` where given. Computed in
/// f64 on the host, stored as F32 on `device`.
///
/// # Errors
/// [`Error::Unsupported`] for an odd or zero `head_dim` or a `theta` that
/// is not finite and positive; [`Error::Config`] for a `scaling` with a
/// non-positive factor or `high_freq_factor <= low_freq_factor`; candle's.
pub fn rope_tables(
    seq: usize,
    head_dim: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "rope_tables";
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("head dimension {head_dim} (it must be even and positive)"),
        });
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::Unsupported {
            op: OP,
            what: format!("theta {theta} (it must be finite and positive)"),
        });
    }
    if let Some(s) = scaling {
        s.check()?;
    }
    let half = head_dim / 2;
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| {
            let f = theta.powf(-((2 * i) as f64) / head_dim as f64);
            scaling.map_or(f, |s| s.scale(f))
        })
        .collect();
    let mut cos = Vec::with_capacity(seq * half);
    let mut sin = Vec::with_capacity(seq * half);
    for t in 0..seq {
        for &f in &inv_freq {
            let angle = t as f64 * f;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    let cos = Tensor::from_vec(cos, (seq, half), &Device::Cpu)?.to_device(device)?;
    let sin = Tensor::from_vec(sin, (seq, half), &Device::Cpu)?.to_device(device)?;
    Ok((cos, sin))
}

/// RoPE of `x` `[batch, seq, heads, head_dim]` (F32 or BF16; F16 and F64
/// on the CPU) with the F32 tables `cos` and `sin` `[seq, head_dim / 2]`
/// of [`rope_tables`]: position `t` of `x` takes row `t` of the tables.
/// The output has `x`'s shape and dtype; the math is in F32 (the same bits
/// on the CPU and CUDA). Backward: `x`'s gradient, one kernel (the
/// rotation by `-sin`); none for the tables.
///
/// # Errors
/// [`Error::Rank`] unless `x` is 4-D and the tables 2-D; [`Error::Shape`]
/// for an odd head dimension or tables that are not `[seq, head_dim / 2]`;
/// [`Error::DType`] for a non-float `x` or tables other than F32;
/// [`Error::Device`]; candle's.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    const OP: &str = "rope";
    let (_, seq, _, head_dim) = x.dims4().map_err(|_| Error::Rank {
        op: OP,
        expected: 4,
        got: x.shape().clone(),
    })?;
    float_dtype(OP, x)?;
    check_tables(OP, x, (seq, head_dim), (cos, sin))?;
    Ok(x.contiguous()?.apply_op3(
        &cos.contiguous()?,
        &sin.contiguous()?,
        Rope {
            sign: 1.0,
            rot: None,
        },
    )?)
}

/// Refuses tables that are not F32 `[seq, head_dim / 2]` on `x`'s device
/// (or an odd head dimension), with `op`'s name.
pub(crate) fn check_tables(
    op: &'static str,
    x: &Tensor,
    (seq, head_dim): (usize, usize),
    (cos, sin): (&Tensor, &Tensor),
) -> Result<()> {
    for table in [cos, sin] {
        if table.rank() != 2 {
            return Err(Error::Rank {
                op,
                expected: 2,
                got: table.shape().clone(),
            });
        }
        if head_dim % 2 != 0 || table.dims() != [seq, head_dim / 2] {
            return Err(Error::Shape {
                op,
                lhs: x.shape().clone(),
                rhs: table.shape().clone(),
            });
        }
        if table.dtype() != DType::F32 {
            return Err(Error::DType {
                op,
                expected: "F32 cos and sin tables",
                got: table.dtype(),
            });
        }
        if !table.device().same_device(x.device()) {
            return Err(Error::Device {
                op,
                lhs: x.device().location(),
                rhs: table.device().location(),
            });
        }
    }
    Ok(())
}

/// RoPE (`sign` +1) or its transpose (-1) of the first `rot` heads of each
/// position of `x` `[batch, seq, heads, head_dim]`, the other heads copied,
/// outside the graph: a packed projection's q and k heads turned, its v
/// heads kept, in one pass (the tables as [`rope`] takes them, checked by
/// the caller with [`check_tables`]).
pub(crate) fn rope_rows(
    x: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    rot: usize,
    sign: f32,
) -> candle_core::Result<Tensor> {
    let op = Rope {
        sign,
        rot: Some(rot),
    };
    x.contiguous()?
        .apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
}

/// The rotation of `(x, cos, sin)` by `sign * sin`: +1 is RoPE, -1 its
/// transpose (RoPE's backward); of the first `rot` heads of each position
/// (`None`: all), the others copied.
struct Rope {
    sign: f32,
    rot: Option<usize>,
}

impl Rope {
    /// The heads turned at each position, of `heads`.
    fn turned(&self, heads: usize) -> usize {
        self.rot.map_or(heads, |r| r.min(heads))
    }
}

/// `x`'s `[batch, seq, heads, head_dim]` from its layout: `(seq, heads,
/// half)`.
fn dims(l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
    let (_, seq, heads, d) = l.shape().dims4()?;
    if d % 2 != 0 {
        candle_core::bail!("amp_rope: an odd head dimension {d}");
    }
    Ok((seq, heads, d / 2))
}

/// The CPU body: each pair `(x[i], x[i + half])` of each row (one head at
/// one position) rotated by `(cos, sign * sin)` of its position, in f32;
/// rows of heads `rot..` copied.
fn rotate(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    (seq, heads, half): (usize, usize, usize),
    rot: usize,
    sign: f32,
) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    if half == 0 {
        return y;
    }
    for (r, (xr, yr)) in x.chunks(2 * half).zip(y.chunks_mut(2 * half)).enumerate() {
        if r % heads >= rot {
            yr.copy_from_slice(xr);
            continue;
        }
        let t = (r / heads) % seq;
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        let (y0, y1) = yr.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (xr[i], xr[i + half]);
            let (c, s) = (c[i], sign * s[i]);
            y0[i] = a * c - b * s;
            y1[i] = b * c + a * s;
        }
    }
    y
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        if self.sign < 0.0 {
            "amp_rope_bwd"
        } else {
            "amp_rope"
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        cos: &CpuStorage,
        lc: &Layout,
        sin: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = dims(lx)?;
        let (cos, sin) = (f32s(cos, lc)?, f32s(sin, ls)?);
        if cos.len() != d.0 * d.2 || sin.len() != cos.len() {
            candle_core::bail!("amp_rope: tables of {} values, not [seq, half]", cos.len());
        }
        let y = rotate(&f32s(x, lx)?, &cos, &sin, d, self.turned(d.1), self.sign);
        Ok((store(y, x.dtype()), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        cos: &candle_core::CudaStorage,
        lc: &Layout,
        sin: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let d = dims(lx)?;
        let rot = self.turned(d.1);
        let out = super::cuda::rope::rope((x, lx), (cos, lc), (sin, ls), d, rot, self.sign)
            .map_err(wrap)?;
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = Rope {
            sign: -self.sign,
            rot: self.rot,
        };
        let dx = dy.contiguous()?.apply_op3_no_bwd(cos, sin, &op)?;
        Ok((Some(dx), None, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rope_rows` turns the first `rot` heads of each position as `rope`
    /// turns them alone, copies the others bit for bit, and its `-1` undoes
    /// its `+1` (to rounding).
    #[test]
    fn rope_rows_turns_the_first_heads_only() -> Result<()> {
        let dev = Device::Cpu;
        let (b, t, heads, rot, d) = (2usize, 5usize, 5usize, 3usize, 8usize);
        let n = b * t * heads * d;
        let vals: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let x = Tensor::from_vec(vals, (b, t, heads, d), &dev)?;
        let (cos, sin) = rope_tables(t, d, 10_000.0, None, &dev)?;
        let y = rope_rows(&x, (&cos, &sin), rot, 1.0)?;
        let turned = rope(&x.narrow(2, 0, rot)?, &cos, &sin)?;
        let bits = |z: &Tensor| -> Result<Vec<u32>> {
            Ok(z.flatten_all()?
                .to_vec1::<f32>()?
                .into_iter()
                .map(f32::to_bits)
                .collect())
        };
        assert_eq!(bits(&y.narrow(2, 0, rot)?)?, bits(&turned)?);
        assert_eq!(
            bits(&y.narrow(2, rot, heads - rot)?)?,
            bits(&x.narrow(2, rot, heads - rot)?)?
        );
        let back = rope_rows(&y, (&cos, &sin), rot, -1.0)?;
        let err = (back - &x)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 1e-5, "{err}");
        Ok(())
    }
}
