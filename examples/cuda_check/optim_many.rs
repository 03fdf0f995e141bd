//! Many parameters in one optimizer on the GPU against the CPU: the small
//! F32 ones take the launches over many tensors (`multi.rs`), the others
//! their own; every state compared bit for bit, and the step outcomes.

use crate::optim::{parts, quantize, same_step, weights, WeightKind};
use crate::util::{same, to_dev, Rng};
use amp::optim::{AdamWConfig, Grad, Grads, LowBitAdamW, LowBitAdamWConfig, StateFormat};
use anyhow::Result;
use candle_core::{Device, Tensor};

/// Sizes around the batch's limits (1, a tail, 4 element blocks of 2048,
/// one past them), a large F32 one, and an FP16 weight with an E4M3
/// gradient among them; both moment formats; three steps, a fourth whose
/// gradient holds a NaN (skipped: every batched state and counter put
/// back), a fifth, and one without gradients.
pub fn check(dev: &Device, rng: &mut Rng) -> Result<bool> {
    let params: [(usize, WeightKind, bool); 8] = [
        (1, WeightKind::F32, false),
        (7, WeightKind::F32, false),
        (1024, WeightKind::F32, false),
        (3001, WeightKind::F32, false),
        (8192, WeightKind::F32, false),
        (8193, WeightKind::F32, false),
        (41107, WeightKind::F32, false),
        (5000, WeightKind::F16, true),
    ];
    let mut ok = true;
    for (mf, vf) in [
        (StateFormat::E4M3, StateFormat::F16),
        (StateFormat::F32, StateFormat::F32),
    ] {
        let (mut on_cpu, mut on_gpu) = (Vec::new(), Vec::new());
        for (i, &(n, kind, _)) in params.iter().enumerate() {
            let w = (Tensor::from_vec(rng.normal(n), n, &Device::Cpu)? * 0.05)?;
            let (c, g) = weights(kind, &w, dev)?;
            on_cpu.push((format!("p{i}"), c));
            on_gpu.push((format!("p{i}"), g));
        }
        let cfg = LowBitAdamWConfig {
            adam: AdamWConfig {
                lr: 1e-2,
                weight_decay: 0.1,
                ..Default::default()
            },
            exp_avg: mf,
            exp_avg_sq: vf,
            max_grad_norm: Some(1.0),
            ..Default::default()
        };
        let slots: Vec<_> = on_cpu
            .iter()
            .zip(&on_gpu)
            .map(|(c, g)| (c.1.clone(), g.1.clone()))
            .collect();
        let mut cpu = LowBitAdamW::new(on_cpu, cfg)?;
        let mut gpu = LowBitAdamW::new(on_gpu, cfg)?;
        let mut case_ok = true;
        for step in 0..5 {
            let (mut a, mut b) = (Grads::new(), Grads::new());
            for (i, &(n, _, g8)) in params.iter().enumerate() {
                let mut g = rng.normal(n);
                if step == 3 && i == 2 {
                    g[5] = f32::NAN;
                }
                let g = Tensor::from_vec(g, n, &Device::Cpu)?;
                let (gc, gg) = if g8 {
                    let q = quantize(&g, amp::QType::E4M3)?;
                    (Grad::Scaled(q.clone()), Grad::Scaled(to_dev(&q, dev)?))
                } else {
                    (Grad::F32(g.clone()), Grad::F32(g.to_device(dev)?))
                };
                a.insert(format!("p{i}"), gc);
                b.insert(format!("p{i}"), gg);
            }
            let (oc, og) = (cpu.step(&a)?, gpu.step(&b)?);
            case_ok &= same_step(&format!("many params step {step}"), &oc, &og, &cpu, &gpu);
            for (i, (cs, gs)) in slots.iter().enumerate() {
                let (pc, pg) = (parts(&cpu, i, cs)?, parts(&gpu, i, gs)?);
                case_ok &= pc.len() == pg.len();
                for (j, (x, y)) in pg.iter().zip(&pc).enumerate() {
                    case_ok &= same(&format!("many params step {step} p{i} part {j}"), x, y)?;
                }
            }
        }
        // a step without gradients: nothing to sum, the same outcome
        let (oc, og) = (cpu.step(&Grads::new())?, gpu.step(&Grads::new())?);
        if format!("{oc:?}") != format!("{og:?}") {
            println!("  many params, no gradients: outcome cuda {og:?} cpu {oc:?}");
            case_ok = false;
        }
        println!(
            "  {} parameters in one optimizer, m {mf:?} v {vf:?}, 5 steps (the fourth skipped) and one without gradients: {}",
            params.len(),
            if case_ok { "identical" } else { "DIFFERENT" }
        );
        ok &= case_ok;
    }
    Ok(ok)
}
