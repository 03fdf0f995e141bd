//! The training run: build, initialize at a level, train with a progress
//! bar, evaluate, report memory, save, export, sample. [`train`] is what
//! the CLI and the end-to-end test call.

use crate::data::{Corpus, Split};
use crate::hf;
use crate::model::{build, Model};
use crate::sample::generate;
pub use crate::summary::{compute_name, device_name, Summary};
use crate::summary::{median_max, persistent_json};
use amp::comm::Communicator;
use amp::levels::{initialize, initialize_distributed, AmpConfig, AmpContext};
use amp::optim::{AdamWConfig, WarmupCosine};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub use crate::config::{memory_estimate, TrainConfig};

/// Trains one model as `cfg` says on `corpus`; with `world_size` N > 1,
/// N data-parallel ranks as threads (rank 0's summary is returned).
///
/// # Errors
/// A bad config (sequence longer than the split, unknown size, a batch the
/// ranks do not divide), a corrupt or mismatched checkpoint, I/O, a failed
/// rank, candle's.
pub fn train(cfg: &TrainConfig, corpus: &Corpus) -> Result<Summary> {
    if cfg.world_size <= 1 {
        return train_rank(cfg, corpus, None);
    }
    if cfg.batch % cfg.world_size != 0 {
        bail!(
            "a batch of {} does not split over {} ranks",
            cfg.batch,
            cfg.world_size
        );
    }
    let mut runs = amp::comm::run_ranks(cfg.world_size, |comm| {
        train_rank(cfg, corpus, Some(Arc::new(comm)))
    })?;
    Ok(runs.swap_remove(0))
}

/// One rank's run (`comm` is `None` for a single process).
pub fn train_rank(
    cfg: &TrainConfig,
    corpus: &Corpus,
    comm: Option<Arc<dyn Communicator>>,
) -> Result<Summary> {
    let t0 = Instant::now();
    // this rank's thread runs its forwards: the switch is per thread
    amp::nn::set_fp8_activation_inputs(cfg.fp8_activation_inputs);
    amp::nn::set_loss_chunk_rows(cfg.loss_chunk_rows);
    // the heap before the model: what the run adds is measured above it
    let heap_base = crate::heap::in_use();
    let (gcfg, hf_cfg) = cfg.model()?;
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world_size()));
    if cfg.batch == 0 || cfg.seq < 2 || cfg.steps == 0 || cfg.batch % world != 0 {
        bail!(
            "batch, steps and seq must be positive (seq at least 2, batch a multiple of the ranks)"
        );
    }
    let micro = cfg.grad_accum.max(1);
    if (cfg.batch / world) % micro != 0 {
        bail!(
            "--grad-accum {micro}: each rank's {} sequences of a batch must divide into {micro} micro-batches",
            cfg.batch / world
        );
    }
    if cfg.device.is_cuda() {
        // Keep freed blocks pooled, as PyTorch's caching allocator does;
        // measure the pool's peak from here on.
        amp::cuda::keep_freed_memory(&cfg.device)?;
        amp::cuda::reset_pool_peaks(&cfg.device)?;
        // One host thread drives the device: one rank, or one rank of an
        // NCCL group (a process per GPU; NCCL on a fenced side stream). Ranks
        // run as threads (--world-size) share it, each with its own
        // per-thread stream, and keep cudarc's events.
        if !cfg.event_tracking && cfg.world_size <= 1 {
            // SAFETY: every op, from this one host thread, runs on the
            // candle device's one (per-thread) stream.
            unsafe { amp::cuda::skip_event_tracking(&cfg.device)? };
        }
    }
    let (model, varmap) = build(gcfg, cfg.seed, &cfg.device).with_context(|| {
        let arch = crate::model::ARCH;
        format!("building the {} {arch} (F32) on {:?}", cfg.size, cfg.device)
    })?;
    if let (Some(dir), Some(hf_cfg)) = (&cfg.init_from, &hf_cfg) {
        hf::load_into(dir, hf_cfg, &gcfg, &varmap)
            .with_context(|| format!("--init-from {}", dir.display()))?;
    }
    let model = model
        .with_activations(cfg.activations)?
        .with_recompute(cfg.recompute);
    let amp_cfg = AmpConfig {
        level: cfg.level,
        compute: cfg.compute.clone(),
        high_precision: cfg.high_precision.clone(),
        max_grad_norm: cfg.max_grad_norm,
        bucket_mb: cfg.bucket_mb,
        overlap_backward: cfg.overlap,
        bf16_wire: cfg.bf16_wire,
        fp8_one_shot: cfg.fp8_one_shot,
        embedding_rows: cfg.embedding_rows,
        lean_step: cfg.lean_step,
        defer_outcome: cfg.defer_outcome,
        fp8_moments: cfg.fp8_moments,
        ..Default::default()
    };
    let adam = AdamWConfig {
        lr: cfg.lr,
        beta2: 0.95,
        weight_decay: cfg.weight_decay,
        ..Default::default()
    };
    let (amp, mut opt) = match &comm {
        Some(c) => initialize_distributed(&varmap, adam, amp_cfg, c.clone()),
        None => initialize(&varmap, adam, amp_cfg),
    }
    .with_context(|| format!("converting the model to {}", cfg.level))?;
    // The mean of a value over the ranks, and whether any rank got a stop
    // signal (SIGINT/SIGTERM): one all-reduce of both, so that every rank
    // stops after the same step without a collective of its own.
    let mean_and_stop = |x: f32| -> Result<(f32, bool)> {
        let stop = STOP.load(Ordering::SeqCst);
        Ok(match &comm {
            Some(c) => {
                let t = Tensor::new(&[x, f32::from(u8::from(stop))], &cfg.device)?;
                let v = c.all_reduce_sum(&t)?.to_vec1::<f32>()?;
                (v[0] / world as f32, v[1] > 0.0)
            }
            None => (x, stop),
        })
    };
    let mean = |x: f32| -> Result<f32> { Ok(mean_and_stop(x)?.0) };
    let rows = cfg.batch / world;
    opt.inner_mut().set_schedule(WarmupCosine {
        peak: cfg.lr,
        min: cfg.lr / 10.0,
        warmup: cfg.warmup,
        total: cfg.steps,
    });
    if let Some(path) = &cfg.resume {
        if let Err(e) = amp.load(path, &mut opt) {
            let mut msg = format!("resuming from {}", path.display());
            if e.to_string().contains("lm_head.weight") {
                // a head tied in one run and not in the other
                let head = if gcfg.tied {
                    "tied to the embedding (--tie-embeddings)"
                } else {
                    "a weight of its own (--tie-embeddings false)"
                };
                msg += &format!(" (this model's head is {head}; the saving run's was not)");
            }
            return Err(anyhow::Error::from(e).context(msg));
        }
    }
    // the batches consumed so far: applied and skipped steps alike, so a
    // resumed run neither repeats a batch nor runs more than --steps
    let start = opt.inner().step_count() + opt.inner().skipped_count();
    // skipped steps counted from the optimizer's own count at the end: with
    // the outcome left on the device a step learns its outcome one later
    let skipped_before = opt.inner().skipped_count();
    let end = cfg.stop_at.unwrap_or(cfg.steps).min(cfg.steps);
    if start >= end {
        bail!("the checkpoint is at step {start}: nothing left to do before step {end}");
    }
    let bar = progress_bar(cfg, start, rank == 0);
    let sent_before = comm.as_ref().map_or(0, |c| c.bytes_sent());
    let (mut train_curve, mut val_curve) = (Vec::new(), Vec::new());
    let mut train_secs = 0.0f64;
    let mut stopped = None;
    let mut step_secs: Vec<f64> = Vec::new();
    let (mut forward_ms, mut forward_peak) = (Vec::new(), None);
    let mut backward_peak = None;
    let (mut comm_exposed_ms, mut buckets, mut overlapped) = (Vec::new(), Vec::new(), Vec::new());
    let mut comm_gather_ms = Vec::new();
    // AMP_STEP_CLOCK: each step's start (`Instant`, the monotonic clock) on
    // stderr, to cut a host profile to the steps (scripts/gpu/perf-gpt.sh)
    let step_clock = std::env::var_os("AMP_STEP_CLOCK").is_some();
    let mut telemetry_rows = Vec::new();
    let mut second_step = None;
    // The step's loss read without waiting for the stream: its copy queued
    // behind the forward and waited for after the step (done long before),
    // so the host queues the next step while the device still runs this
    // one's update (a read of the loss tensor would wait for all of it).
    let mut loss_read = amp::cuda::HostReadback::default();
    // CPU: the heap's high-water mark before the second step's probe
    // resets it (the model's build and conversion, the first step)
    let mut heap_early_peak = 0;
    for step in start..end {
        // telemetry: rank 0 records the step (the flag is this thread's)
        // and collects its layers' records after it
        let record = rank == 0
            && cfg
                .telemetry
                .as_ref()
                .is_some_and(|(every, _)| crate::telemetry::records(*every, start, step + 1, end));
        if record {
            amp::nn::set_telemetry(true);
        }
        let t = Instant::now();
        let step_mark = amp::cuda::StreamMark::now(&cfg.device)?;
        if step_clock {
            eprintln!("step {step} starts at {t:?}");
        }
        let (x, y) = corpus.batch(
            Split::Train,
            step,
            cfg.seed,
            cfg.batch,
            cfg.seq,
            &cfg.device,
        )?;
        let (x, y) = (
            x.narrow(0, rank * rows, rows)?,
            y.narrow(0, rank * rows, rows)?,
        );
        // Micro-batches but the last: forward and backward, gradients kept.
        let m_rows = rows / micro;
        // the micro-batches' losses summed on the device, in order (the
        // same f32 additions a host sum makes), read once with the last
        let mut micro_sum: Option<Tensor> = None;
        for m in 0..micro - 1 {
            let (xm, ym) = (
                x.narrow(0, m * m_rows, m_rows)?,
                y.narrow(0, m * m_rows, m_rows)?,
            );
            let loss = {
                let _fp8 = amp.autocast();
                (model.loss(&xm, &ym)? / micro as f64)?
            };
            micro_sum = Some(match micro_sum.take() {
                Some(sum) => (sum + loss.detach())?,
                None => loss.detach(),
            });
            opt.backward_accumulate(loss)?;
        }
        let (x, y) = (
            x.narrow(0, (micro - 1) * m_rows, m_rows)?,
            y.narrow(0, (micro - 1) * m_rows, m_rows)?,
        );
        // the forward inside the FP8 scope, then backward and step; a mark
        // on the stream where the forward ends times it without a wait
        let mut forward_mark = None;
        // the second step's memory, phase by phase: the CUDA pool's, or on
        // the CPU the counted heap's above what it held before the model
        // (one rank in the process: ranks as threads share the heap)
        let heap = cfg.device.is_cpu() && crate::heap::counting() && cfg.world_size <= 1;
        let probe = step == start + 1 && (cfg.device.is_cuda() || heap);
        let peak_now = || -> Result<u64> {
            Ok(if heap {
                crate::heap::peak().saturating_sub(heap_base)
            } else {
                amp::cuda::pool_peaks(&cfg.device)?.0
            })
        };
        let mut probed = [0u64; 3];
        if probe {
            cfg.device.synchronize()?;
            if heap {
                heap_early_peak = crate::heap::peak().saturating_sub(heap_base);
                crate::heap::reset_peak();
            } else {
                amp::cuda::reset_pool_peaks(&cfg.device)?;
            }
            probed[0] = peak_now()?;
        }
        amp.step(&mut opt, || -> Result<Tensor> {
            let loss = model.loss(&x, &y)?;
            let loss = if micro > 1 {
                (loss / micro as f64)?
            } else {
                loss
            };
            forward_mark = Some(amp::cuda::StreamMark::now(&cfg.device)?);
            let total = match &micro_sum {
                Some(sum) => (sum + loss.detach())?,
                None => loss.detach(),
            };
            loss_read.queue(&total.to_dtype(DType::F64)?)?;
            if step == start || probe {
                // the memory probes read the pool after the forward
                cfg.device.synchronize()?;
            }
            if step == start && cfg.device.is_cuda() {
                forward_peak = Some(amp::cuda::pool_peaks(&cfg.device)?.0);
            }
            if probe {
                probed[1] = peak_now()?;
            }
            Ok(loss)
        })
        .with_context(|| format!("training step {}", step + 1))?;
        if probe {
            cfg.device.synchronize()?;
            probed[2] = peak_now()?;
            second_step = Some(probed);
        }
        // the F32 loss (the micro-batches' sum) through F64 and back: the
        // same value
        let read = loss_read.wait()?;
        let local = *read
            .first()
            .context("the step's loss read came back empty")? as f32;
        if record {
            amp::nn::set_telemetry(false);
            // a skipped step leaves no moment records: its outcome first
            opt.resolve()?;
            telemetry_rows.extend(crate::telemetry::collect(&model, step + 1)?);
            telemetry_rows.extend(crate::telemetry::collect_moments(
                &model,
                &mut opt,
                amp.tied(),
                step + 1,
            ));
        }
        if step == start {
            backward_peak = opt.last_backward_peak();
        }
        let (value, stop) = mean_and_stop(local)?;
        if step >= start + cfg.timing_skip {
            if let Some(c) = opt.last_comm() {
                comm_exposed_ms.push(c.exposed_ms()?);
                comm_gather_ms.extend(c.gather_ms()?);
                buckets.push(c.buckets as f64);
                overlapped.push(c.overlapped as f64);
            }
            let secs = t.elapsed().as_secs_f64();
            train_secs += secs;
            step_secs.push(secs);
            if let Some(mark) = &forward_mark {
                forward_ms.push(step_mark.ms_until(mark)?);
            }
        }
        train_curve.push((step + 1, value));
        let done = step + 1;
        if done % cfg.eval_every.max(1) == 0 || done == end {
            val_curve.push((
                done,
                mean(evaluate(&model, &amp, corpus, cfg, rank, world)?)?,
            ));
        }
        let tps = step_secs.len() as f64 * (cfg.batch * cfg.seq) as f64 / train_secs.max(1e-9);
        bar.set_message(format!("loss {value:.3}  {tps:.0} tok/s"));
        bar.inc(1);
        if let (Some(every), Some(path)) = (cfg.save_every, &cfg.save) {
            if done % every == 0 && done < end {
                opt.resolve()?;
                amp.save(path, &opt)
                    .with_context(|| format!("saving {} after step {done}", path.display()))?;
            }
        }
        if stop {
            stopped = Some(done);
            break;
        }
    }
    bar.finish_and_clear();
    // the last step's outcome, if it is still on the device
    opt.resolve()?;
    let skipped = opt.inner().skipped_count() - skipped_before;
    if let (Some((_, dir)), false) = (&cfg.telemetry, telemetry_rows.is_empty()) {
        let stem = format!("telemetry-{:?}-{}", cfg.level, compute_name(&cfg.compute));
        let path = crate::telemetry::write(&telemetry_rows, dir, &stem)?;
        if cfg.progress {
            println!("telemetry: {} (and .svg)", path.display());
        }
    }
    if let Some(done) = stopped {
        // every rank saw the signal at the same step (mean_and_stop)
        let saved = match &cfg.save {
            Some(path) => {
                amp.save(path, &opt)
                    .with_context(|| format!("saving {} after step {done}", path.display()))?;
                format!("; step {done} saved to {} (--resume it)", path.display())
            }
            None => "; nothing saved (no --save)".into(),
        };
        bail!("stopped by a signal after step {done} of {end}{saved}");
    }
    let wire = comm.as_ref().map_or(0, |c| c.bytes_sent()) - sent_before;
    let report = amp.memory_report(&opt)?;
    // every rank calls: rank 0 writes the replicated state, and at O3 with
    // ZeRO each rank its slice
    if let Some(path) = &cfg.save {
        amp.save(path, &opt)
            .with_context(|| format!("saving {}", path.display()))?;
    }
    if let Some((dir, dtype)) = &cfg.export {
        // the masters (gathered from the ranks under ZeRO), then rank 0
        // writes them in Hugging Face's names and layouts
        let weights = amp
            .export_weights(&opt, *dtype)
            .with_context(|| format!("exporting {}", dir.display()))?;
        if let Some(weights) = weights {
            let vocab_out = hf_cfg.as_ref().map_or(gcfg.vocab, |h| h.vocab_size);
            hf::write_dir(dir, weights, &gcfg, vocab_out)
                .with_context(|| format!("exporting {}", dir.display()))?;
        }
    }
    let sample = if cfg.sample > 0 && rank == 0 {
        Some(amp.evaluate(|| {
            generate(
                &model,
                &cfg.codec,
                &cfg.prompt,
                cfg.sample,
                cfg.seed,
                &cfg.device,
            )
        })?)
    } else {
        None
    };
    let tokens = step_secs.len() as f64 * (cfg.batch * cfg.seq) as f64;
    let (peak_device_bytes, peak_device_reserved_bytes) = if cfg.device.is_cuda() {
        let (used, reserved) = amp::cuda::pool_peaks(&cfg.device)?;
        (Some(used), Some(reserved))
    } else if cfg.device.is_cpu() && crate::heap::counting() && cfg.world_size <= 1 {
        // the whole run's, the model's build included
        let late = crate::heap::peak().saturating_sub(heap_base);
        (Some(late.max(heap_early_peak)), None)
    } else {
        (None, None)
    };
    let timed_steps = step_secs.len() as u64;
    let forward_ms_median = median_max(&forward_ms).0;
    let step_ms: Vec<f64> = step_secs
        .iter()
        .map(|s| (s * 1e5).round() / 100.0)
        .collect();
    let (step_ms_median, step_ms_max) = median_max(&step_ms);
    Ok(Summary {
        level: cfg.level.to_string(),
        compute: compute_name(&cfg.compute).into(),
        size: cfg.size.clone(),
        params: gcfg.params(),
        linear_params: report.linear_params,
        tied_embeddings: gcfg.tied,
        vocab: gcfg.vocab,
        steps: end,
        batch: cfg.batch,
        seq: cfg.seq,
        seed: cfg.seed,
        first_loss: train_curve.first().map_or(f32::NAN, |p| p.1),
        final_loss: train_curve.last().map_or(f32::NAN, |p| p.1),
        val_loss: val_curve.last().map_or(f32::NAN, |p| p.1),
        tokens_per_s: tokens / train_secs.max(1e-9),
        step_ms_median,
        tokens_per_s_median: (cfg.batch * cfg.seq) as f64 / (step_ms_median / 1e3),
        // per GPU: the ranks of an NCCL group have one each (ranks as
        // threads share this process's one)
        mfu: cfg.device.is_cuda().then(|| {
            let gpus = if cfg.world_size > 1 { 1 } else { world };
            (cfg.batch * cfg.seq) as f64 / (step_ms_median / 1e3) * gcfg.flops_per_token(cfg.seq)
                / crate::summary::H100_BF16_PEAK
                / gpus as f64
        }),
        step_ms_max,
        step_ms,
        forward_ms_median,
        timed_steps,
        peak_device_bytes_after_forward: forward_peak,
        peak_device_bytes_after_backward: backward_peak,
        second_step_device_bytes: second_step,
        estimated_peak_bytes: memory_estimate(cfg, &gcfg, world).total(),
        peak_device_bytes,
        peak_device_reserved_bytes,
        bytes_per_linear_param: report.measured_bytes_per_linear_param,
        predicted_bytes_per_linear_param: report.predicted_bytes_per_linear_param,
        persistent_bytes: persistent_json(&report),
        activations_saved_bytes: report.bytes.activations_saved,
        skipped_steps: skipped,
        steps_run: end - start,
        device: device_name(&cfg.device),
        world_size: world,
        activations: format!("{:?}", cfg.activations).to_uppercase(),
        flash_attention: cfg.device.is_cuda()
            && gcfg.flash_head_dim()
            && amp::nn::flash_attention_enabled(),
        recompute: cfg.recompute,
        lean_step: cfg.lean_step,
        defer_outcome: cfg.defer_outcome && cfg.device.is_cuda() && !cfg.lean_step,
        fp8_moments: cfg.fp8_moments,
        wire_bytes_per_step: wire as f64 / (end - start) as f64,
        comm_exposed_ms: (!comm_exposed_ms.is_empty()).then(|| median_max(&comm_exposed_ms).0),
        comm_gather_ms: (!comm_gather_ms.is_empty()).then(|| median_max(&comm_gather_ms).0),
        buckets_per_step: (!buckets.is_empty()).then(|| median_max(&buckets).0),
        overlapped_buckets_per_step: (!overlapped.is_empty()).then(|| median_max(&overlapped).0),
        wall_s: t0.elapsed().as_secs_f64(),
        train_curve,
        val_curve,
        memory: Some(report),
        sample,
    })
}

fn progress_bar(cfg: &TrainConfig, start: u64, shown: bool) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(cfg.stop_at.unwrap_or(cfg.steps).min(cfg.steps)),
        if cfg.progress && shown {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    let style = ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {bar:30.cyan/blue} {pos}/{len} {msg} (ETA {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style.progress_chars("=> "));
    bar.set_prefix(format!("{} {}", cfg.level, compute_name(&cfg.compute)));
    bar.set_position(start);
    bar
}

/// The seed of the validation windows: the same for every run.
const VAL_SEED: u64 = 0;

/// Mean loss over the fixed validation batches (this rank's rows of each;
/// the same windows for every seed), in the run's compute mode, leaving
/// the layers' scaling state as it was ([`AmpContext::evaluate`]).
fn evaluate(
    model: &Model,
    amp: &AmpContext,
    corpus: &Corpus,
    cfg: &TrainConfig,
    rank: usize,
    world: usize,
) -> Result<f32> {
    let rows = cfg.batch / world;
    amp.evaluate(|| {
        let mut sum = 0.0;
        for i in 0..cfg.eval_batches as u64 {
            // the same windows whatever the run's seed (drawn with seed 0):
            // runs of different seeds are measured on the same text
            let (x, y) = corpus.batch(Split::Val, i, VAL_SEED, cfg.batch, cfg.seq, &cfg.device)?;
            let (x, y) = (
                x.narrow(0, rank * rows, rows)?,
                y.narrow(0, rank * rows, rows)?,
            );
            sum += model.loss(&x, &y)?.to_scalar::<f32>()?;
        }
        Ok(sum / cfg.eval_batches.max(1) as f32)
    })
}

/// Set by SIGINT or SIGTERM ([`stop_on_signals`]): the training loop
/// finishes its step, saves (with --save) and stops.
static STOP: AtomicBool = AtomicBool::new(false);

/// Installs the handler for SIGINT and SIGTERM (and SIGHUP): the first
/// asks the loop to stop after its step; a second ends the process at
/// once (exit code 130).
///
/// # Errors
/// When a handler is installed already.
pub fn stop_on_signals() -> Result<()> {
    ctrlc::set_handler(|| {
        if STOP.swap(true, Ordering::SeqCst) {
            eprintln!("second signal: exiting without saving");
            std::process::exit(130);
        }
        eprintln!("signal: stopping after this step");
    })
    .context("installing the SIGINT/SIGTERM handler")
}
