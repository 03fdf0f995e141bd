//! [`rank_order_mean`]: the middle of every FP8 reduction, the ranks'
//! chunks of codes decoded, rank `k`'s with rank `k`'s scale, and summed
//! in F32 in rank order.

use crate::error::{Error, Result};
use amp_core::{QType, ScalingMeta, ScalingTensor};
use candle_core::{DType, Tensor};

/// The rank-order F32 sum of `parts` (one chunk of codes of `qtype` per
/// rank, rank k's decoded with element k of `scale_invs`, or all with its
/// one element), from rank 0's
/// values (not `0 + x`: keeps -0.0), divided by the number of parts when
/// `average`; and its amax (NaN when it holds one). FP8 codes of at most
/// 64 ranks in one pass ([`amp_core::decode_sum`]); otherwise (and for
/// empty parts) decoded one by one and added, bit for bit the same.
pub(crate) fn rank_order_mean(
    parts: &[Tensor],
    scale_invs: &Tensor,
    qtype: QType,
    average: bool,
) -> Result<(Tensor, Tensor)> {
    let shared = scale_invs.elem_count() == 1;
    if parts.is_empty() || !(shared || scale_invs.elem_count() == parts.len()) {
        return Err(Error::InvalidArgument {
            op: "fp8 bucket",
            what: format!(
                "{} ranks' parts with {} scales",
                parts.len(),
                scale_invs.elem_count()
            ),
        });
    }
    if qtype != QType::F16 && parts.len() <= 64 && parts[0].elem_count() > 0 {
        return Ok(amp_core::decode_sum(parts, scale_invs, qtype, average)?);
    }
    // decode(code) * scale_inv: the codes decoded with a unit scale (exact)
    // times the rank's scale_inv (one rounding, as dequantize's), so that a
    // NaN scale_inv (a rank's non-finite flag) decodes to NaN
    let unit = ScalingMeta::new(qtype, 1, scale_invs.device())?;
    let decode = |k: usize| -> Result<Tensor> {
        let si = scale_invs
            .flatten_all()?
            .narrow(0, if shared { 0 } else { k }, 1)?;
        let codes = ScalingTensor::from_parts(parts[k].clone(), unit.clone())?;
        Ok(codes.dequantize(DType::F32)?.broadcast_mul(&si)?)
    };
    let mut sum = decode(0)?;
    for k in 1..parts.len() {
        sum = (sum + decode(k)?)?;
    }
    if average && parts.len() > 1 {
        sum = (sum / parts.len() as f64)?;
    }
    let amax = amp_core::amax(&sum)?;
    Ok((sum, amax))
}
