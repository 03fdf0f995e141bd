//! One parameter's low-bit AdamW update through the fused kernel: the
//! streams it reads (weight, gradient, moments) and how its outputs become
//! the new weight storage and moments.

use crate::adamw::AdamStep;
use crate::error::{Error, Result};
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

fn state_stream(s: &State, ones: &mut Ones) -> Result<Stream> {
    match s {
        State::F32(t) => f32_stream(t, ones),
        State::Scaled(t) => Ok(scaled_stream(t)),
    }
}

pub(crate) fn kernel_error(what: &str) -> Error {
    amp_core::Error::Unsupported {
        op: "LowBitAdamW::step",
        what: what.into(),
    }
    .into()
}

/// Outputs of the kernel per stream: data, scale, scale_inv, amax.
const PER_STREAM: usize = 4;

/// Rebuilds a stream from the kernel's outputs: a scaling tensor for a
/// low-bit stream, the F32 tensor otherwise.
fn rebuild(q: Option<QType>, out: &[Tensor]) -> Result<std::result::Result<ScalingTensor, Tensor>> {
    let [data, scale, scale_inv, amax] = out else {
        return Err(kernel_error("kernel outputs"));
    };
    Ok(match q {
        None => Err(data.clone()),
        Some(qtype) => {
            let meta =
                ScalingMeta::from_parts(qtype, scale.clone(), scale_inv.clone(), amax.clone())?;
            Ok(ScalingTensor::from_parts(data.clone(), meta)?)
        }
    })
}

fn to_state(q: Option<QType>, out: &[Tensor]) -> Result<State> {
    Ok(match rebuild(q, out)? {
        Ok(t) => State::Scaled(t),
        Err(t) => State::F32(t),
    })
}

/// One parameter's update through the fused kernel.
pub(crate) fn update_param(
    p: &mut ParamState,
    g: &Grad,
    k: AdamStep,
    grad_mul: f32,
    scratch: &std::sync::Mutex<Vec<f32>>,
    ones: &mut Ones,
) -> Result<()> {
    let weight = p.slot.read()?.clone();
    let (w, fp8_copy) = match &weight {
        Weight::F32(var) => (f32_stream(var.as_tensor(), ones)?, false),
        Weight::F16(t) => (scaled_stream(t), false),
        Weight::Fp8 { master, .. } => (scaled_stream(master), true),
        Weight::Fp8Gathered(_) => {
            return Err(Error::Config {
                field: "weight",
                reason: format!(
                    "`{}` is a gathered FP8 copy: its master is a shard, update that",
                    p.name
                ),
            })
        }
    };
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
        grad_mul,
        w: w.2,
        g: g.2,
        m: m.2,
        v: v.2,
        fp8_copy,
    };
    let mut inputs = vec![&w.0, &w.1, &g.0, &g.1, &m.0, &m.1, &v.0, &v.1];
    if let Weight::Fp8 { weight: copy, .. } = &weight {
        inputs.push(copy.meta().scale_inv());
    }
    let outs = launch(&kernel, &inputs)?;
    let (copy, rest) = outs.split_at(if fp8_copy { PER_STREAM } else { 0 });
    let (wo, rest) = rest.split_at(PER_STREAM);
    let (mo, vo) = rest.split_at(PER_STREAM);
    p.exp_avg = to_state(m.2, mo)?;
    p.exp_avg_sq = to_state(v.2, vo)?;
    match (weight, rebuild(w.2, wo)?) {
        (Weight::F32(var), Err(t)) => var.set(&t.reshape(var.shape())?.to_dtype(var.dtype())?)?,
        (Weight::F16(_), Ok(t)) => p.slot.replace(Weight::F16(t))?,
        (Weight::Fp8 { .. }, Ok(master)) => {
            let Ok(weight) = rebuild(Some(QType::E4M3), copy)? else {
                return Err(kernel_error("FP8 copy"));
            };
            p.slot.replace(Weight::Fp8 { weight, master })?
        }
        _ => return Err(kernel_error("weight storage changed")),
    }
    Ok(())
}
