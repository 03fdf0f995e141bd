//! Data parallelism through the GPT example on the in-process backend:
//! N ranks with B/N sequences each against one rank with B, the bytes on
//! the wire, and a rank that fails mid-run.

use crate::data;
use crate::gpt_common;
use crate::model;
use crate::train;

use amp::comm::{run_ranks_each, Communicator, InProcessConfig};
use amp::levels::{initialize_distributed, AmpConfig, Compute, Level};
use amp::optim::AdamWConfig;
use amp::CurrentScaling;
use candle_core::Device;
use std::sync::Arc;
use std::time::{Duration, Instant};
use train::{train, TrainConfig};

fn quick(level: Level, compute: Compute, world_size: usize) -> TrainConfig {
    TrainConfig {
        level,
        compute,
        steps: 8,
        batch: 8,
        seq: 32,
        warmup: 2,
        // a rate at which 8 steps are smooth: at 3e-3 a loss spike makes
        // any two runs (levels alike) differ by a few percent
        lr: 1e-3,
        eval_every: 100,
        eval_batches: 2,
        world_size,
        ..Default::default()
    }
}

fn current() -> Compute {
    Compute::Fp8Current {
        recipe: CurrentScaling::default(),
    }
}

/// Of a 2-rank run's summary: the token table's elements, and the elements
/// a rank sends instead to average its gradient from the looked-up rows
/// (each token's id and row gradient; `levels/src/distributed/rows.rs`).
fn token_table(s: &train::Summary) -> (f64, f64) {
    let width = model::GptConfig::named(&s.size, s.vocab, s.seq)
        .unwrap()
        .n_embd;
    let tokens = s.batch / 2 * s.seq;
    assert!(2 * tokens < 2 * s.vocab, "the rows are worth gathering");
    ((s.vocab * width) as f64, (tokens * (1 + width)) as f64)
}

/// Largest relative difference between two loss curves.
fn max_rel(a: &[(u64, f32)], b: &[(u64, f32)]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(p, q)| ((p.1 - q.1) / p.1).abs())
        .fold(0.0, f32::max)
}

#[test]
fn two_ranks_with_half_batches_match_one_rank() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    // O0: F32 all-reduce of the two halves' mean gradients is the full
    // batch's mean up to float rounding. FP8 levels: each rank's gradient
    // is cast before the reduction and the mean cast again, a second
    // rounding (measured: 3e-4 at O1 and O2, as far as O1 from O2).
    for (level, compute, tol) in [
        (Level::O0, Compute::Native, 1e-4),
        (Level::O1, current(), 3e-3),
        (Level::O2, current(), 3e-3),
        (Level::O3, current(), 3e-3),
    ] {
        let one = train(&quick(level, compute.clone(), 1), &corpus)?;
        let two = train(&quick(level, compute.clone(), 2), &corpus)?;
        let diff = max_rel(&one.train_curve, &two.train_curve);
        assert!(
            diff <= tol,
            "{level}: curves differ by {diff} (tolerance {tol})"
        );
        assert!(
            ((one.val_loss - two.val_loss) / one.val_loss).abs() <= tol,
            "{level}"
        );
        assert_eq!(two.world_size, 2);
        assert_eq!(one.wire_bytes_per_step, 0.0);
        assert!(
            two.final_loss < 0.8 * two.first_loss,
            "{level}: no learning"
        );
    }
    Ok(())
}

#[test]
fn o3_shards_masters_and_moments_over_the_ranks() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    for n in [1, 2, 4] {
        let cfg = TrainConfig {
            steps: 3,
            ..quick(Level::O3, current(), n)
        };
        let s = train(&cfg, &corpus)?;
        // 1 byte FP8 weight + 1 byte FP8 gradient, whole; 2 + 1 + 2 bytes of
        // master, m and v, a 1/N slice each
        let predicted = 2.0 + 5.0 / n as f64;
        assert_eq!(s.predicted_bytes_per_linear_param, predicted, "N = {n}");
        let excess = (s.bytes_per_linear_param - predicted) * s.linear_params as f64;
        let meta = s.persistent_bytes["scaling_metadata"]
            .as_f64()
            .unwrap_or(-1.0);
        assert!(
            excess > -0.5 && excess <= meta + 0.5,
            "N = {n}: {} bytes per linear parameter, predicted {predicted}",
            s.bytes_per_linear_param
        );
        assert_eq!(
            s.linear_params, 819_200,
            "N = {n}: the whole weights are counted"
        );
    }
    Ok(())
}

#[test]
fn a_zero_sharded_run_resumes_exactly_reshards_and_exports_whole_weights() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let dir = std::env::temp_dir().join(format!("amp-zero-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let ckpt = dir.join("ckpt.safetensors");
    let export = dir.join("export");
    let cfg = TrainConfig {
        export: Some((export.clone(), amp::levels::ExportDType::F32)),
        ..quick(Level::O3, current(), 2)
    };
    let (whole, rest) = gpt_common::whole_and_resumed(&cfg, &corpus, 3, &ckpt)?;
    // one file per rank, each with its slices, and no other rank file
    let files = amp::levels::shard_files(&ckpt)?;
    assert_eq!(files.len(), 2);
    assert!(files.iter().all(|f| f.exists()), "{files:?}");
    let rank_files = std::fs::read_dir(&dir)?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("ckpt.rank"))
        .count();
    assert_eq!(rank_files, 2, "{files:?}");
    assert_eq!(rest.train_curve, whole.train_curve[3..]);
    // whole weights in GPT-2's layout (Conv1D: [in, out]) from the slices
    let tensors = candle_core::safetensors::load(export.join("model.safetensors"), &Device::Cpu)?;
    assert_eq!(
        tensors["transformer.h.0.mlp.c_fc.weight"].dims(),
        [128, 512]
    );
    // at another world size or level: resharded (one re-encoding of the
    // masters and moments), the curve goes on as the whole run's (measured:
    // 1.2e-4 at O3 on 4 ranks, 8e-5 at O2 in one process)
    for (level, world_size) in [(Level::O3, 4), (Level::O2, 1)] {
        let other = train(
            &TrainConfig {
                resume: Some(ckpt.clone()),
                export: None,
                level,
                world_size,
                ..cfg.clone()
            },
            &corpus,
        )?;
        let diff = max_rel(&other.train_curve, &whole.train_curve[3..]);
        assert!(diff <= 1e-3, "{level} on {world_size}: {diff}");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn fp8_gradients_cut_the_wire_bytes() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let o0 = train(&quick(Level::O0, Compute::Native, 2), &corpus)?;
    let o2 = train(&quick(Level::O2, current(), 2), &corpus)?;
    // Per rank and step with N = 2: 4 bytes per element of an F32
    // all-reduce, 1 per element of an FP8 one (Communicator's counting);
    // the token table's gradient from its rows at both levels (the ids and
    // row gradients a rank sends, in elements of 4 bytes).
    let (linear, other) = (
        o2.linear_params as f64,
        (o2.params - o2.linear_params) as f64,
    );
    let (table, rows) = token_table(&o2);
    let want = (linear / 4.0 + other - table + rows) / (linear + other - table + rows);
    let got = o2.wire_bytes_per_step / o0.wire_bytes_per_step;
    assert!(
        (got / want - 1.0).abs() < 0.01,
        "O2/O0 wire bytes {got}, expected {want}"
    );
    Ok(())
}

#[test]
fn bf16_on_the_wire_halves_the_f32_gradients_bytes_and_still_learns() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let f32_wire = train(&quick(Level::O2, current(), 2), &corpus)?;
    let bf16_wire = train(
        &TrainConfig {
            bf16_wire: true,
            ..quick(Level::O2, current(), 2)
        },
        &corpus,
    )?;
    // Per rank and step with N = 2: the F32 gradients' 4 bytes an element
    // become 2; the FP8 ones stay 1; the token table's rows stay F32.
    let (linear, other) = (
        f32_wire.linear_params as f64,
        (f32_wire.params - f32_wire.linear_params) as f64,
    );
    let (table, rows) = token_table(&f32_wire);
    let want =
        (linear / 4.0 + (other - table) / 2.0 + rows) / (linear / 4.0 + other - table + rows);
    let got = bf16_wire.wire_bytes_per_step / f32_wire.wire_bytes_per_step;
    assert!(
        (got / want - 1.0).abs() < 0.01,
        "BF16/F32 wire bytes {got}, expected {want}"
    );
    // the rounding of the embeddings' and norms' gradients moves the
    // losses a little, not the learning
    let (a, b) = (f32_wire.val_loss as f64, bf16_wire.val_loss as f64);
    assert!(
        (a - b).abs() / a < 0.02,
        "val loss F32 wire {a}, BF16 wire {b}"
    );
    assert!(bf16_wire.final_loss < bf16_wire.first_loss - 0.5);
    Ok(())
}

#[test]
fn one_shot_fp8_buckets_train_bitwise_as_the_default() -> anyhow::Result<()> {
    // `--fp8-one-shot`: every rank's FP8 codes whole to every rank, each
    // summing the whole bucket; the same values at any world size, the same
    // bytes at two ranks and more above (so the option is seen to be taken)
    let corpus = data::Corpus::bundled();
    for world in [2, 3] {
        let base = TrainConfig {
            batch: 12,
            ..quick(Level::O2, current(), world)
        };
        let two = train(&base, &corpus)?;
        let one = train(
            &TrainConfig {
                fp8_one_shot: true,
                ..base
            },
            &corpus,
        )?;
        assert_eq!(
            one.final_loss.to_bits(),
            two.final_loss.to_bits(),
            "N={world}"
        );
        assert_eq!(one.val_loss.to_bits(), two.val_loss.to_bits(), "N={world}");
        let (a, b) = (one.wire_bytes_per_step, two.wire_bytes_per_step);
        if world == 2 {
            assert_eq!(a, b, "N=2: the same bytes");
        } else {
            assert!(a > b, "N={world}: one shot sends more ({a} against {b})");
        }
    }
    Ok(())
}

#[test]
fn a_rank_that_fails_mid_run_is_an_error_on_every_rank() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let gcfg = model::GptConfig::named("tiny", 256, 16)?;
    let timeout = Duration::from_secs(20);
    for panics in [false, true] {
        let t0 = Instant::now();
        let results = run_ranks_each(
            3,
            &InProcessConfig { timeout },
            |comm| -> anyhow::Result<()> {
                let rank = comm.rank();
                let (gpt, varmap) = model::build(gcfg, rank as u64, &Device::Cpu)?;
                let cfg = AmpConfig {
                    compute: current(),
                    ..AmpConfig::level(Level::O2)
                };
                let (amp, mut opt) =
                    initialize_distributed(&varmap, AdamWConfig::default(), cfg, Arc::new(comm))?;
                for step in 0..3 {
                    if rank == 1 && step == 1 {
                        if panics {
                            panic!("rank 1 panics mid-run");
                        }
                        anyhow::bail!("rank 1 fails mid-run");
                    }
                    let (x, y) = corpus.batch(data::Split::Train, step, 0, 2, 16, &Device::Cpu)?;
                    let loss = {
                        let _fp8 = amp.autocast();
                        gpt.loss(&x, &y)?
                    };
                    opt.backward_step(&loss)?;
                }
                Ok(())
            },
        )?;
        assert!(t0.elapsed() < timeout, "the others waited for the timeout");
        for (rank, r) in results.iter().enumerate() {
            let e = match r {
                Ok(()) => panic!("rank {rank} finished although rank 1 failed"),
                Err(e) => format!("{e:#}"),
            };
            assert!(e.contains("rank 1"), "panics {panics}, rank {rank}: {e}");
        }
    }
    Ok(())
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_on_every_rank() -> anyhow::Result<()> {
    use amp::optim::StepOutcome;
    let corpus = data::Corpus::bundled();
    let gcfg = model::GptConfig::named("tiny", 256, 16)?;
    for level in [Level::O2, Level::O3] {
        let outcomes = amp::comm::run_ranks(2, |comm| -> anyhow::Result<Vec<bool>> {
            let rank = comm.rank();
            let (gpt, varmap) = model::build(gcfg, 0, &Device::Cpu)?;
            let cfg = AmpConfig {
                compute: current(),
                ..AmpConfig::level(level)
            };
            let (amp, mut opt) =
                initialize_distributed(&varmap, AdamWConfig::default(), cfg, Arc::new(comm))?;
            let mut applied = vec![];
            for step in 0..3u64 {
                let (x, y) = corpus.batch(data::Split::Train, step, 0, 2, 16, &Device::Cpu)?;
                let mut loss = {
                    let _fp8 = amp.autocast();
                    gpt.loss(&x, &y)?
                };
                if step == 1 && rank == 1 {
                    loss = (loss * f64::INFINITY)?; // an overflow on one rank only
                }
                applied.push(matches!(
                    opt.backward_step(&loss)?,
                    StepOutcome::Applied { .. }
                ));
            }
            Ok(applied)
        })?;
        for (rank, a) in outcomes.iter().enumerate() {
            assert_eq!(a, &[true, false, true], "{level} rank {rank}");
        }
    }
    Ok(())
}

#[test]
fn a_data_parallel_run_resumes_exactly() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let path = std::env::temp_dir().join(format!("amp-dp-{}.safetensors", std::process::id()));
    let cfg = quick(Level::O2, current(), 2);
    let (whole, rest) = gpt_common::whole_and_resumed(&cfg, &corpus, 3, &path)?;
    std::fs::remove_file(&path)?;
    assert_eq!(rest.train_curve, whole.train_curve[3..]);
    Ok(())
}

#[test]
fn the_bucket_size_changes_no_value_only_the_buckets() -> anyhow::Result<()> {
    // Every bucketed reduction is bitwise the per-tensor one, so a run is
    // bitwise the same whatever the cap: one tensor a bucket (a cap below
    // every tensor), DDP's 25 MiB, or everything in one bucket of each kind.
    let corpus = data::Corpus::bundled();
    for level in [Level::O2, Level::O3] {
        let mut runs = vec![];
        for bucket_mb in [1e-6, 25.0, 1e6] {
            let cfg = TrainConfig {
                bucket_mb,
                steps: 4,
                ..quick(level, current(), 2)
            };
            runs.push(train(&cfg, &corpus)?);
        }
        let curve = |s: &train::Summary| -> Vec<(u64, u32)> {
            s.train_curve.iter().map(|p| (p.0, p.1.to_bits())).collect()
        };
        for r in &runs[1..] {
            assert_eq!(curve(r), curve(&runs[0]), "{level}");
            assert_eq!(r.val_loss.to_bits(), runs[0].val_loss.to_bits(), "{level}");
        }
        let buckets: Vec<f64> = runs.iter().map(|r| r.buckets_per_step.unwrap()).collect();
        // one a tensor (grads of every parameter, and at O3 the gathers of
        // the sharded weights), then fewer; the tiny model fits one bucket
        // of each kind (FP8 whole, FP8 sharded, F32; O3's gathers)
        assert!(
            buckets[0] > buckets[1] && buckets[1] >= buckets[2],
            "{level} {buckets:?}"
        );
        let kinds = if level == Level::O3 { 3.0 } else { 2.0 };
        assert_eq!(buckets[2], kinds, "{level} {buckets:?}");
        assert!(runs
            .iter()
            .all(|r| r.comm_exposed_ms.is_some_and(|ms| ms >= 0.0)));
        if level == Level::O2 {
            // with N = 2, the same bytes whatever the cut
            for r in &runs[1..] {
                assert_eq!(r.wire_bytes_per_step, runs[0].wire_bytes_per_step);
            }
        }
    }
    Ok(())
}

#[test]
fn gradient_accumulation_communicates_once_a_step() -> anyhow::Result<()> {
    // Four micro-batches of one sequence per rank against one of four: the
    // same loss up to the sum's rounding, and the same buckets and bytes.
    let corpus = data::Corpus::bundled();
    for level in [Level::O0, Level::O2, Level::O3] {
        let compute = if level == Level::O0 {
            Compute::Native
        } else {
            current()
        };
        let base = train(&quick(level, compute.clone(), 2), &corpus)?;
        let accum = train(
            &TrainConfig {
                grad_accum: 4,
                ..quick(level, compute, 2)
            },
            &corpus,
        )?;
        let diff = max_rel(&base.train_curve, &accum.train_curve);
        assert!(diff < 0.01, "{level}: {diff}");
        assert_eq!(accum.buckets_per_step, base.buckets_per_step, "{level}");
        assert_eq!(
            accum.wire_bytes_per_step, base.wire_bytes_per_step,
            "{level}"
        );
    }
    let err = train(
        &TrainConfig {
            grad_accum: 3,
            ..quick(Level::O2, current(), 2)
        },
        &corpus,
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("--grad-accum 3"), "{err:#}");
    Ok(())
}

#[test]
fn buckets_reduced_during_the_backward_change_no_value() -> anyhow::Result<()> {
    // From the second step on, buckets start inside the backward; the run
    // is bitwise the one that reduces everything after it.
    let corpus = data::Corpus::bundled();
    for level in [Level::O2, Level::O3] {
        let run = |overlap: bool, grad_accum: usize| {
            let cfg = TrainConfig {
                overlap,
                grad_accum,
                bucket_mb: 0.01,
                steps: 4,
                timing_skip: 1,
                ..quick(level, current(), 2)
            };
            train(&cfg, &corpus)
        };
        for accum in [1, 2] {
            let (on, off) = (run(true, accum)?, run(false, accum)?);
            let bits = |s: &train::Summary| -> Vec<u32> {
                s.train_curve.iter().map(|p| p.1.to_bits()).collect()
            };
            assert_eq!(bits(&on), bits(&off), "{level} accum {accum}");
            assert_eq!(on.val_loss.to_bits(), off.val_loss.to_bits(), "{level}");
            assert_eq!(on.buckets_per_step, off.buckets_per_step, "{level}");
            assert_eq!(on.wire_bytes_per_step, off.wire_bytes_per_step, "{level}");
            assert_eq!(
                on.bytes_per_linear_param, off.bytes_per_linear_param,
                "{level}"
            );
            let early = on.overlapped_buckets_per_step.unwrap();
            assert!(early >= 1.0, "{level} accum {accum}: {early}");
            assert_eq!(off.overlapped_buckets_per_step, Some(0.0), "{level}");
        }
    }
    Ok(())
}
