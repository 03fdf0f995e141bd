//! `linear_cross_entropy` over chunks of rows (`nn::set_loss_chunk_rows`):
//! one chunk gives the values of the whole logits bit for bit; several
//! agree with them and with a float64 reference to FP8 rounding; the
//! loss's incoming gradient scales both of the head's gradients; a loss
//! whose head has no tracked input or weight takes no gradient at all.

use crate::common;

use amp::nn::{self, fp8_autocast, set_loss_chunk_rows, ComputeMode, GradSink};
use candle_core::{DType, Device, Tensor, Var};
use common::{modes, randt, values};

/// The per-tensor FP8 modes (the chunked path's).
fn fp8_modes() -> Vec<ComputeMode> {
    modes()
        .into_iter()
        .filter(|m| matches!(m, ComputeMode::Fp8Current(_) | ComputeMode::Fp8Delayed(_)))
        .collect()
}

/// Targets of `rows` tokens (`[2, rows / 2]`) of a `vocab`-word vocabulary.
fn targets(rows: usize, vocab: usize) -> Tensor {
    Tensor::from_vec(
        (0..rows as u32)
            .map(|i| (i * 7 + 3) % vocab as u32)
            .collect(),
        (2, rows / 2),
        &Device::Cpu,
    )
    .unwrap()
}

/// A LayerNorm (weight, bias Vars) and a head (`[vocab, d]` Var, no
/// bias), its gradient to a sink or to the GradStore.
struct Head {
    ln: nn::LayerNorm,
    ln_vars: [Var; 2],
    head: nn::Linear,
    w: Var,
    sink: GradSink,
}

fn head(tag: &str, d: usize, vocab: usize, with_sink: bool) -> Head {
    let ln_w = Var::from_tensor(&randt(&[d], 1, 0.3).affine(1.0, 1.0).unwrap()).unwrap();
    let ln_b = Var::from_tensor(&randt(&[d], 2, 0.1)).unwrap();
    let ln = nn::LayerNorm::new(ln_w.as_tensor().clone(), ln_b.as_tensor().clone(), 1e-5).unwrap();
    let w = Var::from_tensor(&randt(&[vocab, d], 11, 0.3)).unwrap();
    let head = nn::Linear::new(format!("{tag}.weight"), w.as_tensor().clone(), None).unwrap();
    let sink = GradSink::new();
    if with_sink {
        head.set_grad_sink(Some(sink.clone())).unwrap();
    }
    Head {
        ln,
        ln_vars: [ln_w, ln_b],
        head,
        w,
        sink,
    }
}

/// Loss and gradients of `linear_cross_entropy(h, ln, head)` with logits
/// chunked at `chunk` rows (0: off), `scale` times the loss
/// backpropagated: `[loss, dh, dln_w, dln_b, dw]` (dw from the sink or
/// the GradStore).
fn run(m: &Head, h: &Var, t: &Tensor, chunk: usize, scale: f64) -> Vec<Vec<f32>> {
    set_loss_chunk_rows(chunk);
    let loss = nn::linear_cross_entropy(h.as_tensor(), Some(&m.ln), &m.head, t).unwrap();
    set_loss_chunk_rows(nn::DEFAULT_LOSS_CHUNK_ROWS);
    let g = loss.affine(scale, 0.0).unwrap().backward().unwrap();
    assert_path(&loss, chunk);
    let grad = |v: &Var| values(g.get(v.as_tensor()).expect("a gradient"));
    let dw = match m.sink.take().unwrap().into_values().next() {
        Some(q) => values(&q.dequantize(DType::F32).unwrap()),
        None => grad(&m.w),
    };
    vec![
        values(&loss),
        grad(h),
        grad(&m.ln_vars[0]),
        grad(&m.ln_vars[1]),
        dw,
    ]
}

/// Which path ran (see `common::head_path_ran`).
fn assert_path(loss: &Tensor, chunk: usize) {
    if let Err(e) = crate::common::head_path_ran(loss, chunk) {
        panic!("{e}");
    }
}

const PARTS: [&str; 5] = ["loss", "dh", "dln_w", "dln_b", "dw"];

/// 16 rows (a power of two: the mean's gradient too) in one chunk, under
/// current scaling: the values of the head and the loss as separate ops,
/// bit for bit, F32 and BF16, to a sink or to the GradStore (the logits'
/// gradient's cast takes the scale of its bound, which is the
/// current-scaling one here: its amax is above 7/8). Under delayed
/// scaling, where the whole logits' gradient takes its history's scale,
/// the same to FP8 rounding (within 10%), over three steps.
#[test]
fn one_chunk_equals_the_whole_logits_bit_for_bit() {
    let (d, vocab, rows) = (16, 40, 16);
    let t = targets(rows, vocab);
    for (k, mode) in fp8_modes().into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            for with_sink in [true, false] {
                let pair = [0, 1].map(|i| head(&format!("one{k}{i}"), d, vocab, with_sink));
                for step in 0..3u64 {
                    let what = format!("{mode:?} {dtype:?} sink {with_sink} step {step}");
                    let h = Var::from_tensor(
                        &randt(&[2, rows / 2, d], 100 + step, 1.5)
                            .to_dtype(dtype)
                            .unwrap(),
                    )
                    .unwrap();
                    let _s = fp8_autocast(true, mode.clone());
                    // 16 rows a chunk: one chunk
                    let chunked = run(&pair[0], &h, &t, 16, 1.0);
                    let whole = run(&pair[1], &h, &t, 0, 1.0);
                    let delayed = matches!(mode, ComputeMode::Fp8Delayed(_));
                    assert_eq!(chunked[0], whole[0], "{what}: loss");
                    for (i, name) in PARTS.iter().enumerate().skip(1) {
                        if delayed {
                            let e = rel(
                                &chunked[i],
                                &whole[i].iter().map(|v| *v as f64).collect::<Vec<_>>(),
                            );
                            assert!(e < 0.1, "{what}: {name} relative difference {e}");
                        } else {
                            assert_eq!(chunked[i], whole[i], "{what}: {name}");
                        }
                    }
                }
            }
        }
    }
}

/// `|a - b| / |b|` over all elements.
fn rel(a: &[f32], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// The mean cross-entropy of `x [rows, d] · wᵀ` and its gradients for `x`
/// and `w`, in float64.
fn reference(x: &[f32], w: &[f32], t: &[u32], d: usize, vocab: usize) -> [Vec<f64>; 3] {
    let rows = t.len();
    let (mut loss, mut dx, mut dw) = (0.0, vec![0.0; rows * d], vec![0.0; vocab * d]);
    for r in 0..rows {
        let z: Vec<f64> = (0..vocab)
            .map(|c| {
                (0..d)
                    .map(|i| x[r * d + i] as f64 * w[c * d + i] as f64)
                    .sum()
            })
            .collect();
        let max = z.iter().cloned().fold(f64::MIN, f64::max);
        let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
        loss += (lse - z[t[r] as usize]) / rows as f64;
        for c in 0..vocab {
            let g = ((z[c] - lse).exp() - f64::from(c == t[r] as usize)) / rows as f64;
            for i in 0..d {
                dx[r * d + i] += g * w[c * d + i] as f64;
                dw[c * d + i] += g * x[r * d + i] as f64;
            }
        }
    }
    [vec![loss], dx, dw]
}

/// 64 rows in four chunks of 16, each with its own FP8 scale for the
/// logits' gradient: loss and gradients as close to a float64 reference
/// as the whole logits' (FP8 rounding), and the loss the same to F32
/// rounding.
#[test]
fn chunks_agree_with_the_whole_logits_and_float64() {
    let (d, vocab, rows) = (32, 48, 64);
    let t = targets(rows, vocab);
    let tv: Vec<u32> = t.flatten_all().unwrap().to_vec1().unwrap();
    for (k, mode) in fp8_modes().into_iter().enumerate() {
        let w = randt(&[vocab, d], 11, 0.3);
        let x = randt(&[2, rows / 2, d], 5, 1.5);
        let side = |i: usize, chunk: usize| {
            let wv = Var::from_tensor(&w).unwrap();
            let lin =
                nn::Linear::new(format!("ch{k}{i}.weight"), wv.as_tensor().clone(), None).unwrap();
            let sink = GradSink::new();
            lin.set_grad_sink(Some(sink.clone())).unwrap();
            let h = Var::from_tensor(&x).unwrap();
            let _s = fp8_autocast(true, mode.clone());
            set_loss_chunk_rows(chunk);
            let loss = nn::linear_cross_entropy(h.as_tensor(), None, &lin, &t).unwrap();
            set_loss_chunk_rows(nn::DEFAULT_LOSS_CHUNK_ROWS);
            let g = loss.backward().unwrap();
            assert_path(&loss, chunk);
            let dw = sink.take().unwrap().into_values().next().expect("dw");
            [
                values(&loss),
                values(g.get(h.as_tensor()).expect("dh")),
                values(&dw.dequantize(DType::F32).unwrap()),
            ]
        };
        let (chunked, whole) = (side(0, 16), side(1, 0));
        let r = reference(&values(&x), &values(&w), &tv, d, vocab);
        let what = format!("{mode:?}");
        assert!(
            (chunked[0][0] - whole[0][0]).abs() <= 1e-5 * whole[0][0].abs(),
            "{what}: loss {} against {}",
            chunked[0][0],
            whole[0][0]
        );
        for (i, name) in ["loss", "dh", "dw"].iter().enumerate() {
            let (ec, ew) = (rel(&chunked[i], &r[i]), rel(&whole[i], &r[i]));
            eprintln!("{what}: {name} relative error chunked {ec:.2e}, whole {ew:.2e}");
            assert!(
                ec < 0.1 && ec <= 1.5 * ew + 0.01,
                "{what}: {name} relative error {ec} chunked, {ew} whole"
            );
        }
    }
}

/// The loss's incoming gradient scales both of the head's gradients (the
/// forward made them for a gradient of 1), and every LayerNorm gradient
/// with them; the sink's FP8 weight gradient is cast again for it.
#[test]
fn the_incoming_gradient_scales_the_chunked_gradients() {
    let (d, vocab, rows) = (16, 40, 64);
    let t = targets(rows, vocab);
    let mode = ComputeMode::Fp8Current(Default::default());
    for with_sink in [true, false] {
        let pair = [0, 1].map(|i| head(&format!("sc{i}{with_sink}"), d, vocab, with_sink));
        let h = Var::from_tensor(&randt(&[2, rows / 2, d], 7, 1.5)).unwrap();
        let _s = fp8_autocast(true, mode.clone());
        let once = run(&pair[0], &h, &t, 16, 1.0);
        let thrice = run(&pair[1], &h, &t, 16, 3.0);
        assert_eq!(once[0], thrice[0], "the loss");
        for (i, name) in PARTS.iter().enumerate().skip(1) {
            // to F32 rounding, amplified where the LayerNorm's backward
            // cancels; the sink's FP8 gradient cast again times 3/64 (not
            // a power of two): within one E4M3 step (1/8) of each element
            let top = thrice[i].iter().fold(0f32, |m, v| m.max(v.abs()));
            let fp8 = with_sink && *name == "dw";
            for (a, b) in once[i].iter().zip(&thrice[i]) {
                let tol = if fp8 {
                    b.abs() / 8.0 + 1e-6
                } else {
                    1e-5 * top
                };
                assert!(
                    (3.0 * a - b).abs() <= tol,
                    "sink {with_sink} {name}: 3 x {a} against {b}"
                );
            }
        }
    }
}

/// Under `nn::inference` (evaluation) the chunked loss is made without
/// gradients, outside the graph, with the values of the tracked one; a
/// second backward through a chunked loss is a clear error.
#[test]
fn untracked_and_twice_backpropagated_chunked_losses() {
    let (d, vocab, rows) = (16, 40, 64);
    let t = targets(rows, vocab);
    let w = randt(&[vocab, d], 11, 0.3);
    let x = randt(&[2, rows / 2, d], 7, 1.5);
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
    set_loss_chunk_rows(16);
    let wv = Var::from_tensor(&w).unwrap();
    let plain = nn::Linear::new("plain.weight", wv.as_tensor().clone(), None).unwrap();
    let eval = {
        let _eval = nn::inference();
        nn::linear_cross_entropy(&x, None, &plain, &t).unwrap()
    };
    let tracked = nn::Linear::new("tracked.weight", wv.as_tensor().clone(), None).unwrap();
    let h = Var::from_tensor(&x).unwrap();
    let loss = nn::linear_cross_entropy(h.as_tensor(), None, &tracked, &t).unwrap();
    set_loss_chunk_rows(nn::DEFAULT_LOSS_CHUNK_ROWS);
    assert!(!eval.track_op(), "an evaluation loss in the graph");
    assert_eq!(values(&eval), values(&loss));
    let g = loss.backward().unwrap();
    assert!(g.get(h.as_tensor()).is_some() && g.get(wv.as_tensor()).is_some());
    let err = loss
        .backward()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("its gradients went"), "{err}");
}

/// With BF16 activations the mean's gradient scales the input's gradient
/// in F32: a loss divided by 3 (three micro-batches) gives a third of
/// the gradient on average, not a third rounded to BF16 (0.2% more).
#[test]
fn a_non_power_of_two_gradient_scales_bf16_gradients_in_f32() {
    let (d, vocab, rows) = (64, 96, 256);
    let t = targets(rows, vocab);
    let w = Var::from_tensor(&randt(&[vocab, d], 11, 0.3)).unwrap();
    let head = nn::Linear::new("third.weight", w.as_tensor().clone(), None).unwrap();
    head.set_grad_sink(Some(GradSink::new())).unwrap();
    let x = randt(&[2, rows / 2, d], 7, 1.5)
        .to_dtype(DType::BF16)
        .unwrap();
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
    let dh = |scale: f64| {
        let h = Var::from_tensor(&x).unwrap();
        set_loss_chunk_rows(64);
        let loss = nn::linear_cross_entropy(h.as_tensor(), None, &head, &t).unwrap();
        set_loss_chunk_rows(nn::DEFAULT_LOSS_CHUNK_ROWS);
        let g = loss.affine(scale, 0.0).unwrap().backward().unwrap();
        assert_path(&loss, 64);
        values(g.get(h.as_tensor()).expect("dh"))
    };
    let (one, third) = (dh(1.0), dh(1.0 / 3.0));
    let (mut sum, mut n) = (0.0f64, 0usize);
    for (a, b) in one.iter().zip(&third) {
        if a.abs() > 1e-6 {
            sum += f64::from(*b) * 3.0 / f64::from(*a);
            n += 1;
        }
    }
    let mean = sum / n as f64;
    assert!(
        (mean - 1.0).abs() < 5e-4,
        "3 x a third over the whole: {mean}"
    );
}

/// A non-finite input reaches the chunked loss and both of the head's
/// gradients' flags: the loss is NaN, the sink's weight gradient has a
/// non-finite amax (so a loss-scaled step is skipped), as on the separate
/// ops' path.
#[test]
fn a_non_finite_input_makes_the_chunked_gradients_non_finite() {
    let (d, vocab, rows) = (16, 40, 64);
    let t = targets(rows, vocab);
    for bad in [f32::NAN, f32::INFINITY] {
        let m = head(&format!("bad{bad}"), d, vocab, true);
        let mut x: Vec<f32> = values(&randt(&[2, rows / 2, d], 7, 1.5));
        x[5 * d + 3] = bad;
        let h = Var::from_tensor(&Tensor::from_vec(x, (2, rows / 2, d), &Device::Cpu).unwrap())
            .unwrap();
        let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
        set_loss_chunk_rows(16);
        let loss = nn::linear_cross_entropy(h.as_tensor(), Some(&m.ln), &m.head, &t).unwrap();
        set_loss_chunk_rows(nn::DEFAULT_LOSS_CHUNK_ROWS);
        assert!(
            !values(&loss)[0].is_finite(),
            "{bad}: loss {:?}",
            values(&loss)
        );
        let g = loss.backward().unwrap();
        assert_path(&loss, 16);
        let dw = m.sink.take().unwrap().into_values().next().expect("dw");
        let amax = values(&dw.meta().amax().unwrap())[0];
        assert!(
            !amax.is_finite(),
            "{bad}: the weight gradient's amax {amax}"
        );
        let dh = values(g.get(h.as_tensor()).expect("dh"));
        assert!(dh.iter().any(|v| !v.is_finite()), "{bad}: dh finite");
    }
}
