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
//! yet, a last forward with another compute path (native, block, rowwise,
//! delayed scaling), or a weight not stored in FP16, and it casts nothing
//! ahead. A forward that counts its casts' saturated and flushed elements
//! (numerics/counts.rs, telemetry) takes only a cast made while counting.
//! A cast made ahead lives until the layer's next forward (which keeps it
//! for its backward anyway): between the step and the forward, two bytes
//! a weight element more than without.

use super::Linear;
use crate::error::{Error, Result};
use crate::numerics::counts::cast_counts;
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
    /// Whether the cast counted (numerics/counts.rs): a forward that
    /// counts (telemetry turned on since) casts again.
    counted: bool,
    q: ScalingTensor,
    qt: ScalingTensor,
}

fn lock(ahead: &SharedAhead) -> Result<MutexGuard<'_, Ahead>> {
    ahead.lock().map_err(|_| Error::Poisoned {
        op: "Linear casts ahead",
    })
}

/// The forward's side, called by every forward of the layer: `cast` is
/// the weight cast it is about to make (an FP16 weight to `qtype` with its
/// transpose under current scaling `r`), or `None` for any other (another
/// storage or scaling, or no FP8 pass of the weight). Remembers it for
/// [`cast_weights_ahead`] and returns the codes made ahead for it, if they
/// were made from this weight, target and recipe, and counted where this
/// thread counts now. Any other cast made ahead is dropped.
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
                && &x.recipe == r
                && (x.counted || !cast_counts()) =>
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
    // by device (one launch takes one device's tensors), target and recipe
    type Key = (candle_core::Device, QType, CurrentScaling);
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
        let key = (w.device().clone(), qtype, recipe);
        let same = |k: &Key| k.0.same_device(&key.0) && k.1 == key.1 && k.2 == key.2;
        match groups.iter_mut().find(|(k, _)| same(k)) {
            Some((_, members)) => members.push((i, w.clone())),
            None => groups.push((key, vec![(i, w.clone())])),
        }
    }
    let mut cast = 0;
    let counted = cast_counts();
    for ((_, qtype, recipe), members) in groups {
        let weights: Vec<&ScalingTensor> = members.iter().map(|(_, w)| w).collect();
        let casts = ScalingTensor::requantize_t_many(&weights, qtype, &recipe)?;
        for ((i, w), (q, qt, _)) in members.iter().zip(casts) {
            lock(&layers[*i].ahead)?.ready = Some(Ready {
                data: w.data().id(),
                scale_inv: w.meta().scale_inv().id(),
                qtype,
                recipe: recipe.clone(),
                counted,
                q,
                qt,
            });
            cast += 1;
        }
    }
    Ok(cast)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::linear::layer_scaling::Role;
    use crate::nn::{fp8_autocast, ComputeMode};
    use crate::scaling::sink::GradSink;
    use crate::scaling::weight::WeightSlot;
    use candle_core::{Device, Module, Tensor};

    fn weight_scale(l: &Linear) -> TensorId {
        let casts = l.casts.lock().unwrap();
        casts.metas[Role::Weight as usize]
            .as_ref()
            .unwrap()
            .scale()
            .id()
    }

    /// The forward after `cast_weights_ahead` takes the cast made ahead
    /// (its weight metadata is that cast's own tensor), a forward without
    /// an FP8 pass forgets what to cast, and a forward that counts does not
    /// take a cast made without counting.
    #[test]
    fn the_next_forward_takes_the_cast_made_ahead() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (8, 16), &dev).unwrap();
        let r = CurrentScaling::default();
        let (w16, _) = ScalingTensor::quantize(&w, QType::F16, &r).unwrap();
        let l = Linear::from_slot("w", WeightSlot::new(Weight::F16(w16)), None);
        l.set_grad_sink(Some(GradSink::new())).unwrap();
        let x = Tensor::randn(0f32, 1.0, (4, 16), &dev).unwrap();
        let fp8 = || {
            let _s = fp8_autocast(true, ComputeMode::Fp8Current(r.clone()));
            l.forward(&x).unwrap()
        };
        crate::set_cast_counts(false);
        let first = fp8();
        assert_eq!(cast_weights_ahead(std::slice::from_ref(&l)).unwrap(), 1);
        let made = |l: &Linear| {
            let g = l.ahead.lock().unwrap();
            g.ready.as_ref().map(|x| x.q.meta().scale().id())
        };
        let ahead = made(&l).unwrap();
        let taken = fp8();
        assert!(made(&l).is_none(), "the forward took it");
        assert_eq!(
            weight_scale(&l),
            ahead,
            "its weight cast is the one made ahead"
        );
        assert_eq!(
            taken.to_vec2::<f32>().unwrap(),
            first.to_vec2::<f32>().unwrap()
        );
        // made without counting; this thread counts now: cast again
        cast_weights_ahead(std::slice::from_ref(&l)).unwrap();
        let uncounted = made(&l).unwrap();
        crate::set_cast_counts(true);
        fp8();
        assert_ne!(weight_scale(&l), uncounted);
        assert!(l.last_cast_stats().unwrap()[Role::Weight as usize].is_some());
        crate::set_cast_counts(false);
        // a native forward: nothing to cast ahead for it any more
        l.forward(&x).unwrap();
        assert_eq!(cast_weights_ahead(std::slice::from_ref(&l)).unwrap(), 0);
    }
}
