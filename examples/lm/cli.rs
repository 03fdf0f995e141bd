//! The command line both examples share (`examples/gpt`, `examples/llama`):
//! train a model of the binary's architecture (`crate::model`) on the
//! bundled corpus or your data at any level, or compare levels side by
//! side. The flags are the same for both; `--size` names the
//! architecture's sizes (`crate::model::SIZES`) and `--init-from` /
//! `--export` read and write its Hugging Face layout (`crate::hf`).

use crate::{budget, data, launch, model, report, train};
use amp::levels::{Compute, ExportDType, Level};
use amp::{CurrentScaling, DelayedScaling, Float8BlockScaling, Float8RowwiseScaling};
use anyhow::{Context, Result};
use candle_core::{DType, Device};
use clap::{CommandFactory, Parser, ValueEnum};
use std::io::IsTerminal;
use std::path::PathBuf;
use train::{train, TrainConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ComputeArg {
    Native,
    Fp8Current,
    Fp8Delayed,
    /// Block scaling: 1 x 128 tiles and 128 x 128 weight blocks (TE's Float8BlockScaling).
    Fp8Block,
    /// Rowwise scaling: one scale per row of each operand (torchao's rowwise recipe).
    Fp8Rowwise,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ExportArg {
    F32,
    Bf16,
}

#[derive(Parser, Debug)]
#[command(name = model::BIN, about = model::ABOUT)]
struct Args {
    /// Optimization level.
    #[arg(long, default_value = "O0")]
    level: Level,
    /// Compute path of the matrix products [default: native at O0, fp8-current above].
    #[arg(long, value_enum)]
    compute: Option<ComputeArg>,
    /// Recipe (JSON or TOML): Transformer Engine's DelayedScaling (implies
    /// fp8-delayed), current scaling's (margin, fp8_format, scale_rule) with
    /// --compute fp8-current, Float8BlockScaling with --compute fp8-block,
    /// or the rowwise recipe with --compute fp8-rowwise.
    #[arg(long)]
    recipe: Option<PathBuf>,
    /// Model size (`crate::model::SIZES`; GPT: tiny, 125m, 350m, 760m, 1.3b,
    /// 2.7b, 6.7b, 13b; Llama: tiny, 60m, 1b).
    #[arg(long, default_value = "tiny")]
    size: String,
    /// Optimizer steps in all.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Stop after this step (with --save; --resume goes on), the schedule still spanning --steps.
    #[arg(long)]
    stop_at: Option<u64>,
    /// Sequences per step.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    batch: u64,
    /// Tokens per sequence (the model's context).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(2..))]
    seq: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Warmup steps.
    #[arg(long, default_value_t = 20)]
    warmup: u64,
    /// Seed of the weights, the batches and the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Validation every this many steps.
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u64).range(1..))]
    eval_every: u64,
    /// Batches per validation: windows of the validation split drawn with
    /// a fixed seed, the same for every `--seed`.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    eval_batches: u64,
    /// Linear weights kept in high precision (name patterns, `*` wildcard).
    #[arg(long, value_delimiter = ',')]
    high_precision: Vec<String>,
    /// Model vocabulary: above the data's largest token and at least the
    /// tokenizer's vocabulary (default: 256 for text tokenized by bytes;
    /// with --tokenizer its vocabulary rounded up to a multiple of 64; e.g.
    /// 50304 for GPT-2 token shards).
    #[arg(long, value_parser = clap::value_parser!(u64).range(256..))]
    vocab: Option<u64>,
    /// A Hugging Face `tokenizer.json` for raw text under --data (or the
    /// bundled text) and for --sample's prompt and output (with token
    /// shards: the tokenizer they were made with).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Train on this instead of the bundled corpus: a text file, or token
    /// shards (llm.c's or nanoGPT's `.bin`), one file or a quoted glob such
    /// as 'fineweb10B/fineweb_*.bin'; shards named `_val_` validate.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Write a checkpoint (safetensors, every scale) at the end.
    #[arg(long)]
    save: Option<PathBuf>,
    /// With --save: also write the checkpoint every N steps, replacing the
    /// last (a single-file save is atomic), so a crash loses at most N
    /// steps. SIGINT or SIGTERM always finishes the current step, saves
    /// (with --save) and exits non-zero.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    save_every: Option<u64>,
    /// Start from a checkpoint (of any level).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start from a Hugging Face checkpoint of the architecture (GPT-2, or
    /// Llama): a directory of `model.safetensors` and `config.json` (its
    /// shape replaces --size; --vocab may pad its vocabulary).
    #[arg(long)]
    init_from: Option<PathBuf>,
    /// The output head is the token embedding (`--tie-embeddings`, as GPT-2
    /// and Llama-3.2-1B) or a weight of its own (`--tie-embeddings false`).
    /// Default: as --init-from's config.json says (`tie_word_embeddings`),
    /// else untied. A tied weight stays F32 at every level; the head's
    /// product still runs in the compute path (--high-precision keeps it
    /// out).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    tie_embeddings: Option<bool>,
    /// Export the trained model as a Hugging Face directory of the
    /// architecture (`model.safetensors` in its names and layouts,
    /// `config.json`), which `transformers` loads.
    #[arg(long)]
    export: Option<PathBuf>,
    /// Dtype of the export.
    #[arg(long, value_enum, default_value = "f32")]
    export_dtype: ExportArg,
    /// Generate this many tokens at the end (characters without
    /// --tokenizer).
    #[arg(long, default_value_t = 0)]
    sample: usize,
    /// Text the sample continues.
    #[arg(long, default_value = "And God said")]
    prompt: String,
    /// Print one JSON summary line per run at the end (no progress bar).
    #[arg(long)]
    json: bool,
    /// Leave the first K steps out of tokens/s and the median step time.
    #[arg(long, default_value_t = 0)]
    timing_skip: u64,
    /// Dtype of the activations between layers (the residual stream, the
    /// layers' outputs, the logits); weights and optimizer state are not
    /// affected. BF16 halves what backprop keeps and moves.
    #[arg(long, value_enum, default_value = "f32")]
    activations: ExportArg,
    /// Activations recomputed in backward instead of kept: `selective`
    /// casts the FP8 operands again and recomputes materialized attention's
    /// probabilities (no product runs twice); `full` keeps only each
    /// block's input and runs the block again in backward (least memory,
    /// for a second forward). The same values bit for bit either way.
    #[arg(long, value_enum, default_value = "none")]
    recompute: crate::recompute::Recompute,
    /// On CUDA, materialise the attention's probabilities instead of
    /// running flash attention (the comparison runs of BENCHMARKS.md).
    #[arg(long)]
    no_flash: bool,
    /// On CUDA with BF16 activations, O0's products (and high-precision
    /// layers') through the layers' op with its fused neighbours, as on the
    /// CPU (the default: the same losses as candle's graph, 1.72x its
    /// tokens/s at 350M), or with `--native-op false` through candle's
    /// matmul and graph.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    native_op: bool,
    /// Under current scaling, the Linears' FP8 casts take their amax from
    /// the pass that produced the tensor (an output gradient's from the
    /// bias gradient's column sums, the MLP's second input's from its GELU)
    /// instead of a pass of their own (`amp::nn::set_producer_amax`): the
    /// same values, one read less per cast. On by default (`--producer-amax
    /// false`: the separate amax passes).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    producer_amax: bool,
    /// At O1 and O2 under current scaling, the FP16 weights' FP8 casts for
    /// the next forward made right after each step, all at once
    /// (`amp::nn::set_weight_casts_ahead`): the same values, two launches
    /// for all the weights instead of two a layer. On by default
    /// (`--casts-ahead false`: each forward casts its own).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    casts_ahead: bool,
    /// At the FP8 levels, keep the MLP's activation input (GELU's or
    /// SwiGLU's) for its backward as E4M3 with one scale per 1 x 128 tile
    /// instead of at the activations' width (COAT's FP8 activations): less
    /// memory, one more rounding in the backward. No effect with
    /// --recompute selective.
    #[arg(long)]
    fp8_activation_inputs: bool,
    /// At the per-tensor FP8 levels, where a rank has at least this many
    /// tokens, the head's logits, their loss and both of its gradients made
    /// in the forward over chunks of about this many rows: the whole
    /// logits, their gradient and its FP8 casts never exist at once
    /// (`amp::nn::set_loss_chunk_rows`). 0: the whole logits at once.
    #[arg(long, value_name = "ROWS", default_value_t = amp::nn::DEFAULT_LOSS_CHUNK_ROWS)]
    loss_chunk_rows: usize,
    /// On CUDA, keep cudarc's two CUDA events per allocation (off by
    /// default: candle's stream and NCCL's fenced stream never wait on
    /// them; for A/B runs).
    #[arg(long)]
    event_tracking: bool,
    /// Start even when the memory estimate exceeds what the device has
    /// free (the estimate is within about 10% of measured peaks, mostly
    /// above; `estimated_peak_bytes` in `--json`).
    #[arg(long)]
    no_memory_check: bool,
    /// Run each of these levels in turn on the same data and seed.
    #[arg(long, value_delimiter = ',')]
    compare: Vec<Level>,
    /// Data-parallel ranks (threads, in-process backend); --batch stays the global batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    world_size: u64,
    /// Data parallelism: gradients are reduced in buckets of this many MiB
    /// (counted as F32), as PyTorch DDP's bucket_cap_mb.
    #[arg(long, default_value_t = amp::levels::DEFAULT_BUCKET_MB, value_parser = bucket_mb)]
    bucket_mb: f64,
    /// Gradient accumulation: each rank's share of a batch runs as this
    /// many micro-batches, the gradients summed locally and communicated
    /// once, after the last (PyTorch DDP's no_sync); --batch stays the
    /// global batch, so its share on each rank must divide by this.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    grad_accum: u64,
    /// Data parallelism: reduce every bucket after the backward instead of
    /// starting each while the backward runs (same values, for A/B runs).
    #[arg(long)]
    no_overlap: bool,
    /// With data parallelism: the F32 gradients (embeddings, norms,
    /// biases) in BF16 on the wire, summed in F32 (half their bytes; the
    /// mean rounded to BF16). FP8 gradients are unaffected.
    #[arg(long)]
    bf16_wire: bool,
    /// With data parallelism, each bucket of FP8 gradients reduced in one
    /// shot: every rank's codes to every rank, each summing the whole
    /// bucket (`AmpConfig::fp8_one_shot`; the same values).
    #[arg(long)]
    fp8_one_shot: bool,
    /// With data parallelism: the token embedding's gradient averaged from
    /// every rank's looked-up rows instead of an all-reduce of the whole
    /// table (`AmpConfig::embedding_rows`; the examples' batches have one
    /// shape on every rank, as it needs). `--embedding-rows false`: the
    /// table all-reduced.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = true, default_missing_value = "true", action = clap::ArgAction::Set)]
    embedding_rows: bool,
    /// On a GPU, the optimizer waits for the step's outcome before it
    /// updates, so it keeps no second copy of the weights and moments
    /// (`AmpConfig::lean_step`; the same values). Chosen by itself where
    /// only this fits the memory estimate.
    #[arg(long)]
    lean_step: bool,
    /// On a GPU, the host waits for each step's outcome before it goes
    /// on, instead of leaving it on the device and reading it at the next
    /// step (`AmpConfig::defer_outcome`, the default here; the same
    /// values).
    #[arg(long)]
    sync_outcome: bool,
    /// At O2 and O3, both Adam moments in FP8: the second one as E4M3 codes
    /// of its square root instead of FP16 (`AmpConfig::fp8_moments`; one
    /// byte a parameter less). With --compare, O0 and O1 are run as always.
    #[arg(long)]
    fp8_moments: bool,
    /// CPU threads for candle's kernels, at most the cores [default: half the cores, at least 1].
    /// candle's pool waits in a spin loop, so a thread per core runs far
    /// slower as soon as anything else uses a core.
    #[arg(long)]
    threads: Option<usize>,
    /// Precision telemetry every N steps (and the first and last): each
    /// Linear's FP8 casts (amax, scale, saturated, flushed, relative error)
    /// into `--out`'s telemetry-LEVEL-COMPUTE.jsonl and a heat map (.svg).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    telemetry: Option<u64>,
    /// Folder for the comparison's table and plots.
    #[arg(long, default_value = "out")]
    out: PathBuf,
}

/// `--bucket-mb`: a number of MiB in (0, MAX_BUCKET_MB].
fn bucket_mb(s: &str) -> std::result::Result<f64, String> {
    let max = amp::levels::MAX_BUCKET_MB;
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= max => Ok(v),
        Ok(v) => Err(format!("{v} MiB: must be > 0 and at most {max}")),
        Err(e) => Err(format!("not a number: {e}")),
    }
}

/// A usage error: clap's format, exit code 2.
fn usage(msg: impl std::fmt::Display) -> ! {
    Args::command()
        .error(clap::error::ErrorKind::ValueValidation, msg)
        .exit()
}

/// `--fp8-moments` for one run: O2 and O3 only (a single run at O0 or O1
/// is refused before this; under `--compare` they run as always).
fn fp8_moments_for(args: &Args, level: Level) -> bool {
    args.fp8_moments && matches!(level, Level::O2 | Level::O3)
}

fn compute_for(args: &Args, level: Level) -> Compute {
    if let Some(path) = &args.recipe {
        if args.compute == Some(ComputeArg::Fp8Block) {
            return match Float8BlockScaling::from_path(path) {
                Ok(recipe) => Compute::Fp8Block { recipe },
                Err(e) => usage(format!("--recipe {}: {e}", path.display())),
            };
        }
        if args.compute == Some(ComputeArg::Fp8Rowwise) {
            return match Float8RowwiseScaling::from_path(path) {
                Ok(recipe) => Compute::Fp8Rowwise { recipe },
                Err(e) => usage(format!("--recipe {}: {e}", path.display())),
            };
        }
        if args.compute == Some(ComputeArg::Fp8Current) {
            return match CurrentScaling::from_path(path) {
                Ok(recipe) => Compute::Fp8Current { recipe },
                Err(e) => usage(format!("--recipe {}: {e}", path.display())),
            };
        }
        return match DelayedScaling::from_path(path) {
            Ok(recipe) => Compute::Fp8Delayed { recipe },
            Err(e) => usage(format!("--recipe {}: {e}", path.display())),
        };
    }
    match args.compute {
        Some(ComputeArg::Native) => Compute::Native,
        Some(ComputeArg::Fp8Current) => Compute::Fp8Current {
            recipe: CurrentScaling::default(),
        },
        Some(ComputeArg::Fp8Delayed) => Compute::Fp8Delayed {
            recipe: DelayedScaling::default(),
        },
        Some(ComputeArg::Fp8Block) => Compute::Fp8Block {
            recipe: Float8BlockScaling::default(),
        },
        Some(ComputeArg::Fp8Rowwise) => Compute::Fp8Rowwise {
            recipe: Float8RowwiseScaling::default(),
        },
        None if level == Level::O0 => Compute::Native,
        None => Compute::Fp8Current {
            recipe: CurrentScaling::default(),
        },
    }
}

fn device(name: &str) -> Device {
    let ordinal = match name {
        "cpu" => return Device::Cpu,
        "cuda" => Some(0),
        other => other.strip_prefix("cuda:").and_then(|n| n.parse().ok()),
    };
    let Some(ordinal) = ordinal else {
        usage(format!("--device `{name}`: cpu, cuda or cuda:N"))
    };
    Device::new_cuda(ordinal).unwrap_or_else(|e| {
        usage(format!(
            "--device {name}: {e} (build with `--features cuda` on a machine with a GPU)"
        ))
    })
}

/// Parses the command line and runs it (the examples' `main`).
///
/// # Errors
/// A failed run (bad input exits with a usage message instead).
pub fn main() -> Result<()> {
    let args = Args::parse();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = args.threads.unwrap_or((cores / 2).max(1));
    if threads == 0 {
        usage("--threads 0: at least one thread");
    }
    if threads > cores {
        // candle's pool threads spin while they wait: past the core count
        // they take the cores from each other (1000 threads on 2 cores ran
        // about 150 times slower)
        usage(format!(
            "--threads {threads}: this machine has {cores} cores; more threads than cores \
             spin against each other and run many times slower: use at most {cores}"
        ));
    }
    // Read by candle when its thread pool starts, before any op runs;
    // nothing else runs yet, so setting the environment is safe here.
    std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    amp::nn::set_flash_attention(!args.no_flash);
    amp::nn::set_native_op_on_cuda(args.native_op);
    amp::nn::set_producer_amax(args.producer_amax);
    amp::nn::set_weight_casts_ahead(args.casts_ahead);
    if args.recipe.is_some()
        && !matches!(
            args.compute,
            None | Some(
                ComputeArg::Fp8Current
                    | ComputeArg::Fp8Delayed
                    | ComputeArg::Fp8Block
                    | ComputeArg::Fp8Rowwise
            )
        )
    {
        usage(
            "--recipe goes with --compute fp8-current (CurrentScaling), fp8-delayed \
             (DelayedScaling), fp8-block (Float8BlockScaling) or fp8-rowwise",
        );
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        usage(format!("--lr {}: must be finite and positive", args.lr));
    }
    let codec = match &args.tokenizer {
        Some(path) => data::codec::Codec::from_file(path)
            .unwrap_or_else(|e| usage(format!("--tokenizer: {e:#}"))),
        None => data::codec::Codec::Bytes,
    };
    let vocab = args
        .vocab
        .unwrap_or_else(|| (codec.vocab_size() as u64).div_ceil(64) * 64);
    if (vocab as usize) < codec.vocab_size() {
        usage(format!(
            "--vocab {vocab} is below the tokenizer's vocabulary of {}: leave --vocab out \
             (it then pads the tokenizer's to a multiple of 64) or raise it",
            codec.vocab_size()
        ));
    }
    if args.init_from.is_none() {
        if let Err(e) = model::Config::named(&args.size, vocab as usize, args.seq as usize) {
            usage(format!("--size: {e}"));
        }
    }
    let corpus = match &args.data {
        Some(path) => data::Corpus::from_path_with(path, &codec)
            .unwrap_or_else(|e| usage(format!("--data: {e:#}"))),
        None => data::Corpus::bundled_with(&codec)
            .unwrap_or_else(|e| usage(format!("--tokenizer: {e:#}"))),
    };
    let gcfg = match (TrainConfig {
        size: args.size.clone(),
        vocab: vocab as usize,
        seq: args.seq as usize,
        init_from: args.init_from.clone(),
        tie_embeddings: args.tie_embeddings,
        ..Default::default()
    })
    .model()
    {
        Ok((g, _)) => g,
        Err(e) => usage(format!("--init-from: {e:#}")),
    };
    if corpus.max_token() as usize >= gcfg.vocab {
        usage(format!(
            "--data holds token {}: the model's vocabulary ({}, --vocab) must exceed it \
             (GPT-2 shards: --vocab 50304)",
            corpus.max_token(),
            gcfg.vocab
        ));
    }
    if args.sample > 0 && !corpus.is_text() && args.tokenizer.is_none() {
        usage(
            "--sample: token shards need the tokenizer they were made with to decode the \
             sample (--tokenizer tokenizer.json)",
        );
    }
    let val_len = corpus.len(data::Split::Val) as u64;
    if args.seq + 1 >= val_len {
        usage(format!(
            "--seq {}: the validation split has only {val_len} tokens",
            args.seq
        ));
    }
    if args.batch % args.world_size != 0 {
        usage(format!(
            "--batch {} does not split over --world-size {}",
            args.batch, args.world_size
        ));
    }
    let levels = if args.compare.is_empty() {
        vec![args.level]
    } else {
        args.compare.clone()
    };
    let base = TrainConfig {
        // the summary's size: the checkpoint's directory when it sets the shape
        size: match &args.init_from {
            Some(dir) => format!("hf:{}", dir.display()),
            None => args.size.clone(),
        },
        vocab: vocab as usize,
        steps: args.steps,
        stop_at: args.stop_at,
        batch: args.batch as usize,
        seq: args.seq as usize,
        lr: args.lr,
        warmup: args.warmup.min(args.steps),
        seed: args.seed,
        eval_every: args.eval_every,
        eval_batches: args.eval_batches as usize,
        high_precision: args.high_precision.clone(),
        device: device(&args.device),
        save: args.save.clone(),
        save_every: args.save_every,
        resume: args.resume.clone(),
        init_from: args.init_from.clone(),
        tie_embeddings: args.tie_embeddings,
        fp8_activation_inputs: args.fp8_activation_inputs,
        loss_chunk_rows: args.loss_chunk_rows,
        export: args.export.clone().map(|p| {
            let dtype = match args.export_dtype {
                ExportArg::F32 => ExportDType::F32,
                ExportArg::Bf16 => ExportDType::BF16,
            };
            (p, dtype)
        }),
        sample: args.sample,
        codec: codec.clone(),
        prompt: args.prompt.clone(),
        progress: !args.json && std::io::stdout().is_terminal(),
        world_size: args.world_size as usize,
        bucket_mb: args.bucket_mb,
        grad_accum: args.grad_accum as usize,
        overlap: !args.no_overlap,
        bf16_wire: args.bf16_wire,
        fp8_one_shot: args.fp8_one_shot,
        embedding_rows: args.embedding_rows,
        lean_step: args.lean_step,
        defer_outcome: !args.sync_outcome,
        fp8_moments: args.fp8_moments,
        recompute: args.recompute,
        telemetry: args.telemetry.map(|n| (n, args.out.clone())),
        timing_skip: args.timing_skip,
        activations: match args.activations {
            ExportArg::F32 => DType::F32,
            ExportArg::Bf16 => DType::BF16,
        },
        event_tracking: args.event_tracking,
        ..Default::default()
    };
    if args.fp8_moments && levels.iter().all(|l| matches!(l, Level::O0 | Level::O1)) {
        usage("--fp8-moments needs O2 or O3: O0 and O1 keep F32 Adam moments");
    }
    if levels.len() > 1 && (base.save.is_some() || base.export.is_some() || base.resume.is_some()) {
        usage("--save, --resume and --export take one run: leave them out of --compare");
    }
    if args.save_every.is_some() && args.save.is_none() {
        usage("--save-every needs --save (the checkpoint to write)");
    }
    check_outputs(&args, levels.len() > 1);
    train::stop_on_signals()?;
    // Started by torchrun (or a loop setting its variables): one rank of an
    // NCCL group, on the GPU LOCAL_RANK names.
    let group = launch::from_env().transpose()?;
    if group.is_some() && args.world_size > 1 {
        usage(
            "--world-size runs ranks as threads: leave it out under torchrun (WORLD_SIZE is set)",
        );
    }
    let rank = group.as_ref().map_or(0, |c| c.rank());
    let mut base = base;
    if !args.no_memory_check {
        let device = group.as_ref().map_or(&base.device, |c| c.device());
        let world = group
            .as_ref()
            .map_or(args.world_size as usize, |c| c.world_size());
        if check_memory(&args, &base, &gcfg, &levels, device, world) && !base.lean_step {
            if rank == 0 {
                eprintln!(
                    "note: the optimizer keeps no second copy of the states (--lean-step), \
                     so that the run fits"
                );
            }
            base.lean_step = true;
        }
    }
    let mut runs = Vec::new();
    for &level in &levels {
        let mut cfg = TrainConfig {
            level,
            compute: compute_for(&args, level),
            progress: base.progress && rank == 0,
            fp8_moments: fp8_moments_for(&args, level),
            ..base.clone()
        };
        let s = match &group {
            Some(comm) => {
                cfg.device = comm.device().clone();
                train::train_rank(&cfg, &corpus, Some(comm.clone()))?
            }
            None => train(&cfg, &corpus)?,
        };
        if rank != 0 {
            continue;
        }
        if args.json {
            println!("{}", serde_json::to_string(&s)?);
        } else {
            print_summary(&s);
        }
        check_trained(&s)?;
        runs.push(s);
    }
    if levels.len() > 1 && rank == 0 {
        std::fs::create_dir_all(&args.out)
            .with_context(|| format!("creating {}", args.out.display()))?;
        let table = report::markdown(&runs);
        std::fs::write(args.out.join("compare.md"), &table)?;
        report::loss_svg(&runs, &args.out.join("loss.svg"))?;
        report::memory_svg(&runs, &args.out.join("memory.svg"))?;
        if !args.json {
            println!("{table}");
            println!(
                "wrote {0}/compare.md, {0}/loss.svg, {0}/memory.svg",
                args.out.display()
            );
        }
    }
    Ok(())
}

/// Share of skipped steps above which a run warns on stderr.
const SKIPPED_WARN: f64 = 0.1;

/// A run that trained nothing is an error (after its summary is printed):
/// every step skipped, or a loss that is no longer finite (the weights
/// diverged). Many skipped steps are a warning.
fn check_trained(s: &train::Summary) -> Result<()> {
    let run = s.steps_run.max(1);
    if s.skipped_steps >= run {
        anyhow::bail!(
            "{} {}: every one of the {run} steps was skipped (non-finite gradients): \
             nothing was trained; lower --lr or check the data",
            s.level,
            s.compute
        );
    }
    if !(s.final_loss.is_finite() && s.val_loss.is_finite()) {
        anyhow::bail!(
            "{} {}: the loss is no longer finite (final {}, validation {}; {} of {run} \
             steps skipped): the weights diverged; lower --lr",
            s.level,
            s.compute,
            s.final_loss,
            s.val_loss,
            s.skipped_steps
        );
    }
    if s.skipped_steps as f64 > SKIPPED_WARN * run as f64 {
        eprintln!(
            "warning: {} {}: {} of {run} steps were skipped (non-finite gradients)",
            s.level, s.compute, s.skipped_steps
        );
    }
    Ok(())
}

/// Exits with a usage error when the memory a run needs
/// ([`budget::estimate`], the most demanding of `levels`) exceeds what
/// `device` has free; `--no-memory-check` skips this. Returns whether the
/// run fits only with the optimizer's lean step (`--lean-step`), which the
/// caller then turns on.
fn check_memory(
    args: &Args,
    base: &TrainConfig,
    g: &model::Config,
    levels: &[Level],
    device: &Device,
    world: usize,
) -> bool {
    let Some(free) = budget::available(device) else {
        return false;
    };
    // each level's run as `train` will make it, on this device
    let worst = |lean: bool| {
        levels
            .iter()
            .map(|&level| {
                let cfg = TrainConfig {
                    level,
                    compute: compute_for(args, level),
                    device: device.clone(),
                    lean_step: lean,
                    fp8_moments: fp8_moments_for(args, level),
                    ..base.clone()
                };
                (level, train::memory_estimate(&cfg, g, world))
            })
            .max_by(|a, b| a.1.total().total_cmp(&b.1.total()))
    };
    let Some((level, e)) = worst(args.lean_step) else {
        return false;
    };
    if e.total() <= free {
        return false;
    }
    if let Some((_, lean)) = worst(true) {
        if lean.total() <= free {
            return true;
        }
    }
    usage(format!(
        "--size {} --batch {} --seq {} at {level} needs about {} (weights and optimizer \
         state {}, and the larger of activations {} with logits {}, or the optimizer \
         step's {}), and {} has {} free: lower --batch or --seq, try --recompute full, \
         or pass --no-memory-check to try anyway",
        args.size,
        args.batch,
        args.seq,
        budget::gib(e.total()),
        budget::gib(e.persistent),
        budget::gib(e.activations),
        budget::gib(e.logits),
        budget::gib(e.optimizer),
        device_label(device),
        budget::gib(free),
    ));
}

/// "the CPU" or "cuda:N", for messages.
fn device_label(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "the CPU".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        other => format!("{other:?}"),
    }
}

/// The output paths, checked before any training: the export never
/// replaces the checkpoint written or resumed in the same run, and every
/// file goes into an existing directory this process can write in (an
/// error after the run would lose its work and its summary).
fn check_outputs(args: &Args, compare: bool) {
    if let Some(export) = &args.export {
        for (flag, other) in [("--save", &args.save), ("--resume", &args.resume)] {
            if other.as_ref().is_some_and(|p| same_file(p, export)) {
                usage(format!(
                    "--export {} is the checkpoint of {flag}: the export would replace it; \
                     give the export another path",
                    export.display()
                ));
            }
        }
    }
    if let Some(export) = &args.export {
        if export.exists() && !export.is_dir() {
            usage(format!(
                "--export {}: a file; the export is a directory (model.safetensors, config.json)",
                export.display()
            ));
        }
    }
    for (flag, path) in [("--save", &args.save), ("--export", &args.export)] {
        if let Some(path) = path {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => std::path::Path::new("."),
            };
            if let Err(e) = writable_dir(dir) {
                usage(format!("{flag} {}: {e}", path.display()));
            }
        }
    }
    if compare {
        if let Err(e) = std::fs::create_dir_all(&args.out)
            .map_err(|e| format!("cannot create it: {e}"))
            .and_then(|()| writable_dir(&args.out))
        {
            usage(format!("--out {}: {e}", args.out.display()));
        }
    }
}

/// Whether two paths name one file (the file need not exist yet: its
/// directory is resolved, links and `..` included).
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    fn resolved(p: &std::path::Path) -> Option<PathBuf> {
        let abs = std::path::absolute(p).ok()?;
        match (abs.parent().map(std::fs::canonicalize), abs.file_name()) {
            (Some(Ok(dir)), Some(name)) => Some(dir.join(name)),
            _ => Some(abs),
        }
    }
    match (resolved(a), resolved(b)) {
        (Some(a), Some(b)) => a == b,
        _ => a == b,
    }
}

/// `Ok` if `dir` is an existing directory a file can be created in (tried
/// with a probe file, removed at once), else why not.
fn writable_dir(dir: &std::path::Path) -> std::result::Result<(), String> {
    if !dir.is_dir() {
        return Err(format!("{} is not an existing directory", dir.display()));
    }
    let probe = dir.join(format!(
        ".{}-write-probe.{}",
        model::BIN,
        std::process::id()
    ));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            // best effort: a probe left behind is an empty hidden file
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(format!("cannot write in {}: {e}", dir.display())),
    }
}

fn print_summary(s: &train::Summary) {
    println!(
        "{} {} {} ({} params, {} steps of {}x{} tokens on {}):",
        s.level, s.compute, s.size, s.params, s.steps, s.batch, s.seq, s.device
    );
    println!(
        "  loss {:.4} -> {:.4}, validation {:.4}, {:.0} tokens/s, {} skipped, {:.1} s",
        s.first_loss, s.final_loss, s.val_loss, s.tokens_per_s, s.skipped_steps, s.wall_s
    );
    if let Some(m) = &s.memory {
        println!("  {}", m.to_string().replace('\n', "\n  "));
    }
    if let Some(text) = &s.sample {
        println!("  sample:\n{text}\n");
    }
}
