//! The decode-and-sum launch: the ranks' chunks decoded with their
//! scales, summed in rank order, by `SumOut` as sums, amaxes or codes.

use super::{fmt_name, launches, wrap_f32, Item};
use crate::error::Result;
use crate::numerics::bucket::{Piece, SumOut};
use crate::numerics::cuda::decode_sum::SUM_MAX;
use crate::numerics::cuda::launch::{func, view};
use crate::numerics::kernel::arity;
use crate::numerics::qtype::QType;
use crate::numerics::stream::cuda::current_stream;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{Layout, Shape};

/// chunk_0..N-1, scale_inv [T] (and scale [T] for codes) -> by `mode`:
/// sums [sum of piece lengths] and amax [T]; amax [T]; codes [sum of piece
/// lengths].
pub(crate) fn bucket_decode_sum(
    qtype: QType,
    average: bool,
    inv_n: f32,
    pieces: &[Piece],
    mode: SumOut,
    inputs: &[(&CudaStorage, &Layout)],
) -> Result<Vec<(CudaStorage, Shape)>> {
    const OP: &str = "bucket_decode_sum";
    let (inputs, scale) = match mode {
        SumOut::Codes => {
            let Some(((q, lq), rest)) = inputs.split_last() else {
                return Err(arity(OP));
            };
            (rest, Some(view::<f32>(OP, q, lq)?))
        }
        SumOut::Sums | SumOut::Amax => (inputs, None),
    };
    let Some(((s, ls), chunks)) = inputs.split_last() else {
        return Err(arity(OP));
    };
    if chunks.is_empty() || chunks.len() > SUM_MAX {
        return Err(arity(OP));
    }
    let dev = s.device().clone();
    let stream = current_stream(&dev);
    // `[T]`: every rank's codes of tensor t with element t; `[N, T]`:
    // rank k's with element [k, t]
    let (tensors, s_stride): (usize, i32) = match ls.shape().dims() {
        [ranks, t] if *ranks == chunks.len() => (*t, *t as i32),
        [t] => (*t, 0),
        _ => return Err(arity(OP)),
    };
    let scale_inv = view::<f32>(OP, s, ls)?;
    let views = chunks
        .iter()
        .map(|(c, l)| view::<u8>(OP, c, l))
        .collect::<Result<Vec<_>>>()?;
    let mut ptrs = [0u64; SUM_MAX];
    let mut guards = Vec::new();
    for (k, v) in views.iter().enumerate() {
        let (p, g) = v.device_ptr(&stream);
        ptrs[k] = p;
        guards.push(g);
    }
    let mut items = Vec::with_capacity(pieces.len());
    let mut total = 0;
    for p in pieces {
        items.push(Item {
            src: 0,
            len: p.len,
            out_off: total,
            aux: p.start as u64,
            t: p.tensor,
        });
        total += p.len;
    }
    let fmt = fmt_name(OP, qtype)?;
    let ranks = chunks.len() as i32;
    let avg = i32::from(average && chunks.len() > 1);
    // The outputs of the mode: codes, or sums and amaxes, or amaxes.
    let (name, mut codes, mut sums, mut amax) = match (mode, &scale) {
        (SumOut::Codes, Some(_)) => (
            "bucket_decode_quantize",
            // SAFETY: the kernel writes every element (the pieces cover them).
            Some(unsafe { stream.alloc::<u8>(total.max(1)) }.w()?),
            None,
            None,
        ),
        (SumOut::Codes, None) => return Err(arity(OP)),
        (SumOut::Amax, _) => (
            "bucket_decode_amax",
            None,
            None,
            Some(stream.alloc_zeros::<f32>(tensors.max(1)).w()?),
        ),
        (SumOut::Sums, _) => (
            "bucket_decode_sum",
            None,
            // SAFETY: as above.
            Some(unsafe { stream.alloc::<f32>(total.max(1)) }.w()?),
            Some(stream.alloc_zeros::<f32>(tensors.max(1)).w()?),
        ),
    };
    let f = func(&dev, &format!("{name}_{fmt}"))?;
    for (a, cfg) in launches(&dev, &items)? {
        let mut b = stream.launch_builder(&f);
        b.arg(&a)
            .arg(&ptrs)
            .arg(&ranks)
            .arg(&scale_inv)
            .arg(&s_stride)
            .arg(&avg)
            .arg(&inv_n);
        // the kernel's trailing parameters, in its order
        if let (Some(scale), Some(codes)) = (&scale, &mut codes) {
            b.arg(scale).arg(codes);
        }
        if let Some(sums) = &mut sums {
            b.arg(sums);
        }
        if let Some(amax) = &mut amax {
            b.arg(amax);
        }
        // SAFETY: every chunk is live (`guards`) and holds each piece's
        // range; every output range within its output, every tensor in
        // `scale_inv`, `scale` (checked by the caller) and `amax`.
        unsafe { b.launch(cfg) }.w()?;
    }
    let out = match (codes, sums, amax) {
        (Some(codes), _, _) => vec![(
            CudaStorage::wrap_cuda_slice(codes, dev.clone()),
            Shape::from(total),
        )],
        (None, Some(sums), Some(amax)) => {
            vec![wrap_f32(sums, &dev, total), wrap_f32(amax, &dev, tensors)]
        }
        (None, None, Some(amax)) => vec![wrap_f32(amax, &dev, tensors)],
        _ => return Err(arity(OP)),
    };
    drop(guards);
    Ok(out)
}
