//! Hugging Face GPT-2 checkpoints in and out, checked by values against an
//! independent forward ([`crate::hf_reference`]): a synthetic checkpoint in
//! GPT-2's layouts loads (the model's logits equal the reference's), trains,
//! and exports in the same names, shapes and dtypes; an export of a model
//! trained here computes the loss the run reported; bad checkpoints are
//! errors that name the problem.

use crate::data;
use crate::hf;
use crate::hf_reference::Reference;
use crate::model;
use crate::train::{train, TrainConfig};
use amp::levels::{Compute, ExportDType, Level};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn dir(name: &str) -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("amp-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// A GPT-2-layout checkpoint of random values (2 blocks, width 32, 2
/// heads, 64 positions, vocabulary 300, tied, with the mask buffers and no
/// `transformer.` prefix, as the original GPT-2 files are).
fn synthetic(dir: &Path, activation: &str) -> Result<HashMap<String, Tensor>> {
    let (d, v, p, l) = (32usize, 300usize, 64usize, 2usize);
    let mut seed = 1u64;
    let mut rnd = |shape: &[usize], scale: f32| -> Result<Tensor> {
        seed += 1;
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n)
            .map(|i| {
                let x = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    ^ seed.wrapping_mul(0xbf58_476d_1ce4_e5b9);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect();
        Ok(Tensor::from_vec(vals, shape, &Device::Cpu)?)
    };
    let mut t = HashMap::new();
    t.insert("wte.weight".to_string(), rnd(&[v, d], 0.2)?);
    t.insert("wpe.weight".to_string(), rnd(&[p, d], 0.1)?);
    for i in 0..l {
        for ln in ["ln_1", "ln_2"] {
            t.insert(format!("h.{i}.{ln}.weight"), (rnd(&[d], 0.2)? + 1.0)?);
            t.insert(format!("h.{i}.{ln}.bias"), rnd(&[d], 0.1)?);
        }
        // Conv1D: [in, out]; c_proj square, so a transpose keeps its shape
        for (name, i_n, o_n) in [
            ("attn.c_attn", d, 3 * d),
            ("attn.c_proj", d, d),
            ("mlp.c_fc", d, 4 * d),
            ("mlp.c_proj", 4 * d, d),
        ] {
            t.insert(format!("h.{i}.{name}.weight"), rnd(&[i_n, o_n], 0.3)?);
            t.insert(format!("h.{i}.{name}.bias"), rnd(&[o_n], 0.05)?);
        }
        t.insert(
            format!("h.{i}.attn.bias"),
            Tensor::ones((1, 1, p, p), DType::F32, &Device::Cpu)?,
        );
    }
    t.insert("ln_f.weight".to_string(), (rnd(&[d], 0.2)? + 1.0)?);
    t.insert("ln_f.bias".to_string(), rnd(&[d], 0.1)?);
    candle_core::safetensors::save(&t, dir.join("model.safetensors"))?;
    let cfg = serde_json::json!({
        "model_type": "gpt2", "vocab_size": v, "n_positions": p, "n_embd": d, "n_layer": l,
        "n_head": 2, "activation_function": activation, "layer_norm_epsilon": 1e-5,
    });
    std::fs::write(dir.join("config.json"), cfg.to_string())?;
    Ok(t)
}

fn tokens() -> Result<Tensor> {
    let v: Vec<u32> = (0..2 * 20).map(|i| (i * 37 + 5) % 300).collect();
    Ok(Tensor::from_vec(v, (2, 20), &Device::Cpu)?)
}

#[test]
fn a_gpt2_checkpoint_loads_with_its_values() -> Result<()> {
    let d = dir("load")?;
    synthetic(&d, "gelu_new")?;
    let cfg = hf::read_config(&d)?;
    // the vocabulary padded, as --vocab 320 does
    let gcfg = hf::model_config(&cfg, 320, 64);
    assert_eq!((gcfg.vocab, gcfg.ctx, gcfg.n_layer), (320, 64, 2));
    let (gpt, varmap) = model::build(gcfg, 3, &Device::Cpu)?;
    hf::load_into(&d, &cfg, &gcfg, &varmap)?;
    let x = tokens()?;
    let ours = gpt.forward(&x)?.narrow(2, 0, 300)?;
    let want = Reference::load(&d)?.logits(&x)?;
    let diff = (ours - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(
        diff <= 1e-4 * scale.max(1.0),
        "logits differ by {diff} (of {scale})"
    );
    Ok(())
}

#[test]
fn a_tied_checkpoint_loads_tied_whatever_its_file_carries() -> Result<()> {
    let d = dir("tied")?;
    let mut t = synthetic(&d, "gelu_new")?;
    let cfg = hf::read_config(&d)?;
    assert!(cfg.tie_word_embeddings, "GPT-2's default");
    let gcfg = hf::model_config(&cfg, 300, 64);
    assert!(gcfg.tied);
    // some writers keep the tied head's copy in the file: dropped on load
    t.insert("lm_head.weight".into(), t["wte.weight"].clone());
    candle_core::safetensors::save(&t, d.join("model.safetensors"))?;
    let (gpt, varmap) = model::build(gcfg, 3, &Device::Cpu)?;
    assert!(!varmap.data().lock().unwrap().contains_key("lm_head.weight"));
    hf::load_into(&d, &cfg, &gcfg, &varmap)?;
    let x = tokens()?;
    let diff = (gpt.forward(&x)? - Reference::load(&d)?.logits(&x)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert!(diff <= 1e-4, "logits differ by {diff}");
    // a checkpoint whose config unties a head of its own: a tied model
    // would drop it, and says so
    let mut untied = cfg.clone();
    untied.tie_word_embeddings = false;
    let other = (t["wte.weight"].clone() * 0.5)?;
    t.insert("lm_head.weight".into(), other);
    candle_core::safetensors::save(&t, d.join("model.safetensors"))?;
    let (_, varmap) = model::build(gcfg, 3, &Device::Cpu)?;
    let e = format!(
        "{:#}",
        hf::load_into(&d, &untied, &gcfg, &varmap).unwrap_err()
    );
    assert!(e.contains("tying them would drop it"), "{e}");
    // and an untied model reads it
    let ucfg = hf::model_config(&untied, 300, 64);
    let (_, varmap) = model::build(ucfg, 3, &Device::Cpu)?;
    hf::load_into(&d, &untied, &ucfg, &varmap)?;
    let head = varmap.data().lock().unwrap()["lm_head.weight"]
        .as_tensor()
        .clone();
    let want = t["lm_head.weight"].to_dtype(DType::F32)?;
    assert_eq!(
        head.flatten_all()?.to_vec1::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?
    );
    Ok(())
}

#[test]
fn a_sharded_checkpoint_loads_as_its_one_file_does() -> Result<()> {
    // as save_pretrained writes a model above its shard size: the tensors
    // in two files and model.safetensors.index.json mapping each to its file
    let d = dir("sharded")?;
    let t = synthetic(&d, "gelu_new")?;
    let x = tokens()?;
    let want = Reference::load(&d)?.logits(&x)?;
    std::fs::remove_file(d.join("model.safetensors"))?;
    let mut names: Vec<&String> = t.keys().collect();
    names.sort();
    let half = names.len() / 2;
    let mut map = serde_json::Map::new();
    for (i, part) in [&names[..half], &names[half..]].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let shard: HashMap<String, Tensor> =
            part.iter().map(|n| ((*n).clone(), t[*n].clone())).collect();
        candle_core::safetensors::save(&shard, d.join(&file))?;
        for n in part.iter() {
            map.insert((*n).clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    let index_path = d.join("model.safetensors.index.json");
    std::fs::write(&index_path, index.to_string())?;
    let cfg = hf::read_config(&d)?;
    let gcfg = hf::model_config(&cfg, 300, 64);
    let (gpt, varmap) = model::build(gcfg, 3, &Device::Cpu)?;
    hf::load_into(&d, &cfg, &gcfg, &varmap)?;
    let diff = (gpt.forward(&x)? - &want)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert!(diff <= 1e-4, "logits differ by {diff}");
    // what a broken index says
    let load = || -> String {
        let (_, vm) = model::build(gcfg, 3, &Device::Cpu).expect("builds");
        match hf::load_into(&d, &cfg, &gcfg, &vm) {
            Ok(()) => "(no error)".into(),
            Err(e) => format!("{e:#}"),
        }
    };
    let mut bad = index.clone();
    bad["weight_map"]["wpe.weight"] = "model-00001-of-00002.safetensors".into();
    std::fs::write(&index_path, bad.to_string())?;
    let e = load();
    assert!(
        e.contains("no `wpe.weight`") && e.contains("model-00001"),
        "{e}"
    );
    bad["weight_map"]["wpe.weight"] = "../elsewhere.safetensors".into();
    std::fs::write(&index_path, bad.to_string())?;
    assert!(load().contains("not a file in the directory"), "{}", load());
    std::fs::write(&index_path, "{\"weight_map\": 3}")?;
    assert!(load().contains("not a safetensors index"), "{}", load());
    std::fs::remove_file(&index_path)?;
    std::fs::write(d.join("pytorch_model.bin"), b"not read")?;
    let e = load();
    assert!(
        e.contains("no model.safetensors") && e.contains("safe_serialization"),
        "{e}"
    );
    Ok(())
}

#[test]
fn a_loaded_checkpoint_trains_and_exports_in_its_own_layout() -> Result<()> {
    let d = dir("roundtrip")?;
    let input = synthetic(&d, "gelu_new")?;
    let out = d.join("export");
    let corpus = data::Corpus::bundled(); // bytes: below the 300 tokens
    let cfg = TrainConfig {
        level: Level::O2,
        compute: Compute::Native,
        init_from: Some(d.clone()),
        vocab: 320,
        steps: 2,
        batch: 4,
        seq: 32,
        warmup: 1,
        eval_every: 2,
        eval_batches: 1,
        export: Some((out.clone(), ExportDType::F32)),
        ..Default::default()
    };
    train(&cfg, &corpus)?;
    let exported = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu)?;
    for (name, t) in &input {
        if name.ends_with(".attn.bias") {
            continue; // a buffer, not a weight
        }
        let e = exported
            .get(&format!("transformer.{name}"))
            .ok_or_else(|| anyhow::anyhow!("the export has no {name}"))?;
        assert_eq!(e.dims(), t.dims(), "{name}");
        assert_eq!(e.dtype(), t.dtype(), "{name}");
    }
    // tied as the checkpoint is (GPT-2's default): no head of its own
    assert!(!exported.contains_key("lm_head.weight"));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json"))?)?;
    assert_eq!(config["vocab_size"], 300);
    assert_eq!(config["n_positions"], 64);
    assert_eq!(config["tie_word_embeddings"], true);
    assert!(!out.join(".amp-export.safetensors").exists());
    // untied on request: the head starts as wte and trains apart,
    // trimmed back to the checkpoint's vocabulary
    let untied = d.join("export-untied");
    let cfg = TrainConfig {
        tie_embeddings: Some(false),
        export: Some((untied.clone(), ExportDType::F32)),
        ..cfg
    };
    train(&cfg, &corpus)?;
    let exported = candle_core::safetensors::load(untied.join("model.safetensors"), &Device::Cpu)?;
    assert_eq!(exported["lm_head.weight"].dims(), [300, 32]);
    let head = exported["lm_head.weight"].flatten_all()?.to_vec1::<f32>()?;
    let wte = exported["transformer.wte.weight"]
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert_ne!(head, wte, "two steps move them apart");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(untied.join("config.json"))?)?;
    assert_eq!(config["tie_word_embeddings"], false);
    // that export, loaded back: untied, and tying it is refused (the head
    // would be lost)
    let tie = TrainConfig {
        init_from: Some(untied.clone()),
        tie_embeddings: Some(true),
        export: None,
        ..cfg.clone()
    };
    let e = format!("{:#}", train(&tie, &corpus).unwrap_err());
    assert!(e.contains("tie_word_embeddings false"), "{e}");
    let again = TrainConfig {
        tie_embeddings: None,
        ..tie
    };
    assert!(!again.model()?.0.tied);
    Ok(())
}

#[test]
fn an_export_computes_the_loss_the_run_reported() -> Result<()> {
    let corpus = data::Corpus::bundled();
    for (level, dtype, tol, tied) in [
        (Level::O0, ExportDType::F32, 1e-4, false),
        (Level::O2, ExportDType::BF16, 0.05, false),
        (Level::O2, ExportDType::F32, 1e-4, true),
    ] {
        let out = dir(&format!("export-{level}-{tied}"))?;
        let cfg = TrainConfig {
            level,
            tie_embeddings: Some(tied),
            compute: Compute::Native,
            steps: 5,
            batch: 8,
            seq: 32,
            warmup: 5,
            eval_every: 10,
            eval_batches: 2,
            export: Some((out.clone(), dtype)),
            ..Default::default()
        };
        let s = train(&cfg, &corpus)?;
        let tensors = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu)?;
        let want = if dtype == ExportDType::F32 {
            DType::F32
        } else {
            DType::BF16
        };
        for t in tensors.values() {
            assert_eq!(t.dtype(), want);
        }
        // GPT-2's Conv1D layout: [in, out]
        assert_eq!(
            tensors["transformer.h.3.attn.c_attn.weight"].dims(),
            [128, 384]
        );
        assert_eq!(
            tensors["transformer.h.0.mlp.c_proj.weight"].dims(),
            [512, 128]
        );
        let r = Reference::load(&out)?;
        let mut sum = 0.0;
        for i in 0..cfg.eval_batches as u64 {
            let (x, y) = corpus.batch(
                data::Split::Val,
                i,
                cfg.seed,
                cfg.batch,
                cfg.seq,
                &Device::Cpu,
            )?;
            sum += r.loss(&x, &y)?;
        }
        let loss = sum / cfg.eval_batches as f32;
        assert!(
            (loss - s.val_loss).abs() <= tol * s.val_loss,
            "{level}: {loss} vs {}",
            s.val_loss
        );
    }
    Ok(())
}

#[test]
fn bad_checkpoints_are_errors_that_say_what() -> Result<()> {
    let d = dir("bad")?;
    let err = |d: &Path| -> String {
        let run = || -> Result<()> {
            let cfg = hf::read_config(d)?;
            let g = hf::model_config(&cfg, 256, 64);
            let (_, vm) = model::build(g, 0, &Device::Cpu)?;
            hf::load_into(d, &cfg, &g, &vm)
        };
        match run() {
            Ok(()) => "(no error)".into(),
            Err(e) => format!("{e:#}"),
        }
    };
    // an activation this model does not compute
    synthetic(&d, "gelu")?;
    assert!(err(&d).contains("activation_function"), "{}", err(&d));
    // a Conv1D weight stored the other way round
    let mut t = synthetic(&d, "gelu_new")?;
    let w = t["h.1.mlp.c_fc.weight"].t()?.contiguous()?;
    t.insert("h.1.mlp.c_fc.weight".into(), w);
    candle_core::safetensors::save(&t, d.join("model.safetensors"))?;
    let e = err(&d);
    assert!(
        e.contains("h.1.mlp.c_fc.weight") && e.contains("transposed"),
        "{e}"
    );
    // a missing tensor, and one this model does not know
    let mut t = synthetic(&d, "gelu_new")?;
    t.remove("h.0.ln_2.bias");
    candle_core::safetensors::save(&t, d.join("model.safetensors"))?;
    assert!(err(&d).contains("h.0.ln_2.bias"), "{}", err(&d));
    let mut t = synthetic(&d, "gelu_new")?;
    t.insert(
        "h.0.adapter.weight".into(),
        Tensor::zeros(3, DType::F32, &Device::Cpu)?,
    );
    candle_core::safetensors::save(&t, d.join("model.safetensors"))?;
    assert!(err(&d).contains("h.0.adapter.weight"), "{}", err(&d));
    // no config
    std::fs::remove_file(d.join("config.json"))?;
    assert!(err(&d).contains("config.json"), "{}", err(&d));
    Ok(())
}
