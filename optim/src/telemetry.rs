//! Precision telemetry of the Adam moments. While amp-core's telemetry
//! records in this thread (`amp_core::set_telemetry`), each update of a
//! parameter with low-bit moments also measures each new moment against
//! its F32 value (the previous moment decoded, the step's gradient times
//! its multiplier, Adam's recurrences in F32): amax, scale, elements
//! saturated and flushed to zero, relative error, as the Linear layers
//! record their casts. [`LowBitAdamW::take_moment_telemetry`] reads them.
//! A second moment stored as square roots is measured as roots (the
//! values the codes hold). Off, a step pays one thread-local read.

use crate::adamw::AdamWConfig;
use crate::error::Result;
use crate::grad::Grad;
use crate::state::State;
use amp_core::CastRecord;
use candle_core::Tensor;

/// One parameter's moments after one applied step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MomentRecord {
    /// The parameter's name.
    pub name: String,
    /// The optimizer's step (applied steps, 1-based) it was taken at.
    pub step: u64,
    /// The first moment (`exp_avg`).
    pub exp_avg: CastRecord,
    /// The second moment (`exp_avg_sq`; its square roots for
    /// [`StateFormat::E4M3Sqrt`](crate::StateFormat::E4M3Sqrt)).
    pub exp_avg_sq: CastRecord,
}

/// What a record needs from before the update.
pub(crate) struct Before {
    m: Tensor,
    v: Tensor,
    g: Tensor,
}

/// The moments `[m, v]` and the scaled gradient before a parameter's
/// update, where telemetry records and both moments are low-bit.
pub(crate) fn before([m, v]: [&State; 2], g: &Grad, grad_mul: &Tensor) -> Result<Option<Before>> {
    let low_bit = |s: &State| !matches!(s, State::F32(_));
    if !amp_core::telemetry_enabled() || !low_bit(m) || !low_bit(v) {
        return Ok(None);
    }
    Ok(Some(Before {
        m: m.values()?,
        v: v.values()?,
        g: g.to_f32()?.broadcast_mul(grad_mul)?,
    }))
}

/// The record of parameter `name`'s new moments `[m, v]`, after its
/// update (its `step`-th).
pub(crate) fn after(
    name: &str,
    [m, v]: [&State; 2],
    b: Before,
    adam: &AdamWConfig,
    step: u64,
) -> Result<MomentRecord> {
    let m_f32 = ((b.m * adam.beta1)? + (&b.g * (1.0 - adam.beta1))?)?;
    let v_f32 = ((b.v * adam.beta2)? + (b.g.sqr()? * (1.0 - adam.beta2))?)?;
    Ok(MomentRecord {
        name: name.to_string(),
        step,
        exp_avg: measure(m, &m_f32)?,
        exp_avg_sq: measure(v, &v_f32)?,
    })
}

fn measure(s: &State, values: &Tensor) -> Result<CastRecord> {
    Ok(match s {
        State::Sqrt(t) => CastRecord::measure(t, &values.sqrt()?)?,
        State::Scaled(t) => CastRecord::measure(t, values)?,
        // F32 moments: nothing is cast (`before` records none)
        State::F32(t) => CastRecord {
            amax: t.abs()?.max_all()?.to_scalar::<f32>()?,
            scale: 1.0,
            saturated: 0,
            flushed: 0,
            total: t.elem_count() as u64,
            rel_err: 0.0,
        },
    })
}
