//! The fused low-bit AdamW step and the gradient sum of squares on the GPU
//! against the CPU: the same optimizer, weights, gradients and steps on both
//! devices, every output compared bit for bit; and the step's time over its
//! bandwidth floor.

use crate::util::{same, to_dev, Rng};
use amp::optim::{
    AdamWConfig, Grad, Grads, LowBitAdamW, LowBitAdamWConfig, State, StateFormat, StepOutcome,
};
use amp::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use std::time::Instant;

/// Weight storages of the levels.
#[derive(Debug, Clone, Copy)]
pub enum WeightKind {
    F32,
    F16,
    Fp8Master,
}

pub fn quantize(x: &Tensor, q: QType) -> Result<ScalingTensor> {
    Ok(ScalingTensor::quantize(x, q, &CurrentScaling::default())?.0)
}

/// The same weight on the CPU and on `dev`.
pub fn weights(kind: WeightKind, w: &Tensor, dev: &Device) -> Result<(WeightSlot, WeightSlot)> {
    Ok(match kind {
        WeightKind::F32 => (
            WeightSlot::new(Weight::F32(Var::from_tensor(w)?)),
            WeightSlot::new(Weight::F32(Var::from_tensor(&w.to_device(dev)?)?)),
        ),
        WeightKind::F16 => {
            let t = quantize(w, QType::F16)?;
            (
                WeightSlot::new(Weight::F16(t.clone())),
                WeightSlot::new(Weight::F16(to_dev(&t, dev)?)),
            )
        }
        WeightKind::Fp8Master => {
            let master = quantize(w, QType::F16)?;
            let weight = quantize(w, QType::E4M3)?;
            (
                WeightSlot::new(Weight::Fp8 {
                    weight: weight.clone(),
                    master: master.clone(),
                }),
                WeightSlot::new(Weight::Fp8 {
                    weight: to_dev(&weight, dev)?,
                    master: to_dev(&master, dev)?,
                }),
            )
        }
    })
}

fn scaled_parts(t: &ScalingTensor) -> Vec<Tensor> {
    vec![
        t.data().clone(),
        t.meta().scale().clone(),
        t.meta().scale_inv().clone(),
        t.meta().amax_history().clone(),
    ]
}

fn weight_parts(w: &Weight) -> Result<Vec<Tensor>> {
    Ok(match w {
        Weight::F32(v) => vec![v.as_tensor().clone()],
        Weight::F16(t) => scaled_parts(t),
        Weight::Fp8 { weight, master } => {
            let mut v = scaled_parts(weight);
            v.extend(scaled_parts(master));
            v
        }
        Weight::Fp8Gathered(t) => scaled_parts(t),
    })
}

/// The step counters (the optimizer's, each parameter's) and the
/// learning rate, as a skipped step must leave them.
fn counters(o: &LowBitAdamW) -> (u64, Vec<u64>, u64) {
    let steps = o.params().iter().map(|p| p.step).collect();
    (o.step_count(), steps, o.learning_rate().to_bits())
}

/// Whether both optimizers report the same outcome of one step (the norm
/// bit for bit) and left the same counters; prints what differs.
pub fn same_step(
    what: &str,
    oc: &StepOutcome,
    og: &StepOutcome,
    cpu: &LowBitAdamW,
    gpu: &LowBitAdamW,
) -> bool {
    let mut ok = true;
    if format!("{oc:?}") != format!("{og:?}") {
        println!("  {what}: outcome cuda {og:?} cpu {oc:?}");
        ok = false;
    }
    if counters(cpu) != counters(gpu) {
        println!(
            "  {what}: counters cuda {:?} cpu {:?}",
            counters(gpu),
            counters(cpu)
        );
        ok = false;
    }
    ok
}

/// Parameter `i`'s weight (from its slot) and moments, as tensors.
pub fn parts(o: &LowBitAdamW, i: usize, s: &WeightSlot) -> Result<Vec<Tensor>> {
    let mut v = weight_parts(&*s.read()?)?;
    v.extend(state_parts(&o.params()[i].exp_avg));
    v.extend(state_parts(&o.params()[i].exp_avg_sq));
    Ok(v)
}

fn state_parts(s: &State) -> Vec<Tensor> {
    match s {
        State::F32(t) => vec![t.clone()],
        State::Scaled(t) => scaled_parts(t),
    }
}

/// Every combination of weight storage, gradient storage and moment formats
/// the levels use, three steps each with clipping (so the sum of squares
/// and a gradient multiplier other than 1 are exercised), a fourth whose
/// gradient holds a NaN (skipped) and a fifth.
pub fn check(dev: &Device) -> Result<bool> {
    let mut rng = Rng(0x005E_ED0F_AD4A);
    let mut ok = true;
    // 41107 elements: 20 blocks of 2048 and a tail, not a multiple of 8 (the
    // two launches); 7777: one launch of one block
    for shape in [(37usize, 1111usize), (7, 1111)] {
        ok &= combinations(dev, &mut rng, shape)?;
    }
    ok &= many_groups(dev, &mut rng)?;
    ok &= crate::optim_many::check(dev, &mut rng)?;
    Ok(ok)
}

/// Every combination at one shape.
fn combinations(dev: &Device, rng: &mut Rng, shape: (usize, usize)) -> Result<bool> {
    let n = shape.0 * shape.1;
    let mut ok = true;
    for wk in [WeightKind::F32, WeightKind::F16, WeightKind::Fp8Master] {
        for g8 in [false, true] {
            for (mf, vf) in [
                (StateFormat::F32, StateFormat::F32),
                (StateFormat::E4M3, StateFormat::F16),
            ] {
                let what = format!(
                    "lowbit {wk:?} grad {} m {mf:?} v {vf:?}",
                    if g8 { "E4M3" } else { "F32" }
                );
                let w0 = Tensor::from_vec(rng.normal(n), shape, &Device::Cpu)?;
                let (cpu_slot, gpu_slot) = weights(wk, &(w0 * 0.05)?, dev)?;
                let cfg = LowBitAdamWConfig {
                    adam: AdamWConfig {
                        lr: 1e-2,
                        weight_decay: 0.1,
                        beta2: 0.95,
                        ..Default::default()
                    },
                    exp_avg: mf,
                    exp_avg_sq: vf,
                    max_grad_norm: Some(1.0),
                    ..Default::default()
                };
                let mut cpu = LowBitAdamW::new(vec![("w".into(), cpu_slot.clone())], cfg)?;
                let mut gpu = LowBitAdamW::new(vec![("w".into(), gpu_slot.clone())], cfg)?;
                let mut case_ok = true;
                // the fourth step's gradient holds a NaN: both skip it, and
                // on the GPU (the outcome read after the update is enqueued)
                // every state is put back, the in-place F32 weight untouched,
                // and the counters too (the fifth step shows them)
                for step in 0..5 {
                    let mut g = rng.normal(n);
                    if step == 3 {
                        g[n / 2] = f32::NAN;
                    }
                    let g = Tensor::from_vec(g, shape, &Device::Cpu)?;
                    let (gc, gg) = if g8 {
                        let q = quantize(&g, QType::E4M3)?;
                        (Grad::Scaled(q.clone()), Grad::Scaled(to_dev(&q, dev)?))
                    } else {
                        (Grad::F32(g.clone()), Grad::F32(g.to_device(dev)?))
                    };
                    let (mut a, mut b) = (Grads::new(), Grads::new());
                    a.insert("w", gc);
                    b.insert("w", gg);
                    let (oc, og) = (cpu.step(&a)?, gpu.step(&b)?);
                    let step_what = format!("{what} step {step}");
                    case_ok &= same_step(&step_what, &oc, &og, &cpu, &gpu);
                    let (pg, pc) = (parts(&gpu, 0, &gpu_slot)?, parts(&cpu, 0, &cpu_slot)?);
                    case_ok &= pg.len() == pc.len();
                    for (i, (x, y)) in pg.iter().zip(&pc).enumerate() {
                        case_ok &= same(&format!("{what} step {step} part {i}"), x, y)?;
                    }
                }
                println!(
                    "  {what} ({n} elements): {}",
                    if case_ok { "identical" } else { "DIFFERENT" }
                );
                ok &= case_ok;
            }
        }
    }
    Ok(ok)
}

/// The sum of squares over several groups of 256 blocks (the check above
/// has one): 4 groups and a partial block, F32 and E4M3 gradients, and 258
/// groups (sumsq_total over more than one tile), E4M3; then
/// fewer elements than a vector group, and an F32 gradient that is a view
/// one element into its buffer (not 16-byte aligned: the scalar paths).
/// The step outcome carries the f64 norm, compared bit for bit.
fn many_groups(dev: &Device, rng: &mut Rng) -> Result<bool> {
    let big = 3 * 256 * 2048 + 5 * 2048 + 1001;
    // more than 256 groups: sumsq_total adds more than one tile of them
    let huge = 257 * 256 * 2048 + 3;
    let mut ok = true;
    for (n, g8, offset) in [
        (big, false, false),
        (big, true, false),
        (huge, true, false),
        (3, false, false),
        (3, true, false),
        (4099, false, true),
    ] {
        let w = (Tensor::from_vec(rng.normal(n), n, &Device::Cpu)? * 0.05)?;
        let (cpu_slot, gpu_slot) = weights(WeightKind::F16, &w, dev)?;
        let cfg = LowBitAdamWConfig {
            max_grad_norm: Some(1.0),
            ..Default::default()
        };
        let mut cpu = LowBitAdamW::new(vec![("w".into(), cpu_slot)], cfg)?;
        let mut gpu = LowBitAdamW::new(vec![("w".into(), gpu_slot)], cfg)?;
        let g = Tensor::from_vec(rng.normal(n), n, &Device::Cpu)?;
        let (gc, gg) = if g8 {
            let q = quantize(&g, QType::E4M3)?;
            (Grad::Scaled(q.clone()), Grad::Scaled(to_dev(&q, dev)?))
        } else if offset {
            let padded = Tensor::cat(&[&Tensor::zeros(1, DType::F32, &Device::Cpu)?, &g], 0)?;
            (
                Grad::F32(g.clone()),
                Grad::F32(padded.to_device(dev)?.narrow(0, 1, n)?),
            )
        } else {
            (Grad::F32(g.clone()), Grad::F32(g.to_device(dev)?))
        };
        let (mut a, mut b) = (Grads::new(), Grads::new());
        a.insert("w", gc);
        b.insert("w", gg);
        let (oc, og) = (cpu.step(&a)?, gpu.step(&b)?);
        let same_norm = format!("{oc:?}") == format!("{og:?}");
        println!(
            "  sum of squares over {n} elements ({} grad{}): cuda {og:?} cpu {oc:?}: {}",
            if g8 { "E4M3" } else { "F32" },
            if offset { ", unaligned view" } else { "" },
            if same_norm { "identical" } else { "DIFFERENT" }
        );
        ok &= same_norm;
    }
    Ok(ok)
}

/// Step time of one O2 parameter (FP16 weight, E4M3 gradient, E4M3 m, FP16
/// v) of `n` elements over the bandwidth floor: 11 bytes a parameter (read
/// 2 + 1 + 1 + 2, write 2 + 1 + 2) at the device-to-device copy bandwidth
/// measured here, and 12 with the gradient's second read that clipping
/// needs (the global norm before any update). The step includes the sum of
/// squares, the clipping kernel and the read of the step's outcome. As in
/// the GPT example's single-GPU runs, freed memory stays pooled and the
/// tensors made here carry no cross-stream events (one stream).
pub fn bench(dev: &Device) -> Result<bool> {
    // freed blocks stay pooled: no timed call maps fresh memory
    amp::keep_freed_memory(dev)?;
    // SAFETY: everything here runs on the device's one stream.
    let untracked = unsafe { amp::skip_event_tracking(dev)? };
    let n = 64usize << 20;
    let mut rng = Rng(7);
    let w = (Tensor::from_vec(rng.normal(n), n, &Device::Cpu)? * 0.05)?.to_device(dev)?;
    let slot = WeightSlot::new(Weight::F16(quantize(&w, QType::F16)?));
    let cfg = LowBitAdamWConfig {
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let mut opt = LowBitAdamW::new(vec![("w".into(), slot)], cfg)?;
    let g = quantize(
        &Tensor::from_vec(rng.normal(n), n, &Device::Cpu)?.to_device(dev)?,
        QType::E4M3,
    )?;
    let mut grads = Grads::new();
    grads.insert("w", Grad::Scaled(g));
    // the median of 40 synchronized runs after 5
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let mut ts = Vec::new();
        for i in 0..45 {
            dev.synchronize()?;
            let t = Instant::now();
            f()?;
            dev.synchronize()?;
            if i >= 5 {
                ts.push(t.elapsed().as_secs_f64());
            }
        }
        ts.sort_by(f64::total_cmp);
        Ok(ts[ts.len() / 2])
    };
    let step = time(&mut || {
        opt.step(&grads)?;
        Ok(())
    })?;
    // The step queued behind other work, as in training (the host enqueues
    // it while the GPU still runs the backward pass): a 256 MiB copy ahead
    // of it (about 0.18 ms, several times the host's time from the step's
    // call to its first launch), less that copy alone. What is left is the
    // step's GPU time and the read of its outcome.
    let lead = Tensor::zeros(64usize << 20, candle_core::DType::F32, dev)?;
    let alone = time(&mut || {
        let _c = lead.copy()?;
        Ok(())
    })?;
    let behind = time(&mut || {
        let _c = lead.copy()?;
        opt.step(&grads)?;
        Ok(())
    })?;
    let queued = behind - alone;
    // copy bandwidth: 1 GiB read + 1 GiB written
    let big = Tensor::zeros(256usize << 20, candle_core::DType::F32, dev)?;
    let copy = time(&mut || {
        let _c = big.copy()?;
        Ok(())
    })?;
    let copy_bw = 2.0 * (1u64 << 30) as f64 / copy;
    let floor = 11.0 * n as f64 / copy_bw;
    let floor12 = 12.0 * n as f64 / copy_bw;
    println!(
        "BENCH lowbit adamw O2 step n={n}: {:.3} ms; copy bandwidth {:.0} GB/s; floor (11 B/param) {:.3} ms; step/floor {:.2}; with the clipping read (12 B/param) {:.3} ms, step/floor {:.2}; event tracking {}",
        step * 1e3,
        copy_bw / 1e9,
        floor * 1e3,
        step / floor,
        floor12 * 1e3,
        step / floor12,
        if untracked { "off" } else { "unchanged (already off, or several streams)" }
    );
    println!(
        "BENCH lowbit adamw O2 step queued behind a copy: {:.3} ms ({:.3} with the copy, {:.3} alone); over the 11 B floor {:.2}, the 12 B floor {:.2}",
        queued * 1e3,
        behind * 1e3,
        alone * 1e3,
        queued / floor,
        queued / floor12
    );
    Ok(true)
}
