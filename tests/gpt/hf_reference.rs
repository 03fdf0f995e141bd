//! An independent GPT-2 forward written from Hugging Face's
//! `modeling_gpt2.py` semantics with plain candle ops, on the tensors of a
//! Hugging Face checkpoint as they are stored: `Conv1D` weights `[in,
//! out]` applied as `x @ W + b`, `lm_head` `[vocab, d]` (or `wte` when
//! absent), LayerNorm with a biased variance, GELU's tanh form
//! (`gelu_new`), attention scaled by `1 / sqrt(head dim)` with a causal
//! mask. It shares no code with the example's model.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use std::collections::HashMap;

/// The tensors of a checkpoint, without the `transformer.` prefix, F32.
pub struct Reference {
    t: HashMap<String, Tensor>,
    n_layer: usize,
    n_head: usize,
    eps: f64,
}

impl Reference {
    /// From a directory written as `save_pretrained` writes it.
    pub fn load(dir: &std::path::Path) -> Result<Self> {
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
        let raw = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
        let t = raw
            .into_iter()
            .map(|(k, v)| {
                let k = k.strip_prefix("transformer.").unwrap_or(&k).to_string();
                Ok((k, v.to_dtype(DType::F32)?))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        Ok(Self {
            t,
            n_layer: cfg["n_layer"].as_u64().context("n_layer")? as usize,
            n_head: cfg["n_head"].as_u64().context("n_head")? as usize,
            eps: cfg["layer_norm_epsilon"].as_f64().unwrap_or(1e-5),
        })
    }

    fn w(&self, name: &str) -> Result<&Tensor> {
        self.t.get(name).with_context(|| format!("no {name}"))
    }

    fn layer_norm(&self, x: &Tensor, p: &str) -> Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
        let y = xc.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        Ok(y.broadcast_mul(self.w(&format!("{p}.weight"))?)?
            .broadcast_add(self.w(&format!("{p}.bias"))?)?)
    }

    /// `Conv1D`: `x @ W + b`, `W` `[in, out]`.
    fn conv1d(&self, x: &Tensor, p: &str) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let w = self.w(&format!("{p}.weight"))?;
        let y = x.reshape((b * t, d))?.matmul(w)?;
        Ok(y.broadcast_add(self.w(&format!("{p}.bias"))?)?
            .reshape((b, t, w.dim(1)?))?)
    }

    fn gelu_new(x: &Tensor) -> Result<Tensor> {
        let c = (2.0f64 / std::f64::consts::PI).sqrt();
        let inner = ((x + (x.powf(3.0)? * 0.044715)?)? * c)?;
        Ok(((x * 0.5)? * (inner.tanh()? + 1.0)?)?)
    }

    /// Logits `[batch, seq, vocab]` of `tokens` `[batch, seq]` (u32).
    pub fn logits(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let wte = self.w("wte.weight")?;
        let d = wte.dim(1)?;
        let (nh, hd) = (self.n_head, d / self.n_head);
        let pos = Tensor::arange(0u32, t as u32, &Device::Cpu)?;
        let mut h = wte
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, t, d))?
            .broadcast_add(&self.w("wpe.weight")?.index_select(&pos, 0)?)?;
        // the causal mask: -inf above the diagonal
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        for i in 0..self.n_layer {
            let a = self.layer_norm(&h, &format!("h.{i}.ln_1"))?;
            let qkv = self.conv1d(&a, &format!("h.{i}.attn.c_attn"))?;
            let heads = |k: usize| -> Result<Tensor> {
                Ok(qkv
                    .narrow(2, k * d, d)?
                    .reshape((b, t, nh, hd))?
                    .transpose(1, 2)?
                    .contiguous()?)
            };
            let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
            let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let y = att
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b, t, d))?;
            h = (h + self.conv1d(&y, &format!("h.{i}.attn.c_proj"))?)?;
            let m = self.layer_norm(&h, &format!("h.{i}.ln_2"))?;
            let m = Self::gelu_new(&self.conv1d(&m, &format!("h.{i}.mlp.c_fc"))?)?;
            h = (h + self.conv1d(&m, &format!("h.{i}.mlp.c_proj"))?)?;
        }
        let h = self.layer_norm(&h, "ln_f")?;
        let head = match self.t.get("lm_head.weight") {
            Some(w) => w,
            None => wte,
        };
        Ok(h.reshape((b * t, d))?
            .matmul(&head.t()?)?
            .reshape((b, t, head.dim(0)?))?)
    }

    /// Mean next-token cross-entropy.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<f32> {
        let logits = self.logits(x)?;
        let v = logits.dim(2)?;
        let l = candle_nn::loss::cross_entropy(&logits.reshape(((), v))?, &y.flatten_all()?)?;
        Ok(l.to_scalar::<f32>()?)
    }
}
