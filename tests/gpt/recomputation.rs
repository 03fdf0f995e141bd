//! `--recompute full` and `selective` against none on the tiny GPT: the
//! same run bit for bit at every level and compute path (losses, and the
//! checkpoint at the end: weights, optimizer state, every scale and amax
//! history).

use crate::data;
use crate::recompute::Recompute;
use crate::train;

use amp::levels::{Compute, Level};
use amp::{CurrentScaling, DelayedScaling};
use candle_core::DType;
use train::{train, TrainConfig};

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("amp-gpt-recompute-{}-{name}", std::process::id()))
}

fn bits(s: &train::Summary) -> Vec<u32> {
    s.train_curve
        .iter()
        .chain(&s.val_curve)
        .map(|p| p.1.to_bits())
        .collect()
}

/// Two safetensors files with the same metadata and the same tensors,
/// byte for byte (the order of tensors in a file may differ).
fn assert_same_checkpoint(a: &[u8], b: &[u8], what: &str) -> anyhow::Result<()> {
    use safetensors::SafeTensors;
    let (_, ma) = SafeTensors::read_metadata(a)?;
    let (_, mb) = SafeTensors::read_metadata(b)?;
    assert_eq!(ma.metadata(), mb.metadata(), "{what}: checkpoint metadata");
    let (ta, tb) = (SafeTensors::deserialize(a)?, SafeTensors::deserialize(b)?);
    let mut names = ta.names();
    names.sort();
    let mut names_b = tb.names();
    names_b.sort();
    assert_eq!(names, names_b, "{what}: checkpoint tensors");
    for name in names {
        let (x, y) = (ta.tensor(name)?, tb.tensor(name)?);
        assert!(
            x.dtype() == y.dtype() && x.shape() == y.shape() && x.data() == y.data(),
            "{what}: `{name}` differs"
        );
    }
    Ok(())
}

/// A short delayed-scaling history, so that it rolls over within a run.
fn delayed() -> Compute {
    Compute::Fp8Delayed {
        recipe: DelayedScaling {
            amax_history_len: 4,
            ..Default::default()
        },
    }
}

fn current() -> Compute {
    Compute::Fp8Current {
        recipe: CurrentScaling::default(),
    }
}

/// 16 steps of each run with each recompute mode (the delayed history of
/// 4 rolls over three times): the losses and the final checkpoint bit for
/// bit those of the run that keeps everything.
fn same_runs(runs: Vec<(Level, Compute, DType)>) -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    for (level, compute, activations) in runs {
        let what = format!("{level:?} {compute:?} {activations:?}");
        let base = TrainConfig {
            level,
            compute,
            activations,
            steps: 16,
            batch: 2,
            seq: 16,
            warmup: 2,
            eval_every: 8,
            eval_batches: 1,
            ..Default::default()
        };
        let run = |mode: Recompute| -> anyhow::Result<(train::Summary, Vec<u8>)> {
            let path = tmp(&format!("{level:?}-{activations:?}-{mode:?}"));
            let s = train(
                &TrainConfig {
                    save: Some(path.clone()),
                    recompute: mode,
                    ..base.clone()
                },
                &corpus,
            )?;
            let bytes = std::fs::read(&path)?;
            if std::env::var("KEEP").is_err() {
                std::fs::remove_file(&path)?;
            }
            assert_eq!(s.recompute, mode);
            Ok((s, bytes))
        };
        let (kept, a) = run(Recompute::None)?;
        assert!(kept.final_loss < kept.first_loss, "{what}: no learning");
        for mode in [Recompute::Selective, Recompute::Full] {
            let (again, b) = run(mode)?;
            let what = format!("{what}, {mode:?}");
            assert_eq!(bits(&kept), bits(&again), "{what}: losses differ");
            assert_same_checkpoint(&a, &b, &what)?;
        }
    }
    Ok(())
}

// Every level, and each weight storage with each compute path (the weight
// cast again from an F32 `Var` at O0, from FP16 at O1 and O2, kept as
// stored at O3), BF16 activations once (where the residual goes into a
// GEMM's epilogue only for a tracked input); three tests, so that they run
// side by side.

#[test]
fn recompute_is_the_same_run_at_o0() -> anyhow::Result<()> {
    same_runs(vec![
        (Level::O0, Compute::Native, DType::F32),
        (Level::O0, current(), DType::F32),
        (Level::O0, delayed(), DType::F32),
    ])
}

#[test]
fn recompute_is_the_same_run_at_o1_and_o2() -> anyhow::Result<()> {
    same_runs(vec![
        (Level::O1, current(), DType::F32),
        (Level::O2, delayed(), DType::F32),
    ])
}

#[test]
fn recompute_is_the_same_run_with_bf16_and_at_o3() -> anyhow::Result<()> {
    same_runs(vec![
        (Level::O2, current(), DType::BF16),
        (Level::O3, current(), DType::F32),
        (Level::O3, delayed(), DType::F32),
    ])
}

#[test]
fn recompute_is_the_same_with_data_parallelism_and_accumulation() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    // buckets reduced while the backward (and its recomputation) runs;
    // ZeRO at O3; micro-batches accumulated before one reduction
    for (level, world_size, grad_accum) in [(Level::O2, 2, 1), (Level::O3, 2, 1), (Level::O2, 1, 2)]
    {
        let what = format!("{level:?} world {world_size} accumulation {grad_accum}");
        let base = TrainConfig {
            level,
            compute: current(),
            world_size,
            grad_accum,
            bucket_mb: 0.05,
            steps: 8,
            batch: 4,
            seq: 16,
            warmup: 2,
            eval_every: 4,
            eval_batches: 1,
            ..Default::default()
        };
        let kept = train(&base, &corpus)?;
        for mode in [Recompute::Selective, Recompute::Full] {
            let again = train(
                &TrainConfig {
                    recompute: mode,
                    ..base.clone()
                },
                &corpus,
            )?;
            assert_eq!(bits(&kept), bits(&again), "{what}, {mode:?}: losses differ");
        }
    }
    Ok(())
}
