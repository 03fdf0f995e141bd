//! The fused low-bit AdamW step and the gradient sum of squares on the
//! device against the CPU: the same optimizer, weights, gradients and
//! steps on both, every output compared bit for bit.

use crate::util::{same, to_dev, Rng};
use amp::optim::{
    AdamWConfig, Grad, Grads, LowBitAdamW, LowBitAdamWConfig, State, StateFormat, StepOutcome,
};
use amp::{CurrentScaling, QType, ScalingTensor, Weight, WeightSlot};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, Var};

test_device!(step_grid, step_grid_cuda);
test_device!(step_one_block, step_one_block_cuda);
test_device!(sum_of_squares, sum_of_squares_cuda);
test_device!(many_params, many_params_cuda);
test_device!(many_large, many_large_cuda);
test_device!(
    outcome_readback,
    outcome_readback_cpu,
    outcome_readback_cuda
);

/// Weight storages of the levels.
#[derive(Debug, Clone, Copy)]
enum WeightKind {
    F32,
    F16,
    Fp8Master,
}

fn quantize(x: &Tensor, q: QType) -> Result<ScalingTensor> {
    Ok(ScalingTensor::quantize(x, q, &CurrentScaling::default())?.0)
}

/// The same weight on the CPU and on `dev`.
fn weights(kind: WeightKind, w: &Tensor, dev: &Device) -> Result<(WeightSlot, WeightSlot)> {
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

/// The same gradient on the CPU and on `dev`: F32, or its E4M3 cast.
fn grads(g: &Tensor, fp8: bool, dev: &Device) -> Result<(Grad, Grad)> {
    Ok(if fp8 {
        let q = quantize(g, QType::E4M3)?;
        (Grad::Scaled(q.clone()), Grad::Scaled(to_dev(&q, dev)?))
    } else {
        (Grad::F32(g.clone()), Grad::F32(g.to_device(dev)?))
    })
}

/// An F32 gradient on the CPU, and on `dev` as a view one element into
/// its buffer (not 16-byte aligned: the kernels' scalar paths).
fn unaligned(g: &Tensor, dev: &Device) -> Result<(Grad, Grad)> {
    let n = g.elem_count();
    let padded = Tensor::cat(&[&Tensor::zeros(1, DType::F32, &Device::Cpu)?, g], 0)?;
    Ok((
        Grad::F32(g.clone()),
        Grad::F32(padded.to_device(dev)?.narrow(0, 1, n)?),
    ))
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

fn state_parts(s: &State) -> Vec<Tensor> {
    match s {
        State::F32(t) => vec![t.clone()],
        State::Scaled(t) | State::Sqrt(t) => scaled_parts(t),
    }
}

/// Parameter `i`'s weight (from its slot) and moments, as tensors.
fn parts(o: &LowBitAdamW, i: usize, s: &WeightSlot) -> Result<Vec<Tensor>> {
    let mut v = weight_parts(&*s.read()?)?;
    v.extend(state_parts(&o.params()[i].exp_avg));
    v.extend(state_parts(&o.params()[i].exp_avg_sq));
    Ok(v)
}

/// Every parameter of the two optimizers, bit for bit.
fn same_params(
    what: &str,
    cpu: &LowBitAdamW,
    on_dev: &LowBitAdamW,
    slots: &[(WeightSlot, WeightSlot)],
) -> Result<bool> {
    let mut ok = true;
    for (i, (cs, ds)) in slots.iter().enumerate() {
        let (pc, pd) = (parts(cpu, i, cs)?, parts(on_dev, i, ds)?);
        ok &= pc.len() == pd.len();
        for (j, (x, y)) in pd.iter().zip(&pc).enumerate() {
            ok &= same(&format!("{what} p{i} part {j}"), x, y)?;
        }
    }
    Ok(ok)
}

/// The step counters (the optimizer's, each parameter's) and the
/// learning rate, as a skipped step must leave them.
fn counters(o: &LowBitAdamW) -> (u64, Vec<u64>, u64) {
    let steps = o.params().iter().map(|p| p.step).collect();
    (o.step_count(), steps, o.learning_rate().to_bits())
}

/// Whether both optimizers report the same outcome of one step (the norm
/// bit for bit) and left the same counters; prints what differs.
fn same_step(
    what: &str,
    oc: &StepOutcome,
    od: &StepOutcome,
    cpu: &LowBitAdamW,
    on_dev: &LowBitAdamW,
) -> bool {
    let mut ok = true;
    if format!("{oc:?}") != format!("{od:?}") {
        println!("  {what}: outcome device {od:?} cpu {oc:?}");
        ok = false;
    }
    if counters(cpu) != counters(on_dev) {
        println!(
            "  {what}: counters device {:?} cpu {:?}",
            counters(on_dev),
            counters(cpu)
        );
        ok = false;
    }
    ok
}

/// The optimizer's outcome read ([`amp::cuda::HostReadback`]): values of any
/// length, the host slot grown and reused, a read queued before more work
/// on the stream, a second queue replacing a first, no read twice.
fn outcome_readback(dev: &Device) -> Result<()> {
    let mut slot = amp::cuda::HostReadback::default();
    for n in [2usize, 7, 3, 1000] {
        let want: Vec<f64> = (0..n).map(|i| i as f64 * 0.25 - 1.5 + n as f64).collect();
        // the values come from work still running when the copy is queued
        // (a wait that returned early would read the last values)
        let k = if dev.is_cuda() { 2048 } else { 64 };
        let x = (Tensor::ones((k, k), DType::F32, dev)? * 1e-3)?;
        let busy = x.matmul(&x)?.matmul(&x)?.matmul(&x)?.sum_all()?;
        let zero = (busy.to_dtype(DType::F64)? * 0.0)?;
        let t = Tensor::new(want.as_slice(), dev)?.broadcast_add(&zero)?;
        slot.queue(&t)?;
        drop(t);
        // work queued after the copy does not change what it read
        let _more = x.matmul(&x)?;
        ensure!(slot.wait()? == want, "read of {n} values");
        ensure!(slot.wait().is_err(), "a second wait without a queue");
    }
    slot.queue(&Tensor::zeros(0, DType::F64, dev)?)?;
    ensure!(slot.wait()?.is_empty(), "no values");
    slot.queue(&Tensor::new(&[1.0f64, 2.0], dev)?)?;
    slot.queue(&Tensor::new(&[[3.0f64], [4.0]], dev)?)?;
    ensure!(slot.wait()? == [3.0, 4.0], "the last queued read");
    ensure!(
        slot.queue(&Tensor::new(&[1.0f32], dev)?).is_err(),
        "F32 refused"
    );
    Ok(())
}

/// 41107 elements: 20 blocks of 2048 and a tail, not a multiple of 8 (the
/// two launches).
fn step_grid(dev: &Device) -> Result<()> {
    combinations(dev, &mut Rng(0x005E_ED0F_AD4A), (37, 1111))
}

/// 7777 elements: one launch of one block.
fn step_one_block(dev: &Device) -> Result<()> {
    combinations(dev, &mut Rng(0x005E_ED0F_AD4B), (7, 1111))
}

/// Every combination of weight storage, gradient storage and moment
/// formats the levels use at one shape, three steps each with clipping (so
/// the sum of squares and a gradient multiplier other than 1 are
/// exercised), a fourth whose gradient holds a NaN (skipped) and a fifth.
fn combinations(dev: &Device, rng: &mut Rng, shape: (usize, usize)) -> Result<()> {
    let n = shape.0 * shape.1;
    let mut ok = true;
    // the device's optimizer with and without the lean step (the outcome
    // read before the updates), and with the outcome left on the device
    // (`defer_outcome`): the same values every way
    let cases = [WeightKind::F32, WeightKind::F16, WeightKind::Fp8Master]
        .into_iter()
        .flat_map(|wk| [(false, false), (true, false), (false, true)].map(|(l, d)| (wk, l, d)));
    for (wk, lean, defer) in cases {
        for g8 in [false, true] {
            for (mf, vf) in [
                (StateFormat::F32, StateFormat::F32),
                (StateFormat::E4M3, StateFormat::F16),
                (StateFormat::E4M3, StateFormat::E4M3Sqrt),
            ] {
                let what = format!(
                    "lowbit {wk:?} grad {} m {mf:?} v {vf:?}{}",
                    if g8 { "E4M3" } else { "F32" },
                    if lean {
                        " lean"
                    } else if defer {
                        " deferred"
                    } else {
                        ""
                    }
                );
                let w0 = Tensor::from_vec(rng.normal(n), shape, &Device::Cpu)?;
                let slots = [weights(wk, &(w0 * 0.05)?, dev)?];
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
                let mut cpu = LowBitAdamW::new(vec![("w".into(), slots[0].0.clone())], cfg)?;
                let dev_cfg = LowBitAdamWConfig {
                    lean_step: lean,
                    defer_outcome: defer,
                    ..cfg
                };
                let mut on_dev = LowBitAdamW::new(vec![("w".into(), slots[0].1.clone())], dev_cfg)?;
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
                    let (gc, gd) = grads(&Tensor::from_vec(g, shape, &Device::Cpu)?, g8, dev)?;
                    let (mut a, mut b) = (Grads::new(), Grads::new());
                    a.insert("w", gc);
                    b.insert("w", gd);
                    let (oc, od) = (cpu.step(&a)?, on_dev.step(&b)?);
                    let step_what = format!("{what} step {step}");
                    if !defer {
                        case_ok &= same_step(&step_what, &oc, &od, &cpu, &on_dev);
                        case_ok &= same_params(&step_what, &cpu, &on_dev, &slots)?;
                        continue;
                    }
                    // deferred: pending, the states already right on the
                    // device (a skipped step's put back) before the host
                    // reads the outcome; read here after even steps, by
                    // the next step itself after odd ones (the skipped
                    // fourth among them), the counters compared once read
                    case_ok &= matches!(od, StepOutcome::Pending);
                    case_ok &= same_params(&step_what, &cpu, &on_dev, &slots)?;
                    if step % 2 == 0 {
                        let od = on_dev.resolve()?.unwrap_or(StepOutcome::Pending);
                        case_ok &= same_step(&step_what, &oc, &od, &cpu, &on_dev);
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
    ensure!(ok, "low-bit AdamW steps differ (see the lines above)");
    Ok(())
}

/// The sum of squares over several groups of 256 blocks (the step tests
/// have one): 4 groups and a partial block, F32 and E4M3 gradients, and
/// 258 groups (sumsq_total over more than one tile), E4M3; then fewer
/// elements than a vector group, and an F32 gradient that is a view one
/// element into its buffer (not 16-byte aligned: the scalar paths). The
/// step outcome carries the f64 norm, compared bit for bit.
fn sum_of_squares(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x5A5A_0001);
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
        let (cpu_slot, dev_slot) = weights(WeightKind::F16, &w, dev)?;
        let cfg = LowBitAdamWConfig {
            max_grad_norm: Some(1.0),
            ..Default::default()
        };
        let mut cpu = LowBitAdamW::new(vec![("w".into(), cpu_slot)], cfg)?;
        let mut on_dev = LowBitAdamW::new(vec![("w".into(), dev_slot)], cfg)?;
        let g = Tensor::from_vec(rng.normal(n), n, &Device::Cpu)?;
        let (gc, gd) = if offset {
            unaligned(&g, dev)?
        } else {
            grads(&g, g8, dev)?
        };
        let (mut a, mut b) = (Grads::new(), Grads::new());
        a.insert("w", gc);
        b.insert("w", gd);
        let (oc, od) = (cpu.step(&a)?, on_dev.step(&b)?);
        let same_norm = format!("{oc:?}") == format!("{od:?}");
        println!(
            "  sum of squares over {n} elements ({} grad{}): device {od:?} cpu {oc:?}: {}",
            if g8 { "E4M3" } else { "F32" },
            if offset { ", unaligned view" } else { "" },
            if same_norm { "identical" } else { "DIFFERENT" }
        );
        ok &= same_norm;
    }
    ensure!(ok, "sums of squares differ (see the lines above)");
    Ok(())
}

/// Many large gradients in one optimizer, whose sums of squares take two
/// launches for all of a kind: gradients of one CUDA block of partials
/// (one element block, several), of one group, of several groups (a
/// counter each), E4M3 and F32 (one of them
/// an unaligned view) interleaved. Each step's norm and every updated
/// state bit for bit; in the third step one gradient holds an inf (the
/// step skipped on both).
fn many_large(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x3A17_0002);
    let params: [(usize, bool, bool); 9] = [
        (3 * 256 * 2048 + 5 * 2048 + 1001, true, false),
        (9000, false, false),
        (2048, true, false),
        (8193, true, false),
        (257 * 2048 + 11, false, true),
        (100, true, false),
        (600 * 2048 + 7, true, false),
        (5 * 256 * 2048 + 3, true, false),
        (70_001, false, false),
    ];
    let mut slots = Vec::new();
    for &(n, _, _) in &params {
        let w = (Tensor::from_vec(rng.normal(n), n, &Device::Cpu)? * 0.05)?;
        slots.push(weights(WeightKind::F16, &w, dev)?);
    }
    let named = |dev_side: bool| -> Vec<(String, WeightSlot)> {
        slots
            .iter()
            .enumerate()
            .map(|(i, s)| {
                (
                    format!("p{i}"),
                    if dev_side { s.1.clone() } else { s.0.clone() },
                )
            })
            .collect()
    };
    let cfg = LowBitAdamWConfig {
        max_grad_norm: Some(1.0),
        ..Default::default()
    };
    let mut cpu = LowBitAdamW::new(named(false), cfg)?;
    let mut on_dev = LowBitAdamW::new(named(true), cfg)?;
    let mut ok = true;
    for step in 0..4 {
        let (mut a, mut b) = (Grads::new(), Grads::new());
        for (i, &(n, g8, offset)) in params.iter().enumerate() {
            let mut g = rng.normal(n);
            if step == 2 && i == 6 {
                g[n - 2] = f32::INFINITY;
            }
            let g = Tensor::from_vec(g, n, &Device::Cpu)?;
            let (gc, gd) = if offset {
                unaligned(&g, dev)?
            } else {
                grads(&g, g8, dev)?
            };
            a.insert(format!("p{i}"), gc);
            b.insert(format!("p{i}"), gd);
        }
        let (oc, od) = (cpu.step(&a)?, on_dev.step(&b)?);
        let what = format!("many large step {step}");
        ok &= same_step(&what, &oc, &od, &cpu, &on_dev);
        ok &= same_params(&what, &cpu, &on_dev, &slots)?;
        if step == 2 {
            ok &= matches!(od, StepOutcome::Skipped);
        }
    }
    println!(
        "  {} large gradients in one optimizer: {}",
        params.len(),
        if ok { "identical" } else { "DIFFERENT" }
    );
    ensure!(ok, "many large gradients differ (see the lines above)");
    Ok(())
}

/// Many parameters in one optimizer: the small F32 ones take the launches
/// over many tensors, the others their own. Sizes around the batch's
/// limits (1, a tail, 4 element blocks of 2048, one past them), a large F32
/// one, and an FP16 weight with an E4M3 gradient among them; both moment
/// formats; three steps, a fourth whose gradient holds a NaN (skipped:
/// every batched state and counter put back), a fifth, and one without
/// gradients.
fn many_params(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x3A17_0001);
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
        (StateFormat::E4M3, StateFormat::E4M3Sqrt),
    ] {
        let mut slots = Vec::new();
        for &(n, kind, _) in &params {
            let w = (Tensor::from_vec(rng.normal(n), n, &Device::Cpu)? * 0.05)?;
            slots.push(weights(kind, &w, dev)?);
        }
        let named = |dev_side: bool| -> Vec<(String, WeightSlot)> {
            let pick =
                |s: &(WeightSlot, WeightSlot)| if dev_side { s.1.clone() } else { s.0.clone() };
            slots
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("p{i}"), pick(s)))
                .collect()
        };
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
        let mut cpu = LowBitAdamW::new(named(false), cfg)?;
        // the lean step with the 16-bit moments (the outcome read first),
        // the outcome left on the device with the others
        let lean = vf == StateFormat::F16;
        let dev_cfg = LowBitAdamWConfig {
            lean_step: lean,
            defer_outcome: !lean,
            ..cfg
        };
        let mut on_dev = LowBitAdamW::new(named(true), dev_cfg)?;
        let mut case_ok = true;
        for step in 0..5 {
            let (mut a, mut b) = (Grads::new(), Grads::new());
            for (i, &(n, _, g8)) in params.iter().enumerate() {
                let mut g = rng.normal(n);
                if step == 3 && i == 2 {
                    g[5] = f32::NAN;
                }
                let (gc, gd) = grads(&Tensor::from_vec(g, n, &Device::Cpu)?, g8, dev)?;
                a.insert(format!("p{i}"), gc);
                b.insert(format!("p{i}"), gd);
            }
            let (oc, od) = (cpu.step(&a)?, on_dev.step(&b)?);
            let what = format!("many params step {step}");
            case_ok &= same_params(&what, &cpu, &on_dev, &slots)?;
            // deferred: pending, read after even steps (see combinations)
            let od = match od {
                StepOutcome::Pending if step % 2 == 1 => continue,
                StepOutcome::Pending => on_dev.resolve()?.unwrap_or(StepOutcome::Pending),
                od => od,
            };
            case_ok &= same_step(&what, &oc, &od, &cpu, &on_dev);
        }
        // a step without gradients: nothing to sum, the same outcome
        let (oc, od) = (cpu.step(&Grads::new())?, on_dev.step(&Grads::new())?);
        if format!("{oc:?}") != format!("{od:?}") {
            println!("  many params, no gradients: outcome device {od:?} cpu {oc:?}");
            case_ok = false;
        }
        println!(
            "  {} parameters in one optimizer, m {mf:?} v {vf:?}: {}",
            params.len(),
            if case_ok { "identical" } else { "DIFFERENT" }
        );
        ok &= case_ok;
    }
    ensure!(ok, "many-parameter steps differ (see the lines above)");
    Ok(())
}
