//! One parameter's low-bit AdamW update through the fused kernel: the
//! streams it reads (weight, gradient, moments) and how its outputs become
//! the new weight storage and moments.

use crate::adamw::AdamStep;
use crate::error::{kernel_error, Error, Result};
use crate::fused::LowBitStep;
use crate::grad::Grad;
use crate::lowbit::ParamState;
use crate::state::State;
use amp_core::kernel::launch;
use amp_core::{QType, ScalingMeta, ScalingTensor, Weight};
use candle_core::{DType, Tensor};

/// A stream of the fused kernel: its data, scale_inv and storage type.
type Stream = (Tensor, Tensor, Option<QType>);

/// One-element F32 ones, one per device, made once a step: the (ignored)
/// scale_inv of every F32 stream, instead of a fill launch per stream.
#[derive(Default)]
pub(crate) struct Ones(Vec<Tensor>);

impl Ones {
    fn on(&mut self, dev: &candle_core::Device) -> Result<Tensor> {
        if let Some(t) = self.0.iter().find(|t| t.device().same_device(dev)) {
            return Ok(t.clone());
        }
        let t = Tensor::ones(1, DType::F32, dev)?;
        self.0.push(t.clone());
        Ok(t)
    }
}

pub(crate) fn f32_stream(data: &Tensor, ones: &mut Ones) -> Result<Stream> {
    Ok((data.to_dtype(DType::F32)?, ones.on(data.device())?, None))
}

pub(crate) fn scaled_stream(t: &ScalingTensor) -> Stream {
    (
        t.data().clone(),
        t.meta().scale_inv().clone(),
        Some(t.qtype()),
    )
}

pub(crate) fn state_stream(s: &State, ones: &mut Ones) -> Result<Stream> {
    match s {
        State::F32(t) => f32_stream(t, ones),
        State::Scaled(t) | State::Sqrt(t) => Ok(scaled_stream(t)),
    }
}

/// Where `p`'s second moment is stored as square roots, the salt of this
/// step's stochastic rounding: its name's hash and its step count, so no
/// two steps and no two parameters round alike (and a resumed run rounds
/// as the run it continues).
pub(crate) fn root_salt(p: &ParamState) -> Option<u32> {
    if !matches!(p.exp_avg_sq, State::Sqrt(_)) {
        return None;
    }
    // FNV-1a: stable across runs and builds, unlike std's hasher
    let name = p.name.bytes().fold(0x811C_9DC5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    Some(name ^ (p.step as u32).wrapping_mul(0x9E37_79B9) ^ ((p.step >> 32) as u32))
}

/// A stream rebuilt from the kernel's outputs: its data and its three meta
/// slots (views of the one meta output): a scaling tensor for a low-bit
/// stream, the F32 tensor otherwise.
fn rebuild(
    q: Option<QType>,
    data: &Tensor,
    meta: &Tensor,
    slot: usize,
) -> Result<std::result::Result<ScalingTensor, Tensor>> {
    Ok(match q {
        None => Err(data.clone()),
        Some(qtype) => {
            let at = |i: usize| meta.narrow(0, 3 * slot + i, 1);
            let meta = ScalingMeta::from_parts(qtype, at(0)?, at(1)?, at(2)?)?;
            Ok(ScalingTensor::from_parts(data.clone(), meta)?)
        }
    })
}

/// A moment rebuilt from the kernel's outputs; `roots`: the stream holds
/// square roots ([`State::Sqrt`]).
pub(crate) fn to_state(
    q: Option<QType>,
    roots: bool,
    data: &Tensor,
    meta: &Tensor,
    slot: usize,
) -> Result<State> {
    Ok(match rebuild(q, data, meta, slot)? {
        Ok(t) if roots => State::Sqrt(t),
        Ok(t) => State::Scaled(t),
        Err(t) => State::F32(t),
    })
}

/// The error for a step of a gathered FP8 copy (ZeRO's full weight on
/// every rank, whose master is a shard).
pub(crate) fn gathered(name: &str) -> Error {
    Error::Config {
        field: "weight",
        reason: format!("`{name}` is a gathered FP8 copy: its master is a shard, update that"),
    }
}

/// Whether the fused kernel can write this weight in place: a contiguous
/// F32 `Var` on CUDA (any other weight is not an F32 one, or is set from
/// the kernel's output).
pub(crate) fn updates_in_place(w: &Weight) -> bool {
    match w {
        Weight::F32(var) => {
            var.device().is_cuda() && var.dtype() == DType::F32 && var.is_contiguous()
        }
        _ => false,
    }
}

/// One parameter's update through the fused kernel; `grad_mul` is the
/// one-element F32 multiplier (NaN: the kernels skip, see `clip.rs`). With
/// `in_place`, a contiguous F32 weight on CUDA is written by the kernel
/// itself (the CPU body cannot write an input: there the weight is set
/// from the kernel's output).
pub(crate) fn update_param(
    p: &mut ParamState,
    g: &Grad,
    k: AdamStep,
    grad_mul: &Tensor,
    scratch: &std::sync::Mutex<Vec<f32>>,
    ones: &mut Ones,
) -> Result<()> {
    let weight = p.slot.read()?.clone();
    let (w, fp8_copy) = match &weight {
        Weight::F32(var) => (f32_stream(var.as_tensor(), ones)?, false),
        Weight::F16(t) => (scaled_stream(t), false),
        Weight::Fp8 { master, .. } => (scaled_stream(master), true),
        Weight::Fp8Gathered(_) => return Err(gathered(&p.name)),
    };
    let w_in_place = matches!(&weight, Weight::F32(_)) && updates_in_place(&weight);
    let g = match g {
        Grad::F32(t) => f32_stream(t, ones)?,
        Grad::Scaled(t) => scaled_stream(t),
    };
    let (m, v) = (
        state_stream(&p.exp_avg, ones)?,
        state_stream(&p.exp_avg_sq, ones)?,
    );
    let kernel = LowBitStep {
        scratch,
        k,
        w: w.2,
        g: g.2,
        m: m.2,
        v: v.2,
        fp8_copy,
        v_sqrt: root_salt(p),
        w_in_place,
    };
    let mut inputs = vec![&w.0, &w.1, &g.0, &g.1, &m.0, &m.1, &v.0, &v.1, grad_mul];
    if let Weight::Fp8 { weight: copy, .. } = &weight {
        inputs.push(copy.meta().scale_inv());
    }
    let outs = launch(&kernel, &inputs)?;
    let (meta, data) = outs
        .split_last()
        .ok_or_else(|| kernel_error("kernel outputs"))?;
    let (copy, data) = data.split_at(usize::from(fp8_copy));
    let (wo, data) = data.split_at(usize::from(!w_in_place));
    let [mo, vo] = data else {
        return Err(kernel_error("kernel outputs"));
    };
    let roots = kernel.v_sqrt.is_some();
    p.exp_avg = to_state(m.2, false, mo, meta, 1)?;
    p.exp_avg_sq = to_state(v.2, roots, vo, meta, 2)?;
    match (weight, wo) {
        (Weight::F32(_), []) => {}
        (Weight::F32(var), [t]) => var.set(&t.reshape(var.shape())?.to_dtype(var.dtype())?)?,
        (Weight::F16(_), [t]) => {
            let Ok(t) = rebuild(w.2, t, meta, 0)? else {
                return Err(kernel_error("weight storage changed"));
            };
            p.slot.replace(Weight::F16(t))?
        }
        (Weight::Fp8 { .. }, [t]) => {
            let (Ok(master), [c]) = (rebuild(w.2, t, meta, 0)?, copy) else {
                return Err(kernel_error("FP8 copy"));
            };
            let Ok(weight) = rebuild(Some(QType::E4M3), c, meta, 3)? else {
                return Err(kernel_error("FP8 copy"));
            };
            p.slot.replace(Weight::Fp8 { weight, master })?
        }
        _ => return Err(kernel_error("weight storage changed")),
    }
    Ok(())
}
