//! A tiny Llama-style decoder built from `amp::nn`'s parts (RMSNorm,
//! rotary positions, grouped-query attention, the SwiGLU MLP, the handed
//! head and loss) trains at every level: the loss falls, and the FP8
//! levels end within 5% of O0's.

use amp::levels::{initialize, AmpConfig, Compute, Level};
use amp::nn::{self, Activation, MlpForm};
use amp::optim::AdamWConfig;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

const VOCAB: usize = 48;
const DIM: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HIDDEN: usize = 48;
const SEQ: usize = 16;

struct Block {
    attn_norm: nn::RmsNorm,
    qkv: nn::Linear,
    o: nn::Linear,
    mlp: nn::LayerNormMLP,
}

struct Llama {
    table: Tensor,
    blocks: Vec<Block>,
    norm: nn::RmsNorm,
    head: nn::Linear,
    cos: Tensor,
    sin: Tensor,
}

fn build(vb: VarBuilder) -> Llama {
    let hd = DIM / HEADS;
    let blocks = (0..2)
        .map(|i| {
            let vb = vb.pp(format!("layers.{i}"));
            Block {
                attn_norm: nn::rms_norm(DIM, 1e-5, vb.pp("attn_norm")).unwrap(),
                qkv: nn::linear_no_bias(DIM, (HEADS + 2 * KV_HEADS) * hd, vb.pp("qkv")).unwrap(),
                o: nn::linear_no_bias(DIM, DIM, vb.pp("o")).unwrap(),
                mlp: nn::layer_norm_mlp_with(DIM, HIDDEN, 1e-5, MlpForm::llama(), vb.pp("mlp"))
                    .unwrap(),
            }
        })
        .collect();
    let init = candle_nn::Init::Randn {
        mean: 0.0,
        stdev: 0.5,
    };
    let (cos, sin) = nn::rope_tables(SEQ, hd, 10_000.0, None, &Device::Cpu).unwrap();
    Llama {
        table: vb.get_with_hints((VOCAB, DIM), "embed", init).unwrap(),
        blocks,
        norm: nn::rms_norm(DIM, 1e-5, vb.pp("norm")).unwrap(),
        head: nn::linear_no_bias(DIM, VOCAB, vb.pp("head")).unwrap(),
        cos,
        sin,
    }
}

impl Llama {
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> amp::Result<Tensor> {
        let mut h = nn::embedding(ids, &self.table)?;
        for b in &self.blocks {
            let rope = (&self.cos, &self.sin);
            h = nn::rope_self_attention(&h, &b.attn_norm, &b.qkv, &b.o, (HEADS, KV_HEADS), rope)?;
            let m = &b.mlp;
            h = nn::pre_norm_mlp_with(&h, &m.norm, &m.fc1, &m.fc2, true, Activation::SwiGlu)?;
        }
        Ok(nn::linear_cross_entropy(
            &h,
            Some(&self.norm),
            &self.head,
            targets,
        )?)
    }
}

/// Sequences of a fixed rule (`next = 5 t + 3 mod VOCAB`) from varied
/// starts: `(inputs, targets)` `[rows, SEQ]`.
fn batch(step: u64, rows: usize) -> (Tensor, Tensor) {
    let mut all = Vec::with_capacity(rows * (SEQ + 1));
    for r in 0..rows {
        let mut t = ((step as usize) * 7 + r * 13) % VOCAB;
        for _ in 0..=SEQ {
            all.push(t as u32);
            t = (5 * t + 3) % VOCAB;
        }
    }
    let all = Tensor::from_vec(all, (rows, SEQ + 1), &Device::Cpu).unwrap();
    (
        all.narrow(1, 0, SEQ).unwrap(),
        all.narrow(1, 1, SEQ).unwrap(),
    )
}

fn train(level: Level) -> (f32, f32) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = build(vb);
    // the same initial values at every level
    {
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for (i, n) in names.into_iter().enumerate() {
            let v = &data[n];
            if !n.ends_with("norm.weight") && !n.ends_with("layer_norm.weight") {
                let scale = if n == "embed" { 1.0 } else { 0.15 };
                let t = crate::common::randt(v.dims(), 300 + i as u64, scale);
                v.set(&t).unwrap();
            }
        }
    }
    let mut cfg = AmpConfig {
        level,
        ..Default::default()
    };
    if level != Level::O0 {
        cfg.compute = Compute::Fp8Current {
            recipe: Default::default(),
        };
    }
    let adam = AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let (amp, mut opt) = initialize(&varmap, adam, cfg).unwrap();
    let (mut first, mut last) = (None, 0.0);
    for step in 0..60u64 {
        let (x, y) = batch(step, 8);
        let s = amp.step(&mut opt, || model.loss(&x, &y)).unwrap();
        last = s.loss.to_scalar::<f32>().unwrap();
        first.get_or_insert(last);
    }
    (first.unwrap_or(f32::NAN), last)
}

#[test]
fn a_tiny_llama_trains_at_every_level() {
    let (o0_first, o0) = train(Level::O0);
    assert!(o0 < 0.5 * o0_first, "O0: {o0_first} -> {o0}");
    for level in [Level::O1, Level::O2, Level::O3] {
        let (first, last) = train(level);
        assert!(last < 0.5 * first, "{level:?}: {first} -> {last}");
        assert!(
            (last - o0).abs() <= 0.05 * o0.max(0.2),
            "{level:?}: {last} against O0's {o0}"
        );
    }
}
