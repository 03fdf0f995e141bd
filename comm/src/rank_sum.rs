//! The middle of every FP8 reduction: the scales a rank sends beside its
//! codes ([`sent_scales`]), and the ranks' chunks of codes decoded, rank
//! `k`'s with rank `k`'s scale, and summed in F32 in rank order
//! ([`rank_order_mean`]).

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

/// What a rank sends beside its codes of `own`, in bucket kernels only (so
/// that it may run on the communicator's stream): each tensor's
/// `scale_inv`, NaN where its amax is not finite (`[T]`,
/// [`bucket_flag_scale_inv`](amp_core::bucket_flag_scale_inv)), and with
/// `with_amax` each tensor's amax after them (`[2T]`).
pub(crate) fn sent_scales(own: &[&ScalingTensor], with_amax: bool) -> Result<Tensor> {
    let sinv: Vec<&Tensor> = own.iter().map(|s| s.meta().scale_inv()).collect();
    let amax = own
        .iter()
        .map(|s| s.meta().amax())
        .collect::<amp_core::Result<Vec<_>>>()?;
    let amax: Vec<&Tensor> = amax.iter().collect();
    let flags = amp_core::bucket_flag_scale_inv(&sinv, &amax)?;
    if !with_amax {
        return Ok(flags);
    }
    let mut sent: Vec<&Tensor> = vec![&flags];
    sent.extend(&amax);
    Ok(amp_core::bucket_concat(&sent)?)
}
