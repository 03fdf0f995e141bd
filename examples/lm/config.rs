//! One run's settings ([`TrainConfig`]: what the CLI and the tests fill
//! in) and what follows from them before anything is built: the model's
//! shape, whether the head's loss runs over chunks of rows, and the
//! memory estimate the CLI checks against the free memory.

use crate::hf::{self, HfConfig};
use crate::model::Config;
use amp::levels::{AmpConfig, Compute, ExportDType, Level};
use anyhow::{bail, Result};
use candle_core::{DType, Device};
use std::path::PathBuf;

/// Everything one run needs.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Model size by name (`model::SIZES`).
    pub size: String,
    /// Vocabulary of the model (256 for bytes; larger only to match the
    /// shapes of GPU benchmarks).
    pub vocab: usize,
    /// The level.
    pub level: Level,
    /// The compute path.
    pub compute: Compute,
    /// Linear weights (name patterns) kept in high precision.
    pub high_precision: Vec<String>,
    /// Optimizer steps in all (a resumed run continues to this); the
    /// learning-rate schedule spans them.
    pub steps: u64,
    /// Stop after this step (save, then resume later to go on).
    pub stop_at: Option<u64>,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence (also the model's context).
    pub seq: usize,
    /// Peak learning rate (linear warmup, cosine decay to a tenth).
    pub lr: f64,
    /// Warmup steps.
    pub warmup: u64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the global gradient norm to this.
    pub max_grad_norm: Option<f64>,
    /// Seed of the weights, the batches and the sampler.
    pub seed: u64,
    /// Validation every this many steps (and after the last).
    pub eval_every: u64,
    /// Batches per validation.
    pub eval_batches: usize,
    /// Dtype of the activations between layers (F32 or BF16).
    pub activations: DType,
    /// Keep cudarc's per-allocation CUDA events (off by default: one
    /// stream never waits on them).
    pub event_tracking: bool,
    /// Where to run.
    pub device: Device,
    /// Write a checkpoint here at the end.
    pub save: Option<PathBuf>,
    /// Also write it every this many steps (replacing the last).
    pub save_every: Option<u64>,
    /// Start from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Start from this Hugging Face directory of the architecture (`model.safetensors`,
    /// `config.json`; its shape replaces `size`, `vocab` pads its vocabulary).
    pub init_from: Option<PathBuf>,
    /// Tie the head to the embedding (`Some(true)`), keep them apart
    /// (`Some(false)`: a tied checkpoint's head starts as a copy), or as
    /// the `init_from` checkpoint says (`None`; untied without one).
    pub tie_embeddings: Option<bool>,
    /// Export the trained weights as a Hugging Face directory here.
    pub export: Option<(PathBuf, ExportDType)>,
    /// Tokens to generate at the end.
    pub sample: usize,
    /// How the sample's prompt and output are tokenized.
    pub codec: crate::data::codec::Codec,
    /// Text the sample continues.
    pub prompt: String,
    /// Draw a progress bar.
    pub progress: bool,
    /// Data-parallel ranks (threads of this process, the in-process
    /// backend); each takes `batch / world_size` sequences of every batch.
    pub world_size: usize,
    /// Data parallelism's bucket cap, MiB of F32 (`AmpConfig::bucket_mb`).
    pub bucket_mb: f64,
    /// Micro-batches a rank's share of each batch is split into, their
    /// gradients communicated once (`AmpOptimizer::backward_accumulate`).
    pub grad_accum: usize,
    /// Reduce buckets while the backward runs (`AmpConfig::overlap_backward`).
    pub overlap: bool,
    /// F32 gradients in BF16 on the wire (`AmpConfig::bf16_wire`).
    pub bf16_wire: bool,
    /// FP8 buckets reduced in one shot (`AmpConfig::fp8_one_shot`).
    pub fp8_one_shot: bool,
    /// The token table's gradient from its rows
    /// (`AmpConfig::embedding_rows`; on: the examples' batches have one
    /// shape on every rank).
    pub embedding_rows: bool,
    /// The optimizer reads the step's outcome before it updates
    /// (`AmpConfig::lean_step`).
    pub lean_step: bool,
    /// The step's outcome left on the device and read at the next step
    /// (`AmpConfig::defer_outcome`).
    pub defer_outcome: bool,
    /// Both Adam moments in FP8 (`AmpConfig::fp8_moments`; O2 and O3).
    pub fp8_moments: bool,
    /// The MLP's activation input kept as E4M3 tiles for its backward
    /// (`amp::nn::set_fp8_activation_inputs`, on each rank's thread).
    pub fp8_activation_inputs: bool,
    /// The head's loss over chunks of about this many rows
    /// (`amp::nn::set_loss_chunk_rows`, on each rank's thread; 0: the whole
    /// logits at once).
    pub loss_chunk_rows: usize,
    /// Which activations the blocks recompute in backward.
    pub recompute: crate::recompute::Recompute,
    /// Precision telemetry every this many steps, written into this
    /// folder (`crate::telemetry`; rank 0's layers).
    pub telemetry: Option<(u64, PathBuf)>,
    /// Steps at the start left out of tokens/s and the median step time
    /// (warm-up: kernel loading, cuBLASLt plans, the memory pool growing).
    pub timing_skip: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            size: "tiny".into(),
            vocab: crate::data::VOCAB,
            level: Level::O0,
            compute: Compute::Native,
            high_precision: Vec::new(),
            steps: 300,
            stop_at: None,
            batch: 16,
            seq: 64,
            lr: 3e-3,
            warmup: 20,
            weight_decay: 0.1,
            max_grad_norm: Some(1.0),
            seed: 0,
            eval_every: 50,
            eval_batches: 8,
            device: Device::Cpu,
            save: None,
            save_every: None,
            resume: None,
            init_from: None,
            tie_embeddings: None,
            export: None,
            sample: 0,
            codec: Default::default(),
            prompt: "And God said".into(),
            progress: false,
            world_size: 1,
            bucket_mb: amp::levels::DEFAULT_BUCKET_MB,
            grad_accum: 1,
            overlap: true,
            bf16_wire: false,
            fp8_one_shot: false,
            embedding_rows: true,
            lean_step: false,
            defer_outcome: true,
            fp8_moments: false,
            fp8_activation_inputs: false,
            loss_chunk_rows: amp::nn::DEFAULT_LOSS_CHUNK_ROWS,
            recompute: crate::recompute::Recompute::None,
            telemetry: None,
            timing_skip: 0,
            activations: DType::F32,
            event_tracking: false,
        }
    }
}

impl TrainConfig {
    /// The model's shape: the named size, or the `init_from` checkpoint's
    /// (with its configuration).
    ///
    /// # Errors
    /// An unknown size; an unreadable or unsupported checkpoint config.
    pub fn model(&self) -> Result<(Config, Option<HfConfig>)> {
        let (mut shape, hf) = self.shape()?;
        // (tying an untied checkpoint is refused on load where its file
        // has a head of its own: `hf_io::head_tensor`)
        if let Some(tied) = self.tie_embeddings {
            shape.tied = tied;
        }
        Ok((shape, hf))
    }

    /// [`Self::model`] before the run's tying.
    fn shape(&self) -> Result<(Config, Option<HfConfig>)> {
        Ok(match &self.init_from {
            Some(dir) => {
                let hf = hf::read_config(dir)?;
                if self.seq > hf.positions() {
                    bail!(
                        "--seq {}: {} has {} positions",
                        self.seq,
                        dir.display(),
                        hf.positions()
                    );
                }
                (hf::model_config(&hf, self.vocab, self.seq), Some(hf))
            }
            None => (Config::named(&self.size, self.vocab, self.seq)?, None),
        })
    }
}

/// Whether the head's loss runs over chunks of rows
/// (`amp::nn::set_loss_chunk_rows`): per-tensor FP8 in all three of the
/// head's GEMMs (the example's heads have no bias), the head not kept in
/// high precision.
fn head_chunks(cfg: &TrainConfig) -> bool {
    let fp8 = match &cfg.compute {
        Compute::Fp8Current { .. } => true,
        Compute::Fp8Delayed { recipe } => {
            let o = recipe.override_linear_precision;
            !(o.fprop || o.dgrad || o.wgrad)
        }
        _ => false,
    };
    let patterns = AmpConfig {
        high_precision: cfg.high_precision.clone(),
        ..Default::default()
    };
    // a tied head is also named by its embedding's variable
    let names = ["lm_head.weight", "wte.weight", "embed.weight"];
    // (tied unless said otherwise: the model's default decides, Llama's is tied)
    let tied = cfg.tie_embeddings != Some(false);
    fp8 && !names
        .iter()
        .take(if tied { 3 } else { 1 })
        .any(|n| patterns.is_high_precision(n))
}

/// The memory estimate of this run (`crate::budget`): what the example
/// checks against the free memory before it starts.
pub fn memory_estimate(cfg: &TrainConfig, g: &Config, world: usize) -> crate::budget::Estimate {
    let in_process = cfg.world_size.max(1);
    let shards = world.max(in_process);
    let flash = cfg.device.is_cuda() && g.flash_head_dim() && amp::nn::flash_attention_enabled();
    let run = crate::budget::Run {
        batch: cfg.batch / shards,
        seq: cfg.seq,
        ranks: in_process,
        shards,
        act_bytes: cfg.activations.size_in_bytes(),
        flash,
        recompute: cfg.recompute,
        native: matches!(cfg.compute, Compute::Native),
        native_graph: matches!(cfg.compute, Compute::Native)
            && cfg.level == Level::O0
            && cfg.device.is_cuda()
            && !(amp::nn::native_op_on_cuda() && cfg.activations != DType::F32),
        gpu: cfg.device.is_cuda(),
        lean: cfg.lean_step,
        fp8_moments: cfg.fp8_moments,
        fp8_act_inputs: cfg.fp8_activation_inputs,
        loss_chunk_rows: if head_chunks(cfg) {
            cfg.loss_chunk_rows
        } else {
            0
        },
    };
    crate::budget::estimate(&g.shape(), cfg.level, &run)
}
