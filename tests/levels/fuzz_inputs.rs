//! Bounded fuzzing in CI: mutated checkpoints, mutated indexes of sharded
//! ones and arbitrary config and recipe text must give errors, never
//! panics. (The cargo-fuzz targets in `fuzz/` run the same
//! entry points unbounded.)

use crate::common;

use amp::levels::{initialize, AmpConfig, Compute, Level};
use amp::nn;
use amp::optim::AdamWConfig;
use amp::{CurrentScaling, DelayedScaling};
use candle_core::{DType, Device, Module};
use candle_nn::{VarBuilder, VarMap};
use common::randt;
use proptest::prelude::*;
use std::sync::OnceLock;

/// A valid checkpoint of a small O3 model with delayed scaling.
fn checkpoint() -> &'static Vec<u8> {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let (ctx, mut opt, layer) = model();
        let loss = {
            let _s = ctx.autocast();
            layer
                .forward(&randt(&[2, 4], 1, 1.0))
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
        };
        opt.backward_step(&loss).unwrap();
        let path =
            std::env::temp_dir().join(format!("amp-fuzz-{}.safetensors", std::process::id()));
        ctx.save(&path, &opt).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        bytes
    })
}

fn model() -> (
    amp::levels::AmpContext,
    amp::levels::AmpOptimizer,
    nn::Linear,
) {
    let varmap = VarMap::new();
    let layer = nn::linear(
        4,
        3,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("l"),
    )
    .unwrap();
    let cfg = AmpConfig {
        level: Level::O3,
        compute: Compute::Fp8Delayed {
            recipe: DelayedScaling {
                amax_history_len: 2,
                ..Default::default()
            },
        },
        ..Default::default()
    };
    let (ctx, opt) = initialize(&varmap, AdamWConfig::default(), cfg).unwrap();
    (ctx, opt, layer)
}

/// A valid 2-rank sharded checkpoint of the same model (the two ranks as
/// threads): the index's path and bytes; its rank files stay beside it.
fn sharded() -> &'static (std::path::PathBuf, Vec<u8>) {
    static INDEX: OnceLock<(std::path::PathBuf, Vec<u8>)> = OnceLock::new();
    INDEX.get_or_init(|| {
        let path = std::env::temp_dir().join(format!(
            "amp-fuzz-sharded-{}.safetensors",
            std::process::id()
        ));
        amp::comm::run_ranks(2, |comm| {
            let varmap = VarMap::new();
            let _layer = nn::linear(
                4,
                3,
                VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("l"),
            )
            .unwrap();
            let (ctx, opt) = amp::levels::initialize_distributed(
                &varmap,
                AdamWConfig::default(),
                AmpConfig::level(Level::O3),
                std::sync::Arc::new(comm),
            )
            .unwrap();
            ctx.save(&path, &opt).unwrap();
            Ok::<(), amp::comm::Error>(())
        })
        .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        (path, bytes)
    })
}

#[test]
fn the_unmutated_inputs_load() {
    // the mutations below start from checkpoints that load
    let (ctx, mut opt, _layer) = model();
    let path = std::env::temp_dir().join(format!("amp-fuzz-ok-{}.safetensors", std::process::id()));
    std::fs::write(&path, checkpoint()).unwrap();
    ctx.load(&path, &mut opt).unwrap();
    let (ctx, mut opt, _layer) = model();
    ctx.load(&sharded().0, &mut opt).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn mutated_sharded_indexes_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        files in ".{0,120}",
        replace_files in any::<bool>(),
    ) {
        let (path, good) = sharded();
        let mut bytes = good.clone();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if replace_files {
            // the index's own metadata with an arbitrary file list
            let (_, h) = safetensors::SafeTensors::read_metadata(good).unwrap();
            let mut meta = h.metadata().clone().unwrap_or_default();
            meta.insert("files".into(), files);
            bytes = safetensors::tensor::serialize(
                std::iter::empty::<(String, safetensors::tensor::TensorView<'_>)>(),
                Some(meta),
            )
            .unwrap();
        }
        // beside the rank files, which the index names
        let case = path.with_file_name(format!("amp-fuzz-index-case-{}.safetensors", std::process::id()));
        std::fs::write(&case, &bytes).unwrap();
        let (ctx, mut opt, _layer) = model();
        let _ = ctx.load(&case, &mut opt); // Ok or Err, never a panic
    }

    #[test]
    fn mutated_checkpoints_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = checkpoint().clone();
        for (at, byte) in edits {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        let path = std::env::temp_dir().join(format!("amp-fuzz-case-{}.safetensors", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let (ctx, mut opt, _layer) = model();
        let _ = ctx.load(&path, &mut opt); // Ok or Err, never a panic
    }

    #[test]
    fn arbitrary_config_text_never_panics(text in ".{0,200}") {
        let _ = AmpConfig::from_json(&text);
        let _ = AmpConfig::from_toml(&text);
        let _ = DelayedScaling::from_json(&text);
        let _ = DelayedScaling::from_toml(&text);
        let _ = CurrentScaling::from_toml(&text);
        let _ = CurrentScaling::from_json(&text);
    }

    #[test]
    fn structured_config_values_never_panic(
        margin in any::<i64>(), len in any::<i64>(), interval in any::<i64>(),
        scale in any::<f64>(), norm in any::<f64>(),
    ) {
        let json = format!(r#"{{"level": "O2", "max_grad_norm": {norm:?}, "loss_scaling": {{"static": {{"scale": {scale:?}}}}},
            "compute": {{"mode": "fp8_delayed", "recipe": {{"margin": {margin}, "amax_history_len": {len}, "interval": {interval}}}}}}}"#);
        let _ = AmpConfig::from_json(&json);
    }
}
