//! The low-bit step's element codecs as ops of their own, so that a check
//! can put every input through exactly what the step writes and reads:
//! [`step_encode`] (f32 values times a scale, to E4M3, E5M2 or FP16 codes)
//! and [`step_decode`] (codes times a scale_inv, to f32). The CPU bodies are
//! the fused step's own; the CUDA bodies run the step kernels' packed
//! codecs (amp-core's codec header, four elements a thread, the tail
//! one at a time). They agree bit for bit except for NaN payloads: a NaN encodes as
//! 0x7F in FP8 on both, as 0x7FFF in FP16 on CUDA (the CPU keeps a
//! payload), and every decoded NaN is 0x7FFFFFFF on CUDA.

use crate::error::Result;
use crate::fused::{decode, encode_with};
use amp_core::kernel::{launch, slice, Kernel};
use amp_core::QType;
use candle_core::{CpuStorage, DType, Layout, Tensor};

/// Which way an op converts, and its factor.
#[derive(Clone, Copy)]
pub(crate) enum Codec {
    /// f32 values times `scale` to codes of `q`.
    Encode { q: QType, scale: f32 },
    /// Codes of `q` times `scale_inv` to f32.
    Decode { q: QType, scale_inv: f32 },
}

impl Codec {
    /// The CPU body of the kernel (`dispatch.rs` makes it one).
    pub(crate) fn cpu_body(
        &self,
        inputs: &[(&CpuStorage, &Layout)],
    ) -> amp_core::Result<Vec<(CpuStorage, candle_core::Shape)>> {
        const OP: &str = Codec::NAME;
        let [(s, l)] = inputs else {
            return Err(amp_core::Error::Unsupported {
                op: OP,
                what: "wrong number of inputs".into(),
            });
        };
        let out = match *self {
            Codec::Encode { q, scale } => encode_with(q, slice::<f32>(OP, s, l)?, scale),
            Codec::Decode { q, scale_inv } => {
                let mut out = vec![0f32; l.shape().elem_count()];
                decode(OP, Some(q), s, l, scale_inv, 0, &mut out)?;
                CpuStorage::F32(out)
            }
        };
        Ok(vec![(out, l.shape().clone())])
    }
}

/// `x * scale` (x F32) as codes of `q` (U8 for FP8, F16 for FP16), as the
/// low-bit step encodes its outputs, on `x`'s device.
///
/// # Errors
/// A dtype other than F32, or the device's.
pub fn step_encode(x: &Tensor, q: QType, scale: f32) -> Result<Tensor> {
    one(launch(&Codec::Encode { q, scale }, &[x])?)
}

/// Codes of `q` (U8 for FP8, F16 for FP16) times `scale_inv` as F32, as the
/// low-bit step decodes its inputs, on the codes' device.
///
/// # Errors
/// A dtype other than `q`'s storage, or the device's.
pub fn step_decode(codes: &Tensor, q: QType, scale_inv: f32) -> Result<Tensor> {
    let want = if q.fp8().is_some() {
        DType::U8
    } else {
        DType::F16
    };
    if codes.dtype() != want {
        return Err(amp_core::Error::DType {
            op: Codec::NAME,
            expected: "U8 codes for FP8, F16 for FP16",
            got: codes.dtype(),
        }
        .into());
    }
    one(launch(&Codec::Decode { q, scale_inv }, &[codes])?)
}

fn one(out: Vec<Tensor>) -> Result<Tensor> {
    out.into_iter().next().ok_or_else(|| {
        amp_core::Error::Unsupported {
            op: Codec::NAME,
            what: "no output".into(),
        }
        .into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn codes_round_trip_on_the_cpu() -> Result<()> {
        let x = Tensor::new(&[0.5f32, -3.0, 448.0, 1e9, f32::NAN, 0.0], &Device::Cpu)?;
        let c = step_encode(&x, QType::E4M3, 1.0)?;
        assert_eq!(c.to_vec1::<u8>()?, [0x30, 0xC4, 0x7E, 0x7E, 0x7F, 0x00]);
        let y = step_decode(&c, QType::E4M3, 2.0)?.to_vec1::<f32>()?;
        assert_eq!(&y[..4], &[1.0, -6.0, 896.0, 896.0]);
        assert!(y[4].is_nan());
        assert!(matches!(
            step_decode(&x, QType::E4M3, 1.0),
            Err(crate::Error::Core(amp_core::Error::DType { .. }))
        ));
        Ok(())
    }
}
