//! The low-bit AdamW step of one tensor as one kernel: decode weight,
//! gradient and moments block by block, update in f32, take the new amaxes,
//! then re-encode each low-bit output with a fresh power-of-two scale.
//!
//! Two passes over memory: the update (reads every input once, writes f32
//! values of the outputs to scratch) and the encode (reads the scratch,
//! writes the outputs). The encode needs the amax of the whole updated
//! tensor, so it cannot run in the first pass.

use crate::adamw::AdamStep;
use crate::state::stochastic_root;
use amp_core::kernel::{scalar, slice, Kernel};
use amp_core::{QType, ScaleRule};
use candle_core::{CpuStorage, Layout, Shape};
use half::{f16, slice::HalfFloatSliceExt};

/// Block length: a few KiB per stream, so every stream stays in L1.
const BLOCK: usize = 2048;
/// [`SumSq`] adds its blocks' sums in groups of this many, then the groups:
/// the order the CUDA body can follow with a thread per group (one thread
/// over every block in order took longer than the step it serves).
const SUMSQ_GROUP: usize = 256;

/// Storage of one stream: `None` is plain F32.
pub(crate) type Q = Option<QType>;

/// One tensor's update. Inputs, in order: weight, weight scale_inv, grad,
/// grad scale_inv, m, m scale_inv, v, v scale_inv (scale_inv of an F32
/// stream is ignored), the gradient multiplier (one F32: loss-scale inverse
/// times clipping coefficient; where it is NaN the CUDA kernels skip the
/// step, see `clip.rs`, while the CPU body, which the host only calls for
/// steps it applies, computes with it), and
/// with `fp8_copy` the copy's scale_inv before the step (the CUDA body
/// encodes with it first, see `cuda.rs`; the result does not depend on it).
/// Outputs: the data of the weight (and, with `fp8_copy`, an E4M3 copy
/// before it; none with `w_in_place`), m and v, then one F32 tensor of
/// [`META_LEN`] elements: scale, 1 / scale and the amax of the f32 values
/// of w, m, v and the copy at `3 * j` (j in that order; without a copy its
/// slots are 0 on the CPU and unset on CUDA, never read).
pub(crate) struct LowBitStep<'a> {
    /// f32 scratch for the updated weight, m and v, kept across steps so a
    /// step does not fault in fresh pages for it.
    pub scratch: &'a std::sync::Mutex<Vec<f32>>,
    pub k: AdamStep,
    pub w: Q,
    pub g: Q,
    pub m: Q,
    pub v: Q,
    pub fp8_copy: bool,
    /// `Some(salt)`: the v stream holds the square roots of the second
    /// moment ([`StateFormat::E4M3Sqrt`](crate::StateFormat::E4M3Sqrt),
    /// `v` is E4M3): decoded roots are squared before the update, the new
    /// v's roots are what its amax and scale are taken from, and they are
    /// rounded stochastically ([`stochastic_root`], its random bits from
    /// the element's index and `salt`) before they are encoded.
    pub v_sqrt: Option<u32>,
    /// CUDA only: an F32 weight is updated in the weight input's storage
    /// (no weight output); the CPU body refuses it.
    pub w_in_place: bool,
}

/// Elements of the meta output (12 used; the CUDA body keeps the amax
/// scratch of its two passes after them, in the same allocation).
pub(crate) const META_LEN: usize = 16;

/// Decodes `src[range]` of a stream into `dst`.
pub(crate) fn decode(
    op: &'static str,
    q: Q,
    s: &CpuStorage,
    l: &Layout,
    scale_inv: f32,
    at: usize,
    dst: &mut [f32],
) -> amp_core::Result<()> {
    let end = at + dst.len();
    match q.and_then(QType::fp8) {
        Some(f) => f.decode_scaled_slice(&slice::<u8>(op, s, l)?[at..end], scale_inv, dst)?,
        None => match q {
            Some(QType::F16) => {
                slice::<f16>(op, s, l)?[at..end].convert_to_f32_slice(dst);
                for x in dst.iter_mut() {
                    *x *= scale_inv;
                }
            }
            _ => dst.copy_from_slice(&slice::<f32>(op, s, l)?[at..end]),
        },
    }
    Ok(())
}

/// `max |x|` as bits (NaN above everything).
fn amax_bits(xs: &[f32]) -> u32 {
    xs.iter()
        .fold(0u32, |m, x| m.max(x.to_bits() & 0x7FFF_FFFF))
}

/// Encodes an f32 stream into `q` with a fresh power-of-two scale from its
/// amax (keeping `prev_scale` where the amax is 0 or not finite): the data
/// and its scale, 1 / scale and amax. With `roots` (a salt), the values
/// are square roots, first rounded by [`stochastic_root`].
fn encode(
    q: Q,
    values: &mut [f32],
    amax: f32,
    prev_scale: f32,
    roots: Option<u32>,
) -> (CpuStorage, [f32; 3]) {
    let Some(qtype) = q else {
        return (CpuStorage::F32(values.to_vec()), [1.0, 1.0, amax]);
    };
    let scale = ScaleRule::PowerOfTwo.compute(amax, prev_scale, qtype.max(), 0);
    if let Some(salt) = roots {
        for (i, r) in values.iter_mut().enumerate() {
            *r = stochastic_root(*r, scale, i as u64, salt);
        }
    }
    (
        encode_with(qtype, values, scale),
        [scale, 1.0 / scale, amax],
    )
}

/// The codes of `values * scale` in `qtype`: amp-core's saturating RNE
/// casts (an F16 NaN keeps its payload here; the CUDA body writes 0x7FFF).
pub(crate) fn encode_with(qtype: QType, values: &[f32], scale: f32) -> CpuStorage {
    match qtype.fp8() {
        Some(f) => {
            let mut codes = vec![0u8; values.len()];
            // Lengths match by construction.
            let _ = f.encode_scaled_slice(values, scale, &mut codes);
            CpuStorage::U8(codes)
        }
        None => {
            let mut out = vec![f16::ZERO; values.len()];
            let mut buf = [0f32; BLOCK];
            for (src, dst) in values.chunks(BLOCK).zip(out.chunks_mut(BLOCK)) {
                let buf = &mut buf[..src.len()];
                for (b, &x) in buf.iter_mut().zip(src) {
                    // saturate finite as every cast does; NaN stays NaN
                    *b = (x * scale).clamp(-qtype.max(), qtype.max());
                }
                dst.convert_from_f32_slice(buf);
            }
            CpuStorage::F16(out)
        }
    }
}

impl LowBitStep<'_> {
    /// The CPU body of the kernel (`dispatch.rs` makes it one).
    pub(crate) fn cpu_body(
        &self,
        inputs: &[(&CpuStorage, &Layout)],
    ) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        const OP: &str = "lowbit_adamw_step";
        let [(w, lw), (ws, lws), (g, lg), (gs, lgs), (m, lm), (ms, lms), (v, lv), (vs, lvs), (gm, lgm), ..] =
            inputs
        else {
            return Err(amp_core::Error::Unsupported {
                op: OP,
                what: "wrong number of inputs".into(),
            });
        };
        let n = lw.shape().elem_count();
        for l in [lg, lm, lv] {
            if l.shape().elem_count() != n {
                return Err(amp_core::Error::Shape {
                    op: OP,
                    lhs: lw.shape().clone(),
                    rhs: l.shape().clone(),
                });
            }
        }
        if self.w_in_place {
            return Err(amp_core::Error::Unsupported {
                op: OP,
                what: "an in-place weight update on the CPU".into(),
            });
        }
        let grad_mul = scalar(OP, gm, lgm)?;
        let (w_si, g_si, m_si, v_si) = (
            scalar(OP, ws, lws)?,
            scalar(OP, gs, lgs)?,
            scalar(OP, ms, lms)?,
            scalar(OP, vs, lvs)?,
        );
        let mut scratch = self
            .scratch
            .lock()
            .map_err(|_| amp_core::Error::Poisoned { op: OP })?;
        if scratch.len() < 3 * n {
            scratch.resize(3 * n, 0.0);
        }
        let (wn, rest) = scratch.split_at_mut(n);
        let (mn, rest) = rest.split_at_mut(n);
        let vn = &mut rest[..n];
        let mut gb = [0f32; BLOCK];
        let (mut wa, mut ma, mut va) = (0u32, 0u32, 0u32);
        let mut at = 0;
        while at < n {
            let len = BLOCK.min(n - at);
            let (wb, mb, vb) = (
                &mut wn[at..at + len],
                &mut mn[at..at + len],
                &mut vn[at..at + len],
            );
            let gb = &mut gb[..len];
            decode(OP, self.w, w, lw, w_si, at, wb)?;
            decode(OP, self.g, g, lg, g_si, at, gb)?;
            decode(OP, self.m, m, lm, m_si, at, mb)?;
            decode(OP, self.v, v, lv, v_si, at, vb)?;
            if self.v_sqrt.is_some() {
                for r in vb.iter_mut() {
                    *r *= *r;
                }
            }
            self.k.update(wb, gb, grad_mul, mb, vb);
            if self.v_sqrt.is_some() {
                // the update's own sqrt(v), bit for bit
                for v in vb.iter_mut() {
                    *v = v.sqrt();
                }
            }
            wa = wa.max(amax_bits(wb));
            ma = ma.max(amax_bits(mb));
            va = va.max(amax_bits(vb));
            at += len;
        }
        let shape = lw.shape();
        let prev = |si: f32| if si > 0.0 { 1.0 / si } else { 1.0 };
        let (wa, ma, va) = (f32::from_bits(wa), f32::from_bits(ma), f32::from_bits(va));
        let mut meta = vec![0f32; META_LEN];
        let mut out = Vec::with_capacity(5);
        if self.fp8_copy {
            let (data, m) = encode(Some(QType::E4M3), wn, wa, 1.0, None);
            meta[9..12].copy_from_slice(&m);
            out.push((data, shape.clone()));
        }
        let streams = [
            (0, self.w, wn, wa, prev(w_si), None),
            (1, self.m, mn, ma, prev(m_si), None),
            (2, self.v, vn, va, prev(v_si), self.v_sqrt),
        ];
        for (j, q, values, amax, prev, roots) in streams {
            let (data, m) = encode(q, values, amax, prev, roots);
            meta[3 * j..3 * j + 3].copy_from_slice(&m);
            out.push((data, shape.clone()));
        }
        out.push((CpuStorage::F32(meta), Shape::from(META_LEN)));
        Ok(out)
    }
}

/// Sum of squares of a decoded gradient (for the global norm and the
/// non-finite check): inputs grad, grad scale_inv; output one F64.
pub(crate) struct SumSq {
    pub g: Q,
}

impl SumSq {
    /// The CPU body of the kernel (`dispatch.rs` makes it one).
    pub(crate) fn cpu_body(
        &self,
        inputs: &[(&CpuStorage, &Layout)],
    ) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        const OP: &str = SumSq::NAME;
        let [(g, lg), (gs, lgs)] = inputs else {
            return Err(amp_core::Error::Unsupported {
                op: OP,
                what: "wrong number of inputs".into(),
            });
        };
        let si = scalar(OP, gs, lgs)?;
        let n = lg.shape().elem_count();
        let mut buf = [0f32; BLOCK];
        let (mut total, mut group, mut in_group) = (0f64, 0f64, 0);
        let mut at = 0;
        while at < n {
            let len = BLOCK.min(n - at);
            let b = &mut buf[..len];
            decode(OP, self.g, g, lg, si, at, b)?;
            // f32 partial sums in 8 lanes (vectorizes), f64 across blocks
            let mut lanes = [0f32; 8];
            for c in b.chunks(8) {
                for (l, x) in lanes.iter_mut().zip(c) {
                    *l += x * x;
                }
            }
            group += lanes.iter().map(|&l| f64::from(l)).sum::<f64>();
            in_group += 1;
            if in_group == SUMSQ_GROUP {
                total += group;
                (group, in_group) = (0.0, 0);
            }
            at += len;
        }
        if in_group > 0 {
            total += group;
        }
        Ok(vec![(CpuStorage::F64(vec![total]), Shape::from(1usize))])
    }
}

/// [`SumSq`] of many gradients of one kind (none of them empty): inputs
/// (gradient, scale_inv) pairs; output one F64 per gradient, each with
/// the bits of its own [`SumSq`]. On CUDA two launches for all of them
/// (`kernels/sumsq_many.cuh`), where each gradient of its own takes two.
pub(crate) struct SumSqMany {
    pub g: Q,
}

impl SumSqMany {
    /// The CPU body of the kernel (`dispatch.rs` makes it one).
    pub(crate) fn cpu_body(
        &self,
        inputs: &[(&CpuStorage, &Layout)],
    ) -> amp_core::Result<Vec<(CpuStorage, Shape)>> {
        let mut sums = Vec::with_capacity(inputs.len() / 2);
        for pair in inputs.chunks(2) {
            let out = SumSq { g: self.g }.cpu_body(pair)?;
            let [(CpuStorage::F64(s), _)] = out.as_slice() else {
                return Err(amp_core::Error::Unsupported {
                    op: SumSqMany::NAME,
                    what: "a sum of squares without its output".into(),
                });
            };
            sums.extend_from_slice(s);
        }
        let n = sums.len();
        Ok(vec![(CpuStorage::F64(sums), Shape::from(n))])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_encode_here_matches_the_core_cast() {
        // The fused FP16 encode (F16C slice conversion) must equal the core's.
        use amp_core::{CurrentScaling, ScalingTensor};
        use candle_core::{Device, Tensor};
        let xs: Vec<f32> = (0..5000u32)
            .map(|i| {
                f32::from_bits(0x3000_0000 + i * 0x0001_3579) * if i % 2 == 0 { 1.0 } else { -1.0 }
            })
            .collect();
        let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
        let out = encode(Some(QType::F16), &mut xs.clone(), amax, 1.0, None);
        let CpuStorage::F16(ours) = &out.0 else {
            panic!("F16 out")
        };
        let t = Tensor::from_vec(xs.clone(), xs.len(), &Device::Cpu).unwrap();
        let (core, _) =
            ScalingTensor::quantize(&t, QType::F16, &CurrentScaling::default()).unwrap();
        let core: Vec<u16> = core
            .data()
            .to_vec1::<f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(ours.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), core);
    }
}
