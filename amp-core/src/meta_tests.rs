//! Current scaling's scale, computed inside the cast kernel (quantize) and
//! by `ScalingMeta::for_current_amax` (requantize), against the
//! three-step path it replaces (record the amax, update the scale).

use super::*;

#[test]
fn current_amax_meta_equals_new_record_update() -> Result<()> {
    let dev = Device::Cpu;
    let amaxes = [
        0.0f32,
        1e-40,
        1e-3,
        0.75,
        448.0,
        3.0e5,
        f32::MAX,
        f32::INFINITY,
        f32::NAN,
    ];
    for qtype in [QType::E4M3, QType::E5M2, QType::F16] {
        for rule in [ScaleRule::Te, ScaleRule::PowerOfTwo] {
            for margin in [0, 2] {
                for a in amaxes {
                    let amax = Tensor::new(&[a], &dev)?;
                    let recipe = crate::recipe::CurrentScaling {
                        scale_rule: rule,
                        margin,
                        ..Default::default()
                    };
                    let mut old = ScalingMeta::new(qtype, 1, &dev)?;
                    old.record_amax(&amax)?;
                    old.update_scale(rule, AmaxComputeAlgo::MostRecent, margin)?;
                    let (q, _) = crate::tensor::ScalingTensor::quantize(&amax, qtype, &recipe)?;
                    let new = q.meta();
                    let req = ScalingMeta::for_current_amax(qtype, &amax, rule, margin)?;
                    let bits = |t: &Tensor| -> Result<Vec<u32>> {
                        Ok(t.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
                    };
                    assert_eq!(bits(new.scale())?, bits(old.scale())?, "{qtype:?} {a}");
                    assert_eq!(bits(new.scale_inv())?, bits(old.scale_inv())?);
                    assert_eq!(bits(req.scale())?, bits(old.scale())?, "{qtype:?} {a}");
                    assert_eq!(bits(req.scale_inv())?, bits(old.scale_inv())?);
                    assert_eq!(req.updates, old.updates);
                }
            }
        }
    }
    Ok(())
}
