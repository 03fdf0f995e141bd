//! The fused low-bit AdamW step's time over its bandwidth floor. Its
//! checks against the CPU (every output bit for bit) are tests
//! (`tests/gpu/optim.rs`).

use crate::util::Rng;
use amp::optim::{Grad, Grads, LowBitAdamW, LowBitAdamWConfig};
use amp::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use anyhow::Result;
use candle_core::{Device, Tensor};
use std::time::Instant;

fn quantize(x: &Tensor, q: QType) -> Result<ScalingTensor> {
    Ok(ScalingTensor::quantize(x, q, &CurrentScaling::default())?.0)
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
    amp::cuda::keep_freed_memory(dev)?;
    // SAFETY: everything here runs on the device's one stream.
    let untracked = unsafe { amp::cuda::skip_event_tracking(dev)? };
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
