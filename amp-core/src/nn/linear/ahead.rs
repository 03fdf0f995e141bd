//! The weights' FP8 casts made ahead of the forward, all at once.
//!
//! Under current scaling a Linear with an FP16 weight (O1, O2) casts it to
//! its FP8 GEMM operands in every forward: the decoded amax, then the
//! cast-transpose, two launches (and two zero fills) a layer, queued by
//! the host in a forward that runs at the host's pace (BENCHMARKS.md).
//! [`cast_weights_ahead`] makes those casts for many layers in two
//! launches, right after the optimizer has written the weights; each
//! layer's next forward takes its own when the weight, target and recipe
//! are still those it was made for, and casts as before otherwise. The
//! codes are those of the layer's own cast bit for bit
//! ([`ScalingTensor::requantize_t_many`]), so nothing but the number of
//! launches changes.
//!
//! What a layer casts ahead is what its last forward cast: no forward
//! yet, another compute path, or a weight not stored in FP16, and it casts
//! nothing ahead. A cast made ahead lives until that forward (which keeps
//! it for its backward anyway): between the step and the forward, two
//! bytes a weight element more than without.

use super::Linear;
use crate::error::{Error, Result};
use crate::numerics::qtype::QType;
use crate::numerics::recipe::CurrentScaling;
use crate::scaling::tensor::ScalingTensor;
use crate::scaling::weight::Weight;
use candle_core::TensorId;
use std::sync::{Arc, Mutex, MutexGuard};

/// A layer's casts made ahead: what its last forward cast, and the cast
/// made for its next one.
#[derive(Debug, Default)]
pub(crate) struct Ahead {
    last: Option<(QType, CurrentScaling)>,
    ready: Option<Ready>,
}

pub(crate) type SharedAhead = Arc<Mutex<Ahead>>;

/// A weight's codes, both layouts, and what they were made from.
#[derive(Debug)]
struct Ready {
    data: TensorId,
    scale_inv: TensorId,
    qtype: QType,
    recipe: CurrentScaling,
    q: ScalingTensor,
    qt: ScalingTensor,
}

fn lock(ahead: &SharedAhead) -> Result<MutexGuard<'_, Ahead>> {
    ahead.lock().map_err(|_| Error::Poisoned {
        op: "Linear casts ahead",
    })
}

/// The forward's side: `cast` is the weight cast it is about to make (an
/// FP16 weight to `qtype` with its transpose under current scaling `r`),
/// or `None` for any other. Remembers it for [`cast_weights_ahead`] and
/// returns the codes made ahead for it, if they were made from this
/// weight, target and recipe. Any other cast made ahead is dropped.
pub(super) fn take(
    ahead: &SharedAhead,
    cast: Option<(&ScalingTensor, QType, &CurrentScaling)>,
) -> Result<Option<(ScalingTensor, ScalingTensor)>> {
    let mut g = lock(ahead)?;
    g.last = cast.map(|(_, q, r)| (q, r.clone()));
    let ready = g.ready.take();
    Ok(match (cast, ready) {
        (Some((w, qtype, r)), Some(x))
            if x.data == w.data().id()
                && x.scale_inv == w.meta().scale_inv().id()
                && x.qtype == qtype
                && &x.recipe == r =>
        {
            Some((x.q, x.qt))
        }
        _ => None,
    })
}

/// Casts the FP16 weights of `layers` to the FP8 operands their last
/// forward made (current scaling, with the transpose), in two launches per
/// device, target and recipe on CUDA, and keeps each for the layer's next
/// forward (module docs). Layers in high precision, without such a
/// forward, or with another weight storage are skipped. Returns how many
/// weights were cast. The levels call it after each applied step while
/// [`weight_casts_ahead`](super::weight_casts_ahead) is on.
///
/// # Errors
/// The casts' ([`ScalingTensor::requantize_t_many`]), [`Error::Poisoned`].
pub fn cast_weights_ahead(layers: &[Linear]) -> Result<usize> {
    type Key = (candle_core::DeviceLocation, QType, CurrentScaling);
    let mut groups: Vec<(Key, Vec<(usize, ScalingTensor)>)> = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        if layer.is_high_precision() {
            continue;
        }
        let Some((qtype, recipe)) = lock(&layer.ahead)?.last.clone() else {
            continue;
        };
        let Weight::F16(w) = &*layer.weight.read()? else {
            continue;
        };
        let key = (w.device().location(), qtype, recipe);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push((i, w.clone())),
            None => groups.push((key, vec![(i, w.clone())])),
        }
    }
    let mut cast = 0;
    for ((_, qtype, recipe), members) in groups {
        let weights: Vec<&ScalingTensor> = members.iter().map(|(_, w)| w).collect();
        let casts = ScalingTensor::requantize_t_many(&weights, qtype, &recipe)?;
        for ((i, w), (q, qt, _)) in members.iter().zip(casts) {
            lock(&layers[*i].ahead)?.ready = Some(Ready {
                data: w.data().id(),
                scale_inv: w.meta().scale_inv().id(),
                qtype,
                recipe: recipe.clone(),
                q,
                qt,
            });
            cast += 1;
        }
    }
    Ok(cast)
}
