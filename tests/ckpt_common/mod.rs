//! The model, training loop and file helpers of the checkpoint tests.
#![allow(dead_code)] // each test binary uses a different subset

use crate::common::{mse, randn, randt, t};
use amp::comm::Communicator;
use amp::levels::{
    initialize, initialize_distributed, AmpConfig, AmpContext, AmpOptimizer, Compute, Level,
};
use amp::nn::{self, LayerNormMLP, Linear};
use amp::optim::{AdamWConfig, LossScaling};
use amp::{DelayedScaling, Format};
use candle_core::{DType, Device, Module};
use candle_nn::{VarBuilder, VarMap};
use safetensors::SafeTensors;
use std::path::PathBuf;
use std::sync::Arc;

/// A small model with every kind of parameter: Linear weights, a
/// LayerNorm-MLP block, biases.
pub struct Model {
    /// Input projection.
    pub proj: Linear,
    /// LayerNorm and MLP.
    pub block: LayerNormMLP,
    /// Output head.
    pub head: Linear,
}

/// The model of `width` at `level`, with delayed scaling and dynamic loss
/// scaling (every kind of state exists), its weights set from their names.
pub fn build(width: usize, level: Level) -> (Model, AmpContext, AmpOptimizer) {
    build_in(width, level, None)
}

/// [`build`] for one rank of a data-parallel group (`comm`), or alone.
pub fn build_in(
    width: usize,
    level: Level,
    comm: Option<Arc<dyn Communicator>>,
) -> (Model, AmpContext, AmpOptimizer) {
    build_with(width, level, comm, false)
}

/// [`build_in`], with both Adam moments in FP8 (`AmpConfig::fp8_moments`)
/// where `fp8_moments`.
pub fn build_with(
    width: usize,
    level: Level,
    comm: Option<Arc<dyn Communicator>>,
    fp8_moments: bool,
) -> (Model, AmpContext, AmpOptimizer) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Model {
        proj: nn::linear(6, width, vb.pp("proj")).unwrap(),
        block: nn::layer_norm_mlp(width, 2 * width, 1e-5, vb.pp("block")).unwrap(),
        head: nn::linear(width, 3, vb.pp("head")).unwrap(),
    };
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let s = name.bytes().map(u64::from).sum::<u64>();
        let v: Vec<f32> = randn(var.elem_count(), s)
            .iter()
            .map(|x| {
                0.3 * x
                    + if name.contains("layer_norm.weight") {
                        1.0
                    } else {
                        0.0
                    }
            })
            .collect();
        var.set(&t(v, var.dims())).unwrap();
    }
    // Delayed scaling and dynamic loss scaling: every kind of state exists.
    let compute = if level == Level::O0 {
        Compute::Native
    } else {
        Compute::Fp8Delayed {
            recipe: DelayedScaling {
                amax_history_len: 4,
                interval: 2,
                // the format and first step the resharding tests' loss
                // tolerances were measured with (TE's; the defaults are
                // E4M3 and a calibrated first step since)
                fp8_format: Format::Hybrid,
                calibrate_first_step: false,
                ..Default::default()
            },
        }
    };
    let cfg = AmpConfig {
        level,
        compute,
        loss_scaling: LossScaling::Dynamic {
            init_scale: 1024.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2,
        },
        fp8_moments,
        ..Default::default()
    };
    let adam = AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let (amp, opt) = match comm {
        Some(comm) => initialize_distributed(&varmap, adam, cfg, comm).unwrap(),
        None => initialize(&varmap, adam, cfg).unwrap(),
    };
    (model, amp, opt)
}

/// Trains steps `steps` (each on its own batch); the losses.
pub fn train(
    m: &Model,
    amp: &AmpContext,
    opt: &mut AmpOptimizer,
    steps: std::ops::Range<u64>,
) -> Vec<f32> {
    let mut losses = vec![];
    for s in steps {
        let x = randt(&[8, 6], 100 + s, 1.0);
        let y = randt(&[8, 3], 200 + s, 0.5);
        let loss = {
            let _fp8 = amp.autocast();
            let h = m.proj.forward(&x).unwrap();
            let h = (&h + m.block.forward(&h).unwrap()).unwrap();
            mse(&m.head.forward(&h).unwrap(), &y)
        };
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    losses
}

/// `name` in this test process's temporary directory.
pub fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("amp-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// Every tensor's bytes and the metadata of a checkpoint file, sorted.
pub type Contents = (Vec<(String, Vec<u8>)>, Vec<(String, String)>);

pub fn contents(path: &PathBuf) -> Contents {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect();
    tensors.sort();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta: Vec<_> = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    meta.sort();
    (tensors, meta)
}

/// Rewrites one metadata entry of a checkpoint file.
pub fn with_metadata(src: &PathBuf, key: &str, value: &str) -> PathBuf {
    let bytes = std::fs::read(src).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    meta.insert(key.to_string(), value.to_string());
    let views: Vec<(String, safetensors::tensor::TensorView)> = st.tensors();
    let out = safetensors::tensor::serialize(views, Some(meta)).unwrap();
    let p = tmp(&format!("meta-{key}.safetensors"));
    std::fs::write(&p, out).unwrap();
    p
}

/// A copy of checkpoint `src` with tensor `name`'s bytes changed by
/// `edit`, its data checksum (metadata `data_crc32`) recomputed as a save
/// computes it, so that only the values are wrong.
pub fn with_tensor_bytes(src: &PathBuf, name: &str, edit: impl Fn(&mut [u8])) -> PathBuf {
    let bytes = std::fs::read(src).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    owned.sort_by(|a, b| a.0.cmp(&b.0));
    let t = owned
        .iter_mut()
        .find(|t| t.0 == name)
        .expect("no such tensor");
    edit(&mut t.3);
    let mut h = crc32fast::Hasher::new();
    for (n, _, _, data) in &owned {
        h.update(n.as_bytes());
        h.update(data);
    }
    meta.insert("data_crc32".to_string(), h.finalize().to_string());
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, d, s, data)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), data).unwrap(),
            )
        })
        .collect();
    let out = safetensors::tensor::serialize(views, Some(meta)).unwrap();
    let p = tmp(&format!("edited-{}.safetensors", name.replace('.', "_")));
    std::fs::write(&p, out).unwrap();
    p
}
