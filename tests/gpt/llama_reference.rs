//! The Llama example's Hugging Face import and export against an
//! independent Llama forward written from `transformers`' `modeling_llama.py`
//! semantics in float64 candle ops on the tensors as a checkpoint stores
//! them (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
//! `down_proj`, `nn.Linear`'s `[out, in]`), RMSNorm, `rotate_half` RoPE with
//! Llama 3's frequency scaling computed here from the config, grouped-query
//! attention by repeating key/value heads, a tied head. It shares no code
//! with the example's model: the example's loss on its first batch, from a
//! random checkpoint, must be the reference's, and its export must give the
//! reference the same loss again.

use crate::data;
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use std::collections::HashMap;
use std::f64::consts::PI;

const LAYERS: usize = 2;
const DIM: usize = 64;
const HEADS: usize = 4;
const KV: usize = 2;
const INNER: usize = 96;
const VOCAB: usize = 256;
const SEQ: usize = 16;

/// A random Llama checkpoint in Hugging Face's names (tied head, Llama 3
/// RoPE scaling with a short original context so that all three of its
/// frequency bands occur).
fn write_checkpoint(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let hd = DIM / HEADS;
    let mut out: Vec<(String, Tensor)> = Vec::new();
    // each tensor its own stream: seeded by its name
    let mut put = |name: String, shape: &[usize], scale: f64| -> Result<()> {
        let n = shape.iter().product();
        let t = Tensor::from_vec(
            crate::init::normal(1, &name, scale, n)?,
            shape,
            &Device::Cpu,
        )?;
        out.push((name, t));
        Ok(())
    };
    put("model.embed_tokens.weight".into(), &[VOCAB, DIM], 0.1)?;
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}.");
        put(format!("{p}input_layernorm.weight"), &[DIM], 0.2)?;
        put(
            format!("{p}self_attn.q_proj.weight"),
            &[HEADS * hd, DIM],
            0.15,
        )?;
        put(format!("{p}self_attn.k_proj.weight"), &[KV * hd, DIM], 0.15)?;
        put(format!("{p}self_attn.v_proj.weight"), &[KV * hd, DIM], 0.15)?;
        put(format!("{p}self_attn.o_proj.weight"), &[DIM, DIM], 0.1)?;
        put(format!("{p}post_attention_layernorm.weight"), &[DIM], 0.2)?;
        put(format!("{p}mlp.gate_proj.weight"), &[INNER, DIM], 0.15)?;
        put(format!("{p}mlp.up_proj.weight"), &[INNER, DIM], 0.15)?;
        put(format!("{p}mlp.down_proj.weight"), &[DIM, INNER], 0.1)?;
    }
    put("model.norm.weight".into(), &[DIM], 0.2)?;
    // norm scales around 1
    let out: Vec<(String, Tensor)> = out
        .into_iter()
        .map(|(k, v)| {
            let v = if k.ends_with("norm.weight") {
                (v + 1.0)?
            } else {
                v
            };
            Ok((k, v))
        })
        .collect::<Result<_>>()?;
    amp::levels::write_tensors(&dir.join("model.safetensors"), &out)?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": INNER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        "hidden_act": "silu", "tie_word_embeddings": true,
    });
    std::fs::write(dir.join("config.json"), config.to_string())?;
    Ok(())
}

/// The reference forward on a checkpoint directory, in float64.
struct Reference {
    t: HashMap<String, Tensor>,
    cfg: serde_json::Value,
}

impl Reference {
    fn load(dir: &std::path::Path) -> Result<Self> {
        let cfg = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
        let t = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?
            .into_iter()
            .map(|(k, v)| Ok((k, v.to_dtype(DType::F64)?)))
            .collect::<Result<_>>()?;
        Ok(Self { t, cfg })
    }

    fn w(&self, name: &str) -> Result<&Tensor> {
        self.t.get(name).with_context(|| format!("no {name}"))
    }

    fn num(&self, key: &str) -> f64 {
        self.cfg[key].as_f64().unwrap_or(f64::NAN)
    }

    fn rms(&self, x: &Tensor, name: &str) -> Result<Tensor> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        let y = x.broadcast_div(&(ms + self.num("rms_norm_eps"))?.sqrt()?)?;
        Ok(y.broadcast_mul(self.w(name)?)?)
    }

    /// `x @ Wᵀ` of an `nn.Linear` weight.
    fn linear(&self, x: &Tensor, name: &str) -> Result<Tensor> {
        Ok(x.broadcast_matmul(&self.w(name)?.t()?)?)
    }

    /// cos and sin `[t, hd]` (each frequency twice), Llama 3's scaling.
    fn rope(&self, t: usize, hd: usize) -> Result<(Tensor, Tensor)> {
        let theta = self.num("rope_theta");
        let s = &self.cfg["rope_scaling"];
        let (factor, low, high) = (
            s["factor"].as_f64().unwrap_or(1.0),
            s["low_freq_factor"].as_f64().unwrap_or(1.0),
            s["high_freq_factor"].as_f64().unwrap_or(1.0),
        );
        let orig = s["original_max_position_embeddings"]
            .as_f64()
            .unwrap_or(1.0);
        let freqs: Vec<f64> = (0..hd / 2)
            .map(|i| {
                let f = 1.0 / theta.powf(2.0 * i as f64 / hd as f64);
                let wavelen = 2.0 * PI / f;
                if wavelen < orig / high {
                    f
                } else if wavelen > orig / low {
                    f / factor
                } else {
                    let smooth = (orig / wavelen - low) / (high - low);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            })
            .collect();
        let mut cos = Vec::with_capacity(t * hd);
        let mut sin = Vec::with_capacity(t * hd);
        for p in 0..t {
            for k in 0..hd {
                let a = p as f64 * freqs[k % (hd / 2)];
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok((
            Tensor::from_vec(cos, (t, hd), &Device::Cpu)?,
            Tensor::from_vec(sin, (t, hd), &Device::Cpu)?,
        ))
    }

    /// Mean cross-entropy of next-token prediction of `x` against `y`.
    fn loss(&self, x: &Tensor, y: &Tensor) -> Result<f64> {
        let (b, t) = x.dims2()?;
        let hd = DIM / HEADS;
        let (cos, sin) = self.rope(t, hd)?;
        let rotate = |z: &Tensor| -> Result<Tensor> {
            let (a, c) = (z.narrow(3, 0, hd / 2)?, z.narrow(3, hd / 2, hd / 2)?);
            let half = Tensor::cat(&[&c.neg()?, &a], 3)?;
            Ok((z.broadcast_mul(&cos)? + half.broadcast_mul(&sin)?)?)
        };
        let embed = self.w("model.embed_tokens.weight")?;
        let mut h = embed
            .index_select(&x.flatten_all()?, 0)?
            .reshape((b, t, DIM))?;
        let mask: Vec<f64> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f64::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        for i in 0..LAYERS {
            let p = format!("model.layers.{i}.");
            let n = self.rms(&h, &format!("{p}input_layernorm.weight"))?;
            let heads = |name: &str, count: usize| -> Result<Tensor> {
                Ok(self
                    .linear(&n, &format!("{p}self_attn.{name}.weight"))?
                    .reshape((b, t, count, hd))?
                    .transpose(1, 2)?
                    .contiguous()?)
            };
            let q = rotate(&heads("q_proj", HEADS)?)?;
            let k = rotate(&heads("k_proj", KV)?)?;
            let v = heads("v_proj", KV)?;
            // repeat_kv: key/value head j serves query heads j*g .. (j+1)*g
            let rep = |z: &Tensor| -> Result<Tensor> {
                let parts: Vec<Tensor> = (0..HEADS)
                    .map(|h| z.narrow(1, h / (HEADS / KV), 1))
                    .collect::<candle_core::Result<_>>()?;
                Ok(Tensor::cat(&parts, 1)?)
            };
            let s = (q.matmul(&rep(&k)?.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
            let a = candle_nn::ops::softmax(&s, D::Minus1)?.matmul(&rep(&v)?)?;
            let a = a.transpose(1, 2)?.reshape((b, t, DIM))?;
            h = (h + self.linear(&a, &format!("{p}self_attn.o_proj.weight"))?)?;
            let n = self.rms(&h, &format!("{p}post_attention_layernorm.weight"))?;
            let g = self.linear(&n, &format!("{p}mlp.gate_proj.weight"))?;
            let u = self.linear(&n, &format!("{p}mlp.up_proj.weight"))?;
            let m = (candle_nn::ops::silu(&g)? * u)?;
            h = (h + self.linear(&m, &format!("{p}mlp.down_proj.weight"))?)?;
        }
        let n = self.rms(&h, "model.norm.weight")?;
        let head = self.t.get("lm_head.weight").unwrap_or(embed);
        let logits = n.broadcast_matmul(&head.t()?)?.reshape((b * t, VOCAB))?;
        let lse = logits.exp()?.sum_keepdim(1)?.log()?;
        let picked = logits.gather(&y.flatten_all()?.unsqueeze(1)?, 1)?;
        Ok((lse - picked)?.mean_all()?.to_scalar::<f64>()?)
    }
}

#[test]
fn llama_import_and_export_match_an_independent_forward() -> Result<()> {
    let Some(bin) = crate::llama::llama_bin() else {
        eprintln!("skipped: target/*/examples/llama not built");
        return Ok(());
    };
    let dir = std::env::temp_dir().join(format!("amp-llama-{}-reference", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (src, out) = (dir.join("src"), dir.join("out"));
    write_checkpoint(&src)?;
    let args = [
        "--init-from",
        src.to_str().unwrap_or("src"),
        "--export",
        out.to_str().unwrap_or("out"),
        "--steps",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--lr",
        "1e-30",
        "--warmup",
        "0",
        "--eval-batches",
        "1",
    ];
    let runs = crate::llama::run(&bin, &args)?;
    let ours = runs[0]["first_loss"].as_f64().context("first_loss")?;
    let corpus = data::Corpus::bundled();
    let (x, y) = corpus.batch(data::Split::Train, 0, 0, 2, SEQ, &Device::Cpu)?;
    let want = Reference::load(&src)?.loss(&x, &y)?;
    // logits of moderate size: the loss near ln(256), sensitive to every part
    assert!((3.0..9.0).contains(&want), "reference loss {want}");
    assert!(
        (ours - want).abs() < 1e-4 * want,
        "ours {ours}, reference {want}"
    );
    // the export (tied as the source, this model's rows split back) reads
    // the same
    let again = Reference::load(&out)?.loss(&x, &y)?;
    assert!(
        (again - want).abs() < 1e-6 * want,
        "exported {again}, source {want}"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json"))?)?;
    assert_eq!(config["tie_word_embeddings"], true);
    let exported = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu)?;
    assert!(!exported.contains_key("lm_head.weight"));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn llama_configs_this_model_does_not_compute_are_refused() -> Result<()> {
    let Some(bin) = crate::llama::llama_bin() else {
        eprintln!("skipped: target/*/examples/llama not built");
        return Ok(());
    };
    let dir = std::env::temp_dir().join(format!("amp-llama-{}-configs", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_checkpoint(&dir)?;
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    for (field, value, says) in [
        ("head_dim", serde_json::json!(DIM / HEADS / 2), "head_dim"),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
        ("attention_bias", serde_json::json!(true), "biases"),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
            "yarn",
        ),
    ] {
        let mut c = good.clone();
        c[field] = value;
        std::fs::write(dir.join("config.json"), c.to_string())?;
        let out = std::process::Command::new(&bin)
            .args(["--init-from", dir.to_str().unwrap_or("d"), "--steps", "1"])
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{field}: {err}");
        assert!(err.contains(says), "{field}: {err}");
    }
    // a stated head_dim that agrees is fine
    let mut c = good.clone();
    c["head_dim"] = serde_json::json!(DIM / HEADS);
    std::fs::write(dir.join("config.json"), c.to_string())?;
    let args = [
        "--init-from",
        dir.to_str().unwrap_or("d"),
        "--steps",
        "1",
        "--batch",
        "2",
    ];
    crate::llama::run(
        &bin,
        &[&args[..], &["--seq", "16", "--eval-batches", "1"]].concat(),
    )?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
